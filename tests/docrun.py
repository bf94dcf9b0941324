"""The operator's shell blocks of the docs, run as written, one scenario at a time.

A block an operator types is marked in the Markdown, right before its fence, with
the scenario steps it belongs to (one block may serve several scenarios)::

    <!-- executed: compose/settings swarm/settings -->

Any other shell block of such a document says why it is not run
(``<!-- not-executed: reason -->``, as in tests/test_docs.py). A scenario runs its
steps' commands one at a time in **one** bash, as an operator's terminal would: ``cd``
and ``export`` carry over. Every command must exit 0, or the status its own comment
gives (``docker-compose up -d   # exits 1``). Where a ``console`` block shows a
command's output, the real output (stdout and stderr together) must match it:

- ``...`` stands for anything, across lines (doctest's ELLIPSIS);
- columns do not count: runs of blanks are one blank, runs of dashes one ``---``,
  blank lines are dropped;
- numbers stand for any number, and a 12-digit hexadecimal node id for any: sizes,
  lags and ids vary from run to run, the shape of the output does not;
- the ``ERROR: `` that docker-compose puts before a message on a terminal only is
  dropped.

The test may substitute text before a command runs and in the output shown
(``Substitutions``): each test lists its own, only for what the docs say to choose
(a data path, free ports, a project's name).
"""

from __future__ import annotations

import contextlib
import doctest
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port
from tests.test_docs import ROOT, SHELL, Block, parse_blocks

EXECUTED = re.compile(r"<!--\s*executed:(?P<steps>[^>]*?)-->")
EXITS = re.compile(r"#\s*exits (?P<code>\d+)")
COMMAND_LIMIT_S = 240.0


@dataclass(frozen=True)
class Command:
    text: str  # what bash is given: the command's lines as the document shows them
    shown: str | None  # the output a console block shows after it; None where none is
    exits: int  # the exit status it must end with
    where: str  # file:line


@dataclass(frozen=True)
class Step:
    scenario: str
    name: str
    block: Block
    commands: tuple[Command, ...]

    @property
    def id(self) -> str:
        return f"{self.scenario}/{self.name}"


def executed_marker(lines: list[str], block: Block) -> list[str]:
    """The ``scenario/step`` names of the executed marker right before ``block``
    (``lines``: its document's)."""
    k = block.line - 3  # the line before the fence (block.line is the first code line)
    while k >= 0 and not lines[k].strip():
        k -= 1
    found = EXECUTED.fullmatch(lines[k].strip()) if k >= 0 else None
    return found["steps"].split() if found else []


def where(block: Block, line: int | None = None) -> str:
    """``file:line`` of a block (or of a line of it), relative to the repository."""
    path = block.path.relative_to(ROOT) if block.path.is_relative_to(ROOT) else block.path
    return f"{path}:{line or block.line}"


def _complete(text: str) -> bool:
    """Whether bash reads ``text`` as whole commands (no open loop, quote or ``\\``)."""
    if text.rstrip().endswith("\\"):
        return False
    check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    return check.returncode == 0


def commands_of(block: Block) -> list[Command]:
    """The commands of a shell block: ``$ `` lines in a console block, with the lines
    after each as its output; every command line of an ``sh`` block."""
    console = block.lang == "console"
    found: list[tuple[list[str], list[str], int]] = []  # (command lines, shown, line)
    pending: list[str] = []
    for number, line in enumerate(block.code.splitlines(), start=block.line):
        if pending:
            pending.append(line[2:] if console and line.startswith("> ") else line)
        elif console and line.startswith("$ "):
            pending = [line[2:]]
            found.append((pending, [], number))
        elif console:
            assert found, f"{where(block)}: output before the first command"
            found[-1][1].append(line)
            continue
        elif line.strip() and not line.lstrip().startswith("#"):
            pending = [line]
            found.append((pending, [], number))
        else:
            continue
        if _complete("\n".join(pending)):
            pending = []
    assert not pending, f"{where(block)}: the last command is not complete"
    return [
        Command(
            text="\n".join(lines),
            shown="\n".join(shown) if console else None,
            exits=int(m["code"]) if (m := EXITS.search(lines[0])) else 0,
            where=where(block, number),
        )
        for lines, shown, number in found
    ]


