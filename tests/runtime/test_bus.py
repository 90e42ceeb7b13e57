"""The event bus against a real Tansu broker: envelopes, dead letters, coalescing, at-least-once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from google.protobuf.message import Message
from prometheus_client import REGISTRY

from sits.runtime.bus import (
    DeadLetter,
    EventConsumer,
    EventProducer,
    PartitionLag,
    ReceivedEvent,
    ensure_topics,
    find_event,
    lag_by_topic,
    partition_of,
)
from sits.runtime.contract import format_target_key
from sits.runtime.events import (
    DLQ_REASON_HEADER,
    EnvelopeError,
    Topics,
    cloudevent_headers,
    decode_event,
    decode_events,
    metric_batch,
    new_meta,
)
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.settings import Settings
from sits.runtime.signing import KEY_ID_HEADER, SIGNATURE_HEADER, Signer, new_key
from sits.v1 import common_pb2, events_pb2
from tests.waiting import eventually

TARGET = common_pb2.Target(host="h", gpu_uuid="GPU-1", engine="vllm-0")


def sample(seq: int, engine: str = "vllm-0", used: int = 1 << 30) -> events_pb2.MetricSample:
    target = common_pb2.Target(host="h", gpu_uuid="GPU-1", engine=engine)
    msg = events_pb2.MetricSample(meta=new_meta("test", target, time.time()), sequence=seq)
    msg.gpu.used_bytes = used
    msg.gpu.total_bytes = 80 << 30
    return msg


async def read_all(settings: Settings, topic: str, expected: int, timeout_s: float = 10.0) -> list:
    """Read a topic from the start with manual assignment until `expected` records arrive."""
    consumer = AIOKafkaConsumer(**kafka_options_for(settings.kafka_bootstrap), enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(settings.kafka_partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        out: list = []
        deadline = time.monotonic() + timeout_s
        while len(out) < expected and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                out.extend(records)
        return out
    finally:
        await consumer.stop()


async def consume_until(consumer: EventConsumer, done: asyncio.Event, timeout_s: float = 15.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


def test_envelope_round_trip() -> None:
    msg = sample(7)
    headers = cloudevent_headers(msg)
    names = {k for k, _ in headers}
    assert {"ce_id", "ce_type", "ce_source", "ce_specversion", "content-type"} <= names
    decoded = decode_event(headers, msg.SerializeToString())
    assert decoded == msg


async def test_published_record_is_keyed_by_target_with_cloudevents_headers(settings: Settings, topics: Topics) -> None:
    await ensure_topics(settings)
    async with EventProducer(settings) as producer:
        msg = sample(1)
        await producer.publish(topics.metrics, msg)
    (record,) = await read_all(settings, topics.metrics, 1)
    headers = dict(record.headers)
    assert record.key == b"h/GPU-1//vllm-0"
    assert headers["ce_type"] == b"sits.v1.MetricSample"
    assert headers["ce_id"] == msg.meta.event_id.encode()
    assert headers["ce_specversion"] == b"1.0"
    assert headers["content-type"] == b"application/protobuf"


async def test_bad_records_go_to_dead_letters_and_consumption_continues(settings: Settings, topics: Topics) -> None:
    await ensure_topics(settings)
    good = sample(1)
    good_headers = cloudevent_headers(good)
    raw = AIOKafkaProducer(**kafka_options_for(settings.kafka_bootstrap))
    await raw.start()
    try:
        key = b"h/GPU-1//vllm-0"
        await raw.send_and_wait(topics.metrics, b"\xff\x00garbage\x01", key=key, headers=good_headers)
        unknown = [(k, b"sits.v1.NoSuchEvent" if k == "ce_type" else v) for k, v in good_headers]
        await raw.send_and_wait(topics.metrics, good.SerializeToString(), key=key, headers=unknown)
        bad_trace = [*good_headers, ("traceparent", b"00-not-a-trace-01")]
        await raw.send_and_wait(topics.metrics, good.SerializeToString(), key=key, headers=bad_trace)
        await raw.send_and_wait(topics.oom, b"", key=key, headers=[])
    finally:
        await raw.stop()

    handled: list[ReceivedEvent] = []
    done = asyncio.Event()

    async def handle(event: ReceivedEvent) -> None:
        handled.append(event)
        done.set()

    async with EventProducer(settings) as producer:
        # The good record is published after the bad ones: reaching it proves consumption went on.
        await producer.publish(topics.metrics, good)
        consumer = EventConsumer(
            settings,
            group_id=f"{topics.prefix}g",
            topics=[topics.metrics, topics.oom],
            handler=handle,
            dead_letters=producer,
        )
        async with consumer:
            stop = asyncio.Event()
            task = asyncio.create_task(consumer.run(stop))
            assert await eventually(lambda: consumer.stats.dead_lettered >= 4 and done.is_set(), timeout_s=20)
            stop.set()
            await asyncio.wait_for(task, 5)

    assert [e.message for e in handled] == [good]
    letters = await read_all(settings, topics.deadletter, 4)
    reasons = sorted(dict(r.headers)[DLQ_REASON_HEADER].decode() for r in letters)
    assert len(reasons) == 4
    assert any("not a valid sits.v1.MetricSample" in r for r in reasons)
    assert any("unknown ce_type 'sits.v1.NoSuchEvent'" in r for r in reasons)
    assert any("malformed traceparent" in r for r in reasons)
    assert any("ce_specversion" in r for r in reasons)
    assert all(dict(r.headers)["sits_dlq_topic"] in (topics.metrics.encode(), topics.oom.encode()) for r in letters)


def test_a_batch_decodes_into_its_samples_and_a_foreign_sample_refuses_it() -> None:
    samples = [sample(seq) for seq in range(3)]
    batch = metric_batch(samples, "test")
    assert batch.meta.target == samples[0].meta.target
    assert decode_events(cloudevent_headers(batch), batch.SerializeToString()) == samples
    mixed = metric_batch([*samples, sample(3, engine="other")], "test")
    with pytest.raises(EnvelopeError, match="sample 3 is for 'h/GPU-1//other', the batch for 'h/GPU-1//vllm-0'"):
        decode_events(cloudevent_headers(mixed), mixed.SerializeToString())


async def test_batch_records_reach_the_handler_as_samples_in_order(settings: Settings, topics: Topics) -> None:
    await ensure_topics(settings)
    first = metric_batch([sample(seq) for seq in range(5)], "test")
    mixed = metric_batch([sample(5), sample(6, engine="other")], "test")
    handled: list[int] = []
    done = asyncio.Event()

    async def handle(event: ReceivedEvent) -> None:
        assert isinstance(event.message, events_pb2.MetricSample)
        handled.append(event.message.sequence)
        if event.message.sequence == 7:
            done.set()

    async with EventProducer(settings) as producer:
        for message in (first, mixed, sample(7)):
            await producer.publish(topics.metrics, message)
        consumer = EventConsumer(
            settings,
            group_id=f"{topics.prefix}g",
            topics=[topics.metrics],
            handler=handle,
            dead_letters=producer,
            coalesce=False,
        )
        async with consumer:
            await consume_until(consumer, done)
    assert handled == [0, 1, 2, 3, 4, 7]
    assert consumer.stats.dead_lettered == 1
    (letter,) = await read_all(settings, topics.deadletter, 1)
    assert b"MetricBatch sample 1 is for 'h/GPU-1//other'" in dict(letter.headers)[DLQ_REASON_HEADER]


@pytest.mark.parametrize("with_urgent_lane", [False, True], ids=["one-lane", "urgent-lane"])
async def test_lagging_consumer_coalesces_samples_per_target(
    settings: Settings, topics: Topics, with_urgent_lane: bool
) -> None:
    # With urgent topics, the rest are handled in slices (URGENT_SLICE_RECORDS) but still coalesced as one batch.
    await ensure_topics(settings)
    async with EventProducer(settings) as producer:
        futures = []
        for seq in range(200):
            for engine in ("a", "b"):
                futures.append(await producer.enqueue(topics.metrics, sample(seq, engine=engine)))
        oom = events_pb2.OomEvent(meta=new_meta("test", TARGET, time.time()), requested_bytes=1)
        futures.append(await producer.enqueue(topics.oom, oom))
        await asyncio.gather(*futures)

        latest: dict[str, int] = {}
        seen_oom = asyncio.Event()
        done = asyncio.Event()

        async def handle(event: ReceivedEvent) -> None:
            if isinstance(event.message, events_pb2.OomEvent):
                seen_oom.set()
            else:
                engine = event.message.meta.target.engine
                assert event.message.sequence > latest.get(engine, -1), "samples of one target stay in order"
                latest[engine] = event.message.sequence
            if latest.get("a") == 199 and latest.get("b") == 199 and seen_oom.is_set():
                done.set()

        consumer = EventConsumer(
            settings,
            group_id=f"{topics.prefix}g",
            topics=[*topics.samples, topics.oom] if with_urgent_lane else [topics.metrics, topics.oom],
            handler=handle,
            dead_letters=producer,
            urgent_topics=topics.urgent if with_urgent_lane else (),
        )
        async with consumer:
            await consume_until(consumer, done)
    # 401 records arrived while nobody consumed: far fewer handler calls than samples, none lost at the end.
    assert consumer.stats.coalesced > 0
    assert consumer.stats.handled + consumer.stats.coalesced == 401
    assert consumer.stats.handled < 100


async def urgent_record_wait(
    settings: Settings, topics: Topics, urgent_topics: list[str], max_batch: int = 200
) -> tuple[int, int]:
    """Calm samples handled between the moment a sample under pressure is published (the consumer holding a
    backlog of calm ones) and the moment it is handled; and how many calm samples there were."""
    backlog = 12_000
    settings = settings.model_copy(update={"consumer_max_batch": max_batch})
    async with EventProducer(settings) as producer:
        # One target per sample: none coalesce, so every calm record costs a handler call.
        futures = [
            await producer.enqueue(topics.metrics, sample(i, engine=f"e{i}"), traced=False) for i in range(backlog)
        ]
        await asyncio.gather(*futures)
        calm = 0
        published_at: list[int] = []
        handled_at: list[int] = []
        done = asyncio.Event()

        async def handle(event: ReceivedEvent) -> None:
            nonlocal calm
            if event.topic == topics.metrics_urgent:
                handled_at.append(calm)
                done.set()
                return
            calm += 1
            busy_until = time.perf_counter() + 0.0002  # the CPU a decision spends on a sample, loop blocked
            while time.perf_counter() < busy_until:
                pass
            if calm == 500:
                published_at.append(calm)
                await producer.enqueue(topics.metrics_urgent, sample(1, engine="hot", used=79 << 30), traced=False)

        consumer = EventConsumer(
            settings,
            group_id=f"{topics.prefix}g{len(urgent_topics)}",
            topics=topics.samples,
            handler=handle,
            dead_letters=producer,
            urgent_topics=urgent_topics,
        )
        async with consumer:
            await consume_until(consumer, done, timeout_s=60)
    return handled_at[0] - published_at[0], backlog


async def test_an_urgent_record_is_handled_before_the_backlog_already_fetched(
    settings: Settings, topics: Topics
) -> None:
    await ensure_topics(settings)
    waited, backlog = await urgent_record_wait(settings, topics, topics.urgent)
    # The consumer holds most of the backlog in its fetch buffers when the sample arrives; without the urgent
    # lane it is handled after all of them (checked below). With it, after what the consumer handles while
    # aiokafka holds back the next fetch (its prefetch backoff, 100 ms) and the broker answers.
    assert waited < backlog // 4, (waited, backlog)


async def test_an_urgent_record_waits_a_slice_of_the_batch_in_hand_not_the_whole_batch(
    settings: Settings, topics: Topics
) -> None:
    await ensure_topics(settings)
    # The sample under pressure is published while the consumer is 500 records into a batch of 5,000: before
    # slices and the urgent reader, it was handled after the other 4,500 at least; with one loop turn between
    # slices, after 450 (its fetch took 9 slices to reach getmany); with LOOP_TURNS_BETWEEN_SLICES, after 100.
    waited, _ = await urgent_record_wait(settings, topics, topics.urgent, max_batch=5_000)
    assert waited < 300, waited


async def test_without_urgent_topics_a_record_waits_behind_the_fetched_backlog(
    settings: Settings, topics: Topics
) -> None:
    await ensure_topics(settings)
    waited, backlog = await urgent_record_wait(settings, topics, [])
    assert waited >= backlog // 4, (waited, backlog)


def engines_on_two_partitions(settings: Settings) -> tuple[str, str]:
    """Two engines of `sample`'s host whose targets the producer writes to different partitions."""
    engines = [f"e{i}" for i in range(20)]
    keys = {e: format_target_key(common_pb2.Target(host="h", gpu_uuid="GPU-1", engine=e)) for e in engines}
    first = engines[0]
    second = next(
        e
        for e in engines
        if partition_of(keys[e], settings.kafka_partitions) != partition_of(keys[first], settings.kafka_partitions)
    )
    return first, second


