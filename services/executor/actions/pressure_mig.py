"""Envoy's overload pressure (SET_PRESSURE) and MIG re-partitioning (MIG_REBALANCE)."""

from __future__ import annotations

from typing import ClassVar

from services.executor import domain
from services.executor.actions.base import Action, ActionContext, EngineTarget
from sits.runtime.contract import ActionKind
from sits.v1 import events_pb2
from sits_mesh.pressure import write_pressure


class PressureAction(Action):
    kinds: ClassVar[tuple[int, ...]] = (ActionKind.SET_PRESSURE,)

    async def record(self, ctx: ActionContext, target: EngineTarget) -> events_pb2.ActionState:
        state = events_pb2.ActionState()
        pressure = await ctx.state.pressure(target.name)
        if pressure is not None:
            state.pressure = pressure
        return state

    async def apply(
        self,
        ctx: ActionContext,
        target: EngineTarget,
        command: events_pb2.HealingCommand,
        before: events_pb2.ActionState,
    ) -> str:
        await set_pressure(ctx, target, command.pressure)
        return ""

    async def restore(
        self, ctx: ActionContext, target: EngineTarget, before: events_pb2.ActionState, after: events_pb2.ActionState
    ) -> domain.Restore:
        current = await ctx.state.pressure(target.name)
        was = before.pressure if before.HasField("pressure") else 0.0
        if current is not None and after.HasField("pressure") and current != after.pressure:
            return domain.Restore(kept=(f"pressure (now {current})",))
        await set_pressure(ctx, target, was)
        return domain.Restore(restored=(f"pressure {after.pressure} -> {was}",))


async def set_pressure(ctx: ActionContext, target: EngineTarget, value: float) -> None:
    if ctx.pressure_file is None:
        raise RuntimeError("no Envoy pressure file configured (SITS_ENVOY_PRESSURE_FILE)")
    write_pressure(ctx.pressure_file, value)
    await ctx.state.save_pressure(target.name, value)


class MigAction(Action):
    kinds: ClassVar[tuple[int, ...]] = (ActionKind.MIG_REBALANCE,)

    async def record(self, ctx: ActionContext, target: EngineTarget) -> events_pb2.ActionState:
        state = events_pb2.ActionState()
        if ctx.mig is not None:
            state.mig_layout_json = await ctx.mig.layout(target.name)
        return state

    async def apply(
        self,
        ctx: ActionContext,
        target: EngineTarget,
        command: events_pb2.HealingCommand,
        before: events_pb2.ActionState,
    ) -> str:
        if ctx.mig is None:
            raise RuntimeError("MIG rebalancing is not wired into this executor")
        await ctx.mig.rebalance(target.name, command.mig)
        return ""

    async def restore(
        self, ctx: ActionContext, target: EngineTarget, before: events_pb2.ActionState, after: events_pb2.ActionState
    ) -> domain.Restore:
        if ctx.mig is None:
            raise RuntimeError("MIG rebalancing is not wired into this executor")
        if not before.mig_layout_json:
            return domain.Restore(kept=("MIG layout (none was recorded before the action)",))
        if await ctx.mig.layout(target.name) != after.mig_layout_json:
            return domain.Restore(kept=("MIG layout (changed since by a later action)",))
        await ctx.mig.restore(target.name, before.mig_layout_json)
        return domain.Restore(restored=("MIG layout",))
