"""Adopting Fencemark in a repository: its bindings, and ``fencemark init``.

A repository consumes ``template/`` (the agent protocol, the agent definitions, the
MCP client configuration) unmodified, through one small file of *bindings*: its
repo id, its agents' own region and the map of every region's node
(``.fencemark/bindings.toml``). ``fencemark init`` writes the template into a
repository with the bindings filled in, and beside it the contract the protocol
cites (docs/spec.md, as ``.fencemark/spec.md``), never overwriting a file that
differs without ``--force``; a second run changes nothing. ``fencemark mcp --bindings`` and
``fencemark mirror`` read the bindings back (docs/adopting.md).
"""

from __future__ import annotations

import os
import posixpath
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput

BINDINGS = Path(".fencemark/bindings.toml")
# The contract the protocol cites (SPEC §n): `init` writes the installed version's
# docs/spec.md beside the protocol, so that the protocol's links resolve in the
# repository, with its own links to other pages of the project made plain paths.
CONTRACT = Path(".fencemark/spec.md")
SPEC = "spec.md"  # its name in an installed template directory
# The GitHub Actions workflow that runs `fencemark mirror` both ways (docs/adopting.md,
# step 5): rendered with the bindings as flags, as it checks nothing out.
WORKFLOW = "github/fencemark-mirror.yml"
RENDERED = ("bindings.toml", WORKFLOW)  # the template files with {{placeholders}}
# template file -> where `init` writes it, relative to the repository's root
# (SPEC: the contract, found by spec_file()).
LAYOUT = {
    "mcp/stdio.json": ".mcp.json",
    "bindings.toml": str(BINDINGS),
    "README.md": ".fencemark/README.md",
    "protocol.md": ".fencemark/protocol.md",
    SPEC: str(CONTRACT),
    "agents/worker.md": ".fencemark/agents/worker.md",
    "agents/backlog-pm.md": ".fencemark/agents/backlog-pm.md",
    "mcp/http.json": ".fencemark/mcp-http.json",
    WORKFLOW: ".github/workflows/fencemark-mirror.yml",
}
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
# A link of docs/spec.md to another page of the project (not to a section of its own,
# not a URL): the pages do not come with the copy `init` writes.
PAGE_LINK = re.compile(r"\[([^\]]+)\]\((?!#|[A-Za-z][A-Za-z0-9+.-]*:)([^)\s]+)\)")
STANDALONE_NOTE = (
    "> Written by `fencemark init` from Fencemark's `docs/spec.md`. The paths it\n"
    "> names (`docs/...`, `proto/...`) are pages of Fencemark's repository.\n"
)
DEFAULT_PORT = 7400
DEFAULT_TOPIC = "backlog"


class AdoptError(ValueError):
    """Bad input to ``init`` or ``mirror``: a one-line reason naming the field."""


COMMENT_OUTCOMES = ("failed", "deferred")  # outcomes `mirror --push` may comment on


@dataclass(frozen=True)
class PushBindings:
    """``[push]``: what ``fencemark mirror --push`` tells the issues (its flags change
    them for one run)."""

    close: bool = True  # close an issue whose item is done (after its comment)
    parked_label: str = "fencemark:parked"  # the label of an issue whose item is parked
    comment_on: tuple[str, ...] = ()  # of COMMENT_OUTCOMES: they get a comment too


@dataclass(frozen=True)
class Bindings:
    """What a repository sets: its repo id, its agents' own region, every region's
    node, the backlog's topic, and label spellings to priorities (``mirror``)."""

    repo: str
    region: str
    regions: Mapping[str, str]
    topic: str = DEFAULT_TOPIC
    priorities: Mapping[str, str] = field(default_factory=dict)
    push: PushBindings = field(default_factory=PushBindings)

    @property
    def target(self) -> str:
        return self.regions[self.region]

    def regions_flag(self) -> str:
        return ",".join(f"{name}={address}" for name, address in self.regions.items())


