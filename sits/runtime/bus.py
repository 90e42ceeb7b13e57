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
burst costs one handler call per target, not per sample. Records of a consumer's
urgent topics (samples under pressure, OOMs) are handled first in every round,
before any other record already fetched: a backlog of calm samples delays them
by at most the batch in hand.

Replicas: every service's group uses the range assignor, so partition p of each
of its topics goes to the same member (the topics share partition count and
target keys): one replica owns one target on every topic it reads. Offsets are
committed at most every SITS_CONSUMER_COMMIT_INTERVAL_MS (0: after each batch);
on revocation the consumer waits for the batch in hand, commits what it handled
on the revoked partitions, then tells the service (`on_revoked`) so it can hand
its per-target state over before the next owner starts. `partition_of` is the
producer's choice of partition for a key, so a service can tell which targets
it owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from aiokafka.partitioner import murmur2
from google.protobuf.message import Message
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from sits.runtime import metrics
from sits.runtime.contract import format_target_key
from sits.runtime.events import (
    DLQ_REASON_HEADER,
    EnvelopeError,
    Topics,
    cloudevent_headers,
    decode_events,
    header_value,
    meta_of,
)
from sits.runtime.kafka_security import kafka_client_options
from sits.runtime.settings import Settings
from sits.runtime.signing import Signer
from sits.runtime.tracing import extract_headers, inject_headers, is_valid_traceparent
from sits.v1 import events_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sits.bus")

Header = tuple[str, bytes]
# What a consumer's getmany returns: the records fetched, per partition.
Fetched = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
# Partition choices remembered per (topic, key); targets are bounded in practice, this bounds them anyway.
MAX_CACHED_KEYS = 100_000
COALESCED_TYPES = frozenset({events_pb2.MetricSample.DESCRIPTOR.full_name})
SIGNED_TYPES = (events_pb2.HealingCommand,)


# How long a revocation waits for the batch in hand before it abandons it (its records come again elsewhere).
REVOKE_WAIT_S = 10.0
# A consumer with urgent topics handles the rest of a batch in slices of this many records and, between two,
# lets the loop run (its producer sends, its fetcher fetches) and handles the urgent records fetched meanwhile:
# a record heading to OOM then waits behind one slice (tens of ms), not behind a whole batch (up to
# SITS_CONSUMER_MAX_BATCH records, a second and more on a busy host).
URGENT_SLICE_RECORDS = 50
# Event-loop turns given between two slices. aiokafka needs several to bring a fetch response from the socket
# to getmany (the connection's reader, the fetch task, the fetcher's buffer) and as many to send the next
# fetch; with one turn per slice, an urgent record in a busy decision waited several slices for its fetch
# (44 ms p50 / 152 ms p99 from its write to its handling at 5,000 targets, 15 / 113 ms with 8 turns). A turn
# with nothing ready costs a few microseconds: well under 1% of a slice.
LOOP_TURNS_BETWEEN_SLICES = 8


def partition_of(key: str, partitions: int) -> int:
    """The partition the producer writes `key` to (the Java client's murmur2 partitioner)."""
    return int(murmur2(key.encode()) & 0x7FFFFFFF) % partitions


# How far one replica's clock may run ahead of another's, when one looks for what the other published.
CLOCK_SLACK_S = 60.0


async def find_event(
    settings: Settings,
    topic: str,
    key: str,
    since_s: float,
    match: Callable[[Message], bool],
    timeout_s: float = 10.0,
) -> Message | None:
    """The first event of `key` on `topic`, written at `since_s` or later (record time), that `match` accepts.

    For a writer taking over from one that may have died between publishing an event and recording that it
    did: it reads only the key's partition, from the first offset at that time to the end offset taken when it
    begins, through an assigned consumer (no group, no offsets left behind). TimeoutError when it could not
    read that far in `timeout_s`: the answer is then unknown, not "absent".
    """
    consumer = AIOKafkaConsumer(**kafka_client_options(settings), enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer.topics()  # the cluster's metadata
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return None
        tp = TopicPartition(topic, partition_of(key, len(partitions)))
        key_bytes = key.encode()
        consumer.assign([tp])
        start = (await consumer.offsets_for_times({tp: max(0, int(since_s * 1000))})).get(tp)
        # No record that late: Kafka answers None, Tansu 0.6 an offset with timestamp -1.
        if start is None or start.timestamp < 0:
            return None
        end = (await consumer.end_offsets([tp]))[tp]
        consumer.seek(tp, start.offset)
        deadline = time.monotonic() + timeout_s
        while await consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}[{tp.partition}] not read to offset {end} in {timeout_s} s")
            for record in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                if record.offset >= end or record.key != key_bytes:
                    continue
                with contextlib.suppress(EnvelopeError):
                    for message in decode_events(list(record.headers), record.value):
                        if match(message):
                            return message
        return None
    finally:
        await consumer.stop()


