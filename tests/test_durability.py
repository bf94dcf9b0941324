"""SPEC §4 and §6 across crashes: an acknowledged write is on disk, a token is never reissued.

A real node subprocess takes a concurrent stream of writes and grants and is
killed with SIGKILL in the middle of it, then restarted on the same data
directory. The test keeps a ledger of what the node *acknowledged* (a reply
received) and what was merely in flight when it died, and checks the restarted
node against it (Jepsen style: record a history, check it afterwards):

- every acknowledged write is there; a field holds its last acknowledged value
  or the one write that was still in flight, never anything older;
- the next token granted for a record is strictly higher than every token
  granted (and acknowledged) before the crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fencemark.client import AsyncClient, ClaimConflict, FencemarkError, NotFound
from fencemark.node.api.server import DB_FILE, NodeServer
from fencemark.node.crdt import Record
from fencemark.node.crdt.hlc import pack, wall_clock_ms
from fencemark.node.store.storage import Storage
from fencemark.node.tools.process import NodeProcess
from tests.conftest import StartNode

pytestmark = pytest.mark.slow

REPO = "durable"
WRITE_KEYS = [f"repo/{REPO}/mem/writes/w{i}" for i in range(3)]
WRITERS_PER_KEY = 3
CLAIM_KEYS = [f"repo/{REPO}/mem/claims/c{i}" for i in range(3)]
CLAIMERS_PER_KEY = 2
KILL_ROUNDS = 3
LEASE_S = 1.0  # the shortest lease: a claim lost in the crash lapses quickly


@contextlib.asynccontextmanager
async def node_process(data: Path) -> AsyncIterator[NodeProcess]:
    proc = await NodeProcess.start(data, region="local")
    try:
        yield proc
    finally:
        if proc.proc.returncode is None:
            await proc.kill()


@dataclass
class Ledger:
    """What the node acknowledged, and what was in flight when it died."""

    acked: dict[tuple[str, str], str] = field(default_factory=dict)
    in_flight: dict[tuple[str, str], str] = field(default_factory=dict)
    remembered: dict[str, str] = field(default_factory=dict)  # key -> body
    max_token: dict[str, int] = field(default_factory=dict)
    owners: dict[tuple[str, int], str] = field(default_factory=dict)  # (key, token) -> owner
    grants: int = 0
    writes: int = 0

    def granted(self, key: str, token: int, owner: str) -> None:
        """A granted claim; the same token again only as the holder's idempotent retry."""
        first_owner = self.owners.setdefault((key, token), owner)
        assert first_owner == owner, f"{key}: token {token} granted to {first_owner} and {owner}"
        assert token >= self.max_token.get(key, 0), (
            f"{key}: token {token} granted after {self.max_token[key]}"
        )
        self.max_token[key] = token
        self.grants += 1

    async def write(self, key: str, name: str, value: str, call: Awaitable[object]) -> None:
        """Record ``value`` as in flight, then as acknowledged once the node answers."""
        self.in_flight[(key, name)] = value
        await call
        self.acked[(key, name)] = value
        del self.in_flight[(key, name)]
        self.writes += 1


async def writer(client: AsyncClient, ledger: Ledger, key: str, name: str, tag: str) -> None:
    """Unfenced updates of one field, one after the other."""
    for seq in range(1_000_000):
        value = f"{tag}-{seq}"
        await ledger.write(key, name, value, client.update(key, fields={name: value}))


async def rememberer(client: AsyncClient, ledger: Ledger, tag: str) -> None:
    for seq in range(1_000_000):
        id_ = f"{tag}-{seq}"
        key = f"repo/{REPO}/mem/remembered/{id_}"
        await client.remember(REPO, "remembered", id_, body=f"body of {id_}")
        ledger.remembered[key] = f"body of {id_}"


async def claimer(client: AsyncClient, ledger: Ledger, key: str, owner: str) -> None:
    """Claim, write under the token, and release every other time (or let the lease lapse)."""
    for seq in range(1_000_000):
        claim = await client.claim(key, owner, lease_seconds=LEASE_S, wait_seconds=0.5)
        if not claim.granted:
            continue
        ledger.granted(key, claim.fencing_token, owner)
        value = f"{claim.fencing_token}"
        try:
            await ledger.write(
                key,
                owner,
                value,
                client.update(key, fields={owner: value}, fencing_token=claim.fencing_token),
            )
        except ClaimConflict as conflict:  # a slow write outlived its 1 s lease: it happens
            assert conflict.reason in ("expired", "superseded"), conflict
            ledger.in_flight.pop((key, owner), None)
            continue
        if seq % 2 == 0:
            await client.release_claim(key, claim.fencing_token)


