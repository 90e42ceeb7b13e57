"""pipeline_throughput: metric samples per second through capture → Kafka → decision, and the decision lag.

Real parts: Tansu (Kafka protocol), the decision service as a process started the way `sits up`
starts it (`python -m sits_app.cli decision`, default policy), and capture's own path in this process
(CaptureService.ingest_sample → CapturePublisher → TopicEnsuringProducer; calm samples carry no span).

One round: `--samples` samples for `--targets` targets (GPU, processes and engine fields, memory
30-70%, as capture publishes them) are handed to capture as fast as it takes them. A wrapper around
capture's producer records each record's partition, offset and the moment capture handed it to the
producer ("published"). Every 50 ms the decision group's committed offsets are read with aiokafka's
admin client; a sample is "handled" at the first poll whose committed offset is past it. The
decision coalesces samples of one target within a poll when it lags (latest wins, the designed
behaviour): a coalesced sample counts as handled when its offset is committed.

- samples_per_s: samples / (first sample handed to capture → last sample committed by the decision).
- decision_lag_p50/p99_ms: published → handled, per sample (50 ms poll resolution, so up to 50 ms high).
- baselines: a plain aiokafka producer (this process) and a plain aiokafka consumer (a child process,
  partitions assigned) moving the same samples, same keys, same broker, same run, first send → last
  record read: raw_broker_packed_samples_per_s with the samples packed into MetricBatch records as
  capture packs a full queue (the baseline of ratio_to_raw_broker), raw_broker_samples_per_s with one
  sample per record.
- decision_alone_samples_per_s: after each round a second decision process, in a new consumer group,
  works through the whole metrics topic from its start (the backlog it is built to coalesce); records
  per second from its first commit to its last, start-up and group join left out.
- where the time goes: CPU seconds of this process (capture), the decision process and Tansu over the
  round, per sample; the same for the raw baseline's producer, consumer and Tansu.

Two configurations, each with its own stack and raw baseline: the runtime defaults (the figures) and
the decision with SITS_CONSUMER_MAX_BATCH=5000 (under `configurations`). Each figure is the median of
`--rounds` rounds. Writes bench/results/pipeline_throughput.json.

Run: .venv/bin/python -m bench.pipeline_throughput [--samples 40000] [--targets 128] [--rounds 3]
     .venv/bin/python -m bench.pipeline_throughput --profile   (one round, capture and decision under
     cProfile; prints the functions with the most own time, writes no result)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from google.protobuf.message import Message

from bench.common import median, quantile, write_result
from services.capture.publisher import (
    CAPTURE_PRODUCER_BATCH_BYTES,
    MAX_SAMPLES_PER_RECORD,
    CapturePublisher,
    TopicEnsuringProducer,
)
from services.capture.service import CaptureService
from services.capture.settings import CaptureSettings
from services.capture.spool import Spool
from sits.runtime.bus import ensure_topics
from sits.runtime.clock import SystemClock
from sits.runtime.contract import format_target_key
from sits.runtime.events import Topics, metric_batch
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.procs import ManagedProcess, free_port
from sits.runtime.settings import Settings
from sits.v1 import events_pb2
from sits_app.stack.embedded import EmbeddedStack, StackConfig, wait_serving

GIB = 1 << 30
TOTAL_BYTES = 80 * GIB
POLL_S = 0.05
TICKS = os.sysconf("SC_CLK_TCK")


def make_samples(count: int, targets: int, seed: int) -> list[events_pb2.MetricSample]:
    """Calm samples as capture's NVML + engine sources produce them, round-robin over the targets."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        index = i % targets
        sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_NVML)
        sample.meta.target.host = "bench-pipe"
        sample.meta.target.gpu_uuid = f"GPU-{index // 8}"
        sample.meta.target.engine = f"vllm-{index}"
        used = int(TOTAL_BYTES * rng.uniform(0.3, 0.7))
        sample.gpu.used_bytes = used
        sample.gpu.total_bytes = TOTAL_BYTES
        sample.gpu.free_bytes = TOTAL_BYTES - used
        sample.gpu.utilization_pct = 70.0
        sample.processes.add(pid=1000 + index, used_bytes=used, name="vllm", is_target_engine=True)
        sample.engine.kv_cache_usage = rng.uniform(0.2, 0.6)
        sample.engine.num_requests_running = 24
        sample.engine.num_requests_waiting = 2
        out.append(sample)
    return out


