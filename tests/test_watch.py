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
import functools
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fencemark.client import (
    AsyncClient,
    Client,
    CursorExpired,
    InvalidArgument,
    WatchEvent,
    WatchProgress,
)
from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import Record, Stamp
from fencemark.node.crdt.hlc import pack
from fencemark.node.rules import changes
from fencemark.node.store import feed
from fencemark.node.store.feed import Change
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
    opened = asyncio.Event()
    events = client.watch(REPO, on_start=lambda _: opened.set(), **filters)  # type: ignore[call-overload]
    first = asyncio.ensure_future(anext(events))
    async with asyncio.timeout(WITHIN):
        await asyncio.wait(
            [first, asyncio.ensure_future(opened.wait())], return_when=asyncio.FIRST_COMPLETED
        )

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


async def test_on_start_names_where_the_watch_starts_once_its_stream_is_open(
    node: NodeServer,
) -> None:
    """Whatever is committed after ``on_start`` is watched; its cursor resumes there."""
    async with AsyncClient(node.address) as client:
        await client.remember(REPO, TOPIC, "before")
        starts: list[str] = []
        opened = asyncio.Event()

        def on_start(cursor: str) -> None:
            starts.append(cursor)
            opened.set()

        events = client.watch(REPO, on_start=on_start)
        first = asyncio.ensure_future(anext(events))
        async with asyncio.timeout(WITHIN):
            await opened.wait()
        await client.remember(REPO, TOPIC, "after")
        async with asyncio.timeout(WITHIN):
            event = await first
        await events.aclose()
        again = await take(client.watch(REPO, cursor=starts[0]), 1)
    assert len(starts) == 1 and starts[0]
    assert (event.kind, event.key) == ("created", key_of("after"))
    assert again[0].cursor == event.cursor


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


def seq_of(cursor: str) -> int:
    return int(cursor.rpartition(".")[2])


async def test_a_filter_that_passes_over_changes_hears_progress_and_keeps_its_place(
    start_node: StartNode,
) -> None:
    """A filter that rarely matches would leave the cursor a client keeps behind the
    feed, and resuming from it past the window would be refused although nothing the
    filter wants was missed. The node says how far the feed has got (``progress``,
    at most once a second once the watcher caught up); resuming from there works.
    A watcher that did not ask for progress is told it too, but sees changes only."""
    node = await start_node(feed_window=8)
    async with AsyncClient(node.address) as client:
        plain = await started(client, topic="rare")
        watching = client.watch(REPO, topic="rare", progress=True)
        first = asyncio.ensure_future(anext(watching))
        await asyncio.sleep(0.2)  # the stream is open: it watches from now
        await client.remember(REPO, "rare", "wanted")
        async with asyncio.timeout(WITHIN):
            wanted = await first
        assert isinstance(wanted, WatchEvent) and wanted.key == key_of("wanted", "rare")
        for i in range(6):
            await client.remember(REPO, "busy", f"b{i}")
        last = seq_of(wanted.cursor) + 6
        heard: list[WatchEvent | WatchProgress] = []
        async with asyncio.timeout(WITHIN):
            while not heard or seq_of(heard[-1].cursor) < last:
                heard.append(await anext(watching))
        await watching.aclose()
        assert all(isinstance(e, WatchProgress) for e in heard), heard  # no change passed
        assert seq_of(heard[-1].cursor) == last
        for i in range(6, 9):  # the window (8) moves past "wanted", not past the progress
            await client.remember(REPO, "busy", f"b{i}")
        with pytest.raises(CursorExpired):
            await take(client.watch(REPO, topic="rare", cursor=wanted.cursor), 1)
        resumed = client.watch(REPO, topic="rare", cursor=heard[-1].cursor)
        following = asyncio.ensure_future(anext(resumed))
        await client.remember(REPO, "rare", "next")
        async with asyncio.timeout(WITHIN):
            assert (await following).key == key_of("next", "rare")
        await resumed.aclose()
        changes = await take(plain, 2)
        assert [e.key for e in changes] == [key_of("wanted", "rare"), key_of("next", "rare")]


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


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
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


def test_what_watchers_share_is_made_once_per_change_and_bounded() -> None:
    """A node's watchers decode each change, and build its message, once between them
    (``watch.Recent``), keeping only the newest ``size``."""
    from fencemark.node.core.watch import Recent

    made: list[int] = []
    recent: Recent[int, str] = Recent(size=2)

    def make(seq: int) -> str:
        made.append(seq)
        return f"change {seq}"

    for seq in (1, 1, 2, 1, 3, 3, 1):
        assert recent.get(seq, functools.partial(make, seq)) == f"change {seq}"
    assert made == [1, 2, 3, 1]  # 1 made again only once 2 and 3 pushed it out


@given(
    commits=st.lists(
        st.lists(st.sampled_from(["a/1", "a/2", "b/1", "c/9"]), min_size=0, max_size=5),
        max_size=40,
    ),
    window=st.integers(1, 30),
    size=st.integers(1, 12),
    after=st.integers(0, 6000),
    limit=st.integers(1, 8),
)
@example(commits=[["a/1"]] * 20, window=5, size=3, after=14, limit=8)
@example(commits=[["a/1", "a/1"]], window=1, size=1, after=0, limit=1)  # one commit trims
def test_the_feeds_tail_in_memory_answers_as_the_file_would(
    commits: list[list[str]], window: int, size: int, after: int, limit: int
) -> None:
    """``store.feed.Tail`` against a model of the table (every row, trimmed to the
    window at each commit, with a jump of the seqs where an era begins): where it
    says it covers a cursor, its answer is the table's; and the oldest ``seq`` it
    names is the table's."""
    tail = feed.Tail(first=1, last=0, window=window, size=size)
    table: list[Change] = []
    last = 0
    for index, keys in enumerate(commits):
        # Now and then a commit starts a new era of seqs (a new life of the file).
        start = last + 1 + (1000 if index % 7 == 3 else 0)
        rows = [(key, "updated", 0, key.encode()) for key in keys]
        table += [Change(start + i, *row) for i, row in enumerate(rows)]
        if rows:
            last = table[-1].seq
            table = table[-window:]  # the window counts rows
        tail.extend(last, table[0].seq if table else last + 1, rows)
        assert tail.first == (table[0].seq if table else last + 1)
        for lower, upper in (("a/", "a0"), ("", "~")):
            if tail.covers(after):
                wanted = [r for r in table if r.seq > after and lower <= r.key < upper][:limit]
                assert tail.changes(after, lower, upper, limit) == wanted
