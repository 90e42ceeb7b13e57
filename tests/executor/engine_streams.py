"""Drive real token streams through the vLLM gRPC API (test helper)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc


@dataclass
class StreamOutcome:
    request_id: str
    tokens: list[int]
    finish_reason: str


async def run_stream(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float = 120.0,
) -> StreamOutcome:
    request = vllm_engine_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )
    tokens: list[int] = []
    finish_reason = ""
    async for reply in stub.Generate(request, timeout=timeout_s):
        if reply.HasField("chunk"):
            tokens.extend(reply.chunk.token_ids)
        elif reply.HasField("complete"):
            finish_reason = reply.complete.finish_reason
    return StreamOutcome(request_id, tokens, finish_reason)


async def start_streams(
    address: str, count: int, prompt_len: int, max_tokens: int, prefix: str, timeout_s: float = 120.0
) -> tuple[grpc.aio.Channel, list[asyncio.Task[StreamOutcome]]]:
    channel = grpc.aio.insecure_channel(address)
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    tasks = [
        asyncio.create_task(
            run_stream(stub, f"{prefix}-{i}", [(7 * i + j) % 500 + 1 for j in range(prompt_len)], max_tokens, timeout_s)
        )
        for i in range(count)
    ]
    return channel, tasks
