"""Actions whose effect cannot be put back: flush the prefix cache, abort low-priority streams.

Their verdict is "effect observed", never a rollback.
"""

from __future__ import annotations

from typing import ClassVar

from services.executor import domain
from services.executor.actions.base import Action, ActionContext, EngineTarget, abort_streams
from sits.runtime.contract import ActionKind, Tier
from sits.v1 import events_pb2


class FlushAction(Action):
    kinds: ClassVar[tuple[int, ...]] = (ActionKind.FLUSH_CACHE,)
    not_undoable: ClassVar[str] = "a flushed prefix cache cannot be put back; it refills as requests arrive"

    async def apply(
        self,
        ctx: ActionContext,
        target: EngineTarget,
        command: events_pb2.HealingCommand,
        before: events_pb2.ActionState,
    ) -> str:
        # Through the plugin, not vLLM's gRPC FlushCache: it is there on either API the engine serves.
        message = await target.control.flush_cache(ctx.flush_wait_idle_s)
        return f"prefix cache flushed: {message}" if message else "prefix cache flushed"


class AbortAction(Action):
    kinds: ClassVar[tuple[int, ...]] = (ActionKind.ABORT_LOW_PRIORITY,)
    not_undoable: ClassVar[str] = "aborted streams cannot be resumed; their clients retry"

    async def apply(
        self,
        ctx: ActionContext,
        target: EngineTarget,
        command: events_pb2.HealingCommand,
        before: events_pb2.ActionState,
    ) -> str:
        victims = domain.choose_abort_victims(
            await target.control.in_flight(), Tier.from_proto(command.abort.at_or_below), command.abort.max_streams
        )
        await abort_streams(target, victims)
        return f"aborted {len(victims)} stream(s): {', '.join(victims)}" if victims else "no stream to abort"
