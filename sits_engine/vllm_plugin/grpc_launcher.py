"""vLLM's gRPC server, started so that the engine sees the tier Envoy routed each request by.

    python -m sits_engine.vllm_plugin.grpc_launcher --model DIR --scheduler-cls ... [vLLM's own flags]

vLLM's gRPC servicer passes no call metadata into the engine and its
`GenerateRequest` has no priority field, so the SITS scheduler reads a
request's tier from its request id. A client names its own id, so the id alone
proves nothing: this launcher runs vLLM's own gRPC server (same flags, same
servicer) with one server interceptor that rewrites each `Generate` request's
id prefix from the `x-sits-priority` header. Behind the mesh that header is the
tier Envoy routed the stream by (every route overwrites it), so a client that
sends `x-sits-priority: p2` with the id `p0-...` runs as P2. A call with no
such header (a client on the engine's own port, outside the mesh) keeps its id.

vLLM 0.32 (CPU build) serves from `vllm.entrypoints.launchers.grpc_server`,
0.26 (the H200 build) from `vllm.entrypoints.grpc_server`; both build their
server with `grpc.aio.server(...)`, which is where the interceptor goes in.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import runpy
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sits.runtime.contract import TIER_HEADER
from sits.runtime.engine_control import retag_request_id

log = logging.getLogger("sits.grpc_launcher")

GENERATE_METHOD = "/vllm.grpc.engine.VllmEngine/Generate"
_SERVER_MODULES = ("vllm.entrypoints.launchers.grpc_server", "vllm.entrypoints.grpc_server")


def routed_tier(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == TIER_HEADER:
            return str(value)
    return None


class TierInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Rewrites `Generate` request ids to carry the routed tier."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != GENERATE_METHOD or handler.unary_stream is None:
            return handler
        tier = routed_tier(handler_call_details.invocation_metadata)
        if tier is None:
            return handler
        generate: Any = handler.unary_stream

        async def retagged(request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                request.request_id = retag_request_id(request.request_id, tier)
            except ValueError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{TIER_HEADER} must be p0, p1 or p2")
            async for reply in generate(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(
            retagged,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def install_interceptor() -> None:
    """Make every `grpc.aio.server(...)` built after this carry the tier interceptor."""
    original = grpc.aio.server
    if getattr(original, "_sits_tiers", False):
        return

    @functools.wraps(original)
    def server(*args: Any, **kwargs: Any) -> grpc.aio.Server:
        kwargs["interceptors"] = [TierInterceptor(), *(kwargs.get("interceptors") or ())]
        return original(*args, **kwargs)

    server._sits_tiers = True  # type: ignore[attr-defined]
    grpc.aio.server = server


def vllm_server_module_name() -> str:
    for name in _SERVER_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError as error:
            if error.name is not None and not name.startswith(error.name):
                raise
    raise SystemExit(f"no vLLM gRPC server module found (tried {', '.join(_SERVER_MODULES)})")


def main() -> Any:
    install_interceptor()
    # Run vLLM's launcher as `python -m` would, as `__main__`: imported under its own name instead,
    # smg's servicer switch binds it differently and SubscribeKvEvents relays no batches.
    runpy.run_module(vllm_server_module_name(), run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
