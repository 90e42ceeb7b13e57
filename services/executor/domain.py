"""Executor domain: what a command may ask, what it changes, and how to undo it.

Pure: no Kafka, gRPC, Redis or file I/O; time comes in as numbers from an
injected clock. Protobuf messages appear only as data.

- `validate_command` turns a `HealingCommand` into a checked `Plan` or a list
  of reasons (the gRPC API answers INVALID_ARGUMENT with them; nothing is
  applied).
- `Limits` is the engine's complete scheduling state; `merge_limits` applies a
  partial `EngineLimits` to it.
- The priority circuit breaker: one `BreakerRecord` per target and tier, with
  closed → open → half-open → closed driven by a TTL. Tiers shed in order: a
  tier opens only together with every tier below it, and closes only together
  with every tier above it, so P0 is always shed last and admitted first.
- `restore_plan` says what "restore the state before" means for each kind.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from sits.v1 import common_pb2, events_pb2

ActionKind = events_pb2.ActionKind


class Tier(IntEnum):
    """SITS priority tiers; a smaller value is more important (P0 highest)."""

    P0 = 0
    P1 = 1
    P2 = 2

    @classmethod
    def from_proto(cls, priority: int) -> Tier:
        if priority == common_pb2.PRIORITY_P0:
            return cls.P0
        if priority == common_pb2.PRIORITY_P1:
            return cls.P1
        if priority == common_pb2.PRIORITY_P2:
            return cls.P2
        raise ValueError(f"priority {priority} is not P0, P1 or P2")

    def to_proto(self) -> common_pb2.Priority.ValueType:
        return (common_pb2.PRIORITY_P0, common_pb2.PRIORITY_P1, common_pb2.PRIORITY_P2)[self]

    @property
    def mesh_name(self) -> str:
        """The tier's name in the mesh (Envoy cluster suffix, runtime keys): p0, p1, p2."""
        return self.name.lower()


ALL_TIERS: tuple[Tier, ...] = (Tier.P0, Tier.P1, Tier.P2)


# ---------------------------------------------------------------- engine limits


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Fixed facts of an engine that bound what its limits may be."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_chunked_prefill: bool = True


@dataclass(frozen=True, slots=True)
class Limits:
    """The engine's complete live scheduling state (no field unset)."""

    max_num_running_reqs: int
    max_num_scheduled_tokens: int
    # 0: no cap beyond the token budget.
    max_prefill_chunk_tokens: int
    admission_paused: bool

    def as_wire(self) -> dict[str, Any]:
        return {
            "max_num_running_reqs": self.max_num_running_reqs,
            "max_num_scheduled_tokens": self.max_num_scheduled_tokens,
            "max_prefill_chunk_tokens": self.max_prefill_chunk_tokens,
            "admission_paused": self.admission_paused,
        }

    def to_proto(self) -> events_pb2.EngineLimits:
        return events_pb2.EngineLimits(**self.as_wire())

    @classmethod
    def from_proto(cls, message: events_pb2.EngineLimits, fallback: Limits) -> Limits:
        return merge_limits(fallback, message)


def merge_limits(current: Limits, change: events_pb2.EngineLimits) -> Limits:
    """`current` with the fields `change` sets (unset fields are left as they are)."""
    updates: dict[str, Any] = {}
    for name in ("max_num_running_reqs", "max_num_scheduled_tokens", "max_prefill_chunk_tokens", "admission_paused"):
        if change.HasField(name):
            updates[name] = getattr(change, name)
    return replace(current, **updates)


