"""The node's layers (docs/architecture.md, *Layers*): imports point one way, downwards.

Each folder of ``fencemark.node`` is a layer, and a module may import only from its
own layer and the ones this table allows beneath it, so the picture in the docs
stays the code's: no circle, no import running back up, and the tools on top that
nothing in the node imports. Imports made inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

NODE = Path(__file__).resolve().parent.parent / "node" / "fencemark" / "node"

BELOW: dict[str, set[str]] = {
    "crdt": set(),
    "store": {"crdt"},
    "rules": {"crdt"},
    "security": {"crdt", "rules"},
    "core": {"crdt", "store", "rules", "security"},
    "coordination": {"crdt", "store", "rules", "security", "core"},
    "replication": {"crdt", "store", "rules", "security", "core", "coordination"},
    "api": {"crdt", "store", "rules", "security", "core", "coordination", "replication"},
    "tools": {
        "crdt",
        "store",
        "rules",
        "security",
        "core",
        "coordination",
        "replication",
        "api",
    },
}


def layer_imports(path: Path) -> set[str]:
    """The layers of ``fencemark.node`` that the module at ``path`` imports from."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "fencemark.node":
                names = [f"fencemark.node.{alias.name}" for alias in node.names]
            else:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["fencemark", "node"] and len(parts) > 2 and parts[2] in BELOW:
                found.add(parts[2])
    return found


def modules() -> list[Path]:
    return sorted(p for p in NODE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_of_the_node_is_in_a_layer() -> None:
    loose = [
        p.name
        for p in modules()
        if p.parent == NODE and p.name not in {"__init__.py", "__main__.py"}
    ]
    assert not loose, f"modules outside every layer: {loose}"
    assert {p.parent.name for p in modules() if p.parent != NODE} == set(BELOW)


@pytest.mark.parametrize(
    "path",
    [p for p in modules() if p.parent != NODE],  # not the package's face, nor __main__
    ids=lambda p: str(p.relative_to(NODE)),
)
def test_a_module_imports_only_its_own_layer_and_those_below(path: Path) -> None:
    layer = path.parent.name
    upward = layer_imports(path) - BELOW[layer] - {layer}
    assert not upward, f"{layer}/{path.name} imports from {sorted(upward)}, above or beside it"


def test_the_package_root_hands_on_only_the_version() -> None:
    """``fencemark.node`` itself imports no layer, so importing one layer never
    loads the others."""
    assert layer_imports(NODE / "__init__.py") == set()


SHIPPED = [NODE, NODE.parent.parent.parent / "client", NODE.parent.parent.parent / "bench"]


def test_no_shipped_loop_waits_with_wait_for() -> None:
    """``asyncio.wait_for`` on Python 3.11 can lose a cancellation that arrives just as
    the awaited thing completes; a loop waiting that way outlives ``stop()``, which then
    waits for it forever (a node that never stops). ``asyncio.timeout`` does not."""
    offenders = []
    for root in SHIPPED:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "wait_for":
                    offenders.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert not offenders, f"use asyncio.timeout instead of asyncio.wait_for: {offenders}"


def test_the_architecture_quotes_the_assembly_of_the_layers_as_start_makes_it() -> None:
    """docs/architecture.md shows ``NodeServer.start``'s one call per layer: each
    line it quotes is a line of ``start``, in the same order."""
    doc = (NODE.parents[2] / "docs" / "architecture.md").read_text()
    quoted = doc.split("reads as the [layers](#layers)", 1)[1].split("```python\n", 1)[1]
    quoted_lines = [line.split("#")[0].strip() for line in quoted.split("```", 1)[0].splitlines()]
    source = (NODE / "api" / "server.py").read_text()
    start = source.split("    async def start(cls", 1)[1].split("\n    def ", 1)[0]
    code = [line.split("#")[0].strip() for line in start.splitlines()]
    positions = [code.index(line) for line in quoted_lines if line]
    assert len(positions) == len([line for line in quoted_lines if line])
    assert positions == sorted(positions)
