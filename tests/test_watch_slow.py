"""SPEC §9, slow watchers: one that stops taking events never slows writes; it is cut
off ``WATCHER_TOO_SLOW`` and resumes with nothing repeated, and one whose place the
node trimmed meanwhile is refused ``CURSOR_EXPIRED``, never resumed past a gap.

The node's send stalls only once the stream's buffers are full (several MB, or more as
gRPC grows the window with the link's measured bandwidth), so the records here are
large. Every wait is bounded.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fencemark.client import AsyncClient, CursorExpired, WatchEvent
from fencemark.v1 import records_pb2, records_pb2_grpc
from tests.cluster import eventually
from tests.conftest import StartNode
from tests.metrics import refusals
from tests.test_watch import REPO, TOPIC, key_of, started

WRITES = 150  # of 200 kB each: far more than the stream's flow-control windows hold
# A watcher that takes nothing: its channel's stream window stays at 64 kB. With gRPC's
# bandwidth-delay probing on, the window grows with what loopback carries, and a CI
# run's client once took all 150 events (30 MB) into its buffers: nothing was slow.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 16)]


async def test_a_watcher_that_stops_reading_is_cut_off_with_its_cursor_while_writes_go_on(
    start_node: StartNode,
) -> None:
    """It never slows writes: the feed is in the file, and the one stalled send is
    bounded by --watch-send-timeout, then the stream ends WATCHER_TOO_SLOW naming the
    cursor of the last event taken."""
    node = await start_node(watch_send_timeout=0.5)
    body = "x" * 200_000
    async with (
        AsyncClient(node.address) as client,
        grpc.aio.insecure_channel(node.address, options=SMALL_WINDOW) as channel,
    ):
        stream = records_pb2_grpc.RecordsStub(channel).Watch(records_pb2.WatchRequest(repo=REPO))
        await stream.initial_metadata()
        async with asyncio.timeout(60):  # every write acknowledged, none held up for long
            for i in range(WRITES):
                await client.remember(REPO, TOPIC, f"big-{i}", body=body)
        taken = 0  # what the stream's buffers held when the node gave up on it
        # Bounded apart from the writes, so a stream that never ends fails here and
        # says how far it got (a CI run once timed out without saying which phase).
        try:
            async with asyncio.timeout(30):
                async for _ in stream:
                    taken += 1
        except grpc.aio.AioRpcError as error:
            cut = error
        except TimeoutError:
            pytest.fail(f"the stream was not ended within 30 s; {taken} events taken")
        else:
            pytest.fail(f"the stream ended OK after {taken} events")
    assert taken < WRITES, "every event fitted in the buffers: the watcher was never slow"
    assert cut.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (taken, cut)
    assert "resume from cursor" in (cut.details() or "")

    async def counted() -> bool:  # once the node has finished the call on its side
        return refusals(node).get(("Watch", "watcher_too_slow")) == 1

    await eventually(counted, "the cut-off counted as a refusal")


@pytest.mark.slow  # streams 12 MB to a reader that falls behind
async def test_a_watcher_cut_off_as_too_slow_resumes_by_itself_with_nothing_repeated(
    start_node: StartNode,
) -> None:
    """Regression: the event whose send timed out may still reach the watcher before
    the cut-off, whose cursor names the event before it; ``watch()`` resumed from the
    node's cursor and gave that event twice. It resumes from the last event it gave."""
    node = await start_node(watch_send_timeout=0.3)
    body = "x" * 200_000
    count = 60
    got: list[WatchEvent] = []
    async with AsyncClient(node.address) as client:
        events = await started(client, reconnect_seconds=0.05)
        for i in range(count):
            await client.remember(REPO, TOPIC, f"big-{i}", body=body)
        async with asyncio.timeout(60):
            async for event in events:
                got.append(event)
                if len(got) == count:
                    break
                if len(got) % 12 == 0:
                    await asyncio.sleep(1.0)  # leaves the next event untaken: cut off

    async def cut_off() -> bool:
        return refusals(node).get(("Watch", "watcher_too_slow"), 0) >= 1

    await eventually(cut_off, "the watcher cut off as too slow")
    assert [e.key for e in got] == [key_of(f"big-{i}") for i in range(count)]


async def test_a_watcher_whose_place_is_trimmed_while_it_is_slow_is_refused_not_skipped(
    start_node: StartNode,
) -> None:
    """A trim racing a slow watcher: the node keeps five changes, its send to a watcher
    that stopped reading stalls, and the writes go on far past the window. Reading
    again, the watcher gets what the node had already read for it, in order from its
    start, then CURSOR_EXPIRED: the node never goes on after the changes it dropped."""
    node = await start_node(feed_window=5, watch_send_timeout=60.0)
    body = "x" * 250_000
    got: list[WatchEvent] = []
    async with AsyncClient(node.address) as client:
        events = await started(client, topic=TOPIC)
        await client.remember(REPO, TOPIC, "big-0", body=body)
        got.append(await anext(events))  # then it takes nothing while the writes go on
        for i in range(1, 100):
            await client.remember(REPO, TOPIC, f"big-{i}", body=body)
        with pytest.raises(CursorExpired):
            async with asyncio.timeout(60):
                async for event in events:
                    got.append(event)
    assert 1 < len(got) < 100
    assert [e.key for e in got] == [key_of(f"big-{i}") for i in range(len(got))]
