"""A chaos run's report: ``report.json``, ``report.md`` and ``timeline.png``.

Written under the results folder (``tests/chaos/results/<run>/`` unless
``FENCEMARK_CHAOS_RESULTS`` names another), beside ``history.jsonl`` (every
event) and ``logs/`` (each container's log); ``results/latest`` points at the
newest run; ``watch-<region>.jsonl`` holds what each region's watcher received
(one line per event, a line per segment's end). The faults are counted as played,
by kind, beside the schedule (a long run's time limit stops the nemesis before the
end of its schedule). docs/chaos.md explains how to read them.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

from fencemark.node.tools.workload import History
from tests.chaos.checker import Verdict
from tests.chaos.claim_invariants import stale_wakes
from tests.chaos.nemesis import Fault, Played
from tests.chaos.watch_invariants import WatchLog
from tests.chaos.workload import Sample


def plotter() -> ModuleType:
    """matplotlib's pyplot, drawing to files only. Imported when a report is drawn,
    not when the suite is collected: every test worker imports this module."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    return pyplot


RESULTS = Path(__file__).resolve().parent / "results"
MAX_LABELLED_FAULTS = 30
COLOURS = {
    "isolate": "tab:red",
    "halves": "tab:red",
    "bridge": "salmon",
    "flood": "gold",
    "kill": "black",
    "wipe": "tab:purple",
    "wipe-restart": "indigo",
    "pause": "tab:gray",
    "agent-pause": "khaki",
    "forge": "tab:green",
    "loss": "tab:orange",
    "slow": "tab:cyan",
    "rollback": "tab:brown",
    "twin": "tab:pink",
}


def results_folder(seed: int, tier: str = "") -> Path:
    """A new folder for a run's report, ``<time>-seed<seed>`` under the results root
    (``FENCEMARK_CHAOS_RESULTS``, else ``tests/chaos/results``) and ``tier`` (the
    member chaos tier's, ``members``); ``latest`` beside it points at it."""
    root = Path(os.environ.get("FENCEMARK_CHAOS_RESULTS") or RESULTS) / tier
    folder = root / f"{time.strftime('%Y%m%d-%H%M%S')}-seed{seed}"
    folder.mkdir(parents=True)
    latest = root / "latest"
    latest.unlink(missing_ok=True)
    latest.symlink_to(folder.name)
    return folder


