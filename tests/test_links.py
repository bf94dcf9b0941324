"""Every reference in the repository resolves inside it (issue 42).

The contract is ``docs/spec.md``; code, tests and docs cite its sections as
"SPEC §n". A clone, an installed wheel and a repository ``fencemark init`` wrote
into must be able to follow every reference, so:

- every relative Markdown link (``[text](target)``, ``[text](target#anchor)``,
  images and reference definitions alike) of a tracked ``*.md`` file names a
  tracked file or directory inside the repository, and its anchor a heading of
  that file, by GitHub's anchor rules (lowercase, punctuation but ``-`` and ``_``
  dropped, spaces to ``-``, a repeated heading ``-1``, ``-2``, ...). Links with a
  scheme (``https:``, ``mailto:``) are not followed. A template file's links are
  followed from where ``fencemark init`` writes it (its ``LAYOUT`` destination);
- a link whose text is a SPEC citation (``[SPEC §4](spec.md#4-admission-rules)``)
  goes to that very section;
- every "SPEC §n" citation of any tracked text file ("SPEC §2, §8", "SPEC §2/§4",
  "SPEC §4's", "SPEC §1.7" for a step of §1) names a section of docs/spec.md, and
  every "§n" inside docs/spec.md does too;
- no tracked file names the contract's old place outside the repository;
- the template, as ``fencemark init`` writes it into a fresh repository, has links
  that resolve there: its citations lead to the ``.fencemark/spec.md`` it wrote.

Generated protobuf modules and binary files are not read. Nothing here starts a
node or touches the network.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from fencemark.node.tools import adopt

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "spec.md"
TEMPLATE = ROOT / "template"

# The contract's old home, beside the repository: spelt in pieces so that this file
# does not name it itself.
OUTSIDE = ("../" + "shared", "shared/" + "SPEC", "SPEC" + ".md")

SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
# [text](target "title"), ![alt](target): the text may hold one level of brackets.
INLINE_LINK = re.compile(
    r"!?\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]"
    r"\(\s*(?:<(?P<angled>[^>\n]*)>|(?P<bare>[^\s()]*(?:\([^\s()]*\)[^\s()]*)*))"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REFERENCE = re.compile(r"^ {0,3}\[(?P<text>[^\]]+)\]:[ \t]*<?(?P<bare>[^\s>]+)>?", re.MULTILINE)
# "SPEC §2", "SPEC §2, §8", "SPEC §2/§4", "SPEC §1 and §7", "SPEC §1.7", "SPEC §4's",
# also wrapped over a line (a comment's leader between the two).
CITATION = re.compile(
    r"\bSPEC(?:\s|#|//)+§(\d+)(?:\.\d+)?((?:\s*(?:,|/|&|\band\b|\bor\b)\s*§\d+(?:\.\d+)?)*)"
)
SECTION_REF = re.compile(r"§(\d+)")
SPEC_SECTION = re.compile(r"^## (\d+)\. ", re.MULTILINE)
CITATION_TEXT = re.compile(r"^(?:SPEC\s+)?§(\d+)\b")


@dataclass(frozen=True)
class Link:
    source: Path  # the Markdown file
    line: int
    text: str
    target: str  # as written, anchor included

    def where(self, root: Path = ROOT) -> str:
        return f"{self.source.relative_to(root)}:{self.line}"


def git_files() -> list[Path]:
    """Tracked files that exist, but the generated protobuf modules."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"],
        capture_output=True, check=True, timeout=30,
    ).stdout.decode().split("\0")  # fmt: skip
    files = [ROOT / name for name in listed if name and "_pb2" not in Path(name).name]
    return [path for path in files if path.is_file()]


@functools.cache
def tracked_texts() -> dict[Path, str]:
    """Every tracked text file, read (a file with a NUL byte, or that is not UTF-8,
    is binary and left out)."""
    texts = {}
    for path in git_files():
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            texts[path] = data.decode()
        except UnicodeDecodeError:
            continue
    return texts


@functools.cache
def tracked_paths() -> frozenset[Path]:
    """Tracked files and every directory that holds one: what a link may name."""
    found: set[Path] = set()
    for path in git_files():
        found.add(path)
        found.update(parent for parent in path.parents if parent.is_relative_to(ROOT))
    return frozenset(found)


def markdown_files(texts: dict[Path, str]) -> dict[Path, str]:
    return {path: text for path, text in texts.items() if path.suffix == ".md"}