async def run_until_killed(proc: NodeProcess, ledger: Ledger, round_: int) -> None:
    """Stream writes and grants at the node; SIGKILL it once enough was acknowledged."""
    writes_before, grants_before = ledger.writes, ledger.grants
    async with AsyncClient(proc.address, timeout=5, retries=0) as client:
        work: list[Callable[[], Coroutine[Any, Any, None]]] = [
            lambda: rememberer(client, ledger, f"r{round_}"),
            *(
                (lambda k=k, n=n: writer(client, ledger, k, f"w{n}", f"r{round_}"))
                for k in WRITE_KEYS
                for n in range(WRITERS_PER_KEY)
            ),
            *(
                (lambda k=k, n=n: claimer(client, ledger, k, f"worker-{n}"))
                for k in CLAIM_KEYS
                for n in range(CLAIMERS_PER_KEY)
            ),
        ]
        tasks = [asyncio.create_task(job()) for job in work]
        try:
            async with asyncio.timeout(20):
                while ledger.writes - writes_before < 60 or ledger.grants - grants_before < 6:
                    failed = [t for t in tasks if t.done()]
                    if failed:
                        failed[0].result()  # a worker died before the kill: show why
                        raise AssertionError("a worker stopped before the kill")
                    await asyncio.sleep(0.02)
            await asyncio.sleep(random.uniform(0.0, 0.3))  # somewhere mid-stream
            await proc.kill()
            done, pending = await asyncio.wait(tasks, timeout=10)
            assert not pending, "workers still running 10 s after the node died"
            for task in done:
                error = task.exception()
                # Every worker ends on the dead node: unreachable, nothing else.
                assert isinstance(error, FencemarkError), repr(error)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def check_and_settle(client: AsyncClient, ledger: Ledger) -> None:
    """Check the restarted node against the ledger; what it holds becomes the new truth."""
    for (key, name), acked in sorted(ledger.acked.items()):
        value = (await client.get(key)).fields.get(name)
        in_flight = ledger.in_flight.get((key, name))
        assert value in (acked, in_flight), (
            f"{key} field {name}: {value!r}, acknowledged {acked!r}, in flight {in_flight!r}"
        )
    for (key, name), in_flight in ledger.in_flight.items():
        if (key, name) not in ledger.acked:
            with contextlib.suppress(NotFound):
                assert (await client.get(key)).fields.get(name) in (None, in_flight)
    for key, body in sorted(ledger.remembered.items()):
        assert (await client.get(key)).body == body, f"acknowledged remember of {key} lost"
    # Settle: whatever the node holds now is what later rounds build on.
    for key, name in list(ledger.in_flight):
        with contextlib.suppress(NotFound):
            value = (await client.get(key)).fields.get(name)
            if value is not None:
                ledger.acked[(key, name)] = value
    ledger.in_flight.clear()

    for key in CLAIM_KEYS:
        before = ledger.max_token.get(key, 0)
        status = await client.claim_status(key)
        assert status.fence >= before, f"{key}: fence {status.fence} below granted {before}"
        # A claim granted but unanswered before the crash may still be live: wait it out.
        claim = await client.claim(key, "after-crash", lease_seconds=LEASE_S, wait_seconds=5)
        assert claim.granted, claim
        assert claim.fencing_token > before, (
            f"{key}: token {claim.fencing_token} granted after the crash, {before} before it"
        )
        ledger.granted(key, claim.fencing_token, "after-crash")
        assert (await client.release_claim(key, claim.fencing_token)).released


async def create_records(client: AsyncClient) -> None:
    for key in (*WRITE_KEYS, *CLAIM_KEYS):
        topic, id_ = key.split("/")[-2:]
        await client.remember(REPO, topic, id_, title=id_)


