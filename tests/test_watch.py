"""SPEC §9, the change feed: ``Records.Watch`` over gRPC against real nodes and their
SQLite files — kinds in commit order, filters, resuming from a cursor across
disconnects and restarts with nothing skipped or repeated, cursors the node can no
longer resume refused ``CURSOR_EXPIRED``, and a slow watcher cut off while writes
go on (test_watch_slow.py).

Every wait is bounded: watchers stop after the events a test expects, within
``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fencemark.client import (
    AsyncClient,
    Client,
    CursorExpired,
    InvalidArgument,
    WatchEvent,
)
from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import Record, Stamp
from fencemark.node.crdt.hlc import pack
from fencemark.node.rules import changes
from fencemark.v1 import records_pb2, records_pb2_grpc
from tests.cluster import Cluster, all_deciding, eventually
from tests.conftest import StartNode
from tests.test_cli import fencemark

REPO, TOPIC = "feed", "work"
WITHIN = 10.0


async def take(events: AsyncIterator[WatchEvent], count: int) -> list[WatchEvent]:
    """The next ``count`` events, within WITHIN seconds."""
    got: list[WatchEvent] = []
    async with asyncio.timeout(WITHIN):
        async for event in events:
            got.append(event)
            if len(got) == count:
                break
    return got


def key_of(id_: str, topic: str = TOPIC) -> str:
    return f"repo/{REPO}/mem/{topic}/{id_}"


async def started(client: AsyncClient, **filters: object) -> AsyncIterator[WatchEvent]:
    """A watch whose stream is open (its start is fixed) before the caller writes."""
    events = client.watch(REPO, **filters)  # type: ignore[arg-type]
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.2)  # the stream is open and waiting for the first change

    async def rest() -> AsyncIterator[WatchEvent]:
        yield await first
        async for event in events:
            yield event

    return rest()


# -- what the feed says ------------------------------------------------------------------


async def test_each_change_is_one_event_in_commit_order_with_its_kind(
    start_node: StartNode,
) -> None:
    node = await start_node(max_attempts=2)
    async with AsyncClient(node.address) as client:
        events = await started(client, topic=TOPIC)
        made = await client.remember(REPO, TOPIC, "a", title="a", tags=["maxAttempts:1"])
        key = made.record.key
        await client.update(key, fields={"body": "b"})
        claim = await client.claim(key, "w", lease_seconds=30)
        await client.renew_claim(key, claim.fencing_token, lease_seconds=30)
        await client.release_claim(key, claim.fencing_token)
        claim = await client.claim(key, "w", lease_seconds=30)
        await client.release_claim(key, claim.fencing_token, outcome="deferred")
        claim = await client.claim(key, "w", lease_seconds=30)
        await client.release_claim(key, claim.fencing_token, outcome="failed")  # parks
        await client.reopen(key, "try again")
        claim = await client.claim(key, "w", lease_seconds=30)
        await client.release_claim(key, claim.fencing_token, outcome="done")
        await client.remember(REPO, "elsewhere", "x", title="x")  # another topic: not seen
        await client.delete(key)
        got = await take(events, 13)
    assert [e.kind for e in got] == [
        "created", "updated", "claimed", "updated", "released", "claimed", "deferred",
        "claimed", "parked", "reopened", "claimed", "done", "deleted",
    ]  # fmt: skip
    assert {e.key for e in got} == {key}
    assert got[1].record.fields["body"] == "b"  # the record as that change left it
    assert got[-1].record.deleted
    cursors = [int(e.cursor.rpartition(".")[2]) for e in got]
    assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors)
    assert all(e.committed_at is not None for e in got)


async def test_a_watch_sees_only_records_with_every_tag_asked_for(node: NodeServer) -> None:
    async with AsyncClient(node.address) as client:
        events = await started(client, tags=["team:a", "urgent"])
        await client.remember(REPO, TOPIC, "only-a", tags=["team:a"])
        await client.remember(REPO, TOPIC, "both", tags=["team:a", "urgent"])
        await client.remember(REPO, "other", "both-too", tags=["team:a", "urgent"])
        got = await take(events, 2)
    assert [e.key for e in got] == [key_of("both"), key_of("both-too", "other")]


async def test_changes_merged_from_a_peer_are_fed_like_local_ones(tmp_path: Path) -> None:
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us")
        eu = await cluster.start("eu")
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as at_us, AsyncClient(eu.address) as at_eu:
            events = await started(at_us, topic=TOPIC)
            await at_eu.remember(REPO, TOPIC, "from-eu", tags=["homeRegion:eu"])
            (event,) = await take(events, 1)
    assert (event.kind, event.key, event.record.home_region) == (
        "created",
        key_of("from-eu"),
        "eu",
    )


def test_the_kind_is_the_word_that_says_the_most() -> None:
    """Pure: one commit that does several things gets one word (rules.changes)."""
    stamp = Stamp(0, pack(1_000), "n")
    none = Record("repo/r/mem/t/i")
    born = none.create("us", stamp)
    assert changes.kind_of(none, born) == "created"
    assert changes.kind_of(born, born.set_fields({"a": "b"}, Stamp(0, pack(2_000), "n"))) == (
        "updated"
    )
    gone = born.set_deleted(True, Stamp(0, pack(3_000), "n"))
    assert changes.kind_of(born, gone) == "deleted"
    assert changes.kind_of(none, gone) == "deleted"  # a tombstone for a key never seen
    done = born.set_queue({"status": "done", "outcome": "done"}, Stamp(1, pack(4_000), "n"))
    assert changes.kind_of(born, done) == "done"
    assert set(changes.KINDS) == {
        "created", "updated", "deleted", "claimed", "released", "lapsed", "done", "failed",
        "deferred", "parked", "reopened",
    }  # fmt: skip


# -- resuming ------------------------------------------------------------------------------


async def test_resuming_after_a_restart_skips_nothing_and_repeats_nothing(
    start_node: StartNode, tmp_path: Path
) -> None:
    data = tmp_path / "kept"
    node = await start_node(data_dir=data)
    async with AsyncClient(node.address) as client:
        events = await started(client)
        for i in range(5):
            await client.remember(REPO, TOPIC, f"r{i}")
        first = await take(events, 5)
        await events.aclose()  # type: ignore[attr-defined]
    await node.stop()
    node = await start_node(data_dir=data)
    async with AsyncClient(node.address) as client:
        for i in range(5, 8):
            await client.remember(REPO, TOPIC, f"r{i}")
        resumed = await take(client.watch(REPO, cursor=first[2].cursor), 5)
    assert [e.key for e in resumed] == [key_of(f"r{i}") for i in range(3, 8)]


async def test_a_watch_resumes_by_itself_when_its_node_comes_back(
    start_node: StartNode, tmp_path: Path
) -> None:
    """The client keeps its place across the node's restart on the same address."""
    data = tmp_path / "kept"
    node = await start_node(data_dir=data)
    address = node.address
    async with AsyncClient(address) as client:
        events = client.watch(REPO, reconnect_seconds=0.1)
        got: list[WatchEvent] = []

        async def watch() -> None:
            async for event in events:
                got.append(event)
                if len(got) == 4:
                    return

        watching = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        await client.remember(REPO, TOPIC, "before-1")
        await client.remember(REPO, TOPIC, "before-2")

        async def seen_two() -> bool:
            return len(got) == 2

        await eventually(seen_two, "the first two events")
        await node.stop()
        node = await start_node(data_dir=data, listen=address)
        async with AsyncClient(address) as writer:
            await writer.remember(REPO, TOPIC, "after-1")
            await writer.remember(REPO, TOPIC, "after-2")
        async with asyncio.timeout(WITHIN):
            await watching
    assert [e.key.rpartition("/")[2] for e in got] == ["before-1", "before-2", "after-1", "after-2"]


