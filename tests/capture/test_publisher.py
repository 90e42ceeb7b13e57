"""Publishing to a real Tansu broker, spooling through an outage, draining in order."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from google.protobuf.message import Message

from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.spool import Spool
from sits.runtime.events import Topics, decode_events
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.settings import Settings
from sits.runtime.tracing import setup_tracing
from sits.v1 import events_pb2
from sits_app.stack.tansu import TansuBroker
from tests.waiting import in_background


def sample(i: int, gpu: str = "GPU-a") -> events_pb2.MetricSample:
    s = events_pb2.MetricSample(sequence=i, source_kind=events_pb2.SAMPLE_SOURCE_NVML)
    s.meta.event_id = f"s{i}"
    s.meta.target.host = "h"
    s.meta.target.gpu_uuid = gpu
    s.meta.produced_at.FromSeconds(1_700_000_000 + i)
    s.gpu.used_bytes = i
    return s


def oom(i: int) -> events_pb2.OomEvent:
    e = events_pb2.OomEvent(requested_bytes=1 << 30, device_free_bytes=1, device_total_bytes=2 << 30)
    e.meta.event_id = f"o{i}"
    e.meta.target.gpu_uuid = "GPU-a"
    e.meta.produced_at.FromSeconds(1_700_000_000 + i)
    return e


async def read_all(
    settings: Settings, topic: str, expected: int, timeout_s: float = 20.0
) -> list[tuple[bytes, list[Message]]]:
    """(key, events) per record from the start, until `expected` events are in."""
    consumer = AIOKafkaConsumer(**kafka_options_for(settings.kafka_bootstrap), enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or {0, 1})]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        out: list[tuple[bytes, list[Message]]] = []
        deadline = time.monotonic() + timeout_s
        while sum(len(events) for _k, events in out) < expected and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                out.extend((r.key or b"", decode_events(r.headers, r.value)) for r in records)
        return out
    finally:
        await consumer.stop()


def sequences_of(records: list[tuple[bytes, list[Message]]]) -> list[int]:
    return [m.sequence for _k, events in records for m in events if isinstance(m, events_pb2.MetricSample)]


def pressed_sample(i: int, gpu: str) -> events_pb2.MetricSample:
    """A sample at 95% of its GPU's memory: under pressure."""
    s = sample(i, gpu=gpu)
    s.gpu.total_bytes, s.gpu.used_bytes = 100, 95
    return s


@contextlib.asynccontextmanager
async def publishing(publisher: CapturePublisher) -> AsyncIterator[CapturePublisher]:
    """`publisher` running; stopped (and its queue flushed) on the way out."""
    async with in_background(publisher.run, 15):
        yield publisher


@pytest.fixture
async def running(settings: Settings, tmp_path: Path) -> AsyncIterator[CapturePublisher]:
    publisher = CapturePublisher(
        lambda: TopicEnsuringProducer(settings), Spool(tmp_path / "spool"), Topics(settings.topic_prefix)
    )
    async with publishing(publisher):
        yield publisher