ActionEvent = TypeVar("ActionEvent", events_pb2.ActionResult, events_pb2.ValidationVerdict)


async def find_action_event(
    settings: Settings, topic: str, key: str, kind: type[ActionEvent], action_id: str, written_at: float
) -> ActionEvent | None:
    """The `kind` event about `action_id` on `topic`, as another replica would have written it at about
    `written_at` (that replica's clock: `CLOCK_SLACK_S` earlier is read too). Raises as `find_event` does."""

    def about_it(message: Message) -> bool:
        return isinstance(message, kind) and message.action_id == action_id

    found = await find_event(settings, topic, key, written_at - CLOCK_SLACK_S, about_it)
    return found if isinstance(found, kind) else None


class PartitionFollower:
    """Base for a consumer's rebalance handlers whose per-target state follows `topic`'s partitions.

    `consumer` is set once the consumer is built (it takes the handler's callbacks); the partition
    count is read from it at each move, since a topic may gain partitions.
    """

    def __init__(self, topic: str) -> None:
        self._topic = topic
        self.consumer: EventConsumer | None = None

    def keys_in(self, partitions: set[int]) -> Callable[[str], bool]:
        """Whether a target key falls in one of `partitions`."""
        count = (self.consumer.partition_count(self._topic) if self.consumer is not None else None) or 1
        return lambda key: partition_of(key, count) in partitions

    def partition_counter(self) -> Callable[[str], int]:
        count = (self.consumer.partition_count(self._topic) if self.consumer is not None else None) or 1
        return lambda key: partition_of(key, count)


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
        key = format_target_key(meta.target)
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
        partition = partition_of(key, count)
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
    # Read again after an assignment to rebuild state (a forecast window): observe it, act on nothing.
    replay: bool = False

    @property
    def event_type(self) -> str:
        return self.message.DESCRIPTOR.full_name


