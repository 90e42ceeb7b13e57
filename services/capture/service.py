"""The capture pipeline: sources in, stamped events out (Kafka, live streams, latest state).

Every event passes the same steps: stamp (id, time, sequence), remember as the
target's latest state, fan out to StreamSamples clients, hand to the publisher.
A source that fails is marked unhealthy and restarted with backoff; the other
sources and the service carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, Protocol

from services.capture import metrics
from services.capture.domain import LatestState, Stamper, Verdict, validate_oom
from services.capture.sources.base import Backoff, Event, Health, Sleep, Source, default_sleep
from sits.runtime.clock import Clock
from sits.runtime.fanout import Fanout
from sits.v1 import capture_pb2, common_pb2, events_pb2
from sits_engine.oom_hook.hook import event_to_proto
from sits_engine.oom_hook.spool import spooled_events

log = logging.getLogger(__name__)


class Sink(Protocol):
    def submit(self, event: events_pb2.MetricSample | events_pb2.OomEvent) -> None: ...


class RejectedOom(ValueError):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(str(verdict))
        self.verdict = verdict


class CaptureService:
    def __init__(
        self,
        sink: Sink,
        clock: Clock,
        *,
        stream_buffer: int = 256,
        max_targets: int = 4096,
        sleep: Sleep = default_sleep,
    ) -> None:
        self._sink = sink
        self._clock = clock
        self._sleep = sleep
        self.stamper = Stamper(clock)
        self.latest = LatestState(max_targets)
        self.fanout: Fanout[events_pb2.MetricSample] = Fanout(buffer=stream_buffer)
        self.sources: dict[str, Source] = {}
        self._crashed: dict[str, Health] = {}
        self.known_gpus: set[str] = set()
        self._sample_counters: dict[str, Any] = {}

    # ------------------------------------------------------------------ events

    def ingest_sample(self, sample: events_pb2.MetricSample, source: str) -> None:
        self.stamper.stamp_sample(sample, source)
        if sample.source_kind == events_pb2.SAMPLE_SOURCE_NVML and sample.meta.target.gpu_uuid:
            self.known_gpus.add(sample.meta.target.gpu_uuid)
        self.latest.update(sample)
        self.fanout.publish(sample)
        self._sink.submit(sample)
        counter = self._sample_counters.get(source)
        if counter is None:  # label lookups cost more than the increment on this hot path
            counter = self._sample_counters[source] = metrics.SAMPLES.labels(source=source)
        counter.inc()

    def report_oom(self, event: events_pb2.OomEvent) -> str:
        """Validate, stamp and publish an OOM event; raises RejectedOom with every reason."""
        verdict = validate_oom(event, self.known_gpus)
        if not verdict.ok:
            metrics.OOM_REPORTS.labels(outcome="rejected").inc()
            raise RejectedOom(verdict)
        self.stamper.stamp_oom(event)
        self._sink.submit(event)
        metrics.OOM_REPORTS.labels(outcome="accepted").inc()
        log.warning(
            "OOM on %s/%s: %d bytes requested, %d free",
            event.meta.target.host,
            event.meta.target.gpu_uuid,
            event.requested_bytes,
            event.device_free_bytes,
        )
        return event.meta.event_id

    def ingest(self, event: Event, source: str) -> None:
        if isinstance(event, events_pb2.OomEvent):
            try:
                self.report_oom(event)
            except RejectedOom as exc:
                log.warning("source %s produced an invalid OOM event: %s", source, exc)
        else:
            self.ingest_sample(event, source)

    # ------------------------------------------------------------------ sources

    def add_source(self, source: Source) -> None:
        self.sources[source.name] = source

    async def run_source(self, source: Source, stop: asyncio.Event) -> None:
        """Run one source until `stop`; a crash turns it unhealthy and it restarts with backoff."""
        backoff = Backoff(0.5, 30.0)
        while not stop.is_set():
            try:
                async for event in source.events():
                    self._crashed.pop(source.name, None)
                    self.ingest(event, source.name)
                    self._export_health(source)
                    if stop.is_set():
                        break
                else:
                    # The source ended by itself (unavailable here, or a finite replay).
                    self._export_health(source)
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._crashed[source.name] = Health(source.name, healthy=False, detail=f"crashed: {exc}")
                metrics.SOURCE_ERRORS.labels(source=source.name).inc()
                self._export_health(source)
                log.exception("source %s crashed; restarting", source.name)
                await self._sleep(backoff.next_delay())

    async def export_health(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Keep `sits_capture_source_healthy` current, also for sources that yield nothing while failing."""
        while not stop.is_set():
            for source in self.sources.values():
                self._export_health(source)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)

    def _export_health(self, source: Source) -> None:
        metrics.SOURCE_HEALTHY.labels(source=source.name).set(1 if self.health_of(source).healthy else 0)

    def health_of(self, source: Source) -> Health:
        return self._crashed.get(source.name) or source.health()

    def health(self) -> list[Health]:
        return [self.health_of(s) for s in self.sources.values()]

    # ------------------------------------------------------------------ snapshot

    def snapshot(self, target: common_pb2.Target) -> capture_pb2.Snapshot | None:
        latest = self.latest.snapshot(target)
        if latest is None:
            return None
        snapshot = capture_pb2.Snapshot(latest=latest)
        for health in self.health():
            snapshot.sources.add(source=health.source, healthy=health.healthy, detail=health.detail)
        return snapshot

    # ------------------------------------------------------------------ the hooks' spool

    def ingest_hook_spool(self, spool_dir: Path) -> int:
        """Report OOM events that hooks spooled while capture was unreachable; returns how many."""
        count = 0
        for path, raw in spooled_events(spool_dir):
            if raw is None:
                log.warning("unreadable OOM spool file %s; kept as %s.bad", path, path.name)
                with contextlib.suppress(OSError):
                    path.rename(path.with_name(path.name + ".bad"))
                continue
            try:
                self.report_oom(event_to_proto(raw))
                count += 1
            except (RejectedOom, ValueError, TypeError, KeyError) as exc:
                log.warning("spooled OOM event %s refused: %s", path.name, exc)
            # The publisher owns it now (and spools it itself if Kafka is down).
            path.unlink(missing_ok=True)
        return count

    async def watch_hook_spool(self, spool_dir: Path, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.ingest_hook_spool(spool_dir)
            except OSError as exc:
                log.warning("cannot scan OOM hook spool %s: %s", spool_dir, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
