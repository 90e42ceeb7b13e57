"""Domain input and output types of the decision service.

They mirror the sits.v1 protobuf fields (events.proto, decision.proto) but are
plain frozen dataclasses, so the domain never imports generated code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sits.runtime.contract import ActionKind, format_target_key
from sits.runtime.promise import Promise


@dataclass(frozen=True, slots=True)
class Target:
    host: str = ""
    gpu_uuid: str = ""
    mig_instance: str = ""
    engine: str = ""

    @property
    def key(self) -> str:
        return format_target_key(self)

    def gpu_level(self) -> Target:
        """The GPU (or MIG instance) this engine runs on, for GPU-wide commands."""
        return Target(self.host, self.gpu_uuid, self.mig_instance, "")


@dataclass(frozen=True, slots=True)
class GpuMemory:
    used_bytes: int
    total_bytes: int
    reserved_bytes: int = 0
    free_bytes: int = 0
    utilization_pct: float = 0.0


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    pid: int
    used_bytes: int
    name: str = ""
    is_target_engine: bool = False


@dataclass(frozen=True, slots=True)
class TierLoad:
    """One tier's queueing inside the engine (the SITS scheduler plugin's signals)."""

    tier: int
    running: int = 0
    waiting: int = 0
    oldest_wait_s: float = 0.0
    queue_wait_p50_s: float = 0.0
    queue_wait_p90_s: float = 0.0
    queue_wait_samples: int = 0
    preemptions: int = 0
    scheduled: int = 0
    kv_blocks: int = 0


@dataclass(frozen=True, slots=True)
class EngineLoad:
    kv_cache_usage: float = 0.0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_preemptions: int = 0
    admission_rejections: int = 0
    tokens_in_flight: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    block_size: int = 0
    lora_adapters_loaded: int = 0
    # From the SITS plugin: per-tier queueing, the live running cap and the engine's slot count.
    tiers: tuple[TierLoad, ...] = ()
    running_cap: int = 0
    max_num_seqs: int = 0
    # The live token budget of one step (limits.max_num_scheduled_tokens) and its start-up ceiling
    # (max_num_batched_tokens); 0 when the source does not know them.
    token_budget: int = 0
    max_num_batched_tokens: int = 0

    def tier(self, tier: int) -> TierLoad | None:
        return next((t for t in self.tiers if t.tier == tier), None)


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    inactive_split_bytes: int = 0
    alloc_retries: int = 0
    num_ooms: int = 0
    # Allocated between steps (weights, KV cache, buffers); 0 when unknown.
    allocated_floor_bytes: int = 0
    # The device's free memory read in the same moment (the plugin); 0 when unknown.
    device_free_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Sample:
    """One MetricSample. `t` is the producer's wall time in seconds; sub-objects may be absent."""

    target: Target
    t: float
    event_id: str = ""
    source: str = ""
    sequence: int = 0
    gpu: GpuMemory | None = None
    processes: tuple[ProcessMemory, ...] = ()
    engine: EngineLoad | None = None
    allocator: AllocatorStats | None = None

    @property
    def engine_process_bytes(self) -> int | None:
        """The target engine's own device memory (its processes); None when no process of it is listed."""
        own = [p.used_bytes for p in self.processes if p.is_target_engine]
        return sum(own) if own else None


@dataclass(frozen=True, slots=True)
class OomEvent:
    target: Target
    t: float
    event_id: str = ""
    requested_bytes: int = 0
    device_free_bytes: int = 0
    device_total_bytes: int = 0
    allocator: AllocatorStats | None = None
    message: str = ""


class RootCauseKind(enum.Enum):
    """Names of sits.v1.RootCauseKind without the ROOT_CAUSE_KIND_ prefix."""

    NONE = "NONE"
    LONG_CONTEXT_KV_GROWTH = "LONG_CONTEXT_KV_GROWTH"
    ADAPTER_LEAK = "ADAPTER_LEAK"
    COLLECTIVE_BUFFER_GROWTH = "COLLECTIVE_BUFFER_GROWTH"
    FRAGMENTATION = "FRAGMENTATION"
    MULTI_TENANT_CONTENTION = "MULTI_TENANT_CONTENTION"


@dataclass(frozen=True, slots=True)
class Evidence:
    name: str
    value: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RootCause:
    kind: RootCauseKind
    confidence: float
    evidence: tuple[Evidence, ...] = ()


NO_ROOT_CAUSE = RootCause(RootCauseKind.NONE, 0.0)


@dataclass(frozen=True, slots=True)
class Forecast:
    memory_fraction: float
    # Seconds until memory reaches the policy's limit fraction; None when the
    # trend does not reach it within the horizon.
    time_to_limit_s: float | None
    confidence: float
    predicted_fraction: float
    slope_bytes_per_s: float
    model: str
    kv_cache_usage: float = 0.0
    fragmentation: float = 0.0
    # Seconds until the engine's KV pool is full at the current trend of KV usage.
    kv_time_to_full_s: float | None = None


@dataclass(frozen=True, slots=True)
class PlannedCommand:
    """A HealingCommand before it is given an envelope (event meta, trace link)."""

    command_id: str
    target: Target
    kind: ActionKind
    params: dict[str, object]
    reason: str
    evidence: tuple[Evidence, ...]
    rule: str
    policy_version: int
    target_memory_fraction: float
    issued_at: float
    deadline: float
    cause_event_id: str = ""
    trace_id: str = ""
    root_cause: RootCause = field(default=NO_ROOT_CAUSE)
    promise: Promise = field(default_factory=Promise)
