"""``PickLines`` on its own (fencemark.node.core.lines): what a look does for the
waiters of a line, with pickers whose tries the test controls. The claims and work
queue tests drive the lines through real records; these pin what those cannot see
(a stopped line, a look cut short, a line left behind)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from fencemark.node.core.lines import Picker, PickLines

KEY = "repo/topic/"
NEVER = math.inf


def lines(pause: float = NEVER) -> PickLines[str]:
    async def next_look_s(_: str) -> float:
        return pause

    return PickLines(next_look_s)


def picker(
    kind: str,
    finds: Callable[[], Awaitable[str | None]] | str | None = None,
    *,
    once: bool = False,
    given_back: list[str] | None = None,
) -> Picker[str]:
    async def try_pick() -> str | None:
        return await finds() if callable(finds) else finds

    async def give_back(got: str) -> None:
        if given_back is not None:
            given_back.append(got)

    return Picker(kind=kind, once=once, try_pick=try_pick, give_back=give_back)


def standing(line: PickLines[str], *pickers: Picker[str]) -> list[asyncio.Task[str | None]]:
    """Each picker waits in ``KEY``'s line (a minute), in this order."""
    return [asyncio.create_task(line.wait(KEY, p, 60.0)) for p in pickers]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_each_look_is_counted_once() -> None:
    line = lines()
    waiting = standing(line, picker("a"))
    await settle()
    assert line.looks == 1  # the look its arrival made
    line.wake(KEY)
    await settle()
    assert line.looks == 2
    waiting[0].cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_one_look_caller_answered_nothing_does_not_end_the_pass_for_those_behind() -> None:
    """A caller that looks once, of a kind that found nothing, is answered ``None``
    and the look goes on to the waiter behind it, of another kind, which gets its
    item in the same look — no second look is coming."""
    line = lines()
    ahead, once, behind = picker("x"), picker("x", once=True), picker("y", "item")
    waiting = standing(line, ahead, once, behind)
    assert await asyncio.wait_for(waiting[1], 5) is None
    assert await asyncio.wait_for(waiting[2], 5) == "item"
    assert line.looks == 1
    waiting[0].cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_what_a_waiter_that_left_meanwhile_got_is_given_back_and_the_look_starts_over() -> (
    None
):
    """The head leaves while its try is under way; what the try got is given back, and
    the same look starts over from the front, so the waiter behind gets its turn."""
    line = lines()
    trying, release = asyncio.Event(), asyncio.Event()

    async def slow() -> str | None:
        trying.set()
        await release.wait()
        return "first"

    given_back: list[str] = []
    head, behind = picker("x", slow, given_back=given_back), picker("y", "second")
    waiting = standing(line, head, behind)
    await asyncio.wait_for(trying.wait(), 5)
    waiting[0].cancel()  # it leaves while its try is under way
    await settle()
    release.set()
    assert await asyncio.wait_for(waiting[1], 5) == "second"
    assert given_back == ["first"]
    assert line.looks == 2  # the pass started over, within the one look
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_line_its_last_waiter_left_is_gone_and_its_timer_with_it() -> None:
    """The last waiter leaves: the line is dropped, and the look its timer had set for
    a lease's end never comes."""
    line = lines(pause=0.2)
    waiting = standing(line, picker("x"))
    await settle()
    assert line.depth(KEY) == 1
    waiting[0].cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert line.depth(KEY) == 0 and KEY not in line._lines
    looks = line.looks
    await asyncio.sleep(0.4)
    assert line.looks == looks


async def test_a_stopped_line_looks_no_more_and_stop_ends_a_look_under_way() -> None:
    """``stop`` cancels the look under way (its try sees the cancellation) and every
    timer; after it, a wake makes no look. A line without a timer stops too."""
    line = lines(pause=0.2)
    trying, cancelled = asyncio.Event(), asyncio.Event()

    async def stuck() -> str | None:
        trying.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return None

    idle = lines()  # a line whose look ended with no timer set
    idle_waiting = standing(idle, picker("x"))
    waiting = standing(line, picker("x", stuck))
    await asyncio.wait_for(trying.wait(), 5)
    await settle()
    await asyncio.wait_for(idle.stop(), 5)
    await asyncio.wait_for(line.stop(), 5)
    assert cancelled.is_set()
    looks = line.looks
    line.wake(KEY)
    await asyncio.sleep(0.4)  # past the timer's pause too
    assert line.looks == looks
    for task in (*waiting, *idle_waiting):
        task.cancel()
    await asyncio.gather(*waiting, *idle_waiting, return_exceptions=True)


async def test_a_waiter_whose_wait_ran_out_is_not_tried_by_the_look_under_way() -> None:
    """A waiter's wait runs out while the look that will reach it is held up at the
    head: that look passes over it — what it would find would go to nobody."""
    line = lines()
    tries = {"head": 0, "behind": 0}
    release = asyncio.Event()

    async def head_try() -> str | None:
        tries["head"] += 1
        if tries["head"] > 1:  # the second look waits here
            await release.wait()
        return None

    async def behind_try() -> str | None:
        tries["behind"] += 1
        return "item"

    head = standing(line, picker("x", head_try))
    await settle()
    behind = asyncio.create_task(line.wait(KEY, picker("y", behind_try), 0.2))
    assert await asyncio.wait_for(behind, 5) is None  # ran out behind the held look
    release.set()
    await settle()
    assert tries == {"head": 2, "behind": 0}
    head[0].cancel()
    await asyncio.gather(*head, return_exceptions=True)


async def test_what_a_look_handed_to_a_waiter_leaving_that_moment_is_given_back() -> None:
    """The waiter leaves just as its look hands it something (the hand-over and the
    cancellation in one turn of the loop): it never hears of it, and it is given back."""
    line = lines()
    given_back: list[str] = []
    me: list[asyncio.Task[str | None]] = []

    async def found_as_it_leaves() -> str | None:
        me[0].cancel()  # it leaves now; the look hands it the item all the same
        return "item"

    me.extend(standing(line, picker("x", found_as_it_leaves, given_back=given_back)))
    results = await asyncio.gather(*me, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert given_back == ["item"]


async def test_a_one_look_caller_gets_one_try_even_when_a_wake_comes_during_the_look() -> None:
    """A wait-0 caller (``once``) whose try found nothing is answered ``None`` at once,
    not tried again when a wake during the same look starts the pass over — with the
    second try it got an item it had not waited for, and only after the slow try of
    the waiter behind it (a survivor of lines' mutation run: ``picker.once and not
    picker.gone()`` → ``picker.once and picker.gone()``)."""
    line = lines()
    tries = 0
    item: list[str] = []

    async def looks_once() -> str | None:
        nonlocal tries
        tries += 1
        return item.pop() if item else None

    trying, release = asyncio.Event(), asyncio.Event()

    async def slow() -> str | None:
        trying.set()
        await release.wait()
        return None

    waiting = standing(line, picker("x", looks_once, once=True), picker("y", slow))
    await asyncio.wait_for(trying.wait(), 5)  # the waiter behind is trying
    assert waiting[0].done() and waiting[0].result() is None  # answered before it
    item.append("item")
    line.wake(KEY)  # something came meanwhile: the pass starts over
    release.set()
    await settle()
    assert tries == 1
    assert item == ["item"]  # left for whoever asks next
    waiting[1].cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
