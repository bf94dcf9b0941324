"""``fencemark mirror``: a repository's issues into the backlog (docs/adopting.md).

Input is what ``gh issue list --state all --json
number,title,body,labels,state,url,updatedAt`` prints (one JSON array), or JSON
lines for other trackers: one object per line with ``number`` (required),
``title`` (required), ``body``, ``url``, ``state`` (``open`` or ``closed``, any
case; default open) and ``labels`` (names, or objects with a ``name``). Every
entry is checked before anything is written: a bad one is refused naming its line
(or array entry) and field, and nothing is imported.

Each issue is the item ``issue-<number>`` of the bindings' repo and topic: title,
body and url as fields, author ``backlog-pm``, kind ``Issue``; labels become tags —
``P0``…``P9``, ``priority:Pn`` and common spellings (``priority: high``, ...; the
bindings' ``[priorities]`` override them) become ``priority:Pn``, ``phase:…`` stays,
a ``region:R`` label homes the item in R (otherwise the bindings' region), anything
else becomes ``label:<name>`` — plus ``backlog``.

Against what the backlog holds: a new open issue is created; a changed title, body,
url or label is written as an unfenced update — unless a claim is live, which
refuses such a write: then the item is reported and left to its holder, and the
next run catches up; an issue closed upstream becomes ``done`` through the node's
own rules (claimed by ``backlog-pm`` and released ``done``), unless someone holds
it — reported and left; an issue reopened upstream is reopened
(``Claims.Reopen``). The item keeps the issue's state as mirror last saw it
(field ``issueState``), so an item an agent finished while its issue is still open
stays done. Nothing is deleted. The same input twice changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from fencemark.client import AsyncClient, ClaimConflict, FencemarkError, Record
from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput
from fencemark.node.tools.adopt import AdoptError, Bindings
from fencemark.node.tools.cli_rpc import failed

AUTHOR, KIND, OWNER = "backlog-pm", "Issue", "backlog-pm"
LEASE_SECONDS = 30.0
BACKLOG_TAG = "backlog"
PRIORITY_PREFIX, PHASE_PREFIX = "priority:", "phase:"
LABEL_PREFIX, REGION_PREFIX = "label:", "region:"
HOME_PREFIX = "homeRegion:"
# Label spellings to priorities; the bindings' [priorities] add to and override these.
PRIORITIES = {
    "critical": "P0", "urgent": "P0", "priority: critical": "P0", "priority: urgent": "P0",
    "high": "P1", "priority: high": "P1", "priority-high": "P1",
    "medium": "P2", "priority: medium": "P2", "priority-medium": "P2",
    "low": "P3", "priority: low": "P3", "priority-low": "P3",
}  # fmt: skip
PRIORITY_LABEL = re.compile(r"(?:priority:\s*)?(P[0-9])", re.IGNORECASE)
# The issue's state upstream as the last run saw it: what tells an issue reopened
# upstream from an item an agent finished while its issue was still open.
STATE_FIELD, OPEN, CLOSED = "issueState", "open", "closed"
CLOSED_RESULT = "closed upstream"
REOPENED_REASON = "reopened upstream"


@dataclass(frozen=True)
class Issue:
    number: int
    title: str
    body: str
    url: str
    closed: bool
    labels: tuple[str, ...]
    where: str  # "line 3" or "entry 3": for messages


def parse(text: str) -> list[Issue]:
    """Every issue of ``gh``'s JSON array or of JSON lines, checked; AdoptError on the
    first bad one, naming it and its field."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AdoptError(f"input: not JSON (line {exc.lineno}: {exc.msg})") from None
        items = [(f"entry {i + 1}", entry) for i, entry in enumerate(entries)]
    else:
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise AdoptError(f"line {number}: not JSON ({exc.msg})") from None
    issues = [_issue(where, entry) for where, entry in items]
    seen: dict[int, str] = {}
    for issue in issues:
        if issue.number in seen:
            raise AdoptError(f"{issue.where}: number {issue.number} again (first at"
                             f" {seen[issue.number]})")  # fmt: skip
        seen[issue.number] = issue.where
    return issues


