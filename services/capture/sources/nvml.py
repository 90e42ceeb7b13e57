"""NVML source: GPU memory per GPU, per MIG instance and per process, at a fixed rate.

On a machine without a GPU the source reports "unavailable" once and yields
nothing. Up to `DELIVERIES_PER_S` (10 Hz) the event loop samples itself.
Faster, sampling runs in its own thread and hands samples to the loop in
batches, 10 times a second: on the H200 machine an event-loop wake-up costs
60-85 us of CPU, about what the NVML calls of one sample cost, so a wake-up
per sample at 100 Hz nearly doubled capture's CPU (3.08% of a core against
2.39% batched, bench/results/capture_overhead.json); a sample then waits at
most 0.1 s for its batch. The thread sleeps with `time.sleep` (one syscall,
where a timed Event wait takes a lock and a condition) and so notices a stop
within one sampling period. Utilization and the process list are read at most
`DETAILS_PER_S` times a second; memory at the full rate.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

from services.capture.sources.base import Event, Health
from services.capture.sources.nvml_reader import GpuReading, NvmlReader, NvmlUnavailable
from sits.v1 import events_pb2

log = logging.getLogger(__name__)

MAX_HZ = 100.0
DELIVERIES_PER_S = 10.0
DETAILS_PER_S = 10.0
# How long closing the source waits for the sampling thread to finish its read.
_JOIN_TIMEOUT_S = 2.0


def _next_tick(scheduled: float, period: float, now: float) -> float:
    """The next sampling instant; when sampling fell behind, the missed ticks are skipped, not burst."""
    return max(scheduled + period, now)


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
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < hz <= MAX_HZ:
            raise ValueError(f"NVML rate must be in (0, {MAX_HZ}] Hz, got {hz}")
        self.hz = hz
        self._reader = reader if reader is not None else NvmlReader()
        self._host = host or socket.gethostname()
        self._engine = engine
        self._engine_pids = engine_pids
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
        try:
            stream = self._sample_on_loop() if self.hz <= DELIVERIES_PER_S else self._sample_in_thread()
            async for sample in stream:
                yield sample
        finally:
            self._reader.close()

    async def _sample_on_loop(self) -> AsyncIterator[events_pb2.MetricSample]:
        # Every sample is its own delivery here: a thread would only add a hop.
        period = 1.0 / self.hz
        next_tick = self._monotonic()
        while True:
            for sample in self._take(details=True):
                yield sample
            now = self._monotonic()
            next_tick = _next_tick(next_tick, period, now)
            await asyncio.sleep(next_tick - now)

    async def _sample_in_thread(self) -> AsyncIterator[events_pb2.MetricSample]:
        batches: asyncio.Queue[list[events_pb2.MetricSample]] = asyncio.Queue()
        stop = threading.Event()
        sampler = threading.Thread(
            target=self._sample_until,
            args=(stop, asyncio.get_running_loop(), batches),
            name="sits-nvml-sampler",
            daemon=True,
        )
        sampler.start()
        try:
            while True:
                for sample in await batches.get():
                    yield sample
        finally:
            stop.set()
            await asyncio.to_thread(sampler.join, _JOIN_TIMEOUT_S)

    def _take(self, *, details: bool) -> list[events_pb2.MetricSample]:
        try:
            readings = self._reader.read(details=details)
        except Exception as exc:
            self._health = Health(self.name, healthy=False, detail=f"read failed: {exc}")
            return []
        if not self._health.healthy:
            self._health = Health(self.name, healthy=True, detail="recovered")
        self.samples_taken += len(readings)
        return [
            reading_to_sample(reading, host=self._host, engine_pids=self._engine_pids, engine=self._engine)
            for reading in readings
        ]

    def _sample_until(
        self,
        stop: threading.Event,
        loop: asyncio.AbstractEventLoop,
        batches: asyncio.Queue[list[events_pb2.MetricSample]],
    ) -> None:
        period = 1.0 / self.hz
        details_every = max(1, round(self.hz / DETAILS_PER_S))
        next_tick = last_delivery = self._monotonic()
        batch: list[events_pb2.MetricSample] = []
        tick = 0
        while not stop.is_set():
            batch += self._take(details=tick % details_every == 0)
            now = self._monotonic()
            if batch and now - last_delivery >= 1.0 / DELIVERIES_PER_S - 1e-3:
                try:
                    loop.call_soon_threadsafe(batches.put_nowait, batch)
                except RuntimeError:  # the loop is gone: nobody is listening any more
                    return
                batch, last_delivery = [], now
            tick += 1
            next_tick = _next_tick(next_tick, period, now)
            time.sleep(next_tick - now)