def _blank(match: re.Match[str]) -> str:
    """A match replaced by spaces, its newlines kept: offsets and lines stay put."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(markdown: str) -> str:
    """``markdown`` with what is not prose blanked out: YAML front matter, fenced
    code blocks, HTML comments and code spans."""
    lines = markdown.split("\n")
    if lines and lines[0] == "---":
        end = next((i for i in range(1, len(lines)) if lines[i] == "---"), 0)
        for i in range(end + 1):
            lines[i] = " " * len(lines[i])
    fence: str | None = None
    for i, line in enumerate(lines):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
            lines[i] = " " * len(line)
        elif fence is not None:
            # closed by a run of the same character, at least as long, and nothing else
            if re.fullmatch(rf" {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*", line):
                fence = None
            lines[i] = " " * len(line)
    text = COMMENT.sub(_blank, "\n".join(lines))
    return CODE_SPAN.sub(_blank, text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger, without the count)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> tuple[str, ...]:
    """The anchors of ``path``'s headings, in order; a repeated heading's gets
    ``-1``, ``-2``, ... as on GitHub."""
    text = path.read_text()
    masked = prose(text).split("\n")
    seen: dict[str, int] = {}
    found: list[str] = []
    for index, line in enumerate(text.split("\n")):
        if not re.match(r"^ {0,3}#{1,6}(?:[ \t]|$)", masked[index]):
            continue
        match = HEADING.match(line)
        if match is None:
            continue
        base = result = slug(match.group(2) or "")
        while result in seen:
            seen[base] += 1
            result = f"{base}-{seen[base]}"
        seen[result] = 0
        found.append(result)
    return tuple(found)


def links(path: Path, text: str) -> Iterator[Link]:
    """Every inline link, image and reference definition of a Markdown text."""
    masked = prose(text)
    for pattern in (INLINE_LINK, REFERENCE):
        for match in pattern.finditer(masked):
            groups = match.groupdict()
            target = groups["angled"] if groups.get("angled") is not None else groups["bare"]
            line = masked.count("\n", 0, match.start()) + 1
            label = text[match.start("text") : match.end("text")]
            yield Link(path, line, label, target or "")


def resolve(link: Link, base: Path, root: Path, exists: frozenset[Path] | None) -> str | None:
    """Why ``link``, followed from directory ``base``, does not resolve inside
    ``root`` (None when it does). ``exists``: the paths that count as there
    (tracked ones), or None for whatever is on disk."""
    target = link.target
    if SCHEME.match(target):
        return None  # https:, mailto: ... are not followed
    path_part, _, anchor = target.partition("#")
    if target.startswith("/"):
        return f"{target!r} is an absolute path: write it relative to the file"
    if path_part:
        normal = Path(os.path.normpath(base / unquote(path_part)))
        if not normal.is_relative_to(root):
            return f"{target!r} leads outside the repository"
        there = normal in exists if exists is not None else normal.exists()
        if not there:
            return f"{target!r}: no such file in the repository"
    else:
        normal = link.source
    if anchor:
        if normal.is_dir() or normal.suffix != ".md":
            return f"{target!r}: an anchor into a file that is not Markdown"
        if unquote(anchor) not in anchors(normal):
            return f"{target!r}: {normal.relative_to(root)} has no heading with anchor #{anchor}"
    return None


def base_of(path: Path) -> Path:
    """The directory a file's relative links start from: its own, or for a template
    file, the one ``fencemark init`` writes it to (relative to this repository)."""
    if path.is_relative_to(TEMPLATE):
        written = adopt.LAYOUT.get(str(path.relative_to(TEMPLATE)))
        if written is not None:
            return (ROOT / written).parent
    return path.parent


@functools.cache
def spec_sections(path: Path = SPEC) -> dict[str, str]:
    """Section number → its anchor, from the ``## n. Title`` headings of the spec."""
    text = path.read_text()
    by_anchor = dict.fromkeys(anchors(path))
    sections = {}
    for match in SPEC_SECTION.finditer(text):
        line = text[match.start() : text.index("\n", match.start())]
        anchor = slug(line.removeprefix("## "))
        assert anchor in by_anchor, anchor
        sections[match.group(1)] = anchor
    return sections


def _as_its_text(link: re.Match[str]) -> str:
    """A link replaced by its text, the rest blanked (lines stay put)."""
    whole, start = link.group(0), link.start()
    before = whole[: link.start("text") - start]
    after = whole[link.end("text") - start :]
    return re.sub(r"[^\n]", " ", before) + link.group("text") + re.sub(r"[^\n]", " ", after)


def cited_sections(text: str, markdown: bool = True) -> Iterator[tuple[int, str]]:
    """(line, section number) of every SPEC citation in ``text``; in Markdown a
    link counts as its text (``[SPEC §2](...), [§8](...)`` cites §2 and §8)."""
    if markdown:
        text = INLINE_LINK.sub(_as_its_text, text)
    for match in CITATION.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        yield line, match.group(1)
        for number in SECTION_REF.findall(match.group(2)):
            yield line, number


def report(problems: list[str], rule: str) -> str:
    return f"{len(problems)} {rule}:\n" + "\n".join(problems)


def check_links(files: dict[Path, str], root: Path, exists: frozenset[Path] | None) -> list[str]:
    problems = []
    for path, text in sorted(files.items()):
        base = base_of(path) if root == ROOT else path.parent
        for link in links(path, text):
            why = resolve(link, base, root, exists)
            if why:
                problems.append(f"{link.where(root)}: {why}")
    return problems


