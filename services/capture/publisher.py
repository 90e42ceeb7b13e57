"""Publishes capture's events to Kafka; spools them to disk while Kafka is unreachable.

`submit()` never blocks and never raises: events wait in a bounded in-memory
queue for the publishing task. That task sends them in batches through the
runtime's `EventProducer` (keyed by target, CloudEvents headers, trace
context); the samples of one target in a batch travel as one `MetricBatch`
record, so the more capture has queued, the less each sample costs the
producer, the broker and every consumer, and a lone sample waits for no one.
With a linger (`linger_s`, off by default), calm samples wait up to that long
for more of their target's to share a record, as Kafka's own `linger.ms`
does: a fleet of engines at 10 Hz otherwise sends one sample per record, and
per-record work then dominates every stage. An OOM event, a sample under
pressure (memory at or above `trace_samples_above`) or a full batch ends the
wait at once, so what the loop must act on is never held back. Samples under
pressure also travel on a topic of their own (`sits.metrics.urgent.v1`, unless
`urgent_lane` is off), which consumers handle before anything else: in a fleet
whose calm samples outrun the decision, the ones heading to OOM do not queue
behind them. Here too they (and OOM events) go before the calm samples queued
and before the spool's backlog while the broker answers, and each batch of them
is followed by one of the others, so a steady stream of them (a simulated
fleet's publisher) does not starve the calm lane; the spool keeps order within
each lane.
When the broker fails, the batch in hand and everything after it go
to the spool, in order; a drain loop retries with backoff and, once the broker
answers, publishes the spool oldest-first before new events flow directly
again. OOM events are never dropped anywhere on this path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from aiokafka.errors import KafkaError
from google.protobuf.message import Message
from opentelemetry import context as otel_context

from services.capture import metrics
from services.capture.sources.base import Backoff, Sleep, default_sleep
from services.capture.spool import RecordKind, Spool, SpoolRecord
from sits.runtime.contract import memory_fraction
from sits.runtime.events import Topics, metric_batch
from sits.v1 import events_pb2

log = logging.getLogger(__name__)

# Enough that a record's fixed costs vanish per sample, small enough for the producer's 1 MiB
# request limit (a sample is 150-400 bytes).
MAX_SAMPLES_PER_RECORD = 512
BATCH_SOURCE = "capture"
CAPTURE_PRODUCER_BATCH_BYTES = 512 << 10


class Producer(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]: ...


class _Pending(NamedTuple):  # a tuple: one is made per sample
    kind: RecordKind
    topic: str
    message: Message
    # The caller's trace context, kept for OOM events (one trace follows an OOM to its verdict);
    # None for samples, whose volume makes per-record context switching too costly.
    trace_context: otel_context.Context | None
    # Whether its record gets a span (`_traced`): decided once, where the lane is chosen.
    traced: bool


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
        batch_size: int = 4096,
        queue_capacity: int = 50_000,
        sleep: Sleep = default_sleep,
        backoff: Backoff | None = None,
        delivery_timeout_s: float = 10.0,
        trace_samples_above: float = 0.8,
        linger_s: float = 0.0,
        urgent_lane: bool = True,
    ) -> None:
        self._producer_factory = producer_factory
        self._trace_samples_above = trace_samples_above
        self._producer: Producer | None = None
        self._spool = spool
        self._metrics_topic, self._oom_topic = topics.metrics, topics.oom
        self._urgent_topic = topics.metrics_urgent if urgent_lane else topics.metrics
        self._batch_size = batch_size
        self._capacity = queue_capacity
        self._queue: deque[_Pending] = deque()
        # With the urgent lane: OOMs and samples under pressure, published before calm samples and the spool.
        # Without it, they queue with the rest (one topic, one order).
        self._urgent: deque[_Pending] = deque()
        self._urgent_queue = self._urgent if urgent_lane else self._queue
        self._wakeup = asyncio.Event()
        self._linger_s = linger_s
        # Set when what is queued must go now: an OOM, a sample under pressure, a full batch.
        self._flush_now = asyncio.Event()
        self._oldest_queued_at = 0.0
        self._sleep = sleep
        self._backoff = backoff or Backoff(0.2, 5.0)
        self._delivery_timeout_s = delivery_timeout_s
        self.stats = PublisherStats()
        self.online = False
        self._stopping = False

    # ------------------------------------------------------------------ intake

    def submit(self, event: events_pb2.MetricSample | events_pb2.OomEvent) -> None:
        if isinstance(event, events_pb2.OomEvent):
            pending = _Pending(RecordKind.OOM, self._oom_topic, event, otel_context.get_current(), True)
            queue = self._urgent_queue
        elif self._under_pressure(event):
            pending = _Pending(RecordKind.METRIC, self._urgent_topic, event, None, True)
            queue = self._urgent_queue
        else:
            pending = _Pending(RecordKind.METRIC, self._metrics_topic, event, None, False)
            queue = self._queue
        if not self._queue and queue is self._queue:  # the linger counts from the oldest calm sample
            self._oldest_queued_at = time.monotonic()
        if len(queue) >= self._capacity:
            # The publisher cannot keep up: the disk takes the backlog (bounded there, OOMs kept),
            # all of it so that order holds.
            self._to_spool([*self._take(queue, len(queue)), pending])
        else:
            queue.append(pending)
        # `_flush_now` ends the calm samples' linger: set only while some wait. The urgent queue goes first
        # without it, and a flag left set with nothing waiting would let the next calm sample skip its linger.
        if self._queue and (queue is self._urgent_queue or len(self._queue) >= self._batch_size):
            self._flush_now.set()
        self._wakeup.set()

    @property
    def queued(self) -> int:
        return len(self._queue) + len(self._urgent)

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
                if self.online and self._urgent:
                    # Ahead of the spool and of calm samples: a publisher behind on those (a slow broker,
                    # a burst) must not hold back what the loop acts on.
                    await self._publish_batch(self._take(self._urgent, self._batch_size))
                    if not (self.online and (self._spool.pending or self._queue)):
                        continue
                    # On to one batch of the spool or of the calm samples: a steady stream of samples under
                    # pressure (a fleet's worth) must not starve them either.
                if self.online and self._spool.pending:
                    await self._drain_once()
                    continue
                if not self._queue and not self._urgent:
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), timeout=0.2)
                    continue
                if not self.online or self._spool.pending:
                    # Order: while the spool has older events, new ones queue behind them on disk.
                    self._to_spool(self._take_all())
                    if not self.online:
                        await self._sleep(self._backoff.next_delay())
                    continue
                if not self._queue:  # only urgent ones: they go first, above
                    continue
                await self._linger(stop)
                self._flush_now.clear()
                # Urgent events that came during the linger lead the batch; the wait is over for the calm
                # samples too, so a target's samples before its pressure are not held back behind it.
                await self._publish_batch(
                    self._take(self._urgent, self._batch_size) + self._take(self._queue, self._batch_size)
                )
        finally:
            self._to_spool(self._take_all())
            self._spool.sync()
            await self._close_producer()

    async def _linger(self, stop: asyncio.Event) -> None:
        """Wait out what is left of the oldest queued event's linger, unless something must go now."""
        left = self._oldest_queued_at + self._linger_s - time.monotonic()
        if left <= 0 or self._flush_now.is_set() or stop.is_set():
            return
        # A stop ends the wait too: the queue then goes out (or to the spool) at once, not a linger later.
        waits = [asyncio.ensure_future(self._flush_now.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    @staticmethod
    def _take(queue: deque[_Pending], count: int) -> list[_Pending]:
        return [queue.popleft() for _ in range(min(count, len(queue)))]

    def _take_all(self) -> list[_Pending]:
        return self._take(self._urgent, len(self._urgent)) + self._take(self._queue, len(self._queue))

    async def _publish_batch(self, batch: list[_Pending]) -> None:
        try:
            await self._send(batch)
        except Exception as exc:
            self._went_offline(exc)
            self._to_spool(batch)  # possibly some were delivered: at least once
            return
        self.stats.published += len(batch)

    async def _drain_once(self) -> None:
        records = self._spool.peek(self._batch_size)
        pending: list[_Pending] = []
        for record in records:
            cls = events_pb2.OomEvent if record.kind is RecordKind.OOM else events_pb2.MetricSample
            message = cls.FromString(record.payload)
            pending.append(_Pending(record.kind, record.topic, message, None, self._traced(message)))
        try:
            await self._send(pending)
        except Exception as exc:
            self._went_offline(exc)
            await self._sleep(self._backoff.next_delay())
            return
        self._spool.commit(len(records))
        self.stats.drained += len(records)
        metrics.DRAINED.inc(len(records))
        self._export_spool()

    def _traced(self, message: Message) -> bool:
        """Trace OOM events, and samples under pressure: those are where an incident's trace starts.

        A calm sample gets no span: at tens of thousands a second the span would cost more than
        publishing it. A record that packs several samples is traced when one of them is.
        """
        return not isinstance(message, events_pb2.MetricSample) or self._under_pressure(message)

    def _under_pressure(self, sample: events_pb2.MetricSample) -> bool:
        fraction = memory_fraction(sample)
        return fraction is not None and fraction >= self._trace_samples_above

    @staticmethod
    def _packed(pending: list[_Pending]) -> list[tuple[str, Message, otel_context.Context | None, bool]]:
        """The same events, each target's samples (in order) packed into MetricBatch records.

        Each comes with its trace context and whether it is traced.
        """
        out: list[tuple[str, Message, otel_context.Context | None, bool]] = []
        per_target: dict[tuple[str, str, str, str, str], list[tuple[events_pb2.MetricSample, bool]]] = {}
        for _kind, topic, message, trace_context, traced in pending:
            if trace_context is None and isinstance(message, events_pb2.MetricSample):
                target = message.meta.target
                key = (topic, target.host, target.gpu_uuid, target.mig_instance, target.engine)
                samples = per_target.get(key)
                if samples is None:
                    per_target[key] = samples = []
                samples.append((message, traced))
            else:
                out.append((topic, message, trace_context, traced))
        for key, samples in per_target.items():
            for start in range(0, len(samples), MAX_SAMPLES_PER_RECORD):
                part = samples[start : start + MAX_SAMPLES_PER_RECORD]
                traced = any(sample_traced for _sample, sample_traced in part)
                record = part[0][0] if len(part) == 1 else metric_batch([sample for sample, _ in part], BATCH_SOURCE)
                out.append((key[0], record, None, traced))
        return out

    async def _send(self, pending: list[_Pending]) -> None:
        assert self._producer is not None
        futures: list[asyncio.Future[Any]] = []
        for topic, message, trace_context, traced in self._packed(pending):
            token = otel_context.attach(trace_context) if trace_context is not None else None
            try:
                futures.append(await self._producer.enqueue(topic, message, traced=traced))
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
            if not self.queued:
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
            record = SpoolRecord(pending.kind, pending.topic, pending.message.SerializeToString())
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

    def __init__(
        self, settings: Any, *, linger_ms: int = 5, max_batch_bytes: int = CAPTURE_PRODUCER_BATCH_BYTES
    ) -> None:
        from sits.runtime.bus import EventProducer

        self._settings = settings
        # aiokafka keeps one produce request in flight per broker: with its default 16 KiB batches,
        # a burst of MetricBatch records would take a round trip per 16 KiB per partition.
        self._producer = EventProducer(settings, linger_ms=linger_ms, max_batch_bytes=max_batch_bytes)

    async def start(self) -> None:
        from sits.runtime.bus import ensure_topics

        topics = Topics(self._settings.topic_prefix)
        await ensure_topics(self._settings, [*topics.samples, topics.oom])
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]:
        return await self._producer.enqueue(topic, message, traced=traced)
