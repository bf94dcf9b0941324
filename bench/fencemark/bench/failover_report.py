"""The ``failover`` scenario's figures from its ledgers, and its report: tables,
targets, notes and the timeline plot (``fencemark.bench.failover`` measures)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fencemark.bench import plots
from fencemark.bench.failover_agents import DRAIN, Finished, Ledger
from fencemark.bench.ha_servers import SENTINEL_DOWN_AFTER_MS, MemberRegion
from fencemark.bench.load import LoadResult
from fencemark.bench.records import REPO
from fencemark.bench.results import ScenarioResult, Settings, Table, Target, at_least, at_most, fmt
from fencemark.bench.stats import median, paired_ratio, percentile
from fencemark.bench.work_queues import RESULT
from fencemark.client import AsyncClient

SYSTEMS = ("fencemark", "etcd", "redis")
KILLED = {"fencemark": "the decider", "etcd": "the leader", "redis": "the primary"}
CONVERGE_LIMIT_S = 30.0
TTL_S = 2  # the decider's lease the target is judged at (failover.DECIDER_TTL_S)


# -- figures from a ledger -----------------------------------------------------------------


def _ms(done: Sequence[Finished], q: float) -> float:
    return percentile([(f.ended - f.began) * 1000 for f in done], q)


def drained(
    ledger: Ledger, items: int, cpu_s: float, *, deciding_cpu_s: float = math.nan
) -> dict[str, Any]:
    """A drain without a kill: items/s from the first take to the last item done;
    ``cpu_s`` of every server process, ``deciding_cpu_s`` of the one that decides."""
    done = ledger.finished
    seconds = max((f.ended for f in done), default=math.nan)
    counts = Counter(f.item for f in done)
    return {
        "items": len(done),
        "seeded": items,
        "rate": len(done) / seconds if done and seconds > 0 else math.nan,
        "p50_ms": _ms(done, 50),
        "p99_ms": _ms(done, 99),
        "cpu_ms_per_item": 1000 * cpu_s / len(done) if done else math.nan,
        "deciding_cpu_ms_per_item": 1000 * deciding_cpu_s / len(done) if done else math.nan,
        "errors": sum(ledger.errors.values()),
        "exactly_once": len(counts) == items and all(n == 1 for n in counts.values()),
    }


def failover_figures(
    ledger: Ledger, items: int, settings: Settings, done: Mapping[str, str]
) -> dict[str, Any]:
    """The figures of one drain with a kill; ``done``: each item done in the final
    state, with its result."""
    killed = ledger.killed_at
    first = ledger.first_grant_after(killed)
    finished = ledger.finished
    end = max((f.ended for f in finished), default=math.nan)
    before = [f for f in finished if f.ended < killed]
    after = [f for f in finished if f.began >= first]
    across = [f for f in finished if f.began < first and f.ended >= killed]
    counts = Counter(f.item for f in finished)
    drains: defaultdict[str, int] = defaultdict(int)
    tokens: defaultdict[str, list[tuple[float, int]]] = defaultdict(list)
    for grant in ledger.grants:
        tokens[grant.item].append((grant.at, grant.token))
        if grant.kind == DRAIN:
            drains[grant.item] += 1
    reused = below = 0
    for granted in tokens.values():
        values = [t for _, t in granted]
        reused += len(values) - len(set(values))
        highest = 0
        for _, token in sorted(granted):
            below += token < highest
            highest = max(highest, token)
    finished_before = {f.item for f in before}
    held_across = sum(1 for g in ledger.grants if g.at < killed and g.item not in finished_before)
    acknowledged = [f for f in finished if f.acknowledged]
    return {
        "seeded": items,
        "finished": len(finished),
        "killed_at_s": killed,
        "first_grant_s": first,
        "window_s": first - killed,
        "rate_before": len(before) / killed if killed > 0 else math.nan,
        "rate_after": len(after) / (end - first) if end > first else math.nan,
        "p99_before_ms": _ms(before, 99),
        "p99_after_ms": _ms(after, 99),
        "slowest_across_ms": max(((f.ended - f.began) * 1000 for f in across), default=0.0),
        "done_twice": sum(n - 1 for n in counts.values() if n > 1),
        "handed_out_twice": sum(1 for n in drains.values() if n > 1),
        "tokens_reused": reused,
        "tokens_below_earlier": below,
        "lost": sum(1 for f in acknowledged if done.get(f.item) != RESULT["result"]),
        "unacknowledged_done": len(finished) - len(acknowledged),
        "claims_across": held_across,
        "claims_lost": len(ledger.lost_claims),
        "lost_claims": list(ledger.lost_claims),
        "errors": dict(ledger.errors),
        "said": dict(ledger.said),
        "ran_dry": ledger.ran_dry,
        "after_s": settings.failover_after_s,
    }


def price(
    drains: Mapping[str, list[dict[str, Any]]], cycles: Mapping[str, list[LoadResult]]
) -> dict[str, Any]:
    """Medians over the repeats of one node's and three members' figures, and ratios
    paired per repeat."""
    out: dict[str, Any] = {}
    for name in drains:
        runs = drains[name]
        loops = cycles[name]
        out[name] = {
            "drain": {
                "ops_per_s": median([r["rate"] for r in runs]),
                "p99_ms": median([r["p99_ms"] for r in runs]),
                "cpu_ms_per_item": median([r["cpu_ms_per_item"] for r in runs]),
                "deciding_cpu_ms_per_item": median([r["deciding_cpu_ms_per_item"] for r in runs]),
                "errors": sum(r["errors"] for r in runs),
                "exactly_once": all(r["exactly_once"] for r in runs),
            },
            "cycles": {
                "ops_per_s": median([r.rate for r in loops]),
                "p50_ms": median([r.p(50) for r in loops]),
                "p99_ms": median([r.p(99) for r in loops]),
                "errors": sum(r.errors for r in loops),
            },
        }
    one, three = drains["one_node"], drains["three_members"]
    out["drain_ratio"] = paired_ratio([r["rate"] for r in three], [r["rate"] for r in one])
    out["cpu_ratio"] = paired_ratio(
        [r["cpu_ms_per_item"] for r in three], [r["cpu_ms_per_item"] for r in one]
    )
    # What the drain is bound by when each member has a machine of its own and the
    # deciding process's CPU is the bound, as one node's is: one node's CPU per item
    # over the decider's (a bound derived from CPU measured here, not a rate measured).
    out["own_machines_bound"] = paired_ratio(
        [r["deciding_cpu_ms_per_item"] for r in one],
        [r["deciding_cpu_ms_per_item"] for r in three],
    )
    out["cycle_ratio"] = paired_ratio(
        [r.rate for r in cycles["three_members"]], [r.rate for r in cycles["one_node"]]
    )
    return out


async def fencemark_final(region: MemberRegion, topic: str) -> dict[str, Any]:
    """Once the agents stopped: how long until the members left hold the same states,
    and the items done (with their result) at every one of them."""
    clients = {n: AsyncClient(m.address, retries=2, timeout=30) for n, m in region.alive().items()}
    began = asyncio.get_running_loop().time()
    try:
        while True:
            states = {}
            for name, client in clients.items():
                states[name] = {r.key: r async for r in client.iter_records(REPO, topic=topic)}
            digests = [{k: r.digest for k, r in s.items()} for s in states.values()]
            identical = all(d == digests[0] for d in digests)
            waited = asyncio.get_running_loop().time() - began
            if identical or waited > CONVERGE_LIMIT_S:
                done: dict[str, str] = {}
                for key, record in next(iter(states.values())).items():
                    everywhere = [s.get(key) for s in states.values()]
                    if all(r is not None and r.status == "done" for r in everywhere):
                        done[key] = record.fields.get("result", "")
                return {"identical": identical, "after_s": waited, "done": done}
            await asyncio.sleep(0.2)
    finally:
        await asyncio.gather(*(c.close() for c in clients.values()))


# -- the report ----------------------------------------------------------------------------


def report(
    settings: Settings,
    price_: dict[str, Any],
    steady: dict[str, dict[str, Any]],
    runs: dict[str, dict[str, Any]],
    out: Path,
) -> ScenarioResult:
    ledgers: dict[str, Ledger] = {s: runs[s].pop("ledger") for s in SYSTEMS}
    data: dict[str, Any] = {
        "agents": 16,
        "decider_ttl_s": TTL_S,
        "sentinel_down_after_ms": SENTINEL_DOWN_AFTER_MS,
        "kill_at_s": settings.failover_kill_s,
        "failover": runs,
        "steady": steady,
        "price": price_,
    }
    return ScenarioResult(
        "failover",
        "Failover: the leader killed under a drain, vs etcd and Redis with Sentinel",
        data,
        _tables(settings, data),
        _targets(data),
        [_timeline(settings, ledgers, out)],
        _notes(data),
    )


def _tables(settings: Settings, data: dict[str, Any]) -> list[Table]:
    runs = data["failover"]
    window = Table(
        f"The failover: 16 agents draining, the leader killed (SIGKILL) at"
        f" {fmt(settings.failover_kill_s, 1)} s; the window is the kill to the first grant"
        " asked after it",
        ["system", "killed", "window s", "items/s before", "items/s after", "p99 before ms",
         "p99 after ms", "slowest item across ms", "calls refused or failed"],
    )  # fmt: skip
    ledger = Table(
        "The ledger, against each system's final state",
        ["system", "items done", "done twice", "handed out twice", "acknowledged results lost",
         "tokens granted twice", "claims held across the kill", "lost by their holders"],
    )  # fmt: skip
    for system in SYSTEMS:
        row = runs[system]
        window.rows.append([
            system, KILLED[system], fmt(row["window_s"], 2), fmt(row["rate_before"]),
            fmt(row["rate_after"]), fmt(row["p99_before_ms"], 1), fmt(row["p99_after_ms"], 1),
            fmt(row["slowest_across_ms"]), fmt(sum(row["errors"].values())),
        ])  # fmt: skip
        lost_claims = str(row["claims_lost"]) if system == "fencemark" else "not tracked"
        ledger.rows.append([
            system, fmt(row["finished"]), str(row["done_twice"]), str(row["handed_out_twice"]),
            str(row["lost"]), str(row["tokens_reused"] + row["tokens_below_earlier"]),
            str(row["claims_across"]), lost_claims,
        ])  # fmt: skip
    price_ = data["price"]
    one, three = price_["one_node"], price_["three_members"]
    cost = Table(
        f"The steady-state price: one node against a region of three members, 16 agents"
        f" or clients, medians over {settings.repeats} runs",
        ["figure", "one node", "three members", "three / one"],
    )
    cost.rows += [
        ["drain items/s", fmt(one["drain"]["ops_per_s"]), fmt(three["drain"]["ops_per_s"]),
         f"{fmt(price_['drain_ratio'], 2)}x"],
        ["drain p99 per item ms", fmt(one["drain"]["p99_ms"], 1),
         fmt(three["drain"]["p99_ms"], 1), "-"],
        ["server CPU ms per drained item (every member)", fmt(one["drain"]["cpu_ms_per_item"], 2),
         fmt(three["drain"]["cpu_ms_per_item"], 2), f"{fmt(price_['cpu_ratio'], 2)}x"],
        ["server CPU ms per drained item (the deciding process alone)",
         fmt(one["drain"]["deciding_cpu_ms_per_item"], 2),
         fmt(three["drain"]["deciding_cpu_ms_per_item"], 2), "-"],
        ["drain bound, each member on a machine of its own (one node's CPU per item / the"
         " decider's; derived, not measured)", "-", "-",
         f"{fmt(price_['own_machines_bound'], 2)}x"],
        ["claim cycles/s", fmt(one["cycles"]["ops_per_s"]), fmt(three["cycles"]["ops_per_s"]),
         f"{fmt(price_['cycle_ratio'], 2)}x"],
        ["claim cycle p99 ms", fmt(one["cycles"]["p99_ms"], 1),
         fmt(three["cycles"]["p99_ms"], 1), "-"],
    ]  # fmt: skip
    steady = data["steady"]
    baselines = Table(
        f"The baselines without a kill: 16 agents drain {settings.drain_items:,} items",
        ["system", "items/s", "p99 per item ms"],
        [[f"{s} ({'three members' if s == 'etcd' else 'primary, replica, Sentinels'})",
          fmt(steady[s]["rate"]), fmt(steady[s]["p99_ms"], 1)] for s in ("etcd", "redis")],
    )  # fmt: skip
    return [window, ledger, cost, baselines]


def _targets(data: dict[str, Any]) -> list[Target]:
    fm = data["failover"]["fencemark"]
    return [
        at_most(f"failover window: decider killed → first grant (decider TTL {TTL_S} s)",
                fm["window_s"], 5, " s"),
        at_most("items done twice across the failover", fm["done_twice"], 0, ""),
        at_most("acknowledged results lost across the failover", fm["lost"], 0, ""),
        at_most("tokens granted twice across the failover",
                fm["tokens_reused"] + fm["tokens_below_earlier"], 0, ""),
        at_most("claims held across the failover lost by their holders", fm["claims_lost"], 0, ""),
        at_least("drain items/s, three members / one node, 16 agents",
                 data["price"]["drain_ratio"], 0.7, "x"),
    ]  # fmt: skip


def _notes(data: dict[str, Any]) -> list[str]:
    runs = data["failover"]
    fm = runs["fencemark"]
    notes = [
        f"Fencemark: {fm['killed']} killed, {fm['new_decider']} decided next; {fm['holders']}"
        f" claims by key held across the kill, renewed {fm['holder_renewals']} times in all,"
        " then written, released, and claimed again above their token. The members left"
        + (" held identical states" if fm["identical"] else " did NOT hold identical states")
        + f" {fmt(fm['identical_after_s'], 1)} s after the agents stopped.",
        f"Redis Sentinel calls a primary down after {data['sentinel_down_after_ms']:,} ms"
        " (the decider's lease); etcd elects with its default 1 s election timeout.",
    ]
    for system in SYSTEMS:
        row = runs[system]
        said = row.get("said", {})
        errors = (
            ", ".join(
                f"{k} {v:,}"
                + (f" ({said[k]!r})" if k in said and k[:1].isupper() and not k.isupper() else "")
                for k, v in sorted(row["errors"].items())
            )
            or "none"
        )
        notes.append(f"{system}: calls refused or failed across the kill: {errors}.")
        if row["lost_claims"]:
            notes.append(f"{system}: claims lost by their holders: {'; '.join(row['lost_claims'])}")
        if row["unacknowledged_done"]:
            notes.append(
                f"{system}: {row['unacknowledged_done']} items done whose acknowledgement was"
                " lost with the kill (asked again, the release said it was made)."
            )
        if row["ran_dry"]:
            notes.append(f"{system}: the backlog ran out before the run ended.")
    for name in ("one_node", "three_members"):
        if not data["price"][name]["drain"]["exactly_once"]:
            notes.append(f"{name}: a steady drain did NOT hand out every item exactly once.")
    return notes


def _timeline(settings: Settings, ledgers: Mapping[str, Ledger], out: Path) -> Path:
    width = settings.failover_bin_s
    panels: dict[str, tuple[list[float], list[float], dict[str, float]]] = {}
    for system, ledger in ledgers.items():
        killed = ledger.killed_at
        ends = [f.ended - killed for f in ledger.finished]
        start = -killed
        stop = max(ends, default=0.0)
        bins = max(1, math.ceil((stop - start) / width))
        counts = [0] * bins
        for end in ends:
            counts[min(bins - 1, int((end - start) / width))] += 1
        xs = [start + (i + 0.5) * width for i in range(bins)]
        ys = [c / width for c in counts]
        first = ledger.first_grant_after(killed) - killed
        panels[f"{system} ({KILLED[system]} killed)"] = (
            xs,
            ys,
            {"kill": 0.0, f"first grant ({fmt(first, 2)} s)": first},
        )
    return plots.timelines(
        out / "failover_timeline.png",
        f"Items done per second across the kill (bins of {width:g} s)",
        panels, "seconds from the kill", "items/s",
    )  # fmt: skip
