"""Consumer-group moves on the real broker: offsets handled but not yet committed (the commit interval has not
passed) are committed when the partitions are revoked, so the next owner starts after them; and a replica that
is assigned a partition reads its recent records again, flagged as replay, before new work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent, ensure_topics, partition_of
from sits.runtime.contract import format_target_key
from sits.runtime.events import Topics
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.settings import Settings
from sits.v1 import common_pb2
from tests.runtime.test_bus import sample
from tests.waiting import eventually, in_background

PARTITIONS = 2


def engines_on_each_partition() -> list[str]:
    """One engine name per partition, so both partitions get records."""
    found: dict[int, str] = {}
    for i in range(100):
        key = format_target_key(common_pb2.Target(host="h", gpu_uuid="GPU-1", engine=f"vllm-{i}"))
        found.setdefault(partition_of(key, PARTITIONS), f"vllm-{i}")
    return [found[p] for p in range(PARTITIONS)]


async def committed(settings: Settings, group: str, topic: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(**kafka_options_for(settings.kafka_bootstrap))
    await admin.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        offsets = await admin.list_consumer_group_offsets(group, partitions=parts)
        return {tp.partition: (m.offset if m is not None and m.offset >= 0 else 0) for tp, m in offsets.items()}
    finally:
        await admin.close()


async def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    consumer = AIOKafkaConsumer(**kafka_options_for(settings.kafka_bootstrap))
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in range(PARTITIONS)])
        return {tp.partition: n for tp, n in ends.items()}
    finally:
        await consumer.stop()


@contextlib.asynccontextmanager
async def member(consumer: EventConsumer) -> AsyncIterator[asyncio.Event]:
    try:
        async with in_background(consumer.run, 30) as stop:
            yield stop
    finally:
        await consumer.stop()


@pytest.mark.timeout(90)
async def test_revocation_commits_what_was_handled_and_the_next_owner_replays_it(
    broker: object, settings: Settings
) -> None:
    settings = settings.model_copy(
        update={
            "kafka_partitions": PARTITIONS,
            "consumer_commit_interval_ms": 60_000,
            "consumer_session_timeout_ms": 6000,
        }
    )
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings, [topics.metrics, topics.deadletter])
    group = f"{settings.topic_prefix}rebalance"
    engines = engines_on_each_partition()
    per_engine = 10
    async with EventProducer(settings) as producer:
        for seq in range(per_engine):
            for engine in engines:
                await producer.publish(topics.metrics, sample(seq + 1, engine=engine), traced=False)

        seen: dict[str, list[ReceivedEvent]] = {"a": [], "b": []}
        revoked_a: list[set[TopicPartition]] = []

        async def on_revoked(parts: set[TopicPartition]) -> None:
            revoked_a.append(parts)

        def handler(name: str):  # type: ignore[no-untyped-def]
            async def handle(event: ReceivedEvent) -> None:
                seen[name].append(event)

            return handle

        a = EventConsumer(
            settings,
            group_id=group,
            topics=[topics.metrics],
            handler=handler("a"),
            dead_letters=producer,
            coalesce=False,
            on_revoked=on_revoked,
        )
        b = EventConsumer(
            settings,
            group_id=group,
            topics=[topics.metrics],
            handler=handler("b"),
            dead_letters=producer,
            coalesce=False,
            replay={topics.metrics: 3},
        )
        async with member(a):
            assert await eventually(lambda: len(seen["a"]) == per_engine * PARTITIONS, timeout_s=30)
            # Handled, but the commit interval (60 s) has not passed: nothing committed yet.
            assert await committed(settings, group, topics.metrics) == dict.fromkeys(range(PARTITIONS), 0)
            async with member(b):
                assert await eventually(lambda: bool(b.owned_partitions(topics.metrics)), timeout_s=40)
                # On revocation a committed everything it had handled: the next owner starts after it.
                assert revoked_a, "a was told its partitions were revoked"
                assert await committed(settings, group, topics.metrics) == await end_offsets(settings, topics.metrics)
                await asyncio.sleep(1.0)
                # b read the last 3 records of its partition again, as replay only, and nothing as new work.
                assert [e.replay for e in seen["b"]] == [True] * 3
                replayed = [getattr(e.message, "sequence", None) for e in seen["b"]]
                assert replayed == [per_engine - 2, per_engine - 1, per_engine]
