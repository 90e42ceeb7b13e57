"""Root cause of memory pressure, with the evidence that points at it.

Each cause is scored in [0, 1] by comparing the early and the late part of
the window (medians, so a single spike does not decide), then the strongest
one wins if it clears `MIN_SCORE`. The causes read different signals, which is
what keeps them apart:

- long-context KV growth: tokens in flight (and KV usage) rising;
- adapter leak: adapters unloaded but memory not coming back;
- collective-buffer growth: the engine process's NVML memory minus the
  allocator's reserved bytes rising, i.e. memory outside PyTorch (NCCL);
- fragmentation: reserved-minus-allocated and inactive split bytes high while
  allocated is far from the limit: a state, not a growth;
- multi-tenant contention: other processes on the same GPU / MIG instance growing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.decision.domain.types import (
    NO_ROOT_CAUSE,
    AllocatorStats,
    Evidence,
    RootCause,
    RootCauseKind,
    Sample,
)

MIB = 1024 * 1024
GIB = 1024 * MIB
MIN_SCORE = 0.3
# Classification looks at this many samples at most (evenly spread over the window).
MAX_POINTS = 60
FRAGMENTATION_FLOOR = 0.35
FAR_FROM_LIMIT = 0.85


def _clamp(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


@dataclass(frozen=True, slots=True)
class _Series:
    early: float
    late: float

    @property
    def delta(self) -> float:
        return self.late - self.early


def _series(samples: Sequence[Sample], get: Callable[[Sample], float | None]) -> _Series | None:
    values = [v for v in (get(s) for s in samples) if v is not None]
    if len(values) < 3:
        return None
    third = max(1, len(values) // 3)
    return _Series(statistics.median(values[:third]), statistics.median(values[-third:]))


def _decimate(samples: Sequence[Sample]) -> list[Sample]:
    n = len(samples)
    if n <= MAX_POINTS:
        return list(samples)
    step = n / MAX_POINTS
    return [samples[int(i * step)] for i in range(MAX_POINTS - 1)] + [samples[-1]]


def _used(s: Sample) -> float | None:
    return None if s.gpu is None else float(s.gpu.used_bytes)


def _tokens(s: Sample) -> float | None:
    return None if s.engine is None else float(s.engine.tokens_in_flight)


def _kv_usage(s: Sample) -> float | None:
    return None if s.engine is None else s.engine.kv_cache_usage


def _target_process(s: Sample) -> float | None:
    own = s.engine_process_bytes
    return None if own is None else float(own)


def _outside_allocator(s: Sample) -> float | None:
    own = _target_process(s)
    if own is None or s.allocator is None:
        return None
    return own - s.allocator.reserved_bytes


def _others(s: Sample) -> float | None:
    if not s.processes:
        return None
    return float(sum(p.used_bytes for p in s.processes if not p.is_target_engine))


def _allocated(s: Sample) -> float | None:
    if s.allocator is not None:
        return float(s.allocator.allocated_bytes)
    return _target_process(s) if s.processes else _used(s)


def classify(
    samples: Sequence[Sample], *, kv_bytes_per_token: int | None = None, oom_allocator: AllocatorStats | None = None
) -> RootCause:
    points = _decimate(samples)
    if len(points) < 3:
        return NO_ROOT_CAUSE
    total = next((s.gpu.total_bytes for s in reversed(points) if s.gpu is not None), 0)
    if total <= 0:
        return NO_ROOT_CAUSE
    floor = max(256 * MIB, 0.01 * total)
    used = _series(points, _used)
    used_growth = max(0.0, used.delta) if used is not None else 0.0
    candidates = [
        _kv_growth(points, kv_bytes_per_token, used_growth, floor),
        _adapter_leak(points, total),
        _collective_growth(points, used_growth, floor),
        _fragmentation(points, total, oom_allocator),
        _contention(points, used_growth, floor),
    ]
    best = max(candidates, key=lambda c: c.confidence)
    if best.confidence < MIN_SCORE:
        return RootCause(RootCauseKind.NONE, round(1.0 - best.confidence, 4), best.evidence)
    return best


def _kv_growth(points: Sequence[Sample], kv_bytes_per_token: int | None, used_growth: float, floor: float) -> RootCause:
    tokens = _series(points, _tokens)
    kv = _series(points, _kv_usage)
    score = 0.0
    evidence: list[Evidence] = []
    if tokens is not None and tokens.delta >= 256:
        ratio = tokens.delta / max(tokens.early, 1.0)
        score = max(score, _clamp(ratio))
        evidence.append(
            Evidence("tokens_in_flight_rise", tokens.delta, f"tokens in flight {tokens.early:.0f} -> {tokens.late:.0f}")
        )
        if kv_bytes_per_token:
            kv_bytes = tokens.delta * kv_bytes_per_token
            evidence.append(
                Evidence("kv_bytes_rise", kv_bytes, f"{kv_bytes / GIB:.2f} GiB more KV at {kv_bytes_per_token} B/token")
            )
            if used_growth >= floor:
                score = max(score, _clamp(kv_bytes / used_growth))
    if kv is not None and kv.delta >= 0.05:
        score = max(score, _clamp(kv.delta / 0.3))
        evidence.append(Evidence("kv_cache_usage_rise", kv.delta, f"KV cache usage {kv.early:.0%} -> {kv.late:.0%}"))
    return RootCause(RootCauseKind.LONG_CONTEXT_KV_GROWTH, round(score, 4), tuple(evidence))


def _adapter_leak(points: Sequence[Sample], total: int) -> RootCause:
    adapters = [(i, s.engine.lora_adapters_loaded) for i, s in enumerate(points) if s.engine is not None]
    if len(adapters) < 3:
        return RootCause(RootCauseKind.ADAPTER_LEAK, 0.0)
    most = max(a for _, a in adapters)
    now = adapters[-1][1]
    if most == 0 or now >= most:
        return RootCause(RootCauseKind.ADAPTER_LEAK, 0.0)
    peak_index = max(i for i, a in adapters if a == most)
    at_peak = _series(points[max(0, peak_index - 4) : peak_index + 1], _allocated)
    after = _series(points[peak_index + 1 :], _allocated)
    if at_peak is None or after is None:
        return RootCause(RootCauseKind.ADAPTER_LEAK, 0.0)
    kept = after.late - at_peak.late
    # Memory should fall after an unload; staying within half a percent of the peak is a leak.
    if kept < -0.005 * total:
        return RootCause(RootCauseKind.ADAPTER_LEAK, 0.0)
    unloaded = most - now
    score = _clamp(0.6 + 0.4 * unloaded / most)
    evidence = (
        Evidence("adapters_unloaded", unloaded, f"LoRA adapters {most} -> {now}"),
        Evidence(
            "memory_not_returned_bytes",
            at_peak.late + kept,
            f"memory {at_peak.late / GIB:.2f} GiB at {most} adapters, {after.late / GIB:.2f} GiB after unload",
        ),
    )
    return RootCause(RootCauseKind.ADAPTER_LEAK, round(score, 4), evidence)


def _collective_growth(points: Sequence[Sample], used_growth: float, floor: float) -> RootCause:
    return _growth_of(
        points,
        _outside_allocator,
        used_growth,
        floor,
        RootCauseKind.COLLECTIVE_BUFFER_GROWTH,
        "outside_allocator_rise_bytes",
        "NVML process memory minus allocator reserved",
    )


def _growth_of(
    points: Sequence[Sample],
    get: Callable[[Sample], float | None],
    used_growth: float,
    floor: float,
    kind: RootCauseKind,
    evidence_name: str,
    what: str,
) -> RootCause:
    """A cause scored by how much of the device's growth one series (memory held by someone) explains."""
    series = _series(points, get)
    if series is None or series.delta < floor:
        return RootCause(kind, 0.0)
    score = _clamp(series.delta / max(used_growth, series.delta))
    evidence = (
        Evidence(evidence_name, series.delta, f"{what} {series.early / GIB:.2f} -> {series.late / GIB:.2f} GiB"),
    )
    return RootCause(kind, round(score, 4), evidence)