async def test_a_cursor_older_than_the_window_is_refused_cursor_expired(
    start_node: StartNode,
) -> None:
    node = await start_node(feed_window=3)
    async with AsyncClient(node.address) as client:
        events = await started(client)
        await client.remember(REPO, TOPIC, "r0")
        (old,) = await take(events, 1)
        for i in range(1, 6):
            await client.remember(REPO, TOPIC, f"r{i}")
        with pytest.raises(CursorExpired) as expired:
            await take(client.watch(REPO, cursor=old.cursor), 1)
        assert expired.value.code == grpc.StatusCode.OUT_OF_RANGE
        assert expired.value.cursor == old.cursor
        # The newest three are kept: resuming from the third-newest's cursor works.
        recent = await take(client.watch(REPO, cursor=f"{old.cursor.rpartition('.')[0]}.3"), 3)
        assert [e.key.rpartition("/")[2] for e in recent] == ["r3", "r4", "r5"]


async def test_a_cursor_of_another_feed_is_refused_and_a_bad_one_names_the_field(
    start_node: StartNode,
) -> None:
    """A node that lost its disk starts a new feed: its old cursors must not resume
    from a position that now means something else."""
    one, other = await start_node(), await start_node()
    async with AsyncClient(one.address) as at_one, AsyncClient(other.address) as at_other:
        events = await started(at_one)
        await at_one.remember(REPO, TOPIC, "r0")
        (event,) = await take(events, 1)
        await at_other.remember(REPO, TOPIC, "r0")
        with pytest.raises(CursorExpired):
            await take(at_other.watch(REPO, cursor=event.cursor), 1)
        for bad in ("nonsense", f"{event.cursor}0"):
            with pytest.raises(InvalidArgument) as refused:
                await take(at_one.watch(REPO, cursor=bad), 1)
            assert [name for name, _ in refused.value.violations] == ["cursor"]
        with pytest.raises(InvalidArgument) as refused:
            await take(at_one.watch("bad/repo"), 1)
        assert [name for name, _ in refused.value.violations] == ["repo"]


