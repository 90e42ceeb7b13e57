"""The engine-control gRPC endpoint, served from a thread inside the EngineCore process.

A synchronous grpc server with its own small thread pool: the engine's main
thread (the busy loop) is never blocked by it, except for the moment
`schedule()` and a control call contend for the scheduler's control lock.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from sits.runtime import engine_control as protocol

if TYPE_CHECKING:
    from sits_engine.vllm_plugin.scheduler import SitsScheduler


def start_control_server(scheduler: SitsScheduler, address: str) -> grpc.Server:
    def unary(handler: Callable[[dict[str, Any]], Any]) -> grpc.RpcMethodHandler[Any, Any]:
        def behaviour(request: dict[str, Any], context: grpc.ServicerContext) -> dict[str, Any]:
            try:
                result = handler(request)
            except protocol.LimitError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            return result if isinstance(result, dict) else {"items": result}

        return grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=protocol.decode, response_serializer=protocol.encode
        )

    handlers = {
        "GetState": unary(lambda _request: scheduler.control_state()),
        "SetLimits": unary(lambda request: scheduler.set_limits(request.get("limits", {}))),
        "ListRequests": unary(lambda _request: scheduler.list_requests()),
        "AbortRequests": unary(lambda request: scheduler.abort_requests(request.get("request_ids"))),
        "ResetPrefixCache": unary(
            lambda request: scheduler.reset_prefix_cache_when_idle(float(request.get("wait_idle_s", 2.0)))
        ),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sits-control"))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(protocol.SERVICE, handlers),))
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"SITS engine control: cannot bind {address}")
    server.start()
    return server
