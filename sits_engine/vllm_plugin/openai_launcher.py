"""vLLM's OpenAI-compatible HTTP server, started so that the engine sees the tier Envoy routed each request by.

    python -m sits_engine.vllm_plugin.openai_launcher --model DIR [vLLM's own flags]

The HTTP twin of `grpc_launcher`. vLLM's OpenAI server names each engine
request `cmpl-<X-Request-Id>...` / `chatcmpl-<X-Request-Id>...`, and the SITS
scheduler reads the tier from that id (`engine_control.priority_tier_of_request_id`).
A client names its own X-Request-Id (and `priority` in the body, which the
plugin overwrites), so neither proves anything: this launcher runs vLLM's own
server (same flags, same app) with one ASGI middleware that rewrites
X-Request-Id from the `x-sits-priority` header. Behind the mesh that header is
the tier Envoy routed the request by (every route overwrites it), so a client
that sends `X-Request-Id: p0-...` on a P2 route runs as P2. A request without
the header (a client on the engine's own port, outside the mesh) keeps its id.

Unless the command line names them, the launcher adds the SITS scheduler
(`--scheduler-cls`, `--scheduling-policy priority`); the OOM hook comes with
the package's `vllm.general_plugins` entry point, in every vLLM process.
"""

from __future__ import annotations

import importlib
import json
import sys
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sits.runtime.contract import TIER_HEADER
from sits.runtime.engine_control import retag_request_id

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SCHEDULER_CLS = "sits_engine.vllm_plugin.scheduler.SitsScheduler"
MIDDLEWARE = "sits_engine.vllm_plugin.openai_launcher.TierMiddleware"
_TIER = TIER_HEADER.encode()
_REQUEST_ID = b"x-request-id"
_SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


def retag_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]] | None:
    """The headers with X-Request-Id carrying the routed tier; None when no tier was routed.

    Raises ValueError for a tier header that names no tier.
    """
    tier = None
    request_id = None
    for key, value in headers:
        lowered = key.lower()
        if lowered == _TIER:
            tier = value.decode("latin-1")
        elif lowered == _REQUEST_ID:
            request_id = value.decode("latin-1")
    if tier is None:
        return None
    tagged = retag_request_id(request_id or uuid.uuid4().hex, tier)
    kept = [(key, value) for key, value in headers if key.lower() != _REQUEST_ID]
    return [*kept, (_REQUEST_ID, tagged.encode("latin-1"))]


class TierMiddleware:
    """ASGI middleware (vLLM's `--middleware`): X-Request-Id from the routed tier header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http":
            try:
                headers = retag_headers(list(scope.get("headers") or ()))
            except ValueError:
                await _bad_tier(send)
                return
            if headers is not None:
                scope = dict(scope)
                scope["headers"] = headers
        await self.app(scope, receive, send)


async def _bad_tier(send: Send) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"{TIER_HEADER} must be p0, p1 or p2",
                "type": "invalid_request_error",
                "code": "invalid_tier",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def server_argv(argv: list[str]) -> list[str]:
    """vLLM's arguments with the SITS middleware, and the SITS scheduler unless one is named."""
    args = [*argv, "--middleware", MIDDLEWARE]
    if not _has_flag(argv, "--scheduler-cls"):
        args += ["--scheduler-cls", SCHEDULER_CLS]
    if not _has_flag(argv, "--scheduling-policy"):
        # Tiers order vLLM's waiting queue only under its priority policy.
        args += ["--scheduling-policy", "priority"]
    return args


def main() -> Any:
    sys.argv = [sys.argv[0], *server_argv(sys.argv[1:])]
    for name in _SERVER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is not None and not name.startswith(error.name):
                raise
            continue
        if hasattr(module, "main"):
            return module.main()
        # vLLM 0.26 starts its server only under `__main__`.
        import runpy

        return runpy.run_module(name, run_name="__main__")
    raise SystemExit(f"no vLLM OpenAI server module found (tried {', '.join(_SERVER_MODULES)})")


if __name__ == "__main__":
    raise SystemExit(main())