def template_dir() -> Path:
    """Where the template is: ``FENCEMARK_TEMPLATE``, the source checkout this module
    belongs to (an editable install), or the copy a wheel installs under
    ``<prefix>/share/fencemark/template``."""
    candidates = [
        Path(os.environ["FENCEMARK_TEMPLATE"]) if os.environ.get("FENCEMARK_TEMPLATE") else None,
        Path(__file__).resolve().parents[4] / "template",
        Path(sys.prefix) / "share" / "fencemark" / "template",
    ]
    for candidate in candidates:
        if candidate is not None and (candidate / "bindings.toml").is_file():
            return candidate
    raise AdoptError(
        "the template is not installed: set FENCEMARK_TEMPLATE to a copy of the"
        " repository's template/ directory"
    )


def spec_file(template: Path) -> Path:
    """The contract (docs/spec.md) that goes with ``template``: the copy a wheel
    installs in the template directory, or the one of the source checkout the
    template belongs to."""
    for candidate in (template / SPEC, template.parent / "docs" / SPEC):
        if candidate.is_file():
            return candidate
    raise AdoptError(
        f"the specification is not installed beside the template ({template / SPEC}):"
        " copy the repository's docs/spec.md there"
    )


def standalone_spec(text: str) -> str:
    """docs/spec.md as ``init`` writes it into a repository: each link to another page
    of the project becomes that page's path in Fencemark's repository (the page is not
    there to link to), and a note under the title says so. Links to the
    specification's own sections stay links."""

    def named(link: re.Match[str]) -> str:
        label, target = link[1], link[2]
        path, _, anchor = target.partition("#")
        page = posixpath.normpath(posixpath.join("docs", path)) + (
            "/" if path.endswith("/") else ""
        )
        where = f"`{page}{'#' + anchor if anchor else ''}`"
        return where if label.strip("`") in (path, page) else f"{label} ({where})"

    title, _, rest = PAGE_LINK.sub(named, text).partition("\n\n")
    return f"{title}\n\n{STANDALONE_NOTE}\n{rest}"


def template_file(template: Path, source: str) -> Path:
    """Where the file ``LAYOUT`` names ``source`` is read from."""
    return spec_file(template) if source == SPEC else template / source


def parse_regions(text: str, flag: str = "--regions") -> dict[str, str]:
    """``us=HOST:PORT,eu=HOST:PORT`` as a map, each name and address checked."""
    regions: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, address = part.partition("=")
        if not sep or not name or not address:
            raise AdoptError(f"{flag}: {part!r} is not REGION=HOST:PORT")
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise AdoptError(f"{flag}: {address!r} (region {name}) is not HOST:PORT")
        _check_segment(name, f"{flag} region name")
        if name in regions:
            raise AdoptError(f"{flag}: region {name} is named twice")
        regions[name] = address
    if not regions:
        raise AdoptError(f"{flag}: no REGION=HOST:PORT given")
    return regions


def _check_segment(value: str, what: str) -> None:
    try:
        validation.segment(value, what)
    except InvalidInput as exc:
        raise AdoptError(f"{what}: {exc}") from None


def make_bindings(repo: str, region: str, regions: Mapping[str, str] | None) -> Bindings:
    _check_segment(repo, "--repo")
    _check_segment(region, "--region")
    regions = dict(regions) if regions else {region: f"127.0.0.1:{DEFAULT_PORT}"}
    if region not in regions:
        raise AdoptError(f"--region: {region} is not one of --regions ({', '.join(regions)})")
    return Bindings(repo, region, regions)


