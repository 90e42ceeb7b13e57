"""The scenario's clients: each request of the plan as a vLLM gRPC `Generate` stream, at its time.

Requests carry their tier the way the mesh would send them (`x-sits-priority`; the SITS gRPC
launcher writes it into the request id the plugin reads). Each outcome records when it was
sent, its first token, its end, the tokens it got, and the gRPC error if it failed, in
seconds from the scenario's t0.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from scenarios.h200_vllm.plan import Arrival, prompt_for
from sits.runtime.contract import TIER_HEADER


@dataclass
class Outcome:
    index: int
    tier: str
    kind: str
    prompt_tokens: int
    max_tokens: int
    t_sent: float = 0.0
    t_first: float | None = None
    t_done: float | None = None
    tokens: int = 0
    finish_reason: str = ""
    error: str = ""

    @property
    def completed(self) -> bool:
        return not self.error and self.tokens == self.max_tokens

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "completed": self.completed}


def request_for(arrival: Arrival, index: int, scenario: str, vocab: int, seed: int) -> Any:
    return vllm_engine_pb2.GenerateRequest(
        request_id=f"{arrival.tier}-{scenario}-{index}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt_for(arrival, index, vocab, seed)),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=arrival.max_tokens, ignore_eos=True),
        stream=True,
    )


async def _one(
    stub: Any, request: Any, arrival: Arrival, outcome: Outcome, t0: float, timeout_s: float, send_at: float
) -> None:
    await asyncio.sleep(max(0.0, send_at - time.time()))
    outcome.t_sent = time.time() - t0
    try:
        call = stub.Generate(request, timeout=timeout_s, metadata=((TIER_HEADER, arrival.tier),))
        async for reply in call:
            if reply.HasField("chunk"):
                if outcome.t_first is None:
                    outcome.t_first = time.time() - t0
                outcome.tokens += len(reply.chunk.token_ids)
            elif reply.HasField("complete"):
                outcome.finish_reason = reply.complete.finish_reason
    except grpc.aio.AioRpcError as error:
        outcome.error = f"{error.code().name}: {(error.details() or '')[:200]}"
    except Exception as error:  # a client-side failure must not stop the other streams
        outcome.error = f"{type(error).__name__}: {str(error)[:200]}"
    outcome.t_done = time.time() - t0


async def drive(
    address: str,
    arrivals: tuple[Arrival, ...],
    t0: float,
    *,
    scenario: str,
    vocab: int,
    seed: int = 0,
    timeout_s: float = 240.0,
) -> list[Outcome]:
    """Send every arrival at t0 + its time; return when all have ended (each bounded by `timeout_s`)."""
    requests = [request_for(a, i, scenario, vocab, seed) for i, a in enumerate(arrivals)]
    outcomes = [Outcome(i, a.tier, a.kind, a.prompt_tokens, a.max_tokens) for i, a in enumerate(arrivals)]
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        await asyncio.gather(
            *(
                _one(stub, request, arrival, outcome, t0, timeout_s, t0 + arrival.t)
                for request, arrival, outcome in zip(requests, arrivals, outcomes, strict=True)
            )
        )
    return outcomes


async def health(address: str, timeout_s: float = 1.0) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        try:
            reply = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.healthy)
