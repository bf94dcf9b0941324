"""The end of a kept claim reaches its holder through the change feed (issue 43).

Real node on loopback, the real ``fencemark.mcp`` server, the ``mcp`` SDK's client.
Every lease here is long (60 s: the keepalive's first renewal is 20 s away), so a
hold that ends within seconds was ended by what the server's feed of the topic
showed, never by a renewal of its own (``renewals`` stays 0). Where the feed must
lag behind the home, the MCP server reads the node's feed through a fault proxy
held shut (``FaultProxy.blackhole``) while its claims, renewals and releases go to
the home directly (``regions``): the feed's changes then arrive after what the test
did meanwhile, in their order, and nothing is lost. Every wait is for a condition,
bounded by ``eventually``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp import Client
from mcp_types import LoggingMessageNotificationParams, TextResourceContents

from fencemark.client import AsyncClient
from fencemark.mcp import open_server
from fencemark.node.api.server import NodeServer
from fencemark.node.tools.proxy import FaultProxy
from tests.cluster import eventually
from tests.test_mcp import call
from tests.test_mcp_feed import subscribe
from tests.test_mcp_walkthrough import expect_ok

REPO, TOPIC = "kept", "fed"
CHANGES = f"fencemark://{REPO}/{TOPIC}/changes"
LEASE_S = 60.0  # the first renewal is 20 s away: only the feed ends a hold sooner
SOON = 10.0  # bound of a wait the feed answers in well under a second


def keep(key: str, owner: str = "worker-a") -> dict[str, Any]:
    return {"key": key, "owner": owner, "leaseSeconds": LEASE_S, "keepAlive": True}


async def item(client: AsyncClient, id_: str) -> str:
    return (await client.remember(REPO, TOPIC, id_, title=id_)).record.key


async def kept_of(tools: Client, key: str) -> dict[str, Any]:
    status = expect_ok(await call(tools, "repocontext_claim_status", key=key))
    kept: dict[str, Any] = status["keepAlive"]
    return kept


class Shown:
    """The (kind, fence) of every change of the topic the server's feed has shown a
    session, read from the resource (each read gives what came since the last)."""

    def __init__(self, tools: Client) -> None:
        self.tools = tools
        self.changes: list[tuple[str, int]] = []

    async def read(self) -> list[tuple[str, int]]:
        read = await self.tools.read_resource(CHANGES)
        content = read.contents[0]
        assert isinstance(content, TextResourceContents)
        self.changes += [(e["kind"], e["fence"]) for e in json.loads(content.text)["events"]]
        return self.changes


@contextlib.asynccontextmanager
async def lagging(node: NodeServer) -> AsyncIterator[tuple[Client, FaultProxy]]:
    """A session whose server reads the node's feed through a proxy the test can hold
    shut; its claims, renewals and releases go to the home (``regions``) directly."""
    async with await FaultProxy.start(node.address, name="feed") as feed:
        regions = {node.config.region: node.address}
        async with AsyncClient(feed.address, regions=regions) as fencemark:
            server = await open_server(fencemark)
            async with Client(server, mode="legacy") as tools:
                yield tools, feed


@pytest.mark.parametrize(
    ("how", "reason"),
    [("release", "released"), ("done", "released"), ("take back", "superseded")],
)
async def test_a_claim_ended_by_another_session_ends_the_hold_at_once(
    node: NodeServer, client: AsyncClient, how: str, reason: str
) -> None:
    """Two sessions of one identity on one server: B ends A's kept claim with A's token
    (or an operator takes it back); A's next result about the key says so."""
    logged: list[LoggingMessageNotificationParams] = []

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        logged.append(params)

    key = await item(client, f"ended-by-{how.replace(' ', '-')}")
    async with AsyncClient(node.address) as fencemark:
        server = await open_server(fencemark)
        async with (
            Client(server, mode="legacy", logging_callback=on_log) as a,
            Client(server, mode="legacy") as b,
        ):
            granted = expect_ok(await call(a, "repocontext_claim", **keep(key)))
            token = granted["fencingToken"]
            assert granted["keepAlive"]["state"] == "holding"
            if how == "take back":
                await client.force_release(key, "the operator takes it back")
            else:
                outcome = {"outcome": "done"} if how == "done" else {}
                released = expect_ok(
                    await call(
                        b, "repocontext_release_claim", key=key, fencingToken=token, **outcome
                    )
                )
                assert released["released"] is True
                assert "keepAlive" not in released  # B kept nothing: nothing of B's stopped

            async def ended() -> bool:
                return bool((await kept_of(a, key))["state"] != "holding")

            async def explain() -> str:
                shown = await Shown(a).read()
                return f"A's keepAlive is {await kept_of(a, key)}; the feed showed {shown}"

            await eventually(ended, "A's hold ended by the feed", within=SOON, explain=explain)
            kept = await kept_of(a, key)
            refused = await call(
                a, "repocontext_renew_claim", key=key, fencingToken=token, leaseSeconds=LEASE_S
            )
    assert kept == {
        "fencingToken": token, "state": "lost", "reason": reason,
        "leaseSeconds": LEASE_S, "renewals": 0,
    }  # fmt: skip
    assert expect_ok(refused)["renewed"] is False and refused.structured["reason"] == reason
    assert [entry.data["reason"] for entry in logged if isinstance(entry.data, dict)] == [reason]


