"""The one rule for a missing component (tests/components.py): skipped with the command
that installs it, failed under CI, and counted in the block at the end of the run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import components

ABSENT = components.Component("absent", "a tool nobody has", "apt-get install -y absent", bool)
HERE = components.Component("here", "a tool everybody has", "true", lambda: True)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(components.COMPONENTS, ABSENT.name, ABSENT)
    monkeypatch.setitem(components.COMPONENTS, HERE.name, HERE)
    components.present.cache_clear()
    yield
    components.present.cache_clear()


def test_a_missing_component_skips_with_its_install_command(
    registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        components.require("here", "absent")
    message = str(skipped.value)
    assert "missing component absent" in message and "apt-get install -y absent" in message
    assert "missing component here" not in message


@pytest.mark.parametrize("ci", ["true", "1", "yes"])
def test_under_ci_a_missing_component_fails_instead(
    registry: None, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"missing component absent.*CI is set"):
        components.require("absent")


def test_a_present_component_lets_the_test_run(registry: None) -> None:
    components.require("here")  # no skip, no failure


def test_the_summary_counts_each_missing_component_once_per_test(registry: None) -> None:
    both = "missing component absent: x; missing component here: y"
    lines = components.summary_lines([both, "missing component absent: x", "some other skip"])
    assert lines[0].split() == ["absent", "2", "tests", "apt-get", "install", "-y", "absent"]
    assert lines[1].split() == ["here", "1", "test", "true"]
    assert "skipped, not passed" in lines[-1] and len(lines) == 3
    assert components.summary_lines(["some other skip"]) == []


def test_a_marker_naming_an_unknown_component_is_a_usage_error() -> None:
    with pytest.raises(pytest.UsageError, match=r"'promtol'.*no such component"):
        components.check_names(["promtool", "promtol"], "tests/test_x.py::test_y")
    components.check_names(["promtool", "docker"], "tests/test_x.py::test_y")
