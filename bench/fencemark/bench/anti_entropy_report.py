"""What the anti-entropy scenario found (``Repair``) and its report: tables, targets
and plots (``fencemark.bench.anti_entropy`` measures)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fencemark.bench import plots as charts
from fencemark.bench.results import Settings, Table, Target, at_least, at_most, fmt


@dataclass
class Repair:
    k: int
    canonical_bytes: int
    repair_bytes: int
    seconds: float
    timeline: list[tuple[float, int]]  # (seconds since heal, differing level-2 tree nodes at ap)
    links: dict[str, int]  # bytes each node-to-node link moved (src->dst: src's calls to dst)

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "canonical_bytes": self.canonical_bytes,
            "repair_bytes": self.repair_bytes,
            "repair_over_canonical": self.repair_bytes / self.canonical_bytes
            if self.canonical_bytes
            else float("nan"),
            "seconds_to_identical": self.seconds,
            "bytes_by_link": self.links,
        }


def tables(
    settings: Settings,
    in_sync: list[dict[str, Any]],
    repairs: list[Repair],
    naive: dict[str, Any],
) -> list[Table]:
    sync_table = Table(
        f"In-sync anti-entropy round (median of {settings.in_sync_rounds} rounds)",
        ["records", "bytes on the wire", "message bytes", "in sync"],
        [
            [fmt(r["records"]), fmt(r["wire_bytes"]), fmt(r["message_bytes"]),
             "yes" if r["all_in_sync"] else "NO"]
            for r in in_sync
        ],
    )  # fmt: skip
    repair_table = Table(
        f"Repair after a partition: three regions, {settings.divergence_base:,} records,"
        " K updated at us while ap was cut off",
        ["K", "canonical bytes of the K states", "bytes moved by repair", "ratio",
         "seconds to byte-identical", "naive full-state bytes"],
        [
            [fmt(r.k), fmt(r.canonical_bytes), fmt(r.repair_bytes),
             f"{fmt(r.repair_bytes / r.canonical_bytes, 2)}x", fmt(r.seconds, 2),
             fmt(naive["wire_bytes"])]
            for r in repairs
        ],
    )  # fmt: skip
    return [sync_table, repair_table]


def targets(in_sync: list[dict[str, Any]], repairs: list[Repair]) -> list[Target]:
    largest = max(in_sync, key=lambda r: r["records"])
    targets = [
        at_most(
            f"in-sync round at {largest['records']:,} records",
            largest["wire_bytes"],
            1024,
            " bytes",
        )
    ]
    for r in repairs:
        targets.append(
            at_most(
                f"repair bytes / canonical bytes, K={r.k:,}",
                r.repair_bytes / r.canonical_bytes if r.canonical_bytes else float("nan"),
                1.5,
                "x",
            )
        )
    for r in repairs:
        if r.k == 10_000:
            targets.append(at_most("10k divergent records converge", r.seconds, 5, " s"))
    flat = [r["wire_bytes"] for r in in_sync]
    targets.append(
        at_least("in-sync round is flat (smallest / largest)", min(flat) / max(flat), 0.9, "")
    )
    return targets


def plots(
    settings: Settings,
    out: Path,
    in_sync: list[dict[str, Any]],
    repairs: list[Repair],
    naive: dict[str, Any],
) -> list[Path]:
    plot_bytes = charts.lines(
        out / "anti_entropy_bytes.png",
        "Anti-entropy bytes",
        {
            "in-sync round (x = records)": (
                [r["records"] for r in in_sync],
                [r["wire_bytes"] for r in in_sync],
            ),
            "repair (x = K differing)": (
                [r.k for r in repairs],
                [r.repair_bytes for r in repairs],
            ),
            "canonical bytes of the K states": (
                [r.k for r in repairs],
                [r.canonical_bytes for r in repairs],
            ),
            f"naive full-state transfer ({settings.divergence_base:,} records)": (
                [r.k for r in repairs],
                [naive["wire_bytes"] for _ in repairs],
            ),
        },
        "records (in sync) or K differing records (repair)",
        "bytes (log scale)",
        logx=True,
        logy=True,
    )
    plot_converge = charts.lines(
        out / "anti_entropy_convergence.png",
        "Convergence after the heal: differing level-2 tree nodes, ap vs us",
        {
            f"K={r.k:,}": ([t for t, _ in r.timeline], [float(d) for _, d in r.timeline])
            for r in repairs
        },
        "seconds since the heal",
        "differing tree nodes (of 256)",
    )
    return [plot_bytes, plot_converge]
