"""Every example in the documentation runs, against a real node, and says what it prints.

The documents are ``docs/api.md``, ``README.md`` and every ``docs/*.md``. Their
fenced blocks are run as follows, one test per block, named by file and block
index (``docs/api.md-block07``) so a broken example is named in the report:

- ```` ```python ```` blocks run with ``TARGET`` bound to the address of a fresh node
  of region ``local`` with writes enabled (the ``node`` fixture), and
  ``READ_ONLY_TARGET`` to a node without writes when the block mentions it, and
  ``REGIONS`` to ``{"us": ..., "eu": ...}``, two peered nodes, when it mentions that. A
  block with top-level ``await`` runs in the test's event loop (compiled with
  ``ast.PyCF_ALLOW_TOP_LEVEL_AWAIT``); any other block runs in a worker thread, so
  the blocking client never blocks the loop the in-process node serves on.
- When a block's ``print(...)`` calls carry trailing comments, those comments are
  its expected output, line by line in source order (``...`` matches anything,
  a leading ``->`` is ignored), and the captured output must match them.
- The ```` ```console ````/```` ```sh ```` blocks of ``docs/api.md`` run command by
  command (``$ `` lines in ``console``, every line in ``sh``; no shell) and every
  command must exit 0. The documented targets ``127.0.0.1:7400`` and
  ``127.0.0.1:7401`` become the writable and the read-only node. Where a command's
  shown output is JSON, the real output must have the same keys.

Nothing is skipped silently: a block that must not run is preceded by
``<!-- not-executed: reason -->``, the reason must not be empty, and that block
is left out of the run (never reported as a skipped test). In ``docs/api.md``
every shell block is either runnable or marked.
"""

from __future__ import annotations

import ast
import asyncio
import doctest
import inspect
import io
import json
import os
import re
import shlex
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

