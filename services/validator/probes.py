"""The validator's live probes: is the engine alive, and has any P0 request been refused?

- Engine health: vLLM's own gRPC `HealthCheck` on the engine the target names,
  or, for an engine named by an http(s) URL (vLLM's OpenAI server), its
  `GET /health` (200 while the engine core is alive, 503 once it died).
- P0 refusals: counters in Prometheus text, summed: Envoy's overflow of the P0
  cluster's circuit breaker (`/stats/prometheus` on the admin port) and SITS
  admission's refusals of P0 (`sits_shed_requests_total{priority="p0"}` on the
  processor's /metrics). The validator reads them when a watch starts and when
  it is judged; the difference is what the action's window refused.
A probe that cannot reach its endpoint answers None: that part is then not measured.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from sits.runtime.contract import parse_target_key

log = logging.getLogger(__name__)

ENVOY_P0_OVERFLOW = ("envoy_cluster_upstream_rq_pending_overflow", "envoy_cluster_name")
ADMISSION_P0_REFUSED = ("sits_shed_requests", "priority")


def sum_counter(text: str, name: str, label: str, value: str) -> float:
    """Sum of the samples of counter `name` whose `label` is `value` (counters may carry `_total`)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.removesuffix("_total") == name and sample.labels.get(label) == value:
                total += sample.value
    return total


class LiveProbes:
    def __init__(
        self,
        engines: Mapping[str, str],
        *,
        envoy_admin_url: str = "",
        p0_cluster: str = "vllm_p0",
        admission_metrics_url: str = "",
        timeout_s: float = 2.0,
    ) -> None:
        self._engines = dict(engines)
        self._envoy = envoy_admin_url.rstrip("/")
        self._p0_cluster = p0_cluster
        self._admission = admission_metrics_url
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._warned: set[str] = set()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()

    async def engine_healthy(self, target_key: str) -> bool | None:
        try:
            address = self._engines.get(parse_target_key(target_key).engine)
        except ValueError:
            address = None
        if address is None:
            return None
        if address.startswith(("http://", "https://")):
            return await self._http_healthy(address)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        try:
            reply = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.healthy)

    async def _http_healthy(self, base_url: str) -> bool:
        try:
            async with httpx.AsyncClient(timeout=self._timeout_s) as client:
                response = await client.get(f"{base_url.rstrip('/')}/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def p0_refused(self, target_key: str) -> float | None:
        readings = []
        if self._envoy:
            name, label = ENVOY_P0_OVERFLOW
            readings.append(self._scrape(f"{self._envoy}/stats/prometheus", name, label, self._p0_cluster))
        if self._admission:
            name, label = ADMISSION_P0_REFUSED
            readings.append(self._scrape(self._admission, name, label, "p0"))
        if not readings:
            return None
        values = await asyncio.gather(*readings)
        if any(v is None for v in values):
            return None
        return float(sum(v for v in values if v is not None))

    async def _scrape(self, url: str, name: str, label: str, value: str) -> float | None:
        try:
            async with httpx.AsyncClient(timeout=self._timeout_s) as client:
                response = await client.get(url)
                response.raise_for_status()
        except httpx.HTTPError as error:
            if url not in self._warned:
                self._warned.add(url)
                log.warning("P0 refusals not measured: %s unreachable (%s)", url, error)
            return None
        return sum_counter(response.text, name, label, value)
