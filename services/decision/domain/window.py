"""Per-target bounded window of recent samples, with input checks.

Bad samples (out of order, duplicated, missing fields, absurd values) are
dropped with a counted reason before they can reach the window, so one bad
producer can neither crash the service nor bend a forecast.
"""

from __future__ import annotations

import enum
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator

from services.decision.domain.forecast import EnvelopeTrend
from services.decision.domain.types import AllocatorStats, EngineLoad, GpuMemory, Sample, TierLoad

# Sample clocks of different sources on one host may disagree by a little.
ORDER_TOLERANCE_S = 0.05
# Real GPUs top out below 1 TiB; anything larger is a unit error.
MAX_PLAUSIBLE_BYTES = 1 << 40
MAX_PLAUSIBLE_COUNT = 1 << 40


class DropReason(enum.Enum):
    DUPLICATE = "duplicate"
    OUT_OF_ORDER = "out_of_order"
    MISSING_FIELDS = "missing_fields"
    ABSURD_VALUE = "absurd_value"


class DropCounter:
    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def add(self, reason: DropReason) -> None:
        self._counts[reason.value] += 1

    def get(self, reason: DropReason) -> int:
        return self._counts[reason.value]

    def as_dict(self) -> dict[str, int]:
        return dict(self._counts)

    def total(self) -> int:
        return sum(self._counts.values())


def _bad_bytes(value: int) -> bool:
    return value < 0 or value > MAX_PLAUSIBLE_BYTES


def _bad_count(value: int) -> bool:
    return value < 0 or value > MAX_PLAUSIBLE_COUNT


def check_values(sample: Sample) -> DropReason | None:
    """Why this sample cannot be used on its own, or None when it is sound."""
    if not math.isfinite(sample.t) or sample.t < 0:
        return DropReason.ABSURD_VALUE
    gpu, engine, allocator = sample.gpu, sample.engine, sample.allocator
    if gpu is None and engine is None and allocator is None:
        return DropReason.MISSING_FIELDS
    if gpu is not None:
        if gpu.total_bytes == 0:
            return DropReason.MISSING_FIELDS
        if (
            _bad_bytes(gpu.total_bytes)
            or _bad_bytes(gpu.used_bytes)
            or gpu.used_bytes > gpu.total_bytes
            or _bad_bytes(gpu.reserved_bytes)
            or _bad_bytes(gpu.free_bytes)
            or gpu.free_bytes > gpu.total_bytes
            or not (math.isfinite(gpu.utilization_pct) and 0.0 <= gpu.utilization_pct <= 100.0)
        ):
            return DropReason.ABSURD_VALUE
        for proc in sample.processes:
            if _bad_bytes(proc.used_bytes) or proc.used_bytes > gpu.total_bytes:
                return DropReason.ABSURD_VALUE
    elif any(_bad_bytes(proc.used_bytes) for proc in sample.processes):
        return DropReason.ABSURD_VALUE
    if engine is not None and _bad_engine(engine):
        return DropReason.ABSURD_VALUE
    if allocator is not None and _bad_allocator(allocator, gpu):
        return DropReason.ABSURD_VALUE
    return None


def _bad_engine(engine: EngineLoad) -> bool:
    if not (math.isfinite(engine.kv_cache_usage) and 0.0 <= engine.kv_cache_usage <= 1.0):
        return True
    counts = (
        engine.num_requests_running,
        engine.num_requests_waiting,
        engine.num_preemptions,
        engine.admission_rejections,
        engine.tokens_in_flight,
        engine.kv_blocks_total,
        engine.kv_blocks_used,
        engine.block_size,
        engine.lora_adapters_loaded,
    )
    if any(_bad_count(c) for c in counts):
        return True
    if any(_bad_tier(t) for t in engine.tiers):
        return True
    return engine.kv_blocks_total > 0 and engine.kv_blocks_used > engine.kv_blocks_total


def _bad_tier(tier: TierLoad) -> bool:
    if tier.tier not in (0, 1, 2):
        return True
    waits = (tier.oldest_wait_s, tier.queue_wait_p50_s, tier.queue_wait_p90_s)
    if any(not (math.isfinite(w) and 0.0 <= w <= 86_400.0) for w in waits):
        return True
    return any(
        _bad_count(c)
        for c in (tier.running, tier.waiting, tier.queue_wait_samples, tier.preemptions, tier.scheduled, tier.kv_blocks)
    )


def _bad_allocator(allocator: AllocatorStats, gpu: GpuMemory | None) -> bool:
    if (
        _bad_bytes(allocator.allocated_bytes)
        or _bad_bytes(allocator.reserved_bytes)
        or _bad_bytes(allocator.inactive_split_bytes)
        or _bad_count(allocator.alloc_retries)
        or _bad_count(allocator.num_ooms)
    ):
        return True
    # The caching allocator never hands out more than it has reserved.
    if allocator.allocated_bytes > allocator.reserved_bytes:
        return True
    return gpu is not None and allocator.reserved_bytes > gpu.total_bytes


