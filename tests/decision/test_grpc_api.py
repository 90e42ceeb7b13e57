"""The Decision servicer on a real grpc.aio server on 127.0.0.1, port 0."""

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.decision import convert
from services.decision.domain.admission import EngineProfile
from services.decision.domain.engine import DecisionEngine
from services.decision.domain.kv_model import known_model
from services.decision.domain.policy import parse_policy
from services.decision.domain.types import EngineLoad
from services.decision.grpc_api import DecisionService
from sits.runtime.clock import ManualClock
from sits.v1 import decision_pb2, decision_pb2_grpc
from tests.decision.decision_builders import DEFAULT_POLICY, TARGET, make_sample, rules_policy_text

Served = tuple[DecisionEngine, Any]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    engine = DecisionEngine(
        parse_policy(DEFAULT_POLICY.read_text()),
        ManualClock(1_000_000.0),
        profiles={"vllm-0": EngineProfile(known_model("llama-3-8b"))},
    )
    server = grpc.aio.server()
    decision_pb2_grpc.add_DecisionServicer_to_server(DecisionService(engine), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield engine, decision_pb2_grpc.DecisionStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close(None)
        await server.stop(None)


async def test_admit_answers_from_the_latest_kv_figures(served: Served) -> None:
    engine, stub = served
    # 20 free blocks, 10 of them reserved for P0 by the default policy.
    engine.observe(make_sample(1.0, 0.6, engine=EngineLoad(kv_blocks_total=100, kv_blocks_used=80, block_size=16)))
    target = convert.target_to_pb(TARGET)
    ok = await stub.Admit(decision_pb2.AdmitRequest(target=target, prompt_tokens=100, max_tokens=50))
    assert ok.admitted and ok.kv_bytes_needed == 150 * 131072
    no = await stub.Admit(decision_pb2.AdmitRequest(target=target, prompt_tokens=1000, max_tokens=50))
    assert not no.admitted and "free KV beyond the 10 blocks reserved for P0" in no.reason
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Admit(decision_pb2.AdmitRequest(target=target, prompt_tokens=0, max_tokens=5))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_tokens" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Admit(decision_pb2.AdmitRequest(target=target, prompt_tokens=5, max_tokens=5, prompt_logprobs=-3))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs must be" in (info.value.details() or "")


async def test_put_policy_validates_versions_and_keeps_the_old_one_on_error(served: Served) -> None:
    _, stub = served
    current = await stub.GetPolicy(decision_pb2.GetPolicyRequest())
    assert current.version == 1 and "controller:" in current.yaml
    bad = "rules:\n  - name: x\n    when: {kv_usage_above: 2}\n    then: {kind: FLUSH_CACHE}\n"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.PutPolicy(decision_pb2.PutPolicyRequest(yaml=bad, expected_version=1))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "line 3" in (info.value.details() or "") and "kv_usage_above" in (info.value.details() or "")
    assert (await stub.GetPolicy(decision_pb2.GetPolicyRequest())).version == 1
    good = bad.replace("2}", "0.5}")
    updated = await stub.PutPolicy(decision_pb2.PutPolicyRequest(yaml=good, expected_version=1))
    assert updated.version == 2 and updated.yaml == good
    with pytest.raises(grpc.aio.AioRpcError) as stale:
        await stub.PutPolicy(decision_pb2.PutPolicyRequest(yaml=good, expected_version=1))
    assert stale.value.code() is grpc.StatusCode.FAILED_PRECONDITION


async def test_evaluate_is_a_what_if_and_explain_reports_the_live_window(served: Served) -> None:
    engine, stub = served
    samples = [
        convert.sample_to_pb(make_sample(i * 0.1, 0.5 + 0.004 * max(0, i - 300), event_id=f"e{i}")) for i in range(450)
    ]
    result = await stub.Evaluate(decision_pb2.EvaluateRequest(samples=samples))
    assert result.commands and result.commands[0].HasField("engine_limits")
    assert result.forecast.HasField("time_to_oom_seconds")
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.Explain(decision_pb2.ExplainRequest(target=convert.target_to_pb(TARGET)))
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND
    engine.observe(make_sample(1.0, 0.5, event_id="live-1"))
    explanation = await stub.Explain(decision_pb2.ExplainRequest(target=convert.target_to_pb(TARGET)))
    assert [s.meta.event_id for s in explanation.window] == ["live-1"]
    assert explanation.forecast.memory_fraction == pytest.approx(0.5, abs=1e-6)
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await stub.Evaluate(decision_pb2.EvaluateRequest())
    assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_a_planned_command_converts_to_a_healing_command() -> None:
    engine = DecisionEngine(parse_policy(rules_policy_text()), ManualClock(1_000_000.0))
    [command] = engine.observe(make_sample(1.0, 0.5, engine=EngineLoad(kv_cache_usage=0.99), event_id="s1"))
    message = convert.command_to_pb(command)
    assert message.breaker.state == 2 and message.breaker.priority == 3  # OPEN, P2
    assert message.meta.event_id == message.command_id == command.command_id
    assert message.cause_event_id == "s1" and message.policy_rule == "kv-usage-shed-p2"
    assert message.deadline.seconds == int(command.deadline)
    back = convert.sample_from_pb(convert.sample_to_pb(make_sample(2.0, 0.25, seq=3, event_id="x")))
    assert back.gpu is not None and back.sequence == 3 and back.t == pytest.approx(2.0)