async def test_concurrent_partitions_are_handled_side_by_side_each_in_order(settings: Settings, topics: Topics) -> None:
    await ensure_topics(settings)
    # Two targets on different partitions, each first record waiting until the other's has started: handled
    # one partition after the other, the first would wait out its timeout.
    first, second = engines_on_two_partitions(settings)
    started = {first: asyncio.Event(), second: asyncio.Event()}
    timed_out: list[str] = []
    handled: dict[str, list[int]] = {first: [], second: []}
    failed_once = False
    done = asyncio.Event()

    async def handle(event: ReceivedEvent) -> None:
        nonlocal failed_once
        assert isinstance(event.message, events_pb2.MetricSample)
        engine, seq = event.message.meta.target.engine, event.message.sequence
        if seq == 0:
            started[engine].set()
            other = second if engine == first else first
            try:
                await asyncio.wait_for(started[other].wait(), 10)
            except TimeoutError:
                timed_out.append(engine)
        if engine == second and seq == 2 and not failed_once:
            failed_once = True
            raise RuntimeError("a failure on one partition: retried there, the other goes on")
        handled[engine].append(seq)
        if all(len(seqs) >= 4 for seqs in handled.values()):
            done.set()

    async with EventProducer(settings) as producer:
        for seq in range(4):
            for engine in (first, second):
                await producer.publish(topics.metrics, sample(seq, engine=engine))
        consumer = EventConsumer(
            settings,
            group_id=f"{topics.prefix}g",
            topics=[topics.metrics],
            handler=handle,
            dead_letters=producer,
            coalesce=False,
            retry_backoff_s=0.1,
            concurrent_partitions=True,
        )
        async with consumer:
            await consume_until(consumer, done, timeout_s=60)
    assert timed_out == []
    # Every record once, in its partition's order; the failed one again after its retry, none twice.
    assert handled == {first: [0, 1, 2, 3], second: [0, 1, 2, 3]}
    assert consumer.stats.retries == 1


