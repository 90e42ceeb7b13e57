"""The engine as the SITS scheduler plugin sees it, from inside the EngineCore.

Polls the plugin's engine-control endpoint (`GetState`, sits.runtime.engine_control)
every `interval_s`: per-tier queueing (waiting, oldest waiting age, queue wait
p50/p90, preemptions, KV blocks held), the live limits and the token ceiling,
the KV pool's exact block counts, and the engine's caching allocator (reserved,
allocated, the floor held between steps) when it runs on a GPU. This is what
the decision's tier controller steers by, what admission reads free KV from,
and what the step budget is sized against; vLLM's own GetLoads has neither tiers nor
the free-block count. A failed poll turns the source unhealthy and retries
with backoff.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.capture import metrics
from services.capture.sources.base import Backoff, Event, Health, Sleep, default_sleep
from sits.runtime import engine_control as protocol
from sits.v1 import common_pb2, events_pb2

log = logging.getLogger(__name__)


def state_to_sample(state: dict[str, Any], target: common_pb2.Target) -> events_pb2.MetricSample:
    sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_ENGINE)
    sample.meta.target.CopyFrom(target)
    sample.meta.source = "capture/engine-control"
    engine = sample.engine
    engine.kv_cache_usage = min(1.0, max(0.0, float(state.get("kv_cache_usage", 0.0))))
    engine.num_requests_running = int(state.get("running", 0))
    engine.num_requests_waiting = int(state.get("waiting", 0))
    info = state.get("engine", {})
    engine.block_size = int(info.get("block_size", 0))
    engine.max_num_seqs = int(info.get("max_num_seqs", 0))
    engine.max_num_batched_tokens = int(info.get("max_num_batched_tokens", 0))
    total = int(state.get("kv_blocks_total", 0))
    if total > 0:
        engine.kv_blocks_total = total
        engine.kv_blocks_used = max(0, total - int(state.get("kv_blocks_free", total)))
    limits = state.get("limits", {})
    for key in (protocol.MAX_NUM_RUNNING_REQS, protocol.MAX_NUM_SCHEDULED_TOKENS, protocol.MAX_PREFILL_CHUNK_TOKENS):
        if key in limits:
            setattr(engine.limits, key, int(limits[key]))
    if protocol.ADMISSION_PAUSED in limits:
        engine.limits.admission_paused = bool(limits[protocol.ADMISSION_PAUSED])
    preemptions = 0
    for name, tier in sorted(state.get("tiers", {}).items()):
        load = engine.tiers.add(
            priority=common_pb2.Priority.ValueType(int(name) + 1),
            running=int(tier.get("running", 0)),
            waiting=int(tier.get("waiting", 0)),
            oldest_wait_s=float(tier.get("oldest_wait_s", 0.0)),
            queue_wait_p50_s=float(tier.get("queue_wait_p50_s", 0.0)),
            queue_wait_p90_s=float(tier.get("queue_wait_p90_s", 0.0)),
            queue_wait_samples=int(tier.get("queue_wait_samples", 0)),
            preemptions=int(tier.get("preemptions", 0)),
            scheduled=int(tier.get("scheduled", 0)),
            kv_blocks=int(tier.get("kv_blocks", 0)),
        )
        preemptions += load.preemptions
    engine.num_preemptions = preemptions
    allocator = state.get("allocator") or {}
    if allocator.get("reserved_bytes"):
        # The engine's own caching allocator (the plugin reads it inside the EngineCore process).
        sample.allocator.CopyFrom(
            events_pb2.AllocatorStats(
                allocated_bytes=int(allocator.get("allocated_bytes", 0)),
                reserved_bytes=int(allocator["reserved_bytes"]),
                inactive_split_bytes=int(allocator.get("inactive_split_bytes", 0)),
                alloc_retries=int(allocator.get("alloc_retries", 0)),
                num_ooms=int(allocator.get("num_ooms", 0)),
                allocated_floor_bytes=int(allocator.get("allocated_floor_bytes", 0)),
                device_free_bytes=int(allocator.get("device_free_bytes", 0)),
            )
        )
    return sample


class EngineControlSource:
    def __init__(
        self,
        addr: str,
        target: common_pb2.Target,
        *,
        interval_s: float = 0.25,
        timeout_s: float = 2.0,
        sleep: Sleep = default_sleep,
        name: str = "engine-control",
    ) -> None:
        self.name = name
        self._addr = addr
        self._target = target
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._sleep = sleep
        self._health = Health(name, healthy=False, detail="not started")

    def health(self) -> Health:
        return self._health

    async def events(self) -> AsyncIterator[Event]:
        backoff = Backoff(self._interval_s, 30.0)
        async with grpc.aio.insecure_channel(self._addr) as channel:
            get_state = channel.unary_unary(
                protocol.GET_STATE, request_serializer=protocol.encode, response_deserializer=protocol.decode
            )
            while True:
                try:
                    state = await get_state({}, timeout=self._timeout_s)
                except grpc.aio.AioRpcError as exc:
                    self._health = Health(self.name, healthy=False, detail=f"GetState failed: {exc.code().name}")
                    metrics.SOURCE_ERRORS.labels(source=self.name).inc()
                    await self._sleep(backoff.next_delay())
                    continue
                backoff.reset()
                self._health = Health(self.name, healthy=True, detail=f"GetState every {self._interval_s} s")
                yield state_to_sample(state, self._target)
                await self._sleep(self._interval_s)