class TargetWindow:
    """Recent accepted samples of one target, the latest state of each source, and the trends."""

    def __init__(
        self,
        max_samples: int = 1200,
        max_age_s: float = 120.0,
        bucket_s: float = 0.5,
        trend_window_s: float = 60.0,
        min_history_s: float = 0.0,
        young_horizon_s: float = math.inf,
        dedup_ids: int = 4096,
    ) -> None:
        if max_samples <= 0 or max_age_s <= 0:
            raise ValueError("a window needs a positive size and age")
        self.max_age_s = max_age_s
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self.memory = EnvelopeTrend(
            bucket_s, trend_window_s, min_history_s=min_history_s, young_horizon_s=young_horizon_s
        )
        self.kv_usage = EnvelopeTrend(
            bucket_s, trend_window_s, min_history_s=min_history_s, young_horizon_s=young_horizon_s
        )
        self.drops = DropCounter()
        self.accepted = 0
        self.latest_gpu: GpuMemory | None = None
        self.latest_engine: EngineLoad | None = None
        # The latest reading of the SITS plugin (tiers, limits, exact KV blocks): other engine sources
        # (GetLoads, KV events, /metrics) interleave with it and carry none of that.
        self.latest_plugin: EngineLoad | None = None
        self.latest_plugin_t = -math.inf
        self.latest_allocator: AllocatorStats | None = None
        # The engine's own device memory in the latest sample that listed processes (0: never seen).
        self.latest_engine_bytes = 0
        self.latest_t = -math.inf
        self._gpu_t = -math.inf
        self._sequences: dict[str, int] = {}
        self._seen_ids: OrderedDict[str, None] = OrderedDict()
        self._dedup_ids = dedup_ids

    def offer(self, sample: Sample) -> DropReason | None:
        """Accept the sample into the window, or say why it was dropped (and count it)."""
        reason = self._check(sample)
        if reason is not None:
            self.drops.add(reason)
            return reason
        self._accept(sample)
        return None

    def _check(self, sample: Sample) -> DropReason | None:
        if sample.event_id and sample.event_id in self._seen_ids:
            return DropReason.DUPLICATE
        reason = check_values(sample)
        if reason is not None:
            return reason
        if sample.sequence:
            last = self._sequences.get(sample.source)
            if last is not None and sample.sequence <= last:
                return DropReason.DUPLICATE if sample.sequence == last else DropReason.OUT_OF_ORDER
        if sample.gpu is not None and sample.t < self._gpu_t - ORDER_TOLERANCE_S:
            return DropReason.OUT_OF_ORDER
        if sample.t < self.latest_t - self.max_age_s:
            return DropReason.OUT_OF_ORDER
        return None

    def _accept(self, sample: Sample) -> None:
        self.accepted += 1
        if sample.event_id:
            self._seen_ids[sample.event_id] = None
            if len(self._seen_ids) > self._dedup_ids:
                self._seen_ids.popitem(last=False)
        if sample.sequence:
            self._sequences[sample.source] = sample.sequence
        t = sample.t
        if t > self.latest_t:
            self.latest_t = t
        gpu = sample.gpu
        if gpu is not None:
            self.latest_gpu = gpu
            self._gpu_t = max(self._gpu_t, t)
            self.memory.add(t, gpu.used_bytes / gpu.total_bytes)
        engine_bytes = sample.engine_process_bytes
        if engine_bytes:
            self.latest_engine_bytes = engine_bytes
        if sample.engine is not None:
            self.latest_engine = sample.engine
            if sample.engine.tiers:
                self.latest_plugin = sample.engine
                self.latest_plugin_t = t
            self.kv_usage.add(t, sample.engine.kv_cache_usage)
        if sample.allocator is not None:
            self.latest_allocator = sample.allocator
        self.samples.append(sample)
        horizon = self.latest_t - self.max_age_s
        samples = self.samples
        while samples and samples[0].t < horizon:
            samples.popleft()

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def memory_fraction(self) -> float:
        gpu = self.latest_gpu
        return 0.0 if gpu is None else gpu.used_bytes / gpu.total_bytes

    @property
    def fragmentation(self) -> float:
        """Share of the allocator's reserved memory that is not allocated."""
        alloc = self.latest_allocator
        if alloc is None or alloc.reserved_bytes <= 0:
            return 0.0
        return (alloc.reserved_bytes - alloc.allocated_bytes) / alloc.reserved_bytes
