"""FIFO lines of waiters, by key: the waiting that claims and the work queue share.

Callers waiting for the same thing (a record's claim, an item of a topic) stand in
one line; only the head tries, so the first to come is the first served, and a
newcomer does not overtake. The head tries when it reaches the front, whenever it
is woken (``wake``: the thing may be free now) and after the pause its last try
asked for (a lease or deferral ending); whoever leaves the line wakes the next.
Lines live in memory only: a hint, never the authority — every try re-reads the
durable state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

R = TypeVar("R")


@dataclass
class Waiter:
    owner: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Lines:
    def __init__(self) -> None:
        self._lines: dict[str, deque[Waiter]] = {}

    def depth(self, key: str) -> int:
        """Callers in ``key``'s line."""
        return len(self._lines.get(key, ()))

    def wake(self, key: str) -> None:
        """``key``'s thing may be free: its head tries again now."""
        line = self._lines.get(key)
        if line:
            line[0].wake.set()

    async def wait(
        self,
        key: str,
        owner: str,
        wait_s: float,
        at_head: Callable[[], Awaitable[tuple[R | None, float]]],
    ) -> R | None:
        """Stand in ``key``'s line for up to ``wait_s`` seconds: each time this caller
        is at the head, ``at_head()`` answers what it got (None: nothing yet) and how
        many seconds to sleep before trying again unless woken. None at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        line = self._lines.setdefault(key, deque())
        me = Waiter(owner)
        line.append(me)
        try:
            while True:
                me.wake.clear()  # before any await, so no wake-up is lost
                pause = float("inf")
                if line[0] is me:
                    got, pause = await at_head()
                    if got is not None:
                        return got
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                # Not wait_for: on Python 3.11 it swallows a cancellation that arrives
                # with the wake-up, and the thing would go to a caller that left.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(pause, remaining)):
                        await me.wake.wait()
        finally:
            line.remove(me)
            if line:
                line[0].wake.set()
            else:
                del self._lines[key]
