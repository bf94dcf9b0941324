"""The live progress line on stderr: rewritten in place on a terminal, else a line now and then."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.scenario = ""
        self._last_status = 0.0
        self._width = 0

    def begin(self, scenario: str) -> None:
        self.scenario = scenario
        self.line(f"== {scenario}")

    def line(self, text: str) -> None:
        """A line that stays (a step done, a result)."""
        self._clear()
        print(f"[{self._elapsed()}] {text}", file=self.stream, flush=True)

    def status(self, text: str) -> None:
        """The live line: replaced by the next status (throttled off a terminal)."""
        full = f"[{self._elapsed()}] {self.scenario}: {text}"
        if self.tty:
            self._clear()
            self.stream.write(full)
            self.stream.flush()
            self._width = len(full)
        elif time.monotonic() - self._last_status >= 5.0:
            print(full, file=self.stream, flush=True)
            self._last_status = time.monotonic()

    def _clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0

    def _elapsed(self) -> str:
        seconds = int(time.monotonic() - self.started)
        return f"{seconds // 60:02d}:{seconds % 60:02d}"