def steps_of(paths: Iterable[Path]) -> dict[str, Step]:
    """Every executed step of ``paths``, by ``scenario/step``."""
    steps: dict[str, Step] = {}
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        for block in parse_blocks(path):
            for name in executed_marker(lines, block):
                scenario, _, step = name.partition("/")
                assert step, f"{where(block)}: name the step as SCENARIO/STEP, not {name!r}"
                assert block.lang in SHELL, f"{where(block)}: {name} is no shell block"
                assert name not in steps, f"{where(block)}: {name} is marked twice"
                steps[name] = Step(scenario, step, block, tuple(commands_of(block)))
    return steps


def unmarked_shell_blocks(path: Path) -> list[str]:
    """The shell blocks of ``path`` neither executed nor marked not-executed."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [
        where(block)
        for block in parse_blocks(path)
        if block.lang in SHELL and block.not_executed is None and not executed_marker(lines, block)
    ]


# -- comparing output --------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NODE_ID = re.compile(r"\b[0-9a-f]{12}\b")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
# Which of the stack's members of us decides, and so which one a failover kills, varies
# from run to run as node ids do: us-a, us-b and us-c are one word to the comparison.
MEMBER = re.compile(r"\bus-[abc]\b")


def normalise(text: str) -> str:
    lines = []
    for raw in ANSI.sub("", text).replace("\r", "").splitlines():
        line = re.sub(r"\s+", " ", raw).strip()
        line = line.removeprefix("ERROR: ")
        line = re.sub(r"-{3,}", "---", line)
        line = NUMBER.sub("0", NODE_ID.sub("<node>", MEMBER.sub("us-<member>", line)))
        if line:
            lines.append(line)
    return "".join(line + "\n" for line in lines)


def matches(shown: str, real: str) -> bool:
    return doctest.OutputChecker().check_output(normalise(shown), normalise(real), doctest.ELLIPSIS)


# -- running ----------------------------------------------------------------------


@dataclass
class Substitutions:
    """Text the test replaces, in commands and in the output shown, before running:
    in one pass (what one puts in is not replaced again), the longest first, so that
    ``machine-us:7400`` goes before ``machine-us``."""

    text: dict[str, str] = field(default_factory=dict)

    def __call__(self, value: str) -> str:
        if not self.text:
            return value
        documented = sorted(self.text, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, documented)))
        return pattern.sub(lambda found: self.text[found[0]], value)


class Shell:
    """One bash, given one command at a time: what a command changes (``cd``,
    ``export``) holds for the next, as in a terminal. Each command's output goes to
    a file of its own, stdout and stderr together, with no standard input."""

    def __init__(self, cwd: Path, env: Mapping[str, str], transcript: Path) -> None:
        self.transcript = transcript
        transcript.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            # A terminal 200 columns wide, whatever runs the test: docker-compose fits
            # its tables to the terminal, and a page's samples come from a wide one.
            env={**env, "COLUMNS": "200"},
            start_new_session=True,  # its process group is ours to end
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put("")

    def run(self, command: str, limit_s: float = COMMAND_LIMIT_S) -> tuple[int, str]:
        """Run ``command``; its exit status and output."""
        self.count += 1
        output = self.transcript / f"{self.count:03d}.out"
        marker = f"__done_{uuid.uuid4().hex}__"
        assert self.process.stdin is not None
        self.process.stdin.write(
            f'{{\n{command}\n}} >{shlex.quote(str(output))} 2>&1 </dev/null\necho "{marker} $?"\n'
        )
        self.process.stdin.flush()
        while True:
            try:
                line = self.lines.get(timeout=limit_s)
            except queue.Empty:
                self.close()
                text = output.read_text(errors="replace") if output.exists() else ""
                raise AssertionError(
                    f"still running after {limit_s} s: {command}\n{text[-3000:]}"
                ) from None
            if not line:
                raise AssertionError(f"the shell ended during: {command}")
            if line.startswith(marker):
                return int(line.split()[1]), output.read_text(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


Hook = Callable[[], None]


def run_steps(
    shell: Shell,
    steps: Iterable[Step],
    substitute: Substitutions,
    before: Mapping[str, Hook] | None = None,
    after: Mapping[str, Hook] | None = None,
) -> dict[str, list[str]]:
    """Run each step's commands in ``shell``, with the test's checks ``before`` and
    ``after`` a step (by ``scenario/step`` or by step name); each step's outputs."""
    outputs: dict[str, list[str]] = {}
    before, after = before or {}, after or {}
    for step in steps:
        if hook := before.get(step.id) or before.get(step.name):
            hook()
        outputs[step.id] = []
        for command in step.commands:
            code, output = shell.run(substitute(command.text))
            outputs[step.id].append(output)
            assert code == command.exits, (
                f"{command.where} ({step.id}): `{command.text}` exited {code},"
                f" not {command.exits}:\n{output[-4000:]}"
            )
            if command.shown is not None:
                shown = substitute(command.shown)
                assert matches(shown, output), (
                    f"{command.where} ({step.id}): `{command.text}` printed what the"
                    f" document does not show.\n--- shown (normalised)\n{normalise(shown)}"
                    f"--- printed (normalised)\n{normalise(output)}"
                )
        if hook := after.get(step.id) or after.get(step.name):
            hook()
    return outputs