async def wait_for(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_publishes_samples_and_ooms_keyed_by_target(
    running: CapturePublisher, settings: Settings, topics: Topics
) -> None:
    for i in range(50):
        running.submit(sample(i, gpu="GPU-a" if i % 2 else "GPU-b"))
    running.submit(oom(1))
    await wait_for(lambda: running.stats.published == 51)
    metric_records = await read_all(settings, topics.metrics, 50)
    assert sorted(sequences_of(metric_records)) == list(range(50))
    assert {k for k, _ in metric_records} == {b"h/GPU-a//", b"h/GPU-b//"}
    for key, events in metric_records:
        assert {f"h/{m.meta.target.gpu_uuid}//".encode() for m in events} == {key}
    oom_records = await read_all(settings, topics.oom, 1)
    assert [m.meta.event_id for m in oom_records[0][1]] == ["o1"]
    assert running.spool.pending == 0


async def test_queued_samples_of_a_target_share_records_in_order(
    running: CapturePublisher, settings: Settings, topics: Topics
) -> None:
    # Submitted without yielding to the loop: the publisher finds all of them queued at once.
    for i in range(1200):
        running.submit(sample(i))
    await wait_for(lambda: running.stats.published == 1200)
    records = await read_all(settings, topics.metrics, 1200)
    assert [len(events) for _k, events in records] == [512, 512, 176]
    assert sequences_of(records) == list(range(1200))


def pressure_mix(publisher: CapturePublisher) -> None:
    """Three samples of a calm GPU, three of a GPU whose second sample is above the 80% threshold."""
    for i in range(3):
        calm = sample(i, gpu="GPU-calm")
        calm.gpu.total_bytes = 100
        pressed = sample(10 + i, gpu="GPU-pressed")
        pressed.gpu.total_bytes = 100
        pressed.gpu.used_bytes = 95 if i == 1 else 50
        publisher.submit(calm)
        publisher.submit(pressed)


async def test_samples_under_pressure_take_the_urgent_lane_traced(
    running: CapturePublisher, settings: Settings, topics: Topics
) -> None:
    setup_tracing("sits-tests")  # a recording provider: otherwise no span context reaches the headers
    pressure_mix(running)
    await wait_for(lambda: running.stats.published == 6)
    urgent = await read_all(settings, topics.metrics_urgent, 1)
    assert [(key, [m.sequence for m in events]) for key, events in urgent] == [(b"h/GPU-pressed//", [11])]
    calm = await read_all(settings, topics.metrics, 5)
    assert sorted(sequences_of(calm)) == [0, 1, 2, 10, 12]


async def test_urgent_events_go_before_the_calm_samples_queued_ahead_of_them(
    settings: Settings, topics: Topics, tmp_path: Path
) -> None:
    order: list[str] = []

    class Recording(TopicEnsuringProducer):
        async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]:
            order.append(topic)
            return await super().enqueue(topic, message, traced=traced)

    publisher = CapturePublisher(lambda: Recording(settings), Spool(tmp_path / "spool"), topics)
    # Queued before the publisher runs: 5,000 calm samples of 50 GPUs (a publisher behind), then an OOM and a
    # sample under pressure.
    for i in range(5000):
        publisher.submit(sample(i, gpu=f"GPU-{i % 50}"))
    publisher.submit(oom(1))
    publisher.submit(pressed_sample(5000, gpu="GPU-hot"))
    async with publishing(publisher):
        await wait_for(lambda: publisher.stats.published == 5002)
    assert sorted(order[:2]) == sorted([topics.oom, topics.metrics_urgent]), order[:3]
    assert set(order[2:]) == {topics.metrics}


async def test_a_steady_stream_of_urgent_samples_does_not_starve_the_calm_ones(
    settings: Settings, topics: Topics, tmp_path: Path
) -> None:
    order: list[str] = []
    publishers: list[CapturePublisher] = []

    class Recording(TopicEnsuringProducer):
        async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]:
            order.append(topic)
            if topic == topics.metrics_urgent and len(order) < 200:
                # Each one sent brings the next: the urgent queue is never empty when the publisher looks (a
                # simulated fleet's publisher, hundreds of GPUs under pressure).
                publishers[0].submit(pressed_sample(10_000 + len(order), gpu="GPU-hot"))
            return await super().enqueue(topic, message, traced=traced)

    publisher = CapturePublisher(lambda: Recording(settings), Spool(tmp_path / "spool"), topics)
    publishers.append(publisher)
    for i in range(10):
        publisher.submit(sample(i))
    publisher.submit(pressed_sample(5000, gpu="GPU-hot"))
    async with publishing(publisher):
        await wait_for(lambda: topics.metrics in order)
    # The calm samples went out right after the first urgent batch, while the stream still flowed.
    assert order.index(topics.metrics) < 5, order[:10]
    assert order[0] == topics.metrics_urgent


