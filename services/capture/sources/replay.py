"""Replay source: plays a recorded SITS trace v1 at real or accelerated speed.

Each record is emitted when `t / speed` seconds have passed since the replay
started, stamped with the clock's current time, so downstream services see a
live-looking stream recorded from a real GPU. OOM records become OomEvents.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from services.capture.sources.base import Event, Health, Sleep, default_sleep
from sits.runtime.clock import Clock, SystemClock
from sits.runtime.traces import Trace, TraceTarget, read_trace, record_to_oom, record_to_sample


class ReplaySource:
    def __init__(
        self,
        trace: Trace | str | Path,
        *,
        speed: float = 1.0,
        loop: bool = False,
        target: TraceTarget | None = None,
        clock: Clock | None = None,
        sleep: Sleep = default_sleep,
        name: str = "replay",
    ) -> None:
        if speed <= 0:
            raise ValueError("replay speed must be positive")
        self.trace = trace if isinstance(trace, Trace) else read_trace(trace)
        self.name = name
        self._speed = speed
        self._loop = loop
        self._target = target or self.trace.header.target
        self._clock = clock or SystemClock()
        self._sleep = sleep
        self.emitted = 0
        self._health = Health(name, healthy=True, detail=f"trace {self.trace.header.name!r} at {speed}x")

    def health(self) -> Health:
        return self._health

    async def events(self) -> AsyncIterator[Event]:
        while True:
            started = self._clock.monotonic()
            for record in self.trace.records:
                wait = started + float(record["t"]) / self._speed - self._clock.monotonic()
                if wait > 0:
                    await self._sleep(wait)
                now = self._clock.now()
                if record["kind"] == "oom":
                    yield record_to_oom(record, self._target, produced_at=now, event_id="", source="capture/replay")
                else:
                    yield record_to_sample(
                        record, self._target, produced_at=now, sequence=0, event_id="", source="capture/replay"
                    )
                self.emitted += 1
            if not self._loop:
                self._health = Health(self.name, healthy=True, detail=f"finished after {self.emitted} records")
                return
