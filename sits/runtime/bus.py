"""The Kafka event bus every service uses (aiokafka).

Producer: records keyed by target, CloudEvents headers, the current trace
context injected as `traceparent`/`tracestate`, and a PRODUCER span per record.
Given a signer, it signs every HealingCommand it sends (sits.runtime.signing).

Consumer: offsets are committed only after the handler finished (at-least-once;
handlers are idempotent on event_id / command_id). A record that cannot be
decoded, has an unknown `ce_type` or a malformed header goes to the dead-letter
topic with the reason in a header, and consumption continues. A handler that
raises `DeadLetter` sends its record there too (the executor refuses unsigned
commands so), and consumption continues. A handler that
raises anything else leaves its record uncommitted: the consumer seeks back and retries after
a backoff, so a dependency outage (Redis, say) delays work and loses none.
A MetricBatch record reaches the handler as its samples, one by one (a retry
replays the whole record; handlers are idempotent on event_id). When a consumer
lags, metric samples in one poll are coalesced per target (latest wins), so a
burst costs one handler call per target, not per sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from aiokafka.partitioner import murmur2
from google.protobuf.message import Message
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from sits.runtime import metrics
from sits.runtime.events import (
    DLQ_REASON_HEADER,
    EnvelopeError,
    Topics,
    cloudevent_headers,
    decode_events,
    header_value,
    meta_of,
    target_key,
)
from sits.runtime.kafka_security import kafka_client_options
from sits.runtime.settings import Settings
from sits.runtime.signing import Signer
from sits.runtime.tracing import extract_headers, inject_headers, is_valid_traceparent
from sits.v1 import events_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sits.bus")

Header = tuple[str, bytes]
# Partition choices remembered per (topic, key); targets are bounded in practice, this bounds them anyway.
MAX_CACHED_KEYS = 100_000
COALESCED_TYPES = frozenset({events_pb2.MetricSample.DESCRIPTOR.full_name})
SIGNED_TYPES = (events_pb2.HealingCommand,)


class DeadLetter(Exception):
    """Raised by a handler: this record must not be handled; it goes to the dead-letter topic with the reason.

    `category` is a short, bounded label (for metrics); the message is the reason header.
    """

    def __init__(self, category: str, reason: str) -> None:
        super().__init__(reason)
        self.category = category


async def ensure_topics(settings: Settings, topics: Sequence[str] | None = None) -> None:
    """Create the SITS topics that do not exist yet."""
    wanted = list(topics) if topics is not None else Topics(settings.topic_prefix).all()
    admin = AIOKafkaAdminClient(**kafka_client_options(settings))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t not in existing]
        if missing:
            new = [NewTopic(t, num_partitions=settings.kafka_partitions, replication_factor=1) for t in missing]
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(new)
    finally:
        await admin.close()


class EventProducer:
    """Publishes SITS events; an async context manager whose stop() is safe twice.

    With a `signer`, every HealingCommand record carries its signature headers.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        linger_ms: int = 2,
        max_batch_bytes: int = 16384,
        signer: Signer | None = None,
    ) -> None:
        self._settings = settings
        self._signer = signer
        self._producer = AIOKafkaProducer(
            **kafka_client_options(settings),
            enable_idempotence=settings.kafka_enable_idempotence,
            acks="all",
            linger_ms=linger_ms,
            max_batch_size=max_batch_bytes,
            request_timeout_ms=settings.kafka_request_timeout_ms,
        )
        self._started = False
        self._partitions: dict[tuple[str, str], int] = {}
        self._partition_counts: dict[str, int] = {}
        self._out_counters: dict[str, Any] = {}

    async def start(self) -> None:
        if not self._started:
            try:
                await self._producer.start()
            except BaseException:
                # A broker refusing us (TLS, SASL) leaves the client half open: close it before raising.
                with contextlib.suppress(Exception):
                    await self._producer.stop()
                raise
            self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await self._producer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def publish(self, topic: str, message: Message, *, traced: bool = True) -> None:
        """Publish and wait until the broker has it."""
        await (await self.enqueue(topic, message, traced=traced))

    async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]:
        """Hand the record to the producer's batch; await the returned future for delivery.

        `traced=False` skips the PRODUCER span and the trace headers: for high-volume
        records that start no incident (a calm metric sample), where a span per
        record would cost more than the rest of publishing.
        """
        meta = meta_of(message)
        key = target_key(meta.target)
        partition = await self._partition(topic, key)
        value = message.SerializeToString()
        key_bytes = key.encode()
        headers: list[Header] = cloudevent_headers(message, key)
        if self._signer is not None and isinstance(message, SIGNED_TYPES):
            headers.extend(self._signer.headers(key_bytes, value))
        if not traced:
            future = await self._producer.send(topic, value=value, key=key_bytes, headers=headers, partition=partition)
        else:
            with tracer.start_as_current_span(
                f"{topic} publish",
                kind=SpanKind.PRODUCER,
                attributes={
                    "messaging.system": "kafka",
                    "messaging.destination.name": topic,
                    "messaging.message.id": meta.event_id,
                    "sits.event_type": message.DESCRIPTOR.full_name,
                },
            ):
                inject_headers(headers)
                future = await self._producer.send(
                    topic, value=value, key=key_bytes, headers=headers, partition=partition
                )
        counter = self._out_counters.get(topic)
        if counter is None:
            counter = self._out_counters[topic] = metrics.EVENTS_OUT.labels(topic=topic)
        counter.inc()
        delivery: asyncio.Future[Any] = future
        return delivery

    async def _partition(self, topic: str, key: str) -> int:
        """The default partitioner's choice (murmur2 of the key), remembered per key."""
        cached = self._partitions.get((topic, key))
        if cached is not None:
            return cached
        count = self._partition_counts.get(topic)
        if count is None:
            count = len(await self._producer.partitions_for(topic))
            self._partition_counts[topic] = count
        if len(self._partitions) > MAX_CACHED_KEYS:
            self._partitions.clear()
        partition = int(murmur2(key.encode()) & 0x7FFFFFFF) % count
        self._partitions[(topic, key)] = partition
        return partition

    async def forward_raw(self, topic: str, key: bytes | None, value: bytes | None, headers: list[Header]) -> None:
        await (await self._producer.send(topic, value=value, key=key, headers=headers))

    async def flush(self) -> None:
        await self._producer.flush()