async def test_a_partition_held_by_a_slow_record_does_not_hold_the_next_fetch_of_another(
    settings: Settings, topics: Topics
) -> None:
    await ensure_topics(settings)
    slow, other = engines_on_two_partitions(settings)
    release = asyncio.Event()
    handled: list[tuple[str, int]] = []
    other_seen = {0: asyncio.Event(), 1: asyncio.Event()}

    async def handle(event: ReceivedEvent) -> None:
        assert isinstance(event.message, events_pb2.MetricSample)
        engine, seq = event.message.meta.target.engine, event.message.sequence
        if engine == slow:
            # An engine that does not answer: the executor's call waits out its timeout.
            await asyncio.wait_for(release.wait(), 30)
        handled.append((engine, seq))
        if engine == other:
            other_seen[seq].set()

    async with EventProducer(settings) as producer:
        consumer = EventConsumer(
            settings,
            group_id=f"{topics.prefix}g",
            topics=[topics.metrics],
            handler=handle,
            dead_letters=producer,
            coalesce=False,
            concurrent_partitions=True,
        )
        stop = asyncio.Event()
        async with consumer:
            task = asyncio.create_task(consumer.run(stop))
            try:
                await producer.publish(topics.metrics, sample(0, engine=slow))
                await producer.publish(topics.metrics, sample(0, engine=other))
                await asyncio.wait_for(other_seen[0].wait(), 30)
                # Written after the slow record is in hand: it comes in a later fetch than the slow one's.
                await producer.publish(topics.metrics, sample(1, engine=other))
                await asyncio.wait_for(other_seen[1].wait(), 20)
                assert not release.is_set()
                assert (slow, 0) not in handled
                release.set()
                assert await eventually(lambda: (slow, 0) in handled, timeout_s=10)
            finally:
                release.set()
                stop.set()
                await asyncio.wait_for(task, 15)
    assert sorted(handled) == sorted([(other, 0), (other, 1), (slow, 0)])


