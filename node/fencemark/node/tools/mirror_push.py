"""``fencemark mirror --push``: what agents finish goes back to the issue (docs/adopting.md).

For each item ``fencemark mirror`` brought in (``issue-N``, author ``backlog-pm``,
kind ``Issue``) whose state changed since it was last pushed:

- ``done``: one comment — who finished it, when, and its result fields — then the
  issue is closed (not with ``--no-close``, or ``close = false`` under ``[push]`` in
  the bindings);
- ``parked``: one comment (``parked after N attempts: last error …``) and a label,
  ``fencemark:parked`` unless the bindings name another;
- ``failed`` or ``deferred`` (the item stays open): nothing, unless ``--comment-on``
  names the outcome;
- open again after a done or parked was pushed: the issue is reopened (or loses the
  parked label) with a comment.

An item closed or reopened *upstream* (by ``mirror`` itself, from the issue) is
recorded and needs no comment: the issue already says so.

**Once.** What was pushed is recorded on the item (field ``issuePushed``, state and
token: ``done:3``), an unfenced write through the node's rules. Each comment ends
with an HTML comment naming the item, the state and the token; before it comments,
the push reads the issue's comments (``gh issue view N --json comments,state``) and
skips a comment whose marker is there — a crash between the comment and the record
costs no second comment. Two runs at once take turns: a run holds the claim of the
record ``repo/<repo>/mem/fencemark.mirror/push-<topic>`` (kept alive while it runs;
another run waits for it in line), and checks it still holds it before every write
to the tracker.

**Through ``gh``.** ``gh issue comment N --body-file -`` (the body on standard
input), ``gh issue close``, ``gh issue reopen`` and ``gh issue edit --add-label`` /
``--remove-label``. ``--dry-run`` prints those commands and their bodies and runs
nothing. A failed command — ``gh`` missing, not authenticated, rate-limited, or
refused for one issue — is one line naming the issue and the cause; nothing is
recorded for that issue, the others go on, and the exit code is 1.

**Agents' words.** Results and owners are written by agents: in a comment they are
quoted with ``<``, ``>`` and ``&`` escaped (no HTML, no forged marker), an ``@``
before a name broken by a zero-width space (no one is mentioned), and the keywords
that close issues (``closes``, ``fixes``, ``resolves`` …) broken the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import re
import shlex
import socket
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fencemark.client import AsyncClient, ClaimConflict, ClaimEvent, FencemarkError, Record
from fencemark.client.keepalive import ClaimLost, Hold
from fencemark.node.tools.adopt import AdoptError, Bindings, PushBindings
from fencemark.node.tools.cli_rpc import failed
from fencemark.node.tools.mirror import (
    AUTHOR,
    CLOSED_RESULT,
    HOME_PREFIX,
    KIND,
    OWNER,
    REOPENED_REASON,
    STATE_FIELD,
)

PUSHED_FIELD = "issuePushed"
GH = "gh"
ITEM = re.compile(r"issue-([1-9][0-9]{0,17})")
# The fields mirror writes itself: everything else on a done item is its result.
MIRROR_FIELDS = frozenset({"kind", "author", "title", "body", "url", STATE_FIELD, PUSHED_FIELD})
LOCK_TOPIC = "fencemark.mirror"
LOCK_LEASE_S = 15.0  # a run that died holds up the next for at most this
LOCK_WAIT_S = 120.0  # a run waits this long for another to finish
GH_LIMIT_S = 60.0  # one gh command
MAX_QUOTED = 1_000  # characters of one agent-written value in a comment
# An issue-closing keyword of GitHub's, and a mention: broken by a zero-width space.
ZWSP = "\u200b"
# GitHub closes an issue on a keyword, then a reference: #N, OWNER/REPO#N or its URL.
CLOSING = re.compile(
    r"\b(?:clos(?:e|es|ed)|fix(?:es|ed)?|resolv(?:e|es|ed))"
    r"(?=:?\s+(?:[\w.-]+/[\w.-]+)?#\d|:?\s+https?://\S+/(?:issues|pull)/\d)",
    re.IGNORECASE,
)
MENTION = re.compile(r"@(?=[A-Za-z0-9_-])")


def marker(item: str, state: str, token: int) -> str:
    """The invisible mark a comment of this push carries."""
    return f"<!-- fencemark:push item={item} state={state} token={token} -->"


def quoted(text: str) -> str:
    """An agent's words, safe in a comment: no HTML, no mention, no closing keyword,
    at most ``MAX_QUOTED`` characters, on one line."""
    text = " ".join(text.split())
    if len(text) > MAX_QUOTED:
        text = text[: MAX_QUOTED - 1] + "…"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = MENTION.sub("@" + ZWSP, text)
    return CLOSING.sub(lambda m: m[0][0] + ZWSP + m[0][1:], text)


@dataclass(frozen=True)
class Step:
    """What one issue needs: a comment (with its marker) and the commands after it,
    or neither when the change only needs recording."""

    number: int
    item: str
    key: str
    state: str  # done, parked, open, failed, deferred
    token: int
    body: str = ""  # the comment; empty: none
    then: tuple[tuple[str, ...], ...] = ()  # gh arguments after `gh issue`

    @property
    def pushed(self) -> str:
        return f"{self.state}:{self.token}"

    @property
    def mark(self) -> str:
        return marker(self.item, self.state, self.token)


def mirrored(records: Iterable[Record]) -> list[tuple[int, Record]]:
    """The items mirror brought in, by issue number."""
    found = []
    for record in records:
        match = ITEM.fullmatch(record.id)
        if match and not record.deleted and record.author == AUTHOR and record.kind == KIND:
            found.append((int(match[1]), record))
    return sorted(found, key=lambda pair: pair[0])


def _latest(events: Sequence[ClaimEvent], kind: str, detail: str = "") -> ClaimEvent | None:
    for event in reversed(events):
        if event.kind == kind and (not detail or event.detail == detail):
            return event
    return None


def _when(at: datetime.datetime | None) -> str:
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC") if at else "a moment ago"


def _results(record: Record) -> list[str]:
    """The result fields of a finished item, ``result`` first, as Markdown lines."""
    names = sorted(n for n in record.fields if n not in MIRROR_FIELDS and record.fields[n])
    names.sort(key=lambda n: n != "result")
    return [f"- {quoted(n)}: {quoted(record.fields[n])}" for n in names]


def _error(record: Record) -> str:
    for name in ("error", "lastError", "result"):
        if record.fields.get(name):
            return quoted(record.fields[name])
    return "none recorded"


def _body(lines: Sequence[str], mark: str) -> str:
    return "\n".join([*lines, "", mark]) + "\n"


async def plan(
    client: AsyncClient, number: int, record: Record, settings: PushBindings
) -> Step | None:
    """What ``record``'s issue needs now, or None when nothing changed since the push."""
    pushed = record.fields.get(PUSHED_FIELD, "")
    token = record.fence
    item = record.id

    def step(state: str, body: Sequence[str] = (), *then: tuple[str, ...]) -> Step | None:
        if pushed == f"{state}:{token}":
            return None
        mark = marker(item, state, token)
        text = _body(body, mark) if body else ""
        return Step(number, item, record.key, state, token, text, tuple(then))

    if record.status == "done":
        if pushed == f"done:{token}":
            return None
        events = (await client.history(record.key)).events
        finished = _latest(events, "released", "done")
        if record.fields.get("result") == CLOSED_RESULT and (
            finished is None or finished.owner == OWNER
        ):
            return None  # closed upstream: the issue says so already, nothing to record
        who = quoted(finished.owner) if finished else "an agent"
        when = _when(finished.at if finished else None)
        lines = [f"Done by {who} on {when} (fencing token {token})."]
        results = _results(record)
        if results:
            lines += ["", *results]
        then = [("close", str(number))] if settings.close else []
        return step("done", lines, *then)
    if record.status == "parked":
        lines = [f"Parked after {record.attempts} attempts: last error: {_error(record)}.",
                 "Agents take it again once it is reopened in the backlog."]  # fmt: skip
        return step("parked", lines, ("edit", str(number), "--add-label", settings.parked_label))
    if pushed.startswith(("done:", "parked:")):
        events = (await client.history(record.key)).events
        reopened = _latest(events, "reopened")
        if reopened is not None and reopened.detail == REOPENED_REASON:
            return step("open")  # reopened upstream: only recorded
        why = f": {quoted(reopened.detail)}" if reopened and reopened.detail else ""
        lines = [f"Reopened in the backlog{why}. Agents take it again."]
        if pushed.startswith("done:"):
            return step("open", lines, ("reopen", str(number)))
        return step("open", lines, ("edit", str(number), "--remove-label", settings.parked_label))
    outcome = record.last_outcome
    if outcome in settings.comment_on:  # a new attempt's outcome: a new token
        return step(outcome, [f"Attempt {record.attempts} ended {outcome}: {_error(record)}."])
    return None


