"""What a scenario hands back, and how a run is configured."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Settings:
    """How long and how large a run is: ``full()`` for the figures, ``quick()`` for a smoke run."""

    quick: bool
    repeats: int  # every figure is the median over this many runs
    warmup: float  # seconds before a load window starts counting
    duration: float  # seconds of one load window
    concurrency: tuple[int, ...]
    records_per_client: int  # claim-cycle and write records, used in turn
    lag_seconds: float
    lag_write_rate: float  # background writes per second during the lag scenario
    lag_probe_interval: float
    in_sync_records: tuple[int, ...]
    in_sync_rounds: int
    divergence: tuple[int, ...]  # K records diverged during a partition
    divergence_base: int  # records the three regions hold before the partition
    footprint_records: int
    drain_items: int  # the backlog the agents drain
    pick_records: tuple[int, ...]  # records in the topic a pick's cost is measured at
    pick_samples: int  # picks (and claims by key) per size
    feed_seconds: float  # writes whose events are timed from the writer to each watcher
    feed_write_rate: float  # writes per second at the writer meanwhile (open loop)
    feed_watchers: tuple[int, ...]  # Watch streams attached while the write path is measured
    feed_writers: int  # closed-loop clients writing while the watchers watch
    wan_rtts_ms: tuple[int, ...]  # round trips between regions the wan scenario runs at
    wan_agents: tuple[int, ...]  # agents per region
    wan_window_s: float  # how long each system drains at each (agents, R)
    wan_cut_phases: tuple[float, float, float]  # steady, cut off, healed (seconds)
    failover_kill_s: float  # into the failover drain, the leader is killed
    failover_after_s: float  # the drain goes on this long past the failover's window
    failover_bin_s: float  # the timeline's bins

    @classmethod
    def full(cls) -> Settings:
        return cls(
            quick=False,
            repeats=3,
            warmup=0.5,
            duration=3.0,
            concurrency=(1, 16, 64),
            records_per_client=16,
            lag_seconds=20.0,
            lag_write_rate=200.0,
            lag_probe_interval=0.02,
            in_sync_records=(1_000, 10_000, 100_000),
            in_sync_rounds=5,
            divergence=(100, 1_000, 10_000),
            divergence_base=20_000,
            footprint_records=100_000,
            drain_items=2_000,
            pick_records=(1_000, 10_000, 100_000),
            pick_samples=200,
            feed_seconds=20.0,
            feed_write_rate=100.0,
            feed_watchers=(0, 1, 100),
            feed_writers=16,
            wan_rtts_ms=(0, 50, 150),
            wan_agents=(4, 16),
            wan_window_s=3.0,
            wan_cut_phases=(4.0, 20.0, 8.0),
            failover_kill_s=10.0,
            failover_after_s=10.0,
            failover_bin_s=1.0,
        )

    @classmethod
    def quick_run(cls) -> Settings:
        return cls(
            quick=True,
            repeats=1,
            warmup=0.2,
            duration=0.8,
            concurrency=(1, 16, 64),
            records_per_client=2,
            lag_seconds=3.0,
            lag_write_rate=50.0,
            lag_probe_interval=0.05,
            in_sync_records=(1_000, 5_000),
            in_sync_rounds=2,
            divergence=(100, 500),
            divergence_base=1_000,
            footprint_records=5_000,
            drain_items=200,
            pick_records=(1_000, 2_000),
            pick_samples=50,
            feed_seconds=3.0,
            feed_write_rate=50.0,
            feed_watchers=(0, 1, 100),
            feed_writers=16,
            wan_rtts_ms=(50,),
            wan_agents=(4,),
            wan_window_s=2.0,
            wan_cut_phases=(2.0, 4.0, 3.0),
            failover_kill_s=2.0,
            failover_after_s=2.0,
            failover_bin_s=0.5,
        )


@dataclass
class Target:
    """One target of issue 6, judged on this run's figures (never asserted by tests)."""

    name: str
    goal: str
    measured: float
    unit: str
    met: bool | None  # None: not measured in this run

    @property
    def verdict(self) -> str:
        return {True: "met", False: "NOT met", None: "not measured"}[self.met]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "goal": self.goal,
            "measured": _finite(self.measured),
            "unit": self.unit,
            "met": self.met,
        }


def at_least(name: str, measured: float, goal: float, unit: str) -> Target:
    met = None if math.isnan(measured) else measured >= goal
    return Target(name, f"≥ {goal:g}{unit}", measured, unit, met)


def at_most(name: str, measured: float, goal: float, unit: str) -> Target:
    met = None if math.isnan(measured) else measured <= goal
    return Target(name, f"≤ {goal:g}{unit}", measured, unit, met)


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [
            f"**{self.title}**",
            "",
            "| " + " | ".join(self.header) + " |",
            "|" + "|".join("---" for _ in self.header) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class ScenarioResult:
    name: str
    title: str
    data: dict[str, Any]
    tables: list[Table]
    targets: list[Target] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "data": _finite(self.data),
            "targets": [t.to_json() for t in self.targets],
            "plots": [p.name for p in self.plots],
            "notes": self.notes,
        }


def _finite(value: Any) -> Any:
    """JSON has no NaN: unmeasured figures become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def fmt(value: float, digits: int = 0) -> str:
    if not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"
