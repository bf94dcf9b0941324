"""``fencemark bench``: run the scenarios, write JSON, Markdown, PNGs and the docs' headline.

Everything a run needs (node processes, etcd, Redis, data) lives in a temporary
directory that is removed at the end; only the results stay.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fencemark.bench import headline
from fencemark.bench.progress import Progress
from fencemark.bench.results import ScenarioResult, Settings, Target
from fencemark.bench.scenarios import SCENARIOS

DOCS_BEGIN = "<!-- bench:results:begin (written by `fencemark bench`; edits are lost) -->"
DOCS_END = "<!-- bench:results:end -->"
DOCS_PLOTS = "performance"  # docs/<this>/: the plots the headline shows


async def _run_scenario(
    name: str, settings: Settings, progress: Progress, work: Path, out: Path, seeds: Any
) -> ScenarioResult:
    # Imported here: each scenario pulls in its own clients (aetcd, redis, psutil).
    if name == "wan":
        from fencemark.bench.wan import run_wan

        return await run_wan(settings, progress, work, out)
    if name == "fleet":
        from fencemark.bench.fleet import run_fleet

        return await run_fleet(settings, progress, work, out)
    if name == "claims":
        from fencemark.bench.claim_cycle import run_claim_cycle

        return await run_claim_cycle(settings, progress, work, out)
    if name == "writes":
        from fencemark.bench.claim_cycle import run_writes

        return await run_writes(settings, progress, work, out)
    if name == "lag":
        from fencemark.bench.lag import run_lag

        return await run_lag(settings, progress, work, out)
    if name == "anti-entropy":
        from fencemark.bench.anti_entropy import run_anti_entropy

        return await run_anti_entropy(settings, progress, work, out, seeds)
    if name == "footprint":
        from fencemark.bench.footprint import run_footprint

        return await run_footprint(settings, progress, work, out, seeds)
    if name == "drain":
        from fencemark.bench.drain import run_drain

        return await run_drain(settings, progress, work, out)
    if name == "feed":
        from fencemark.bench.feed import run_feed

        return await run_feed(settings, progress, work, out)
    if name == "failover":
        from fencemark.bench.failover import run_failover

        return await run_failover(settings, progress, work, out)
    raise ValueError(f"unknown scenario {name!r}")


async def run(
    scenarios: Sequence[str],
    settings: Settings,
    results: Path,
    *,
    docs: Path | None = None,
    progress: Progress | None = None,
) -> tuple[list[ScenarioResult], dict[str, str]]:
    """Run ``scenarios`` in order; returns their results and the failures by scenario."""
    from fencemark.bench.anti_entropy import Seeds

    progress = progress or Progress()
    await asyncio.to_thread(results.mkdir, parents=True, exist_ok=True)
    done: list[ScenarioResult] = []
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fencemark-bench-") as scratch:
        work = Path(scratch)
        seeds = Seeds(work / "seeds")
        for name in scenarios:
            progress.begin(name)
            try:
                result = await _run_scenario(name, settings, progress, work / name, results, seeds)
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
                progress.line(f"{name} FAILED: {failed[name]}")
                traceback.print_exc(file=progress.stream)
                continue
            done.append(result)
            for target in result.targets:
                progress.line(f"  {target.verdict:>8}  {target.name}: {_measured(target)}")
    write_results(done, failed, settings, results)
    if docs is not None:
        write_docs(done, settings, results, docs)
    return done, failed


def _measured(target: Target) -> str:
    return f"{target.measured:,.2f}{target.unit} (goal {target.goal})"


def _machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def write_results(
    done: list[ScenarioResult], failed: dict[str, str], settings: Settings, results: Path
) -> None:
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    payload = {
        "when": when,
        "mode": "quick" if settings.quick else "full",
        "machine": _machine(),
        "settings": {k: v for k, v in vars(settings).items()},
        "scenarios": {r.name: r.to_json() for r in done},
        "failed": failed,
    }
    (results / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (results / "results.md").write_text(markdown(done, failed, settings, when) + "\n")


def target_rows(result: ScenarioResult) -> list[str]:
    return [
        f"| {t.name} | {t.goal} | {t.measured:,.2f}{t.unit} | **{t.verdict}** |"
        for t in result.targets
    ]


def targets_table(done: list[ScenarioResult]) -> str:
    lines = ["| target | goal | measured | verdict |", "|---|---|---|---|"]
    for result in done:
        lines += target_rows(result)
    return "\n".join(lines)


def run_description(settings: Settings, when: str) -> str:
    machine = _machine()
    return (
        f"run of {when}, {'quick' if settings.quick else 'full'} mode, {settings.repeats}"
        f" run(s) per figure, on {machine['cpus']} CPUs, Python {machine['python']}"
    )


def section(result: ScenarioResult, plots_dir: str = ".") -> str:
    """A scenario's part of the results: its heading, tables, notes and plots."""
    parts = [f"### {result.title}", ""]
    for table in result.tables:
        parts += [table.markdown(), ""]
    parts += [f"- {note}" for note in result.notes]
    if result.notes and result.plots:
        parts.append("")  # else Markdown puts the plots into the last note
    parts += [f"![{p.stem}]({plots_dir}/{p.name})" for p in result.plots]
    return "\n".join(parts).strip()


def markdown(
    done: list[ScenarioResult],
    failed: dict[str, str],
    settings: Settings,
    when: str,
    plots_dir: str = ".",
) -> str:
    run = run_description(settings, when)
    parts = [f"{run[:1].upper()}{run[1:]}.", "", "### Targets", "", targets_table(done)]
    for result in done:
        parts += ["", section(result, plots_dir)]
    for name, why in failed.items():
        parts += ["", f"### {name}: FAILED", "", f"`{why}`"]
    return "\n".join(parts)


def write_docs(done: list[ScenarioResult], settings: Settings, results: Path, docs: Path) -> None:
    """Rewrite the headline between the markers of ``docs`` with the sections of the
    scenarios in ``done``, keeping the other scenarios' sections (``headline``), and
    copy the plots beside it."""
    text = docs.read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise SystemExit(f"fencemark bench: {docs} has no {DOCS_BEGIN!r} ... {DOCS_END!r} section")
    plots = docs.parent / DOCS_PLOTS
    plots.mkdir(exist_ok=True)
    for result in done:
        for plot in result.plots:
            shutil.copyfile(plot, plots / plot.name)
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    run = run_description(settings, when)
    head, rest = text.split(DOCS_BEGIN, 1)
    old, tail = rest.split(DOCS_END, 1)
    fresh = [headline.Section(r.name, run, target_rows(r), section(r, DOCS_PLOTS)) for r in done]
    body = headline.render(headline.merge(headline.parse(old), fresh, tuple(SCENARIOS)))
    docs.write_text(f"{head}{DOCS_BEGIN}\n\n{body}\n\n{DOCS_END}{tail}")


def main(
    scenarios: Sequence[str],
    *,
    quick: bool,
    results: str,
    docs: str | None,
) -> int:
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        print(
            f"fencemark bench: unknown scenario {', '.join(unknown)};"
            f" choose from {', '.join(SCENARIOS)}",
            file=sys.stderr,
        )
        return 2
    chosen = [s for s in SCENARIOS if s in scenarios] if scenarios else list(SCENARIOS)
    settings = Settings.quick_run() if quick else Settings.full()
    docs_path = Path(docs) if docs else None
    done, failed = asyncio.run(run(chosen, settings, Path(results), docs=docs_path))
    print(targets_table(done))
    print(f"results: {Path(results) / 'results.md'} (and results.json, *.png)")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
