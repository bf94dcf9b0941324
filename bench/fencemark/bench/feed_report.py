"""The ``feed`` scenario's tables, figures and plot (``feed.py`` measures, this reports)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fencemark.bench import plots
from fencemark.bench.feed_cost import CostRun, summary
from fencemark.bench.results import ScenarioResult, Settings, Table, fmt
from fencemark.bench.stats import paired_ratio, percentile

SAME_REGION = "us"
CROSS_REGION = ("eu", "ap")


@dataclass
class Delivered:
    """What the delivery part saw: per region, each acknowledged write's latency."""

    writes: int  # acknowledged
    skipped: int  # due while the writer was behind: not written
    errors: int
    latencies: dict[str, list[float | None]] = field(default_factory=dict)  # s; None: unseen
    merged: dict[str, int] = field(default_factory=dict)  # delivered by a later write's event
    events: dict[str, int] = field(default_factory=dict)  # events of the written records


def _figures(latencies: Sequence[float | None]) -> dict[str, Any]:
    ms = [s * 1000 for s in latencies if s is not None]
    return {
        "delivered": len(ms),
        "undelivered": len(latencies) - len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms, default=math.nan),
        "before_ack": sum(1 for s in ms if s <= 0),
    }


def _delivery(delivered: Delivered, settings: Settings) -> tuple[Table, dict[str, Any]]:
    table = Table(
        f"Change feed delivery: write acknowledged at us → event received, three regions on"
        f" loopback, {settings.feed_write_rate:.0f} writes/s at us for"
        f" {settings.feed_seconds:.0f} s ({delivered.writes:,} writes)",
        ["watcher at", "events", "writes delivered", "p50 ms", "p99 ms", "max ms",
         "received before the ack", "merged with a later write"],
    )  # fmt: skip
    data: dict[str, Any] = {
        "writes": delivered.writes,
        "skipped": delivered.skipped,
        "errors": delivered.errors,
    }
    rows: dict[str, tuple[list[float | None], int, int]] = {
        region: (delivered.latencies[region], delivered.events[region], delivered.merged[region])
        for region in (SAME_REGION, *CROSS_REGION)
    }
    rows["eu and ap"] = (
        [s for r in CROSS_REGION for s in delivered.latencies[r]],
        sum(delivered.events[r] for r in CROSS_REGION),
        sum(delivered.merged[r] for r in CROSS_REGION),
    )
    for name, (latencies, events, merged) in rows.items():
        f = _figures(latencies)
        label = f"{name} (the writer's region)" if name == SAME_REGION else name
        table.rows.append([
            label, fmt(events), fmt(f["delivered"]), fmt(f["p50_ms"], 1), fmt(f["p99_ms"], 1),
            fmt(f["max_ms"], 1), fmt(f["before_ack"]), fmt(merged),
        ])  # fmt: skip
        key = "cross_region" if name == "eu and ap" else name
        data[key] = {**f, "events": events, "merged": merged}
    return table, data


def _cost(costs: dict[int, list[CostRun]], settings: Settings) -> tuple[Table, dict[str, Any]]:
    base = min(costs)
    table = Table(
        f"Writes at us with watchers of the topic attached (every watcher at us),"
        f" {settings.feed_writers} writers, medians over {settings.repeats} runs",
        ["watchers", "writes/s", "write p50 ms", "write p99 ms", "node CPU ms per write",
         "events not received", f"writes/s vs {base}", f"p99 vs {base}",
         f"CPU per write vs {base}"],
    )  # fmt: skip
    data: dict[str, Any] = {"writers": settings.feed_writers}
    for count, runs in costs.items():
        s = summary(runs)
        s["rate_vs_none"] = paired_ratio(
            [r.load.rate for r in runs], [r.load.rate for r in costs[base]]
        )
        s["p99_vs_none"] = paired_ratio(
            [r.load.p(99) for r in runs], [r.load.p(99) for r in costs[base]]
        )
        s["cpu_vs_none"] = paired_ratio(
            [r.cpu_ms_per_write for r in runs], [r.cpu_ms_per_write for r in costs[base]]
        )
        data[str(count)] = s
        table.rows.append([
            fmt(count), fmt(s["writes_per_s"]), fmt(s["p50_ms"], 2), fmt(s["p99_ms"], 2),
            fmt(s["node_cpu_ms_per_write"], 2), fmt(s["events_missed"]),
            f"{fmt(s['rate_vs_none'], 2)}x", f"{fmt(s['p99_vs_none'], 2)}x",
            f"{fmt(s['cpu_vs_none'], 2)}x",
        ])  # fmt: skip
    return table, data


def _plot(delivered: Delivered, costs: dict[int, list[CostRun]], out: Path) -> Path:
    def ms(latencies: Sequence[float | None]) -> list[float]:
        return [s * 1000 for s in latencies if s is not None]

    delivery = {
        f"at {r}{' (same region)' if r == SAME_REGION else ''}": ms(delivered.latencies[r])
        for r in (SAME_REGION, *CROSS_REGION)
    }
    writes = {
        f"{count} watcher{'' if count == 1 else 's'}": [
            s * 1000 for run in runs for s in run.load.latencies
        ]
        for count, runs in costs.items()
    }
    return plots.latency_cdfs(
        out / "feed_latency.png",
        "Change feed: delivery to each region, and the writer's latency under watchers",
        {"write acknowledged at us → event received": delivery,
         "write latency at us, by watchers attached": writes},
    )  # fmt: skip


def report(
    delivered: Delivered, costs: dict[int, list[CostRun]], settings: Settings, out: Path
) -> ScenarioResult:
    delivery_table, delivery = _delivery(delivered, settings)
    cost_table, cost = _cost(costs, settings)
    notes = []
    if delivered.skipped:
        notes.append(f"{delivered.skipped} writes were due while the writer was behind: skipped")
    if delivered.errors:
        notes.append(f"{delivered.errors} writes failed")
    if before := delivery[SAME_REGION]["before_ack"]:
        notes.append(
            f"{before} events at us were received before the writer heard its acknowledgement"
            " (a latency of 0 or less, left out of the plot's log scale)"
        )
    return ScenarioResult(
        "feed",
        "Change feed",
        {"delivery": delivery, "cost": cost},
        [delivery_table, cost_table],
        [],
        [_plot(delivered, costs, out)],
        notes,
    )
