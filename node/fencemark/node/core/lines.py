"""FIFO lines of waiters, by key: how claims and the work queue wait.

``Lines``: callers waiting for one thing (a record's claim) stand in one line; only
the head tries, so the first to come is the first served, and a newcomer does not
overtake. The head tries when it reaches the front, whenever it is woken (``wake``:
the thing may be free now) and after the pause its last try asked for (a lease
ending); whoever leaves the line wakes the next.

``PickLines``: callers waiting for any one of many things (an item of a topic),
each with its own idea of what suits it (its tags). A look walks the line from the
front and lets each waiter try in turn, so an item goes to the first waiter it suits
(SPEC §8) and a waiter whom nothing suits blocks nobody behind it. Waiters of one
kind find the same things, so a look tries a kind once it found nothing for it: a
long line of alike waiters costs one try per look, not one per waiter.

Lines live in memory only: a hint, never the authority — every try re-reads the
durable state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")

log = logging.getLogger(__name__)


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


@dataclass(eq=False)
class Picker(Generic[R]):
    """A caller in a ``PickLines`` line: what it tries, and what it got."""

    kind: Hashable  # callers of one kind find the same things
    once: bool  # answer after the first look (a caller that does not wait)
    try_pick: Callable[[], Awaitable[R | None]]
    give_back: Callable[[R], Awaitable[None]]  # undo what was got for a caller that left
    got: asyncio.Future[R | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    left: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # no try under way for it

    def __post_init__(self) -> None:
        self.idle.set()

    def gone(self) -> bool:
        """Whether the caller left (read after an await: it may have, meanwhile)."""
        return self.left


@dataclass(eq=False)
class _PickLine(Generic[R]):
    waiters: deque[Picker[R]] = field(default_factory=deque)
    look: asyncio.Task[None] | None = None
    again: bool = False  # woken while a look ran: look once more
    timer: asyncio.TimerHandle | None = None


class PickLines(Generic[R]):
    def __init__(self, next_look_s: Callable[[str], Awaitable[float]]) -> None:
        """``next_look_s(key)``: seconds until something of ``key`` may become free
        without anyone saying so (a deferral or lease ending); inf for never."""
        self._next_look_s = next_look_s
        self._lines: dict[str, _PickLine[R]] = {}
        self._stopped = False
        self.looks = 0  # looks made, for the tests and metrics

    def depth(self, key: str) -> int:
        """Callers in ``key``'s line."""
        line = self._lines.get(key)
        return len(line.waiters) if line else 0

    async def stop(self) -> None:
        """No more looks: timers cancelled, the looks under way ended (the node stops;
        its callers have left)."""
        self._stopped = True
        looks = []
        for line in self._lines.values():
            if line.timer is not None:
                line.timer.cancel()
            if line.look is not None:
                line.look.cancel()
                looks.append(line.look)
        await asyncio.gather(*looks, return_exceptions=True)

    def wake(self, key: str) -> None:
        """Something of ``key`` may be free: the line looks again (one look at a time)."""
        line = self._lines.get(key)
        if line is None or self._stopped:
            return
        if line.look is not None:
            line.again = True
        else:
            line.look = asyncio.get_running_loop().create_task(self._look(key, line))

    async def wait(self, key: str, picker: Picker[R], wait_s: float) -> R | None:
        """Stand in ``key``'s line until a look hands ``picker`` something, for up to
        ``wait_s`` seconds (``picker.once``: for one look); None when nothing came."""
        line = self._lines.setdefault(key, _PickLine())
        line.waiters.append(picker)
        self.wake(key)
        try:
            async with asyncio.timeout(None if picker.once else wait_s):
                # Shielded: a caller that leaves does not cancel what a look hands it.
                return await asyncio.shield(picker.got)
        except TimeoutError:
            await picker.idle.wait()  # a try under way for it may still hand it something
            return picker.got.result() if picker.got.done() else None
        except asyncio.CancelledError:
            # The caller leaves, but only once what was got for it is given back: a
            # try under way gives back itself when it ends; one that ended gave here.
            picker.left = True
            while not picker.idle.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await picker.idle.wait()
            got = _handed(picker.got)
            if got is not None:
                await _give_back(picker, got)
            raise
        finally:
            picker.left = True
            line.waiters.remove(picker)
            if not line.waiters and self._lines.get(key) is line:
                del self._lines[key]
                if line.timer is not None:
                    line.timer.cancel()

    async def _look(self, key: str, line: _PickLine[R]) -> None:
        try:
            while await self._pass(line):
                pass
            if line.waiters:
                pause = await self._next_look_s(key)
                if line.timer is not None:
                    line.timer.cancel()
                if pause != float("inf"):
                    line.timer = asyncio.get_running_loop().call_later(pause, self.wake, key)
        except Exception:
            log.exception("looking for the waiters of %s failed; they look again when woken", key)
        finally:
            line.look = None
            if line.again and line.waiters:
                self.wake(key)
            else:  # a look that failed: a caller that asked for one look is answered
                for picker in line.waiters:
                    if picker.once and not picker.got.done():
                        picker.got.set_result(None)

    async def _pass(self, line: _PickLine[R]) -> bool:
        """Let each waiter try, from the front; True to start again from the front,
        because something changed meanwhile (a waiter ahead may have it first)."""
        line.again = False
        self.looks += 1
        found_nothing: set[Hashable] = set()
        for picker in list(line.waiters):
            if picker.left or picker.got.done():
                continue
            if picker.kind in found_nothing:
                if picker.once:
                    picker.got.set_result(None)
                continue
            picker.idle.clear()
            try:
                got = await picker.try_pick()
                if got is not None and picker.gone():
                    await _give_back(picker, got)  # it left meanwhile: the next may have it
                    return True
            except Exception as refused:  # the caller hears it (NOT_SERVING, ...)
                if not picker.gone():
                    picker.got.set_exception(refused)
                continue
            finally:
                picker.idle.set()
            if got is None:
                found_nothing.add(picker.kind)
                if picker.once and not picker.gone():
                    picker.got.set_result(None)
            elif not picker.gone():
                picker.got.set_result(got)
            if line.again:
                return True
        return False


def _handed(got: asyncio.Future[R | None]) -> R | None:
    """What a look handed over, if it did (None for nothing, a refusal or not yet;
    ``got`` is never cancelled: the caller awaits it shielded)."""
    if not got.done() or got.exception() is not None:
        return None
    return got.result()


async def _give_back(picker: Picker[R], got: R) -> None:
    try:
        await picker.give_back(got)
    except Exception:  # what was got still ends on its own (a lease lapses)
        log.exception("giving back what was picked for a caller that left failed")