Handler = Callable[[ReceivedEvent], Awaitable[None]]
PartitionsChanged = Callable[[set[TopicPartition]], Awaitable[None]]


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
        on_assigned: PartitionsChanged | None = None,
        on_revoked: PartitionsChanged | None = None,
        replay: Mapping[str, int] | None = None,
        before_commit: Callable[[], Awaitable[None]] | None = None,
        urgent_topics: Sequence[str] = (),
        concurrent_partitions: bool = False,
    ) -> None:
        """`replay`: per topic, how many records before the committed offset a newly assigned partition
        is read again with `ReceivedEvent.replay` set (0 or absent: none). `before_commit`: awaited before
        each commit (a handler that only enqueued what it produces waits for delivery there); when it
        raises, nothing is committed and the consumer goes back to its committed offsets. `urgent_topics`
        (among `topics`): their fetched records are handled before any other, in every round, and between
        slices of URGENT_SLICE_RECORDS of the others. `concurrent_partitions`: each partition's records are
        handled by a task of its own (in order), side by side, and the consumer fetches on for the partitions
        not busy, for a handler that mostly waits on others: one partition's slow record holds only the records
        behind it, not every other partition's."""
        self._settings = settings
        self._topics = list(topics)
        self._urgent_topics = frozenset(urgent_topics) & set(self._topics)
        if concurrent_partitions and self._urgent_topics:
            # Urgent records are handled between the others' slices: side by side, two partitions would take
            # an urgent partition's records at once, out of order.
            raise ValueError("a consumer with urgent topics handles its partitions one at a time")
        self._handler = handler
        self._dlq = dead_letters
        self._dlq_topic = Topics(settings.topic_prefix).deadletter
        self._coalesce = coalesce
        self._retry_backoff_s = retry_backoff_s
        self._concurrent_partitions = concurrent_partitions
        self._group_id = group_id
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._before_commit = before_commit
        self._replay = dict(replay or {})
        # Per partition: records below this offset are replayed state, not work (set on assignment).
        self._replay_until: dict[TopicPartition, int] = {}
        self._commit_interval_s = settings.consumer_commit_interval_ms / 1000.0
        # Handled and not yet committed: next offset per partition, and when the last commit went out.
        self._uncommitted: dict[TopicPartition, int] = {}
        self._last_commit = time.monotonic()
        self._handling = asyncio.Lock()
        # concurrent_partitions: each partition's records in hand, handled by a task of its own.
        self._in_flight: dict[TopicPartition, asyncio.Task[bool]] = {}
        self._consumer = AIOKafkaConsumer(
            **kafka_client_options(settings),
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=settings.consumer_max_batch,
            # With an urgent lane, what needs the short wait has a reader of its own (below). Tansu answers an
            # empty fetch only when its wait ends, so every replica's idle fetches cost CPU in proportion.
            fetch_max_wait_ms=settings.consumer_calm_fetch_max_wait_ms
            if self._urgent_topics
            else settings.consumer_fetch_max_wait_ms,
            # Tansu starts a group quickly; the default 3 s join delay would dominate tests.
            session_timeout_ms=settings.consumer_session_timeout_ms,
            heartbeat_interval_ms=min(1_000, settings.consumer_session_timeout_ms // 3),
            # Partition p of every topic to one member: a replica owns a target on all the topics it reads.
            partition_assignment_strategy=(RangePartitionAssignor,),
        )
        self._consumer.subscribe(self._topics, listener=_Listener(self))
        # The urgent topics' partitions this member owns are read by a consumer of their own (no group: the
        # group consumer keeps them, paused, for ownership and commits). Its fetches carry only them: fetched
        # with the calm topics, an urgent record waited for the group consumer's next fetch, which aiokafka holds
        # back while fetched calm records are still unread, up to a second behind a backlog here.
        self._urgent_reader: AIOKafkaConsumer | None = (
            AIOKafkaConsumer(
                **kafka_client_options(settings),
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_poll_records=settings.consumer_max_batch,
                fetch_max_wait_ms=settings.consumer_fetch_max_wait_ms,
            )
            if self._urgent_topics
            else None
        )
        self._started = False
        self._metric_children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # Per partition: the write time (ms) of the record the consumer stopped at: the last one of
        # a handled batch, or the one a handler failed on. Set per batch: lag is exported between them.
        self._reached_ms: dict[TopicPartition, int] = {}
        self.stats = ConsumerStats()

    async def start(self) -> None:
        if not self._started:
            if self._urgent_reader is not None:
                await self._urgent_reader.start()
            await self._consumer.start()
            self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await self._flush_commits()
            with contextlib.suppress(KafkaError):
                await self._consumer.stop()
            if self._urgent_reader is not None:
                with contextlib.suppress(KafkaError):
                    await self._urgent_reader.stop()

    def assignment(self) -> set[TopicPartition]:
        """The partitions this member owns now."""
        return set(self._consumer.assignment())

    def partition_count(self, topic: str) -> int | None:
        parts = self._consumer.partitions_for_topic(topic)
        return len(parts) if parts else None

    def owned_partitions(self, topic: str) -> set[int]:
        return {tp.partition for tp in self._consumer.assignment() if tp.topic == topic}

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
        max_batch = self._settings.consumer_max_batch
        try:
            while not stop.is_set():
                # getmany returns buffered records without yielding: let the fetchers (and the rest of the service)
                # run between rounds, or urgent records would wait until the buffers ran dry.
                await asyncio.sleep(0)
                if self._concurrent_partitions:
                    await self._partitions_round(max_batch)
                else:
                    await self._handle_batches(await self._next_batches(max_batch))
                await self._export_lag()
        except BaseException:
            # Cancelled, or failed: the partitions' tasks go with it, as handlers awaited in place would.
            for task in self._in_flight.values():
                task.cancel()
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
            self._in_flight.clear()
            raise
        await self._finish_in_flight()
        async with self._handling:
            await self._flush_commits()

    async def _partitions_round(self, max_batch: int) -> None:
        """concurrent_partitions: start a task for each partition fetched, and fetch on for the partitions whose
        records are all handled while the others' tasks run: one partition's slow record (an engine that does
        not answer) holds only the records behind it, not the next fetch of every other partition."""
        owned = self._consumer.assignment()
        idle = [tp for tp in owned if tp not in self._in_flight]
        waits: list[asyncio.Future[Any]] = list(self._in_flight.values())
        fetch: asyncio.Future[Fetched] | None = None
        if idle or not owned:
            # Only the idle partitions: records fetched meanwhile for a busy one wait in aiokafka's buffer.
            fetch = asyncio.ensure_future(self._consumer.getmany(*idle, timeout_ms=200, max_records=max_batch))
            waits.append(fetch)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        fetched: Fetched = {}
        if fetch is not None:
            if fetch.done():
                fetched = fetch.result()
            else:
                # A getmany cancelled while it waits has taken no records (it takes them in the step that returns).
                fetch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fetch
        owned = self._consumer.assignment()
        for tp, records in fetched.items():
            if tp in owned and tp not in self._in_flight:  # else fetched before a revocation: read again elsewhere
                self._in_flight[tp] = asyncio.create_task(self._handle_partition(tp, records))
        failures = self._reap_in_flight()
        if failures:
            # Every other partition's work runs to its end before the error goes up: none is cut off half-applied.
            await self._finish_in_flight()
            raise failures[0]
        if time.monotonic() - self._last_commit >= self._commit_interval_s:
            async with self._handling:
                await self._flush_commits()

    def _reap_in_flight(self, only: set[TopicPartition] | None = None) -> list[BaseException]:
        """Forget the partition tasks that ended; the errors they raised."""
        failures: list[BaseException] = []
        for tp, task in list(self._in_flight.items()):
            if task.done() and (only is None or tp in only):
                del self._in_flight[tp]
                error = None if task.cancelled() else task.exception()
                if error is not None:
                    failures.append(error)
        return failures

    async def _finish_in_flight(self, only: set[TopicPartition] | None = None, timeout_s: float | None = None) -> bool:
        """Wait for the partition tasks in hand (on `only`, or all); False when some did not end in `timeout_s`."""
        tasks = [task for tp, task in self._in_flight.items() if only is None or tp in only]
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for failure in self._reap_in_flight(only):
            log.error("partition handling failed while finishing", exc_info=failure)
        return not pending

    async def _handle_batches(self, batches: Fetched) -> None:
        async with self._handling:
            owned = self._consumer.assignment()
            ordered = sorted(batches.items(), key=lambda item: item[0].topic not in self._urgent_topics)
            work = [
                (tp, records, self._between_slices_of(tp))
                for tp, records in ordered
                if tp in owned  # fetched before a revocation: the new owner reads these again
            ]
            if self._concurrent_partitions:
                # Every partition's work runs to its end before an error goes up: none is cut off half-applied.
                outcomes = await asyncio.gather(*(self._handle_partition(*w) for w in work), return_exceptions=True)
                for outcome in outcomes:
                    if isinstance(outcome, BaseException):
                        raise outcome
            else:
                for w in work:
                    await self._handle_partition(*w)
            if time.monotonic() - self._last_commit >= self._commit_interval_s:
                await self._flush_commits()

    def _between_slices_of(self, tp: TopicPartition) -> Callable[[], Awaitable[None]] | None:
        """What a calm partition's handling awaits between slices: the urgent records fetched meanwhile."""
        if not self._urgent_topics or tp.topic in self._urgent_topics:
            return None
        return self._handle_urgent_fetched

    async def _next_batches(self, max_batch: int) -> Fetched:
        """The urgent records fetched, if any; else whichever of the two consumers has records first."""
        reader = self._urgent_reader
        if reader is None or not reader.assignment():
            fetched: Fetched = await self._consumer.getmany(timeout_ms=200, max_records=max_batch)
            return fetched
        urgent: Fetched = await reader.getmany(timeout_ms=0, max_records=max_batch)
        if urgent:
            # With what the group consumer has fetched already (handled after them): a steady stream of urgent
            # records must not starve the rest.
            fetched = await self._consumer.getmany(timeout_ms=0, max_records=max_batch)
            return {**urgent, **fetched}
        # Both wait: an urgent record must not sit out a quiet calm lane's 200 ms. A getmany cancelled while it
        # waits has taken no records (it takes them in the step that returns).
        waits = [
            asyncio.ensure_future(reader.getmany(timeout_ms=200, max_records=max_batch)),
            asyncio.ensure_future(self._consumer.getmany(timeout_ms=200, max_records=max_batch)),
        ]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        out: Fetched = {}
        for wait in waits:
            if wait.done():
                out.update(wait.result())
            else:
                wait.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await wait
        return out

    async def _handle_urgent_fetched(self) -> None:
        """Between two slices of other records: let the loop run, then handle the urgent records it fetched."""
        for _ in range(LOOP_TURNS_BETWEEN_SLICES):
            await asyncio.sleep(0)
        reader = self._urgent_reader
        if reader is None or not reader.assignment():
            return
        fetched = await reader.getmany(timeout_ms=0, max_records=self._settings.consumer_max_batch)
        owned = self._consumer.assignment()
        for tp, records in fetched.items():
            if tp in owned:
                await self._handle_partition(tp, records)

    def _reader_of(self, tp: TopicPartition) -> AIOKafkaConsumer:
        """The consumer that fetches `tp`: the urgent reader for an urgent topic's partition, else the group's."""
        if self._urgent_reader is not None and tp.topic in self._urgent_topics:
            return self._urgent_reader
        return self._consumer

    async def _rewind_to_committed(self, tps: Sequence[TopicPartition]) -> None:
        for tp in tps:
            committed = await self._consumer.committed(tp)
            reader = self._reader_of(tp)
            if committed is None:
                await reader.seek_to_beginning(tp)
            else:
                reader.seek(tp, committed)

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        """Finish the batch in hand (or give up on it after REVOKE_WAIT_S), commit what was handled."""
        if self._concurrent_partitions:
            if not await self._finish_in_flight(revoked, REVOKE_WAIT_S):
                log.warning("revocation: a partition's records did not finish in %.0f s; abandoned", REVOKE_WAIT_S)
            async with self._handling:
                await self._flush_commits(revoked)
        else:
            await self._finish_batch_in_hand(revoked)
        for tp in revoked:
            self._uncommitted.pop(tp, None)
            self._replay_until.pop(tp, None)
        if self._urgent_reader is not None:
            self._urgent_reader.assign([tp for tp in self._urgent_reader.assignment() if tp not in revoked])
        if self._on_revoked is not None:
            await self._on_revoked(revoked)

    async def _finish_batch_in_hand(self, revoked: set[TopicPartition]) -> None:
        try:
            await asyncio.wait_for(self._handling.acquire(), REVOKE_WAIT_S)
        except TimeoutError:
            log.warning("revocation: the batch in hand did not finish in %.0f s; abandoned", REVOKE_WAIT_S)
            await self._flush_commits(revoked)
        else:
            try:
                await self._flush_commits(revoked)
            finally:
                self._handling.release()

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        if self._on_assigned is not None:
            await self._on_assigned(assigned)
        if self._urgent_reader is not None:
            urgent = [tp for tp in self._consumer.assignment() if tp.topic in self._urgent_topics]
            self._consumer.pause(*urgent)
            self._urgent_reader.assign(urgent)
            await self._rewind_to_committed(urgent)
        for tp in assigned:
            depth = self._replay.get(tp.topic, 0)
            if depth <= 0:
                continue
            committed = await self._consumer.committed(tp)
            if committed:
                self._replay_until[tp] = committed
                self._reader_of(tp).seek(tp, max(0, committed - depth))

    async def _handle_partition(
        self,
        tp: TopicPartition,
        records: list[ConsumerRecord[bytes, bytes]],
        between_slices: Callable[[], Awaitable[None]] | None = None,
    ) -> bool:
        """Handle `records` of `tp` in order; False when the handler failed on one (the consumer seeks back to it).

        `between_slices` is awaited every URGENT_SLICE_RECORDS records decoded and events handled: the whole
        list is still coalesced as one (a target's samples fold across it), but the loop is not held for all of it.
        The check is inline, not a coroutine: this is every consumer's per-record path.
        """
        decoded: list[tuple[ConsumerRecord[bytes, bytes], Message]] = []
        replay_until = self._replay_until.get(tp)
        for index, record in enumerate(records):
            if between_slices is not None and index and index % URGENT_SLICE_RECORDS == 0:
                await between_slices()
            if replay_until is not None and record.offset < replay_until:
                # Dead-lettered already by the previous owner, if it was bad: read it quietly.
                with contextlib.suppress(EnvelopeError):
                    decoded.extend((record, m) for m in decode_events(list(record.headers), record.value))
                continue
            messages = await self._decode_or_dead_letter(record)
            if messages is not None:
                decoded.extend((record, message) for message in messages)
        if replay_until is not None:
            if records[-1].offset + 1 >= replay_until:
                del self._replay_until[tp]
            # State only, every sample (no coalescing): the previous owner handled and committed these.
            for record, message in decoded:
                if record.offset < replay_until:
                    with contextlib.suppress(Exception):
                        await self._handler(self._received(record, message, replay=True))
            decoded = [(r, m) for r, m in decoded if r.offset >= replay_until]
        for index, (record, message, folded) in enumerate(self._coalesced(decoded)):
            if between_slices is not None and index and index % URGENT_SLICE_RECORDS == 0:
                await between_slices()
            event = self._received(
                record, message, coalesced=folded, record_key=record.key or b"", record_value=record.value or b""
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
                self._uncommitted[tp] = record.offset
                await self._flush_commits({tp})
                self._reader_of(tp).seek(tp, record.offset)
                await asyncio.sleep(self._retry_backoff_s)
                return False
        if records:
            self._reached_ms[tp] = records[-1].timestamp
            self._uncommitted[tp] = records[-1].offset + 1
        return True

    @staticmethod
    def _received(record: ConsumerRecord[bytes, bytes], message: Message, **extra: Any) -> ReceivedEvent:
        return ReceivedEvent(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=(record.key or b"").decode(errors="replace"),
            message=message,
            headers=tuple(record.headers),
            **extra,
        )

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

    async def _flush_commits(self, only: set[TopicPartition] | None = None) -> None:
        """Commit what was handled (on `only`, or every partition)."""
        offsets = {tp: o for tp, o in self._uncommitted.items() if only is None or tp in only}
        self._last_commit = time.monotonic()
        if not offsets:
            return
        if self._before_commit is not None:
            try:
                await self._before_commit()
            except Exception:
                # What the handled records produced may not have reached the broker: handle them again.
                log.exception("delivery before commit failed; %d partition(s) go back to their commits", len(offsets))
                for tp in offsets:
                    self._uncommitted.pop(tp, None)
                with contextlib.suppress(KafkaError, AssertionError):
                    await self._rewind_to_committed([tp for tp in offsets if tp in self._consumer.assignment()])
                return
        try:
            await self._consumer.commit(offsets)
        except KafkaError as error:
            # The group moved on (a rebalance): the new owner reads these records again; handlers are idempotent.
            log.warning("commit of %d partition(s) refused (%s); redelivered elsewhere", len(offsets), error)
        for tp, offset in offsets.items():
            if self._uncommitted.get(tp) == offset:
                del self._uncommitted[tp]

    async def _export_lag(self) -> None:
        partitions = []
        for tp in self._consumer.assignment():
            reader = self._reader_of(tp)
            if tp not in reader.assignment():
                continue
            highwater = reader.highwater(tp)
            if highwater is None:
                continue
            position = await reader.position(tp)
            partitions.append(PartitionLag(tp.topic, max(0, highwater - position), self._reached_ms.get(tp)))
        for topic, (records, seconds) in lag_by_topic(partitions, time.time()).items():
            metrics.CONSUMER_LAG.labels(topic=topic, group=self._group_id).set(records)
            metrics.CONSUMER_LAG_SECONDS.labels(topic=topic, group=self._group_id).set(seconds)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, consumer: EventConsumer) -> None:
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._consumer._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._consumer._assigned(set(assigned))