class GhFailed(Exception):
    """A ``gh`` command failed: the message names the cause in one line."""


@dataclass(frozen=True)
class Gh:
    """The GitHub CLI, one command at a time, on ``repo`` (``-R``) or on the one it
    picks itself (``GH_REPO``, the directory's git remote)."""

    repo: str = ""

    def argv(self, *args: str) -> list[str]:
        return [GH, "issue", *args, *(["-R", self.repo] if self.repo else [])]

    async def run(self, *args: str, stdin: str = "") -> str:
        argv = self.argv(*args)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        except FileNotFoundError:
            raise GhFailed(f"{GH} is not installed (GitHub's CLI, `gh`)") from None
        try:
            async with asyncio.timeout(GH_LIMIT_S):
                out, err = await proc.communicate(stdin.encode())
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise GhFailed(f"`gh issue {args[0]}` gave no answer in {GH_LIMIT_S:.0f} s") from None
        if proc.returncode != 0:
            raise GhFailed(_cause(err.decode(errors="replace"), args[0]))
        return out.decode(errors="replace")


def _cause(stderr: str, command: str) -> str:
    lowered = stderr.lower()
    if "gh auth login" in lowered or "not logged in" in lowered or "authentication" in lowered:
        return "gh is not authenticated (run `gh auth login`, or set GH_TOKEN)"
    if "rate limit" in lowered:
        return "GitHub's rate limit was reached: run again later"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return f"`gh issue {command}` failed: {lines[-1] if lines else 'no reason given'}"