def load_bindings(path: Path = BINDINGS) -> Bindings:
    """The bindings file ``init`` wrote, checked like ``init``'s flags."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise AdoptError(f"{path}: no bindings here (run `fencemark init` first)") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise AdoptError(f"{path}: {exc}") from None
    for name in ("repo", "region"):
        if not isinstance(data.get(name), str):
            raise AdoptError(f"{path}: `{name}` must be a string")
    regions = data.get("regions")
    if not isinstance(regions, dict) or not all(isinstance(v, str) for v in regions.values()):
        raise AdoptError(f"{path}: [regions] must map each region to HOST:PORT")
    flag = f"{path} [regions]"
    checked = parse_regions(",".join(f"{k}={v}" for k, v in regions.items()), flag)
    bindings = make_bindings(data["repo"], data["region"], checked)
    topic = data.get("topic", DEFAULT_TOPIC)
    priorities = data.get("priorities", {})
    if not isinstance(topic, str):
        raise AdoptError(f"{path}: `topic` must be a string")
    _check_segment(topic, f"{path} topic")
    if not isinstance(priorities, dict) or not all(
        isinstance(v, str) and re.fullmatch(r"P[0-9]", v) for v in priorities.values()
    ):
        raise AdoptError(f"{path}: [priorities] must map labels to P0 ... P9")
    push = _push_bindings(path, data.get("push", {}))
    return Bindings(bindings.repo, bindings.region, bindings.regions, topic, priorities, push)


def _push_bindings(path: Path, table: object) -> PushBindings:
    if not isinstance(table, dict):
        raise AdoptError(f"{path}: [push] must be a table")
    unknown = sorted(set(table) - {"close", "parked_label", "comment_on"})
    if unknown:
        raise AdoptError(f"{path}: [push] has no setting {unknown[0]!r}")
    defaults = PushBindings()
    close = table.get("close", defaults.close)
    if not isinstance(close, bool):
        raise AdoptError(f"{path}: [push] `close` must be true or false")
    label = table.get("parked_label", defaults.parked_label)
    if not isinstance(label, str) or not label.strip() or len(label) > 50:
        raise AdoptError(f"{path}: [push] `parked_label` must be a label of 1 to 50 characters")
    outcomes = table.get("comment_on", list(defaults.comment_on))
    if not isinstance(outcomes, list) or not set(outcomes) <= set(COMMENT_OUTCOMES):
        raise AdoptError(f"{path}: [push] `comment_on` must list failed and/or deferred")
    return PushBindings(close, label.strip(), tuple(outcomes))


def git_repo_name(directory: Path) -> str | None:
    """The repository's name from its ``origin`` remote (``.../name.git`` → name)."""
    try:
        url = subprocess.run(
            ["git", "-C", str(directory), "remote", "get-url", "origin"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    name = url.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1].removesuffix(".git")
    return name or None


def render(template: Path, bindings: Bindings) -> dict[str, str]:
    """Every file ``init`` writes, by path relative to the repository: the template's
    files as they are, the bindings file with its placeholders filled, and the
    contract standing alone (``standalone_spec``)."""
    from fencemark.node import __version__

    values = {
        "repo": bindings.repo,
        "region": bindings.region,
        "regions": "\n".join(f'{name} = "{addr}"' for name, addr in bindings.regions.items()),
        "regions_flag": bindings.regions_flag(),
        "version": __version__,
    }
    out = {}
    for source, target in LAYOUT.items():
        text = template_file(template, source).read_text()
        if source in RENDERED:
            text = PLACEHOLDER.sub(lambda m: values[m[1]], text)
        elif source == SPEC:
            text = standalone_spec(text)
        out[target] = text
    return out


@dataclass
class InitResult:
    wrote: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # differ, not overwritten without --force


def init(directory: Path, bindings: Bindings, *, force: bool = False) -> InitResult:
    result = InitResult()
    for relative, text in render(template_dir(), bindings).items():
        path = directory / relative
        current = path.read_text() if path.is_file() else None
        if current == text:
            result.unchanged.append(relative)
        elif current is not None and not force:
            result.left.append(relative)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            result.wrote.append(relative)
    return result


def cmd_init(directory: str, repo: str | None, region: str, regions: str | None,
             force: bool) -> int:  # fmt: skip
    root = Path(directory)
    try:
        if not root.is_dir():
            raise AdoptError(f"--dir: {directory} is not a directory")
        name = repo or git_repo_name(root)
        if not name:
            raise AdoptError("--repo: not given, and no git remote `origin` to take it from")
        bindings = make_bindings(name, region, parse_regions(regions) if regions else None)
        result = init(root, bindings, force=force)
    except AdoptError as exc:
        print(f"fencemark init: {exc}", file=sys.stderr)
        return 2
    for path in result.wrote:
        print(f"wrote      {path}")
    for path in result.unchanged:
        print(f"unchanged  {path}")
    for path in result.left:
        print(f"left       {path} (it differs from the template; --force overwrites it)")
    print(
        f"init: repo {bindings.repo}, region {bindings.region} ({bindings.regions_flag()}):"
        f" {len(result.wrote)} written, {len(result.unchanged)} unchanged,"
        f" {len(result.left)} left"
    )
    return 1 if result.left else 0