async def test_a_batch_is_traced_when_one_of_its_samples_is_under_pressure(
    settings: Settings, topics: Topics, tmp_path: Path
) -> None:
    # Every sample on one topic (SITS_CAPTURE_URGENT_LANE=false): the pressed sample shares its target's record.
    setup_tracing("sits-tests")
    one_lane = CapturePublisher(
        lambda: TopicEnsuringProducer(settings), Spool(tmp_path / "spool"), topics, urgent_lane=False
    )
    async with publishing(one_lane):
        pressure_mix(one_lane)
        await wait_for(lambda: one_lane.stats.published == 6)
    consumer = AIOKafkaConsumer(**kafka_options_for(settings.kafka_bootstrap), enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topics.metrics, p) for p in consumer.partitions_for_topic(topics.metrics) or {0}]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        traced: dict[bytes, bool] = {}
        deadline = time.monotonic() + 20
        while len(traced) < 2 and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for r in records:
                    assert r.key is not None and dict(r.headers)["ce_type"] == b"sits.v1.MetricBatch"
                    traced[r.key] = "traceparent" in dict(r.headers)
    finally:
        await consumer.stop()
    assert traced == {b"h/GPU-calm//": False, b"h/GPU-pressed//": True}


async def test_calm_samples_linger_to_share_records_and_pressure_ends_the_wait(
    settings: Settings, topics: Topics, tmp_path: Path
) -> None:
    # A linger far longer than the test: only what must go now can end it.
    publisher = CapturePublisher(
        lambda: TopicEnsuringProducer(settings), Spool(tmp_path / "spool"), Topics(settings.topic_prefix), linger_s=600
    )
    async with publishing(publisher):
        for i in range(6):
            publisher.submit(sample(i, gpu="GPU-a" if i % 2 else "GPU-b"))
            await asyncio.sleep(0.05)  # apart in time: without a linger each would be a record of its own
        await asyncio.sleep(1.0)
        assert publisher.stats.published == 0 and publisher.queued == 6
        publisher.submit(pressed_sample(6, gpu="GPU-a"))
        await wait_for(lambda: publisher.stats.published == 7)
        records = await read_all(settings, topics.metrics, 6)
        assert sorted(len(events) for _k, events in records) == [3, 3]  # one record per target
        assert sorted(sequences_of(records)) == list(range(6))
        assert sequences_of(await read_all(settings, topics.metrics_urgent, 1)) == [6]
        # An OOM ends the wait too, and takes the calm samples queued before it along.
        publisher.submit(sample(7))
        await asyncio.sleep(0.5)
        assert publisher.stats.published == 7
        publisher.submit(oom(1))
        await wait_for(lambda: publisher.stats.published == 9)
        # Pressure with no calm sample waiting goes alone, and the next calm sample lingers as before.
        publisher.submit(pressed_sample(8, gpu="GPU-a"))
        await wait_for(lambda: publisher.stats.published == 10)
        publisher.submit(sample(9))
        await asyncio.sleep(0.5)
        assert publisher.stats.published == 10 and publisher.queued == 1


async def test_outage_spools_and_drains_in_order(tmp_path: Path, topic_prefix: str) -> None:
    broker = TansuBroker(tmp_path / "tansu")
    broker.start()
    settings = Settings(
        kafka_bootstrap=broker.bootstrap, topic_prefix=topic_prefix, kafka_partitions=1, kafka_request_timeout_ms=1500
    )
    topics = Topics(topic_prefix)
    publisher = CapturePublisher(
        lambda: TopicEnsuringProducer(settings), Spool(tmp_path / "spool"), topics, delivery_timeout_s=3.0
    )
    try:
        async with publishing(publisher):
            publisher.submit(sample(0))
            await wait_for(lambda: publisher.stats.published == 1)
            await asyncio.to_thread(broker.stop)
            for i in range(1, 40):
                publisher.submit(sample(i))
            publisher.submit(oom(40))
            await wait_for(lambda: publisher.spool.pending >= 40 and not publisher.online)
            assert publisher.stats.spooled >= 40
            await asyncio.to_thread(broker.start)  # same port; memory storage: the old record is gone
            await wait_for(lambda: publisher.spool.pending == 0 and publisher.online, timeout_s=30)
            publisher.submit(sample(41))
            await wait_for(lambda: publisher.stats.published >= 2)
            records = await read_all(settings, topics.metrics, 40)
            sequences = sequences_of(records)
            # In order, none lost; a batch caught by the outage may arrive twice (at least once).
            assert sorted(set(sequences)) == [*range(1, 40), 41]
            first_seen = list(dict.fromkeys(sequences))
            assert first_seen == sorted(first_seen)
            ooms = await read_all(settings, topics.oom, 1)
            assert [m.meta.event_id for _k, events in ooms for m in events] == ["o40"]
    finally:
        broker.stop()