async def comments_and_state(gh: Gh, number: int) -> tuple[list[str], str]:
    out = await gh.run("view", str(number), "--json", "comments,state")
    try:
        view = json.loads(out)
        bodies = [str(c.get("body", "")) for c in view.get("comments") or []]
        return bodies, str(view.get("state", "")).upper()
    except (ValueError, AttributeError, TypeError):
        raise GhFailed(f"`gh issue view {number}` answered something other than JSON") from None


async def apply(gh: Gh, step: Step, hold: Hold) -> list[str]:
    """Comment unless the issue holds the marker already, then the commands after it.
    What was done, as words."""
    done: list[str] = []
    if not (step.body or step.then):
        return done
    comments, state = await comments_and_state(gh, step.number)
    if step.body and not any(step.mark in body for body in comments):
        hold.check()
        await gh.run("comment", str(step.number), "--body-file", "-", stdin=step.body)
        done.append("commented")
    for args in step.then:
        if (args[0] == "close" and state == "CLOSED") or (args[0] == "reopen" and state == "OPEN"):
            continue
        hold.check()
        await gh.run(*args)
        done.append({"close": "closed", "reopen": "reopened"}.get(args[0], "labelled"))
    return done


@asynccontextmanager
async def turn(client: AsyncClient, bindings: Bindings) -> AsyncIterator[Hold]:
    """This run's turn to push: the claim of the push record, kept alive; another run
    waits for it in line (``LOCK_WAIT_S``)."""
    ident = f"push-{bindings.topic}"
    key = f"repo/{bindings.repo}/mem/{LOCK_TOPIC}/{ident}"
    with contextlib.suppress(ClaimConflict):  # made before, and another run's turn now
        await client.remember(
            bindings.repo, LOCK_TOPIC, ident, title="mirror --push runs one at a time",
            tags=[HOME_PREFIX + bindings.region],
        )  # fmt: skip
    owner = f"mirror-push@{socket.gethostname()}:{os.getpid()}"
    claim = await client.claim(key, owner, lease_seconds=LOCK_LEASE_S, wait_seconds=LOCK_WAIT_S)
    if not claim.granted:
        raise AdoptError(f"--push: another run held {key} for {LOCK_WAIT_S:.0f} s ({claim.reason})")
    try:
        async with client.hold(claim, key=key, lease_seconds=LOCK_LEASE_S) as hold:
            yield hold
    finally:
        with contextlib.suppress(FencemarkError):  # else its lease runs out
            await client.release_claim(key, claim.fencing_token)


