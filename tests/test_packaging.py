"""The package layout and the pins the generated code depends on."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "proto" / "fencemark" / "v1"


def _lower_bound(requirement: str) -> tuple[int, ...]:
    match = re.search(r">=([0-9.]+)", requirement)
    assert match, f"{requirement!r} has no lower bound"
    return tuple(int(part) for part in match.group(1).split("."))


def _requirement(name: str) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dependencies: list[str] = project["dependencies"]
    return next(r for r in dependencies if re.match(rf"{name}\b(?![-_])", r))


@pytest.mark.parametrize("bare", ["node", "client", "v1", "bench"])
def test_no_bare_module_is_importable(bare: str, tmp_path: Path) -> None:
    """The installed package puts only `fencemark` on sys.path (run from a neutral cwd,
    so `python -m pytest` adding the repository root to sys.path does not count)."""
    probe = f"import importlib.util; print(importlib.util.find_spec({bare!r}))"
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "None"


def test_import_names_explain_themselves() -> None:
    for name in (
        "fencemark.node",
        "fencemark.client",
        "fencemark.v1.records_pb2",
        "fencemark.bench",
    ):
        assert importlib.util.find_spec(name) is not None, name


def test_grpcio_pin_is_never_older_than_the_generator() -> None:
    versions = {
        re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", path.read_text()).group(1)  # type: ignore[union-attr]
        for path in GENERATED.glob("*_pb2_grpc.py")
    }
    assert len(versions) == 1
    generated = tuple(int(p) for p in versions.pop().split("."))
    assert _lower_bound(_requirement("grpcio")) >= generated


def test_protobuf_pin_is_never_older_than_the_generator() -> None:
    pattern = re.compile(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),")
    versions = {
        tuple(int(v) for v in pattern.search(path.read_text()).groups())  # type: ignore[union-attr]
        for path in GENERATED.glob("*_pb2.py")
    }
    assert len(versions) == 1
    assert _lower_bound(_requirement("protobuf")) >= versions.pop()
