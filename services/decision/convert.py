"""Adapter between sits.v1 protobuf messages and the decision domain's dataclasses."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from services.decision.domain.types import (
    AllocatorStats,
    EngineLoad,
    Evidence,
    Forecast,
    GpuMemory,
    OomEvent,
    PlannedCommand,
    ProcessMemory,
    RootCause,
    Sample,
    Target,
    TierLoad,
)
from sits.runtime.contract import LOWEST_TIER, ActionKind, Tier
from sits.runtime.promise import promise_to_pb
from sits.v1 import common_pb2, decision_pb2, events_pb2

SOURCE = "decision"

_BREAKER_STATES = {
    "OPEN": events_pb2.BREAKER_STATE_OPEN,
    "HALF_OPEN": events_pb2.BREAKER_STATE_HALF_OPEN,
    "CLOSED": events_pb2.BREAKER_STATE_CLOSED,
}


def _seconds(ts: timestamp_pb2.Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def target_from_pb(target: common_pb2.Target) -> Target:
    return Target(target.host, target.gpu_uuid, target.mig_instance, target.engine)


def target_to_pb(target: Target) -> common_pb2.Target:
    return common_pb2.Target(
        host=target.host, gpu_uuid=target.gpu_uuid, mig_instance=target.mig_instance, engine=target.engine
    )


def _allocator_from_pb(a: events_pb2.AllocatorStats) -> AllocatorStats:
    return AllocatorStats(
        a.allocated_bytes,
        a.reserved_bytes,
        a.inactive_split_bytes,
        a.alloc_retries,
        a.num_ooms,
        a.allocated_floor_bytes,
        a.device_free_bytes,
    )


def _allocator_to_pb(a: AllocatorStats) -> events_pb2.AllocatorStats:
    return events_pb2.AllocatorStats(
        allocated_bytes=a.allocated_bytes,
        reserved_bytes=a.reserved_bytes,
        inactive_split_bytes=a.inactive_split_bytes,
        alloc_retries=a.alloc_retries,
        num_ooms=a.num_ooms,
        allocated_floor_bytes=a.allocated_floor_bytes,
        device_free_bytes=a.device_free_bytes,
    )


def sample_from_pb(sample: events_pb2.MetricSample) -> Sample:
    meta = sample.meta
    gpu = None
    if sample.HasField("gpu"):
        g = sample.gpu
        gpu = GpuMemory(g.used_bytes, g.total_bytes, g.reserved_bytes, g.free_bytes, g.utilization_pct)
    engine = None
    if sample.HasField("engine"):
        e = sample.engine
        engine = EngineLoad(
            e.kv_cache_usage,
            e.num_requests_running,
            e.num_requests_waiting,
            e.num_preemptions,
            e.admission_rejections,
            e.tokens_in_flight,
            e.kv_blocks_total,
            e.kv_blocks_used,
            e.block_size,
            e.lora_adapters_loaded,
            tiers=tuple(_tier_from_pb(t) for t in e.tiers),
            running_cap=e.limits.max_num_running_reqs if e.limits.HasField("max_num_running_reqs") else 0,
            max_num_seqs=e.max_num_seqs,
            token_budget=e.limits.max_num_scheduled_tokens if e.limits.HasField("max_num_scheduled_tokens") else 0,
            max_num_batched_tokens=e.max_num_batched_tokens,
        )
    return Sample(
        target=target_from_pb(meta.target),
        t=_seconds(meta.produced_at),
        event_id=meta.event_id,
        source=meta.source,
        sequence=sample.sequence,
        gpu=gpu,
        processes=tuple(ProcessMemory(p.pid, p.used_bytes, p.name, p.is_target_engine) for p in sample.processes),
        engine=engine,
        allocator=_allocator_from_pb(sample.allocator) if sample.HasField("allocator") else None,
    )


def _tier_from_pb(t: events_pb2.TierLoad) -> TierLoad:
    # sits.v1.Priority P0..P2 are 1..3; the domain counts tiers from 0 (P0).
    return TierLoad(
        tier=int(t.priority) - 1,
        running=t.running,
        waiting=t.waiting,
        oldest_wait_s=t.oldest_wait_s,
        queue_wait_p50_s=t.queue_wait_p50_s,
        queue_wait_p90_s=t.queue_wait_p90_s,
        queue_wait_samples=t.queue_wait_samples,
        preemptions=t.preemptions,
        scheduled=t.scheduled,
        kv_blocks=t.kv_blocks,
    )


def _tier_to_pb(t: TierLoad) -> events_pb2.TierLoad:
    return events_pb2.TierLoad(
        priority=common_pb2.Priority.ValueType(t.tier + 1),
        running=t.running,
        waiting=t.waiting,
        oldest_wait_s=t.oldest_wait_s,
        queue_wait_p50_s=t.queue_wait_p50_s,
        queue_wait_p90_s=t.queue_wait_p90_s,
        queue_wait_samples=t.queue_wait_samples,
        preemptions=t.preemptions,
        scheduled=t.scheduled,
        kv_blocks=t.kv_blocks,
    )


def sample_to_pb(sample: Sample) -> events_pb2.MetricSample:
    message = events_pb2.MetricSample(sequence=sample.sequence)
    message.meta.event_id = sample.event_id
    message.meta.source = sample.source
    message.meta.target.CopyFrom(target_to_pb(sample.target))
    message.meta.produced_at.CopyFrom(_timestamp(sample.t))
    if sample.gpu is not None:
        g = sample.gpu
        message.gpu.CopyFrom(
            events_pb2.GpuMemory(
                used_bytes=g.used_bytes,
                total_bytes=g.total_bytes,
                reserved_bytes=g.reserved_bytes,
                free_bytes=g.free_bytes,
                utilization_pct=g.utilization_pct,
            )
        )
    for p in sample.processes:
        message.processes.add(pid=p.pid, used_bytes=p.used_bytes, name=p.name, is_target_engine=p.is_target_engine)
    if sample.engine is not None:
        e = sample.engine
        message.engine.CopyFrom(
            events_pb2.EngineLoad(
                kv_cache_usage=e.kv_cache_usage,
                num_requests_running=e.num_requests_running,
                num_requests_waiting=e.num_requests_waiting,
                num_preemptions=e.num_preemptions,
                admission_rejections=e.admission_rejections,
                tokens_in_flight=e.tokens_in_flight,
                kv_blocks_total=e.kv_blocks_total,
                kv_blocks_used=e.kv_blocks_used,
                block_size=e.block_size,
                lora_adapters_loaded=e.lora_adapters_loaded,
                tiers=[_tier_to_pb(t) for t in e.tiers],
                max_num_seqs=e.max_num_seqs,
            )
        )
        if e.running_cap:
            message.engine.limits.max_num_running_reqs = e.running_cap
    if sample.allocator is not None:
        message.allocator.CopyFrom(_allocator_to_pb(sample.allocator))
    return message


def oom_from_pb(oom: events_pb2.OomEvent) -> OomEvent:
    return OomEvent(
        target=target_from_pb(oom.meta.target),
        t=_seconds(oom.meta.produced_at),
        event_id=oom.meta.event_id,
        requested_bytes=oom.requested_bytes,
        device_free_bytes=oom.device_free_bytes,
        device_total_bytes=oom.device_total_bytes,
        allocator=_allocator_from_pb(oom.allocator) if oom.HasField("allocator") else None,
        message=oom.message,
    )


def priority_from_pb(priority: int) -> Tier | None:
    """The request's tier; None when it names none (PRIORITY_UNSPECIFIED) or an unknown one."""
    try:
        return Tier.from_proto(priority)
    except ValueError:
        return None


