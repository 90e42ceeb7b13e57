"""sits.v1.Validator over the audit store and the live verdict stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.validator.audit import AuditStore
from sits.runtime.contract import format_target_key
from sits.runtime.fanout import Fanout, SubscriberTooSlow
from sits.runtime.grpcserver import abort_invalid
from sits.v1 import events_pb2, validator_pb2, validator_pb2_grpc

MAX_LIST = 1000


class ValidatorApi(validator_pb2_grpc.ValidatorServicer):
    def __init__(self, audit: AuditStore, live: Fanout[tuple[str, events_pb2.ValidationVerdict]]) -> None:
        self._audit = audit
        self._live = live

    async def GetVerdict(
        self, request: validator_pb2.GetVerdictRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> events_pb2.ValidationVerdict:
        if bool(request.verdict_id) == bool(request.action_id):
            await abort_invalid(context, "give exactly one of verdict_id and action_id")
        if request.verdict_id:
            verdict = await self._audit.verdict(request.verdict_id)
        else:
            verdict = await self._audit.verdict_for_action(request.action_id)
        if verdict is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no verdict for that id (yet)")
        assert verdict is not None
        return verdict

    async def ListVerdicts(
        self, request: validator_pb2.ListVerdictsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> validator_pb2.ListVerdictsResponse:
        if request.limit < 0 or request.limit > MAX_LIST:
            await abort_invalid(context, f"limit must be between 0 and {MAX_LIST} (0 means 100), got {request.limit}")
        if request.verdict not in events_pb2.Verdict.values():
            await abort_invalid(context, f"unknown verdict value {request.verdict}")
        verdicts = await self._audit.list_verdicts(
            target_key=format_target_key(request.target) if request.HasField("target") else None,
            outcome=request.verdict or None,
            limit=request.limit or 100,
        )
        return validator_pb2.ListVerdictsResponse(verdicts=verdicts)

    async def StreamVerdicts(
        self, request: validator_pb2.StreamVerdictsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[events_pb2.ValidationVerdict]:
        wanted = format_target_key(request.target) if request.HasField("target") else None
        subscription = self._live.subscribe(lambda item: wanted is None or item[0] == wanted)
        try:
            async for _key, verdict in subscription:
                yield verdict
        except SubscriberTooSlow as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
