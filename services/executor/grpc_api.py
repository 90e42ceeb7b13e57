"""sits.v1.Executor over gRPC: Apply, Rollback, ListActions, GetLimits.

Authentication of Apply and Rollback is the runtime server's interceptor
(`MUTATING_METHODS`); this servicer maps domain outcomes to status codes:
INVALID_ARGUMENT with the reasons, UNAVAILABLE when Redis (or the engine) is
unreachable, ABORTED when another executor holds the target's lease.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc

from services.executor.adapters.engine import EngineUnavailable
from services.executor.adapters.redis_state import LeaseHeld, StateUnavailable
from services.executor.service import ActionNotFound, Executor, InvalidCommand
from sits.v1 import events_pb2, executor_pb2, executor_pb2_grpc

SERVICE_NAME = "sits.v1.Executor"
MUTATING_METHODS = (f"/{SERVICE_NAME}/Apply", f"/{SERVICE_NAME}/Rollback")
MAX_LIST = 500

Context = grpc.aio.ServicerContext[Any, Any]
T = TypeVar("T")


async def answered(context: Context, call: Awaitable[T], *, mutating: bool = True) -> T:
    """The call's result, or the status its failure maps to (the context aborts the RPC).

    A mutating call says it refused to act when Redis is down; a read just says Redis is down.
    """
    try:
        return await call
    except InvalidCommand as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(error.reasons))
    except ActionNotFound as error:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
    except StateUnavailable as error:
        detail = f"refusing mutating action: {error}" if mutating else str(error)
        await context.abort(grpc.StatusCode.UNAVAILABLE, detail)
    except EngineUnavailable as error:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
    except LeaseHeld as error:
        await context.abort(grpc.StatusCode.ABORTED, str(error))
    raise AssertionError("unreachable: abort raises")


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, executor: Executor) -> None:
        self._executor = executor

    async def Apply(self, request: events_pb2.HealingCommand, context: Context) -> events_pb2.ActionResult:
        return await answered(context, self._executor.handle(request))

    async def Rollback(self, request: executor_pb2.RollbackRequest, context: Context) -> events_pb2.ActionResult:
        if not request.action_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "action_id is empty")
        return await answered(context, self._executor.rollback(request.action_id, reason=request.reason))

    async def ListActions(
        self, request: executor_pb2.ListActionsRequest, context: Context
    ) -> executor_pb2.ListActionsResponse:
        if request.limit < 0 or request.limit > MAX_LIST:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be in [0, {MAX_LIST}]")
        name = request.target.engine
        if name not in self._executor.targets:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown target engine {name!r}")
        actions = await answered(context, self._executor.state.actions(name, request.limit or 50), mutating=False)
        return executor_pb2.ListActionsResponse(actions=actions)

    async def GetLimits(self, request: executor_pb2.GetLimitsRequest, context: Context) -> executor_pb2.LimitsState:
        state = await answered(context, self._executor.limits_state(request.target.engine), mutating=False)
        reply = executor_pb2.LimitsState(state=state)
        reply.target.CopyFrom(request.target)
        return reply