def write(
    folder: Path,
    *,
    settings: Mapping[str, Any],
    verdicts: Sequence[Verdict],
    played: Sequence[Played],
    samples: Sequence[Sample],
    history: History,
    heal_at: float,
    watched: Sequence[WatchLog] = (),
    scheduled: Sequence[Fault] = (),
) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    passed = all(v.ok for v in verdicts)
    counts = Counter(f"{e.op}:{e.outcome}" for e in history.events)
    report: dict[str, Any] = {
        "passed": passed,
        "settings": dict(settings),
        "invariants": [asdict(v) for v in verdicts],
        "faults": fault_counts(scheduled, played),
        "nemesis": [asdict(p) for p in played],
        "agent_pauses": [
            {**asdict(wake), "verdict": wake.verdict} for wake in stale_wakes(history, played)
        ],
        "operations": dict(sorted(counts.items())),
        "refusals": dict(
            sorted(
                Counter(
                    e.detail for e in history.events if e.outcome == "fail" and e.detail
                ).items()
            )
        ),
        "convergence_timeline": [asdict(s) for s in samples],
        "final_heal_at": round(heal_at, 3),
        "watchers": [watcher_summary(log, played) for log in watched],
    }
    (folder / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    with (folder / "history.jsonl").open("w") as out:
        for event in history.events:
            row = asdict(event)
            row["invoked"] = round(event.invoked - history.started, 4)
            row["completed"] = round(event.completed - history.started, 4)
            if event.expires:
                row["expires"] = round(event.expires - history.started, 4)
            out.write(json.dumps(row) + "\n")
    for log in watched:
        write_watch_log(folder / f"watch-{log.region}.jsonl", log)
    (folder / "report.md").write_text(markdown(report))
    timeline(folder / "timeline.png", played, samples, heal_at, settings)
    return report


def fault_counts(scheduled: Sequence[Fault], played: Sequence[Played]) -> dict[str, Any]:
    """How many faults were played, by kind (``not injected``: the engine refused
    them, see their note), beside how many the schedule held: the nemesis starts no
    fault past the first of each kind once the run's time is spent, so a long run
    plays fewer than it scheduled."""
    kinds = Counter(f.kind for f in scheduled)
    done = Counter(p.kind for p in played)
    refused = Counter(p.kind for p in played if not p.injected)
    return {
        "played": len(played),
        "not injected": sum(refused.values()),
        "scheduled": len(scheduled),
        "by kind": {
            kind: {"played": done[kind], "not injected": refused[kind], "scheduled": kinds[kind]}
            for kind in sorted(kinds.keys() | done.keys(), key=lambda k: (-done[k], k))
        },
    }


def markdown(report: Mapping[str, Any]) -> str:
    settings = report["settings"]
    faults = report["faults"]
    lines = [
        f"# Chaos run, seed {settings['seed']}: {'PASSED' if report['passed'] else 'FAILED'}",
        "",
        f"{settings['regions']} regions, {settings['agents']} agents, lease"
        f" {settings['lease_seconds']} s, {faults['played']} faults played over"
        f" {settings['seconds']:.0f} s of nemesis ({faults['scheduled']} scheduled)."
        f" Replay: `FENCEMARK_CHAOS_SEED={settings['seed']}`.",
        "",
        "| invariant | result | detail |",
        "|---|---|---|",
        *(
            f"| {v['name']} | {'ok' if v['ok'] else '**VIOLATED**'} | {v['detail']} |"
            for v in report["invariants"]
        ),
        "",
        *played_by_kind(faults),
        *agent_pauses(report["agent_pauses"]),
        "## Nemesis",
        "",
        "| at (s) | fault | targets | lasted (s) | note |",
        "|---:|---|---|---:|---|",
        *(
            f"| {p['started']:.1f} | {p['kind']} | {' '.join(p['targets'])} |"
            f" {p['ended'] - p['started']:.1f} | {p['detail']} |"
            for p in report["nemesis"]
        ),
        "",
        *forgeries(report["nemesis"]),
        *watchers(report["watchers"]),
        "## Operations",
        "",
        "| operation:outcome | count |",
        "|---|---:|",
        *(f"| {k} | {n} |" for k, n in report["operations"].items()),
        "",
        "Refusals by reason: "
        + (", ".join(f"{k} {n}" for k, n in report["refusals"].items()) or "none"),
        "",
        "![timeline](timeline.png)",
        "",
    ]
    return "\n".join(lines)


def played_by_kind(faults: Mapping[str, Any]) -> list[str]:
    """The faults played, by kind, beside the schedule's count of each."""
    lines = [
        "## Faults played",
        "",
        f"{faults['played']} played ({faults['not injected']} of them not injected: the engine"
        f" refused them), of {faults['scheduled']} scheduled. Past the first of each kind"
        " the nemesis starts no fault once the run's time is spent: the rest of the"
        " schedule is never played.",
        "",
        "| fault | played | not injected | scheduled |",
        "|---|---:|---:|---:|",
    ]
    for kind, n in faults["by kind"].items():
        lines.append(f"| {kind} | {n['played']} | {n['not injected']} | {n['scheduled']} |")
    return [*lines, ""]


def agent_pauses(wakes: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each ``agent-pause``: what its woken worker's write and renewal with its old
    token were told (invariant 1: ``superseded`` or ``expired``)."""
    if not wakes:
        return []
    lines = [
        "## Agent pauses",
        "",
        "The woken worker's write and renewal with its old token must be refused"
        " `superseded` or `expired` (invariant 1).",
        "",
        "| at (s) | agent | item | token | write | renewal | verdict |",
        "|---:|---|---|---:|---|---|---|",
    ]
    for w in wakes:
        item = w["key"].rsplit("/", 1)[-1] or "-"
        write, renewal = w["write"] or "-", w["renewal"] or "-"
        lines.append(f"| {w['at']:.1f} | {w['agent']} | {item} | {w['token']} | {write} |"
                     f" {renewal} | {w['verdict']} |")  # fmt: skip
    return [*lines, ""]


def forgeries(nemesis: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``forge`` faults' pushes, by forgery: how each was answered (invariant 11)."""
    pushed = [push for fault in nemesis for push in fault.get("forged", ())]
    if not pushed:
        return []
    rows: dict[tuple[str, str], Counter[str]] = {}
    for push in pushed:
        seen = rows.setdefault((push["forgery"], push["rule"]), Counter())
        seen["pushed"] += 1
        if push["merged"]:
            seen["merged"] += 1
        elif push["refused"] == push["rule"]:
            seen["by its rule"] += 1
        else:
            seen[f"{push['refused'] or 'no refusal seen'}"] += 1
    lines = [
        "## Forgeries",
        "",
        "Pushed by the hostile peer of the `forge` faults, each to be refused by its rule.",
        "",
        "| forgery | rule | pushed | refused by its rule | merged | otherwise |",
        "|---|---|---:|---:|---:|---|",
    ]
    for (forgery, rule), seen in rows.items():
        other = ", ".join(
            f"{k} {n}" for k, n in seen.items() if k not in ("pushed", "merged", "by its rule")
        )
        lines.append(
            f"| {forgery} | {rule} | {seen['pushed']} | {seen['by its rule']} |"
            f" {seen['merged']} | {other} |"
        )
    return [*lines, ""]


# What a watcher's own node went through.
NODE_FAULTS = ("kill", "wipe", "wipe-restart", "rollback", "pause")


def watcher_summary(log: WatchLog, played: Sequence[Played]) -> dict[str, Any]:
    """A region's watcher in numbers: events, segments, feeds, and its node's faults."""
    lived = Counter(p.kind for p in played if p.kind in NODE_FAULTS and p.targets[0] == log.region)
    return {
        "region": log.region,
        "events": sum(len(s.events) for s in log.segments),
        "segments": len(log.segments),
        "feeds": len(dict.fromkeys(s.feed for s in log.segments)),
        "node faults": dict(sorted(lived.items())),
        "ended": dict(Counter(s.ended.split(":")[0] for s in log.segments if s.ended)),
        "re-read": len(log.reread),
        "problems": log.problems,
    }


def write_watch_log(path: Path, log: WatchLog) -> None:
    with path.open("w") as out:
        for number, segment in enumerate(log.segments):
            for e in segment.events:
                row = {"segment": number, "cursor": e.cursor, "kind": e.kind, "key": e.key,
                       "digest": e.digest.hex(), "fence": e.fence}  # fmt: skip
                out.write(json.dumps(row) + "\n")
            out.write(json.dumps({"segment": number, "start": segment.start,
                                  "ended": segment.ended}) + "\n")  # fmt: skip


def watchers(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Invariant 13's watchers: what each received, and what its node went through."""
    if not rows:
        return []
    lines = [
        "## Watchers",
        "",
        "One per region, of the whole repository at its own node, for the whole run",
        "(`watch-<region>.jsonl`: every event, and where each segment ended).",
        "",
        "| region | events | segments | feeds | its node's faults | segments ended |",
        "|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        faults = ", ".join(f"{k} {n}" for k, n in row["node faults"].items()) or "none"
        ended = ", ".join(f"{k} {n}" for k, n in row["ended"].items()) or "none"
        lines.append(f"| {row['region']} | {row['events']} | {row['segments']} |"
                     f" {row['feeds']} | {faults} | {ended} |")  # fmt: skip
    return [*lines, ""]


def timeline(
    path: Path,
    played: Sequence[Played],
    samples: Sequence[Sample],
    heal_at: float,
    settings: Mapping[str, Any],
) -> None:
    """Faults as shaded spans; per region, the records it is behind on over time."""
    pyplot = plotter()
    figure, axes = pyplot.subplots(figsize=(12, 4.5))
    seen: set[str] = set()
    for fault in played:
        label = fault.kind if fault.kind not in seen else None
        seen.add(fault.kind)
        axes.axvspan(
            fault.started,
            fault.ended,
            color=COLOURS.get(fault.kind, "tab:blue"),
            alpha=0.25,
            label=label,
        )
        if len(played) <= MAX_LABELLED_FAULTS:  # a long run's labels would be a smear
            axes.annotate(
                " ".join(fault.targets)[:12],
                (fault.started, 0),
                fontsize=7,
                rotation=90,
                va="bottom",
                xytext=(2, 2),
                textcoords="offset points",
            )
    for region in sorted({r for s in samples for r in s.divergent}):
        points = [
            (s.at, s.divergent[region]) for s in samples if s.divergent.get(region) is not None
        ]
        if points:
            axes.plot(*zip(*points, strict=True), marker=".", linewidth=1, label=f"{region}")
    axes.axvline(heal_at, color="green", linestyle="--", label="final heal")
    axes.set_xlabel("seconds since the run started")
    axes.set_ylabel("records behind another region")
    axes.set_title(f"chaos run, seed {settings['seed']}: faults, and how far behind each region is")
    axes.legend(loc="upper left", fontsize=7, ncol=2)
    axes.set_ylim(bottom=0)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
