"""Engine limits through the SITS scheduler plugin: running cap, token budget, prefill chunk, pause/resume."""

from __future__ import annotations

from typing import ClassVar

from services.executor import domain
from services.executor.actions.base import Action, ActionContext, EngineTarget
from sits.runtime.contract import ActionKind
from sits.v1 import events_pb2


class EngineLimitsAction(Action):
    kinds: ClassVar[tuple[int, ...]] = (
        ActionKind.SET_ENGINE_LIMITS,
        ActionKind.PAUSE_ADMISSION,
        ActionKind.RESUME_ADMISSION,
    )
    needs_engine_info: ClassVar[bool] = True

    async def record(self, ctx: ActionContext, target: EngineTarget) -> events_pb2.ActionState:
        return events_pb2.ActionState(engine_limits=(await target.control.state()).limits.to_proto())

    async def apply(
        self,
        ctx: ActionContext,
        target: EngineTarget,
        command: events_pb2.HealingCommand,
        before: events_pb2.ActionState,
    ) -> str:
        current = domain.merge_limits(_UNSET, before.engine_limits)
        running = 0
        if command.engine_limits.HasField("max_num_running_reqs_factor"):
            running = (await target.control.state()).running
        wanted = domain.limits_after(int(command.kind), current, command, running, target.info)
        snapshot = await target.control.set_limits(wanted)
        if not snapshot.applied:
            raise RuntimeError("the engine did not reach a step that applied the new limits in time")
        return ""

    async def restore(
        self, ctx: ActionContext, target: EngineTarget, before: events_pb2.ActionState, after: events_pb2.ActionState
    ) -> domain.Restore:
        current = (await target.control.state()).limits
        wanted, restore = domain.restore_limits(current, before.engine_limits, after.engine_limits)
        if wanted != current:
            snapshot = await target.control.set_limits(wanted)
            if not snapshot.applied:
                raise RuntimeError("the engine did not apply the restored limits in time")
        return restore


_UNSET = domain.Limits(
    max_num_running_reqs=0, max_num_scheduled_tokens=0, max_prefill_chunk_tokens=0, admission_paused=False
)