# -- the operator's machine, for docs/deploy.md ------------------------------------

DEPLOY_DOCS = (ROOT / "docs" / "deploy.md", ROOT / "docs" / "operations.md")
DOCUMENTED_DATA = "/srv/fencemark"  # the doc's REPOCONTEXT_MEMORY_ARCHIVE_PATH
PORT_SETTING = re.compile(r"^(?P<name>FENCEMARK_\w+_PORT)=(?P<port>\d+)$", re.MULTILINE)


@dataclass
class OperatorSite:
    """What docs/deploy.md assumes of the operator's machine, in a scratch directory:
    the repository's root with ``deploy/`` (a copy: the steps write ``.env`` there)
    and ``.venv`` (the one ``make image`` made, linked), the data directory the steps
    create, and what ``$EDITOR .env`` sets: the data path, every host port (a free one
    each) and the images (tags of this run's own, so that a rebuild of ``fencemark:dev``
    meanwhile changes nothing here)."""

    root: Path
    data: Path
    ports: dict[str, int]  # FENCEMARK_*_PORT -> the free port .env names
    defaults: dict[str, int]  # FENCEMARK_*_PORT -> the port .env.example names
    images: dict[str, str]  # FENCEMARK_IMAGE, _PROMETHEUS_IMAGE, _ETCD_IMAGE -> tag
    env: dict[str, str]
    substitute: Substitutions

    @classmethod
    def make(cls, tmp_path: Path, images: dict[str, str], env: dict[str, str]) -> OperatorSite:
        root = tmp_path / "repository"
        shutil.copytree(ROOT / "deploy", root / "deploy", ignore=shutil.ignore_patterns(".env"))
        venv = ROOT / ".venv"
        if not (venv / "bin" / "fencemark").exists():
            venv = Path(sys.prefix)
        (root / ".venv").symlink_to(venv)
        data = tmp_path / "srv-fencemark"
        example = (root / "deploy" / ".env.example").read_text()
        defaults = {m["name"]: int(m["port"]) for m in PORT_SETTING.finditer(example)}
        ports = {name: free_port() for name in defaults}
        settings = {"REPOCONTEXT_MEMORY_ARCHIVE_PATH": str(data), **images}
        settings.update({name: str(port) for name, port in ports.items()})
        editor = tmp_path / "editor"
        editor.write_text(
            "#!/bin/sh\n# $EDITOR .env: what the operator chooses\nexec sed -i"
            + "".join(f" -e 's|^{k}=.*|{k}={v}|'" for k, v in settings.items())
            + ' "$1"\n'
        )
        editor.chmod(0o755)
        substitute = Substitutions(
            {
                DOCUMENTED_DATA: str(data),
                **{f"127.0.0.1:{defaults[n]}": f"127.0.0.1:{p}" for n, p in ports.items()},
            }
        )
        return cls(root, data, ports, defaults, images, {**env, "EDITOR": str(editor)}, substitute)