@dataclass
class Delivery:
    partition: int
    offset: int
    published: float
    samples: int  # a MetricBatch record carries several


def samples_in(message: Message) -> int:
    return len(message.samples) if isinstance(message, events_pb2.MetricBatch) else 1


class RecordingProducer:
    """Capture's producer, noting each record's partition, offset and publication time."""

    def __init__(self, inner: TopicEnsuringProducer, deliveries: list[Delivery]) -> None:
        self._inner = inner
        self._deliveries = deliveries

    async def start(self) -> None:
        await self._inner.start()

    async def stop(self) -> None:
        await self._inner.stop()

    async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]:
        published = time.perf_counter()
        future = await self._inner.enqueue(topic, message, traced=traced)
        deliveries, samples = self._deliveries, samples_in(message)

        def delivered(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is None:
                meta = done.result()
                deliveries.append(Delivery(meta.partition, meta.offset, published, samples))

        future.add_done_callback(delivered)
        return future


@dataclass
class CommitWatch:
    """Snapshots of a consumer group's committed offsets, every POLL_S."""

    bootstrap: str
    group: str
    topic: str
    partitions: int
    snapshots: list[tuple[float, dict[int, int]]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        admin = AIOKafkaAdminClient(**kafka_options_for(self.bootstrap))
        await admin.start()
        # Tansu answers an OffsetFetch for named partitions only (not "all of the group's").
        wanted = [TopicPartition(self.topic, p) for p in range(self.partitions)]
        try:
            while not stop.is_set():
                offsets = await admin.list_consumer_group_offsets(self.group, partitions=wanted)
                now = time.perf_counter()
                self.snapshots.append(
                    (now, {tp.partition: om.offset for tp, om in offsets.items() if tp.topic == self.topic})
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=POLL_S)
        finally:
            await admin.close()

    def latest(self) -> dict[int, int]:
        return self.snapshots[-1][1] if self.snapshots else {}


def handled_times(deliveries: list[Delivery], snapshots: list[tuple[float, dict[int, int]]]) -> list[float]:
    """Per delivery, the first snapshot time whose committed offset is past it (nan if never)."""
    by_partition: dict[int, list[int]] = {}
    for index, delivery in enumerate(deliveries):
        by_partition.setdefault(delivery.partition, []).append(index)
    handled = [float("nan")] * len(deliveries)
    for partition, indexes in by_partition.items():
        indexes.sort(key=lambda i: deliveries[i].offset)
        cursor = 0
        for when, committed in snapshots:
            position = committed.get(partition, -1)
            while cursor < len(indexes) and deliveries[indexes[cursor]].offset < position:
                handled[indexes[cursor]] = when
                cursor += 1
    return handled


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(0.005)


@dataclass
class RoundResult:
    samples_per_s: float
    samples_per_record: float
    capture_samples_per_s: float
    lag_p50_ms: float
    lag_p99_ms: float
    cpu_us_per_sample: dict[str, float]


async def pipeline_round(
    capture: CaptureService,
    publisher: CapturePublisher,
    deliveries: list[Delivery],
    watch: CommitWatch,
    samples: list[events_pb2.MetricSample],
    pids: dict[str, int],
) -> RoundResult:
    deliveries.clear()
    published_before = publisher.stats.published
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    process_before = time.process_time()
    started = time.perf_counter()
    for index, sample in enumerate(samples):
        capture.ingest_sample(sample, "bench")
        if index % 256 == 255:
            await asyncio.sleep(0)  # a source yields to the loop between samples
    n = len(samples)
    await wait_until(lambda: publisher.stats.published - published_before >= n, 180, "capture publishing")
    await wait_until(lambda: sum(d.samples for d in deliveries) >= n, 30, "delivery reports")
    captured = time.perf_counter()
    ends: dict[int, int] = {}
    for delivery in deliveries:
        ends[delivery.partition] = max(ends.get(delivery.partition, -1), delivery.offset + 1)
    await wait_until(
        lambda: all(watch.latest().get(p, -1) >= end for p, end in ends.items()), 180, "decision catching up"
    )
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    cpu["capture_process"] = time.process_time() - process_before
    handled = handled_times(deliveries, [s for s in watch.snapshots if s[0] >= started])
    finished = max(handled)
    lags = [(h - d.published) * 1000 for h, d in zip(handled, deliveries, strict=True) for _ in range(d.samples)]
    return RoundResult(
        samples_per_s=n / (finished - started),
        samples_per_record=n / len(deliveries),
        capture_samples_per_s=n / (captured - started),
        lag_p50_ms=quantile(lags, 0.5),
        lag_p99_ms=quantile(lags, 0.99),
        cpu_us_per_sample={name: seconds / n * 1e6 for name, seconds in cpu.items()},
    )


async def raw_consumer(bootstrap: str, topic: str, count: int) -> None:
    """Child-process side of the baseline: read `count` records; print the wall time and this process's CPU."""
    consumer = AIOKafkaConsumer(**kafka_options_for(bootstrap), fetch_max_wait_ms=10, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        while not partitions:
            await consumer.force_metadata_update()
            partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        print("ready", flush=True)
        cpu_before = time.process_time()
        seen = 0
        while seen < count:
            batches = await consumer.getmany(timeout_ms=200)
            seen += sum(len(records) for records in batches.values())
        print(f"done {time.time()!r} {time.process_time() - cpu_before!r}", flush=True)
    finally:
        await consumer.stop()


async def raw_round(
    settings: Settings, topic: str, payloads: list[tuple[bytes, bytes]], tansu_pid: int, max_batch_size: int = 16384
) -> tuple[float, dict[str, float]]:
    """Plain aiokafka producer (here) → consumer (a child process): records per second, CPU us per record."""
    await ensure_topics(settings, [topic])
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--raw-consumer",
        settings.kafka_bootstrap,
        topic,
        str(len(payloads)),
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    try:
        ready = await asyncio.wait_for(child.stdout.readline(), timeout=60)
        if not ready.startswith(b"ready"):
            raise RuntimeError(f"raw consumer did not start: {ready!r}")
        producer = AIOKafkaProducer(
            **kafka_options_for(settings.kafka_bootstrap), acks="all", linger_ms=5, max_batch_size=max_batch_size
        )
        await producer.start()
        try:
            tansu_before = cpu_seconds(tansu_pid)
            process_before = time.process_time()
            started = time.time()
            futures = [await producer.send(topic, value=value, key=key) for key, value in payloads]
            await asyncio.gather(*futures)
            producer_cpu = time.process_time() - process_before
        finally:
            await producer.stop()
        done = (await asyncio.wait_for(child.stdout.readline(), timeout=120)).split()
        n = len(payloads)
        cpu = {
            "producer_process": producer_cpu,
            "consumer_process": float(done[2]),
            "tansu": cpu_seconds(tansu_pid) - tansu_before,
        }
        return n / (float(done[1]) - started), {name: seconds / n * 1e6 for name, seconds in cpu.items()}
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


def packed_payloads(samples: list[events_pb2.MetricSample]) -> list[tuple[bytes, bytes]]:
    """The samples as capture's publisher packs them when it finds them all queued: per window of
    its batch size, each target's samples in MetricBatch records of at most MAX_SAMPLES_PER_RECORD."""
    payloads = []
    window = CaptureSettings().capture_publish_batch
    for start in range(0, len(samples), window):
        per_target: dict[str, list[events_pb2.MetricSample]] = {}
        for sample in samples[start : start + window]:
            per_target.setdefault(format_target_key(sample.meta.target), []).append(sample)
        for key, group in per_target.items():
            for first in range(0, len(group), MAX_SAMPLES_PER_RECORD):
                batch = metric_batch(group[first : first + MAX_SAMPLES_PER_RECORD], "bench")
                payloads.append((key.encode(), batch.SerializeToString()))
    return payloads


def top_functions(stats: pstats.Stats, count: int = 15) -> list[str]:
    """The functions with the most own time, as 'tottime_s cumtime_s calls file:line(name)'."""
    table = stats.stats  # type: ignore[attr-defined]
    rows = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [
        f"{tt:7.3f} {ct:7.3f} {nc:8d} {Path(file).name}:{line}({name})"
        for (file, line, name), (_, nc, tt, ct, _) in rows
    ]


@dataclass
class ConfigResult:
    rounds: list[RoundResult] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    raw_cpu: list[dict[str, float]] = field(default_factory=list)
    raw_packed: list[float] = field(default_factory=list)  # samples/s
    drain: list[float] = field(default_factory=list)
    drain_cpu_us: list[float] = field(default_factory=list)


async def decision_drain(
    stack: EmbeddedStack, topic: str, group: str, workdir: Path, samples_per_record: float
) -> tuple[float, float]:
    """A second decision process, in a new group, works through the whole metrics topic from its start.

    The decision alone, with the backlog it is built to coalesce: samples per second and CPU us per
    sample (records counted from the committed offsets, times the topic's samples per record), from
    its first commit to its last (its start-up and group join are left out).
    """
    partitions = [TopicPartition(topic, p) for p in range(stack.settings.kafka_partitions)]
    reader = AIOKafkaConsumer(**kafka_options_for(stack.broker.bootstrap))
    await reader.start()
    try:
        ends = {tp.partition: offset for tp, offset in (await reader.end_offsets(partitions)).items()}
    finally:
        await reader.stop()
    env = {
        **stack.env(),
        "SITS_DECISION_GROUP": group,
        "SITS_DECISION_ADDR": f"127.0.0.1:{free_port()}",
        "SITS_METRICS_PORT": str(free_port()),
    }
    process = ManagedProcess(
        "decision-drain", [sys.executable, "-m", "sits_app.cli", "decision"], workdir / f"{group}.log", env
    )
    watch = CommitWatch(stack.broker.bootstrap, f"{stack.config.topic_prefix}{group}", topic, len(partitions))
    stop = asyncio.Event()
    watching = asyncio.create_task(watch.run(stop))
    process.start()
    try:
        await wait_until(lambda: sum(watch.latest().values()) > 0, 120, "the drain decision's first commit")
        first_t, first = watch.snapshots[-1]
        first_cpu = cpu_seconds(process.pid)
        await wait_until(lambda: all(watch.latest().get(p, -1) >= e for p, e in ends.items()), 180, "the drain")
        last_t, last = watch.snapshots[-1]
        drained = (sum(last.values()) - sum(first.values())) * samples_per_record
        return drained / (last_t - first_t), (cpu_seconds(process.pid) - first_cpu) / drained * 1e6
    finally:
        stop.set()
        await watching
        await process.astop()


async def run_config(
    label: str, decision_env: dict[str, str], count: int, targets: int, rounds: int, profile_dir: Path | None
) -> ConfigResult:
    """One stack (Tansu + decision process) with `decision_env`, `rounds` pipeline rounds and raw baselines."""
    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-pipe-"))
    prefix = f"benchpipe{uuid.uuid4().hex[:6]}."
    topics = Topics(prefix)
    services: tuple[str, ...] = () if profile_dir else ("decision",)
    config = StackConfig(
        run_dir=workdir / "stack", topic_prefix=prefix, services=services, start_budget_s=120, extra_env=decision_env
    )
    result = ConfigResult()
    async with EmbeddedStack(config, progress=lambda msg: print(msg, flush=True)) as stack:
        profiled: ManagedProcess | None = None
        if profile_dir:
            # The decision under cProfile; it writes its profile when SIGTERM ends it.
            profiled = ManagedProcess(
                "decision",
                [
                    sys.executable,
                    "-m",
                    "cProfile",
                    "-o",
                    str(profile_dir / "decision.prof"),
                    "-m",
                    "sits_app.cli",
                    "decision",
                ],
                workdir / "decision.log",
                env={**stack.env(), "SITS_METRICS_PORT": str(free_port())},
            )
            profiled.start()
            await wait_serving(stack.settings.decision_addr, "sits.v1.Decision", 120)
            decision_pid = profiled.pid
        else:
            decision_pid = stack.services["decision"].process.pid
        settings = Settings(kafka_bootstrap=stack.broker.bootstrap, topic_prefix=prefix)
        deliveries: list[Delivery] = []
        publisher = CapturePublisher(
            lambda: RecordingProducer(TopicEnsuringProducer(settings), deliveries), Spool(workdir / "spool"), topics
        )
        capture = CaptureService(publisher, SystemClock())
        stop = asyncio.Event()
        publishing = asyncio.create_task(publisher.run(stop))
        watch = CommitWatch(
            stack.broker.bootstrap, f"{prefix}sits-decision", topics.metrics, stack.settings.kafka_partitions
        )
        watching = asyncio.create_task(watch.run(stop))
        broker_proc = stack.broker._proc
        assert broker_proc is not None
        pids = {"decision_process": decision_pid, "tansu": broker_proc.pid}
        try:
            # The decision joins its group after it answers health checks, and a group may rebalance once
            # more while topics appear: warm up until a warm-up is committed within half a second.
            topic_records = topic_samples = 0
            for attempt in range(20):
                deliveries.clear()
                for sample in make_samples(targets, targets, seed=1 + attempt):
                    capture.ingest_sample(sample, "warmup")
                sent = time.perf_counter()
                await wait_until(lambda: sum(d.samples for d in deliveries) >= targets, 60, "warm-up delivery")
                await wait_until(
                    lambda: all(watch.latest().get(d.partition, -1) > d.offset for d in deliveries),
                    120,
                    "the decision joining",
                )
                topic_records += len(deliveries)
                topic_samples += targets
                if time.perf_counter() - sent < 0.5:
                    break
            for r in range(rounds):
                samples = make_samples(count, targets, seed=100 + r)
                capture_profile = cProfile.Profile() if profile_dir else None
                if capture_profile:
                    capture_profile.enable()
                outcome = await pipeline_round(capture, publisher, deliveries, watch, samples, pids)
                topic_records += len(deliveries)
                topic_samples += count
                if capture_profile:
                    capture_profile.disable()
                    assert profile_dir is not None
                    capture_profile.dump_stats(profile_dir / "capture.prof")
                payloads = []
                for sample in make_samples(count, targets, seed=200 + r):
                    capture.stamper.stamp_sample(sample, "bench")
                    payloads.append((format_target_key(sample.meta.target).encode(), sample.SerializeToString()))
                raw_rate, raw_cpu = await raw_round(settings, f"{prefix}raw{r}", payloads, broker_proc.pid)
                packed = packed_payloads([events_pb2.MetricSample.FromString(value) for _key, value in payloads])
                packed_records_per_s, _ = await raw_round(
                    settings, f"{prefix}rawpacked{r}", packed, broker_proc.pid, CAPTURE_PRODUCER_BATCH_BYTES
                )
                result.rounds.append(outcome)
                result.raw.append(raw_rate)
                result.raw_cpu.append(raw_cpu)
                result.raw_packed.append(packed_records_per_s * count / len(packed))
                drain_rate, drain_cpu = await decision_drain(
                    stack, topics.metrics, f"drain{r}", workdir, topic_samples / topic_records
                )
                result.drain.append(drain_rate)
                result.drain_cpu_us.append(drain_cpu)
                cpu = ", ".join(f"{k} {v:.0f}" for k, v in outcome.cpu_us_per_sample.items())
                raw_cpu_text = ", ".join(f"{k} {v:.0f}" for k, v in raw_cpu.items())
                print(
                    f"[{label}] round {r}: pipeline {outcome.samples_per_s:.0f}/s "
                    f"(capture alone {outcome.capture_samples_per_s:.0f}/s, "
                    f"{outcome.samples_per_record:.1f} samples/record), "
                    f"lag p50 {outcome.lag_p50_ms:.0f} p99 {outcome.lag_p99_ms:.0f} ms; CPU us/sample: {cpu}; "
                    f"raw broker {raw_rate:.0f}/s, CPU us/record: {raw_cpu_text}; raw broker, packed records "
                    f"{result.raw_packed[-1]:.0f} samples/s; decision alone (drain) "
                    f"{drain_rate:.0f}/s, {drain_cpu:.0f} us/record; load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        finally:
            stop.set()
            await publishing
            await watching
            if profiled is not None:
                await profiled.astop(grace_s=20)
    return result


def summary(result: ConfigResult) -> dict[str, Any]:
    rate = median([r.samples_per_s for r in result.rounds])
    raw_rate = median(result.raw)
    names = list(result.rounds[0].cpu_us_per_sample)
    raw_names = list(result.raw_cpu[0])
    return {
        "samples_per_s": round(rate),
        # Paired per round: a pipeline round and the raw baseline run right after it share the machine's load.
        "ratio_to_raw_broker": round(
            median([r.samples_per_s / raw for r, raw in zip(result.rounds, result.raw_packed, strict=True)]), 3
        ),
        "ratio_to_raw_broker_one_sample_per_record": round(
            median([r.samples_per_s / raw for r, raw in zip(result.rounds, result.raw, strict=True)]), 3
        ),
        "samples_per_record": round(median([r.samples_per_record for r in result.rounds]), 1),
        "decision_lag_p50_ms": round(median([r.lag_p50_ms for r in result.rounds]), 1),
        "decision_lag_p99_ms": round(median([r.lag_p99_ms for r in result.rounds]), 1),
        "capture_publish_samples_per_s": round(median([r.capture_samples_per_s for r in result.rounds])),
        "cpu_us_per_sample": {n: round(median([r.cpu_us_per_sample[n] for r in result.rounds]), 1) for n in names},
        "decision_alone_samples_per_s": round(median(result.drain)),
        "decision_alone_cpu_us_per_sample": round(median(result.drain_cpu_us), 1),
        "raw_broker_samples_per_s": round(raw_rate),
        "raw_broker_packed_samples_per_s": round(median(result.raw_packed)),
        "raw_cpu_us_per_record": {n: round(median([c[n] for c in result.raw_cpu]), 1) for n in raw_names},
    }


CONFIGS = {
    "runtime_defaults": {},
    # A larger poll lets the decision coalesce more samples per target per poll (one handler call each).
    "decision_max_batch_5000": {"SITS_CONSUMER_MAX_BATCH": "5000"},
}


async def run(count: int, targets: int, rounds: int) -> None:
    summaries = {}
    for label, env in CONFIGS.items():
        summaries[label] = summary(await run_config(label, env, count, targets, rounds, None))
    main = summaries["runtime_defaults"]
    load = os.getloadavg()
    path = write_result(
        "pipeline_throughput",
        command=".venv/bin/python -m bench.pipeline_throughput",
        figures={
            **{k: v for k, v in main.items() if not k.startswith("raw_")},
            "samples_per_round": count,
            "targets": targets,
            "rounds": rounds,
        },
        baseline={
            "raw_broker_packed_samples_per_s": main["raw_broker_packed_samples_per_s"],
            "raw_broker_samples_per_s": main["raw_broker_samples_per_s"],
            "raw_cpu_us_per_record": main["raw_cpu_us_per_record"],
        },
        goal={"samples_per_s": 50_000, "decision_lag_p99_ms": 1000},
        notes=(
            "one capture (this process: CaptureService.ingest_sample -> CapturePublisher -> TopicEnsuringProducer, "
            "calm samples without spans) -> Tansu (4 partitions) -> decision process (default policy). figures: "
            "runtime defaults (SITS_CONSUMER_MAX_BATCH=500, fetch wait 10 ms); configurations.* has the same run "
            "with other decision settings, each with its own raw baseline. Samples are offered as fast as capture "
            "takes them. Handled = the decision group's committed offset is past the sample (admin client polled "
            "every 50 ms); samples coalesced per target within a poll (latest wins) count as handled. Raw baseline: "
            "aiokafka producer here + aiokafka consumer in a child process, same payloads and keys, no headers. "
            "cpu_us_per_sample: CPU time of each process over a round divided by its samples. decision_alone: a "
            "second decision process in a new group drains the whole metrics topic after each round (first commit "
            "to last). ratio_to_raw_broker pairs each round with the raw run right after it. Medians of the "
            f"rounds. Load average at the end (1/5/15 min): {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, other "
            "helpers' tests sharing the 2 cores. Capture sends each target's queued samples as one MetricBatch "
            "record (samples_per_record: the mean); raw_broker_packed_samples_per_s, the baseline of "
            "ratio_to_raw_broker: the raw producer and consumer moving the same samples packed the same way, with "
            "capture's producer batch size; raw_broker_samples_per_s: one sample per record (aiokafka defaults)"
        ),
        extra={"configurations": summaries},
    )
    print(path.read_text())


async def profile(count: int, targets: int) -> None:
    """One round with the decision process and this process's capture path under cProfile; prints the top."""
    directory = Path(tempfile.mkdtemp(prefix="sits-bench-pipe-prof-"))
    await run_config("profile", {}, count, targets, 1, directory)
    for name in ("capture", "decision"):
        path = directory / f"{name}.prof"
        print(f"--- {name}: tottime cumtime calls function ({path})")
        print("\n".join(top_functions(pstats.Stats(str(path)))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=40_000, help="samples per round (below capture's queue bound)")
    parser.add_argument("--targets", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="one round under cProfile; prints, writes no result")
    parser.add_argument("--raw-consumer", nargs=3, metavar=("BOOTSTRAP", "TOPIC", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_consumer:
        bootstrap, topic, count = args.raw_consumer
        asyncio.run(raw_consumer(bootstrap, topic, int(count)))
        return
    with contextlib.suppress(KeyboardInterrupt):
        if args.profile:
            asyncio.run(profile(args.samples, args.targets))
        else:
            asyncio.run(run(args.samples, args.targets, args.rounds))


if __name__ == "__main__":
    main()
