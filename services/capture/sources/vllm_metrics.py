"""vLLM engine source over its Prometheus `/metrics` endpoint.

vLLM's gRPC launcher (`vllm.entrypoints.launchers.grpc_server`, Python
servicer) serves no `/metrics`; the OpenAI HTTP server
(`vllm.entrypoints.openai.api_server`) does, and that is what this source
scrapes. An endpoint that answers garbage, hangs past the deadline or is gone
turns the source unhealthy (exported as `sits_capture_source_healthy`) and
the scrape is retried with backoff; the service keeps running.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.capture import metrics
from services.capture.sources.base import Backoff, Event, Health, Sleep, default_sleep
from sits.v1 import common_pb2, events_pb2

log = logging.getLogger(__name__)

# vLLM family name -> EngineLoad field.
WANTED = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:num_preemptions": "num_preemptions",
    "vllm:admission_rejections": "admission_rejections",
}
MAX_BODY_BYTES = 8 << 20


class MetricsParseError(ValueError):
    pass


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum each wanted family over its labels (one engine may report per model / per rank)."""
    found: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises several types on garbage
        raise MetricsParseError(f"not Prometheus text: {exc}") from exc
    # Matched on sample names, not family names: counters appear as `<name>_total`, and the
    # parser splits a family whose TYPE line and samples disagree on the suffix.
    collected: dict[str, list[float]] = {}
    for family in families:
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            field = WANTED.get(name)
            if field is not None:
                collected.setdefault(field, []).append(sample.value)
    for field, values in collected.items():
        found[field] = max(values) if field == "kv_cache_usage" else sum(values)
    if not found:
        raise MetricsParseError("no vLLM metrics in the response")
    return found


def values_to_sample(values: Mapping[str, float], target: common_pb2.Target) -> events_pb2.MetricSample:
    sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_ENGINE)
    sample.meta.target.CopyFrom(target)
    sample.meta.source = "capture/vllm-metrics"
    engine = sample.engine
    engine.SetInParent()
    for field, value in values.items():
        setattr(engine, field, float(value) if field == "kv_cache_usage" else int(value))
    return sample


class VllmMetricsSource:
    def __init__(
        self,
        url: str,
        target: common_pb2.Target,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        sleep: Sleep = default_sleep,
        backoff: Backoff | None = None,
        name: str = "vllm-metrics",
    ) -> None:
        self.name = name
        self._url = url
        self._target = target
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._sleep = sleep
        self._backoff = backoff or Backoff(interval_s, 30.0)
        self._health = Health(name, healthy=False, detail="not started")
        self.scrapes = 0
        self.failures = 0

    def health(self) -> Health:
        return self._health

    async def scrape(self, client: httpx.AsyncClient) -> dict[str, float]:
        response = await client.get(self._url, timeout=self._timeout_s)
        response.raise_for_status()
        if len(response.content) > MAX_BODY_BYTES:
            raise MetricsParseError(f"response of {len(response.content)} bytes is too large")
        return parse_vllm_metrics(response.text)

    async def events(self) -> AsyncIterator[Event]:
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    values = await self.scrape(client)
                except (httpx.HTTPError, MetricsParseError, UnicodeDecodeError) as exc:
                    self.failures += 1
                    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    self._health = Health(self.name, healthy=False, detail=f"scrape of {self._url} failed: {reason}")
                    metrics.SOURCE_ERRORS.labels(source=self.name).inc()
                    metrics.SOURCE_HEALTHY.labels(source=self.name).set(0)
                    await self._sleep(self._backoff.next_delay())
                    continue
                self.scrapes += 1
                self._backoff.reset()
                detail = f"scraping {self._url} every {self._interval_s} s"
                self._health = Health(self.name, healthy=True, detail=detail)
                metrics.SOURCE_HEALTHY.labels(source=self.name).set(1)
                yield values_to_sample(values, self._target)
                await self._sleep(self._interval_s)
