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
- `restore_limits`, `restore_breakers`, `restore_budget`: compare-and-set rollback (only what the action set,
  only while no later action replaced it); `direction`: whether an action tightened or loosened.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from sits.runtime.contract import ALL_TIERS, ActionKind, Tier, action_kind_name
from sits.v1 import common_pb2, events_pb2

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
            priority=common_pb2.Priority.ValueType(self.tier.to_proto()),
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


@dataclass(frozen=True, slots=True)
class TierBudgetRecord:
    """The controller's limits on the tiers below P0, held until `until` unless renewed."""

    limits: Mapping[Tier, int]
    until: float
    command_id: str = ""
    lease_s: float = 0.0

    def active(self, now: float) -> bool:
        return now < self.until

    def to_proto(self) -> list[events_pb2.TierLimit]:
        return [
            events_pb2.TierLimit(priority=common_pb2.Priority.ValueType(t.to_proto()), max_requests=n)
            for t, n in sorted(self.limits.items())
        ]


def budget_limits(budget: events_pb2.TierBudget) -> dict[Tier, int]:
    return {Tier.from_proto(limit.priority): limit.max_requests for limit in budget.limits}


def budget_reasons(budget: events_pb2.TierBudget, policy: BreakerPolicy) -> list[str]:
    reasons: list[str] = []
    seen: set[int] = set()
    for limit in budget.limits:
        if limit.priority not in (common_pb2.PRIORITY_P1, common_pb2.PRIORITY_P2):
            reasons.append("tier_budget.limits may name P1 and P2 only: P0 is never limited by the controller")
            continue
        if limit.priority in seen:
            reasons.append("tier_budget.limits names a tier twice")
        seen.add(limit.priority)
        if not 0 <= limit.max_requests <= policy.closed_max_requests:
            reasons.append(
                f"tier_budget max_requests must be in [0, {policy.closed_max_requests}], got {limit.max_requests}"
            )
    if budget.limits and not 0.0 < budget.lease_seconds <= 3600.0:
        reasons.append(f"tier_budget.lease_seconds must be in (0, 3600], got {budget.lease_seconds}")
    return reasons


def envoy_limits(
    board: BreakerBoard, now: float, policy: BreakerPolicy, budget: TierBudgetRecord | None = None
) -> dict[Tier, int]:
    """Envoy circuit-breaker max_requests per tier (each tier has its own cluster in the mesh).

    A tier is held to the tighter of its breaker and the controller's budget while that is leased.
    """
    effective = board.effective(now, policy)
    limits = {tier: effective.get(tier, policy).max_requests for tier in ALL_TIERS}
    if budget is not None and budget.active(now):
        for tier, cap in budget.limits.items():
            limits[tier] = min(limits[tier], cap)
    return limits


# ---------------------------------------------------------------- which way an action moved things


def _tightness(before: float, after: float, smaller_is_tighter: bool = True) -> int:
    """-1 tighter, +1 looser, 0 the same."""
    if before == after:
        return 0
    return -1 if (after < before) == smaller_is_tighter else 1


def _chunk(value: int) -> float:
    return math.inf if value == 0 else float(value)


def direction(before: events_pb2.ActionState, after: events_pb2.ActionState) -> events_pb2.ChangeDirection.ValueType:
    """The ChangeDirection of an action from the state it recorded before and after it."""
    moves: list[int] = []
    old, new = before.engine_limits, after.engine_limits
    for name in ("max_num_running_reqs", "max_num_scheduled_tokens"):
        if old.HasField(name) and new.HasField(name):
            moves.append(_tightness(getattr(old, name), getattr(new, name)))
    if old.HasField("max_prefill_chunk_tokens") and new.HasField("max_prefill_chunk_tokens"):
        moves.append(_tightness(_chunk(old.max_prefill_chunk_tokens), _chunk(new.max_prefill_chunk_tokens)))
    if old.HasField("admission_paused") and new.HasField("admission_paused"):
        moves.append(_tightness(float(old.admission_paused), float(new.admission_paused), smaller_is_tighter=False))
    old_breakers = {b.priority: b.max_requests for b in before.breakers}
    for b in after.breakers:
        if b.priority in old_breakers:
            moves.append(_tightness(old_breakers[b.priority], b.max_requests))
    if before.budget or after.budget:
        # No budget at all admits everything: it is the loosest.
        old_total = sum(b.max_requests for b in before.budget) if before.budget else math.inf
        new_total = sum(b.max_requests for b in after.budget) if after.budget else math.inf
        moves.append(_tightness(old_total, new_total))
    if before.HasField("pressure") or after.HasField("pressure"):
        moves.append(_tightness(before.pressure, after.pressure, smaller_is_tighter=False))
    changed = {m for m in moves if m != 0}
    if not changed:
        return events_pb2.CHANGE_DIRECTION_NONE
    if changed == {-1}:
        return events_pb2.CHANGE_DIRECTION_TIGHTEN
    if changed == {1}:
        return events_pb2.CHANGE_DIRECTION_LOOSEN
    return events_pb2.CHANGE_DIRECTION_MIXED