def _issue(where: str, entry: Any) -> Issue:
    if not isinstance(entry, dict):
        raise AdoptError(f"{where}: not a JSON object")
    number = entry.get("number")
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise AdoptError(f"{where}: field `number` must be a positive integer, got {number!r}")
    title = entry.get("title")
    if not isinstance(title, str) or not title.strip():
        raise AdoptError(f"{where} (issue #{number}): field `title` must be a non-empty string")
    texts = {"title": title}
    for name in ("body", "url"):
        value = entry.get(name) or ""
        if not isinstance(value, str):
            raise AdoptError(f"{where} (issue #{number}): field `{name}` must be a string")
        texts[name] = value
    try:
        validation.fields(texts)
    except InvalidInput as exc:
        raise AdoptError(f"{where} (issue #{number}): {exc}") from None
    state = entry.get("state") or "open"
    if not isinstance(state, str) or state.lower() not in ("open", "closed"):
        raise AdoptError(f"{where} (issue #{number}): field `state` must be open or closed")
    labels = []
    for label in entry.get("labels") or []:
        named = label.get("name") if isinstance(label, dict) else label
        if not isinstance(named, str) or not named:
            raise AdoptError(f"{where} (issue #{number}): field `labels` holds {label!r}")
        labels.append(named)
    return Issue(number, title, texts["body"], texts["url"], state.lower() == "closed",
                 tuple(labels), where)  # fmt: skip


def item_id(issue: Issue) -> str:
    return f"issue-{issue.number}"


def wanted(issue: Issue, bindings: Bindings) -> tuple[dict[str, str], set[str], str]:
    """An issue's fields, the tags mirror sets from its labels, and its home region."""
    priorities = {k.lower(): v for k, v in {**PRIORITIES, **bindings.priorities}.items()}
    tags, home = {BACKLOG_TAG}, bindings.region
    for label in issue.labels:
        lowered = label.lower().strip()
        if lowered in priorities:
            tags.add(PRIORITY_PREFIX + priorities[lowered])
        elif match := PRIORITY_LABEL.fullmatch(label.strip()):
            tags.add(PRIORITY_PREFIX + match[1].upper())
        elif lowered.startswith(PHASE_PREFIX):
            tags.add(PHASE_PREFIX + label.strip()[len(PHASE_PREFIX) :].strip())
        elif lowered.startswith(REGION_PREFIX):
            home = label.strip()[len(REGION_PREFIX) :].strip()
        else:
            tags.add(LABEL_PREFIX + label.strip())
    fields = {"kind": KIND, "author": AUTHOR, "title": issue.title, "body": issue.body,
              "url": issue.url, STATE_FIELD: CLOSED if issue.closed else OPEN}  # fmt: skip
    return fields, tags, home


def check_tags(issues: Sequence[Issue], bindings: Bindings) -> None:
    """Each issue's tags and home within the limits, before anything is written."""
    for issue in issues:
        _, tags, home = wanted(issue, bindings)
        try:
            validation.tags(sorted(tags), "labels")
            validation.segment(home, "region label")
        except InvalidInput as exc:
            raise AdoptError(f"{issue.where} (issue #{issue.number}): {exc}") from None
        if len([t for t in tags if t.startswith(PRIORITY_PREFIX)]) > 1:
            raise AdoptError(f"{issue.where} (issue #{issue.number}): field `labels` names"
                             " more than one priority")  # fmt: skip


@dataclass
class Plan:
    """What a run does, line by line, and its counts."""

    lines: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, what: str, item: str, detail: str = "") -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        if what != "unchanged":
            self.lines.append(f"{what:<9} {item}" + (f"  {detail}" if detail else ""))

    def summary(self, dry_run: bool) -> str:
        order = ("created", "updated", "done", "reopened", "left", "unchanged")
        counts = ", ".join(f"{self.counts.get(k, 0)} {k}" for k in order)
        if not any(self.counts.get(k) for k in order[:5]):
            return f"mirror: nothing to change ({counts})"
        return f"mirror{' (dry run: nothing written)' if dry_run else ''}: {counts}"


def _managed(tag: str) -> bool:
    return tag.startswith((LABEL_PREFIX, PRIORITY_PREFIX, PHASE_PREFIX)) or tag == BACKLOG_TAG


async def mirror(
    client: AsyncClient, bindings: Bindings, issues: Sequence[Issue], *, dry_run: bool
) -> Plan:
    plan = Plan()
    held = {r.id: r async for r in client.iter_records(bindings.repo, topic=bindings.topic)}
    for issue in sorted(issues, key=lambda i: i.number):
        ident = item_id(issue)
        fields, tags, home = wanted(issue, bindings)
        record = held.get(ident)
        if record is None or record.deleted:
            if issue.closed:
                plan.add("unchanged", ident)  # closed before it was ever mirrored
                continue
            if not dry_run:
                await client.remember(bindings.repo, bindings.topic, ident, fields=fields,
                                      tags=sorted({*tags, HOME_PREFIX + home}))  # fmt: skip
            plan.add("created", ident, repr(issue.title[:60]))
            continue
        await _reconcile(client, plan, record, issue, fields, tags, dry_run=dry_run)
    return plan


