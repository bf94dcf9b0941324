"""The chaos tier for a region of several members (SPEC §10): the stack of
deploy/docker-compose.yml with the chaos overlay (members.py: region ``us`` as three
member containers with an etcd cluster of three, ``eu`` and ``ap`` as one node each),
a seeded nemesis of the decider's faults, six invariants (member_invariants.py).

While three workers drain a queue homed in ``us`` (claim the next item, write with
the token, release it done), a writer adds to it and a holder renews one claim and
writes with it every second, each reaching a member at random and following its
redirect, the nemesis plays each fault kind once, in a seeded order:

- ``kill-decider``: ``kill -9`` of the decider, which starts again on its disk;
- ``kill-decider-disk-lost``: the same, its disk destroyed before it starts;
- ``pause-decider``: the decider frozen for longer than its TTL, then woken;
- ``cut-decider-from-etcd``: the decider cut from etcd alone, then healed;
- ``cut-member-from-decider``: another member cut from the decider, then healed;
- ``cut-decider-from-members``: the decider cut from both other members, not from
  etcd: it steps aside, and one of them must decide while the cut lasts;
- ``kill-etcd-leader``: ``kill -9`` of etcd's leader, which starts again;
- ``etcd-quorum-lost``: two of etcd's three killed for 20 s, then started;
- ``disk-lost-then-decider-killed``: a member back on an empty disk, and at once the
  decider killed: the member that lost its disk is no vote until it caught up.

After each fault is healed a member must decide within ``DECIDER_LIMIT_S``. At the
end every node converges, and the history is judged. Environment, as for the
region chaos tier (test_chaos.py):

    FENCEMARK_CHAOS_SECONDS=600       # faults drawn at random for this many more seconds
    FENCEMARK_CHAOS_SEED=1234         # replay a run's faults (printed at its start)
    FENCEMARK_CHAOS_RESULTS=DIR       # where reports go (default tests/chaos/results)
    FENCEMARK_CHAOS_KEEP=1            # a failed run leaves its containers running, to look

Each run writes report.json, report.md and timeline.png under ``members/`` of the
results folder (``members/latest`` the newest); docs/chaos.md explains them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from fencemark.client import AsyncClient, ClaimConflict, FencemarkError, Record
from fencemark.client.errors import NotDecider, Unavailable
from tests.chaos.checker import Verdict
from tests.chaos.member_invariants import (
    Grant,
    Release,
    acknowledged_kept,
    claims_exclusive,
    decider_after_each,
    done_once,
    holders_kept,
    replaced_while_cut,
)
from tests.chaos.members import OTHERS, REGION, MemberCluster
from tests.chaos.report import plotter, results_folder
from tests.chaos.workload import divergence, versions
from tests.compose import ETCDS, MEMBERS, NODES

T = TypeVar("T")
KINDS = (
    "kill-decider",
    "kill-decider-disk-lost",
    "pause-decider",
    "cut-decider-from-etcd",
    "cut-member-from-decider",
    "cut-decider-from-members",
    "kill-etcd-leader",
    "etcd-quorum-lost",
    "disk-lost-then-decider-killed",
)
TTL_S = 2
LEASE_S = 20.0  # a worker's claim: longer than any fault but etcd's outage
HOLDER_LEASE_S = 60.0  # the holder's: longer than every fault, etcd's outage included
ETCD_OUTAGE_S = 20.0
DECIDER_LIMIT_S = 30.0
# A decider cut off from its members steps aside after two lease times; one of them
# is elected within about one more and catches up with the other.
REPLACED_LIMIT_S = 8 * TTL_S
CALL_S = 2.0  # each call's deadline: a paused member holds up nobody longer
WARM_UP_S = 3.0
BETWEEN_S = 2.0  # healthy work between one fault's decider and the next fault
CONVERGE_LIMIT_S = 30.0
SERVING_LIMIT_S = 90.0
REPO, TOPIC, HELD = "chaos", "members-queue", "held-item"


class Stopped(Exception):
    """The run is over: a client stops asking."""


@dataclass
class Played:
    kind: str
    decider: str  # the member deciding when it began
    at: float
    healed: float = 0.0
    window: float | None = None  # heal to the next decider
    replaced: float | None = None  # a cut-off decider: the cut to another's decision


@dataclass
class History:
    started: float = field(default_factory=time.monotonic)
    grants: list[Grant] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    acked: list[str] = field(default_factory=list)
    held_key: str = ""
    held_count: int = 0  # the holder's last acknowledged counter
    holder_calls: int = 0
    lapsed: int = 0  # workers' claims that ran out before their item was done
    refusals: list[str] = field(default_factory=list)
    played: list[Played] = field(default_factory=list)
    deciders: list[tuple[float, str | None]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started


def settings() -> tuple[int, float]:
    seed = os.environ.get("FENCEMARK_CHAOS_SEED")
    return (
        int(seed) if seed else random.SystemRandom().randrange(1 << 32),
        float(os.environ.get("FENCEMARK_CHAOS_SECONDS") or 0),
    )


SEED, EXTRA_S = settings()
KEEP = bool(os.environ.get("FENCEMARK_CHAOS_KEEP"))  # a failed run's containers left running


def client(cluster: MemberCluster, node: str, identity: str, timeout: float) -> AsyncClient:
    """A client of ``node`` as ``identity``, each call within ``timeout``, never retried
    by itself (the caller asks again, and records what it asked)."""
    credentials = cluster.client_credentials(identity)
    return AsyncClient(cluster.address(node), credentials=credentials, retries=0, timeout=timeout)


class Work:
    """The run's clients: three workers, a writer and a holder, each with an identity
    of its own (a claim is bound to its holder's) and a client per member."""

    def __init__(self, cluster: MemberCluster, history: History, stop: asyncio.Event) -> None:
        self.cluster = cluster
        self.history = history
        self.stop = stop
        self._clients: list[AsyncClient] = []

    def clients(self, identity: str) -> list[AsyncClient]:
        made = [client(self.cluster, m, identity, CALL_S) for m in MEMBERS]
        self._clients += made
        return made

    async def again(self, call: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """``call(...)`` until answered: a fault's refusals (a member gone, frozen or
        not deciding, no majority) are asked again; the end of the run stops it."""
        while not self.stop.is_set():
            try:
                return await call(*args, **kwargs)
            except (Unavailable, NotDecider):
                await asyncio.sleep(0.1)
            except FencemarkError as error:
                if error.code != grpc.StatusCode.CANCELLED:  # a member stopped mid-call
                    raise
                await asyncio.sleep(0.1)
        raise Stopped

    async def worker(self, owner: str) -> None:
        clients = self.clients(owner)
        h = self.history
        with contextlib.suppress(Stopped):
            while True:
                c = random.choice(clients)
                sent = h.now()
                picked = await self.again(c.claim_next, REPO, TOPIC, owner, lease_seconds=LEASE_S)
                if not picked.granted or picked.record is None:
                    await asyncio.sleep(0.1)
                    continue
                key, token = picked.record.key, picked.fencing_token
                h.grants.append(Grant(key, token, owner, sent, h.now()))
                try:
                    await self.again(c.update, key, fields={"by": owner}, fencing_token=token)
                    sent = h.now()
                    answer = await self.again(c.release_claim, key, token, outcome="done")
                except ClaimConflict:
                    # Its lease ran out while nobody could decide (etcd's outage is
                    # as long as a worker's lease): the item is another's to take.
                    h.lapsed += 1
                    continue
                h.releases.append(Release(key, token, sent, h.now(), answer.released))

    async def writer(self) -> None:
        clients = self.clients("writer")
        n = 0
        with contextlib.suppress(Stopped):
            while True:
                c = random.choice(clients)
                try:
                    made = await self.again(
                        c.remember, REPO, TOPIC, f"item-{n}", tags=[f"homeRegion:{REGION}"]
                    )
                    self.history.acked.append(made.record.key)
                except ClaimConflict:
                    pass  # asked again after a lost reply, and claimed meanwhile: made
                n += 1
                await asyncio.sleep(0.05)

    async def holder(self) -> None:
        clients = self.clients("holder")
        h = self.history
        with contextlib.suppress(Stopped):
            made = await self.again(clients[0].remember, REPO, "held", HELD,
                                    tags=[f"homeRegion:{REGION}"])  # fmt: skip
            key = h.held_key = made.record.key
            held = await self.again(clients[0].claim, key, "holder", lease_seconds=HOLDER_LEASE_S)
            assert held.granted, f"the holder's first claim: {held.reason}"
            token, n = held.fencing_token, 0
            while not await stopped(self.stop, 1.0):
                c = random.choice(clients)
                try:
                    renewed = await self.again(
                        c.renew_claim, key, token, lease_seconds=HOLDER_LEASE_S
                    )
                    if not renewed.renewed:
                        h.refusals.append(f"renewal at {h.now():.1f} s: {renewed.reason}")
                    n += 1
                    await self.again(c.update, key, fields={"n": str(n)}, fencing_token=token)
                    h.held_count = n
                except ClaimConflict as refused:
                    h.refusals.append(f"a fenced write at {h.now():.1f} s: {refused}")
                h.holder_calls += 2

    async def close(self) -> None:
        for client in self._clients:
            await client.close()


async def stopped(stop: asyncio.Event, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


class Nemesis:
    def __init__(
        self,
        cluster: MemberCluster,
        history: History,
        rng: random.Random,
        log: Callable[[str], None],
    ) -> None:
        self.cluster = cluster
        self.history = history
        self.rng = rng
        self.log = log
        self.readers = {m: client(cluster, m, "nemesis", 1.0) for m in MEMBERS}

    async def decider(self) -> str | None:
        """The member that says it decides and serves claims now (None: none does)."""
        for name, reader in self.readers.items():
            if await asyncio.to_thread(self.cluster.status, name) != "running":
                continue
            try:
                info = await reader.info()
            except FencemarkError:
                continue
            if info.decider is not None and info.decider.member == name and info.claims_serving:
                return name
        return None

    async def replaced(self, decider: str, limit: float) -> float | None:
        """Seconds until a member other than ``decider`` decides (None: not within
        ``limit``)."""
        began = time.monotonic()
        while (waited := time.monotonic() - began) < limit:
            if (name := await self.decider()) not in (None, decider):
                self.history.deciders.append((self.history.now(), name))
                return waited
            await asyncio.sleep(0.1)
        return None

    async def one_decides(self, limit: float) -> str | None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if (name := await self.decider()) is not None:
                self.history.deciders.append((self.history.now(), name))
                return name
            await asyncio.sleep(0.1)
        self.history.deciders.append((self.history.now(), None))
        return None

    async def play(self, kind: str) -> Played:
        c, h = self.cluster, self.history
        decider = await self.one_decides(DECIDER_LIMIT_S) or self.rng.choice(MEMBERS)
        other = self.rng.choice([m for m in MEMBERS if m != decider])
        played = Played(kind, decider, h.now())
        self.log(f"{kind}: the decider is {decider}")
        run = asyncio.to_thread
        if kind in ("kill-decider", "kill-decider-disk-lost"):
            await run(c.kill, decider)
            if kind == "kill-decider-disk-lost":
                await run(c.wipe, decider)
            await asyncio.sleep(TTL_S)
            await run(c.start_node, decider)
        elif kind == "pause-decider":
            await run(c.pause, decider)
            await asyncio.sleep(TTL_S + 3)
            await run(c.unpause, decider)
        elif kind == "cut-decider-from-etcd":
            await run(c.cut_from_etcd, decider)
            await asyncio.sleep(3 * TTL_S)
            await run(c.heal_network)
        elif kind == "cut-member-from-decider":
            await run(c.cut_members, decider, other)
            await asyncio.sleep(5)
            await run(c.heal_network)
        elif kind == "cut-decider-from-members":
            await run(c.cut_from_members, decider, [m for m in MEMBERS if m != decider])
            played.replaced = await self.replaced(decider, REPLACED_LIMIT_S + 5)
            self.log(f"  another member decides after {played.replaced or 0:.1f} s")
            await asyncio.sleep(BETWEEN_S)  # work goes on under it, the cut still there
            await run(c.heal_network)
        elif kind == "kill-etcd-leader":
            leader = await c.etcd_leader() or self.rng.choice(ETCDS)
            self.log(f"  etcd's leader is {leader}")
            await run(c.kill_etcd, [leader])
            await asyncio.sleep(3)
            await run(c.start_etcd, [leader])
        elif kind == "etcd-quorum-lost":
            two = self.rng.sample(ETCDS, 2)
            await run(c.kill_etcd, two)
            await asyncio.sleep(ETCD_OUTAGE_S)
            await run(c.start_etcd, two)
        elif kind == "disk-lost-then-decider-killed":
            await run(c.kill, other)
            await run(c.wipe, other)
            await run(c.start_node, other)
            await run(c.kill, decider)
            await asyncio.sleep(TTL_S)
            await run(c.start_node, decider)
        else:
            raise ValueError(f"no such fault kind: {kind}")
        played.healed = h.now()
        found = await self.one_decides(DECIDER_LIMIT_S)
        if found is not None:
            played.window = h.now() - played.healed
        self.log(f"  healed; {found or 'nobody'} decides after {played.window or 0:.1f} s")
        h.played.append(played)
        return played

    async def close(self) -> None:
        for reader in self.readers.values():
            await reader.close()


def lagging(finals: dict[str, dict[str, Record] | None]) -> str:
    """A few records each node is behind on, with the newest version's age and fence."""
    newest: dict[str, Record] = {}
    for records in finals.values():
        for key, record in (records or {}).items():
            have = newest.get(key)
            if have is None or versions({key: record})[key] > versions({key: have})[key]:
                newest[key] = record
    said = []
    for node, records in finals.items():
        behind = [
            k
            for k, r in newest.items()
            if records is not None
            and versions({k: r}) != versions({k: records[k]} if k in records else {})
        ]
        said.append(f"{node}: {', '.join(k.rsplit('/', 1)[-1] for k in behind[:4])}")
    return "; ".join(said)


def write_report(folder: Path, history: History, verdicts: list[Verdict]) -> bool:
    passed = all(v.ok for v in verdicts)
    report = {
        "seed": SEED,
        "extra_fault_seconds": EXTRA_S,
        "passed": passed,
        "invariants": [asdict(v) for v in verdicts],
        "played": [asdict(p) for p in history.played],
        # What the clients lived, for a failed run's post-mortem (times: the run's).
        "grants": [asdict(g) for g in history.grants],
        "releases": [asdict(r) for r in history.releases],
        "deciders": history.deciders,
    }
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Member chaos run, seed {SEED}", "", "| invariant | ok | detail |", "|---|---|---|"]
    lines += [f"| {v.name} | {'yes' if v.ok else 'NO'} | {v.detail} |" for v in verdicts]
    lines += ["", "| fault | decider | at (s) | replaced after (s) | healed (s) |"
              " next decider after (s) |", "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {p.kind} | {p.decider} | {p.at:.1f} | "
        f"{'' if p.replaced is None else f'{p.replaced:.1f}'} | {p.healed:.1f} | "
        f"{'none' if p.window is None else f'{p.window:.1f}'} |"
        for p in history.played
    ]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    # Items done per second, each fault's span shaded, each heal's wait for a decider.
    ends = [r.answered for r in history.releases if r.released]
    span = max([history.now(), *ends])
    seconds = list(range(int(span) + 1))
    per_second = [0] * len(seconds)
    for at in ends:
        per_second[int(at)] += 1
    pyplot = plotter()
    figure, axes = pyplot.subplots(figsize=(11, 4))
    axes.plot(seconds, per_second, color="tab:blue", label="items done per second")
    for p in history.played:
        axes.axvspan(p.at, p.healed, color="tab:red", alpha=0.15)
        if p.window is not None:
            axes.axvspan(p.healed, p.healed + p.window, color="tab:orange", alpha=0.25)
        axes.annotate(p.kind, (p.at, max(per_second, default=1)), rotation=60, fontsize=7)
    axes.set_xlabel("seconds into the run (red: a fault; orange: until a member decides)")
    axes.set_ylabel("items done")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(folder / "timeline.png", dpi=110)
    pyplot.close(figure)
    return passed


@pytest.mark.chaos
@pytest.mark.docker
@pytest.mark.timeout(EXTRA_S + 900)
async def test_a_region_of_three_members_keeps_its_promises_through_failovers(
    compose: list[str],
    image: str,
    etcd_image: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = random.Random(SEED)
    history = History()

    def log(text: str) -> None:
        with capsys.disabled():
            print(f"[member chaos {history.now():6.1f}s] {text}", flush=True)

    folder = results_folder(SEED, "members")
    log(f"seed {SEED} (replay: FENCEMARK_CHAOS_SEED={SEED}); report: {folder}")
    cluster = MemberCluster(
        compose, image, etcd_image, tmp_path / "members", run_id=uuid.uuid4().hex[:8], ttl_s=TTL_S
    )
    stop = asyncio.Event()
    work = Work(cluster, history, stop)
    nemesis: Nemesis | None = None
    verdicts: list[Verdict] = []
    try:
        await asyncio.to_thread(cluster.up)
        nemesis = Nemesis(cluster, history, rng, log)
        if await nemesis.one_decides(SERVING_LIMIT_S) is None:
            raise AssertionError(f"no member of {REGION} decides within {SERVING_LIMIT_S} s")
        log(
            f"{len(MEMBERS)} members, {len(ETCDS)} etcd and {' and '.join(OTHERS)}'s nodes up;"
            " one decides"
        )
        tasks = [asyncio.create_task(work.worker(f"worker-{i}")) for i in range(3)]
        tasks += [asyncio.create_task(work.writer()), asyncio.create_task(work.holder())]
        await asyncio.sleep(WARM_UP_S)
        kinds = list(KINDS)
        rng.shuffle(kinds)
        until = time.monotonic() + EXTRA_S
        try:
            for kind in kinds:
                await nemesis.play(kind)
                await asyncio.sleep(BETWEEN_S)
            while time.monotonic() < until:
                await nemesis.play(rng.choice(KINDS))
                await asyncio.sleep(BETWEEN_S)
        finally:
            stop.set()
            _, pending = await asyncio.wait(tasks, timeout=30)
            for task in pending:
                task.cancel()
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise AssertionError("a client task crashed") from task.exception()

        await asyncio.to_thread(cluster.heal_all)
        readers = {n: client(cluster, n, "reader", 5.0) for n in NODES}
        finals: dict[str, dict[str, Record] | None] = {}
        deadline = time.monotonic() + CONVERGE_LIMIT_S
        while True:
            for n, reader in readers.items():
                try:
                    listing = reader.iter_records(REPO, include_deleted=True)
                    finals[n] = {record.key: record async for record in listing}
                except FencemarkError:
                    finals[n] = None
            views = {n: None if r is None else versions(r) for n, r in finals.items()}
            behind = divergence(views)
            if all(b == 0 for b in behind.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        peers_said = ""
        if not all(b == 0 for b in behind.values()):  # what each lagging node says of its peers
            for n, reader in readers.items():
                if behind.get(n):
                    with contextlib.suppress(FencemarkError):
                        info = await reader.info()
                        peers_said += (
                            f" {n} sees "
                            + ", ".join(
                                f"{p.name} (synced {p.last_sync}, reachable {p.reachable},"
                                f" refused {p.merges_refused} {p.last_refusal!r},"
                                f" error {p.last_error!r})"
                                for p in info.peers
                            )
                            + f"; owes {info.owes_catch_up}, decider {info.decider};"
                        )
        for reader in readers.values():
            await reader.close()
        converged = Verdict(
            "every node converges",
            all(b == 0 for b in behind.values()),
            f"{len(NODES)} nodes byte-identical"
            if all(b == 0 for b in behind.values())
            else f"records behind, per node: {behind}; {lagging(finals)};{peers_said}",
        )
        verdicts = [
            claims_exclusive(history.grants, history.releases, LEASE_S),
            done_once(history.releases),
            acknowledged_kept(history.acked, finals, history.held_key, history.held_count, "n"),
            holders_kept(history.refusals, history.holder_calls),
            decider_after_each(
                {f"{i} {p.kind}": p.window for i, p in enumerate(history.played)}, DECIDER_LIMIT_S
            ),
            replaced_while_cut(
                {
                    f"{i} {p.kind}": p.replaced
                    for i, p in enumerate(history.played)
                    if p.kind == "cut-decider-from-members"
                },
                REPLACED_LIMIT_S,
            ),
            converged,
        ]
    finally:
        if nemesis is not None:
            await nemesis.close()
        await work.close()
        if KEEP and not all(v.ok for v in verdicts):
            label = f"label=fencemark.chaos={cluster.run_id}"
            log(
                f"kept for a look (FENCEMARK_CHAOS_KEEP): {cluster.addresses()}; remove with"
                f" docker rm -f $(docker ps -aq --filter {label});"
                f" docker network prune -f --filter {label}"
            )
        else:
            await asyncio.to_thread(cluster.close, folder / "logs")
    passed = write_report(folder, history, verdicts)
    for verdict in verdicts:
        log(f"{'ok  ' if verdict.ok else 'FAIL'} {verdict.name}: {verdict.detail}")
    log(f"report: {folder / 'report.md'}")
    assert passed, f"member chaos seed {SEED}: " + "; ".join(
        f"{v.name}: {v.detail}" for v in verdicts if not v.ok
    )
    missed = sorted(set(KINDS) - {p.kind for p in history.played})
    assert not missed, f"member chaos seed {SEED}: never played {missed}"
    # It ran: work was done across the faults, and the holder renewed throughout.
    assert len(history.grants) >= 20 and history.held_count >= 10, (
        len(history.grants),
        history.held_count,
    )
