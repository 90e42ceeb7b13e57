"""The fleet simulator: recorded H200 traces, shifted and mixed over many targets, through capture's publisher
into a real broker (`sits fleet`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.reliability_harness import read_topics
from sits.runtime.bus import partition_of
from sits.runtime.contract import format_target_key
from sits.runtime.events import Topics
from sits.runtime.settings import Settings
from sits.v1 import events_pb2
from sits_app.fleet.sim import Fleet, load_frames, trace_paths
from sits_app.stack.tansu import TansuBroker


class Collect:
    """Stands in for the publisher's intake in this pure test (the broker test below uses the real one)."""

    def __init__(self) -> None:
        self.samples: list[events_pb2.MetricSample] = []

    def submit(self, sample: events_pb2.MetricSample) -> None:
        self.samples.append(sample)


@pytest.fixture(scope="module")
def frames() -> list:
    return [load_frames(p, 10.0) for p in trace_paths()]


def test_the_fleet_mixes_every_trace_shifted_per_target(frames: list) -> None:
    assert len(frames) >= 10 and any(f.heads_to_oom for f in frames) and not all(f.heads_to_oom for f in frames)
    fleet = Fleet(frames, 260, hz=10.0)
    sink = Collect()
    for step in range(3):
        fleet.tick(sink, step, 1_000_000.0 + step / 10)  # type: ignore[arg-type]
    assert len(sink.samples) == 3 * 260
    keys = Counter(format_target_key(s.meta.target) for s in sink.samples)
    assert len(keys) == 260 and set(keys.values()) == {3}
    # Each target numbers its own samples; every event is its own.
    per_target: dict[str, list[int]] = {}
    for s in sink.samples:
        per_target.setdefault(format_target_key(s.meta.target), []).append(s.sequence)
    assert all(seqs == [1, 2, 3] for seqs in per_target.values())
    assert len({s.meta.event_id for s in sink.samples}) == len(sink.samples)
    # Shifted: the targets replaying one trace are not in lockstep.
    same_trace = [t for t in fleet.targets if t.trace is fleet.targets[0].trace]
    assert len(same_trace) > 20 and len({t.offset for t in same_trace}) > len(same_trace) // 2
    first = {format_target_key(s.meta.target): s for s in sink.samples[: len(fleet.targets)]}
    frames_used = {first[format_target_key(t.target)].gpu.used_bytes for t in same_trace}
    assert len(frames_used) > 1, "the targets of one trace show different moments of it"
    # Mostly calm, with some in an incident (about the default 10%), several of those running out.
    assert 0 < fleet.heading_to_oom() <= fleet.in_incident() and 10 <= fleet.in_incident() <= 50
    calm = [t for t in fleet.targets if t.trace.peak_fraction < 0.9 and not t.trace.heads_to_oom]
    assert len(calm) == 260 - fleet.in_incident()
    # Hosts of 8 GPUs, and the targets spread over every partition.
    assert len({t.target.host for t in fleet.targets}) == 260 // 8 + 1
    assert {partition_of(k, 8) for k in keys} == set(range(8))


@pytest.mark.timeout(90)
def test_sits_fleet_publishes_through_capture_into_the_broker(broker: TansuBroker, topic_prefix: str) -> None:
    env = {**os.environ, "SITS_KAFKA_BOOTSTRAP": broker.bootstrap, "SITS_TOPIC_PREFIX": topic_prefix}
    done = subprocess.run(
        [sys.executable, "-m", "sits_app.cli", "fleet", "--targets", "40", "--hz", "5", "--for", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=80,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "40 targets at 5 Hz" in done.stdout

    import asyncio

    topics = Topics(topic_prefix)
    records = asyncio.run(read_topics(Settings(kafka_bootstrap=broker.bootstrap).kafka_bootstrap, topics.samples))
    lanes = [r for t in topics.samples for r in records[t]]
    samples = [m for r in lanes for m in r.events() if isinstance(m, events_pb2.MetricSample)]
    targets = {format_target_key(s.meta.target) for s in samples}
    assert len(targets) == 40
    # About 5 Hz for 4 s per target (a loaded machine may skip ticks, never add them).
    assert 40 * 5 <= len(samples) <= 40 * 5 * 6
    assert all(s.meta.source == "capture/fleet" and s.gpu.total_bytes > 0 for s in samples)
