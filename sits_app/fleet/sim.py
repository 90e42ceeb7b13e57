"""A fleet of simulated GPUs: recorded H200 traces, shifted and mixed, published through capture's own path.

Each simulated target (one engine on one GPU; hosts of `gpus_per_host` GPUs) replays one of the recorded
traces under traces/ (`h200/`: NVML and allocator at real memory shapes, `h200_vllm/`: real vLLM with and
without SITS, several of which run out of memory), started at its own offset into the trace so the fleet
does not move in lockstep, and looped. Every tick (1/hz s) each target's sample at its current trace time is
stamped with the wall clock, a sequence number and an event id, and handed to `CapturePublisher.submit`,
exactly as a capture source hands its samples: the publisher packs, publishes, spools and retries as it does
in the capture service. Hosts are sampled in groups spread over the tick, as unsynchronised hosts would be. A
tick that cannot keep up is not made up for: the achieved rate is reported.

Frames are built once per trace (at the simulation rate) and copied per target, so a sample costs the
simulator a protobuf copy and three fields, not a conversion from JSON.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.capture.publisher import CapturePublisher
from sits.runtime.traces import TraceTarget, read_trace, record_to_sample
from sits.v1 import common_pb2, events_pb2

REPO = Path(__file__).resolve().parents[2]
TRACE_DIRS = (REPO / "traces" / "h200", REPO / "traces" / "h200_vllm")
# A trace that never runs out of memory and stays under this is a calm GPU's; the rest are incidents.
CALM_PEAK = 0.9
# Hosts sampled together at one point of the period (32 hosts of 8 GPUs: 256 samples).
HOSTS_PER_SLICE = 32


@dataclass(frozen=True)
class TraceFrames:
    """One recorded trace resampled at the simulation rate: a MetricSample template per frame."""

    name: str
    frames: tuple[events_pb2.MetricSample, ...]
    heads_to_oom: bool
    peak_fraction: float = 0.0


def trace_paths(dirs: Iterable[Path] = TRACE_DIRS) -> list[Path]:
    return sorted(p for d in dirs for p in d.glob("*.jsonl*"))


def load_frames(path: Path, hz: float) -> TraceFrames:
    trace = read_trace(path)
    samples = [r for r in trace.records if r.get("kind") == "sample" and r.get("gpu")]
    if not samples:
        raise ValueError(f"{path}: no samples with GPU memory")
    ooms = any(r.get("kind") == "oom" for r in trace.records)
    duration = float(samples[-1]["t"]) or 1.0
    frames = []
    index = 0
    empty = TraceTarget()
    for step in range(max(1, int(duration * hz))):
        t = step / hz
        while index + 1 < len(samples) and float(samples[index + 1]["t"]) <= t:
            index += 1
        frames.append(record_to_sample(samples[index], empty, produced_at=0.0, sequence=0, event_id=""))
    peak = max((f.gpu.used_bytes / f.gpu.total_bytes for f in frames if f.gpu.total_bytes), default=0.0)
    return TraceFrames(trace.header.name or path.stem, tuple(frames), ooms, peak)


@dataclass
class SimTarget:
    target: common_pb2.Target
    trace: TraceFrames
    offset: int
    sequence: int = 0


@dataclass
class FleetStats:
    ticks: int = 0
    late_ticks: int = 0
    submitted: int = 0
    started_at: float = 0.0
    stopped_at: float | None = None

    def rate(self, now: float) -> float:
        end = self.stopped_at if self.stopped_at is not None else now
        return self.submitted / max(1e-9, end - self.started_at)


class Fleet:
    """`targets` simulated GPUs over the given traces; `run` submits their samples until stopped."""

    def __init__(
        self,
        traces: Sequence[TraceFrames],
        targets: int,
        *,
        hz: float = 10.0,
        gpus_per_host: int = 8,
        host_prefix: str = "fleet-host",
        engine_prefix: str = "fleet",
        seed: int = 22,
        incident_fraction: float = 0.1,
    ) -> None:
        """`incident_fraction` of the targets replay the traces recorded during incidents (memory near the
        limit, most running out); the others the calm ones. A fleet is mostly healthy: were every GPU in an
        incident at once, the commands, not the samples, would be what the run measured."""
        if not traces:
            raise ValueError("no traces to replay")
        calm = [t for t in traces if not t.heads_to_oom and t.peak_fraction < CALM_PEAK]
        incidents = [t for t in traces if t not in calm]
        rng = random.Random(seed)
        self.hz = hz
        self._per_host = gpus_per_host
        self.targets: list[SimTarget] = []
        for i in range(targets):
            pool = incidents if (not calm or (incidents and rng.random() < incident_fraction)) else calm
            trace = pool[i % len(pool)]
            target = common_pb2.Target(
                host=f"{host_prefix}-{i // gpus_per_host}", gpu_uuid=f"GPU-sim-{i:06d}", engine=f"{engine_prefix}-{i}"
            )
            # Shifted: each target starts at its own point of its trace, so OOMs and bursts spread over time.
            self.targets.append(SimTarget(target, trace, rng.randrange(len(trace.frames))))
        self.stats = FleetStats()

    def heading_to_oom(self) -> int:
        return sum(1 for t in self.targets if t.trace.heads_to_oom)

    def in_incident(self) -> int:
        return sum(1 for t in self.targets if t.trace.heads_to_oom or t.trace.peak_fraction >= CALM_PEAK)

    def tick(self, publisher: CapturePublisher, step: int, now: float, hosts: range | None = None) -> None:
        """Submit the samples of step `step` of every target (or of the targets on `hosts`), stamped `now`."""
        stamp = int(now * 1e9)
        chosen = (
            self.targets if hosts is None else self.targets[hosts.start * self._per_host : hosts.stop * self._per_host]
        )
        for sim in chosen:
            frames = sim.trace.frames
            sample = events_pb2.MetricSample()
            sample.CopyFrom(frames[(sim.offset + step) % len(frames)])
            sim.sequence += 1
            sample.sequence = sim.sequence
            meta = sample.meta
            meta.event_id = uuid.uuid4().hex
            meta.source = "capture/fleet"
            meta.target.CopyFrom(sim.target)
            meta.produced_at.FromNanoseconds(stamp)
            publisher.submit(sample)
        self.stats.submitted += len(chosen)

    def host_groups(self) -> list[range]:
        """The hosts in groups of at most HOSTS_PER_SLICE, each sampled at its own point of the period.

        Real hosts are not in step, and one process submitting thousands of samples at once would hold its
        event loop (and every other task on it, the publisher included) for that long.
        """
        hosts = -(-len(self.targets) // self._per_host)
        return [range(h, min(hosts, h + HOSTS_PER_SLICE)) for h in range(0, hosts, HOSTS_PER_SLICE)]

    async def run(self, publisher: CapturePublisher, stop: asyncio.Event) -> None:
        period = 1.0 / self.hz
        self.stats.started_at = start = time.monotonic()
        try:
            await self._run(publisher, stop, start, period)
        finally:
            self.stats.stopped_at = time.monotonic()

    async def _run(self, publisher: CapturePublisher, stop: asyncio.Event, start: float, period: float) -> None:
        groups = self.host_groups()
        step = 0
        while not stop.is_set():
            for i, hosts in enumerate(groups):
                phase = start + (step + i / len(groups)) * period - time.monotonic()
                if phase > 0:
                    await asyncio.sleep(phase)
                elif i:
                    await asyncio.sleep(0)
                if stop.is_set():
                    return
                self.tick(publisher, step, time.time(), hosts)
            self.stats.ticks += 1
            step += 1
            delay = start + step * period - time.monotonic()
            if delay < 0:
                # Behind: skip the missed ticks rather than burst to catch up (a real GPU does not wait either).
                self.stats.late_ticks += 1
                missed = int(-delay / period) + 1
                step += missed - 1
                delay = start + step * period - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
