"""Publishes capture's events to Kafka; spools them to disk while Kafka is unreachable.

`submit()` never blocks and never raises: events wait in a bounded in-memory
queue for the publishing task. That task sends them in batches through the
runtime's `EventProducer` (keyed by target, CloudEvents headers, trace
context). When the broker fails, the batch in hand and everything after it go
to the spool, in order; a drain loop retries with backoff and, once the broker
answers, publishes the spool oldest-first before new events flow directly
again. OOM events are never dropped anywhere on this path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiokafka.errors import KafkaError
from google.protobuf.message import Message
from opentelemetry import context as otel_context

from services.capture import metrics
from services.capture.sources.base import Backoff, Sleep, default_sleep
from services.capture.spool import RecordKind, Spool, SpoolRecord
from sits.runtime.events import Topics, memory_fraction
from sits.v1 import events_pb2

log = logging.getLogger(__name__)


class Producer(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]: ...


@dataclass(frozen=True)
class _Pending:
    kind: RecordKind
    message: Message
    # The caller's trace context, kept for OOM events (one trace follows an OOM to its verdict);
    # None for samples, whose volume makes per-record context switching too costly.
    trace_context: otel_context.Context | None


@dataclass
class PublisherStats:
    published: int = 0
    spooled: int = 0
    drained: int = 0
    broker_failures: int = 0
    unpublishable: int = 0


class CapturePublisher:
    def __init__(
        self,
        producer_factory: Callable[[], Producer],
        spool: Spool,
        topics: Topics,
        *,
        batch_size: int = 512,
        queue_capacity: int = 50_000,
        sleep: Sleep = default_sleep,
        backoff: Backoff | None = None,
        delivery_timeout_s: float = 10.0,
        trace_samples_above: float = 0.8,
    ) -> None:
        self._producer_factory = producer_factory
        self._trace_samples_above = trace_samples_above
        self._producer: Producer | None = None
        self._spool = spool
        self._topics = topics
        self._batch_size = batch_size
        self._capacity = queue_capacity
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._sleep = sleep
        self._backoff = backoff or Backoff(0.2, 5.0)
        self._delivery_timeout_s = delivery_timeout_s
        self.stats = PublisherStats()
        self.online = False
        self._stopping = False

    # ------------------------------------------------------------------ intake

    def submit(self, event: events_pb2.MetricSample | events_pb2.OomEvent) -> None:
        kind = RecordKind.OOM if isinstance(event, events_pb2.OomEvent) else RecordKind.METRIC
        trace_context = otel_context.get_current() if kind is RecordKind.OOM else None
        if len(self._queue) >= self._capacity:
            # The publisher cannot keep up: the disk takes the backlog (bounded there, OOMs kept),
            # all of it so that order holds.
            self._to_spool([*self._take(len(self._queue)), _Pending(kind, event, trace_context)])
        else:
            self._queue.append(_Pending(kind, event, trace_context))
        self._wakeup.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def spool(self) -> Spool:
        return self._spool

    # ------------------------------------------------------------------ run

    async def run(self, stop: asyncio.Event) -> None:
        """Publish until `stop` is set; then flush what is queued to Kafka or the spool."""
        try:
            while not stop.is_set():
                if not self.online:
                    await self._try_reconnect()
                if self.online and self._spool.pending:
                    await self._drain_once()
                    continue
                if not self._queue:
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), timeout=0.2)
                    continue
                if not self.online or self._spool.pending:
                    # Order: while the spool has older events, new ones queue behind them on disk.
                    self._to_spool(self._take(len(self._queue)))
                    if not self.online:
                        await self._sleep(self._backoff.next_delay())
                    continue
                await self._publish_batch(self._take(self._batch_size))
        finally:
            self._to_spool(self._take(len(self._queue)))
            self._spool.sync()
            await self._close_producer()

    def _take(self, count: int) -> list[_Pending]:
        return [self._queue.popleft() for _ in range(min(count, len(self._queue)))]

    async def _publish_batch(self, batch: list[_Pending]) -> None:
        try:
            await self._send([(self._topic(p.kind), p.message, p.trace_context) for p in batch])
        except Exception as exc:
            self._went_offline(exc)
            self._to_spool(batch)  # possibly some were delivered: at least once
            return
        self.stats.published += len(batch)

    async def _drain_once(self) -> None:
        records = self._spool.peek(self._batch_size)
        messages: list[tuple[str, Message, otel_context.Context | None]] = []
        for record in records:
            cls = events_pb2.OomEvent if record.kind is RecordKind.OOM else events_pb2.MetricSample
            messages.append((record.topic, cls.FromString(record.payload), None))
        try:
            await self._send(messages)
        except Exception as exc:
            self._went_offline(exc)
            await self._sleep(self._backoff.next_delay())
            return
        self._spool.commit(len(records))
        self.stats.drained += len(records)
        metrics.DRAINED.inc(len(records))
        self._export_spool()

    def _traced(self, message: Message, trace_context: otel_context.Context | None) -> bool:
        """Trace OOM events, and samples under pressure: those are where an incident's trace starts.

        A calm sample gets no span: at tens of thousands a second the span would cost more than
        publishing it.
        """
        if trace_context is not None or not isinstance(message, events_pb2.MetricSample):
            return True
        fraction = memory_fraction(message)
        return fraction is not None and fraction >= self._trace_samples_above

    async def _send(self, messages: list[tuple[str, Message, otel_context.Context | None]]) -> None:
        assert self._producer is not None
        futures: list[asyncio.Future[Any]] = []
        for topic, message, trace_context in messages:
            token = otel_context.attach(trace_context) if trace_context is not None else None
            try:
                futures.append(
                    await self._producer.enqueue(topic, message, traced=self._traced(message, trace_context))
                )
            except (KafkaError, OSError, TimeoutError):
                raise
            except Exception as exc:
                # Not the broker: this one event cannot be sent (no event_id, say). Retrying it would
                # stall every event behind it, so it is logged and skipped.
                self.stats.unpublishable += 1
                log.error("dropping an event that cannot be published to %s: %s", topic, exc)
            finally:
                if token is not None:
                    otel_context.detach(token)
        if futures:
            await asyncio.wait_for(asyncio.gather(*futures), timeout=self._delivery_timeout_s)

    def _topic(self, kind: RecordKind) -> str:
        return self._topics.oom if kind is RecordKind.OOM else self._topics.metrics

    # ------------------------------------------------------------------ broker state

    async def _try_reconnect(self) -> None:
        await self._close_producer()
        producer = self._producer_factory()
        try:
            await asyncio.wait_for(producer.start(), timeout=self._delivery_timeout_s)
        except Exception as exc:
            with contextlib.suppress(Exception):
                await producer.stop()
            self._went_offline(exc)
            if not self._queue:
                await self._sleep(self._backoff.next_delay())
            return
        self._producer = producer
        self.online = True
        self._backoff.reset()
        metrics.BROKER_UP.set(1)
        log.info("Kafka reachable; %d spooled events to drain", self._spool.pending)

    def _went_offline(self, exc: BaseException) -> None:
        if self.online:
            log.warning("Kafka unreachable (%s); spooling to %s", exc or type(exc).__name__, self._spool.directory)
        self.online = False
        self.stats.broker_failures += 1
        metrics.BROKER_UP.set(0)

    async def _close_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), timeout=5.0)

    def _to_spool(self, batch: list[_Pending]) -> None:
        for pending in batch:
            record = SpoolRecord(pending.kind, self._topic(pending.kind), pending.message.SerializeToString())
            dropped_before = self._spool.dropped_samples
            self._spool.append(record)
            metrics.SPOOLED.labels(kind=pending.kind.name.lower()).inc()
            if self._spool.dropped_samples > dropped_before:
                metrics.SPOOL_DROPPED.inc(self._spool.dropped_samples - dropped_before)
        self.stats.spooled += len(batch)
        self._export_spool()

    def _export_spool(self) -> None:
        metrics.SPOOL_PENDING.set(self._spool.pending)
        metrics.SPOOL_BYTES.set(self._spool.total_bytes)


class TopicEnsuringProducer:
    """The runtime's EventProducer, creating capture's topics first (a restarted broker may lack them)."""

    def __init__(self, settings: Any, *, linger_ms: int = 5) -> None:
        from sits.runtime.bus import EventProducer

        self._settings = settings
        self._producer = EventProducer(settings, linger_ms=linger_ms)

    async def start(self) -> None:
        from sits.runtime.bus import ensure_topics

        topics = Topics(self._settings.topic_prefix)
        await ensure_topics(self._settings, [topics.metrics, topics.oom])
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]:
        return await self._producer.enqueue(topic, message, traced=traced)