from fencemark.node.api.server import NodeConfig, NodeServer
from fencemark.node.replication.tuning import Tuning
from tests.cluster import shared_loop
from tests.conftest import StartNode
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
API_DOC = ROOT / "docs" / "api.md"
DOCUMENTED_TARGET = "127.0.0.1:7400"
DOCUMENTED_READ_ONLY_TARGET = "127.0.0.1:7401"
PYTHON = frozenset({"python", "py", "python3"})
SHELL = frozenset({"console", "sh", "shell", "bash"})
COMMAND_TIMEOUT_S = 60.0

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")
MARKER = re.compile(r"<!--\s*not-executed\b(?P<colon>\s*:)?(?P<reason>.*?)-->", re.DOTALL)
SHELL_OPERATORS = frozenset({"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "2>&1"})


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    index: int  # among the file's fenced blocks, from 0
    line: int  # 1-based line of the first line of code
    lang: str
    code: str
    not_executed: str | None  # the marker's reason ("" if empty); None if unmarked
    marker_line: int | None  # 0-based line where the marker starts

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}-block{self.index:02d}"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, each with the not-executed marker before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence) and not closing["info"]:
                break
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        reason, marker_line = _marker_before(lines, i)
        blocks.append(
            Block(
                path=path,
                index=len(blocks),
                line=i + 2,
                lang=opening["info"].lower(),
                code="\n".join(body) + "\n",
                not_executed=reason,
                marker_line=marker_line,
            )
        )
        i = j + 1
    return blocks


def _marker_before(lines: list[str], fence_line: int) -> tuple[str | None, int | None]:
    """The reason and line of a not-executed marker right before a fence (blank lines aside)."""
    k = fence_line - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0 or not lines[k].rstrip().endswith("-->"):
        return None, None
    start = k
    while start > 0 and "<!--" not in lines[start]:
        start -= 1
    match = MARKER.match("\n".join(lines[start : k + 1]).strip())
    if match is None:
        return None, None
    return (match["reason"].strip() if match["colon"] else ""), start


def standalone_markers(path: Path) -> list[int]:
    """The 0-based lines, outside code blocks, where a not-executed marker starts."""
    found: list[int] = []
    fence = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        opening = FENCE.match(line)
        if fence:
            if opening and opening["fence"].startswith(fence) and not opening["info"]:
                fence = ""
        elif opening:
            fence = opening["fence"]
        elif re.match(r"\s*<!--\s*not-executed", line):
            found.append(number)
    return found


def documents() -> list[Path]:
    """``docs/api.md``, ``README.md`` and ``docs/*.md`` that exist, each once."""
    found = [API_DOC, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return list(dict.fromkeys(p for p in found if p.is_file()))


ALL_BLOCKS = [block for path in documents() for block in parse_blocks(path)]
# Marked blocks are not tests at all (a skipped test must never count as a
# pass); test_every_block_not_executed_says_why checks their markers instead.
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.not_executed is None]
PYTHON_BLOCKS = [b for b in RUN_BLOCKS if b.lang in PYTHON]
SHELL_BLOCKS = [b for b in RUN_BLOCKS if b.lang in SHELL and b.path == API_DOC]


def _params(blocks: list[Block]) -> list[object]:
    return [pytest.param(b, id=b.name) for b in blocks]


def test_every_block_not_executed_says_why() -> None:
    marked = [b for b in ALL_BLOCKS if b.not_executed is not None]
    for block in marked:
        assert block.not_executed, (
            f"{block.where}: <!-- not-executed: ... --> must give a reason for not running it"
        )


# -- Python ---------------------------------------------------------------------


def expected_output(code: str) -> list[str] | None:
    """The trailing comments of the ``print`` calls, in source order; None if there are none."""
    comments = {
        token.start[0]: token.string
        for token in tokenize.generate_tokens(io.StringIO(code).readline)
        if token.type == tokenize.COMMENT
    }
    print_ends = sorted(
        node.end_lineno or node.lineno
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and _is_print(node.func)
    )
    shown = [comments.get(end) for end in print_ends]
    if not any(shown):
        return None
    return [re.sub(r"^#\s?(->\s?)?", "", comment or "").rstrip() for comment in shown]


def _is_print(func: ast.expr) -> bool:
    return isinstance(func, ast.Name) and func.id == "print"


async def run_python(block: Block, namespace: dict[str, object]) -> None:
    # Leading newlines keep the line numbers of tracebacks those of the Markdown file.
    source = "\n" * (block.line - 1) + block.code
    code = compile(
        source,
        str(block.path.relative_to(ROOT)),
        "exec",
        flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
        dont_inherit=True,
    )
    if code.co_flags & inspect.CO_COROUTINE:
        await eval(code, namespace)
    else:
        await asyncio.to_thread(exec, code, namespace)


async def start_regions(data: Path, regions: tuple[str, ...]) -> list[NodeServer]:
    """Peered in-process nodes on fixed free loopback ports, one per region."""
    addresses = {region: f"127.0.0.1:{free_port()}" for region in regions}
    nodes = []
    for region in regions:
        config = NodeConfig(
            region=region,
            listen=addresses[region],
            data_dir=data / region,
            enable_writes=True,
            grace_seconds=0.5,
            peers={r: a for r, a in addresses.items() if r != region},
            anti_entropy_interval=0.2,
            # A twin's settle is no concern of the examples: a short one.
            replication=shared_loop(Tuning(heartbeat_s=0.2, settle_slack_s=0.2)),
        )
        nodes.append(await NodeServer.start(config))
    return nodes


@pytest.mark.parametrize("block", _params(PYTHON_BLOCKS))
async def test_python_example_runs(
    block: Block,
    node: NodeServer,
    start_node: StartNode,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    namespace: dict[str, object] = {"__name__": "__main__", "TARGET": node.address}
    if "READ_ONLY_TARGET" in block.code:
        namespace["READ_ONLY_TARGET"] = (await start_node(enable_writes=False)).address
    cluster: list[NodeServer] = []
    if "REGIONS" in block.code:
        cluster = await start_regions(tmp_path / "regions", ("us", "eu"))
        namespace["REGIONS"] = {n.config.region: n.address for n in cluster}
    want = expected_output(block.code)
    capsys.readouterr()
    try:
        await run_python(block, namespace)
    finally:
        for member in cluster:
            await member.stop()
    got = capsys.readouterr().out
    if want is None:
        return
    wanted = "".join(line + "\n" for line in want)
    checker = doctest.OutputChecker()
    assert checker.check_output(wanted, got, doctest.ELLIPSIS), (
        f"{block.where}: the output shown in the comments is not what the example prints\n"
        + checker.output_difference(doctest.Example("", wanted), got, doctest.ELLIPSIS)
    )


# -- CLI --------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    argv: list[str]
    shown: str  # the output the document shows for it (console blocks only)


def parse_commands(block: Block) -> list[Command]:
    """The commands of a shell block, with the output shown after each."""
    commands: list[Command] = []
    pending = ""
    shown: list[str] = []
    console = block.lang == "console"

    def flush() -> None:
        if commands and shown:
            last = commands[-1]
            commands[-1] = Command(last.argv, "\n".join(shown))
        shown.clear()

    for raw in block.code.splitlines():
        line = raw.rstrip()
        if pending:
            pending += " " + line.strip()
        elif console and line.lstrip().startswith("$ "):
            flush()
            pending = line.lstrip()[2:]
        elif console:
            shown.append(line)
            continue
        elif line.strip() and not line.lstrip().startswith("#"):
            pending = line
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        commands.append(Command(shlex.split(pending, comments=True), ""))
        pending = ""
    flush()
    assert not pending, f"{block.where}: the last command ends with a line continuation"
    return [c for c in commands if c.argv]


def is_fencemark(argv: list[str]) -> bool:
    return bool(argv) and Path(argv[0]).name == "fencemark"


def fencemark_command() -> list[str]:
    """The ``fencemark`` entry point of this interpreter's environment."""
    script = Path(sys.executable).with_name("fencemark")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fencemark.node"]


def json_keys(value: object) -> object:
    """The key structure of a JSON value (values themselves vary from run to run)."""
    if isinstance(value, dict):
        return {key: json_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_keys(item) for item in value[:1]]
    return None


@pytest.mark.slow  # spawns a CLI process per command
@pytest.mark.parametrize("block", _params(SHELL_BLOCKS))
async def test_cli_example_runs(block: Block, node: NodeServer, start_node: StartNode) -> None:
    commands = parse_commands(block)
    assert commands, f"{block.where}: a shell block without commands; mark it not-executed"
    for command in commands:
        assert is_fencemark(command.argv), (
            f"{block.where}: only `fencemark` commands can be run by the docs test, got"
            f" {shlex.join(command.argv)!r}; mark the block <!-- not-executed: reason -->"
        )
        operators = SHELL_OPERATORS.intersection(command.argv)
        assert not operators, f"{block.where}: commands run without a shell, found {operators}"
    targets = {DOCUMENTED_TARGET: node.address}
    if DOCUMENTED_READ_ONLY_TARGET in block.code:
        read_only = await start_node(enable_writes=False)
        targets[DOCUMENTED_READ_ONLY_TARGET] = read_only.address
    env = {**os.environ, "FENCEMARK_TARGET": node.address, "FENCEMARK_TARGETS": node.address}
    for command in commands:
        argv = [*fencemark_command()]
        for arg in command.argv[1:]:
            for documented, real in targets.items():
                arg = arg.replace(documented, real)
            argv.append(arg)
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
        )
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            out, err = await process.communicate()
        shown = shlex.join(command.argv)
        assert process.returncode == 0, (
            f"{block.where}: `{shown}` exited {process.returncode}\n"
            f"stdout:\n{out.decode(errors='replace')}\nstderr:\n{err.decode(errors='replace')}"
        )
        try:
            documented_json = json.loads(command.shown)
        except ValueError:
            continue  # no output shown, or not JSON (a table, a walkthrough)
        real_json = json.loads(out)
        assert json_keys(real_json) == json_keys(documented_json), (
            f"{block.where}: `{shown}` prints other keys than the document shows:\n"
            f"{out.decode(errors='replace')}"
        )


# -- the rules themselves -----------------------------------------------------------


def test_the_api_guide_has_examples_of_every_kind() -> None:
    assert API_DOC.is_file(), "docs/api.md is missing"
    python = [b for b in PYTHON_BLOCKS if b.path == API_DOC and b.not_executed is None]
    assert any("AsyncClient" in b.code and "await" in b.code for b in python)
    assert any("Client(" in b.code and "await" not in b.code for b in python)
    assert any(b.not_executed is None for b in SHELL_BLOCKS)


def test_python_examples_name_the_target_by_its_variable() -> None:
    """A literal documented address would not be pointed at the test's node."""
    for block in PYTHON_BLOCKS:
        if block.not_executed is not None:
            continue
        strings = [
            token.string
            for token in tokenize.generate_tokens(io.StringIO(block.code).readline)
            if token.type == tokenize.STRING
        ]
        for documented in (DOCUMENTED_TARGET, DOCUMENTED_READ_ONLY_TARGET):
            assert not any(documented in string for string in strings), (
                f"{block.where}: use TARGET or READ_ONLY_TARGET, not {documented!r}"
            )


def test_every_marker_precedes_a_block() -> None:
    """A marker followed by prose would skip nothing, silently: it is a mistake."""
    for path in documents():
        used = {b.marker_line for b in parse_blocks(path)}
        for line in standalone_markers(path):
            assert line in used, (
                f"{path.relative_to(ROOT)}:{line + 1}: this <!-- not-executed --> marker is not"
                " right before a code block"
            )


def test_the_block_parser_reads_markers_and_indented_fences(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Intro\n\n<!-- not-executed: needs grpcurl -->\n```sh\ngrpcurl list\n```\n\n"
        "- item\n\n  ```python\n  print(1)  # 1\n  ```\n<!-- not-executed -->\n```py\nx\n```\n"
    )
    blocks = parse_blocks(doc)
    assert [(b.lang, b.not_executed, b.code) for b in blocks] == [
        ("sh", "needs grpcurl", "grpcurl list\n"),
        ("python", None, "print(1)  # 1\n"),
        ("py", "", "x\n"),
    ]
    assert expected_output(blocks[1].code) == ["1"]