# ---------------------------------------------------------------- commands


# Kinds that change the engine's scheduler (need its control endpoint).
ENGINE_KINDS = frozenset(
    {
        ActionKind.SET_ENGINE_LIMITS,
        ActionKind.PAUSE_ADMISSION,
        ActionKind.RESUME_ADMISSION,
    }
)
_PARAMS_FOR_KIND: dict[int, str | None] = {
    ActionKind.SET_ENGINE_LIMITS: "engine_limits",
    ActionKind.SHED_PRIORITY: "breaker",
    ActionKind.SET_PRESSURE: "pressure",
    ActionKind.FLUSH_CACHE: None,
    ActionKind.ABORT_LOW_PRIORITY: "abort",
    ActionKind.PAUSE_ADMISSION: None,
    ActionKind.RESUME_ADMISSION: None,
    ActionKind.MIG_REBALANCE: "mig",
    ActionKind.ROLLBACK: "rollback",
    ActionKind.SET_TIER_BUDGET: "tier_budget",
}


_TIER_PRIORITIES = frozenset(tier.to_proto() for tier in ALL_TIERS)


def kind_name(kind: int) -> str:
    """The kind as sits.v1 spells it, for messages an operator matches against the .proto."""
    return f"ACTION_KIND_{action_kind_name(kind)}"


