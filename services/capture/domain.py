"""Capture's pure logic: no Kafka, gRPC, network or file I/O; time comes from an injected clock.

- `LatestState`: the latest state of every target, merged across sources (GetSnapshot).
- `Stamper`: gives each event its id, production time and per-source sequence.
- `validate_oom`: every reason an OomEvent is refused (ReportOom answers INVALID_ARGUMENT).
- `plan_spool_compaction`: which spool segments lose their metric samples when the spool is full.
- `matches`: the StreamSamples target filter (the per-client bounded buffer is sits.runtime.fanout).
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sits.runtime.clock import Clock
from sits.runtime.contract import format_target_key, parse_target_key
from sits.v1 import capture_pb2, common_pb2, events_pb2

# Larger than any GPU made or planned (1 PiB): a figure beyond it is a bug in the reporter.
ABSURD_BYTES = 1 << 50


def matches(selector: capture_pb2.TargetFilter | common_pb2.Target, target: common_pb2.Target) -> bool:
    """Empty selector fields match anything."""
    return all(
        not want or want == have
        for want, have in (
            (selector.host, target.host),
            (selector.gpu_uuid, target.gpu_uuid),
            (selector.engine, target.engine),
            (getattr(selector, "mig_instance", ""), target.mig_instance),
        )
    )


# ---------------------------------------------------------------------------- stamping


def counter_ids() -> Callable[[], str]:
    """32 hex digits: 64 random bits drawn once, then a counter.

    Unique across processes like a random id, at a third of the cost of drawing 128 bits per event
    (capture stamps tens of thousands of samples a second).
    """
    prefix = os.urandom(8).hex()
    counter = itertools.count(1)
    return lambda: f"{prefix}{next(counter):016x}"


class Stamper:
    """Stamps event ids, production time and a per-source monotonic sequence."""

    def __init__(self, clock: Clock, new_id: Callable[[], str] | None = None) -> None:
        self._clock = clock
        self._new_id = new_id or counter_ids()
        self._sequences: dict[str, int] = {}

    def stamp_sample(self, sample: events_pb2.MetricSample, source: str) -> events_pb2.MetricSample:
        sequence = self._sequences.get(source, 0) + 1
        self._sequences[source] = sequence
        sample.sequence = sequence
        meta = sample.meta
        if not meta.source:
            meta.source = f"capture/{source}"
        self._stamp_meta(meta)
        return sample

    def stamp_oom(self, event: events_pb2.OomEvent) -> events_pb2.OomEvent:
        self._stamp_meta(event.meta)
        return event

    def _stamp_meta(self, meta: common_pb2.EventMeta) -> None:
        if not meta.event_id:
            meta.event_id = self._new_id()
        if not meta.HasField("produced_at"):
            now = self._clock.now()
            whole = int(now)
            produced = meta.produced_at
            produced.seconds = whole
            produced.nanos = int((now - whole) * 1e9)


# ---------------------------------------------------------------------------- latest state


class LatestState:
    """Latest GPU, process, allocator and engine view per target; bounded in targets.

    Sources see one target from different sides (NVML: the GPU; vLLM: the engine;
    the allocator: the process), so each part keeps its own latest value and a
    snapshot merges them.
    """

    def __init__(self, max_targets: int = 4096) -> None:
        if max_targets < 1:
            raise ValueError("max_targets must be at least 1")
        self._max_targets = max_targets
        self._parts: OrderedDict[str, dict[str, events_pb2.MetricSample]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parts)

    def update(self, sample: events_pb2.MetricSample) -> None:
        key = format_target_key(sample.meta.target)
        parts = self._parts.get(key)
        if parts is None:
            parts = {}
            self._parts[key] = parts
            if len(self._parts) > self._max_targets:
                self._parts.popitem(last=False)  # the target silent for longest
        else:
            self._parts.move_to_end(key)
        for part in ("gpu", "engine", "allocator"):
            if sample.HasField(part):
                parts[part] = sample

    def snapshot(self, selector: common_pb2.Target) -> events_pb2.MetricSample | None:
        """The merged latest view of the most recently updated target matching `selector`."""
        for key in reversed(self._parts):
            target = common_pb2.Target(**parse_target_key(key)._asdict())
            if matches(selector, target):
                return self._merge(target, self._parts[key])
        return None

    @staticmethod
    def _merge(target: common_pb2.Target, parts: dict[str, events_pb2.MetricSample]) -> events_pb2.MetricSample:
        newest = max(parts.values(), key=lambda s: s.meta.produced_at.ToNanoseconds())
        merged = events_pb2.MetricSample()
        merged.CopyFrom(newest)
        merged.meta.target.CopyFrom(target)
        for part in ("gpu", "engine", "allocator"):
            if part in parts:
                getattr(merged, part).CopyFrom(getattr(parts[part], part))
        if "gpu" in parts:
            del merged.processes[:]
            merged.processes.extend(parts["gpu"].processes)
        return merged


# ---------------------------------------------------------------------------- OOM validation


@dataclass(frozen=True)
class Verdict:
    reasons: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.reasons

    def __str__(self) -> str:
        return "; ".join(self.reasons) if self.reasons else "ok"


def validate_oom(event: events_pb2.OomEvent, known_gpus: Iterable[str] = ()) -> Verdict:
    """Every reason this OomEvent cannot be accepted; `known_gpus` empty means any GPU is known."""
    reasons: list[str] = []
    target = event.meta.target
    if not event.HasField("meta") or not event.meta.HasField("target"):
        reasons.append("meta.target is missing")
    elif not target.gpu_uuid and not target.engine:
        reasons.append("meta.target names neither a GPU (gpu_uuid) nor an engine")
    else:
        known = set(known_gpus)
        if known and target.gpu_uuid and target.gpu_uuid not in known:
            reasons.append(f"unknown target: GPU {target.gpu_uuid!r} is not on this host")
    if event.requested_bytes <= 0:
        reasons.append(f"requested_bytes must be positive, got {event.requested_bytes}")
    for name in ("requested_bytes", "device_free_bytes", "device_total_bytes"):
        value = getattr(event, name)
        if value > ABSURD_BYTES:
            reasons.append(f"{name} {value} is beyond any GPU (limit {ABSURD_BYTES})")
    if event.device_free_bytes < 0:
        reasons.append(f"device_free_bytes must not be negative, got {event.device_free_bytes}")
    if event.device_total_bytes <= 0:
        reasons.append(f"device_total_bytes must be positive, got {event.device_total_bytes}")
    elif event.device_free_bytes > event.device_total_bytes:
        reasons.append(
            f"device_free_bytes {event.device_free_bytes} exceeds device_total_bytes {event.device_total_bytes}"
        )
    if event.device_index < 0:
        reasons.append(f"device_index must not be negative, got {event.device_index}")
    if event.pid < 0:
        reasons.append(f"pid must not be negative, got {event.pid}")
    if event.HasField("allocator"):
        for name in ("allocated_bytes", "reserved_bytes", "inactive_split_bytes", "alloc_retries", "num_ooms"):
            value = getattr(event.allocator, name)
            if value < 0:
                reasons.append(f"allocator.{name} must not be negative, got {value}")
            elif value > ABSURD_BYTES:
                reasons.append(f"allocator.{name} {value} is absurd")
        if event.allocator.allocated_bytes > event.allocator.reserved_bytes > 0:
            reasons.append("allocator.allocated_bytes exceeds allocator.reserved_bytes")
    return Verdict(tuple(reasons))


# ---------------------------------------------------------------------------- spool bounding


@dataclass(frozen=True)
class SegmentUsage:
    """What one spool segment holds."""

    total_bytes: int
    metric_bytes: int
    metric_records: int


@dataclass(frozen=True)
class CompactionPlan:
    # Segments (indices, oldest first) whose metric samples are dropped.
    strip: tuple[int, ...] = ()
    # Bytes that stay over the bound because only OOM events are left to drop (they never are).
    overflow_bytes: int = 0
    # The incoming record is a metric sample and there is no room even after stripping: drop it.
    drop_incoming: bool = False


def plan_spool_compaction(
    segments: Sequence[SegmentUsage],
    incoming_bytes: int,
    incoming_is_oom: bool,
    max_bytes: int,
    *,
    protect_last: bool = True,
) -> CompactionPlan:
    """Drop metric samples oldest-first, a segment at a time, until the incoming record fits.

    The newest (open) segment is stripped last, and only when `protect_last` is false:
    rewriting the segment being appended to would race the writer.
    """
    used = sum(s.total_bytes for s in segments)
    need = used + incoming_bytes - max_bytes
    if need <= 0:
        return CompactionPlan()
    strip: list[int] = []
    candidates = range(len(segments) - 1) if protect_last else range(len(segments))
    for index in candidates:
        if need <= 0:
            break
        if segments[index].metric_records:
            strip.append(index)
            need -= segments[index].metric_bytes
    if need <= 0:
        return CompactionPlan(strip=tuple(strip))
    if not incoming_is_oom:
        return CompactionPlan(strip=tuple(strip), drop_incoming=True)
    return CompactionPlan(strip=tuple(strip), overflow_bytes=need)
