"""The executor's command handler: deadline → lease → duplicate check → before → apply → after → publish.

What each kind does lives in `services/executor/actions/` (validate, record
before, apply, restore); this module keeps what every kind shares: the
per-target lease with its fencing token, idempotency on command_id, and the
one published `ActionResult` per command, with the command's promise and the
direction the action moved things (for the validator).

Every command ends in exactly one published result, except when Redis is
unreachable: then `StateUnavailable` propagates, the Kafka consumer leaves the
offset uncommitted and retries later, and the gRPC API answers UNAVAILABLE. If
applying fails half-way, the state recorded before is put back before the
FAILED result goes out. A tier-budget command that finds its budget already in
force only renews the lease: a RENEWED result, not recorded as an action.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.executor import domain, metrics
from services.executor.actions import ACTIONS
from services.executor.actions.base import (
    Action,
    ActionNotFound,
    EngineTarget,
    InvalidCommand,
    MigHook,
    NotUndoable,
    Renewal,
)
from services.executor.actions.tier_limits import budget_state
from services.executor.adapters.engine import EngineRejected
from services.executor.adapters.envoy import EnvoyAdmin
from services.executor.adapters.redis_state import Lease, LeaseHeld, RedisState
from services.executor.domain import BreakerPolicy
from sits.runtime.clock import Clock
from sits.runtime.contract import ActionKind, Tier, format_target_key
from sits.runtime.events import new_meta, seconds
from sits.v1 import common_pb2, events_pb2

log = logging.getLogger(__name__)

SOURCE = "executor"
ActionStatus = events_pb2.ActionStatus
Publish = Callable[[events_pb2.ActionResult], Awaitable[None]]
# Whether an action's result (by target key and action id), written about that time (epoch seconds, the
# writer's clock), is on the results topic.
ResultPublished = Callable[[str, str, float], Awaitable[bool]]

__all__ = ["ActionNotFound", "EngineTarget", "Executor", "InvalidCommand", "MigHook"]


class Ownership(Protocol):
    """Which of the configured targets this executor replica reconciles (the others belong to other replicas)."""

    async def owned(self, names: list[str]) -> set[str]: ...


@dataclass
class Executor:
    state: RedisState
    targets: Mapping[str, EngineTarget]
    publish: Publish
    clock: Clock
    envoy: EnvoyAdmin | None = None
    pressure_file: Path | None = None
    policy: BreakerPolicy = field(default_factory=BreakerPolicy)
    lease_ttl_ms: int = 10_000
    flush_wait_idle_s: float = 2.0
    mig: MigHook | None = None
    # None: a lone executor, it reconciles every target.
    ownership: Ownership | None = None
    # None: a duplicate is never checked against the results topic.
    result_published: ResultPublished | None = None
    _known_keys: dict[str, str] = field(default_factory=dict)
    _pushed_limits: dict[str, dict[Tier, int]] = field(default_factory=dict)
    # Per target: the commands whose breaker or budget was in force at the last reconcile, to report expiry.
    _holding: dict[str, dict[str, str]] = field(default_factory=dict)

    # ------------------------------------------------------------ entry points

    async def handle(self, command: events_pb2.HealingCommand) -> events_pb2.ActionResult:
        """Apply one command (from Kafka or gRPC) and publish its result.

        Raises InvalidCommand (nothing applied, nothing published: the caller
        decides), StateUnavailable (Redis down: retry later), LeaseHeld.
        """
        engine_level = bool(command.meta.target.engine)
        self._resolve_gpu_level(command)
        reasons = domain.validate_command(command, self.targets.keys(), breaker_policy=self.policy)
        if reasons:
            raise InvalidCommand(reasons)
        if int(command.kind) == ActionKind.ROLLBACK:
            return await self.rollback(command.rollback.action_id, command=command)
        target_name = command.meta.target.engine
        if engine_level and target_name in self.targets:
            await self._remember_key(target_name, format_target_key(command.meta.target))
        if domain.is_stale(command, self.clock.now()):
            result = self.result_for(command, ActionStatus.ACTION_STATUS_SKIPPED_STALE, "deadline passed; not applied")
            await self.state.record(target_name, result, mark_applied=False)
            await self.publish(result)
            return result
        lease = await self.state.acquire_lease(target_name, self.lease_ttl_ms, command_id=command.command_id)
        try:
            return await self._apply_under_lease(command, lease)
        finally:
            await self.state.release_lease(lease)

    async def _remember_key(self, target_name: str, key: str) -> None:
        """Where this target's commands are keyed, so whichever replica owns that partition reconciles it."""
        if self._known_keys.get(target_name) != key:
            await self.state.remember_target_key(target_name, key)
            self._known_keys[target_name] = key

    def _resolve_gpu_level(self, command: events_pb2.HealingCommand) -> None:
        """Point a GPU-level command (a MIG plan, pressure) at the one engine on that GPU."""
        target = command.meta.target
        if target.engine or not target.gpu_uuid:
            return
        on_gpu = [name for name, t in self.targets.items() if t.gpu_uuid == target.gpu_uuid]
        if len(on_gpu) == 1:
            target.engine = on_gpu[0]

    async def rollback(
        self, action_id: str, *, reason: str = "", command: events_pb2.HealingCommand | None = None
    ) -> events_pb2.ActionResult:
        """Undo an action: only what it changed, and only where no later action has replaced it."""
        original = await self.state.action(action_id)
        if original is None:
            raise ActionNotFound(f"no action {action_id!r}")
        target_name = original.meta.target.engine
        rollback_command = events_pb2.HealingCommand(
            command_id=command.command_id if command is not None and command.command_id else f"rollback:{action_id}",
            kind=events_pb2.ActionKind.ValueType(ActionKind.ROLLBACK.to_proto()),
            reason=reason or (command.reason if command is not None else ""),
            target_memory_fraction=original.target_memory_fraction,
        )
        rollback_command.meta.CopyFrom(original.meta)
        rollback_command.rollback.action_id = action_id
        lease = await self.state.acquire_lease(target_name, self.lease_ttl_ms, command_id=rollback_command.command_id)
        try:
            if lease.applied_action is not None:
                return await self._duplicate(rollback_command, lease.applied_action, lease)
            action = ACTIONS.get(int(original.kind))
            target = self.targets.get(target_name)
            if action is None or target is None:
                return await self._refuse_rollback(rollback_command, action_id, lease, "its target is not served here")
            before = await action.record(self, target)
            try:
                restore = await action.restore(self, target, original.before, original.after)
            except NotUndoable as error:
                return await self._refuse_rollback(rollback_command, action_id, lease, str(error))
            after = await action.record(self, target)
            result = self.result_for(rollback_command, ActionStatus.ACTION_STATUS_ROLLED_BACK, "", lease)
            result.kind = original.kind
            result.rolled_back_action_id = action_id
            result.before.CopyFrom(before)
            result.after.CopyFrom(after)
            result.direction = domain.direction(before, after)
            result.detail = restore.describe()
            await self._record_applied(target_name, result)
            return result
        finally:
            await self.state.release_lease(lease)

    async def _refuse_rollback(
        self, command: events_pb2.HealingCommand, action_id: str, lease: Lease, why: str
    ) -> events_pb2.ActionResult:
        result = self.result_for(command, ActionStatus.ACTION_STATUS_REFUSED, why, lease)
        result.rolled_back_action_id = action_id
        await self.state.record(command.meta.target.engine, result, mark_applied=False)
        await self.publish(result)
        return result

    async def limits_state(self, target_name: str) -> events_pb2.ActionState:
        if target_name not in self.targets:
            raise InvalidCommand([f"unknown target engine {target_name!r}"])
        target = self.targets[target_name]
        snapshot = await target.control.state()
        target.info = snapshot.info
        now = self.clock.now()
        state = budget_state(await self.state.budget(target_name), now)
        state.engine_limits.CopyFrom(snapshot.limits.to_proto())
        state.breakers.extend((await self.state.breakers(target_name)).to_proto(now, self.policy))
        pressure = await self.state.pressure(target_name)
        if pressure is not None:
            state.pressure = pressure
        return state

    # ------------------------------------------------------------ the steps

    async def _apply_under_lease(self, command: events_pb2.HealingCommand, lease: Lease) -> events_pb2.ActionResult:
        target_name = lease.target
        if lease.applied_action is not None:
            return await self._duplicate(command, lease.applied_action, lease)
        target = self.targets[target_name]
        action = ACTIONS.get(int(command.kind))
        if action is None:
            raise InvalidCommand([f"unknown action kind {domain.kind_name(int(command.kind))}"])
        if action.needs_engine_info and target.info is None:
            target.info = (await target.control.state()).info
        reasons = domain.validate_command(command, self.targets.keys(), target.info, self.policy)
        if reasons:
            raise InvalidCommand(reasons)
        before = await action.record(self, target)
        if not await self.state.lease_is_current(lease):
            # Our lease expired while we read the state: a newer holder (larger fencing token) owns the target.
            raise LeaseHeld(f"lease on {target_name} lost before applying {command.command_id}")
        try:
            detail = await action.apply(self, target, command, before)
            # Live from here: reading the state after it back is bookkeeping, not part of the action.
            live_at = self.clock.now()
            after = await action.record(self, target)
        except Renewal as renewal:
            result = self.result_for(command, ActionStatus.ACTION_STATUS_RENEWED, renewal.detail, lease)
            await self.publish(result)
            return result
        except EngineRejected as error:
            raise InvalidCommand([str(error)]) from error
        except InvalidCommand:
            raise  # refused before anything changed (e.g. a MIG layout no profile can give)
        except Exception as error:
            log.exception("applying %s to %s failed; restoring the state before", command.command_id, target_name)
            restored = await self._restore_quietly(action, target, before)
            result = self.result_for(
                command, ActionStatus.ACTION_STATUS_FAILED, f"{error}; state before {restored}", lease
            )
            result.before.CopyFrom(before)
            await self.state.record(target_name, result, mark_applied=False)
            await self.publish(result)
            return result
        result = self.result_for(command, ActionStatus.ACTION_STATUS_APPLIED, detail, lease, at=live_at)
        result.before.CopyFrom(before)
        result.after.CopyFrom(after)
        result.direction = domain.direction(before, after)
        if not result.detail:
            result.detail = "; ".join(domain.state_diff(before, after)) or "no change"
        await self._record_applied(target_name, result)
        return result

    async def _record_applied(self, target_name: str, result: events_pb2.ActionResult) -> None:
        # Recorded first, so a replica killed before publishing leaves its command applied, never applied twice;
        # `_duplicate` then publishes what it recorded.
        await self.state.record(target_name, result, mark_applied=True)
        await self.publish(result)
        await self.state.mark_published(result.action_id)

    async def _duplicate(
        self, command: events_pb2.HealingCommand, action_id: str, lease: Lease
    ) -> events_pb2.ActionResult:
        if self.result_published is not None and not await self.state.was_published(action_id):
            # Not noted as published: the replica that applied it (an action or a rollback) may have been killed
            # between recording it and publishing its result. Then it goes out now, or nothing downstream would
            # hear of it (no verdict, no budget). Only this case reads the action and the topic.
            original = await self.state.action(action_id)
            if original is not None:
                key = format_target_key(original.meta.target)
                if not await self.result_published(key, action_id, seconds(original.applied_at)):
                    log.warning("action %s was applied but its result never published; publishing it now", action_id)
                    await self.publish(original)
                await self.state.mark_published(action_id)
        result = self.result_for(
            command, ActionStatus.ACTION_STATUS_SKIPPED_DUPLICATE, f"already applied as action {action_id}", lease
        )
        await self.publish(result)
        return result

    async def _restore_quietly(self, action: Action, target: EngineTarget, before: events_pb2.ActionState) -> str:
        """After a failed apply: put back whatever now differs from `before` (as if the action had set it)."""
        try:
            now_state = await action.record(self, target)
            restore = await action.restore(self, target, before, now_state)
        except NotUndoable as error:
            return f"not restored ({error})"
        except Exception as error:
            log.exception("restoring %s after a failed action failed", target.name)
            return f"NOT restored ({error})"
        return "restored" if restore.restored or not restore.kept else restore.describe()

    # ------------------------------------------------------------ Envoy limits and leases

    async def push_tier_limits(self, target: EngineTarget) -> None:
        """Push each tier's limit (the tighter of its breaker and the leased budget) to Envoy."""
        if self.envoy is None:
            raise RuntimeError("no Envoy admin URL configured (SITS_ENVOY_ADMIN_URL)")
        limits = await self._tier_limits(target.name)
        await self.envoy.set_breaker_limits(target.envoy_cluster, limits)
        self._pushed_limits[target.name] = limits

    async def _tier_limits(self, target_name: str) -> dict[Tier, int]:
        now = self.clock.now()
        board = await self.state.breakers(target_name)
        return domain.envoy_limits(board, now, self.policy, await self.state.budget(target_name))

    async def reconcile_breakers(self) -> None:
        """Push limits that moved by time (breaker TTLs, budget leases) to Envoy, and report what expired."""
        now = self.clock.now()
        names = list(self.targets)
        owned = set(names) if self.ownership is None else await self.ownership.owned(names)
        for gone in [n for n in self._holding if n not in owned]:
            # Another replica reports its expiries now; forget, so a later return starts from what is there.
            del self._holding[gone]
            self._pushed_limits.pop(gone, None)
        for target_name, target in self.targets.items():
            if target_name not in owned:
                continue
            board = await self.state.breakers(target_name)
            budget = await self.state.budget(target_name)
            metrics.export_breakers(target_name, board, now, self.policy)
            await self._report_expiries(target, board, budget, now)
            limits = domain.envoy_limits(board, now, self.policy, budget)
            if self.envoy is None:
                continue
            if self._pushed_limits.get(target_name, limits) != limits or (
                target_name not in self._pushed_limits and (board.records or budget is not None)
            ):
                await self.envoy.set_breaker_limits(target.envoy_cluster, limits)
                self._pushed_limits[target_name] = limits

    async def _report_expiries(
        self, target: EngineTarget, board: domain.BreakerBoard, budget: domain.TierBudgetRecord | None, now: float
    ) -> None:
        """An EXPIRED result for each command whose hold ran out since the last look (defaults restored)."""
        holding: dict[str, str] = {}
        effective = board.effective(now, self.policy)
        for tier, command_id in (await self.state.breaker_commands(target.name)).items():
            if command_id and effective.get(tier, self.policy).state is not domain.BreakerState.CLOSED:
                holding[f"breaker:{tier.name}"] = command_id
        if budget is not None and budget.command_id and budget.active(now):
            holding["budget"] = budget.command_id
        if budget is not None and not budget.active(now):
            await self.state.save_budget(target.name, None)
        before = self._holding.get(target.name, {})
        for what, command_id in before.items():
            if holding.get(what) == command_id:
                continue
            if what == "budget" and budget is not None and budget.command_id != command_id and budget.active(now):
                continue  # replaced by a newer budget, not expired
            result = events_pb2.ActionResult(
                meta=new_meta(SOURCE, common_pb2.Target(engine=target.name, gpu_uuid=target.gpu_uuid), now),
                action_id=uuid.uuid4().hex,
                command_id=command_id,
                kind=events_pb2.ActionKind.ValueType(
                    (ActionKind.SET_TIER_BUDGET if what == "budget" else ActionKind.SHED_PRIORITY).to_proto()
                ),
                status=ActionStatus.ACTION_STATUS_EXPIRED,
                detail=f"{what.replace(':', ' ')} ran out; Envoy's defaults restored",
            )
            result.applied_at.FromNanoseconds(int(now * 1e9))
            await self.publish(result)
        self._holding[target.name] = holding

    # ------------------------------------------------------------ results

    def result_for(
        self,
        command: events_pb2.HealingCommand,
        status: events_pb2.ActionStatus.ValueType,
        detail: str,
        lease: Lease | None = None,
        *,
        at: float | None = None,
    ) -> events_pb2.ActionResult:
        """The result of `command`, applied (or refused, skipped...) at `at` (default: now)."""
        now = self.clock.now()
        target = common_pb2.Target()
        target.CopyFrom(command.meta.target)
        result = events_pb2.ActionResult(
            meta=new_meta(SOURCE, target, now),
            action_id=uuid.uuid4().hex,
            command_id=command.command_id,
            kind=command.kind,
            status=status,
            detail=detail,
            target_memory_fraction=command.target_memory_fraction,
            fencing_token=lease.fencing_token if lease is not None else 0,
        )
        if command.HasField("promise"):
            result.promise.CopyFrom(command.promise)
        result.applied_at.FromNanoseconds(int((now if at is None else at) * 1e9))
        return result
