"""The processor's HTTP branch without Envoy: what it answers for each stream (pure: a recording admitter)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from envoy_data_plane.envoy.service.ext_proc.v3 import ProcessingResponse

from sits_mesh.admission import AdmissionQuery, Verdict
from sits_mesh.ext_proc import AdmissionProcessor
from sits_mesh.ext_proc_wire import ExtProcRequest, Phase
from sits_mesh.policy import MeshPolicy


class RecordingAdmitter:
    def __init__(self, admitted: bool = True) -> None:
        self.queries: list[AdmissionQuery] = []
        self.admitted = admitted

    async def admit(self, query: AdmissionQuery) -> Verdict:
        self.queries.append(query)
        return Verdict(admitted=self.admitted, reason="" if self.admitted else "the prompt needs more KV than is free")


class Context:
    def __init__(self, metadata: dict[str, str]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self._metadata.items())


async def stream(*requests: ExtProcRequest) -> AsyncIterator[ExtProcRequest]:
    for request in requests:
        yield request


async def answers(processor: AdmissionProcessor, metadata: dict[str, str], *requests: ExtProcRequest) -> list[Any]:
    out = []
    async for answer in processor.process(stream(*requests), Context(metadata)):
        out.append(ProcessingResponse.FromString(answer) if isinstance(answer, bytes) else answer)
    return out


def headers(path: str, **extra: str) -> ExtProcRequest:
    return ExtProcRequest(Phase.REQUEST_HEADERS, headers={":path": path, **extra})


def body(data: dict[str, Any] | bytes) -> ExtProcRequest:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return ExtProcRequest(Phase.REQUEST_BODY, body=raw, end_of_stream=True)


POLICY = MeshPolicy.model_validate({"engine_api": "openai", "http": {"models": ["m"], "max_body_bytes": 2048}})
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "n": 2}


async def test_the_routes_metadata_names_tier_and_endpoint_and_the_clients_header_is_ignored() -> None:
    admitter = RecordingAdmitter()
    processor = AdmissionProcessor(POLICY, admitter)
    metadata = {"x-sits-priority": "p2", "x-sits-openai-endpoint": "chat"}
    out = await answers(processor, metadata, headers("/v1/chat/completions", **{"x-sits-priority": "p0"}), body(CHAT))
    assert [a.is_set("request_headers") for a in out] == [True, False]
    assert out[1].is_set("request_body")
    assert admitter.queries[0].priority == "p2" and admitter.queries[0].max_tokens == 10
    assert admitter.queries[0].prompt_logprobs == 0
    completions = {"x-sits-priority": "p1", "x-sits-openai-endpoint": "completions"}
    await answers(
        processor, completions, headers("/v1/completions"), body({"model": "m", "prompt": "x", "prompt_logprobs": 3})
    )
    assert admitter.queries[1].prompt_logprobs == 3


async def test_under_istio_the_headers_stand_in_and_other_paths_pass_uninspected() -> None:
    admitter = RecordingAdmitter()
    processor = AdmissionProcessor(POLICY, admitter)
    await answers(processor, {}, headers("/v1/chat/completions?x=1", **{"x-sits-priority": "p0"}), body(CHAT))
    assert admitter.queries[-1].priority == "p0"
    out = await answers(processor, {}, headers("/v1/models"), body(b"not json"))
    assert out[1].is_set("request_body") and len(admitter.queries) == 1
    assert processor.counters.not_inspected == 1


async def test_refusals_are_immediate_replies_with_the_status_and_code() -> None:
    processor = AdmissionProcessor(POLICY, RecordingAdmitter(admitted=False))
    meta = {"x-sits-priority": "p0", "x-sits-openai-endpoint": "completions"}
    cases = [
        (body({"model": "m", "prompt": "hi", "max_tokens": 1}), 400, "sits_kv_admission"),
        (body({"model": "x", "prompt": "hi"}), 404, "sits_model_not_found"),
        (body(b"{"), 400, "sits_invalid_json"),
        (body({"model": "m", "prompt": "x" * 4096}), 413, "sits_request_too_large"),
    ]
    for request, status, code in cases:
        reply = (await answers(processor, meta, headers("/v1/completions"), request))[-1].immediate_response
        assert (int(reply.status.code), reply.details) == (status, code)
        assert reply.body
