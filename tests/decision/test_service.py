"""The decision service end to end on a real Tansu broker: samples in, one HealingCommand out."""

import asyncio
import contextlib
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from services.decision.main import DecisionSettings, serve
from sits.runtime.bus import EventProducer, ensure_topics
from sits.runtime.events import Topics
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.settings import Settings
from sits.v1 import common_pb2, events_pb2
from tests.decision.decision_builders import rules_policy_text


def _sample(event_id: str, seq: int, kv: float) -> events_pb2.MetricSample:
    sample = events_pb2.MetricSample(sequence=seq)
    sample.meta.event_id = event_id
    sample.meta.source = "test"
    sample.meta.target.CopyFrom(common_pb2.Target(host="h", gpu_uuid="GPU-0", engine="vllm-0"))
    sample.meta.produced_at.FromNanoseconds(int((time.time() + seq * 0.1) * 1e9))
    sample.gpu.CopyFrom(events_pb2.GpuMemory(used_bytes=50 << 30, total_bytes=140 << 30))
    sample.engine.CopyFrom(events_pb2.EngineLoad(kv_cache_usage=kv))
    return sample


async def _read_commands(settings: Settings, topic: str, timeout_s: float) -> list[events_pb2.HealingCommand]:
    consumer = AIOKafkaConsumer(**kafka_options_for(settings.kafka_bootstrap), enable_auto_commit=False)
    await consumer.start()
    out: list[events_pb2.HealingCommand] = []
    try:
        partitions = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or {0, 1})]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                out += [events_pb2.HealingCommand.FromString(r.value) for r in records if r.value]
    finally:
        await consumer.stop()
    return out


async def test_samples_in_one_command_out(settings: Settings, topics: Topics, tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(rules_policy_text())
    decision_settings = DecisionSettings(
        **(settings.model_dump() | {"decision_addr": "127.0.0.1:0", "decision_policy_file": policy_file})
    )
    await ensure_topics(settings)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(decision_settings, stop))
    try:
        async with EventProducer(settings) as producer:
            first = _sample("s-1", 1, 0.99)
            await producer.publish(topics.metrics, first)
            await producer.publish(topics.metrics, first)  # re-delivered: must not act twice
            await producer.publish(topics.metrics, _sample("s-2", 2, 0.99))  # still high: latched
        commands = await _read_commands(settings, topics.commands, timeout_s=8.0)
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=15)
    assert len(commands) == 1
    [command] = commands
    assert command.kind == events_pb2.ACTION_KIND_SHED_PRIORITY
    # The consumer may coalesce a lagging target's samples (latest wins), so either may be the cause.
    assert command.cause_event_id in {"s-1", "s-2"} and command.policy_rule == "kv-usage-shed-p2"
    assert command.deadline.seconds > 0 and any(e.name == "kv_cache_usage" for e in command.evidence)
