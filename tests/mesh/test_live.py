"""Live: a real Envoy and the real admission processor in front of a real vLLM gRPC server.

One engine for the session (conftest); each test starts its own Envoy (fast) and processor.
"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest
from prometheus_client import REGISTRY
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from sits_mesh.envoy_config import RATELIMIT_ENFORCED_KEY, breaker_key
from sits_mesh.ext_proc import BypassController
from tests.mesh.conftest import StartMesh
from tests.mesh.helpers import (
    KV_BYTES_PER_TOKEN,
    KvRuleDecision,
    SlowReader,
    generate,
    generate_request,
    read_stream,
    stall_until_envoy_pauses,
    upstream_read_once_settled,
    wait_for_stat,
)

pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.timeout(240)]

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_client_that_stops_reading_is_bounded_by_the_windows(start_mesh: StartMesh) -> None:
    buffer_limit = 16_384
    stack = await start_mesh(
        http2={
            "initial_stream_window_bytes": 65_535,
            "initial_connection_window_bytes": 65_535,
            "per_connection_buffer_limit_bytes": buffer_limit,
        }
    )
    envoy = stack.envoy
    # ~900 tokens with 100 logprobs each (~550 KB): far larger than every window on the path.
    request = generate_request(prompt_tokens=4, max_tokens=900, logprobs=100)
    client_window = 4096
    reader = SlowReader(stack.address, window=client_window)
    await reader.open(request)
    try:
        paused, read = await stall_until_envoy_pauses(envoy, reader)
        assert paused >= 1, f"Envoy never paused reading from vLLM (read {read} bytes) for a stalled client"
        assert reader.received <= client_window
        # While paused, what Envoy has read from vLLM stays bounded by the windows and buffers,
        # and stops growing even though vLLM has more to send.
        read_while_paused, read_now = await upstream_read_once_settled(envoy, reader)
        assert read_now == read_while_paused, "Envoy kept reading from vLLM for 30 s after pausing"
        # The client's window, vLLM's stream window into Envoy, and Envoy's few buffers of
        # `buffer_limit` on the path (downstream codec and connection, upstream codec and connection).
        bound = client_window + 65_535 + 6 * buffer_limit
        assert read_while_paused < bound
        assert not reader.ended
        # Reading again drains everything, and Envoy resumes reading upstream.
        await reader.pump(60.0, acknowledge=True)
        assert reader.ended
        assert reader.trailers.get("grpc-status") == "0", reader.events
        assert reader.received > 2 * bound, "the response was too small to test flow control"
        assert await envoy.stat("cluster.vllm_p0.upstream_flow_control_resumed_reading_total") >= 1
    finally:
        await reader.close()


async def test_pressure_refuses_new_streams_while_in_flight_ones_finish(start_mesh: StartMesh) -> None:
    stack = await start_mesh()
    async with grpc.aio.insecure_channel(stack.address) as channel:
        call = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
            generate_request(max_tokens=300), metadata=(("x-sits-priority", "p0"),), timeout=60
        )
        first = await call.read()  # the stream is in flight once a token came back
        assert isinstance(first, vllm_engine_pb2.GenerateResponse) and first.HasField("chunk")
        stack.envoy.set_pressure(0.97)
        gauge = "overload.envoy.overload_actions.stop_accepting_requests.active"
        assert await wait_for_stat(stack.envoy, gauge, 1) == 1
        refused = await generate(stack.address, "p0")
        assert refused.code == grpc.StatusCode.UNAVAILABLE
        assert "overloaded" in refused.details
        finished = await read_stream(call)
    assert finished.ok, finished
    assert len(first.chunk.token_ids) + len(finished.tokens) == 300
    stack.envoy.set_pressure(0.0)
    shed_point = "overload.envoy.load_shed_points.http_connection_manager_decode_headers.scale_percent"
    deadline = time.monotonic() + 10
    while await stack.envoy.stat(gauge) or await stack.envoy.stat(shed_point):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    # Workers apply the new state a moment after the gauges: new streams flow again soon.
    recovered = await generate(stack.address, "p0")
    while not recovered.ok and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        recovered = await generate(stack.address, "p0")
    assert recovered.ok, recovered


async def test_a_breaker_moved_at_runtime_sheds_p2_and_keeps_p0(start_mesh: StartMesh) -> None:
    stack = await start_mesh()
    assert (await generate(stack.address, "p2")).ok
    await stack.envoy.runtime_modify({breaker_key(stack.envoy.policy.upstream_cluster, "p2"): 0})
    shed = await generate(stack.address, "p2")
    assert shed.code == grpc.StatusCode.UNAVAILABLE
    assert shed.trailers.get("x-envoy-overloaded") == "true"
    kept = await generate(stack.address, "p0")
    assert kept.ok and len(kept.tokens) == 8
    assert await stack.envoy.stat("cluster.vllm_p2.upstream_rq_active_overflow") >= 1
    assert await stack.envoy.stat("cluster.vllm_p0.upstream_rq_active_overflow") == 0


async def test_runtime_shed_key_sheds_a_priority_at_the_route(start_mesh: StartMesh) -> None:
    stack = await start_mesh()
    await stack.envoy.runtime_modify({"sits.shed.p2": 100})
    shed = await generate(stack.address, "p2")
    assert shed.code == grpc.StatusCode.UNAVAILABLE
    assert "priority p2" in shed.details
    assert (await generate(stack.address, "p1")).ok


def shed_count(priority: str, reason: str) -> float:
    # Labelled like Envoy's vllm_pN clusters, which the recording rules join them with.
    return REGISTRY.get_sample_value("sits_shed_requests_total", {"priority": priority, "reason": reason}) or 0.0


async def test_processor_sheds_p2_first_under_pressure(start_mesh: StartMesh) -> None:
    stack = await start_mesh()
    stack.envoy.set_pressure(0.75)  # above p2's 0.7, below p1's 0.85 and Envoy's 0.9
    shed_before = shed_count("p2", "pressure")
    p2 = await generate(stack.address, "p2")
    p1 = await generate(stack.address, "p1")
    assert p2.code == grpc.StatusCode.UNAVAILABLE and "priority p2 is shed" in p2.details
    assert shed_count("p2", "pressure") == shed_before + 1
    assert p1.ok
    stack.envoy.set_pressure(0.87)
    p1 = await generate(stack.address, "p1")
    p0 = await generate(stack.address, "p0")
    assert p1.code == grpc.StatusCode.UNAVAILABLE and "priority p1 is shed" in p1.details
    assert p0.ok


async def test_the_rate_limit_answers_resource_exhausted(start_mesh: StartMesh) -> None:
    stack = await start_mesh(rate_limit={"max_tokens": 2, "tokens_per_fill": 1, "fill_interval_s": 3600})
    results = [await generate(stack.address, "p0", max_tokens=1) for _ in range(4)]
    codes = [r.code for r in results]
    assert codes[:2] == [grpc.StatusCode.OK, grpc.StatusCode.OK]
    assert codes[2:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert await stack.envoy.stat("sits_ratelimit.http_local_rate_limit.rate_limited") >= 2
    # The executor can stop enforcing through runtime.
    await stack.envoy.runtime_modify({RATELIMIT_ENFORCED_KEY: 0})
    assert (await generate(stack.address, "p0", max_tokens=1)).ok


async def test_token_streams_pass_end_to_end_with_the_trace_context(start_mesh: StartMesh) -> None:
    stack = await start_mesh()
    direct = await generate(f"127.0.0.1:{stack.envoy.policy.upstream.port}", "p0", max_tokens=16)
    through = await generate(stack.address, "p0", max_tokens=16, metadata=(("traceparent", TRACEPARENT),))
    assert through.ok and direct.ok
    assert through.chunks > 1, "tokens must arrive as a stream"
    assert through.tokens == direct.tokens  # greedy decoding: the same tokens either way
    deadline = time.monotonic() + 10
    line = ""
    while time.monotonic() < deadline:
        if stack.access_log.exists():
            line = next((x for x in stack.access_log.read_text().splitlines() if TRACEPARENT in x), "")
            if line:
                break
        await asyncio.sleep(0.2)
    assert f"traceparent={TRACEPARENT}" in line
    assert "grpc=0" in line and "cluster=vllm_p0" in line


async def test_a_prompt_that_exceeds_free_kv_is_refused_with_a_reason(
    start_mesh: StartMesh, decision_peer: tuple[str, KvRuleDecision]
) -> None:
    stack = await start_mesh()
    decision_peer[1].free_kv_bytes = 512 * KV_BYTES_PER_TOKEN
    small = await generate(stack.address, "p0", prompt_tokens=32, max_tokens=8)
    assert small.ok
    big = await generate(stack.address, "p0", prompt_tokens=700, max_tokens=8)
    assert big.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.search(
        r"the prompt needs 708\.0 KiB of KV \(700 prompt \+ 8 new tokens\) and 512\.0 KiB is free", big.details
    ), big.details
    # The engine never saw it: Envoy sent it nowhere (no upstream reset of a started request).
    assert stack.processor.counters.refused == 1
    assert stack.processor.counters.admitted == 1
    assert await stack.envoy.stat("http.sits_ingress.ext_proc.sits_admission.immediate_responses_sent") == 1


async def test_inference_flows_when_the_processor_is_down(start_mesh: StartMesh) -> None:
    stack = await start_mesh()
    assert (await generate(stack.address, "p0")).ok
    await stack.ext_proc.stop()
    flowed = await generate(stack.address, "p0", max_tokens=8)
    assert flowed.ok and len(flowed.tokens) == 8
    # Still under Envoy's last limits: a runtime breaker keeps working without the processor.
    await stack.envoy.runtime_modify({breaker_key(stack.envoy.policy.upstream_cluster, "p2"): 0})
    assert (await generate(stack.address, "p2")).code == grpc.StatusCode.UNAVAILABLE
    assert await stack.envoy.stat("http.sits_ingress.ext_proc.sits_admission.failure_mode_allowed") >= 1


async def test_the_bypass_skips_the_processor_while_free_kv_is_plentiful_and_closes_when_it_is_not(
    start_mesh: StartMesh, decision_peer: tuple[str, KvRuleDecision]
) -> None:
    stack = await start_mesh(admission={"bypass_max_request_tokens": 1024, "bypass_open_after_s": 0})
    controller = BypassController(stack.processor, stack.envoy)
    streams = "http.sits_ingress.ext_proc.sits_admission.streams_started"
    assert await controller.probe_once()  # the peer has 4096 tokens of KV free: 4 x the 1024-token probe
    before = await stack.envoy.stat(streams)
    assert (await generate(stack.address, "p0", max_tokens=4)).ok
    assert (await generate(stack.address, "p2", max_tokens=4)).ok
    assert await stack.envoy.stat(streams) == before  # not one stream to the processor
    decision_peer[1].free_kv_bytes = 1500 * KV_BYTES_PER_TOKEN  # one 1024-token request fits, but not twice
    assert not await controller.probe_once()
    assert "under 2 x" in controller.gate.reason
    big = await generate(stack.address, "p0", prompt_tokens=900, max_tokens=700)
    assert big.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "refused by SITS admission" in big.details, big
    assert await stack.envoy.stat(streams) == before + 1
