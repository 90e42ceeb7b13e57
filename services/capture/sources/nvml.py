"""NVML source: GPU memory per GPU, per MIG instance and per process, at a fixed rate.

On a machine without a GPU the source reports "unavailable" once and yields
nothing. Sampling runs on the event loop: one NVML read of one GPU costs a few
microseconds (FACTS.md), far less than a thread hop would.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator, Callable

from services.capture.sources.base import Event, Health, Sleep, default_sleep
from services.capture.sources.nvml_reader import GpuReading, NvmlReader, NvmlUnavailable
from sits.v1 import events_pb2

log = logging.getLogger(__name__)

MAX_HZ = 100.0


def reading_to_sample(
    reading: GpuReading, *, host: str, engine_pids: frozenset[int] = frozenset(), engine: str = ""
) -> events_pb2.MetricSample:
    sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_NVML)
    target = sample.meta.target
    target.host = host
    target.gpu_uuid = reading.gpu_uuid
    target.mig_instance = reading.mig_instance
    target.engine = engine
    sample.meta.source = "capture/nvml"
    gpu = sample.gpu
    gpu.used_bytes = reading.used_bytes
    gpu.total_bytes = reading.total_bytes
    gpu.reserved_bytes = reading.reserved_bytes
    gpu.free_bytes = reading.free_bytes
    if reading.utilization_pct is not None:
        gpu.utilization_pct = reading.utilization_pct
    for proc in reading.processes:
        sample.processes.add(
            pid=proc.pid, used_bytes=proc.used_bytes, name=proc.name, is_target_engine=proc.pid in engine_pids
        )
    return sample


class NvmlSource:
    name = "nvml"

    def __init__(
        self,
        *,
        hz: float = 10.0,
        reader: NvmlReader | None = None,
        host: str | None = None,
        engine: str = "",
        engine_pids: frozenset[int] = frozenset(),
        sleep: Sleep = default_sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < hz <= MAX_HZ:
            raise ValueError(f"NVML rate must be in (0, {MAX_HZ}] Hz, got {hz}")
        self.hz = hz
        self._reader = reader if reader is not None else NvmlReader()
        self._host = host or socket.gethostname()
        self._engine = engine
        self._engine_pids = engine_pids
        self._sleep = sleep
        self._monotonic = monotonic
        self._health = Health(self.name, healthy=False, detail="not started")
        self.samples_taken = 0

    def health(self) -> Health:
        return self._health

    async def events(self) -> AsyncIterator[Event]:
        try:
            self._reader.open()
        except NvmlUnavailable as exc:
            # Said once; a GPU does not appear while the service runs.
            self._health = Health(self.name, healthy=False, detail=str(exc), unavailable=True)
            log.info("NVML source unavailable: %s", exc)
            return
        self._health = Health(self.name, healthy=True, detail=f"{self._reader.gpu_count} GPU(s) at {self.hz} Hz")
        period = 1.0 / self.hz
        next_tick = self._monotonic()
        try:
            while True:
                try:
                    readings = self._reader.read()
                except Exception as exc:
                    self._health = Health(self.name, healthy=False, detail=f"read failed: {exc}")
                    readings = []
                else:
                    if not self._health.healthy:
                        self._health = Health(self.name, healthy=True, detail="recovered")
                for reading in readings:
                    self.samples_taken += 1
                    yield reading_to_sample(
                        reading, host=self._host, engine_pids=self._engine_pids, engine=self._engine
                    )
                next_tick += period
                now = self._monotonic()
                if next_tick < now:  # fell behind: skip ticks instead of bursting
                    next_tick = now
                await self._sleep(next_tick - now)
        finally:
            self._reader.close()