def validate_command(
    command: events_pb2.HealingCommand,
    known_engines: Iterable[str],
    engine_info: EngineInfo | None = None,
    breaker_policy: BreakerPolicy | None = None,
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
    if kind == ActionKind.SET_ENGINE_LIMITS:
        change = command.engine_limits
        if not change.ListFields():
            reasons.append("engine_limits sets no field")
        reasons.extend(limit_reasons(change, engine_info))
    elif kind == ActionKind.SET_TIER_BUDGET:
        reasons.extend(budget_reasons(command.tier_budget, breaker_policy or BreakerPolicy()))
    elif kind == ActionKind.SHED_PRIORITY:
        setting = command.breaker
        if setting.priority not in _TIER_PRIORITIES:
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
    elif kind == ActionKind.SET_PRESSURE:
        if not (math.isfinite(command.pressure) and 0.0 <= command.pressure <= 1.0):
            reasons.append(f"pressure must be in [0, 1], got {command.pressure}")
    elif kind == ActionKind.ABORT_LOW_PRIORITY:
        if command.abort.at_or_below not in _TIER_PRIORITIES:
            reasons.append("abort.at_or_below must be P0, P1 or P2")
        if command.abort.max_streams < 1:
            reasons.append(f"abort.max_streams must be >= 1, got {command.abort.max_streams}")
    elif kind == ActionKind.MIG_REBALANCE:
        if not command.mig.tenant_bytes:
            reasons.append("mig.tenant_bytes is empty")
        bad = [name for name, need in command.mig.tenant_bytes.items() if need <= 0]
        if bad:
            reasons.append(f"mig.tenant_bytes must be positive; not for {', '.join(sorted(bad))}")
    elif kind == ActionKind.ROLLBACK and not command.rollback.action_id:
        reasons.append("rollback.action_id is empty")
    return reasons


def is_stale(command: events_pb2.HealingCommand, now: float) -> bool:
    """A command past its deadline is recorded and skipped, never applied late."""
    if not command.HasField("deadline"):
        return False
    deadline = command.deadline.seconds + command.deadline.nanos / 1e9
    return now > deadline


def limits_after(
    kind: int, current: Limits, command: events_pb2.HealingCommand, running: int = 0, info: EngineInfo | None = None
) -> Limits:
    """The engine limits a limits/pause/resume command asks for; `running` resolves a cap factor."""
    if kind == ActionKind.PAUSE_ADMISSION:
        return replace(current, admission_paused=True)
    if kind == ActionKind.RESUME_ADMISSION:
        return replace(current, admission_paused=False)
    change = command.engine_limits
    if change.restore_defaults:
        if info is None:
            raise ValueError("restoring the start-up limits needs the engine's facts")
        return replace(
            current, max_num_running_reqs=info.max_num_seqs, max_num_scheduled_tokens=info.max_num_batched_tokens
        )
    limits = merge_limits(current, change)
    if change.HasField("max_num_running_reqs_factor") and not change.HasField("max_num_running_reqs"):
        base = running if running > 0 else current.max_num_running_reqs
        cap = max(1, math.floor(base * change.max_num_running_reqs_factor))
        limits = replace(limits, max_num_running_reqs=min(cap, current.max_num_running_reqs))
    return limits


# ---------------------------------------------------------------- compare-and-set rollback
#
# A rollback restores only the fields its action changed, and of those only the ones that still hold
# the value the action set: a field a later action replaced belongs to that action now.


@dataclass(frozen=True, slots=True)
class Restore:
    """What a rollback puts back, and what it leaves because a later action replaced it."""

    restored: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.restored:
            parts.append("restored " + ", ".join(self.restored))
        if self.kept:
            parts.append("left " + ", ".join(self.kept) + " (replaced by a later action)")
        return "; ".join(parts) or "nothing to restore"


LIMIT_FIELDS = ("max_num_running_reqs", "max_num_scheduled_tokens", "max_prefill_chunk_tokens", "admission_paused")


def restore_limits(
    current: Limits, before: events_pb2.EngineLimits, after: events_pb2.EngineLimits
) -> tuple[Limits, Restore]:
    """`current` with each field the action changed put back, where it still holds the action's value."""
    updates: dict[str, Any] = {}
    restored: list[str] = []
    kept: list[str] = []
    was: Any = before  # the field names are checked by LIMIT_FIELDS, not by the stubs' literals
    now: Any = after
    for name in LIMIT_FIELDS:
        if not (was.HasField(name) and now.HasField(name)):
            continue
        old, new = getattr(before, name), getattr(after, name)
        if old == new:
            continue
        if getattr(current, name) == new:
            updates[name] = old
            restored.append(f"{name} {new} -> {old}")
        else:
            kept.append(f"{name} (now {getattr(current, name)})")
    return replace(current, **updates), Restore(tuple(restored), tuple(kept))


def restore_breakers(
    current: BreakerBoard,
    before: Sequence[events_pb2.BreakerSetting],
    after: Sequence[events_pb2.BreakerSetting],
    now: float,
    policy: BreakerPolicy,
) -> tuple[BreakerBoard, Restore]:
    """The breaker board with each tier the action moved put back, where it still reads as the action left it."""
    effective = current.effective(now, policy)
    records = dict(effective.records)
    old = {Tier.from_proto(b.priority): b for b in before}
    restored: list[str] = []
    kept: list[str] = []
    for setting in after:
        tier = Tier.from_proto(setting.priority)
        was = old.get(tier)
        if was is None or (was.state, was.max_requests) == (setting.state, setting.max_requests):
            continue
        now_record = effective.get(tier, policy)
        if (int(now_record.state), now_record.max_requests) == (setting.state, setting.max_requests):
            records[tier] = board_from_settings([was], now).get(tier, policy)
            restored.append(f"breaker {tier.name} -> max_requests {was.max_requests}")
        else:
            kept.append(f"breaker {tier.name} (now max_requests {now_record.max_requests})")
    return BreakerBoard(records), Restore(tuple(restored), tuple(kept))


def restore_budget(
    current: TierBudgetRecord | None, before: events_pb2.ActionState, after: events_pb2.ActionState, now: float
) -> tuple[dict[Tier, int] | None, Restore]:
    """The budget to put back (None: none, the defaults), if the one in force is still the action's.

    Returns the current limits unchanged (and says so) when a later command replaced them.
    """
    in_force = dict(current.limits) if current is not None and current.active(now) else None
    set_by_action = {Tier.from_proto(b.priority): b.max_requests for b in after.budget} or None
    previous = {Tier.from_proto(b.priority): b.max_requests for b in before.budget} or None
    if in_force != set_by_action:
        return in_force, Restore(kept=(f"tier budget (now {_limits_text(in_force)})",))
    return previous, Restore(restored=(f"tier budget {_limits_text(set_by_action)} -> {_limits_text(previous)}",))


def _limits_text(limits: Mapping[Tier, int] | None) -> str:
    if not limits:
        return "none"
    return ", ".join(f"{tier.name} <= {n}" for tier, n in sorted(limits.items()))


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
    old_budget = {b.priority: b.max_requests for b in before.budget}
    new_budget = {b.priority: b.max_requests for b in after.budget}
    if old_budget != new_budget:
        changes.append(
            f"tier budget: {_limits_text({Tier.from_proto(p): n for p, n in old_budget.items()})} -> "
            f"{_limits_text({Tier.from_proto(p): n for p, n in new_budget.items()})}"
        )
    if before.mig_layout_json != after.mig_layout_json:
        changes.append("mig layout changed")
    return changes
