"""The Prometheus source against endpoints that answer garbage, hang, or disappear (real HTTP servers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from services.capture.sources.base import Backoff
from services.capture.sources.vllm_metrics import VllmMetricsSource
from sits.v1 import common_pb2, events_pb2

TARGET = common_pb2.Target(host="h", gpu_uuid="GPU-x", engine="vllm-0")
GOOD = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.625
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# TYPE vllm:admission_rejections counter
vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 1.0
vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 4.0
"""


class Endpoint:
    """A real HTTP server whose /metrics behaviour a test switches at will."""

    def __init__(self) -> None:
        self.mode = "good"
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, _request: web.Request) -> web.Response:
        if self.mode == "garbage":
            return web.Response(body=b"\x00\xffthis is {not} prometheus ] text\n\x01", content_type="text/plain")
        if self.mode == "hang":
            await asyncio.sleep(30)
        return web.Response(text=GOOD, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


@pytest.fixture
async def endpoint() -> AsyncIterator[Endpoint]:
    server = Endpoint()
    await server.start()
    yield server
    await server.stop()


class Run:
    """Runs a source in the background, collecting what it yields."""

    def __init__(self, source: VllmMetricsSource) -> None:
        self.source = source
        self.samples: list[events_pb2.MetricSample] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for event in self.source.events():
            assert isinstance(event, events_pb2.MetricSample)
            self.samples.append(event)

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():  # noqa: ASYNC110 - the source offers no event to wait on
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def healthy_gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value("sits_capture_source_healthy", {"source": name})


async def test_good_endpoint_gives_engine_samples(endpoint: Endpoint) -> None:
    run = Run(VllmMetricsSource(endpoint.url, TARGET, interval_s=0.05, name="m-good"))
    await run.until(lambda: len(run.samples) >= 2)
    await run.stop()
    engine = run.samples[0].engine
    assert engine.kv_cache_usage == 0.625
    assert (engine.num_requests_running, engine.num_requests_waiting) == (3, 2)
    assert (engine.num_preemptions, engine.admission_rejections) == (7, 5)
    assert run.source.health().healthy and healthy_gauge("m-good") == 1


async def test_garbage_turns_unhealthy_and_recovers(endpoint: Endpoint) -> None:
    endpoint.mode = "garbage"
    run = Run(VllmMetricsSource(endpoint.url, TARGET, interval_s=0.05, backoff=Backoff(0.05, 0.1), name="m-garbage"))
    await run.until(lambda: run.source.failures >= 2)
    assert not run.source.health().healthy
    assert "MetricsParseError" in run.source.health().detail
    assert healthy_gauge("m-garbage") == 0
    assert run.samples == []
    endpoint.mode = "good"
    await run.until(lambda: len(run.samples) >= 1)
    assert run.source.health().healthy and healthy_gauge("m-garbage") == 1
    await run.stop()


async def test_hanging_endpoint_times_out_with_backoff(endpoint: Endpoint) -> None:
    endpoint.mode = "hang"
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        await asyncio.sleep(0.01)

    source = VllmMetricsSource(endpoint.url, TARGET, interval_s=0.1, timeout_s=0.2, sleep=sleep, name="m-hang")
    run = Run(source)
    await run.until(lambda: source.failures >= 3)
    await run.stop()
    assert "ReadTimeout" in source.health().detail
    assert delays[:3] == [0.1, 0.2, 0.4]


async def test_vanished_endpoint_is_retried_until_it_returns(endpoint: Endpoint) -> None:
    run = Run(VllmMetricsSource(endpoint.url, TARGET, interval_s=0.05, backoff=Backoff(0.05, 0.1), name="m-gone"))
    await run.until(lambda: len(run.samples) >= 1)
    await endpoint.stop()
    await run.until(lambda: not run.source.health().healthy)
    assert "ConnectError" in run.source.health().detail
    before = len(run.samples)
    await endpoint.start()  # same port
    await run.until(lambda: len(run.samples) > before)
    assert run.source.health().healthy
    await run.stop()