async def test_acknowledged_writes_and_grants_survive_sigkill_mid_stream(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ledger = Ledger()
    async with contextlib.AsyncExitStack() as stack:
        proc = await stack.enter_async_context(node_process(data))
        async with AsyncClient(proc.address) as client:
            await create_records(client)
            node_id = (await client.info()).node_id
        for round_ in range(KILL_ROUNDS):
            await run_until_killed(proc, ledger, round_)
            assert proc.proc.returncode == -9
            proc = await stack.enter_async_context(node_process(data))
            async with AsyncClient(proc.address) as client:
                assert (await client.info()).node_id == node_id
                await check_and_settle(client, ledger)
        assert await proc.stop() == 0
    assert ledger.grants >= KILL_ROUNDS * 6
    assert len(ledger.remembered) > 0


async def test_a_graceful_restart_preserves_everything_and_the_node_id(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with node_process(data) as proc, AsyncClient(proc.address) as client:
        for i in range(20):
            await client.remember(REPO, "kept", f"k{i}", body=f"body {i}", tags=[f"n:{i}"])
        key = f"repo/{REPO}/mem/kept/k0"
        gone = f"repo/{REPO}/mem/kept/k1"
        await client.delete(gone)
        released = await client.claim(key, "worker-a", lease_seconds=60)
        assert (await client.release_claim(key, released.fencing_token)).released
        held = await client.claim(key, "worker-b", lease_seconds=600)
        assert held.granted
        await client.update(key, fields={"body": "fenced"}, fencing_token=held.fencing_token)
        info = await client.info()
        everything = [r async for r in client.iter_records(REPO, include_deleted=True)]
        status = await client.claim_status(key)
        assert await proc.stop() == 0

    async with node_process(data) as proc, AsyncClient(proc.address) as client:
        after = await client.info()
        assert (after.node_id, after.region, after.record_count) == (
            info.node_id,
            info.region,
            info.record_count,
        )
        assert [r async for r in client.iter_records(REPO, include_deleted=True)] == everything
        assert await client.claim_status(key) == status
        with pytest.raises(NotFound):
            await client.get(gone)
        # The claim is still live: only its token writes, and the fence never went back.
        with pytest.raises(ClaimConflict) as refused:
            await client.update(key, fields={"body": "unfenced"})
        assert refused.value.reason == "claimed"
        with pytest.raises(ClaimConflict) as old:
            await client.update(key, fields={"body": "a"}, fencing_token=released.fencing_token)
        assert old.value.reason == "superseded"
        record = await client.update(
            key, fields={"body": "still mine"}, fencing_token=held.fencing_token
        )
        assert record.body == "still mine"
        assert (await client.release_claim(key, held.fencing_token)).released
        again = await client.claim(key, "worker-c")
        assert again.granted and again.fencing_token > held.fencing_token
        assert await proc.stop() == 0


async def test_sigterm_right_after_the_ready_line_is_still_a_graceful_stop(
    tmp_path: Path,
) -> None:
    """Once a node has said "listening on", SIGTERM means a graceful shutdown (exit 0).

    ``NodeProcess.stop`` (and any supervisor) may send it the moment the line
    appears; a node killed by SIGTERM's default action skips the graceful path.
    """
    codes = []
    for attempt in range(5):  # the window is narrow: look more than once
        proc = await NodeProcess.start(tmp_path / f"data-{attempt}", region="local")
        codes.append(await proc.stop())
    assert codes == [0] * 5, f"exit codes {codes}: -15 means killed by SIGTERM's default action"


# -- the hybrid logical clock across restarts ------------------------------------------------


def stamps_of(record: Record) -> list[int]:
    return [stamp.hlc for stamp in record.stamps()]


async def stored_record(node: NodeServer, key: str) -> Record:
    stored = await node.storage.get(key)
    assert stored is not None
    return stored.record


async def test_the_hlc_never_goes_backwards_across_a_restart(
    start_node: StartNode, tmp_path: Path
) -> None:
    data = tmp_path / "hlc"
    node = await start_node(data_dir=data)
    keys = [f"repo/{REPO}/mem/clock/k{i}" for i in range(5)]
    async with AsyncClient(node.address) as client:
        for key in keys:
            id_ = key.rsplit("/", 1)[1]
            await client.remember(REPO, "clock", id_, body="first")
            for n in range(20):  # many writes in one millisecond tick the logical part
                await client.update(key, fields={f"f{n}": "x"})
    before = [hlc for key in keys for hlc in stamps_of(await stored_record(node, key))]
    high_before = node.storage.hlc_high
    await node.stop()

    node = await start_node(data_dir=data)
    assert node.storage.hlc_high >= max(before)
    assert node.storage.hlc_high == high_before
    async with AsyncClient(node.address) as client:
        await client.update(keys[0], fields={"body": "after restart"})
        await client.remember(REPO, "clock", "new", body="after restart")
    written = (await stored_record(node, keys[0])).fields["body"].stamp.hlc
    created = max(stamps_of(await stored_record(node, f"repo/{REPO}/mem/clock/new")))
    assert written > max(before)
    assert created > written


async def test_a_restarted_clock_continues_from_its_high_water_mark_even_if_wall_time_is_behind(
    start_node: StartNode, tmp_path: Path
) -> None:
    """As if the machine's clock stepped back 60 s while the node was down."""
    data = tmp_path / "hlc-ahead"
    key = f"repo/{REPO}/mem/clock/ahead"
    node = await start_node(data_dir=data)
    async with AsyncClient(node.address) as client:
        await client.remember(REPO, "clock", "ahead", body="now")
    await node.stop()

    # Rewrite the state as if its last write had happened 60 s from now.
    ahead = pack(wall_clock_ms() + 60_000, 7)
    storage = await Storage.open(data / DB_FILE)
    try:
        stored = await storage.get(key)
        assert stored is not None
        current = stored.record
        stamp = current.fields["body"].stamp._replace(hlc=ahead)
        await storage.put(current.set_fields({"body": "from the future"}, stamp), hlc=ahead)
    finally:
        await storage.close()

    node = await start_node(data_dir=data)
    async with AsyncClient(node.address) as client:
        record = await client.update(key, fields={"body": "written after the restart"})
        assert record.body == "written after the restart", "a later local write must win"
        await client.remember(REPO, "clock", "other", body="x")
    assert (await stored_record(node, key)).fields["body"].stamp.hlc > ahead
    assert max(stamps_of(await stored_record(node, f"repo/{REPO}/mem/clock/other"))) > ahead
