"""Holding a claim without a hand-written renew loop (SPEC §9): ``client.hold(...)``.

A ``Hold`` renews its claim in the background every ``lease_seconds / 3`` and says
the moment the claim is lost: a renewal answered ``superseded``, ``expired``,
``released`` or ``missing`` (or refused, e.g. ``not_holder``), or the lease, as last
renewed, running out before a renewal got through: ``unreachable`` when renewals
were tried and the home did not answer, ``expired`` when none was even tried (the
holder's own process stalled: paused, swapped out, its event loop blocked). The loss
is an event to await (``lost``), a flag (``held``), a reason (``reason``) and, when
asked for (``cancel_on_loss``), the cancellation of the task that holds it, which
then leaves its ``async with`` with ``ClaimLost``.

The renewals run inside the holder's process and end with the ``async with``: a
holder whose process dies stops renewing, and its claim lapses at the home as any
other. Leaving the block stops renewing; it does not release (end the claim with
its outcome, ``release_claim``, inside the block).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Protocol

import grpc

from fencemark.client.errors import FencemarkError, Unavailable
from fencemark.client.types import RenewResult


class Renewing(Protocol):
    """What a keepalive needs of a client (``AsyncClient`` is one)."""

    async def renew_claim(
        self, key: str, fencing_token: int, *, lease_seconds: float = 0.0
    ) -> RenewResult: ...


UNREACHABLE = "unreachable"  # the home did not answer before the lease ran out
EXPIRED = "expired"  # the lease ran out before the holder even tried to renew it
RENEWS_PER_LEASE = 3
RETRY_S = 0.2  # between renewals that could not reach the home, until the lease ends


class ClaimLost(FencemarkError):
    """The held claim is lost (``reason``): raised where the holder's task was
    cancelled for it (``cancel_on_loss``)."""

    def __init__(self, key: str, token: int, reason: str) -> None:
        super().__init__(grpc.StatusCode.ABORTED, f"lost the claim {token} of {key}: {reason}")
        self.key = key
        self.token = token
        self.reason = reason


class Hold:
    """One claim kept alive. ``held`` until it is lost; then ``reason`` says why."""

    def __init__(self, key: str, token: int, lease_seconds: float) -> None:
        self.key = key
        self.token = token
        self.lease_seconds = lease_seconds
        self.lost = asyncio.Event()
        self.reason = ""
        self.renewals = 0
        self.unanswered = 0  # renewals tried since the last that got through
        # Monotonic time by which the lease, as last renewed, runs out (from when the
        # renewal was sent: the home's clock started it no earlier).
        self.lease_ends = time.monotonic() + lease_seconds

    @property
    def held(self) -> bool:
        return not self.lost.is_set()

    async def wait_lost(self) -> str:
        """Return the reason once the claim is lost."""
        await self.lost.wait()
        return self.reason

    def check(self) -> None:
        """Raise ``ClaimLost`` if the claim is lost (for code between its steps)."""
        if not self.held:
            raise ClaimLost(self.key, self.token, self.reason)

    def _lose(self, reason: str) -> None:
        if self.held:
            self.reason = reason
            self.lost.set()


async def _renew(client: Renewing, hold: Hold, every: float) -> None:
    while hold.held:
        await asyncio.sleep(every if time.monotonic() + every < hold.lease_ends else RETRY_S)
        sent = time.monotonic()
        if sent >= hold.lease_ends:
            hold._lose(UNREACHABLE if hold.unanswered else EXPIRED)
            return
        try:
            # No answer within what is left of the lease is as good as none.
            async with asyncio.timeout(max(0.05, min(every, hold.lease_ends - sent))):
                renewed = await client.renew_claim(
                    hold.key, hold.token, lease_seconds=hold.lease_seconds
                )
        except (Unavailable, TimeoutError):
            hold.unanswered += 1
            continue  # try again until the lease, as last renewed, runs out
        except FencemarkError as refused:  # e.g. not_holder: it was never ours to renew
            hold._lose(str(getattr(refused, "reason", "")) or refused.code.name.lower())
            return
        if not renewed.renewed:
            hold._lose(renewed.reason)
            return
        hold.renewals += 1
        hold.unanswered = 0
        hold.lease_ends = sent + hold.lease_seconds


@contextlib.asynccontextmanager
async def holding(
    client: Renewing,
    key: str,
    token: int,
    lease_seconds: float,
    *,
    expires_at: datetime | None = None,
    cancel_on_loss: bool = False,
) -> AsyncIterator[Hold]:
    hold = Hold(key, token, lease_seconds)
    if expires_at is not None:
        # The claim may be older than this hold (a lease granted a while ago): its
        # lease ends no later than the home said, as far as this clock can tell.
        left = (expires_at - datetime.now(UTC)).total_seconds()
        hold.lease_ends = min(hold.lease_ends, time.monotonic() + max(0.0, left))
    holder = asyncio.current_task()
    renewer = asyncio.create_task(
        _renew(client, hold, lease_seconds / RENEWS_PER_LEASE), name=f"keepalive {key}"
    )
    cancelled_by_us = False

    def on_loss(_: asyncio.Task[None]) -> None:
        nonlocal cancelled_by_us
        if cancel_on_loss and not hold.held and holder is not None and not holder.done():
            cancelled_by_us = True
            holder.cancel()

    renewer.add_done_callback(on_loss)
    try:
        yield hold
    except asyncio.CancelledError:
        if cancelled_by_us and holder is not None and holder.uncancel() == 0:
            raise ClaimLost(key, token, hold.reason) from None
        raise
    finally:
        renewer.remove_done_callback(on_loss)
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