def limit_reasons(change: events_pb2.EngineLimits, info: EngineInfo | None) -> list[str]:
    """Why this limit change is out of range; empty when it is fine."""
    reasons: list[str] = []
    if change.HasField("max_num_running_reqs_factor"):
        factor = change.max_num_running_reqs_factor
        if not 0.0 < factor <= 1.0:
            reasons.append(f"max_num_running_reqs_factor must be in (0, 1], got {factor}")
    if change.HasField("max_num_running_reqs"):
        cap = change.max_num_running_reqs
        if cap < 1:
            reasons.append(f"max_num_running_reqs must be >= 1, got {cap}")
        elif info is not None and cap > info.max_num_seqs:
            reasons.append(f"max_num_running_reqs must be <= the engine's max_num_seqs {info.max_num_seqs}, got {cap}")
    if change.HasField("max_num_scheduled_tokens"):
        budget = change.max_num_scheduled_tokens
        block = info.block_size if info is not None else 1
        if budget < max(1, block):
            reasons.append(f"max_num_scheduled_tokens must be at least one KV block ({block} tokens), got {budget}")
        elif info is not None and budget > info.max_num_batched_tokens:
            reasons.append(
                f"max_num_scheduled_tokens must be <= the engine's max_num_batched_tokens "
                f"{info.max_num_batched_tokens}, got {budget}"
            )
    if change.HasField("max_prefill_chunk_tokens"):
        chunk = change.max_prefill_chunk_tokens
        block = info.block_size if info is not None else 1
        if chunk < 0:
            reasons.append(f"max_prefill_chunk_tokens must be 0 (off) or positive, got {chunk}")
        elif 0 < chunk < block:
            reasons.append(f"max_prefill_chunk_tokens must be 0 (off) or at least one KV block ({block}), got {chunk}")
        elif chunk > 0 and info is not None and not info.enable_chunked_prefill:
            reasons.append("max_prefill_chunk_tokens needs an engine with chunked prefill enabled")
    return reasons


# ---------------------------------------------------------------- in-flight streams


@dataclass(frozen=True, slots=True)
class InFlightRequest:
    request_id: str
    tier: int
    running: bool
    arrival_time: float


def choose_abort_victims(in_flight: Iterable[InFlightRequest], at_or_below: Tier, max_streams: int) -> list[str]:
    """The streams to abort: tier `at_or_below` and lower, lowest tier first, newest first.

    Newest first because it has consumed the least work and is likeliest to be
    retried cheaply by its client.
    """
    eligible = [r for r in in_flight if r.tier >= at_or_below]
    eligible.sort(key=lambda r: (r.tier, r.arrival_time), reverse=True)
    return [r.request_id for r in eligible[: max(0, max_streams)]]


# ---------------------------------------------------------------- circuit breaker


class BreakerState(IntEnum):
    CLOSED = events_pb2.BREAKER_STATE_CLOSED
    OPEN = events_pb2.BREAKER_STATE_OPEN
    HALF_OPEN = events_pb2.BREAKER_STATE_HALF_OPEN


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """Thresholds that hold for every breaker of one executor."""

    # Envoy max_requests for a tier whose breaker is closed (the normal limit).
    closed_max_requests: int = 1024
    # Envoy max_requests while half-open: a few probe requests get through.
    half_open_max_requests: int = 4
    # Open → half-open after the setting's TTL; half-open → closed after this
    # many further TTLs without being opened again.
    half_open_ttls: int = 1
    default_ttl_s: int = 30


@dataclass(frozen=True, slots=True)
class BreakerRecord:
    """One tier's breaker on one target, as stored (in Redis by the adapter)."""

    tier: Tier
    state: BreakerState
    max_requests: int
    opened_at: float = 0.0
    ttl_s: int = 0

    def effective(self, now: float, policy: BreakerPolicy) -> BreakerRecord:
        """The state at `now`: an open breaker half-opens after its TTL and closes after the probation."""
        if self.state is BreakerState.CLOSED:
            return self
        elapsed = now - self.opened_at
        if self.state is BreakerState.OPEN and elapsed < self.ttl_s:
            return self
        if elapsed < self.ttl_s * (1 + policy.half_open_ttls):
            return replace(self, state=BreakerState.HALF_OPEN, max_requests=policy.half_open_max_requests)
        return closed_record(self.tier, policy)

    def expires_at(self, policy: BreakerPolicy) -> float | None:
        """When this record stops mattering (it reads as closed); None for closed ones."""
        if self.state is BreakerState.CLOSED:
            return None
        return self.opened_at + self.ttl_s * (1 + policy.half_open_ttls)

    def to_proto(self) -> events_pb2.BreakerSetting:
        return events_pb2.BreakerSetting(
            priority=self.tier.to_proto(),
            state=events_pb2.BreakerState.ValueType(int(self.state)),
            max_requests=self.max_requests,
            ttl_seconds=self.ttl_s,
        )


def closed_record(tier: Tier, policy: BreakerPolicy) -> BreakerRecord:
    return BreakerRecord(tier=tier, state=BreakerState.CLOSED, max_requests=policy.closed_max_requests)


