"""vLLM engine source over vLLM's own gRPC API (`smg_grpc_proto`, service `VllmEngine`).

Two feeds, merged into one stream of engine samples for one target:
- `GetLoads`, polled every `interval_s` with a deadline: running and waiting
  requests, KV-cache usage, tokens in use.
- `SubscribeKvEvents`, a server stream: each batch carries the engine's load at
  that scheduler step and the KV blocks stored/removed, from which the number
  of cached blocks is kept. Engines started without `--kv-events-config`
  answer UNIMPLEMENTED: the feed says so in the source's health and retries
  rarely; GetLoads alone keeps the source useful.
Failures turn the source unhealthy and retry with backoff; nothing here stops
the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2

from services.capture import metrics
from services.capture.sources.base import Backoff, Event, Health, Sleep, default_sleep
from sits.v1 import common_pb2, events_pb2

log = logging.getLogger(__name__)


def loads_to_sample(response: Any, target: common_pb2.Target) -> events_pb2.MetricSample:
    sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_ENGINE)
    sample.meta.target.CopyFrom(target)
    sample.meta.source = "capture/vllm-grpc"
    engine = sample.engine
    engine.SetInParent()
    ranks = list(response.loads)
    if ranks:
        engine.num_requests_running = sum(r.num_running_reqs for r in ranks)
        engine.num_requests_waiting = sum(r.num_waiting_reqs for r in ranks)
        engine.tokens_in_flight = sum(r.num_used_tokens for r in ranks)
        engine.kv_cache_usage = max(r.token_usage for r in ranks)
    return sample


class VllmGrpcSource:
    def __init__(
        self,
        addr: str,
        target: common_pb2.Target,
        *,
        interval_s: float = 0.5,
        timeout_s: float = 2.0,
        kv_events: bool = True,
        sleep: Sleep = default_sleep,
        name: str = "vllm-grpc",
    ) -> None:
        self.name = name
        self._addr = addr
        self._target = target
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._kv_events = kv_events
        self._sleep = sleep
        self._loads_health = Health(name, healthy=False, detail="not started")
        self.kv_detail = "off" if not kv_events else "not started"
        self.kv_batches = 0
        self._blocks_cached = 0
        self._block_size = 0

    def health(self) -> Health:
        detail = f"{self._loads_health.detail}; kv events: {self.kv_detail}"
        return Health(self.name, healthy=self._loads_health.healthy, detail=detail)

    async def events(self) -> AsyncIterator[Event]:
        queue: asyncio.Queue[events_pb2.MetricSample] = asyncio.Queue(maxsize=256)
        async with grpc.aio.insecure_channel(self._addr) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            tasks = [asyncio.create_task(self._poll_loads(stub, queue))]
            if self._kv_events:
                tasks.append(asyncio.create_task(self._follow_kv_events(stub, queue)))
            try:
                while True:
                    yield await queue.get()
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task

    @staticmethod
    def _offer(queue: asyncio.Queue[events_pb2.MetricSample], sample: events_pb2.MetricSample) -> None:
        # A consumer that lags loses the oldest engine sample: the newest state matters most.
        if queue.full():
            queue.get_nowait()
        queue.put_nowait(sample)

    async def _poll_loads(self, stub: Any, queue: asyncio.Queue[events_pb2.MetricSample]) -> None:
        backoff = Backoff(self._interval_s, 30.0)
        while True:
            try:
                response = await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=self._timeout_s)
            except grpc.aio.AioRpcError as exc:
                self._loads_health = Health(self.name, healthy=False, detail=f"GetLoads failed: {exc.code().name}")
                metrics.SOURCE_ERRORS.labels(source=self.name).inc()
                await self._sleep(backoff.next_delay())
                continue
            backoff.reset()
            self._loads_health = Health(self.name, healthy=True, detail=f"GetLoads every {self._interval_s} s")
            self._offer(queue, loads_to_sample(response, self._target))
            await self._sleep(self._interval_s)

    async def _follow_kv_events(self, stub: Any, queue: asyncio.Queue[events_pb2.MetricSample]) -> None:
        backoff = Backoff(self._interval_s, 60.0)
        while True:
            request = smg_common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True)
            try:
                async for batch in stub.SubscribeKvEvents(request):
                    backoff.reset()
                    self.kv_batches += 1
                    self.kv_detail = f"streaming ({self.kv_batches} batches)"
                    self._offer(queue, self._batch_to_sample(batch))
                self.kv_detail = "stream ended by the engine; resubscribing"
            except grpc.aio.AioRpcError as exc:
                self.kv_detail = f"{exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    # Not a transient fault: the engine was started without KV events.
                    await self._sleep(60.0)
                    continue
            await self._sleep(backoff.next_delay())

    def _batch_to_sample(self, batch: Any) -> events_pb2.MetricSample:
        for event in batch.events:
            which = event.WhichOneof("data")
            if which == "stored":
                self._blocks_cached += len(event.stored.blocks)
                for block in event.stored.blocks:
                    if block.block_size:
                        self._block_size = block.block_size
            elif which == "removed":
                self._blocks_cached = max(0, self._blocks_cached - len(event.removed.block_hashes))
            elif which == "cleared":
                self._blocks_cached = 0
        sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_ENGINE)
        sample.meta.target.CopyFrom(self._target)
        sample.meta.source = "capture/vllm-kv-events"
        engine = sample.engine
        engine.SetInParent()
        engine.kv_blocks_used = self._blocks_cached
        engine.block_size = self._block_size
        if batch.HasField("load"):
            engine.num_requests_running = batch.load.running_requests
            engine.num_requests_waiting = batch.load.waiting_requests
            engine.kv_cache_usage = batch.load.token_usage
            if batch.load.HasField("num_used_tokens"):
                engine.tokens_in_flight = batch.load.num_used_tokens
            if batch.load.HasField("max_total_num_tokens") and self._block_size:
                engine.kv_blocks_total = batch.load.max_total_num_tokens // self._block_size
        return sample
