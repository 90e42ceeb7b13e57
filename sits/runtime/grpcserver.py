"""A grpc.aio server with what every SITS service needs.

`grpc.health.v1` (SERVING once started, NOT_SERVING while draining), server
reflection, W3C trace context from call metadata (OpenTelemetry's server
interceptor), bearer-token authentication on mutating methods, a bound
on message size, and TLS (optionally mutual) when given server credentials
(`sits.runtime.grpc_tls.server_credentials(settings)`).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor

from sits.runtime import metrics

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"


def read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),)


class _Refusal:
    """Builds a handler that answers every call with one status."""

    @staticmethod
    def handler(
        original: grpc.RpcMethodHandler[Any, Any], code: grpc.StatusCode, details: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(code, details)

        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(code, details)
            yield  # pragma: no cover - makes this an async generator

        if original.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=original.request_deserializer,
                response_serializer=original.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=original.request_deserializer,
            response_serializer=original.response_serializer,
        )


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses mutating methods without `authorization: Bearer <token>` (UNAUTHENTICATED).

    With no token configured the server refuses mutating calls altogether:
    failing closed is the only safe default for calls that change production.
    """

    def __init__(self, token: str | None, mutating_methods: Iterable[str]) -> None:
        self._token = token
        self._mutating = frozenset(mutating_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._mutating:
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get(AUTH_HEADER, "")
        if self._token is None:
            reason = "this server has no token configured; mutating calls are refused"
        elif not isinstance(presented, str) or not presented.startswith("Bearer "):
            reason = "missing bearer token (metadata 'authorization: Bearer <token>')"
        elif not hmac.compare_digest(presented[len("Bearer ") :].encode(), self._token.encode()):
            reason = "invalid bearer token"
        else:
            return handler
        metrics.GRPC_REJECTED.labels(method=method, code="UNAUTHENTICATED").inc()
        return _Refusal.handler(handler, grpc.StatusCode.UNAUTHENTICATED, reason)


@dataclass(frozen=True)
class ServiceBinding:
    """One gRPC service to host: its generated `add_*_to_server`, the servicer and full name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str


class GrpcServer:
    """Hosts SITS gRPC services; an async context manager whose stop() is safe twice."""

    def __init__(
        self,
        bindings: Sequence[ServiceBinding],
        *,
        bind: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        mutating_methods: Iterable[str] = (),
        max_message_bytes: int = 1 << 20,
        grace_s: float = 5.0,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self._bindings = list(bindings)
        self._credentials = credentials
        self._address = f"{bind}:{port}"
        self._grace_s = grace_s
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._server = grpc.aio.server(
            interceptors=[
                aio_server_interceptor(),  # type: ignore[no-untyped-call]
                TokenAuthInterceptor(token, mutating_methods),
            ],
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes * 4),
                ("grpc.so_reuseport", 0),
            ],
        )
        for binding in self._bindings:
            binding.add_to_server(binding.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [b.full_name for b in self._bindings]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._server,
        )
        self.port = 0
        self._running = False

    @property
    def tls(self) -> bool:
        return self._credentials is not None

    @property
    def address(self) -> str:
        host = self._address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        if self._running:
            return
        if self._credentials is None:
            self.port = self._server.add_insecure_port(self._address)
        else:
            self.port = self._server.add_secure_port(self._address, self._credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {self._address}")
        await self._server.start()
        self._running = True
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.stop(self._grace_s)

    async def _set_all(self, status: int) -> None:
        await self._health.set("", status)
        for binding in self._bindings:
            await self._health.set(binding.full_name, status)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def abort_invalid(context: grpc.aio.ServicerContext[Any, Any], reason: str) -> None:
    """INVALID_ARGUMENT with a reason a person can act on."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