async def test_an_older_tokens_release_arriving_late_leaves_the_newer_hold(
    node: NodeServer, client: AsyncClient
) -> None:
    """A re-claims the key while the feed lags: the release of A's first token comes
    through after A's hold of the second began, and says nothing of it."""
    key = await item(client, "reclaimed")
    async with lagging(node) as (tools, feed):
        first = expect_ok(await call(tools, "repocontext_claim", **keep(key)))["fencingToken"]
        feed.blackhole()
        await client.release_claim(key, first)  # the same identity, the right token
        second = expect_ok(await call(tools, "repocontext_claim", **keep(key)))
        token = second["fencingToken"]
        assert token > first and second["keepAlive"]["state"] == "holding"
        feed.heal()
        shown = Shown(tools)

        async def through() -> bool:
            return ("claimed", token) in await shown.read()

        await eventually(through, "the feed's late changes shown", within=SOON)
        seen = shown.changes
        kept = await kept_of(tools, key)
    assert seen.index(("released", first)) < seen.index(("claimed", token))
    assert kept == {
        "fencingToken": token, "state": "holding", "leaseSeconds": LEASE_S, "renewals": 0
    }  # fmt: skip


async def test_a_grant_that_records_its_predecessors_lapse_is_asked_of_the_home(
    node: NodeServer, client: AsyncClient
) -> None:
    """The grant of A's token also records the lapse of the token before (the home's
    lapse watcher is stopped, so the grant is what records it): the feed's word for
    that commit is ``lapsed``, at A's own fence. The server asks the home (a renewal,
    in the key's history) instead of taking the word for A's loss."""
    await node.lapses.stop()
    key = await item(client, "lapsed-before")
    before = await client.claim(key, "worker-z", lease_seconds=1)

    async def ran_out() -> bool:
        return (await client.claim_status(key)).claim is None

    await eventually(ran_out, "the first lease ran out")
    async with lagging(node) as (tools, feed):
        await subscribe(tools, CHANGES)  # the server follows the topic from now
        expect_ok(await call(tools, "repocontext_recall", key=key))  # learns the key's home
        feed.blackhole()
        granted = expect_ok(await call(tools, "repocontext_claim", **keep(key)))
        token = granted["fencingToken"]
        feed.heal()

        async def asked() -> bool:
            events = (await client.history(key)).events
            return any(e.kind == "renewed" and e.fencing_token == token for e in events)

        await eventually(asked, "the home asked whether the claim still holds", within=SOON)
        seen = await Shown(tools).read()
        kept = await kept_of(tools, key)
    kinds = [(e.kind, e.fencing_token) for e in (await client.history(key)).events]
    assert kinds[:3] == [("granted", before.fencing_token), ("lapsed", before.fencing_token),
                         ("granted", token)]  # fmt: skip
    assert ("lapsed", token) in seen
    assert kept == {
        "fencingToken": token, "state": "holding", "leaseSeconds": LEASE_S, "renewals": 0
    }  # fmt: skip