def evidence_to_pb(evidence: Evidence) -> common_pb2.Evidence:
    return common_pb2.Evidence(name=evidence.name, value=float(evidence.value), detail=evidence.detail)


def forecast_to_pb(forecast: Forecast) -> decision_pb2.Forecast:
    message = decision_pb2.Forecast(
        memory_fraction=forecast.memory_fraction,
        confidence=forecast.confidence,
        predicted_fraction=forecast.predicted_fraction,
        slope_bytes_per_second=forecast.slope_bytes_per_s,
        model=forecast.model,
    )
    if forecast.time_to_limit_s is not None:
        message.time_to_oom_seconds = forecast.time_to_limit_s
    return message


def root_cause_to_pb(root_cause: RootCause) -> decision_pb2.RootCause:
    return decision_pb2.RootCause(
        kind=decision_pb2.RootCauseKind.Value(f"ROOT_CAUSE_KIND_{root_cause.kind.value}"),
        confidence=root_cause.confidence,
        evidence=[evidence_to_pb(e) for e in root_cause.evidence],
    )


def _tier_param(params: dict[str, object], name: str, default: Tier) -> Tier:
    try:
        return Tier.parse(str(params.get(name)))
    except ValueError:
        return default


def _int(params: dict[str, object], name: str, default: int = 0) -> int:
    value = params.get(name, default)
    return int(value) if isinstance(value, int | float) else default


