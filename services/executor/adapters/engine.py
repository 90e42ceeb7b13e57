"""The engine as the executor sees it: the SITS control endpoint plus vLLM's own gRPC API.

`EngineControlClient` reads and sets live scheduling limits, flushes the prefix
cache and aborts streams through the scheduler plugin's endpoint (the same on
vLLM's gRPC and OpenAI servers); `VllmEngineClient` aborts through vLLM's
`VllmEngine` service, for an engine whose plugin predates AbortRequests.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from services.executor.domain import EngineInfo, InFlightRequest, Limits
from sits.runtime import engine_control as protocol


class EngineUnavailable(RuntimeError):
    """The engine (or its control endpoint) did not answer."""


class MethodUnsupported(EngineUnavailable):
    """The engine's plugin has no such method (UNIMPLEMENTED: a plugin older than the executor)."""


class EngineRejected(ValueError):
    """The engine refused the change (INVALID_ARGUMENT from the plugin)."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    limits: Limits
    info: EngineInfo
    step: int
    applied_at_step: int
    applied: bool
    running: int
    waiting: int
    kv_cache_usage: float
    # Streams the plugin preempted to honour a lowered running cap (since start).
    cap_preemptions: int


def _snapshot(state: dict[str, Any]) -> EngineSnapshot:
    limits = state["limits"]
    engine = state["engine"]
    return EngineSnapshot(
        limits=Limits(
            max_num_running_reqs=int(limits[protocol.MAX_NUM_RUNNING_REQS]),
            max_num_scheduled_tokens=int(limits[protocol.MAX_NUM_SCHEDULED_TOKENS]),
            max_prefill_chunk_tokens=int(limits[protocol.MAX_PREFILL_CHUNK_TOKENS]),
            admission_paused=bool(limits[protocol.ADMISSION_PAUSED]),
        ),
        info=EngineInfo(
            max_num_seqs=int(engine["max_num_seqs"]),
            max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
            block_size=int(engine["block_size"]),
            enable_chunked_prefill=bool(engine["enable_chunked_prefill"]),
        ),
        step=int(state["step"]),
        applied_at_step=int(state["applied_at_step"]),
        applied=bool(state.get("applied", True)),
        running=int(state["running"]),
        waiting=int(state["waiting"]),
        kv_cache_usage=float(state["kv_cache_usage"]),
        cap_preemptions=int(state["cap_preemptions"]),
    )


class EngineControlClient:
    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(address)

        def call(method: str) -> grpc.aio.UnaryUnaryMultiCallable[Any, Any]:
            return self._channel.unary_unary(
                method, request_serializer=protocol.encode, response_deserializer=protocol.decode
            )

        self._get_state = call(protocol.GET_STATE)
        self._set_limits = call(protocol.SET_LIMITS)
        self._list_requests = call(protocol.LIST_REQUESTS)
        self._reset_prefix_cache = call(protocol.RESET_PREFIX_CACHE)
        self._abort_requests = call(protocol.ABORT_REQUESTS)

    async def __aenter__(self) -> EngineControlClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def _call(self, method: grpc.aio.UnaryUnaryMultiCallable[Any, Any], request: dict[str, Any]) -> Any:
        try:
            return await method(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise EngineRejected(error.details() or "rejected") from error
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise MethodUnsupported(f"engine control {self.address}: {error.details()}") from error
            raise EngineUnavailable(f"engine control {self.address}: {error.code().name} {error.details()}") from error

    async def state(self) -> EngineSnapshot:
        return _snapshot(await self._call(self._get_state, {}))

    async def set_limits(self, limits: Limits | dict[str, Any]) -> EngineSnapshot:
        wire = limits.as_wire() if isinstance(limits, Limits) else limits
        return _snapshot(await self._call(self._set_limits, {"limits": wire}))

    async def flush_cache(self, wait_idle_s: float = 2.0) -> str:
        """Empty the engine's prefix cache through the plugin: the same on the gRPC and the OpenAI server."""
        try:
            reply = await self._reset_prefix_cache({"wait_idle_s": wait_idle_s}, timeout=self._timeout_s + wait_idle_s)
        except grpc.aio.AioRpcError as error:
            raise EngineUnavailable(f"engine control {self.address}: {error.code().name} {error.details()}") from error
        if not reply.get("reset"):
            raise EngineUnavailable(f"prefix cache not reset: {reply.get('reason') or 'refused'}")
        return ""

    async def abort(self, request_ids: list[str]) -> list[str]:
        """End the requests' streams (finish reason "abort"); the ids the engine ended."""
        if not request_ids:
            return []
        reply = await self._call(self._abort_requests, {"request_ids": request_ids})
        return [str(i) for i in reply.get("aborted", [])]

    async def in_flight(self) -> list[InFlightRequest]:
        reply = await self._call(self._list_requests, {})
        return [
            InFlightRequest(
                request_id=str(item["request_id"]),
                tier=int(item["priority"]),
                running=item["status"] == "running",
                arrival_time=float(item["arrival_time"]),
            )
            for item in reply["items"]
        ]


class VllmEngineClient:
    """vLLM's own gRPC API (smg `VllmEngine`): Abort, for an engine whose plugin predates AbortRequests (the
    OpenAI server has no abort call: a client's disconnect is its only one)."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            await self._stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=request_ids), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            raise EngineUnavailable(f"Abort: {error.code().name} {error.details()}") from error
