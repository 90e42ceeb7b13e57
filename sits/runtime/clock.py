"""Time as a dependency.

Anything that reasons about time takes a `Clock`, so tests move time by hand
instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (wall clock, comparable across processes)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for durations)."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to; for tests and replays."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._mono = 0.0

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._now += seconds
        self._mono += seconds

    def set(self, now: float) -> None:
        self.advance(max(0.0, now - self._now))
