"""What ``fencemark bench`` tells a user before any scenario runs: its help, generated
from the registry of scenarios, and the one line an install without the benchmark
extra gets (regressions: the help named seven of nine scenarios; issue 42)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fencemark.bench.scenarios import EXTRA_MODULES, INSTALL_EXTRA, SCENARIOS
from tests.test_cli import clean_env

# An environment without the extra: its modules cannot be imported (None in
# sys.modules is how Python marks a module as not importable).
WITHOUT_EXTRA = (
    "import sys\n"
    f"sys.modules.update(dict.fromkeys({list(EXTRA_MODULES)!r}))\n"
    "from fencemark.node.tools.cli import main\n"
    "sys.argv = ['fencemark', *sys.argv[1:]]\n"
    "sys.exit(main())\n"
)


def fencemark(*args: str, without_extra: bool = False) -> subprocess.CompletedProcess[str]:
    command = ["-c", WITHOUT_EXTRA] if without_extra else ["-m", "fencemark.node"]
    return subprocess.run(
        [sys.executable, *command, *args],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
def test_the_bench_help_names_every_scenario_of_the_registry() -> None:
    shown = fencemark("bench", "--help")
    assert shown.returncode == 0
    for name, what in SCENARIOS.items():
        assert f"  {name}" in shown.stdout and what in shown.stdout, name
    listed = " ".join(fencemark("--help").stdout.split())  # as one line, unwrapped
    assert f"bench benchmarks against etcd and Redis: {', '.join(SCENARIOS)}" in listed


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
def test_bench_without_the_extra_is_one_line_naming_the_install() -> None:
    ran = fencemark("bench", "--quick", "claims", without_extra=True)
    assert ran.returncode == 2
    assert ran.stdout == ""
    assert ran.stderr.count("\n") == 1, ran.stderr
    assert INSTALL_EXTRA in ran.stderr
    assert "Traceback" not in ran.stderr
    assert all(module in ran.stderr for module in EXTRA_MODULES)


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
def test_bench_help_needs_no_extra() -> None:
    shown = fencemark("bench", "--help", without_extra=True)
    assert shown.returncode == 0
    assert all(name in shown.stdout for name in SCENARIOS)