async def test_a_consumer_with_urgent_topics_refuses_to_handle_partitions_side_by_side(
    settings: Settings, topics: Topics
) -> None:
    with pytest.raises(ValueError, match="one at a time"):
        EventConsumer(
            settings,
            group_id=f"{topics.prefix}g",
            topics=topics.samples,
            handler=lambda event: asyncio.sleep(0),
            dead_letters=EventProducer(settings),
            urgent_topics=topics.urgent,
            concurrent_partitions=True,
        )


async def test_consumer_killed_mid_batch_handles_every_record_once(
    settings: Settings, topics: Topics, redis_client, tmp_path: Path
) -> None:
    await ensure_topics(settings)
    total = 400
    async with EventProducer(settings) as producer:
        futures = [await producer.enqueue(topics.oom, oom_event(i)) for i in range(total)]
        await asyncio.gather(*futures)

    counter = f"{topics.prefix}applied"
    handled_list = f"{topics.prefix}handled"
    env = {
        **os.environ,
        "SITS_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "SITS_TOPIC_PREFIX": settings.topic_prefix,
        "SITS_REDIS_URL": settings.redis_url,
        "SITS_KAFKA_PARTITIONS": str(settings.kafka_partitions),
        "TEST_COUNTER_KEY": counter,
        "TEST_HANDLED_KEY": handled_list,
        "TEST_EXPECTED": str(total),
    }
    script = [sys.executable, "-m", "tests.runtime.idempotent_consumer"]
    # First run dies hard (os._exit, like kill -9) after handling half of what it sees, before any commit.
    first = await asyncio.to_thread(
        subprocess.run, script, env={**env, "TEST_CRASH_AFTER": str(total // 2)}, timeout=60, check=False
    )
    assert first.returncode == 137
    handled_first = await redis_client.llen(handled_list)
    assert handled_first == total // 2
    second = await asyncio.to_thread(subprocess.run, script, env=env, timeout=60, check=False)
    assert second.returncode == 0

    handled_ids = [x.decode() for x in await redis_client.lrange(handled_list, 0, -1)]
    # Records handled before the crash were not committed, so they come again (at-least-once) ...
    assert len(handled_ids) > total
    assert len(set(handled_ids)) == total
    # ... and the idempotent handler applied each event_id exactly once.
    assert int(await redis_client.get(counter)) == total


def oom_event(i: int) -> events_pb2.OomEvent:
    target = common_pb2.Target(host="h", gpu_uuid="GPU-1", engine=f"e{i % 3}")
    return events_pb2.OomEvent(meta=new_meta("test", target, time.time()), requested_bytes=i + 1)


def test_lag_adds_records_and_takes_the_oldest_waiting_partition() -> None:
    lag = lag_by_topic(
        [
            PartitionLag("m", records=3, reached_ms=940_000),  # 60 s behind
            PartitionLag("m", records=2, reached_ms=990_000),  # 10 s behind
            PartitionLag("m", records=0, reached_ms=100_000),  # caught up: its old record does not count
            PartitionLag("o", records=0, reached_ms=None),
            PartitionLag("c", records=4, reached_ms=None),  # nothing handled yet: no age to tell
        ],
        now_s=1000.0,
    )
    assert lag == {"m": (5, 60.0), "o": (0, 0.0), "c": (4, 0.0)}


async def test_a_stuck_consumer_reports_how_old_its_waiting_record_is(settings: Settings, topics: Topics) -> None:
    """Lag in seconds comes from the records' write times, so it reads the same however capture packs samples."""
    await ensure_topics(settings)
    stuck = sample(1)
    raw = AIOKafkaProducer(**kafka_options_for(settings.kafka_bootstrap))
    await raw.start()
    try:
        written_ms = int((time.time() - 120.0) * 1000)  # written two minutes ago
        await raw.send_and_wait(
            topics.metrics,
            stuck.SerializeToString(),
            key=b"h/GPU-1//vllm-0",
            headers=cloudevent_headers(stuck),
            timestamp_ms=written_ms,
        )
    finally:
        await raw.stop()

    async def handle(event: ReceivedEvent) -> None:
        raise RuntimeError("the handler cannot make progress")

    group = f"{topics.prefix}g"

    labels = {"topic": topics.metrics, "group": group}

    def seconds_behind() -> float:
        return REGISTRY.get_sample_value("sits_consumer_lag_seconds", labels) or 0.0

    async with EventProducer(settings) as producer:
        consumer = EventConsumer(
            settings,
            group_id=group,
            topics=[topics.metrics],
            handler=handle,
            dead_letters=producer,
            retry_backoff_s=0.05,
        )
        async with consumer:
            stop = asyncio.Event()
            task = asyncio.create_task(consumer.run(stop))
            assert await eventually(lambda: seconds_behind() >= 119.0, timeout_s=20), seconds_behind()
            stop.set()
            await asyncio.wait_for(task, 5)
    assert consumer.stats.retries >= 1
    assert REGISTRY.get_sample_value("sits_consumer_lag", labels) == 1
    assert seconds_behind() < 200.0


def test_stop_twice_is_safe(settings: Settings) -> None:
    async def go() -> None:
        producer = EventProducer(settings)
        await producer.start()
        await producer.stop()
        await producer.stop()

    with contextlib.suppress(RuntimeError):
        asyncio.get_event_loop()
    asyncio.run(go())


async def test_a_handler_refusing_a_record_dead_letters_it_as_received_and_consumption_goes_on(
    settings: Settings, topics: Topics
) -> None:
    """DeadLetter from a handler (the executor's signature gate uses it): the record goes to the dead-letter
    topic byte for byte with the reason, the next one is handled, and the refused one is committed."""
    await ensure_topics(settings)
    signer = Signer([new_key("k1")])
    refused_sample, good = sample(1), sample(2)
    command = events_pb2.HealingCommand(command_id="c1", kind=events_pb2.ACTION_KIND_FLUSH_CACHE)
    command.meta.CopyFrom(sample(3).meta)
    handled: list[int] = []

    async def handle(event: ReceivedEvent) -> None:
        if isinstance(event.message, events_pb2.MetricSample) and event.message.sequence == 1:
            raise DeadLetter("refused_for_test", "refused_for_test: the handler said no")
        handled.append(getattr(event.message, "sequence", -1))

    async with EventProducer(settings, signer=signer) as producer:
        for message in (refused_sample, command, good):
            await producer.publish(topics.metrics, message)
        for attempt in range(2):  # the second consumer of the group finds nothing left: all was committed
            consumer = EventConsumer(
                settings,
                group_id=f"{topics.prefix}g",
                topics=[topics.metrics],
                handler=handle,
                dead_letters=producer,
                coalesce=False,  # every sample reaches the handler
            )
            async with consumer:
                stop = asyncio.Event()
                task = asyncio.create_task(consumer.run(stop))
                if attempt == 0:
                    assert await eventually(lambda: len(handled) == 2, timeout_s=20)
                else:
                    await asyncio.sleep(1.0)  # a poll or two: nothing may come again
                stop.set()
                await asyncio.wait_for(task, 5)
    assert handled == [-1, 2], "the command (no sequence) and the good sample, each once"
    (letter,) = await read_all(settings, topics.deadletter, 1)
    headers = dict(letter.headers)
    assert headers[DLQ_REASON_HEADER] == b"refused_for_test: the handler said no"
    assert letter.value == refused_sample.SerializeToString()
    records = await read_all(settings, topics.metrics, 3)
    signed = [dict(r.headers) for r in records if dict(r.headers)["ce_type"] == b"sits.v1.HealingCommand"]
    unsigned = [dict(r.headers) for r in records if dict(r.headers)["ce_type"] == b"sits.v1.MetricSample"]
    assert len(signed) == 1 and KEY_ID_HEADER in signed[0] and SIGNATURE_HEADER in signed[0]
    assert all(KEY_ID_HEADER not in h for h in unsigned), "only HealingCommands are signed"


async def test_find_event_reads_one_keys_records_since_a_time(settings: Settings, topics: Topics) -> None:
    await ensure_topics(settings)
    key = format_target_key(TARGET)
    async with EventProducer(settings) as producer:
        await producer.publish(topics.metrics, sample(1))
        await producer.publish(topics.metrics, sample(2, engine="vllm-1"))  # another key
        await asyncio.sleep(0.2)
        since = time.time()
        await asyncio.sleep(0.2)
        await producer.publish(topics.metrics, sample(3))
        await producer.publish(topics.metrics, sample(4, engine="vllm-1"))

    def sequence(n: int) -> Callable[[Message], bool]:
        return lambda m: isinstance(m, events_pb2.MetricSample) and m.sequence == n

    found = await find_event(settings, topics.metrics, key, since, sequence(3))
    assert isinstance(found, events_pb2.MetricSample) and found.meta.target == TARGET
    assert await find_event(settings, topics.metrics, key, since, sequence(1)) is None, "written before `since`"
    assert await find_event(settings, topics.metrics, key, since - 60, sequence(1)) is not None
    assert await find_event(settings, topics.metrics, key, since, sequence(4)) is None, "another key's record"
    assert await find_event(settings, topics.metrics, key, time.time() + 60, sequence(3)) is None, "nothing that late"
