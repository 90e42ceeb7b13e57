"""The executor's command handler: deadline → lease → duplicate check → before → apply → after → publish.

Every command ends in exactly one published `ActionResult`, except when Redis
is unreachable: then `StateUnavailable` propagates, the Kafka consumer leaves
the offset uncommitted and retries later, and the gRPC API answers
UNAVAILABLE. If applying fails half-way, the state recorded before is put back
before the FAILED result goes out.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.executor import domain, metrics
from services.executor.adapters.engine import EngineControlClient, EngineRejected, VllmEngineClient
from services.executor.adapters.envoy import EnvoyAdmin, write_pressure_file
from services.executor.adapters.redis_state import Lease, LeaseHeld, RedisState
from services.executor.domain import ActionKind, BreakerPolicy, Tier
from sits.runtime.clock import Clock
from sits.runtime.events import new_meta
from sits.v1 import common_pb2, events_pb2

log = logging.getLogger(__name__)

SOURCE = "executor"
ActionStatus = events_pb2.ActionStatus
Publish = Callable[[events_pb2.ActionResult], Awaitable[None]]


class InvalidCommand(ValueError):
    """The command is out of range or names something unknown; nothing was applied."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


class ActionNotFound(LookupError):
    pass


class MigHook(Protocol):
    """MIG re-partitioning (services/executor/mig owns it); returns layouts as JSON."""

    async def layout(self, target: str) -> str: ...

    async def rebalance(self, target: str, params: events_pb2.MigRebalanceParams) -> str: ...

    async def restore(self, target: str, layout_json: str) -> str: ...