def _float(params: dict[str, object], name: str, default: float = 0.0) -> float:
    value = params.get(name, default)
    return float(value) if isinstance(value, int | float) else default


def command_to_pb(command: PlannedCommand, source: str = SOURCE) -> events_pb2.HealingCommand:
    """The HealingCommand for a planned command; its event id is the command id (idempotent re-sends)."""
    message = events_pb2.HealingCommand(
        command_id=command.command_id,
        kind=events_pb2.ActionKind.ValueType(command.kind.to_proto()),
        reason=command.reason,
        evidence=[evidence_to_pb(e) for e in command.evidence],
        policy_rule=command.rule,
        policy_version=command.policy_version,
        target_memory_fraction=command.target_memory_fraction,
        cause_event_id=command.cause_event_id,
    )
    message.meta.event_id = command.command_id
    message.meta.source = source
    message.meta.target.CopyFrom(target_to_pb(command.target))
    message.meta.produced_at.CopyFrom(_timestamp(command.issued_at))
    message.deadline.CopyFrom(_timestamp(command.deadline))
    params = command.params
    kind = command.kind
    if kind is ActionKind.SET_ENGINE_LIMITS:
        limits = events_pb2.EngineLimits()
        for name in ("max_num_running_reqs", "max_num_scheduled_tokens", "max_prefill_chunk_tokens"):
            if name in params:
                setattr(limits, name, _int(params, name))
        if "admission_paused" in params:
            limits.admission_paused = bool(params["admission_paused"])
        factor = params.get("max_num_running_reqs_factor")
        if isinstance(factor, int | float):
            limits.max_num_running_reqs_factor = float(factor)
        if params.get("restore_defaults"):
            limits.restore_defaults = True
        message.engine_limits.CopyFrom(limits)
    elif kind is ActionKind.SHED_PRIORITY:
        message.breaker.CopyFrom(
            events_pb2.BreakerSetting(
                priority=common_pb2.Priority.ValueType(_tier_param(params, "priority", LOWEST_TIER).to_proto()),
                state=_BREAKER_STATES.get(str(params.get("state")), events_pb2.BREAKER_STATE_OPEN),
                max_requests=_int(params, "max_requests"),
                ttl_seconds=_int(params, "ttl_seconds", 30),
            )
        )
    elif kind is ActionKind.SET_PRESSURE:
        pressure = params.get("pressure", 0.0)
        message.pressure = float(pressure) if isinstance(pressure, int | float) else 0.0
    elif kind is ActionKind.ABORT_LOW_PRIORITY:
        message.abort.CopyFrom(
            events_pb2.AbortParams(
                at_or_below=common_pb2.Priority.ValueType(_tier_param(params, "at_or_below", LOWEST_TIER).to_proto()),
                max_streams=_int(params, "max_streams", 1),
            )
        )
    elif kind is ActionKind.MIG_REBALANCE:
        tenants = params.get("tenant_bytes", {})
        mig = events_pb2.MigRebalanceParams(dry_run=bool(params.get("dry_run", True)))
        if isinstance(tenants, dict):
            for name, used in tenants.items():
                mig.tenant_bytes[str(name)] = int(used)
        message.mig.CopyFrom(mig)
    elif kind is ActionKind.SET_TIER_BUDGET:
        budget = events_pb2.TierBudget(
            lower_tier_budget=_int(params, "budget", -1),
            lease_seconds=_float(params, "lease_s"),
            drain_backlog=bool(params.get("drain_backlog", False)),
        )
        tier_limits = params.get("limits", {})
        if isinstance(tier_limits, dict):
            for tier, max_requests in sorted(tier_limits.items()):
                budget.limits.add(priority=Tier(int(tier)).to_proto(), max_requests=int(max_requests))
        message.tier_budget.CopyFrom(budget)
    message.promise.CopyFrom(promise_to_pb(command.promise))
    return message
