"""The headline of docs/performance.md: one section per scenario, merged across runs.

``fencemark bench SCENARIO --docs FILE`` rewrites the sections of the scenarios it
ran and keeps every other scenario's section and targets as the last run that
measured them wrote them. Each section starts with a comment naming its scenario,
the run it is from and how many rows of the targets table are its own; the
targets table lists the sections' rows in the order of the sections.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MARK = re.compile(
    r"^<!-- bench:scenario (?P<name>\S+) \| (?P<run>[^|]+?) \| (?P<targets>\d+) targets -->$",
    re.MULTILINE,
)
TARGETS_HEADER = ("| target | goal | measured | verdict |", "|---|---|---|---|")


@dataclass(frozen=True)
class Section:
    name: str  # the scenario
    run: str  # "run of <when>, full mode, ..."
    targets: list[str]  # its rows of the targets table
    text: str  # its Markdown, from its heading to its plots

    @property
    def mark(self) -> str:
        return f"<!-- bench:scenario {self.name} | {self.run} | {len(self.targets)} targets -->"


def parse(body: str) -> dict[str, Section]:
    """The sections of a headline written by ``render`` (none from any other text)."""
    marks = list(MARK.finditer(body))
    if not marks:
        return {}
    table = body[: marks[0].start()]
    rows = [
        line for line in table.splitlines() if line.startswith("|") and line not in TARGETS_HEADER
    ]
    sections: dict[str, Section] = {}
    taken = 0
    for index, mark in enumerate(marks):
        end = marks[index + 1].start() if index + 1 < len(marks) else len(body)
        count = int(mark["targets"])
        name = mark["name"]
        text = body[mark.end() : end].strip()
        sections[name] = Section(name, mark["run"], rows[taken : taken + count], text)
        taken += count
    return sections


def merge(
    kept: dict[str, Section], fresh: Iterable[Section], order: Sequence[str]
) -> list[Section]:
    """``kept`` with ``fresh`` in place of the same scenarios', in ``order`` (others last)."""
    merged = dict(kept)
    merged.update((section.name, section) for section in fresh)
    rank = {name: index for index, name in enumerate(order)}
    return sorted(merged.values(), key=lambda s: (rank.get(s.name, len(rank)), s.name))


def render(sections: Sequence[Section]) -> str:
    runs: dict[str, list[str]] = {}
    for section in sections:
        runs.setdefault(section.run, []).append(section.name)
    if len(runs) == 1:
        (run,) = runs
        parts = [f"{run[:1].upper()}{run[1:]}."]
    else:
        parts = ["Figures from more than one run (a scenario run alone replaces only its own):", ""]
        parts += [f"- {', '.join(names)}: {run}." for run, names in runs.items()]
    parts += ["", "### Targets", "", *TARGETS_HEADER]
    parts += [row for section in sections for row in section.targets]
    for section in sections:
        parts += ["", section.mark, section.text]
    return "\n".join(parts)
