"""Hybrid logical clock (Kulkarni et al., 2014) and write stamps.

An HLC timestamp is one 64-bit integer: 48 bits of milliseconds since the Unix
epoch, then a 16-bit logical counter. Packing both into an int keeps comparison
and ``max`` trivial. Should the counter overflow within one millisecond it carries
into the millisecond part: the clock runs at most that far ahead, never backwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

LOGICAL_BITS = 16
PHYSICAL_BITS = 48
MAX_HLC = (1 << (PHYSICAL_BITS + LOGICAL_BITS)) - 1
DEFAULT_MAX_CLOCK_OFFSET_MS = 500


def pack(physical_ms: int, logical: int = 0) -> int:
    """The HLC timestamp of a physical time and a logical counter."""
    return (physical_ms << LOGICAL_BITS) + logical


def physical_ms(hlc: int) -> int:
    """The millisecond part of an HLC timestamp."""
    return hlc >> LOGICAL_BITS


def wall_clock_ms() -> int:
    """This machine's wall clock in milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


class Stamp(NamedTuple):
    """Orders writes: ``(epoch, hlc, node_id)`` compared lexicographically.

    ``epoch`` is the fence the writing node knew when it admitted the write, so a
    write admitted under a newer fence wins whatever the clocks say (SPEC §3).
    """

    epoch: int
    hlc: int
    node: str


ZERO_STAMP = Stamp(0, 0, "")


class ClockSkew(Exception):
    """A remote stamp is further ahead of the local wall clock than allowed."""

    def __init__(self, remote_hlc: int, local_ms: int, max_offset_ms: int) -> None:
        self.remote_ms = physical_ms(remote_hlc)
        self.local_ms = local_ms
        self.max_offset_ms = max_offset_ms
        super().__init__(
            f"remote clock is {self.remote_ms - local_ms} ms ahead of this node's"
            f" (at most {max_offset_ms} ms allowed)"
        )


class HybridClock:
    """The node's HLC. ``now`` ticks for a local event; ``observe`` receives a stamp.

    Every local event gets a timestamp strictly greater than both the wall clock
    and every timestamp this clock has issued or observed, so a local write made
    after a merge always wins over what was merged.
    """

    def __init__(
        self,
        wall_ms: Callable[[], int] = wall_clock_ms,
        max_offset_ms: int = DEFAULT_MAX_CLOCK_OFFSET_MS,
        last: int = 0,
    ) -> None:
        self._wall_ms = wall_ms
        self.max_offset_ms = max_offset_ms
        self._last = last

    @property
    def last(self) -> int:
        """The largest timestamp issued or observed so far."""
        return self._last

    def wall_ms(self) -> int:
        """The wall clock this HLC follows (ms since the Unix epoch)."""
        return self._wall_ms()

    def now(self) -> int:
        """A fresh timestamp for a local event."""
        self._last = max(pack(self._wall_ms()), self._last + 1)
        return self._last

    def check(self, remote_hlc: int) -> None:
        """Raise ``ClockSkew`` if ``remote_hlc`` is beyond ``max_offset_ms`` ahead."""
        local = self._wall_ms()
        if physical_ms(remote_hlc) > local + self.max_offset_ms:
            raise ClockSkew(remote_hlc, local, self.max_offset_ms)

    def observe(self, remote_hlc: int) -> None:
        """Advance past a timestamp received from elsewhere (after ``check``)."""
        self.check(remote_hlc)
        self._last = max(self._last, remote_hlc)
