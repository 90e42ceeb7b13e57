"""Capture's pure logic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.capture.domain import (
    LatestState,
    SegmentUsage,
    Stamper,
    counter_ids,
    matches,
    plan_spool_compaction,
    validate_oom,
)
from sits.runtime.clock import ManualClock
from sits.v1 import capture_pb2, common_pb2, events_pb2

GIB = 1 << 30


def sample(gpu: str, *, used: int | None = None, kv: float | None = None, at: int = 0) -> events_pb2.MetricSample:
    s = events_pb2.MetricSample()
    s.meta.target.CopyFrom(common_pb2.Target(host="h", gpu_uuid=gpu))
    s.meta.produced_at.FromSeconds(1_700_000_000 + at)
    if used is not None:
        s.gpu.used_bytes = used
    if kv is not None:
        s.engine.kv_cache_usage = kv
    return s


def test_stamper_sequences_per_source_and_keeps_given_ids() -> None:
    ids = iter(["a", "b", "c"])
    stamper = Stamper(ManualClock(start=100.0), new_id=lambda: next(ids))
    first = stamper.stamp_sample(events_pb2.MetricSample(), "nvml")
    second = stamper.stamp_sample(events_pb2.MetricSample(), "nvml")
    other = stamper.stamp_sample(events_pb2.MetricSample(), "replay")
    assert [first.sequence, second.sequence, other.sequence] == [1, 2, 1]
    assert first.meta.event_id == "a" and first.meta.produced_at.seconds == 100
    assert first.meta.source == "capture/nvml"
    given_id = events_pb2.OomEvent()
    given_id.meta.event_id = "keep"
    assert stamper.stamp_oom(given_id).meta.event_id == "keep"


def test_stamper_times_to_the_nanosecond_and_counter_ids_do_not_repeat() -> None:
    stamper = Stamper(ManualClock(start=1_700_000_000.25))
    stamped = [stamper.stamp_sample(events_pb2.MetricSample(), "nvml") for _ in range(3)]
    assert stamped[0].meta.produced_at.ToNanoseconds() == 1_700_000_000_250_000_000
    ids = [s.meta.event_id for s in stamped] + [counter_ids()() for _ in range(2)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_latest_state_merges_parts_and_is_bounded() -> None:
    state = LatestState(max_targets=2)
    state.update(sample("g1", used=5, at=1))
    state.update(sample("g1", kv=0.5, at=2))
    state.update(sample("g1", used=7, at=3))
    merged = state.snapshot(common_pb2.Target(gpu_uuid="g1"))
    assert merged is not None
    assert (merged.gpu.used_bytes, merged.engine.kv_cache_usage) == (7, 0.5)
    state.update(sample("g2", used=1))
    state.update(sample("g3", used=1))
    assert len(state) == 2
    assert state.snapshot(common_pb2.Target(gpu_uuid="g1")) is None  # the longest silent went first
    assert state.snapshot(common_pb2.Target(gpu_uuid="nope")) is None


def test_filter_empty_fields_match_anything() -> None:
    target = common_pb2.Target(host="h", gpu_uuid="g", engine="e")
    assert matches(capture_pb2.TargetFilter(), target)
    assert matches(capture_pb2.TargetFilter(gpu_uuid="g"), target)
    assert not matches(capture_pb2.TargetFilter(gpu_uuid="g", engine="other"), target)


def valid_oom() -> events_pb2.OomEvent:
    event = events_pb2.OomEvent(requested_bytes=GIB, device_free_bytes=GIB // 2, device_total_bytes=80 * GIB)
    event.meta.target.gpu_uuid = "GPU-1"
    return event


def test_valid_oom_passes_and_every_reason_is_listed() -> None:
    assert validate_oom(valid_oom()).ok
    bad = valid_oom()
    bad.requested_bytes = -1
    bad.device_free_bytes = -2
    bad.allocator.num_ooms = -1
    verdict = validate_oom(bad, known_gpus={"GPU-2"})
    assert not verdict.ok
    text = str(verdict)
    for part in (
        "requested_bytes must be positive",
        "device_free_bytes must not be negative",
        "allocator.num_ooms must not be negative",
        "unknown target",
    ):
        assert part in text


@given(st.integers(-(1 << 62), 1 << 62), st.integers(-(1 << 62), 1 << 62), st.integers(-(1 << 62), 1 << 62))
def test_accepted_ooms_are_always_sane(requested: int, free: int, total: int) -> None:
    event = valid_oom()
    event.requested_bytes, event.device_free_bytes, event.device_total_bytes = requested, free, total
    if validate_oom(event).ok:
        assert 0 < requested <= 1 << 50 and 0 <= free <= total <= 1 << 50


def test_compaction_strips_oldest_metric_segments_first() -> None:
    segments = [
        SegmentUsage(1000, 900, 9),
        SegmentUsage(1000, 0, 0),
        SegmentUsage(1000, 800, 8),
        SegmentUsage(500, 500, 5),
    ]
    plan = plan_spool_compaction(segments, 200, False, max_bytes=3000)
    assert plan.strip == (0,) and not plan.drop_incoming
    plan = plan_spool_compaction(segments, 200, False, max_bytes=2000)
    assert plan.strip == (0, 2)
    # Only OOMs left to drop: an incoming OOM is kept beyond the bound, a sample is not.
    only_ooms = [SegmentUsage(1000, 0, 0), SegmentUsage(1000, 0, 0)]
    assert plan_spool_compaction(only_ooms, 100, True, 1500).overflow_bytes == 600
    assert plan_spool_compaction(only_ooms, 100, False, 1500).drop_incoming
    assert plan_spool_compaction(segments, 10, False, max_bytes=10_000).strip == ()


@pytest.mark.parametrize("bad", [0, -1])
def test_latest_state_needs_room(bad: int) -> None:
    with pytest.raises(ValueError):
        LatestState(bad)