def _fragmentation(points: Sequence[Sample], total: int, oom_allocator: AllocatorStats | None) -> RootCause:
    stats = [s.allocator for s in points if s.allocator is not None]
    if oom_allocator is not None:
        stats.append(oom_allocator)
    if not stats:
        return RootCause(RootCauseKind.FRAGMENTATION, 0.0)
    recent = stats[-max(1, len(stats) // 3) :]
    latest = recent[-1]
    if latest.reserved_bytes <= 0:
        return RootCause(RootCauseKind.FRAGMENTATION, 0.0)
    slack = statistics.median(
        (a.reserved_bytes - a.allocated_bytes) / a.reserved_bytes for a in recent if a.reserved_bytes > 0
    )
    inactive = latest.inactive_split_bytes / latest.reserved_bytes
    allocated_fraction = latest.allocated_bytes / total
    if allocated_fraction > FAR_FROM_LIMIT:
        return RootCause(RootCauseKind.FRAGMENTATION, 0.0)
    level = max(slack, inactive)
    if level < FRAGMENTATION_FLOOR * 0.7:
        return RootCause(RootCauseKind.FRAGMENTATION, 0.0)
    score = _clamp(0.5 + (level - FRAGMENTATION_FLOOR) / 0.3)
    evidence = (
        Evidence("reserved_not_allocated_fraction", slack, f"{slack:.0%} of reserved memory is not allocated"),
        Evidence(
            "inactive_split_fraction", inactive, f"{latest.inactive_split_bytes / GIB:.2f} GiB in inactive splits"
        ),
        Evidence("allocated_fraction", allocated_fraction, f"allocated is {allocated_fraction:.0%} of the device"),
    )
    return RootCause(RootCauseKind.FRAGMENTATION, round(score, 4), evidence)


def _contention(points: Sequence[Sample], used_growth: float, floor: float) -> RootCause:
    return _growth_of(
        points,
        _others,
        used_growth,
        floor,
        RootCauseKind.MULTI_TENANT_CONTENTION,
        "co_tenant_rise_bytes",
        "other processes on this GPU",
    )