@dataclass(frozen=True)
class ReceivedEvent:
    topic: str
    partition: int
    offset: int
    key: str
    message: Message
    headers: tuple[Header, ...]
    # How many samples this one stands for after coalescing (1 when none were folded in).
    coalesced: int = 1
    # The record's key and value as they came off the wire (what a signature covers).
    record_key: bytes = b""
    record_value: bytes = b""

    @property
    def event_type(self) -> str:
        return self.message.DESCRIPTOR.full_name


Handler = Callable[[ReceivedEvent], Awaitable[None]]


@dataclass
class ConsumerStats:
    handled: int = 0
    dead_lettered: int = 0
    coalesced: int = 0
    retries: int = 0
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PartitionLag:
    topic: str
    records: int  # records written and not yet consumed
    reached_ms: int | None  # write time of the record the consumer stopped at (last handled, or failing)


def lag_by_topic(partitions: Sequence[PartitionLag], now_s: float) -> dict[str, tuple[int, float]]:
    """(records, seconds) behind per topic. Records add up over partitions. Seconds are those of the
    partition furthest behind, counted only where records wait: a caught-up partition is 0 s behind
    however old its last record. Seconds do not depend on how many samples a record packs, records do.
    The record it is at stands for the oldest waiting one: they were written moments apart.
    """
    lag: dict[str, tuple[int, float]] = {}
    for p in partitions:
        records, seconds = lag.get(p.topic, (0, 0.0))
        behind_s = 0.0
        if p.records > 0 and p.reached_ms is not None and p.reached_ms > 0:
            behind_s = max(0.0, now_s - p.reached_ms / 1000.0)
        lag[p.topic] = (records + p.records, max(seconds, behind_s))
    return lag


