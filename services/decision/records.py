"""SITS trace v1 records (plain dicts, see services/capture/traces.py) to domain events.

Pure conversion, no file access: replays and benchmarks read the file with
`services.capture.traces.read_trace` and hand the records here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.decision.domain.types import (
    AllocatorStats,
    EngineLoad,
    GpuMemory,
    OomEvent,
    ProcessMemory,
    Sample,
    Target,
)


def _int(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key, 0)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _allocator(raw: Mapping[str, Any] | None) -> AllocatorStats | None:
    if not raw:
        return None
    return AllocatorStats(
        _int(raw, "allocated_bytes"),
        _int(raw, "reserved_bytes"),
        _int(raw, "inactive_split_bytes"),
        _int(raw, "alloc_retries"),
        _int(raw, "num_ooms"),
        _int(raw, "allocated_floor_bytes"),
        _int(raw, "device_free_bytes"),
    )


def target_from_header(raw: Mapping[str, Any] | None) -> Target:
    raw = raw or {}
    return Target(
        str(raw.get("host", "")),
        str(raw.get("gpu_uuid", "")),
        str(raw.get("mig_instance", "")),
        str(raw.get("engine", "")),
    )


def record_to_sample(
    record: Mapping[str, Any], target: Target, t0: float, sequence: int, event_id: str = "", source: str = "replay"
) -> Sample:
    gpu_raw = record.get("gpu")
    gpu = None
    if gpu_raw:
        gpu = GpuMemory(
            _int(gpu_raw, "used_bytes"),
            _int(gpu_raw, "total_bytes"),
            _int(gpu_raw, "reserved_bytes"),
            _int(gpu_raw, "free_bytes"),
            float(gpu_raw.get("utilization_pct", 0.0) or 0.0),
        )
    processes = tuple(
        ProcessMemory(
            _int(p, "pid"), _int(p, "used_bytes"), str(p.get("name", "")), bool(p.get("is_target_engine", False))
        )
        for p in record.get("processes") or ()
    )
    engine_raw = record.get("engine")
    engine = None
    if engine_raw:
        engine = EngineLoad(
            kv_cache_usage=float(engine_raw.get("kv_cache_usage", 0.0) or 0.0),
            num_requests_running=_int(engine_raw, "num_requests_running"),
            num_requests_waiting=_int(engine_raw, "num_requests_waiting"),
            num_preemptions=_int(engine_raw, "num_preemptions"),
            admission_rejections=_int(engine_raw, "admission_rejections"),
            tokens_in_flight=_int(engine_raw, "tokens_in_flight"),
            kv_blocks_total=_int(engine_raw, "kv_blocks_total"),
            kv_blocks_used=_int(engine_raw, "kv_blocks_used"),
            block_size=_int(engine_raw, "block_size"),
            lora_adapters_loaded=_int(engine_raw, "lora_adapters_loaded"),
            max_num_seqs=_int(engine_raw, "max_num_seqs"),
            token_budget=_int(engine_raw.get("limits") or {}, "max_num_scheduled_tokens"),
            max_num_batched_tokens=_int(engine_raw, "max_num_batched_tokens"),
        )
    return Sample(
        target=target,
        t=t0 + float(record["t"]),
        event_id=event_id,
        source=source,
        sequence=sequence,
        gpu=gpu,
        processes=processes,
        engine=engine,
        allocator=_allocator(record.get("allocator")),
    )


def record_to_oom(record: Mapping[str, Any], target: Target, t0: float, event_id: str = "") -> OomEvent:
    return OomEvent(
        target=target,
        t=t0 + float(record["t"]),
        event_id=event_id,
        requested_bytes=_int(record, "requested_bytes"),
        device_free_bytes=_int(record, "device_free_bytes"),
        device_total_bytes=_int(record, "device_total_bytes"),
        allocator=_allocator(record.get("allocator")),
        message=str(record.get("message", "")),
    )