def command_line(gh: Gh, args: Sequence[str], body: str = "") -> str:
    line = shlex.join(gh.argv(*args))
    return f"{line} <<'EOF'\n{body}EOF" if body else line


@dataclass
class Outcome:
    lines: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, what: str, line: str = "") -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        if line:
            self.lines.append(line)


async def push(client: AsyncClient, bindings: Bindings, gh: Gh, *, dry_run: bool) -> Outcome:
    records = [r async for r in client.iter_records(bindings.repo, topic=bindings.topic)]
    items = mirrored(records)
    if not items:
        raise AdoptError(
            f"--push: no item of repo {bindings.repo}, topic {bindings.topic} came from"
            " `fencemark mirror` (issue-N, author backlog-pm): run `fencemark mirror` first"
        )
    settings = bindings.push
    result = Outcome()
    if dry_run:
        for number, record in items:
            step = await plan(client, number, record, settings)
            if step is None:
                result.add("unchanged")
                continue
            result.add("planned", f"# {step.item}: {step.state} (fencing token {step.token})")
            if step.body:
                result.lines.append(
                    command_line(gh, ("comment", str(number), "--body-file", "-"), step.body)
                )
            result.lines.extend(command_line(gh, args) for args in step.then)
        return result
    async with turn(client, bindings) as hold:
        # Read again in this run's turn: a run before it may have pushed meanwhile.
        records = [r async for r in client.iter_records(bindings.repo, topic=bindings.topic)]
        for number, record in mirrored(records):
            step = await plan(client, number, record, settings)
            if step is None:
                result.add("unchanged")
                continue
            try:
                done = await apply(gh, step, hold)
            except GhFailed as exc:
                result.add("failed", f"failed    {step.item}  #{number} {step.state}: {exc}")
                continue
            try:
                await client.update(step.key, fields={PUSHED_FIELD: step.pushed})
            except ClaimConflict as exc:  # an agent holds it again: pushed, recorded next run
                what = ", ".join(done) or "recorded"
                result.add("pushed", f"pushed    {step.item}  #{number} {step.state}: {what};"
                           f" its record waits for the next run ({exc.reason})")  # fmt: skip
                continue
            result.add(
                "pushed",
                f"pushed    {step.item}  #{number} {step.state}: {', '.join(done) or 'recorded'}",
            )
    return result


def run(
    bindings: Bindings, *, gh_repo: str = "", dry_run: bool, timeout: float,
    credentials: Any = None,
) -> int:  # fmt: skip
    """``fencemark mirror --push``: 0 when every issue got what it needed, 1 when a
    ``gh`` command failed for one (the others went on), 2 on a usage error."""

    async def go() -> Outcome:
        async with AsyncClient(bindings.target, regions=bindings.regions, timeout=timeout,
                               credentials=credentials) as client:  # fmt: skip
            return await push(client, bindings, Gh(gh_repo), dry_run=dry_run)

    try:
        outcome = asyncio.run(go())
    except AdoptError as exc:
        print(f"fencemark mirror: {exc}", file=sys.stderr)
        return 2
    except ClaimLost as exc:
        print(f"fencemark mirror: --push lost its turn ({exc}); the next run goes on",
              file=sys.stderr)  # fmt: skip
        return 1
    except FencemarkError as exc:
        return failed(exc, target="", tls=credentials is not None, prefix="fencemark mirror")
    for line in outcome.lines:
        print(line)
    counts = ", ".join(f"{outcome.counts.get(k, 0)} {k}" for k in ("pushed", "failed", "unchanged"))
    if dry_run:
        planned = outcome.counts.get("planned", 0)
        print(f"mirror --push (dry run: nothing run): {planned} planned,"
              f" {outcome.counts.get('unchanged', 0)} unchanged")  # fmt: skip
        return 0
    print(f"mirror --push: {counts}")
    return 1 if outcome.counts.get("failed") else 0