def check_citation_links(files: dict[Path, str], root: Path) -> list[str]:
    problems = []
    for path, text in sorted(files.items()):
        base = base_of(path) if root == ROOT else path.parent
        for link in links(path, text):
            cited = CITATION_TEXT.match(link.text.strip())
            if cited is None or SCHEME.match(link.target):
                continue
            path_part, _, anchor = link.target.partition("#")
            spec = Path(os.path.normpath(base / unquote(path_part))) if path_part else path
            if spec.name != "spec.md" or not spec.is_file():
                problems.append(f"{link.where(root)}: {link.target!r} is not a spec.md")
                continue
            wanted = spec_sections(spec).get(cited.group(1))
            if anchor != wanted:
                problems.append(
                    f"{link.where(root)}: [{link.text}] goes to #{anchor or '(no anchor)'},"
                    f" not to §{cited.group(1)} (#{wanted})"
                )
    return problems


# -- the repository ---------------------------------------------------------------


def test_every_relative_markdown_link_resolves_to_a_tracked_file_and_heading() -> None:
    files = markdown_files(tracked_texts())
    assert SPEC in files and ROOT / "README.md" in files
    problems = check_links(files, ROOT, tracked_paths())
    assert not problems, report(problems, "links that do not resolve inside the repository")


def test_a_linked_spec_citation_goes_to_the_section_it_names() -> None:
    problems = check_citation_links(markdown_files(tracked_texts()), ROOT)
    assert not problems, report(problems, "SPEC citations linked to another place")


def test_every_spec_citation_names_a_section_of_docs_spec_md() -> None:
    sections = spec_sections()
    assert set(sections) == {str(n) for n in range(1, 11)}, sorted(sections)
    problems = []
    cited = 0
    for path, text in sorted(tracked_texts().items()):
        for line, number in cited_sections(text, markdown=path.suffix == ".md"):
            cited += 1
            if number not in sections:
                problems.append(f"{path.relative_to(ROOT)}:{line}: SPEC §{number}")
    assert cited > 100  # the pattern still finds the citations
    assert not problems, report(problems, "citations of sections docs/spec.md does not have")


def test_every_section_the_spec_refers_to_exists() -> None:
    sections = spec_sections()
    text = SPEC.read_text()
    problems = [
        f"docs/spec.md:{text.count(chr(10), 0, match.start()) + 1}: §{match.group(1)}"
        for match in SECTION_REF.finditer(text)
        if match.group(1) not in sections
    ]
    assert not problems, report(problems, "references to sections docs/spec.md does not have")


def test_no_file_names_the_contract_outside_the_repository() -> None:
    problems = [
        f"{path.relative_to(ROOT)}:{number}: {needle}"
        for path, text in sorted(tracked_texts().items())
        for number, line in enumerate(text.split("\n"), 1)
        for needle in OUTSIDE
        if needle in line
    ]
    assert not problems, report(problems, "mentions of the contract's old place outside")


# -- the template, as init writes it ----------------------------------------------


def test_the_template_s_links_resolve_where_init_writes_it(tmp_path: Path) -> None:
    repo = tmp_path / "widgets"
    repo.mkdir()
    bindings = adopt.make_bindings("widgets", "us", {"us": "127.0.0.1:7400"})
    result = adopt.init(repo, bindings)
    assert not result.left and (repo / adopt.CONTRACT).is_file()
    written = {path: path.read_text() for path in repo.rglob("*.md")}
    protocol = repo / ".fencemark" / "protocol.md"
    assert protocol in written
    problems = check_links(written, repo, exists=None)
    problems += check_citation_links(written, repo)
    assert not problems, report(problems, "links of the template that do not resolve after init")
    # The protocol's citations are links to the contract init wrote beside it.
    targets = {link.target.partition("#")[0] for link in links(protocol, written[protocol])}
    assert "spec.md" in targets


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """A broken link, a wrong anchor, a link out of the repository, a citation of a
    missing section and a citation linked to another section are each reported."""
    (tmp_path / "docs").mkdir()
    spec = tmp_path / "docs" / "spec.md"
    spec.write_text("# S\n\n## 1. One\n\n## 2. Two\n\n## 2. Two\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[a](spec.md#1-one) [b](spec.md#2-two-1) [c](https://example.com/x.md)\n"
        "[d](missing.md) [e](spec.md#3-three) [f](../../outside.md)\n"
        "`[g](in-code.md)` [SPEC §2](spec.md#1-one) SPEC §2, §9\n"
        "```\n[h](in-a-block.md)\n```\n"
    )
    files = {spec: spec.read_text(), page: page.read_text()}
    broken = check_links(files, tmp_path, exists=None)
    assert [p.split(": ", 1)[0] for p in broken] == ["docs/page.md:2"] * 3, broken
    assert "missing.md" in broken[0] and "#3-three" in broken[1] and "outside" in broken[2]
    assert anchors(spec) == ("s", "1-one", "2-two", "2-two-1")
    wrong = check_citation_links(files, tmp_path)
    assert len(wrong) == 1 and "docs/page.md:3" in wrong[0], wrong
    assert list(cited_sections(page.read_text())) == [(3, "2"), (3, "2"), (3, "9")]