async def test_the_blocking_client_watches_too(node: NodeServer) -> None:
    """Its blocking iterator, run in a thread while this loop serves the node."""

    def watch_one() -> WatchEvent:
        with Client(node.address) as client:
            events = client.watch(REPO)
            # The stream opens at the first next(): write once it is waiting.
            writer = threading.Timer(0.5, client.remember, (REPO, TOPIC, "seen"))
            writer.start()
            try:
                return next(events)
            finally:
                writer.join()
                events.close()

    async with asyncio.timeout(WITHIN):
        event = await asyncio.to_thread(watch_one)
    assert (event.kind, event.key) == ("created", key_of("seen"))


async def test_a_node_stopping_ends_its_watch_streams_at_once_instead_of_waiting_out_its_grace(
    start_node: StartNode,
) -> None:
    """Regression: a watch stream never ends by itself, so a graceful stop waited its
    whole grace for it (5 s by default, refusing every new call meanwhile). The
    stream now ends UNAVAILABLE at the stop's start, and the watcher resumes."""
    node = await start_node()
    async with grpc.aio.insecure_channel(node.address) as channel:
        stream = records_pb2_grpc.RecordsStub(channel).Watch(records_pb2.WatchRequest(repo=REPO))
        await stream.initial_metadata()
        async with asyncio.timeout(WITHIN):  # far less than the grace it was given
            await node.stop(grace=60.0)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in stream:
                    pass
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "stopping" in (ended.value.details() or "")


async def test_fencemark_watch_prints_one_json_line_per_event(node: NodeServer) -> None:
    async with AsyncClient(node.address) as client:
        events = await started(client)
        for name in ("one", "two", "three"):
            await client.remember(REPO, TOPIC, name)
        first = (await take(events, 1))[0]
    ran = await fencemark(
        "watch", "--target", node.address, "--repo", REPO, "--cursor", first.cursor,
        "--count", "2",
    )  # fmt: skip
    assert ran.code == 0, ran.stderr
    lines = [json.loads(line) for line in ran.stdout.splitlines()]
    assert [(e["kind"], e["record"]["id"]) for e in lines] == [
        ("created", "two"),
        ("created", "three"),
    ]
    assert int(lines[0]["cursor"].rpartition(".")[2]) == int(first.cursor.rpartition(".")[2]) + 1
