"""SPEC §9 across restarts and crashes of a real node process, over thousands of events.

Writers make a few thousand changes of every kind (creations, updates, claims,
releases with each outcome, items parked and reopened, deletions) while two
watchers follow the topic: the client's own ``watch()``, which resumes by itself,
and ``fencemark watch`` child processes, each killed mid-stream and started again
from the cursor the one before saved (the last line it printed). The node is
stopped with SIGTERM and killed with SIGKILL, twice each, while all of it goes on.

Then the history is checked (Jepsen style, afterwards): what each watcher received,
in order, equals the feed the node kept in its SQLite file after the starting
cursor (read straight from the file once the node is stopped: nothing skipped,
nothing repeated, in commit order), and what a fresh ``Watch`` from that cursor
returns; every write the node acknowledged is shown by an event, in the order each
writer had it acknowledged; and each record's last event is its state in the node.

It pins two bugs it found: reads that saw the file from before commits that had
returned, so watchers skipped feed rows (``Storage.get``, now also pinned by
test_storage.py), and a SIGTERM stop that held itself up its whole grace for the
watch streams (test_watch.py pins that too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import sqlite3
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fencemark.client import AsyncClient, FencemarkError, WatchEvent
from fencemark.node.api.server import DB_FILE
from fencemark.node.crdt import codec
from fencemark.node.rules.validation import key_range
from fencemark.node.store import feed
from fencemark.node.tools.process import NodeProcess
from tests.cluster import LOOPBACK
from tests.ports import free_ports

pytestmark = pytest.mark.slow

REPO, TOPIC, OTHER = "resume", "work", "elsewhere"
WRITERS, STEPS = 4, 650  # each writer's steps: a little over 2 000 acknowledged changes
FAULTS = ("SIGKILL", "SIGTERM", "SIGKILL", "SIGTERM")  # spread evenly over the writing
LEASE_S = 3.0
WITHIN_S = 60.0  # the bound of every wait
MARK = "the-end"  # the last change of the topic: both watchers read up to it
SMALL_CACHE = ("--cache-size", "16")  # most reads go to the file, as in a large store
KINDS = {"created", "updated", "claimed", "released", "done", "failed", "deferred", "parked",
         "reopened", "deleted"}  # fmt: skip
# A grant that takes over a lapsed lease ends that claim in the same commit: its word
# is the ending's, which says more (api.md, *Change feed*), or parked by that lapse.
GRANTED = frozenset({"claimed", "lapsed", "parked"})
ENDINGS = {"": {"released"}, "done": {"done"}, "failed": {"failed", "parked"},
           "deferred": {"deferred"}}  # fmt: skip


@dataclass(frozen=True)
class Seen:
    """One event as a watcher received it (or as the node's file holds it)."""

    cursor: str
    kind: str
    key: str
    digest: bytes
    fence: int = field(default=0, compare=False)
    fields: dict[str, str] = field(default_factory=dict, compare=False)


def seen_of(event: WatchEvent) -> Seen:
    record = event.record
    return Seen(event.cursor, event.kind, event.key, record.digest, record.fence, record.fields)


def seen_of_line(line: dict[str, Any]) -> Seen:
    """An event as ``fencemark watch`` prints it (one JSON object per line)."""
    record = line["record"]
    return Seen(line["cursor"], line["kind"], line["key"], bytes.fromhex(record["digest"]),
                record["fence"], record["fields"])  # fmt: skip


@dataclass(frozen=True)
class Acked:
    """A change the node acknowledged, and what an event of it must show: the state
    the node answered with (its digest), or for a claim and its release, which carry
    none, the token and the field written; and its word (one of ``kinds``)."""

    key: str
    kinds: frozenset[str]
    digest: bytes = b""
    fence: int = 0
    name: str = ""
    value: str = ""

    def shown_by(self, event: Seen) -> bool:
        return (
            event.key == self.key
            and event.kind in self.kinds
            and (not self.digest or event.digest == self.digest)
            and (not self.fence or event.fence == self.fence)
            and (not self.name or event.fields.get(self.name) == self.value)
        )


@dataclass
class Writer:
    """Changes its own records of the topic (no two writers share one), and keeps what
    the node acknowledged, in order. A call that fails is not acknowledged: the node
    was away, and the change may or may not have been made."""

    name: str
    rng: random.Random
    keys: list[str] = field(default_factory=list)
    granted: dict[str, int] = field(default_factory=dict)  # key -> the last token it got
    acked: list[Acked] = field(default_factory=list)
    unsure: set[str] = field(default_factory=set)  # keys whose claim's answer was lost
    steps: int = 0
    made: int = 0

    async def run(self, client: AsyncClient) -> None:
        for _ in range(STEPS):
            try:
                await self._step(client)
            except FencemarkError:
                await asyncio.sleep(0.05)
            self.steps += 1

    async def _step(self, client: AsyncClient) -> None:
        roll = self.rng.random()
        if len(self.keys) < 3 or roll < 0.12:
            await self._create(client)
        elif roll < 0.40:
            key, name = self.rng.choice(self.keys), f"u.{self.name}.{self.steps}"
            updated = await client.update(key, fields={name: "v"})
            # A claim of the key whose answer was lost may have lapsed just before: the
            # commit that makes this change records the lapse too, and is named by it
            # ("lapsed", or "parked" when that lapse parked the item), as a grant's is.
            kinds = GRANTED | {"updated"} if key in self.unsure else frozenset({"updated"})
            self.acked.append(Acked(key, kinds, updated.digest))
        elif roll < 0.88:
            await self._claim_and_end(client, self.rng.choice(self.keys))
        elif roll < 0.93:
            key = self.rng.choice(self.keys)
            reopened = await client.reopen(key, "again")  # an open item: its attempts from 0
            if reopened.reopened and reopened.record is not None:
                kinds = frozenset({"reopened", "updated"})
                self.acked.append(Acked(key, kinds, reopened.record.digest))
        elif roll < 0.96:
            key = self.keys.pop(self.rng.randrange(len(self.keys)))
            gone = await client.delete(key)
            self.acked.append(Acked(key, frozenset({"deleted"}), gone.digest))
        else:  # another topic: no watcher of this one may see it
            await client.remember(REPO, OTHER, f"{self.name}-{self.steps}")

    async def _create(self, client: AsyncClient) -> None:
        name = f"{self.name}-{self.made}"
        tags = ["maxAttempts:2"] if self.made % 3 == 0 else []  # parked by two failures
        self.made += 1
        made = await client.remember(REPO, TOPIC, name, title=name, tags=tags)
        self.keys.append(made.record.key)
        self.acked.append(Acked(made.record.key, frozenset({"created"}), made.record.digest))

    async def _claim_and_end(self, client: AsyncClient, key: str) -> None:
        try:
            claim = await client.claim(key, self.name, lease_seconds=LEASE_S)
        except FencemarkError:
            self.unsure.add(key)  # it may have been granted: the node went away first
            raise
        if not claim.granted:  # held by a claim whose answer was lost: it lapses
            return
        token = claim.fencing_token
        if self.granted.get(key) != token:  # not its own claim again (its release was lost)
            # A claim whose answer was lost, asked again, is the same claim extended
            # (SPEC §4's retry): an ``updated`` at its token, after the grant.
            kinds = GRANTED | {"updated"} if key in self.unsure else GRANTED
            self.acked.append(Acked(key, kinds, fence=token))
        self.unsure.discard(key)
        self.granted[key] = token
        outcome = self.rng.choice(sorted(ENDINGS))
        name, value = f"end.{token}", outcome or "released"
        later = 0.1 if outcome == "deferred" else 0.0
        released = await client.release_claim(
            key, token, outcome=outcome, fields={name: value}, retry_after_seconds=later
        )
        if released.released:
            self.acked.append(Acked(key, frozenset(ENDINGS[outcome]), b"", token, name, value))


class ProcessWatcher:
    """``fencemark watch`` child processes, one after another, each printing to a file
    of its own and started from the cursor the one before saved: its last complete
    line (a line cut short by SIGKILL is not saved; the next one prints it again)."""

    def __init__(self, folder: Path, address: str, cursor: str) -> None:
        self.folder, self.address, self.cursor = folder, address, cursor
        self.outputs: list[Path] = []
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        out = self.folder / f"watch-{len(self.outputs)}.jsonl"
        self.outputs.append(out)
        with out.open("wb") as stdout, (self.folder / "watch.err").open("ab") as stderr:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fencemark.node", "watch", "--target", self.address,
                "--repo", REPO, "--topic", TOPIC, "--cursor", self.cursor,
                stdout=stdout, stderr=stderr,
            )  # fmt: skip

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        saved = self.events_of(self.outputs[-1])
        self.cursor = saved[-1].cursor if saved else self.cursor

    @staticmethod
    def events_of(path: Path) -> list[Seen]:
        complete = path.read_bytes().split(b"\n")[:-1]  # the last piece has no newline
        return [seen_of_line(json.loads(line)) for line in complete]

    def events(self) -> list[Seen]:
        return [event for path in self.outputs for event in self.events_of(path)]

    def printed(self, text: str) -> bool:
        return text.encode() in self.outputs[-1].read_bytes()


