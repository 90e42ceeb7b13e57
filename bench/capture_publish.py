"""Capture publish throughput and spool drain rate, against a real Tansu broker on this machine.

    python -m bench.capture_publish [--samples 50000] [--runs 3]

- `samples_per_s`: MetricSamples through one capture process (CaptureService.ingest_sample: stamp, latest
  state, fan-out, publisher -> runtime EventProducer with CloudEvents headers and trace context) until the
  broker acknowledged all of them.
- `spool_drain_samples_per_s`: samples spooled on disk, published in order once the broker is reachable.
- baseline: a bare aiokafka producer sending the same serialized samples (no headers), one per record, same
  broker, same run. Capture packs what it finds queued for a target into MetricBatch records.
Medians of `--runs` runs; writes bench/results/capture_publish.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaProducer

from bench.common import utc_stamp
from services.capture.publisher import (
    MAX_SAMPLES_PER_RECORD,
    CapturePublisher,
    TopicEnsuringProducer,
)
from services.capture.service import CaptureService
from services.capture.spool import FsyncPolicy, RecordKind, Spool, SpoolRecord
from sits.runtime.bus import ensure_topics
from sits.runtime.clock import SystemClock
from sits.runtime.events import Topics
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.settings import Settings
from sits.v1 import events_pb2
from sits_app.stack.tansu import TansuBroker

ROOT = Path(__file__).resolve().parents[1]

RESULT = ROOT / "bench" / "results" / "capture_publish.json"


def make_sample(i: int) -> events_pb2.MetricSample:
    sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_NVML)
    sample.meta.target.host = "bench-host"
    sample.meta.target.gpu_uuid = f"GPU-{i % 8}"
    sample.gpu.used_bytes = 40 << 30
    sample.gpu.total_bytes = 141 << 30
    sample.gpu.free_bytes = 100 << 30
    sample.gpu.utilization_pct = 73.0
    sample.processes.add(pid=1234, used_bytes=39 << 30, name="python", is_target_engine=True)
    return sample


async def wait_until(predicate, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark did not finish in time")
        await asyncio.sleep(0.001)


async def raw_baseline(settings: Settings, topic: str, n: int) -> float:
    payloads = [make_sample(i).SerializeToString() for i in range(n)]
    producer = AIOKafkaProducer(**kafka_options_for(settings.kafka_bootstrap), acks="all", linger_ms=5)
    await producer.start()
    try:
        started = time.perf_counter()
        futures = [await producer.send(topic, value=p, key=b"bench-host/GPU-0//") for p in payloads]
        await asyncio.gather(*futures)
        return n / (time.perf_counter() - started)
    finally:
        await producer.stop()


async def capture_run(settings: Settings, n: int, spool_dir: Path) -> float:
    topics = Topics(settings.topic_prefix)
    publisher = CapturePublisher(lambda: TopicEnsuringProducer(settings), Spool(spool_dir), topics)
    service = CaptureService(publisher, SystemClock())
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    await wait_until(lambda: publisher.online, 20)
    samples = [make_sample(i) for i in range(n)]
    started = time.perf_counter()
    for index, sample in enumerate(samples):
        service.ingest_sample(sample, "bench")
        if index % 256 == 0:
            await asyncio.sleep(0)  # a source yields to the loop between samples
    await wait_until(lambda: publisher.stats.published >= n, 120)
    elapsed = time.perf_counter() - started
    stop.set()
    await task
    assert publisher.stats.spooled == 0, "the broker refused samples during the run"
    return n / elapsed


async def drain_run(settings: Settings, n: int, spool_dir: Path) -> float:
    spool = Spool(spool_dir, max_bytes=1 << 30, fsync=FsyncPolicy.INTERVAL)
    topic = Topics(settings.topic_prefix).metrics
    for i in range(n):
        sample = make_sample(i)
        sample.meta.event_id = f"drain-{i}"
        sample.sequence = i + 1
        spool.append(SpoolRecord(RecordKind.METRIC, topic, sample.SerializeToString()))
    spool.sync()
    publisher = CapturePublisher(lambda: TopicEnsuringProducer(settings), spool, Topics(settings.topic_prefix))
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(publisher.run(stop))
    await wait_until(lambda: spool.pending == 0, 120)
    elapsed = time.perf_counter() - started
    stop.set()
    await task
    return n / elapsed


async def main_async(n: int, runs: int) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="capture-bench-"))
    broker = TansuBroker(work / "tansu")
    broker.start()
    try:
        raw, capture, drain = [], [], []
        for run in range(runs):
            settings = Settings(kafka_bootstrap=broker.bootstrap, topic_prefix=f"bench{run}.", kafka_partitions=4)
            await ensure_topics(settings, [Topics(settings.topic_prefix).metrics, Topics(settings.topic_prefix).oom])
            raw.append(await raw_baseline(settings, Topics(settings.topic_prefix).metrics, n))
            capture.append(await capture_run(settings, n, work / f"spool-c{run}"))
            drain.append(await drain_run(settings, n, work / f"spool-d{run}"))
            print(f"run {run}: raw {raw[-1]:.0f}/s, capture {capture[-1]:.0f}/s, drain {drain[-1]:.0f}/s")
    finally:
        broker.stop()
    return {
        "name": "capture_publish",
        "measured_at": utc_stamp(),
        "machine": "2-core CPU machine, Tansu broker on loopback",
        "command": f"python -m bench.capture_publish --samples {n} --runs {runs}",
        "figures": {
            "samples_per_s": round(statistics.median(capture)),
            "spool_drain_samples_per_s": round(statistics.median(drain)),
            "samples_per_run": n,
            "runs": runs,
        },
        "baseline": {"raw_aiokafka_samples_per_s": round(statistics.median(raw))},
        "goal": {"samples_per_s": 20000},
        "notes": (
            "one target: capture packs the samples it finds queued into MetricBatch records of up to "
            f"{MAX_SAMPLES_PER_RECORD} samples (the spool drain too); the baseline sends one sample per record"
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(main_async(args.samples, args.runs))
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["figures"]), json.dumps(result["baseline"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