@dataclass(frozen=True, slots=True)
class BreakerBoard:
    """All tiers' breakers of one target."""

    records: Mapping[Tier, BreakerRecord] = field(default_factory=dict)

    def get(self, tier: Tier, policy: BreakerPolicy) -> BreakerRecord:
        return self.records.get(tier) or closed_record(tier, policy)

    def effective(self, now: float, policy: BreakerPolicy) -> BreakerBoard:
        return BreakerBoard({t: self.get(t, policy).effective(now, policy) for t in ALL_TIERS})

    def to_proto(self, now: float, policy: BreakerPolicy) -> list[events_pb2.BreakerSetting]:
        board = self.effective(now, policy)
        return [board.get(t, policy).to_proto() for t in ALL_TIERS]


def apply_breaker_setting(
    board: BreakerBoard, setting: events_pb2.BreakerSetting, now: float, policy: BreakerPolicy
) -> BreakerBoard:
    """The board after `setting`, keeping shedding ordered by tier.

    Opening (or half-opening) tier T also opens every lower tier that is less
    restricted; closing T also closes every higher tier. So the set of shed
    tiers is always P2, then P1+P2, then all: P0 is shed last.
    """
    tier = Tier.from_proto(setting.priority)
    state = BreakerState(setting.state)
    current = board.effective(now, policy)
    records = dict(current.records)
    if state is BreakerState.CLOSED:
        for other in ALL_TIERS:
            if other <= tier:
                records[other] = closed_record(other, policy)
        return BreakerBoard(records)
    ttl = setting.ttl_seconds or policy.default_ttl_s
    if state is BreakerState.OPEN:
        limit = setting.max_requests
    else:
        limit = setting.max_requests or policy.half_open_max_requests
    opened = BreakerRecord(tier=tier, state=state, max_requests=limit, opened_at=now, ttl_s=ttl)
    records[tier] = opened
    for other in ALL_TIERS:
        if other > tier:
            existing = current.get(other, policy)
            if existing.state is BreakerState.CLOSED or existing.max_requests > limit:
                records[other] = replace(opened, tier=other)
    return BreakerBoard(records)


def board_from_settings(settings: Sequence[events_pb2.BreakerSetting], now: float) -> BreakerBoard:
    """A board that restores recorded settings as they were (used to undo an action)."""
    records: dict[Tier, BreakerRecord] = {}
    for setting in settings:
        tier = Tier.from_proto(setting.priority)
        records[tier] = BreakerRecord(
            tier=tier,
            state=BreakerState(setting.state),
            max_requests=setting.max_requests,
            opened_at=now,
            ttl_s=setting.ttl_seconds,
        )
    return BreakerBoard(records)


def envoy_limits(board: BreakerBoard, now: float, policy: BreakerPolicy) -> dict[Tier, int]:
    """Envoy circuit-breaker max_requests per tier (each tier has its own cluster in the mesh)."""
    effective = board.effective(now, policy)
    return {tier: effective.get(tier, policy).max_requests for tier in ALL_TIERS}


# ---------------------------------------------------------------- commands


REVERSIBLE_KINDS = frozenset(
    {
        ActionKind.ACTION_KIND_SET_ENGINE_LIMITS,
        ActionKind.ACTION_KIND_SHED_PRIORITY,
        ActionKind.ACTION_KIND_SET_PRESSURE,
        ActionKind.ACTION_KIND_PAUSE_ADMISSION,
        ActionKind.ACTION_KIND_RESUME_ADMISSION,
        ActionKind.ACTION_KIND_MIG_REBALANCE,
    }
)
# Kinds that change the engine's scheduler (need its control endpoint).
ENGINE_KINDS = frozenset(
    {
        ActionKind.ACTION_KIND_SET_ENGINE_LIMITS,
        ActionKind.ACTION_KIND_PAUSE_ADMISSION,
        ActionKind.ACTION_KIND_RESUME_ADMISSION,
    }
)
_PARAMS_FOR_KIND: dict[int, str | None] = {
    ActionKind.ACTION_KIND_SET_ENGINE_LIMITS: "engine_limits",
    ActionKind.ACTION_KIND_SHED_PRIORITY: "breaker",
    ActionKind.ACTION_KIND_SET_PRESSURE: "pressure",
    ActionKind.ACTION_KIND_FLUSH_CACHE: None,
    ActionKind.ACTION_KIND_ABORT_LOW_PRIORITY: "abort",
    ActionKind.ACTION_KIND_PAUSE_ADMISSION: None,
    ActionKind.ACTION_KIND_RESUME_ADMISSION: None,
    ActionKind.ACTION_KIND_MIG_REBALANCE: "mig",
    ActionKind.ACTION_KIND_ROLLBACK: "rollback",
}