@dataclass
class EngineTarget:
    name: str
    control: EngineControlClient
    engine: VllmEngineClient
    envoy_cluster: str = "vllm"
    info: domain.EngineInfo | None = None
    # The GPU the engine runs on: GPU-level commands (engine "") name the GPU, not the engine.
    gpu_uuid: str = ""


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
    _pushed_breakers: dict[str, dict[Tier, int]] = field(default_factory=dict)

    # ------------------------------------------------------------ entry points

    async def handle(self, command: events_pb2.HealingCommand) -> events_pb2.ActionResult:
        """Apply one command (from Kafka or gRPC) and publish its result.

        Raises InvalidCommand (nothing applied, nothing published: the caller
        decides), StateUnavailable (Redis down: retry later), LeaseHeld.
        """
        self._resolve_gpu_level(command)
        reasons = domain.validate_command(command, self.targets.keys())
        if reasons:
            raise InvalidCommand(reasons)
        if command.kind == ActionKind.ACTION_KIND_ROLLBACK:
            return await self.rollback(command.rollback.action_id, command=command)
        target_name = command.meta.target.engine
        now = self.clock.now()
        if domain.is_stale(command, now):
            result = self.result_for(command, ActionStatus.ACTION_STATUS_SKIPPED_STALE, "deadline passed; not applied")
            await self.state.record(target_name, result, mark_applied=False)
            await self.publish(result)
            return result
        lease = await self.state.acquire_lease(target_name, self.lease_ttl_ms)
        try:
            return await self._apply_under_lease(command, lease)
        finally:
            await self.state.release_lease(lease)

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
        original = await self.state.action(action_id)
        if original is None:
            raise ActionNotFound(f"no action {action_id!r}")
        target_name = original.meta.target.engine
        rollback_command = events_pb2.HealingCommand(
            command_id=command.command_id if command is not None and command.command_id else f"rollback:{action_id}",
            kind=ActionKind.ACTION_KIND_ROLLBACK,
            reason=reason or (command.reason if command is not None else ""),
            target_memory_fraction=original.target_memory_fraction,
        )
        rollback_command.meta.CopyFrom(original.meta)
        rollback_command.rollback.action_id = action_id
        lease = await self.state.acquire_lease(target_name, self.lease_ttl_ms)
        try:
            done = await self.state.applied_action(rollback_command.command_id)
            if done is not None:
                return await self._duplicate(rollback_command, done, lease)
            target = self.targets.get(target_name)
            plan = domain.restore_plan(original.kind, original.before, await self._limits_or_none(target))
            if not plan.possible:
                result = self.result_for(rollback_command, ActionStatus.ACTION_STATUS_REFUSED, plan.reason, lease)
                result.rolled_back_action_id = action_id
                await self.state.record(target_name, result, mark_applied=False)
                await self.publish(result)
                return result
            before = await self._capture(original.kind, target_name)
            await self._restore(original.kind, target_name, plan)
            after = await self._capture(original.kind, target_name)
            result = self.result_for(rollback_command, ActionStatus.ACTION_STATUS_ROLLED_BACK, "", lease)
            result.kind = original.kind
            result.rolled_back_action_id = action_id
            result.before.CopyFrom(before)
            result.after.CopyFrom(after)
            result.detail = "; ".join(domain.state_diff(before, after)) or "already as before"
            await self.state.record(target_name, result, mark_applied=True)
            await self.publish(result)
            return result
        finally:
            await self.state.release_lease(lease)

    async def limits_state(self, target_name: str) -> events_pb2.ActionState:
        if target_name not in self.targets:
            raise InvalidCommand([f"unknown target engine {target_name!r}"])
        state = events_pb2.ActionState()
        target = self.targets[target_name]
        snapshot = await target.control.state()
        target.info = snapshot.info
        state.engine_limits.CopyFrom(snapshot.limits.to_proto())
        board = await self.state.breakers(target_name)
        state.breakers.extend(board.to_proto(self.clock.now(), self.policy))
        pressure = await self.state.pressure(target_name)
        if pressure is not None:
            state.pressure = pressure
        return state

    # ------------------------------------------------------------ the steps

    async def _apply_under_lease(self, command: events_pb2.HealingCommand, lease: Lease) -> events_pb2.ActionResult:
        target_name = lease.target
        done = await self.state.applied_action(command.command_id)
        if done is not None:
            return await self._duplicate(command, done, lease)
        target = self.targets[target_name]
        kind = int(command.kind)
        if kind in domain.ENGINE_KINDS and target.info is None:
            target.info = (await target.control.state()).info
        reasons = domain.validate_command(command, self.targets.keys(), target.info)
        if reasons:
            raise InvalidCommand(reasons)
        before = await self._capture(kind, target_name)
        if not await self.state.lease_is_current(lease):
            # Our lease expired while we read the state: a newer holder (larger fencing token) owns the target.
            raise LeaseHeld(f"lease on {target_name} lost before applying {command.command_id}")
        try:
            detail = await self._apply(command, target_name, before)
            after = await self._capture(kind, target_name)
        except EngineRejected as error:
            raise InvalidCommand([str(error)]) from error
        except InvalidCommand:
            raise  # refused before anything changed (e.g. a MIG layout no profile can give)
        except Exception as error:
            log.exception("applying %s to %s failed; restoring the state before", command.command_id, target_name)
            restored = await self._restore_quietly(kind, target_name, before)
            result = self.result_for(
                command, ActionStatus.ACTION_STATUS_FAILED, f"{error}; state before {restored}", lease
            )
            result.before.CopyFrom(before)
            await self.state.record(target_name, result, mark_applied=False)
            await self.publish(result)
            return result
        result = self.result_for(command, ActionStatus.ACTION_STATUS_APPLIED, detail, lease)
        result.before.CopyFrom(before)
        result.after.CopyFrom(after)
        if not result.detail:
            result.detail = "; ".join(domain.state_diff(before, after)) or "no change"
        await self.state.record(target_name, result, mark_applied=True)
        await self.publish(result)
        return result

    async def _duplicate(
        self, command: events_pb2.HealingCommand, action_id: str, lease: Lease
    ) -> events_pb2.ActionResult:
        result = self.result_for(
            command, ActionStatus.ACTION_STATUS_SKIPPED_DUPLICATE, f"already applied as action {action_id}", lease
        )
        await self.publish(result)
        return result

    async def _capture(self, kind: int, target_name: str) -> events_pb2.ActionState:
        """What `kind` may change, as it is now."""
        state = events_pb2.ActionState()
        target = self.targets[target_name]
        if kind in domain.ENGINE_KINDS:
            state.engine_limits.CopyFrom((await target.control.state()).limits.to_proto())
        elif kind == ActionKind.ACTION_KIND_SHED_PRIORITY:
            board = await self.state.breakers(target_name)
            state.breakers.extend(board.to_proto(self.clock.now(), self.policy))
        elif kind == ActionKind.ACTION_KIND_SET_PRESSURE:
            pressure = await self.state.pressure(target_name)
            if pressure is not None:
                state.pressure = pressure
        elif kind == ActionKind.ACTION_KIND_MIG_REBALANCE and self.mig is not None:
            state.mig_layout_json = await self.mig.layout(target_name)
        return state

    async def _apply(self, command: events_pb2.HealingCommand, target_name: str, before: events_pb2.ActionState) -> str:
        """Carry the command out; returns a detail line ("" lets the state diff speak)."""
        target = self.targets[target_name]
        kind = int(command.kind)
        if kind in domain.ENGINE_KINDS:
            current = domain.merge_limits(_zero_limits(), before.engine_limits)
            running = 0
            if command.engine_limits.HasField("max_num_running_reqs_factor"):
                running = (await target.control.state()).running
            snapshot = await target.control.set_limits(domain.limits_after(kind, current, command, running))
            if not snapshot.applied:
                raise RuntimeError("the engine did not reach a step that applied the new limits in time")
            return ""
        if kind == ActionKind.ACTION_KIND_SHED_PRIORITY:
            now = self.clock.now()
            board = await self.state.breakers(target_name)
            board = domain.apply_breaker_setting(board, command.breaker, now, self.policy)
            await self._push_breakers(target_name, board, now)
            return ""
        if kind == ActionKind.ACTION_KIND_SET_PRESSURE:
            await self._set_pressure(target_name, command.pressure)
            return ""
        if kind == ActionKind.ACTION_KIND_FLUSH_CACHE:
            message = await target.engine.flush_cache(self.flush_wait_idle_s)
            return f"prefix cache flushed: {message}" if message else "prefix cache flushed"
        if kind == ActionKind.ACTION_KIND_ABORT_LOW_PRIORITY:
            victims = domain.choose_abort_victims(
                await target.control.in_flight(), Tier.from_proto(command.abort.at_or_below), command.abort.max_streams
            )
            await target.engine.abort(victims)
            return f"aborted {len(victims)} stream(s): {', '.join(victims)}" if victims else "no stream to abort"
        if kind == ActionKind.ACTION_KIND_MIG_REBALANCE:
            if self.mig is None:
                raise RuntimeError("MIG rebalancing is not wired into this executor")
            await self.mig.rebalance(target_name, command.mig)
            return ""
        raise InvalidCommand([f"unknown action kind {domain.kind_name(kind)}"])

    async def _push_breakers(self, target_name: str, board: domain.BreakerBoard, now: float) -> None:
        if self.envoy is None:
            raise RuntimeError("no Envoy admin URL configured (SITS_ENVOY_ADMIN_URL)")
        limits = domain.envoy_limits(board, now, self.policy)
        await self.envoy.set_breaker_limits(self.targets[target_name].envoy_cluster, limits)
        self._pushed_breakers[target_name] = limits
        expiries = {t: board.get(t, self.policy).expires_at(self.policy) for t in Tier}
        await self.state.save_breakers(target_name, board, expiries, now)

    async def _set_pressure(self, target_name: str, value: float) -> None:
        if self.pressure_file is None:
            raise RuntimeError("no Envoy pressure file configured (SITS_ENVOY_PRESSURE_FILE)")
        write_pressure_file(self.pressure_file, value)
        await self.state.save_pressure(target_name, value)

    async def _restore(self, kind: int, target_name: str, plan: domain.RestorePlan) -> None:
        target = self.targets[target_name]
        if plan.limits is not None:
            snapshot = await target.control.set_limits(plan.limits)
            if not snapshot.applied:
                raise RuntimeError("the engine did not apply the restored limits in time")
        if kind == ActionKind.ACTION_KIND_SHED_PRIORITY:
            now = self.clock.now()
            await self._push_breakers(target_name, domain.board_from_settings(plan.breakers, now), now)
        if plan.pressure is not None:
            await self._set_pressure(target_name, plan.pressure)
        if plan.mig_layout_json is not None:
            if self.mig is None:
                raise RuntimeError("MIG rebalancing is not wired into this executor")
            await self.mig.restore(target_name, plan.mig_layout_json)

    async def _restore_quietly(self, kind: int, target_name: str, before: events_pb2.ActionState) -> str:
        plan = domain.restore_plan(kind, before, await self._limits_or_none(self.targets[target_name]))
        if not plan.possible:
            return f"not restored ({plan.reason})"
        try:
            await self._restore(kind, target_name, plan)
        except Exception as error:
            log.exception("restoring %s after a failed action failed", target_name)
            return f"NOT restored ({error})"
        return "restored"

    async def _limits_or_none(self, target: EngineTarget | None) -> domain.Limits | None:
        if target is None:
            return None
        try:
            return (await target.control.state()).limits
        except Exception:
            return None

    async def reconcile_breakers(self) -> None:
        """Push breakers whose TTL moved them (open → half-open → closed) to Envoy."""
        now = self.clock.now()
        for target_name, target in self.targets.items():
            board = await self.state.breakers(target_name)
            metrics.export_breakers(target_name, board, now, self.policy)
            limits = domain.envoy_limits(board, now, self.policy)
            if self.envoy is None:
                continue
            if self._pushed_breakers.get(target_name, limits) != limits or (
                target_name not in self._pushed_breakers and board.records
            ):
                await self.envoy.set_breaker_limits(target.envoy_cluster, limits)
                self._pushed_breakers[target_name] = limits

    # ------------------------------------------------------------ results

    def result_for(
        self,
        command: events_pb2.HealingCommand,
        status: events_pb2.ActionStatus.ValueType,
        detail: str,
        lease: Lease | None = None,
    ) -> events_pb2.ActionResult:
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
        result.applied_at.FromNanoseconds(int(now * 1e9))
        return result


def _zero_limits() -> domain.Limits:
    return domain.Limits(
        max_num_running_reqs=0, max_num_scheduled_tokens=0, max_prefill_chunk_tokens=0, admission_paused=False
    )