class EventConsumer:
    """Consumes SITS events for one consumer group and hands each to `handler`."""

    def __init__(
        self,
        settings: Settings,
        *,
        group_id: str,
        topics: Sequence[str],
        handler: Handler,
        dead_letters: EventProducer,
        coalesce: bool = True,
        retry_backoff_s: float = 0.5,
    ) -> None:
        self._settings = settings
        self._topics = list(topics)
        self._handler = handler
        self._dlq = dead_letters
        self._dlq_topic = Topics(settings.topic_prefix).deadletter
        self._coalesce = coalesce
        self._retry_backoff_s = retry_backoff_s
        self._group_id = group_id
        self._consumer = AIOKafkaConsumer(
            *self._topics,
            **kafka_client_options(settings),
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=settings.consumer_max_batch,
            fetch_max_wait_ms=settings.consumer_fetch_max_wait_ms,
            # Tansu starts a group quickly; the default 3 s join delay would dominate tests.
            session_timeout_ms=10_000,
            heartbeat_interval_ms=1_000,
        )
        self._started = False
        self._metric_children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # Per partition: the write time (ms) of the record the consumer stopped at: the last one of
        # a handled batch, or the one a handler failed on. Set per batch: lag is exported between them.
        self._reached_ms: dict[TopicPartition, int] = {}
        self.stats = ConsumerStats()

    async def start(self) -> None:
        if not self._started:
            await self._consumer.start()
            self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            with contextlib.suppress(KafkaError):
                await self._consumer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def run(self, stop: asyncio.Event) -> None:
        """Poll, handle and commit until `stop` is set; the last handled batch is committed before return.

        Starts the consumer if needed: joining a group takes seconds on some
        brokers, so services answer health checks first and join here.
        """
        await self.start()
        while not stop.is_set():
            batches = await self._consumer.getmany(timeout_ms=200, max_records=self._settings.consumer_max_batch)
            for tp, records in batches.items():
                await self._handle_partition(tp, records)
            await self._export_lag()

    async def _handle_partition(self, tp: TopicPartition, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        decoded: list[tuple[ConsumerRecord[bytes, bytes], Message]] = []
        for record in records:
            messages = await self._decode_or_dead_letter(record)
            if messages is not None:
                decoded.extend((record, message) for message in messages)
        for record, message, folded in self._coalesced(decoded):
            event = ReceivedEvent(
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                key=(record.key or b"").decode(errors="replace"),
                message=message,
                headers=tuple(record.headers),
                coalesced=folded,
                record_key=record.key or b"",
                record_value=record.value or b"",
            )
            try:
                await self._handle_traced(event)
            except DeadLetter as refused:
                # Refused by the handler: dead-lettered like an undecodable record, and done with.
                await self._dead_letter(record, refused.category, str(refused))
            except Exception:
                # Everything before this record is done; this one and the rest come again.
                log.exception("handler failed on %s[%d]@%d; retrying", record.topic, record.partition, record.offset)
                self.stats.retries += 1
                metrics.HANDLER_RETRIES.labels(topic=record.topic).inc()
                self._reached_ms[tp] = record.timestamp
                await self._commit(tp, record.offset)
                self._consumer.seek(tp, record.offset)
                await asyncio.sleep(self._retry_backoff_s)
                return
        if records:
            self._reached_ms[tp] = records[-1].timestamp
            await self._commit(tp, records[-1].offset + 1)

    def _coalesced(
        self, decoded: list[tuple[ConsumerRecord[bytes, bytes], Message]]
    ) -> list[tuple[ConsumerRecord[bytes, bytes], Message, int]]:
        if not self._coalesce:
            return [(r, m, 1) for r, m in decoded]
        latest: dict[bytes, int] = {}
        counts: dict[bytes, int] = {}
        for index, (record, message) in enumerate(decoded):
            if message.DESCRIPTOR.full_name in COALESCED_TYPES:
                key = record.key or b""
                latest[key] = index
                counts[key] = counts.get(key, 0) + 1
        keep: list[tuple[ConsumerRecord[bytes, bytes], Message, int]] = []
        for index, (record, message) in enumerate(decoded):
            if message.DESCRIPTOR.full_name not in COALESCED_TYPES:
                keep.append((record, message, 1))
                continue
            key = record.key or b""
            if latest[key] == index:
                keep.append((record, message, counts[key]))
            else:
                self.stats.coalesced += 1
                self._child(metrics.EVENTS_COALESCED, record.topic).inc()
        return keep

    async def _handle_traced(self, event: ReceivedEvent) -> None:
        parent = extract_headers(event.headers)
        if event.event_type in COALESCED_TYPES and not trace.get_current_span(parent).get_span_context().is_valid:
            # Capture publishes calm samples without a trace: a root span for each would start a trace
            # per sample and cost more than handling it.
            await self._handle(event)
            return
        token = otel_context.attach(parent)
        try:
            with tracer.start_as_current_span(
                f"{event.topic} process",
                kind=SpanKind.CONSUMER,
                attributes={
                    "messaging.system": "kafka",
                    "messaging.destination.name": event.topic,
                    "messaging.consumer.group.name": self._group_id,
                    "messaging.message.id": meta_of(event.message).event_id,
                    "sits.event_type": event.event_type,
                },
            ):
                await self._handle(event)
        finally:
            otel_context.detach(token)

    async def _handle(self, event: ReceivedEvent) -> None:
        started = time.perf_counter()
        await self._handler(event)
        self._child(metrics.HANDLER_SECONDS, event.topic).observe(time.perf_counter() - started)
        self.stats.handled += 1
        self._child(metrics.EVENTS_IN, event.topic, event.event_type).inc()

    def _child(self, metric: Any, *labels: str) -> Any:
        """The labelled child of `metric`, looked up once: `.labels()` per record is measurable."""
        key = (id(metric), labels)
        child = self._metric_children.get(key)
        if child is None:
            child = self._metric_children[key] = metric.labels(*labels)
        return child

    async def _decode_or_dead_letter(self, record: ConsumerRecord[bytes, bytes]) -> list[Message] | None:
        """The record's events (a MetricBatch's samples, one by one), or None once it is dead-lettered."""
        headers = list(record.headers)
        try:
            traceparent = header_value(headers, "traceparent")
            if traceparent is not None and not is_valid_traceparent(traceparent):
                raise EnvelopeError("malformed_header", f"malformed traceparent {traceparent!r}")
            return decode_events(headers, record.value)
        except EnvelopeError as err:
            await self._dead_letter(record, err.category, str(err))
        return None

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], category: str, reason: str) -> None:
        headers = list(record.headers)
        await self._dlq.forward_raw(
            self._dlq_topic,
            record.key,
            record.value,
            [
                *[(k, v) for k, v in headers if not k.startswith("sits_dlq_")],
                (DLQ_REASON_HEADER, reason.encode()),
                ("sits_dlq_topic", record.topic.encode()),
                ("sits_dlq_partition", str(record.partition).encode()),
                ("sits_dlq_offset", str(record.offset).encode()),
                ("sits_dlq_group", self._group_id.encode()),
            ],
        )
        self.stats.dead_lettered += 1
        self.stats.dead_letter_reasons[category] = self.stats.dead_letter_reasons.get(category, 0) + 1
        metrics.DEAD_LETTERS.labels(topic=record.topic, reason=category).inc()
        log.warning("dead-lettered %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)

    async def _commit(self, tp: TopicPartition, next_offset: int) -> None:
        await self._consumer.commit({tp: next_offset})

    async def _export_lag(self) -> None:
        partitions = []
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            if highwater is None:
                continue
            position = await self._consumer.position(tp)
            partitions.append(PartitionLag(tp.topic, max(0, highwater - position), self._reached_ms.get(tp)))
        for topic, (records, seconds) in lag_by_topic(partitions, time.time()).items():
            metrics.CONSUMER_LAG.labels(topic=topic, group=self._group_id).set(records)
            metrics.CONSUMER_LAG_SECONDS.labels(topic=topic, group=self._group_id).set(seconds)
