"""Decision latency per sample (p50/p99) and samples per second on one core; Admit latency.

Replays synthetic samples (GPU, processes, engine and allocator fields, as
capture publishes them) for many targets at 10 Hz of event time through the
decision engine with the default policy, one process, one thread. Baseline in
the same run: decoding the same samples from protobuf bytes, which every
consumer pays anyway.

    .venv/bin/python -m bench.decision_throughput
writes bench/results/decision_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from bench.common import utc_stamp
from services.decision import convert
from services.decision.domain.admission import EngineProfile
from services.decision.domain.engine import DecisionEngine
from services.decision.domain.kv_model import known_model
from services.decision.domain.policy import parse_policy
from services.decision.domain.types import (
    AllocatorStats,
    EngineLoad,
    GpuMemory,
    ProcessMemory,
    Sample,
    Target,
)
from sits.runtime.clock import ManualClock
from sits.runtime.contract import Tier

ROOT = Path(__file__).resolve().parent.parent

GIB = 1024**3
TOTAL = 143771 * 1024 * 1024


def make_samples(targets: int, seconds: float, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out: list[Sample] = []
    specs = [
        (Target("bench", f"GPU-{i // 4}", "", f"vllm-{i}"), rng.uniform(0.4, 0.8), rng.uniform(-0.001, 0.002))
        for i in range(targets)
    ]
    steps = int(seconds * 10)
    for step in range(steps):
        t = 1_800_000_000.0 + step * 0.1
        for index, (target, base, slope) in enumerate(specs):
            frac = min(0.999, max(0.01, base + slope * step * 0.1 + rng.gauss(0, 0.005)))
            used = int(frac * TOTAL)
            reserved = int(used * 0.95)
            out.append(
                Sample(
                    target=target,
                    t=t,
                    event_id=f"{index}-{step}",
                    source="capture/nvml",
                    sequence=step + 1,
                    gpu=GpuMemory(used, TOTAL, 0, TOTAL - used, 80.0),
                    processes=(ProcessMemory(1000 + index, used, "vllm", True),),
                    engine=EngineLoad(
                        kv_cache_usage=min(1.0, frac),
                        num_requests_running=32,
                        num_requests_waiting=4,
                        tokens_in_flight=40_000,
                        kv_blocks_total=20_000,
                        kv_blocks_used=int(20_000 * frac),
                        block_size=16,
                    ),
                    allocator=AllocatorStats(int(reserved * 0.9), reserved, int(reserved * 0.02)),
                )
            )
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_engine(samples: list[Sample]) -> tuple[list[float], float, int]:
    clock = ManualClock(1_800_000_000.0)
    profiles = {s.target.engine: EngineProfile(known_model("llama-3-8b")) for s in samples[:1000]}
    engine = DecisionEngine(parse_policy((ROOT / "services/decision/default_policy.yaml").read_text()), clock, profiles)
    latencies = []
    commands = 0
    perf = time.perf_counter_ns
    started = time.perf_counter()
    for sample in samples:
        begin = perf()
        commands += len(engine.observe(sample))
        latencies.append((perf() - begin) / 1e6)
    elapsed = time.perf_counter() - started
    return latencies, elapsed, commands


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--targets", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decision_throughput.json")
    args = parser.parse_args()
    samples = make_samples(args.targets, args.seconds, seed=42)
    encoded = [convert.sample_to_pb(s).SerializeToString() for s in samples]

    rates, p50s, p99s, decode_rates, with_decode_rates = [], [], [], [], []
    commands = 0
    from sits.v1 import events_pb2

    for _ in range(args.runs):
        latencies, elapsed, commands = run_engine(samples)
        rates.append(len(samples) / elapsed)
        p50s.append(percentile(latencies, 0.50))
        p99s.append(percentile(latencies, 0.99))
        started = time.perf_counter()
        decoded = [convert.sample_from_pb(events_pb2.MetricSample.FromString(b)) for b in encoded]
        decode_elapsed = time.perf_counter() - started
        decode_rates.append(len(encoded) / decode_elapsed)
        with_decode_rates.append(len(samples) / (elapsed + decode_elapsed))
        del decoded

    clock = ManualClock(1_800_000_000.0)
    engine = DecisionEngine(
        parse_policy((ROOT / "services/decision/default_policy.yaml").read_text()),
        clock,
        {s.target.engine: EngineProfile(known_model("llama-3-8b")) for s in samples[:1000]},
    )
    for sample in samples[: args.targets * 50]:
        engine.observe(sample)
    admit_us = []
    targets = [s.target for s in samples[: args.targets]]
    perf = time.perf_counter_ns
    for i in range(50_000):
        target = targets[i % len(targets)]
        begin = perf()
        engine.admit(target, 512 + i % 4096, 256, Tier.P1)
        admit_us.append((perf() - begin) / 1e3)

    result = {
        "name": "decision_throughput",
        "measured_at": utc_stamp(),
        "machine": "2-core CPU machine",
        "command": "python -m bench.decision_throughput",
        "figures": {
            "samples_per_s_per_core": round(statistics.median(rates)),
            "p50_ms": round(statistics.median(p50s), 4),
            "p99_ms": round(statistics.median(p99s), 4),
            "samples_per_s_per_core_with_protobuf_decode": round(statistics.median(with_decode_rates)),
            "admit_p50_us": round(percentile(admit_us, 0.5), 2),
            "admit_p99_us": round(percentile(admit_us, 0.99), 2),
            "samples": len(samples),
            "targets": args.targets,
            "commands": commands,
            "runs": args.runs,
        },
        "baseline": {"protobuf_decode_samples_per_s": round(statistics.median(decode_rates))},
        "goal": {"samples_per_s_per_core": 20000, "p99_ms": 5.0},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
