"""gRPC face of the decision service (sits.v1.Decision) over the domain engine.

Authentication of PutPolicy is the server's job (sits.runtime.grpcserver's
token interceptor, with `MUTATING_METHODS`); this servicer range-checks every
input and answers INVALID_ARGUMENT with a reason, FAILED_PRECONDITION when a
policy update names a version that is no longer current.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.decision import convert
from services.decision.domain.engine import DecisionEngine
from services.decision.domain.policy import Policy, PolicyError, parse_policy
from sits.v1 import decision_pb2, decision_pb2_grpc

SERVICE_NAME = "sits.v1.Decision"
MUTATING_METHODS = (f"/{SERVICE_NAME}/PutPolicy",)
MAX_EVALUATE_EVENTS = 100_000
MAX_POLICY_BYTES = 256 * 1024

PolicyListener = Callable[[Policy], Awaitable[None]]
Context = grpc.aio.ServicerContext[Any, Any]


class DecisionService(decision_pb2_grpc.DecisionServicer):
    def __init__(self, engine: DecisionEngine, on_policy_change: PolicyListener | None = None) -> None:
        self._engine = engine
        self._on_policy_change = on_policy_change
        self._policy_lock = asyncio.Lock()

    async def Admit(self, request: decision_pb2.AdmitRequest, context: Context) -> decision_pb2.AdmitResponse:
        try:
            decision = self._engine.admit(
                convert.target_from_pb(request.target),
                request.prompt_tokens,
                request.max_tokens,
                convert.priority_from_pb(request.priority),
                request.prompt_logprobs,
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises
        return decision_pb2.AdmitResponse(
            admitted=decision.admitted,
            reason=decision.reason,
            kv_bytes_needed=decision.kv_bytes_needed,
            kv_bytes_free=decision.kv_bytes_free,
        )

    async def Evaluate(self, request: decision_pb2.EvaluateRequest, context: Context) -> decision_pb2.EvaluateResponse:
        if len(request.samples) + len(request.ooms) > MAX_EVALUATE_EVENTS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_EVALUATE_EVENTS} samples and OOM events per Evaluate"
            )
        if not request.samples and not request.ooms:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Evaluate needs at least one sample or OOM event")
        target = convert.target_from_pb(request.target) if request.HasField("target") else None
        try:
            result = self._engine.evaluate(
                [convert.sample_from_pb(s) for s in request.samples],
                [convert.oom_from_pb(o) for o in request.ooms],
                target,
            )
            return decision_pb2.EvaluateResponse(
                forecast=convert.forecast_to_pb(result.forecast),
                root_cause=convert.root_cause_to_pb(result.root_cause),
                commands=[convert.command_to_pb(c) for c in result.commands],
            )
        except ValueError as err:
            # Times far outside what a Timestamp holds (found by fuzzing): the caller's input, not our fault.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a time in the request is out of range: {err}")
            raise AssertionError("unreachable") from err

    async def GetPolicy(self, request: decision_pb2.GetPolicyRequest, context: Context) -> decision_pb2.Policy:
        policy = self._engine.policy
        return decision_pb2.Policy(version=policy.version, yaml=policy.yaml_text)

    async def PutPolicy(self, request: decision_pb2.PutPolicyRequest, context: Context) -> decision_pb2.Policy:
        if len(request.yaml.encode()) > MAX_POLICY_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a policy is at most {MAX_POLICY_BYTES} bytes")
        async with self._policy_lock:
            current = self._engine.policy
            if request.expected_version and request.expected_version != current.version:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"policy version is {current.version}, not {request.expected_version}",
                )
            try:
                policy = parse_policy(request.yaml, version=current.version + 1)
            except PolicyError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"policy refused: {exc}")
                raise  # unreachable: abort raises
            if self._on_policy_change is not None:
                # Persist first: a policy the store did not take must not become current.
                await self._on_policy_change(policy)
            self._engine.set_policy(policy)
        return decision_pb2.Policy(version=policy.version, yaml=policy.yaml_text)

    async def Explain(self, request: decision_pb2.ExplainRequest, context: Context) -> decision_pb2.Explanation:
        target = convert.target_from_pb(request.target)
        explanation = self._engine.explain(target)
        if explanation is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no samples seen for target {target.key}")
            raise AssertionError("unreachable")
        message = decision_pb2.Explanation(
            target=request.target,
            window=[convert.sample_to_pb(s) for s in explanation.window],
            forecast=convert.forecast_to_pb(explanation.forecast),
            root_cause=convert.root_cause_to_pb(explanation.root_cause),
        )
        if explanation.last_command is not None:
            message.last_command.CopyFrom(convert.command_to_pb(explanation.last_command))
        return message
