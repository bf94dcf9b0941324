"""The replication chaos tier: three region containers, a seeded nemesis, fourteen invariants.

The nodes run mutual TLS, as deployed (cluster.py); every client of the test has a
certificate of the run's CA.

Run by the README's test command whenever a Docker engine answers, and required
under CI (``CI`` set: no engine is a failure, not a skip). The short run plays
every fault kind once (about two minutes); a long run is chosen by environment:

    FENCEMARK_CHAOS_LONG=1            # 30 minutes of faults
    FENCEMARK_CHAOS_SECONDS=600       # or exactly this many seconds of faults
    FENCEMARK_CHAOS_SEED=1234         # replay a run's faults (printed at its start)
    FENCEMARK_CHAOS_RESULTS=DIR       # where reports go (default tests/chaos/results)

Every run writes its report (report.json, report.md, timeline.png, history.jsonl,
logs/) and fails if any invariant is violated. docs/chaos.md explains it all.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, FencemarkError, Record
from fencemark.node.tools.proxy import ProxyMesh
from fencemark.node.tools.workload import History
from tests.chaos import report
from tests.chaos.checker import CONVERGE_ROUNDS, Convergence, check
from tests.chaos.claim_invariants import leases_recorded
from tests.chaos.cluster import ChaosCluster
from tests.chaos.forger import Forger
from tests.chaos.hasty import HastyWork, read_endings
from tests.chaos.nemesis import KINDS, Fault, Nemesis, Played, schedule, wait_for
from tests.chaos.queue_work import QueueWork
from tests.chaos.shapes import SPLIT_MEET_LIMIT_S, Shapes
from tests.chaos.watch_invariants import watched_in_order
from tests.chaos.watchers import MARKS, Watchers
from tests.chaos.workload import SAMPLE_TIMEOUT_S, Workload, all_records, divergence

REGIONS = ("us", "eu", "ap")
LEASE_SECONDS = 2.0
AGENTS_PER_REGION = 2
ANTI_ENTROPY_INTERVAL = 1.0
WARM_UP_S = 3.0  # a healthy workload before the first fault
COOL_DOWN_S = 3.0  # and after the last one
LONG_RUN_S = 1800.0
SERVING_LIMIT_S = 60.0


@dataclass(frozen=True)
class Settings:
    seed: int
    seconds: float  # fault time beyond playing every kind once (0: the short run)

    @classmethod
    def from_env(cls) -> Settings:
        seed = os.environ.get("FENCEMARK_CHAOS_SEED")
        seconds = os.environ.get("FENCEMARK_CHAOS_SECONDS")
        if seconds is None:
            seconds = str(LONG_RUN_S) if os.environ.get("FENCEMARK_CHAOS_LONG") else "0"
        return cls(
            seed=int(seed) if seed else random.SystemRandom().randrange(1 << 32),
            seconds=float(seconds),
        )


SETTINGS = Settings.from_env()


def by_kind(faults: Sequence[Fault | Played]) -> str:
    """``isolate x3, kill x2, ...``: how many of ``faults`` are of each kind."""
    return ", ".join(f"{k} x{n}" for k, n in Counter(f.kind for f in faults).items())


async def _all_serving(clients: dict[str, AsyncClient]) -> bool:
    try:
        return all([(await c.info()).claims_serving for c in clients.values()])
    except FencemarkError:
        return False


@pytest.mark.chaos
@pytest.mark.docker
@pytest.mark.alone  # it judges availability: a busy machine's stalls would be naps
@pytest.mark.timeout(SETTINGS.seconds + 900)
async def test_replication_keeps_its_promises_under_the_nemesis(
    image: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = SETTINGS
    rng = random.Random(settings.seed)
    history = History()

    def log(text: str) -> None:
        with capsys.disabled():
            print(f"[chaos {time.monotonic() - history.started:6.1f}s] {text}", flush=True)

    folder = report.results_folder(settings.seed)
    log(f"seed {settings.seed} (replay: FENCEMARK_CHAOS_SEED={settings.seed}); report: {folder}")
    cluster = ChaosCluster(
        image,
        REGIONS,
        tmp_path / "chaos",
        run_id=uuid.uuid4().hex[:8],
        anti_entropy_interval=ANTI_ENTROPY_INTERVAL,
    )
    mesh: ProxyMesh | None = None
    workload: Workload | None = None
    followers: Watchers | None = None
    try:
        await asyncio.to_thread(cluster.up)
        addresses = {r: cluster.regions[r].address for r in REGIONS}
        mesh = await ProxyMesh.start(addresses)
        workload = Workload(
            addresses,
            mesh,
            history,
            rng,
            cluster.client_credentials,
            lease_seconds=LEASE_SECONDS,
            agents_per_region=AGENTS_PER_REGION,
        )
        watchers = {r: workload.client(r, timeout=1.0) for r in REGIONS}
        took = await wait_for(
            "every region serving claims", lambda: _all_serving(watchers), SERVING_LIMIT_S
        )
        log(f"{len(REGIONS)} region containers serving claims after {took:.1f} s")
        await workload.prepare()
        agents = [agent.name for agent in workload.agents]
        faults = schedule(rng, REGIONS, agents, settings.seconds, LEASE_SECONDS)
        log(
            f"{len(faults)} faults scheduled (played until the run's time is spent, every"
            f" kind at least once): {by_kind(faults)}"
        )

        shapes = Shapes(workload)
        forger = Forger(workload, cluster.node_files)
        # After the schedule and the shapes drew from the run's rng: a seed replays
        # the same faults and shapes as before the work queue joined the workload.
        queue = QueueWork(workload)
        await queue.prepare()
        hasty = HastyWork(workload)  # after the queue drew: seeds replay as before it joined
        await hasty.prepare()
        log(f"{len(hasty.clients)} hasty clients, {len(hasty.shared)} shared hasty items")
        nemesis = Nemesis(cluster, mesh, workload.agents, workload.now, log, shapes, forger)
        followers = Watchers(workload)  # a watcher of the queue's topic at every node
        followers.start()
        stop = asyncio.Event()
        tasks = [*workload.tasks(stop), *shapes.tasks(stop), *queue.tasks(stop), *hasty.tasks(stop)]
        await asyncio.sleep(WARM_UP_S)
        try:
            await nemesis.play(faults, stop, until=workload.now() + settings.seconds)
            log(
                f"nemesis done: {len(nemesis.played)} faults played of {len(faults)} scheduled:"
                f" {by_kind(nemesis.played)}"
            )
            await asyncio.sleep(COOL_DOWN_S)
        finally:
            stop.set()
            # A split's holders and watch may still be on their way after the last heal.
            tasks += shapes.spawned
            _, pending = await asyncio.wait(tasks, timeout=LEASE_SECONDS + SPLIT_MEET_LIMIT_S + 5)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise AssertionError("a workload task crashed") from task.exception()

        # The final heal, then byte-identical replicas within CONVERGE_ROUNDS rounds.
        await asyncio.to_thread(cluster.heal_all)
        mesh.heal()
        heal_at = workload.now()
        log("final heal: every node up, every link clean; waiting for convergence")
        readers = {r: workload.client(r, timeout=SAMPLE_TIMEOUT_S) for r in REGIONS}
        finals: dict[str, dict[str, Record]] = {}

        async def identical() -> bool:
            sample, seen = await workload.look(readers)
            workload.samples.append(sample)
            if any(n is None or n > 0 for n in sample.divergent.values()):
                return False
            finals.update({r: records for r, records in seen.items() if records is not None})
            return True

        convergence: Convergence | None = None
        try:
            seconds = await wait_for(
                "byte-identical regions", identical, CONVERGE_ROUNDS * ANTI_ENTROPY_INTERVAL
            )
            convergence = Convergence(seconds, ANTI_ENTROPY_INTERVAL, len(finals[REGIONS[0]]))
            log(f"converged {seconds:.2f} s after the final heal")
        except TimeoutError as exc:
            log(str(exc))
            finals = {r: await all_records(c) for r, c in readers.items()}
        log(hasty.summary())
        # Every claimed record's latest claim event at its home: a lease that ran out
        # there must have been recorded lapsed (or released) by now (invariant 14).
        endings, unread = await read_endings(workload)
        await followers.finish()  # after the final states: its marks are no part of them
        watched = list(followers.logs.values())
        verdicts = check(
            history,
            nemesis.played,
            finals,
            workload.homes,
            convergence,
            lease_seconds=LEASE_SECONDS,
        )
        verdicts.append(watched_in_order(watched, history, nemesis.played, workload.homes, MARKS))
        verdicts.append(leases_recorded(history, endings, unread, nemesis.played, LEASE_SECONDS))
        written = report.write(
            folder,
            settings={
                "seed": settings.seed,
                "seconds": nemesis.played[-1].ended if nemesis.played else 0.0,
                "regions": len(REGIONS),
                "agents": len(agents),
                "queue_agents": len(queue.agents),
                "lease_seconds": LEASE_SECONDS,
                "anti_entropy_interval": ANTI_ENTROPY_INTERVAL,
                "extra_fault_seconds": settings.seconds,
            },
            verdicts=verdicts,
            played=nemesis.played,
            samples=workload.samples,
            history=history,
            heal_at=heal_at,
            watched=watched,
            scheduled=faults,
        )
    finally:
        if followers is not None:
            await followers.stop()
        await asyncio.to_thread(cluster.close, folder / "logs")
        if mesh is not None:
            await mesh.close()
        if workload is not None:
            await workload.close()
    for verdict in verdicts:
        log(f"{'ok  ' if verdict.ok else 'FAIL'} {verdict.name}: {verdict.detail}")
    log(f"report: {folder / 'report.md'}")
    assert written["passed"], (
        f"chaos seed {settings.seed}: "
        + "; ".join(f"{v.name}: {v.detail}" for v in verdicts if not v.ok)
        + f" (report: {folder})"
    )
    # A run that never managed to inject a kind of fault did not test what it claims.
    missed = sorted(set(KINDS) - {p.kind for p in nemesis.played if p.injected})
    assert not missed, f"chaos seed {settings.seed}: never injected {missed} (report: {folder})"


def test_divergence_counts_the_records_a_region_is_behind_on() -> None:
    views: dict[str, dict[str, tuple[float, bytes]] | None] = {
        "us": {"a": (1.0, b"1"), "b": (2.0, b"2")},
        "eu": {"a": (1.0, b"1"), "b": (1.0, b"3")},
        "ap": {"a": (1.0, b"1")},
        "xx": None,
    }
    assert divergence(views) == {"us": 0, "eu": 1, "ap": 1, "xx": None}
    same = {"a": (1.0, b"1")}
    assert divergence({"us": same, "eu": dict(same)}) == {"us": 0, "eu": 0}
    # Equal times, different states (a renewal does not move updated_at): both count
    # as different, and one of them as behind.
    split = divergence({"us": {"a": (1.0, b"1")}, "eu": {"a": (1.0, b"2")}})
    assert split == {"us": 1, "eu": 0}