async def until(check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    """Poll ``check`` until it holds; fail after WITHIN_S."""
    async with asyncio.timeout(WITHIN_S):
        while True:
            result = check()
            if result if isinstance(result, bool) else await result:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"unreachable: {what}")


async def follow(client: AsyncClient, cursor: str, into: list[Seen]) -> None:
    """The client's own resume: one ``watch()`` from ``cursor`` until the mark."""
    async for event in client.watch(REPO, topic=TOPIC, cursor=cursor, reconnect_seconds=0.1):
        into.append(seen_of(event))
        if event.key.endswith(f"/{MARK}"):
            return


def kept_in_file(data: Path, node_id: str) -> list[Seen]:
    """The topic's rows of the node's feed up to the mark, straight from its SQLite
    file (the node is stopped): what the watchers must have received, in this order."""
    lower, upper = key_range(REPO, TOPIC)
    with contextlib.closing(sqlite3.connect(f"file:{data / DB_FILE}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT seq, kind, key, state FROM feed WHERE key >= ? AND key < ? ORDER BY seq",
            (lower, upper),
        ).fetchall()
    return to_mark([Seen(feed.cursor(node_id, seq), kind, key, codec.digest(state))
                    for seq, kind, key, state in rows])  # fmt: skip


def to_mark(events: list[Seen]) -> list[Seen]:
    """``events`` up to the mark (a lease may lapse after it, and be seen or not)."""
    marks = [i for i, event in enumerate(events) if event.key.endswith(f"/{MARK}")]
    return events[: marks[0] + 1] if marks else events


def difference(got: list[Seen], kept: list[Seen]) -> str:
    """Where ``got`` first departs from ``kept``, and what it repeated or skipped."""
    index = next((i for i, (a, b) in enumerate(zip(got, kept, strict=False)) if a != b), None)
    cursors = [e.cursor for e in got]
    repeated = sorted({c for c in cursors if cursors.count(c) > 1})[:5]
    skipped = [e.cursor for e in kept if e.cursor not in set(cursors)][:5]
    where = "" if index is None else f"first difference at {index}: {got[index]} != {kept[index]}"
    return f"{len(got)} received, {len(kept)} kept; {where}; repeated {repeated}; skipped {skipped}"


def unshown(acked: list[Acked], events: list[Seen]) -> list[Acked]:
    """The acknowledged changes no event shows in the order they were acknowledged:
    each must be shown by an event after the one that showed the change before it."""
    positions: dict[str, list[int]] = {}
    for index, event in enumerate(events):
        positions.setdefault(event.key, []).append(index)
    position, missing = -1, []
    for change in acked:
        later = (i for i in positions.get(change.key, ()) if i > position)
        found = next((i for i in later if change.shown_by(events[i])), None)
        if found is None:
            missing.append(change)
        else:
            position = found
    return missing


def stepped(writers: list[Writer], steps: int) -> bool:
    return min(writer.steps for writer in writers) >= steps


async def write_through_faults(
    nodes: list[NodeProcess], writers: list[Writer], followed: list[Seen], watcher: ProcessWatcher
) -> list[int]:
    """Run the writers; at each share of their steps, kill the watcher process, stop or
    kill the node, start both again (``nodes``: every node process started, the last
    one running). How many events the client's watcher had at each fault."""
    address, data = nodes[-1].address, nodes[-1].data_dir
    clients = [AsyncClient(address, timeout=5.0, retries=0) for _ in writers]
    running = [asyncio.create_task(w.run(c)) for w, c in zip(writers, clients, strict=True)]
    at_fault = []
    try:
        for index, signal in enumerate(FAULTS):
            share = (index + 1) * STEPS // (len(FAULTS) + 1)
            await until(functools.partial(stepped, writers, share), "the writers' steps")
            at_fault.append(len(followed))
            await watcher.kill()  # mid-stream, with what it printed so far
            await (nodes[-1].kill() if signal == "SIGKILL" else nodes[-1].stop())
            nodes.append(await NodeProcess.start(data, listen=address, extra_args=SMALL_CACHE))
            await watcher.start()  # from the cursor the killed one saved
        async with asyncio.timeout(WITHIN_S):
            await asyncio.gather(*running)
    finally:
        for task in running:
            task.cancel()
        for client in clients:
            await client.close()
    return at_fault


async def claims_at_rest(client: AsyncClient) -> bool:
    """Every claim on the topic's records ended: released, or its lapse recorded.
    (Regression: a lapse recorded between the mark and the listing made a record's
    last event before the mark differ from its state.)"""
    async for record in client.iter_records(REPO, topic=TOPIC, include_deleted=True):
        if not record.fence:
            continue
        events = (await client.history(record.key)).events
        ended = [e for e in events if e.fencing_token == record.fence]
        if not any(e.kind not in ("granted", "renewed") for e in ended):
            return False
    return True


async def read_to_the_mark(
    address: str, start: str, following: asyncio.Task[None], watcher: ProcessWatcher
) -> tuple[dict[str, bytes], list[Seen]]:
    """Once the writers are done: the mark, both watchers up to it, every record of the
    topic as the node holds it, and a fresh ``Watch`` from ``start`` to the mark."""
    async with AsyncClient(address, timeout=5.0, retries=4) as client:
        # A claim whose answer was lost lapses LEASE_S after its grant, and its lapse
        # changes the record: only once every claim ended is the mark the last change.
        await until(functools.partial(claims_at_rest, client), "every claim ended")
        await client.remember(REPO, TOPIC, MARK)
        async with asyncio.timeout(WITHIN_S):
            await following
        await until(lambda: watcher.printed(f"/{MARK}"), "the watcher process printing the mark")
        await watcher.kill()
        listing = client.iter_records(REPO, topic=TOPIC, include_deleted=True)
        ends = {record.key: record.digest async for record in listing}
        fresh: list[Seen] = []
        async with asyncio.timeout(WITHIN_S):
            await follow(client, start, fresh)
    return ends, fresh


async def test_watchers_resume_across_restarts_and_kill_9_with_no_gap_and_no_repeat(
    tmp_path: Path,
) -> None:
    (port,) = free_ports(1)
    nodes = [await NodeProcess.start(tmp_path / "node", listen=f"{LOOPBACK}:{port}",
                                     extra_args=SMALL_CACHE)]  # fmt: skip
    address = nodes[0].address
    writers = [Writer(f"w{i}", random.Random(i)) for i in range(WRITERS)]
    followed: list[Seen] = []
    try:
        async with AsyncClient(address, timeout=5.0) as reader:
            node_id = (await reader.info()).node_id
            start = feed.cursor(node_id, 0)  # the beginning of the node's feed, still empty
            watcher = ProcessWatcher(tmp_path, address, start)
            following = asyncio.create_task(follow(reader, start, followed))
            await watcher.start()
            try:
                at_fault = await write_through_faults(nodes, writers, followed, watcher)
                ends, fresh = await read_to_the_mark(address, start, following, watcher)
            finally:
                following.cancel()
                await watcher.kill()
        await nodes[-1].stop()
    finally:
        for node in nodes:
            await node.kill()  # those still running, after a failure
    kept = kept_in_file(tmp_path / "node", node_id)
    assert len(kept) > 2_000, len(kept)
    assert {e.kind for e in kept} >= KINDS, {e.kind for e in kept}
    assert at_fault[0] > 0 and at_fault == sorted(set(at_fault)) and at_fault[-1] < len(kept)
    assert followed == kept, difference(followed, kept)  # resumed by the client itself
    printed = to_mark(watcher.events())
    assert printed == kept, difference(printed, kept)  # resumed from the cursors it saved
    assert fresh == kept, difference(fresh, kept)
    for writer in writers:
        assert not unshown(writer.acked, followed), unshown(writer.acked, followed)[:3]
    assert {e.key: e.digest for e in followed} == ends  # each record's last event: its state
