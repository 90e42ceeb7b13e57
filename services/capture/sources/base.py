"""What every capture source has in common: health, backoff, and the Source protocol.

A source yields `sits.v1.MetricSample`s (and, for the replay source, `OomEvent`s)
without meta.event_id or sequence: the capture pipeline stamps those. Each source
reports its own health; a source that cannot reach what it reads turns
unhealthy, retries with backoff, and never stops the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from sits.v1 import events_pb2

Sleep = Callable[[float], Awaitable[None]]
Event = events_pb2.MetricSample | events_pb2.OomEvent


@dataclass(frozen=True)
class Health:
    source: str
    healthy: bool
    detail: str = ""
    # True when the source can never work here (for example NVML without a GPU):
    # it has said so once and stays out of the way.
    unavailable: bool = False


class Source(Protocol):
    name: str

    def health(self) -> Health: ...

    def events(self) -> AsyncIterator[Event]:
        """Events until the source is closed or cancelled."""
        ...


class Backoff:
    """Exponential backoff with a cap; `reset()` after a success."""

    def __init__(self, initial_s: float = 0.1, maximum_s: float = 10.0, factor: float = 2.0) -> None:
        if initial_s <= 0 or maximum_s < initial_s or factor < 1:
            raise ValueError("backoff needs 0 < initial <= maximum and factor >= 1")
        self._initial = initial_s
        self._maximum = maximum_s
        self._factor = factor
        self._next = initial_s
        self.failures = 0

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._maximum, self._next * self._factor)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self._next = self._initial
        self.failures = 0


async def default_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)
