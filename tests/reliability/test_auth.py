"""Auth: every mutating gRPC call without valid credentials gets UNAUTHENTICATED, and nothing changes."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, cast

import grpc
import pytest

from bench import reliability_harness as h
from sits.v1 import (
    decision_pb2,
    events_pb2,
    executor_pb2,
    executor_pb2_grpc,
)
from tests.reliability.service_stubs import service_stubs

BAD_CREDENTIALS = {
    "none": (),
    "wrong token": (("authorization", "Bearer not-the-token"),),
    "not bearer": (("authorization", "Basic dXNlcjpwYXNz"),),
    "empty bearer": (("authorization", "Bearer "),),
}


async def _state(rs: h.ReliabilityStack) -> tuple[object, ...]:
    records = await h.read_topics(rs.settings.kafka_bootstrap, [rs.topics.oom, rs.topics.commands, rs.topics.results])
    account = await h.account_actions(rs, records)
    pressure = (
        (rs.stack.config.run_dir / "pressure").read_text() if (rs.stack.config.run_dir / "pressure").exists() else None
    )
    return tuple(len(v) for v in records.values()), dict(account.redis_effects), pressure


@pytest.mark.slow
@pytest.mark.parametrize("credentials", sorted(BAD_CREDENTIALS))
async def test_mutating_calls_without_valid_credentials_are_unauthenticated_and_change_nothing(
    api_stack: h.ReliabilityStack, credentials: str
) -> None:
    rs = api_stack
    metadata = BAD_CREDENTIALS[credentials]
    before = await _state(rs)
    async with service_stubs(rs.stack) as stubs:
        capture, decision, executor = stubs.capture, stubs.decision, stubs.executor
        policy_before = await decision.GetPolicy(decision_pb2.GetPolicyRequest(), timeout=5)
        calls = {
            "Capture/ReportOom": capture.ReportOom(
                h.oom_event(rs.target(0), time.time()), metadata=metadata, timeout=5
            ),
            "Decision/PutPolicy": decision.PutPolicy(
                decision_pb2.PutPolicyRequest(yaml=h.POLICY_YAML.replace("0.95", "0.5")), metadata=metadata, timeout=5
            ),
            "Executor/Apply": executor.Apply(h.pressure_command(rs.target(0), 0.7, 60), metadata=metadata, timeout=5),
            "Executor/Rollback": executor.Rollback(
                executor_pb2.RollbackRequest(action_id="any", reason="test"), metadata=metadata, timeout=5
            ),
        }
        for method, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await cast(Awaitable[Any], call)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, refused.value)
            assert refused.value.details(), method
        policy_after = await decision.GetPolicy(decision_pb2.GetPolicyRequest(), timeout=5)
    assert policy_after == policy_before
    assert await _state(rs) == before


@pytest.mark.slow
async def test_the_same_calls_with_the_token_are_accepted(api_stack: h.ReliabilityStack) -> None:
    """The refusal above is the credentials, not the calls: with the token, Apply takes effect."""
    rs = api_stack
    async with grpc.aio.insecure_channel(rs.stack.address_of("executor")) as channel:
        executor = executor_pb2_grpc.ExecutorStub(channel)
        result = await executor.Apply(
            h.pressure_command(rs.target(1), 0.25, 60), metadata=(("authorization", f"Bearer {rs.token}"),), timeout=10
        )
    assert result.status == events_pb2.ACTION_STATUS_APPLIED