def kind_name(kind: int) -> str:
    try:
        return str(events_pb2.ActionKind.Name(events_pb2.ActionKind.ValueType(kind)))
    except ValueError:
        return f"ACTION_KIND_{kind}"


def validate_command(
    command: events_pb2.HealingCommand,
    known_engines: Iterable[str],
    engine_info: EngineInfo | None = None,
) -> list[str]:
    """Why `command` must not be applied; an empty list means it may be."""
    reasons: list[str] = []
    if not command.command_id:
        reasons.append("command_id is empty")
    kind = int(command.kind)
    if kind not in _PARAMS_FOR_KIND:
        reasons.append(f"unknown action kind {kind_name(kind)}")
        return reasons
    engine = command.meta.target.engine
    known = set(known_engines)
    if not engine:
        reasons.append("meta.target.engine is empty")
    elif engine not in known:
        reasons.append(f"unknown target engine {engine!r} (known: {', '.join(sorted(known)) or 'none'})")
    expected = _PARAMS_FOR_KIND[kind]
    given = command.WhichOneof("params")
    if expected is not None and given != expected:
        reasons.append(f"{kind_name(kind)} needs params.{expected}, got {given or 'none'}")
        return reasons
    if expected is None and given is not None:
        reasons.append(f"{kind_name(kind)} takes no params, got {given}")
        return reasons
    if kind == ActionKind.ACTION_KIND_SET_ENGINE_LIMITS:
        change = command.engine_limits
        if not change.ListFields():
            reasons.append("engine_limits sets no field")
        reasons.extend(limit_reasons(change, engine_info))
    elif kind == ActionKind.ACTION_KIND_SHED_PRIORITY:
        setting = command.breaker
        if setting.priority not in (common_pb2.PRIORITY_P0, common_pb2.PRIORITY_P1, common_pb2.PRIORITY_P2):
            reasons.append("breaker.priority must be P0, P1 or P2")
        if setting.state not in (
            events_pb2.BREAKER_STATE_CLOSED,
            events_pb2.BREAKER_STATE_OPEN,
            events_pb2.BREAKER_STATE_HALF_OPEN,
        ):
            reasons.append("breaker.state must be CLOSED, OPEN or HALF_OPEN")
        if setting.max_requests < 0:
            reasons.append(f"breaker.max_requests must be >= 0, got {setting.max_requests}")
        if setting.ttl_seconds < 0:
            reasons.append(f"breaker.ttl_seconds must be >= 0, got {setting.ttl_seconds}")
    elif kind == ActionKind.ACTION_KIND_SET_PRESSURE:
        if not (math.isfinite(command.pressure) and 0.0 <= command.pressure <= 1.0):
            reasons.append(f"pressure must be in [0, 1], got {command.pressure}")
    elif kind == ActionKind.ACTION_KIND_ABORT_LOW_PRIORITY:
        if command.abort.at_or_below not in (common_pb2.PRIORITY_P0, common_pb2.PRIORITY_P1, common_pb2.PRIORITY_P2):
            reasons.append("abort.at_or_below must be P0, P1 or P2")
        if command.abort.max_streams < 1:
            reasons.append(f"abort.max_streams must be >= 1, got {command.abort.max_streams}")
    elif kind == ActionKind.ACTION_KIND_MIG_REBALANCE:
        if not command.mig.tenant_bytes:
            reasons.append("mig.tenant_bytes is empty")
        bad = [name for name, need in command.mig.tenant_bytes.items() if need <= 0]
        if bad:
            reasons.append(f"mig.tenant_bytes must be positive; not for {', '.join(sorted(bad))}")
    elif kind == ActionKind.ACTION_KIND_ROLLBACK and not command.rollback.action_id:
        reasons.append("rollback.action_id is empty")
    return reasons


