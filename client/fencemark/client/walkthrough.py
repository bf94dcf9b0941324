"""The seven steps of SPEC §1, run against a live node and checked as they go.

Each observation is printed as one line the moment it is made, marked ✓ when
it is what the contract promises and ✗ when not. The walkthrough can be run
again and again against the same node: it waits out a claim left live by an
earlier run, and only asks that tokens grow relative to what it saw itself.
Every wait is measured on the node's clock (``info().now``), never ours.

    python -m fencemark.client.walkthrough 127.0.0.1:50051
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import grpc

from fencemark.client._aio import AsyncClient
from fencemark.client.errors import ClaimConflict, FencemarkError, NotFound, Unavailable
from fencemark.client.types import Record

__all__ = ["KEY", "run_walkthrough"]

REPO, TOPIC, ID = "lattice", "backlog", "issue-2101"
KEY = f"repo/{REPO}/mem/{TOPIC}/{ID}"
# Slept past a lease expiry so the node's clock is surely beyond it.
LAPSE_MARGIN_SECONDS = 0.2
# A write the home refused NOT_SERVING (settling after a restart or a pause) is sent
# again for this long, every RetryInfo delay (or SETTLE_POLL_SECONDS without one).
SETTLE_WAIT_SECONDS = 15.0
SETTLE_POLL_SECONDS = 0.5


class _Abort(Exception):
    """A step whose outcome the following steps depend on went wrong."""


def _at(moment: datetime | None) -> str:
    return moment.isoformat(timespec="milliseconds") if moment else "(unset)"


def _refusal_text(conflict: ClaimConflict | None) -> str:
    if conflict is None:
        return "admitted (expected a refusal)"
    return f"{conflict.reason} (fence {conflict.fence})"


class _Walkthrough:
    def __init__(self, client: AsyncClient, out: Callable[[str], None]) -> None:
        self.client = client
        self.out = out
        self.ok = True
        self.label = "setup"

    def check(self, holds: bool, text: str) -> bool:
        self.ok = self.ok and holds
        self.out(f"{'✓' if holds else '✗'} {self.label}: {text}")
        return holds

    def require(self, holds: bool, text: str) -> None:
        if not self.check(holds, text):
            raise _Abort

    def note(self, text: str) -> None:
        self.out(f"· {self.label}: {text}")

    async def server_now(self) -> datetime:
        return (await self.client.info()).now or datetime.now(UTC)

    async def sleep_past(self, moment: datetime | None) -> None:
        """Sleep until the node's own clock is past ``moment``.

        The node's ``now`` was read before its reply reached us, so by the end
        of this sleep the node's clock is at least ``moment`` plus the margin.
        """
        if moment is None:
            return
        remaining = (moment - await self.server_now()).total_seconds()
        if remaining >= 0:
            await asyncio.sleep(remaining + LAPSE_MARGIN_SECONDS)

    async def write(self, send: Callable[[], Awaitable[Record]]) -> Record:
        """``send()``'s record; asked again while the home answers ``NOT_SERVING`` —
        it settles (after a restart, or a pause: a starved host) and did nothing —
        within ``SETTLE_WAIT_SECONDS``, as an agent with a fenced write should."""
        deadline = time.monotonic() + SETTLE_WAIT_SECONDS
        while True:
            try:
                return await send()
            except Unavailable as refused:
                wait = refused.retry_after or SETTLE_POLL_SECONDS
                if refused.reason != "NOT_SERVING" or time.monotonic() + wait > deadline:
                    raise
                self.note(f"the node settles before it decides ({refused.message}); again")
                await asyncio.sleep(wait)

    async def refusal(self, send: Callable[[], Awaitable[Record]]) -> ClaimConflict | None:
        """The claim conflict a write is refused with, or None if it was admitted."""
        try:
            await self.write(send)
        except ClaimConflict as conflict:
            return conflict
        return None

    async def run(self, lease_seconds: float) -> None:
        region = await self.setup()
        fence_before = await self.wait_for_no_live_claim()
        await self.remember_twice(region)
        token_a, expiry_a = await self.claim_as_worker_a(lease_seconds, fence_before)
        await self.write_under_claim(token_a)
        token_b, expiry_b = await self.claim_after_lapse(token_a, expiry_a)
        await self.lose_to_worker_b(token_a)
        await self.status_while_claimed(token_b, expiry_b)
        await self.release(token_a, token_b)
        await self.status_after_release(token_b)

    async def setup(self) -> str:
        info = await self.client.info()
        self.require(
            info.writes_enabled,
            f"node {info.node_id} of region {info.region!r} at {self.client.target}, "
            f"writes enabled: {info.writes_enabled}",
        )
        try:
            existing = await self.client.get(KEY)
        except NotFound:
            return info.region
        self.require(
            existing.home_region == info.region,
            f"{KEY} exists from an earlier run, homed in {existing.home_region!r}",
        )
        return info.region

    async def wait_for_no_live_claim(self) -> int:
        """Wait out a claim an earlier run left live; the fence before this run."""
        try:
            status = await self.client.claim_status(KEY)
        except NotFound:
            return 0
        while status.claim is not None:
            self.note(
                f"a claim by {status.claim.owner} (token {status.claim.fencing_token}) "
                f"from an earlier run is live until {_at(status.claim.lease_expires_at)}; "
                "waiting for it to lapse"
            )
            await self.sleep_past(status.claim.lease_expires_at)
            status = await self.client.claim_status(KEY)
        return status.fence

    async def remember_twice(self, region: str) -> None:
        self.label = "step 1"
        tags = [
            "backlog",
            "priority:P1",
            "phase:implementation",
            f"homeRegion:{region}",
            "baseBranch:feat/epic/wal-batching",
        ]

        async def remember() -> tuple[Record, bool]:
            result = await self.client.remember(
                repo=REPO,
                topic=TOPIC,
                id=ID,
                kind="Note",
                author="backlog-pm",
                title="Batch WAL fsyncs",
                body="Group commits so that one fsync covers many writes.",
                tags=tags,
            )
            return result.record, result.created

        record, created = await remember()
        self.check(record.key == KEY, f"remember {'created' if created else 'merged into'} {KEY}")
        record, created = await remember()
        self.check(not created, f"the same remember again merged in place (created={created})")
        same_key = [r async for r in self.client.iter_records(REPO, topic=TOPIC) if r.key == KEY]
        self.check(len(same_key) == 1, f"list shows {len(same_key)} record with that key")
        missing = sorted(set(tags) - set(record.tags))
        self.check(
            not missing and record.home_region == region,
            f"home region {record.home_region!r}, tags {', '.join(record.tags)}"
            + (f" (missing {', '.join(missing)})" if missing else ""),
        )

    async def claim_as_worker_a(
        self, lease_seconds: float, fence_before: int
    ) -> tuple[int, datetime | None]:
        self.label = "step 2"
        claim = await self.client.claim(KEY, "worker-a", lease_seconds=lease_seconds)
        self.require(
            claim.granted and claim.fencing_token > fence_before,
            f"claim by worker-a granted={claim.granted} {claim.reason}".rstrip()
            + f", token {claim.fencing_token} (fence before: {fence_before})",
        )
        now = await self.server_now()
        expiry = claim.lease_expires_at
        self.check(
            expiry is not None and expiry > now,
            f"lease expires at {_at(expiry)}, "
            f"{(expiry - now).total_seconds() if expiry else 0:.2f} s after the node's now",
        )
        return claim.fencing_token, expiry

    async def write_under_claim(self, token_a: int) -> None:
        self.label = "step 3"
        conflict = await self.refusal(lambda: self.client.update(KEY, fields={"body": "started"}))
        self.check(
            conflict is not None and conflict.reason == "claimed",
            f"unfenced update refused: {_refusal_text(conflict)}",
        )
        record = await self.write(
            lambda: self.client.update(KEY, fields={"body": "started"}, fencing_token=token_a)
        )
        self.check(
            record.body == "started",
            f"the same update with token {token_a} admitted: body {record.body!r}",
        )

    async def claim_after_lapse(
        self, token_a: int, expiry_a: datetime | None
    ) -> tuple[int, datetime | None]:
        self.label = "step 4"
        self.note(f"waiting for worker-a's lease to lapse at {_at(expiry_a)} (node clock)")
        await self.sleep_past(expiry_a)
        claim = await self.client.claim(KEY, "worker-b")
        self.require(
            claim.granted and claim.fencing_token > token_a,
            f"after the lapse, claim by worker-b granted={claim.granted} {claim.reason}".rstrip()
            + f", token {claim.fencing_token} (worker-a had {token_a})",
        )
        return claim.fencing_token, claim.lease_expires_at

    async def lose_to_worker_b(self, token_a: int) -> None:
        self.label = "step 5"
        conflict = await self.refusal(
            lambda: self.client.update(
                KEY, fields={"body": "worker-a was here"}, fencing_token=token_a
            )
        )
        self.check(
            conflict is not None and conflict.reason == "superseded",
            f"worker-a's update with old token {token_a} refused: {_refusal_text(conflict)}",
        )
        renewal = await self.client.renew_claim(KEY, token_a)
        self.check(
            not renewal.renewed and renewal.reason == "superseded",
            f"renew_claim(token {token_a}): renewed={renewal.renewed}, reason {renewal.reason!r}",
        )

    async def status_while_claimed(self, token_b: int, expiry_b: datetime | None) -> None:
        self.label = "step 7"
        status = await self.client.claim_status(KEY)
        live = status.claim
        self.check(
            live is not None
            and (live.owner, live.fencing_token, live.lease_expires_at)
            == ("worker-b", token_b, expiry_b),
            "before release, live claim: "
            + (
                f"owner {live.owner}, token {live.fencing_token}, "
                f"expires {_at(live.lease_expires_at)}"
                if live
                else "none"
            ),
        )
        self.check(
            status.fence == token_b and not status.authoritative,
            f"fence {status.fence}, queue depth {status.queue_depth}, "
            f"authoritative={status.authoritative}",
        )

    async def release(self, token_a: int, token_b: int) -> None:
        self.label = "step 6"
        for attempt in ("", " again (idempotent)"):
            result = await self.client.release_claim(KEY, token_b)
            self.check(
                result.released and result.fence == token_b,
                f"release_claim(token {token_b}){attempt}: released={result.released}"
                + (f" {result.reason}" if result.reason else "")
                + f", fence {result.fence}",
            )
        record = await self.write(lambda: self.client.update(KEY, fields={"body": "done"}))
        self.check(record.body == "done", f"unfenced update admitted again: body {record.body!r}")
        conflict = await self.refusal(
            lambda: self.client.update(
                KEY, fields={"body": "worker-a was here"}, fencing_token=token_a
            )
        )
        self.check(
            conflict is not None and conflict.reason == "superseded",
            f"worker-a's token {token_a} still refused: {_refusal_text(conflict)}",
        )

    async def status_after_release(self, token_b: int) -> None:
        self.label = "step 7"
        status = await self.client.claim_status(KEY)
        self.check(
            status.claim is None,
            "after release, live claim: "
            + (f"owner {status.claim.owner}" if status.claim else "none"),
        )
        self.check(
            status.fence == token_b and not status.authoritative,
            f"fence {status.fence}, queue depth {status.queue_depth}, "
            f"authoritative={status.authoritative}",
        )


async def run_walkthrough(
    target: str,
    *,
    lease_seconds: float = 2.0,
    out: Callable[[str], None] = print,
    credentials: grpc.ChannelCredentials | None = None,
) -> bool:
    """Run SPEC §1 against the node at ``target``; True when every expectation held.

    ``lease_seconds`` is worker-a's lease (step 2); step 4 waits for it to lapse.
    The node must have writes enabled; its own region is used as the record's home.
    """
    async with AsyncClient(target, credentials=credentials) as client:
        walkthrough = _Walkthrough(client, out)
        try:
            await walkthrough.run(lease_seconds)
        except _Abort:
            walkthrough.ok = False
        except FencemarkError as error:
            walkthrough.check(False, f"unexpected error: {error}")
        return walkthrough.ok


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fencemark.client.walkthrough HOST:PORT", file=sys.stderr)
        return 2
    return 0 if asyncio.run(run_walkthrough(args[0])) else 1


if __name__ == "__main__":
    sys.exit(main())
