"""The validator's engine-health probe over vLLM's OpenAI server (`GET /health`), on a real HTTP server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.validator.probes import LiveProbes

TARGET = "host-a/GPU-0//vllm-0"


class Engine(BaseHTTPRequestHandler):
    # What vLLM's OpenAI server answers: 200 while the engine core lives, 503 after it died.
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        Engine.status = 200


async def test_an_openai_engine_is_judged_by_its_health_endpoint(engine_url: str) -> None:
    probes = LiveProbes({"vllm-0": engine_url}, timeout_s=5.0)
    try:
        assert await probes.engine_healthy(TARGET) is True
        Engine.status = 503
        assert await probes.engine_healthy(TARGET) is False
        # An engine not named in the settings is not measured.
        assert await probes.engine_healthy("host-a/GPU-0//vllm-9") is None
    finally:
        await probes.close()


async def test_an_unreachable_openai_engine_is_unhealthy(engine_url: str) -> None:
    probes = LiveProbes({"vllm-0": "http://127.0.0.1:9"}, timeout_s=2.0)
    try:
        assert await probes.engine_healthy(TARGET) is False
    finally:
        await probes.close()
