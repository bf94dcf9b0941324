"""The real components some tests need beyond Python, and the one rule for their absence.

A test names what it needs with ``@pytest.mark.requires("promtool")`` (a fixture that
needs one calls ``require("docker")``). Where a component is missing, the test is
skipped with the command that installs it; under ``CI`` (``.ci/run`` sets it and
installs every component first) a missing component *fails* the test instead, so a
green CI proves that everything ran. At the end of a run, ``summary_lines`` turns the
skips into one block: what was missing, how many tests it cost, and how to install it.

Every such decision is made here and nowhere else (docs/testing.md, *Components*).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where `make inspector` and `make buf` install (.ci/ensure-inspector, .ci/ensure-buf).
INSPECTOR_PREFIX = Path(os.environ.get("FENCEMARK_INSPECTOR_PREFIX", ROOT / ".tools" / "node22"))
INSPECTOR_BIN = INSPECTOR_PREFIX / "node_modules" / ".bin"
BUF_PREFIX = Path(os.environ.get("FENCEMARK_BUF_PREFIX", ROOT / ".tools" / "buf"))
BUF = BUF_PREFIX / "node_modules" / ".bin" / "buf"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# A skip for a missing component says this, so the summary can find it again
# (pytest-xdist carries a skip's message, not the objects behind it).
SKIP_PREFIX = "missing component"
SKIP_PATTERN = re.compile(rf"{SKIP_PREFIX} (?P<name>[\w-]+):")


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _on_path(binary: str) -> Callable[[], bool]:
    return lambda: shutil.which(binary) is not None


@dataclass(frozen=True)
class Component:
    name: str
    what: str  # what it is and which tests it serves, for a person
    install: str  # the exact command that provides it, as root on Debian
    present: Callable[[], bool]


COMPONENTS: dict[str, Component] = {
    c.name: c
    for c in (
        Component(
            "docker",
            "a Docker engine (the image, the compose and swarm stacks, the chaos tier)",
            "bash deploy/ensure-docker.sh",
            _docker_answers,
        ),
        Component(
            "docker-compose",
            "docker-compose, Debian's 1.29: the compose stack, and what docs/deploy.md runs",
            "bash deploy/ensure-docker.sh",
            _on_path("docker-compose"),
        ),
        Component(
            "root",
            "root, as docs/deploy.md's steps run (they make directories owned by 10001)",
            "run the tests as root",
            lambda: os.geteuid() == 0,
        ),
        Component(
            "etcd",
            "etcd: a region's decider election (tests/test_decider.py), a benchmark baseline",
            "apt-get install -y etcd-server",
            _on_path("etcd"),
        ),
        Component(
            "redis",
            "Redis, a benchmark baseline",
            "apt-get install -y redis-server",
            _on_path("redis-server"),
        ),
        Component(
            "promtool",
            "promtool, which checks the alert rules and the Prometheus config",
            "apt-get install -y --no-install-recommends prometheus",
            _on_path("promtool"),
        ),
        Component(
            "chromium",
            "Debian's chromium, which drives the dashboard's page",
            "apt-get install -y --no-install-recommends chromium",
            lambda: os.path.exists(CHROMIUM),
        ),
        Component(
            "inspector",
            "Node 22 and the pinned MCP Inspector CLI under .tools/node22",
            "make inspector",
            lambda: all((INSPECTOR_BIN / tool).exists() for tool in ("node", "mcp-inspector")),
        ),
        Component(
            "buf",
            "the pinned buf CLI under .tools/buf (a reflection client)",
            "make buf",
            BUF.exists,
        ),
    )
}


@functools.cache
def present(name: str) -> bool:
    """Whether component ``name`` is here (asked once per test process)."""
    return COMPONENTS[name].present()


def require(*names: str) -> None:
    """Skip the running test for want of any of ``names`` (fail it under CI)."""
    missing = [COMPONENTS[name] for name in names if not present(name)]
    if not missing:
        return
    message = "; ".join(
        f"{SKIP_PREFIX} {c.name}: {c.what}; install it with `{c.install}`" for c in missing
    )
    if under_ci():
        pytest.fail(f"{message} (CI is set: nothing may be skipped)", pytrace=False)
    pytest.skip(message)


def check_names(names: Iterable[str], where: str) -> None:
    """Refuse a ``requires`` marker naming a component this module does not know."""
    unknown = sorted(set(names) - COMPONENTS.keys())
    if unknown:
        raise pytest.UsageError(
            f"{where}: requires({', '.join(map(repr, unknown))}): no such component;"
            f" known: {', '.join(sorted(COMPONENTS))}"
        )


def summary_lines(skip_messages: Iterable[str]) -> list[str]:
    """The end-of-run block: each missing component, the tests it cost, its install command."""
    counts = Counter(
        match.group("name") for message in skip_messages for match in SKIP_PATTERN.finditer(message)
    )
    if not counts:
        return []
    width = max(map(len, counts))
    lines = []
    for name, count in sorted(counts.items()):
        component = COMPONENTS[name]
        tests = f"{count} test{'s' if count != 1 else ''}"
        lines.append(f"{name:<{width}}  {tests:>9}  {component.install}")
    lines.append(
        "These were skipped, not passed. As root, `bash .ci/run` installs and starts every"
        " component, then runs all of it (CI=true fails instead of skipping)."
    )
    return lines
