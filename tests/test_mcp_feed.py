"""The change feed through MCP (issue 18): waiting for work without polling
(``repocontext_wait_for_work``) and a topic's changes as a resource one subscribes to.

Real nodes on loopback, the real ``fencemark.mcp`` server, the ``mcp`` SDK's own
client on both protocol eras: ``legacy`` (the initialize handshake, sessions,
``resources/subscribe``) and ``auto`` (2026-07-28 in memory: ``subscriptions/listen``).
What the node sees is read from its own counters: its ``ClaimNext`` calls (no
polling) and its ``Watch`` streams (none left open). Keepalive is in
``test_mcp_keepalive.py``; the Inspector's view in ``test_mcp_inspector.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPDeprecationWarning, MCPError
from mcp_types import ResourceUpdatedNotification, TextResourceContents

from fencemark.client import AsyncClient
from fencemark.mcp import create_server, open_server
from fencemark.node.api.server import NodeServer
from tests.cluster import Cluster, eventually
from tests.metrics import counters, gauges
from tests.test_mcp import call
from tests.test_mcp_walkthrough import expect_ok, outcome_of

REPO = "feed"
WITHIN = 15.0


def calls_of(node: NodeServer, method: str) -> float:
    """How many ``method`` calls the node has finished (streams: ended)."""
    done = counters(node, "fencemark_requests", "method", "code")
    return sum(count for (name, _), count in done.items() if name == method)


def waiting_in_line(node: NodeServer) -> float:
    """Callers waiting in the node's claim lines (``ClaimNext`` with a wait among them)."""
    return gauges(node, "fencemark_claim_waiters").get((), 0.0)


def reads_in_flight(node: NodeServer) -> float:
    """Read-class calls the node serves now: open ``Watch`` streams, when idle."""
    return gauges(node, "fencemark_rpcs_in_flight", "class").get(("read",), 0.0)


async def no_stream_left(node: NodeServer, *, ended: float) -> None:
    """The node has ended ``ended`` Watch streams in all and serves none."""

    async def closed() -> bool:
        return calls_of(node, "Watch") >= ended and reads_in_flight(node) == 0

    async def explain() -> str:
        return f"{calls_of(node, 'Watch')} streams ended, {reads_in_flight(node)} reads open"

    await eventually(closed, "every Watch stream ended at the node", explain=explain)


@contextlib.asynccontextmanager
async def tools_at(node: NodeServer, mode: str = "legacy", **options: Any) -> AsyncIterator[Client]:
    async with AsyncClient(node.address) as fencemark:
        server = await open_server(fencemark)
        async with Client(server, mode=mode, **options) as client:
            yield client


async def subscribe(client: Client, uri: str) -> None:
    with warnings.catch_warnings():  # deprecated only for 2026-07-28, which has listen
        warnings.simplefilter("ignore", MCPDeprecationWarning)
        await client.subscribe_resource(uri)


async def unsubscribe(client: Client, uri: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MCPDeprecationWarning)
        await client.unsubscribe_resource(uri)


async def read(client: Client, uri: str) -> dict[str, Any]:
    contents = (await client.read_resource(uri)).contents
    assert len(contents) == 1 and isinstance(contents[0], TextResourceContents)
    assert contents[0].mime_type == "application/json"
    found: dict[str, Any] = json.loads(contents[0].text)
    return found


def wait_args(topic: str, owner: str = "worker-a", **extra: Any) -> dict[str, Any]:
    return {"repoId": REPO, "topic": topic, "owner": owner, "leaseSeconds": 60, **extra}


# -- waiting for work ---------------------------------------------------------------------


async def test_waiting_for_work_answers_empty_as_a_value_once_the_time_is_up(
    node: NodeServer,
) -> None:
    async with tools_at(node) as client:
        now = expect_ok(
            await call(client, "repocontext_wait_for_work", **wait_args("none", timeoutSeconds=0))
        )
        later = expect_ok(
            await call(client, "repocontext_wait_for_work", **wait_args("none", timeoutSeconds=1))
        )
    assert now == later == {"granted": False, "reason": "empty"}


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_wait_claims_the_item_that_comes_and_says_it_is_waiting(
    node: NodeServer, client: AsyncClient, mode: str
) -> None:
    """It waits in the node's line: a few ClaimNext calls however long it waits."""
    reports: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        reports.append((progress, total, message))

    async with tools_at(node, mode) as tools:
        before = calls_of(node, "ClaimNext")
        waiting = asyncio.create_task(
            tools.call_tool(
                "repocontext_wait_for_work",
                wait_args(f"comes-{mode}", timeoutSeconds=60),
                progress_callback=on_progress,
            )
        )

        async def in_line() -> bool:
            return bool(reports) and waiting_in_line(node) == 1

        await eventually(in_line, "the wait reported progress and waits in the node's line")
        made = await client.remember(REPO, f"comes-{mode}", "item-1", title="Arrives later")
        async with asyncio.timeout(WITHIN):
            got = expect_ok(outcome_of(await waiting))
    assert got["granted"] is True and got["record"]["key"] == made.record.key
    assert calls_of(node, "ClaimNext") - before == 2  # it looked, then waited and was handed it
    done, total, message = reports[0]
    assert (total, message) == (60.0, f"waiting for an eligible item of {REPO}/comes-{mode}")
    assert 0 <= done <= 60


