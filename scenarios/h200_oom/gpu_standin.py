"""A STAND-IN for NVML, CPU dry runs only: memory samples of a GPU that is not there, so the loop runs end to end.

Publishes NVML-shaped MetricSamples (source kind REPLAY, so nobody takes them
for a measurement) for the engine's target at `--hz`: flat at `--base` of the
device until the scenario's t0, then a ramp to `--peak` over `--ramp-s`. The
decision service sees them beside capture's real engine samples of the CPU
workload, and the executor acts on the real workload's control endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scenarios.h200_oom.files import wait_for_file
from sits.runtime.bus import EventProducer, ensure_topics
from sits.runtime.events import Topics, new_meta
from sits.runtime.settings import Settings
from sits.v1 import common_pb2, events_pb2

TOTAL = 141 << 30


def memory_at(t: float, base: float, peak: float, ramp_s: float) -> float:
    """Fraction of the device used `t` seconds after t0 (negative: before it)."""
    if t <= 0:
        return base
    return base + (peak - base) * min(1.0, t / ramp_s)


async def publish_stand_in_samples(
    bootstrap: str,
    topic_prefix: str,
    target: common_pb2.Target,
    source: str,
    total_bytes: int,
    used_bytes: Callable[[float], int],
    hz: float,
    max_s: float,
) -> None:
    """NVML-shaped samples of a device of `total_bytes`, `used_bytes(now)` used, at `hz` for `max_s` seconds.

    Tagged SAMPLE_SOURCE_REPLAY, so nobody takes them for a measurement. The h200_vllm rehearsal's
    stand-in (`scenarios.h200_vllm.gpu_standin`) publishes through this too.
    """
    settings = Settings(kafka_bootstrap=bootstrap, topic_prefix=topic_prefix)
    topics = Topics(topic_prefix)
    await ensure_topics(settings)
    started = time.time()
    sequence = 0
    async with EventProducer(settings) as producer:
        while time.time() - started < max_s:
            now = time.time()
            used = used_bytes(now)
            sequence += 1
            sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_REPLAY, sequence=sequence)
            sample.meta.CopyFrom(new_meta(source, target, now))
            sample.gpu.total_bytes = total_bytes
            sample.gpu.used_bytes = used
            sample.gpu.free_bytes = total_bytes - used
            await producer.publish(topics.metrics, sample)
            await asyncio.sleep(1.0 / hz)


async def publish(args: argparse.Namespace) -> None:
    t0: float | None = None

    def used_bytes(now: float) -> int:
        nonlocal t0
        if t0 is None and args.go_file.exists():
            t0 = float(wait_for_file(args.go_file, 5)["t0"])
        return int(memory_at(now - t0 if t0 is not None else -1.0, args.base, args.peak, args.ramp_s) * TOTAL)

    target = common_pb2.Target(host=args.host, gpu_uuid=args.gpu_uuid, engine=args.engine)
    await publish_stand_in_samples(
        args.bootstrap, args.topic_prefix, target, "scenario/synthetic-gpu", TOTAL, used_bytes, args.hz, args.max_s
    )


def stand_in_parser(description: str) -> argparse.ArgumentParser:
    """The options every stand-in takes: where to publish, and as which target."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic-prefix", default="")
    p.add_argument("--host", required=True)
    p.add_argument("--gpu-uuid", required=True)
    p.add_argument("--engine", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    p = stand_in_parser(__doc__.split("\n")[0])
    p.add_argument("--go-file", type=Path, required=True)
    p.add_argument("--hz", type=float, default=10.0)
    p.add_argument("--base", type=float, default=0.3)
    p.add_argument("--peak", type=float, default=0.99)
    p.add_argument("--ramp-s", type=float, default=20.0)
    p.add_argument("--max-s", type=float, default=300.0)
    asyncio.run(publish(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