def is_stale(command: events_pb2.HealingCommand, now: float) -> bool:
    """A command past its deadline is recorded and skipped, never applied late."""
    if not command.HasField("deadline"):
        return False
    deadline = command.deadline.seconds + command.deadline.nanos / 1e9
    return now > deadline


def limits_after(kind: int, current: Limits, command: events_pb2.HealingCommand, running: int = 0) -> Limits:
    """The engine limits a limits/pause/resume command asks for; `running` resolves a cap factor."""
    if kind == ActionKind.ACTION_KIND_PAUSE_ADMISSION:
        return replace(current, admission_paused=True)
    if kind == ActionKind.ACTION_KIND_RESUME_ADMISSION:
        return replace(current, admission_paused=False)
    change = command.engine_limits
    limits = merge_limits(current, change)
    if change.HasField("max_num_running_reqs_factor") and not change.HasField("max_num_running_reqs"):
        base = running if running > 0 else current.max_num_running_reqs
        cap = max(1, math.floor(base * change.max_num_running_reqs_factor))
        limits = replace(limits, max_num_running_reqs=min(cap, current.max_num_running_reqs))
    return limits


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What undoing an action means; `reason` is set when it cannot be undone."""

    limits: Limits | None = None
    breakers: tuple[events_pb2.BreakerSetting, ...] = ()
    pressure: float | None = None
    mig_layout_json: str | None = None
    reason: str = ""

    @property
    def possible(self) -> bool:
        return not self.reason


def restore_plan(kind: int, before: events_pb2.ActionState, fallback_limits: Limits | None) -> RestorePlan:
    """Undo `kind` by putting back exactly what it changed, as recorded in `before`."""
    if kind in ENGINE_KINDS:
        if fallback_limits is None or not before.HasField("engine_limits"):
            return RestorePlan(reason="no engine limits were recorded before the action")
        return RestorePlan(limits=merge_limits(fallback_limits, before.engine_limits))
    if kind == ActionKind.ACTION_KIND_SHED_PRIORITY:
        return RestorePlan(breakers=tuple(before.breakers))
    if kind == ActionKind.ACTION_KIND_SET_PRESSURE:
        return RestorePlan(pressure=before.pressure if before.HasField("pressure") else 0.0)
    if kind == ActionKind.ACTION_KIND_MIG_REBALANCE:
        if not before.mig_layout_json:
            return RestorePlan(reason="no MIG layout was recorded before the action")
        return RestorePlan(mig_layout_json=before.mig_layout_json)
    if kind == ActionKind.ACTION_KIND_FLUSH_CACHE:
        return RestorePlan(reason="a flushed prefix cache cannot be put back; it refills as requests arrive")
    if kind == ActionKind.ACTION_KIND_ABORT_LOW_PRIORITY:
        return RestorePlan(reason="aborted streams cannot be resumed; their clients retry")
    return RestorePlan(reason=f"{kind_name(kind)} cannot be rolled back")


def state_diff(before: events_pb2.ActionState, after: events_pb2.ActionState) -> list[str]:
    """Readable list of what changed, for ActionResult.detail and the audit trail."""
    changes: list[str] = []
    for name in ("max_num_running_reqs", "max_num_scheduled_tokens", "max_prefill_chunk_tokens", "admission_paused"):
        had = before.engine_limits.HasField(name)
        has = after.engine_limits.HasField(name)
        old = getattr(before.engine_limits, name) if had else None
        new = getattr(after.engine_limits, name) if has else None
        if old != new:
            changes.append(f"{name}: {old} -> {new}")
    old_breakers = {b.priority: (b.state, b.max_requests) for b in before.breakers}
    new_breakers = {b.priority: (b.state, b.max_requests) for b in after.breakers}
    for priority in sorted(set(old_breakers) | set(new_breakers)):
        if old_breakers.get(priority) != new_breakers.get(priority):
            label = common_pb2.Priority.Name(common_pb2.Priority.ValueType(priority))
            changes.append(f"breaker {label}: {old_breakers.get(priority)} -> {new_breakers.get(priority)}")
    old_pressure = before.pressure if before.HasField("pressure") else None
    new_pressure = after.pressure if after.HasField("pressure") else None
    if old_pressure != new_pressure:
        changes.append(f"pressure: {old_pressure} -> {new_pressure}")
    if before.mig_layout_json != after.mig_layout_json:
        changes.append("mig layout changed")
    return changes