async def test_a_wait_takes_an_item_of_another_region_when_the_feed_says_it_came(
    tmp_path: Path,
) -> None:
    """The server in us waits in us's line: an item created in eu (replicated to us)
    makes us tell it of the item (it is the first waiter the item suits), and it
    claims the item at eu — no watch of the topic, no look at every region (issue 36)."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        await cluster.start_all()
        regions = dict(cluster.addresses)
        async with (
            AsyncClient(regions["us"], regions=regions) as fencemark,
            AsyncClient(regions["eu"]) as eu,
        ):
            await eventually(lambda: _serving(fencemark, eu), "every node serving claims")
            server = create_server(fencemark, writes_enabled=True)
            async with Client(server, mode="legacy") as tools:
                waiting = asyncio.create_task(
                    tools.call_tool(
                        "repocontext_wait_for_work", wait_args("far", timeoutSeconds=60)
                    )
                )
                await eventually(lambda: _in_line(cluster["us"]), "the wait in us's line")
                made = await eu.remember(REPO, "far", "eu-item", tags=["homeRegion:eu"])
                async with asyncio.timeout(WITHIN):
                    got = expect_ok(outcome_of(await waiting))
            assert (got["granted"], got["record"]["key"]) == (True, made.record.key)
            assert got["record"]["homeRegion"] == "eu"
            # It looked in us and eu, waited in us's line until us told it of eu's
            # item, and asked eu for it: two calls at each, and no watch.
            assert calls_of(cluster["us"], "ClaimNext") == 2
            assert calls_of(cluster["eu"], "ClaimNext") == 2
            assert cluster["us"].work.hints == 1
            await no_stream_left(cluster["us"], ended=0)


async def _serving(*clients: AsyncClient) -> bool:
    return all([(await client.info()).claims_serving for client in clients])


async def _in_line(node: NodeServer) -> bool:
    return waiting_in_line(node) == 1


async def test_a_wait_names_the_argument_the_node_refuses(tmp_path: Path) -> None:
    """With other regions, a bad repoId is refused by the first region asked."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        await cluster.start_all()
        regions = dict(cluster.addresses)
        async with AsyncClient(regions["us"], regions=regions) as fencemark:
            server = create_server(fencemark, writes_enabled=True)
            async with Client(server, mode="legacy") as tools:
                bad = await call(
                    tools,
                    "repocontext_wait_for_work",
                    **{**wait_args("t", timeoutSeconds=5), "repoId": "bad repo"},
                )
    assert bad.is_error and bad.text.startswith("Invalid arguments for repocontext_wait_for_work")
    assert "repoId: must match" in bad.text


# -- a topic's changes ----------------------------------------------------------------------


async def test_the_changes_of_a_topic_are_a_resource_template(node: NodeServer) -> None:
    async with tools_at(node) as client:
        templates = (await client.list_resource_templates()).resource_templates
        capabilities = client.server_capabilities.resources
        unfollowed = await read(client, "fencemark://feed/quiet/changes")
    assert [t.uri_template for t in templates] == ["fencemark://{repo}/{topic}/changes"]
    assert capabilities is not None and capabilities.subscribe is True
    assert unfollowed == {
        "uri": "fencemark://feed/quiet/changes", "repoId": "feed", "topic": "quiet",
        "following": False, "events": [], "missed": 0,
    }  # fmt: skip


