"""Claims kept alive for as long as the MCP session lasts (issue 18, ``keepAlive``).

Real node on loopback, the real ``fencemark.mcp`` server, the ``mcp`` SDK's client.
A claim with a 2 s lease kept alive outlives its lease while the session lives, and
lapses at its lease end once the session is gone (it is not released); a take-back
is told in the next result about the key and in a log message; releasing stops the
keepalive first; a connection without a session is refused ``keepAlive``. Every
wait is for a condition, bounded by ``eventually``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from mcp import Client
from mcp_types import LoggingMessageNotificationParams

from fencemark.client import AsyncClient
from fencemark.mcp import create_server, open_server
from fencemark.node.api.server import NodeServer
from tests.cluster import eventually
from tests.test_mcp import call, http_server
from tests.test_mcp_walkthrough import expect_conflict, expect_ok

REPO, TOPIC = "kept", "alive"
LEASE_S = 2.0
OUTLIVED = timedelta(seconds=2 * LEASE_S)  # how far past its first lease end it must live


@contextlib.asynccontextmanager
async def session(node: NodeServer, mode: str = "legacy", **options: Any) -> AsyncIterator[Client]:
    async with AsyncClient(node.address) as fencemark:
        server = await open_server(fencemark)
        async with Client(server, mode=mode, **options) as client:
            yield client


async def item(client: AsyncClient, id_: str) -> str:
    return (await client.remember(REPO, TOPIC, id_, title=id_)).record.key


def keep(key: str, owner: str = "worker-a") -> dict[str, Any]:
    return {"key": key, "owner": owner, "leaseSeconds": LEASE_S, "keepAlive": True}


async def outlives_its_lease(client: AsyncClient, key: str, token: int, first: str) -> None:
    """The same claim is live well after the lease it was granted with ended."""
    past = datetime.fromisoformat(first) + OUTLIVED

    async def alive_past_it() -> bool:
        claim = (await client.claim_status(key)).claim
        live = claim is not None and claim.fencing_token == token
        return live and datetime.now(UTC) > past

    async def explain() -> str:
        events = [(e.kind, e.fencing_token) for e in (await client.history(key)).events]
        return f"the claim is {(await client.claim_status(key)).claim}; history {events}"

    await eventually(
        alive_past_it, "the kept claim alive past its lease", within=20, explain=explain
    )


async def lapsed(client: AsyncClient, key: str) -> None:
    """No live claim, and the home has recorded the lapse (its LapseWatcher)."""

    async def recorded() -> bool:
        events = (await client.history(key)).events
        return (await client.claim_status(key)).claim is None and events[-1].kind == "lapsed"

    async def explain() -> str:
        events = [(e.kind, e.fencing_token) for e in (await client.history(key)).events]
        return f"the claim is {(await client.claim_status(key)).claim}; history {events}"

    await eventually(recorded, "the claim lapsed at its lease end", explain=explain)


@pytest.mark.slow  # waits through several leases
@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_kept_claim_outlives_its_lease_while_the_session_lives_then_lapses(
    node: NodeServer, client: AsyncClient, mode: str
) -> None:
    """``auto`` is 2026-07-28 in memory: the stream is the session (the lifespan)."""
    key = await item(client, f"outlives-{mode}")
    async with session(node, mode) as tools:
        granted = expect_ok(await call(tools, "repocontext_claim", **keep(key)))
        assert granted["granted"] is True
        token = granted["fencingToken"]
        assert granted["keepAlive"] == {
            "fencingToken": token, "state": "holding", "leaseSeconds": LEASE_S, "renewals": 0
        }  # fmt: skip
        await outlives_its_lease(client, key, token, granted["leaseExpiresAtUtc"])
        status = expect_ok(await call(tools, "repocontext_claim_status", key=key))
        assert status["keepAlive"]["state"] == "holding"
        assert status["keepAlive"]["renewals"] >= 3
    await lapsed(client, key)
    kinds = [event.kind for event in (await client.history(key)).events]
    assert kinds[0] == "granted" and kinds[-1] == "lapsed" and "released" not in kinds
    record = await client.get(key)
    assert (record.last_outcome, record.status) == ("lapsed", "open")


async def test_a_take_back_is_told_in_the_next_result_and_in_a_log_message(
    node: NodeServer, client: AsyncClient
) -> None:
    logged: list[LoggingMessageNotificationParams] = []

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        logged.append(params)

    key = await item(client, "taken-back")
    async with session(node, logging_callback=on_log) as tools:
        granted = expect_ok(await call(tools, "repocontext_claim", **keep(key)))
        token = granted["fencingToken"]
        await client.force_release(key, "the operator takes it back")

        async def told() -> bool:
            return bool(logged)

        await eventually(told, "a log message of the loss")
        status = expect_ok(await call(tools, "repocontext_claim_status", key=key))
        refused = await call(tools, "repocontext_update", key=key, fields={"x": "1"},
                             fencingToken=token)  # fmt: skip
    assert logged[0].level == "warning" and logged[0].logger == "fencemark.keepalive"
    assert isinstance(logged[0].data, dict)
    assert {k: logged[0].data[k] for k in ("event", "key", "fencingToken", "reason")} == {
        "event": "claimLost", "key": key, "fencingToken": token, "reason": "superseded",
    }  # fmt: skip
    lost = {"fencingToken": token, "state": "lost", "reason": "superseded"}
    assert lost.items() <= status["keepAlive"].items()
    assert "claim" not in status  # no live claim: the fence moved past it
    expect_conflict(refused, "superseded", status["fence"])
    assert lost.items() <= refused.structured["keepAlive"].items()
    assert f"keepAlive of token {token}: lost (superseded)." in refused.text
    assert len(logged) == 1


async def test_releasing_stops_the_keepalive_first_and_tells_no_loss(
    node: NodeServer, client: AsyncClient
) -> None:
    logged: list[LoggingMessageNotificationParams] = []

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        logged.append(params)

    await item(client, "finished")
    async with session(node, logging_callback=on_log) as tools:
        picked = expect_ok(
            await call(
                tools, "repocontext_claim_next", repoId=REPO, topic=TOPIC, owner="worker-a",
                leaseSeconds=LEASE_S, keepAlive=True,
            )
        )  # fmt: skip
        key, token = picked["record"]["key"], picked["fencingToken"]
        assert picked["keepAlive"]["state"] == "holding"
        released = expect_ok(
            await call(
                tools, "repocontext_release_claim", key=key, fencingToken=token,
                outcome="done", fields={"result": "ok"},
            )
        )  # fmt: skip
        status = expect_ok(await call(tools, "repocontext_claim_status", key=key))
    assert released["released"] is True
    assert released["keepAlive"]["state"] == "stopped"
    assert "keepAlive" not in status  # nothing kept for the key any more
    assert logged == []
    assert (await client.get(key)).status == "done"


async def test_keep_alive_is_refused_where_there_is_no_session(client: AsyncClient) -> None:
    """Called outside any request (no session): refused by name, nothing claimed."""
    key = await item(client, "no-session")
    server = create_server(client, writes_enabled=True)
    result = await server.call_tool("repocontext_claim", keep(key))
    assert getattr(result, "is_error", False)
    text = result.content[0].text  # type: ignore[union-attr]
    assert text.startswith("Invalid arguments for repocontext_claim: keepAlive: ")
    assert (await client.claim_status(key)).claim is None


@pytest.mark.slow
async def test_over_http_a_handshake_session_keeps_and_a_stateless_one_is_refused(
    node: NodeServer, client: AsyncClient
) -> None:
    """Streamable HTTP: the handshake era has sessions (ended by the client's leaving);
    2026-07-28 requests share none, so keepAlive is refused there."""
    kept, refused_key = await item(client, "http-kept"), await item(client, "http-refused")
    async with http_server(node.address) as url:
        async with Client(url, mode="legacy") as tools:
            granted = expect_ok(await call(tools, "repocontext_claim", **keep(kept)))
            token = granted["fencingToken"]
            await outlives_its_lease(client, kept, token, granted["leaseExpiresAtUtc"])
        await lapsed(client, kept)
        async with Client(url) as stateless:
            assert stateless.protocol_version == "2026-07-28"
            refused = await call(stateless, "repocontext_claim", **keep(refused_key))
    assert refused.is_error and "keepAlive: this connection has no MCP session" in refused.text
    assert (await client.claim_status(refused_key)).claim is None