async def _reconcile(
    client: AsyncClient,
    plan: Plan,
    record: Record,
    issue: Issue,
    fields: Mapping[str, str],
    tags: set[str],
    *,
    dry_run: bool,
) -> None:
    ident = item_id(issue)
    current = set(record.tags)
    add = tags - current
    # Mirror owns label:* tags; a priority or phase from the labels replaces the
    # item's; without one, the item keeps what the PM set.
    remove = {t for t in current if t.startswith(LABEL_PREFIX) and t not in tags}
    for prefix in (PRIORITY_PREFIX, PHASE_PREFIX):
        if any(t.startswith(prefix) for t in tags):
            remove |= {t for t in current if t.startswith(prefix) and t not in tags}
    changed = {k: v for k, v in fields.items() if record.fields.get(k, "") != v}
    needs_done = issue.closed and record.status != "done"
    was_closed = record.fields.get(STATE_FIELD) == CLOSED
    needs_reopen = not issue.closed and was_closed and record.status == "done"
    if not (changed or add or remove or needs_done or needs_reopen):
        plan.add("unchanged", ident)
        return
    what = ", ".join([*sorted(changed), *(f"+{t}" for t in sorted(add)),
                      *(f"-{t}" for t in sorted(remove))])  # fmt: skip
    # Who holds it now: a snapshot (SPEC §1.7), only to report and to skip a write
    # a live claim would refuse anyway — the node decides.
    status = await client.claim_status(record.key)
    if status.claim is not None:
        waiting = "closed upstream" if needs_done else what
        plan.add("left", ident, f"claimed by {status.claim.owner}: {waiting}; left to its holder")
        return
    if (changed or add or remove) and not dry_run:
        try:
            await client.update(record.key, fields=changed, add_tags=sorted(add),
                                remove_tags=sorted(remove))  # fmt: skip
        except ClaimConflict as exc:
            plan.add("left", ident, f"claimed: {what} waits for its release ({exc})")
            return
    if needs_done:
        error = "" if dry_run else await _finish(client, record.key)
        if error:
            plan.add("left", ident, f"closed upstream: {error}")
        else:
            plan.add("done", ident, "closed upstream" + (f"; {what}" if what else ""))
    elif needs_reopen:
        if not dry_run:
            await client.reopen(record.key, REOPENED_REASON)
        plan.add("reopened", ident, "reopened upstream" + (f"; {what}" if what else ""))
    else:
        plan.add("updated", ident, what)


async def _finish(client: AsyncClient, key: str) -> str:
    """Done through the node's rules: claimed by backlog-pm and released done. A reason
    it could not be ("" when done)."""
    claim = await client.claim(key, OWNER, lease_seconds=LEASE_SECONDS)
    if not claim.granted:
        return f"not claimable ({claim.reason})"
    released = await client.release_claim(key, claim.fencing_token, outcome="done",
                                          fields={"result": CLOSED_RESULT})  # fmt: skip
    return "" if released.released else f"release refused ({released.reason})"


def read_input(source: str, stdin: TextIO) -> str:
    if source == "-":
        return stdin.read()
    try:
        with open(source, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise AdoptError(f"--from: {exc.strerror}: {source}") from None


def run(bindings: Bindings, source: str, *, dry_run: bool, timeout: float,
        credentials: Any = None, target: str | None = None,
        stdin: TextIO = sys.stdin) -> int:  # fmt: skip
    try:
        issues = parse(read_input(source, stdin))
        check_tags(issues, bindings)
    except AdoptError as exc:
        print(f"fencemark mirror: {exc}; nothing imported", file=sys.stderr)
        return 2

    async def go() -> Plan:
        async with AsyncClient(target or bindings.target, regions=bindings.regions,
                               timeout=timeout, credentials=credentials) as client:  # fmt: skip
            return await mirror(client, bindings, issues, dry_run=dry_run)

    try:
        plan = asyncio.run(go())
    except FencemarkError as exc:  # the exit code of every command that calls a node
        # It calls several regions' nodes: which one failed is not known ("").
        tls = credentials is not None
        return failed(exc, target="", tls=tls, prefix="fencemark mirror")
    for line in plan.lines:
        print(line)
    print(plan.summary(dry_run))
    return 0