async def test_a_subscriber_is_told_of_each_change_and_reads_what_changed_since(
    node: NodeServer, client: AsyncClient
) -> None:
    uri = "fencemark://feed/told/changes"
    updates: list[str] = []

    async def on_message(message: object) -> None:
        if isinstance(message, ResourceUpdatedNotification):
            updates.append(message.params.uri)

    async with tools_at(node, message_handler=on_message) as tools:
        await subscribe(tools, uri)
        made = await client.remember(REPO, "told", "a", title="A")
        claim = await client.claim(made.record.key, "worker-a", lease_seconds=60)
        await client.release_claim(made.record.key, claim.fencing_token, outcome="done")
        await client.remember(REPO, "elsewhere", "b")  # another topic: not this resource
        await eventually(lambda: _at_least(updates, 3), "a notification per change")
        first = await read(tools, uri)
        again = await read(tools, uri)
    assert set(updates) == {uri}
    assert first["following"] is True and first["missed"] == 0
    assert [(e["kind"], e["id"]) for e in first["events"]] == [
        ("created", "a"), ("claimed", "a"), ("done", "a"),
    ]  # fmt: skip
    assert first["events"][-1]["status"] == "done"
    assert again["events"] == []  # nothing since the last read
    # A change's cursor resumes the node's own feed right after it.
    resumed = client.watch(REPO, cursor=first["events"][0]["cursor"])
    async with asyncio.timeout(WITHIN):
        after = await anext(resumed)
    await resumed.aclose()
    assert (after.kind, after.cursor) == ("claimed", first["events"][1]["cursor"])
    await no_stream_left(node, ended=2)  # the session's, and this test's own


async def _at_least(items: list[str], count: int) -> bool:
    return len(items) >= count


async def test_one_stream_per_topic_ends_with_its_last_subscriber(node: NodeServer) -> None:
    uri = "fencemark://feed/shared/changes"
    async with AsyncClient(node.address) as fencemark:
        server = await open_server(fencemark)
        async with Client(server, mode="legacy") as one, Client(server, mode="legacy") as two:
            await shared_by(node, uri, one, two)


async def shared_by(node: NodeServer, uri: str, one: Client, two: Client) -> None:
    """Two sessions of one server subscribe to the same topic."""
    await subscribe(one, uri)
    await subscribe(two, uri)
    await subscribe(two, uri)  # again: still one subscription
    assert reads_in_flight(node) == 1  # one Watch at the node for both
    await unsubscribe(one, uri)
    assert (await read(two, uri))["following"] is True
    await unsubscribe(two, uri)
    await no_stream_left(node, ended=1)
    assert (await read(two, uri))["following"] is False


async def test_a_closed_session_ends_every_stream_it_started(node: NodeServer) -> None:
    async with tools_at(node) as tools:
        for topic in ("one", "two", "three"):
            await subscribe(tools, f"fencemark://feed/{topic}/changes")
        assert reads_in_flight(node) == 3
    await no_stream_left(node, ended=3)


async def test_a_listen_stream_follows_the_topic_while_it_lasts(
    node: NodeServer, client: AsyncClient
) -> None:
    """2026-07-28: subscriptions/listen names the resource; its end ends the Watch."""
    uri = "fencemark://feed/listened/changes"
    async with tools_at(node, "auto") as tools:
        async with tools.listen(resource_subscriptions=[uri]) as events:
            assert reads_in_flight(node) == 1
            await client.remember(REPO, "listened", "a")
            async with asyncio.timeout(WITHIN):
                event = await anext(aiter(events))
            content = await read(tools, uri)
        assert getattr(event, "uri", None) == uri
        assert [(e["kind"], e["id"]) for e in content["events"]] == [("created", "a")]
        await no_stream_left(node, ended=1)


@pytest.mark.parametrize(
    ("uri", "reason", "says"),
    [
        ("fencemark://feed/t/other", "unknown_resource", "No such resource"),
        ("fencemark://bad!repo/t/changes", "invalid_argument", "repoId: must match"),
    ],
)
async def test_a_subscription_the_server_cannot_follow_is_refused_with_its_reason(
    node: NodeServer, uri: str, reason: str, says: str
) -> None:
    async with tools_at(node) as tools:
        with pytest.raises(MCPError) as refused:
            await subscribe(tools, uri)
    assert says in refused.value.message
    data = refused.value.data
    assert isinstance(data, dict) and (data["uri"], data["reason"]) == (uri, reason)
    await no_stream_left(node, ended=calls_of(node, "Watch"))


async def test_reading_a_resource_with_a_bad_name_is_refused_naming_it(node: NodeServer) -> None:
    async with tools_at(node) as tools:
        with pytest.raises(MCPError) as refused:
            await read(tools, "fencemark://feed/bad!topic/changes")
    assert "topic: must match [A-Za-z0-9._:-]{1,128}, got 'bad!topic'" in refused.value.message
    assert refused.value.data == {
        "uri": "fencemark://feed/bad!topic/changes", "reason": "invalid_argument",
        "argument": "topic",
    }  # fmt: skip
