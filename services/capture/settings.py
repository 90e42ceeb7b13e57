"""Capture settings (environment variables `SITS_*`), on top of the shared runtime settings."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.capture.spool import FsyncPolicy
from sits.runtime.settings import Settings, renamed


class CaptureSettings(Settings):
    nvml_enabled: bool = Field(True, description="Sample GPUs through NVML (reports 'unavailable' once without a GPU).")
    nvml_hz: float = Field(10.0, gt=0, le=100, description="NVML samples per second per GPU (at most 100).")
    nvml_processes: bool = Field(
        True, description="Read per-process GPU memory (at most 10 times a second; samples in between repeat it)."
    )
    vllm_grpc_addr: str = Field(
        "", description="vLLM gRPC server (GetLoads, SubscribeKvEvents), host:port; empty: off."
    )
    vllm_loads_interval_s: float = Field(0.5, gt=0, le=60, description="GetLoads polling period.")
    engine_control_addr: str = Field(
        "",
        description="The SITS scheduler plugin's engine-control endpoint, host:port (the variable the plugin binds "
        "to): per-tier queueing, live limits and KV blocks; empty: off.",
    )
    engine_control_interval_s: float = Field(
        0.25, gt=0, le=60, description="How often capture reads the plugin's state (the controller's signals)."
    )
    vllm_kv_events: bool = Field(True, description="Subscribe to the engine's KV-cache event stream.")
    vllm_metrics_url: str = Field("", description="vLLM Prometheus endpoint (http://host:port/metrics); empty: off.")
    vllm_metrics_interval_s: float = Field(1.0, gt=0, le=60, description="Prometheus scrape period.")
    vllm_timeout_s: float = Field(2.0, gt=0, le=60, description="Deadline of one GetLoads call or /metrics scrape.")
    capture_engine_name: str = Field(
        "vllm-0",
        validation_alias=renamed("SITS_CAPTURE_ENGINE_NAME", "SITS_ENGINE_NAME"),
        description="Target.engine of the engine this capture watches.",
    )
    capture_engine_gpu_uuid: str = Field(
        "",
        validation_alias=renamed("SITS_CAPTURE_ENGINE_GPU_UUID", "SITS_ENGINE_GPU_UUID"),
        description="GPU UUID of the watched engine, for its samples' target.",
    )
    capture_engine_pids: list[int] = Field(
        default_factory=list,
        validation_alias=renamed("SITS_CAPTURE_ENGINE_PIDS", "SITS_ENGINE_PIDS"),
        description="PIDs of the engine's processes (JSON list).",
    )
    replay_trace: Path | None = Field(None, description="Replay this SITS trace v1 file as a source (demos, tests).")
    replay_speed: float = Field(1.0, gt=0, le=1000, description="Replay speed: 1 real time, 10 ten times faster.")
    replay_loop: bool = Field(False, description="Start the trace again when it ends.")
    replay_as_engine: bool = Field(
        False,
        description="Replay the trace as this capture's own engine (SITS_CAPTURE_ENGINE_NAME on "
        "SITS_CAPTURE_ENGINE_GPU_UUID), so "
        "SITS acts on a live engine while memory follows a recorded one.",
    )
    capture_spool_dir: Path = Field(
        Path("/var/lib/sits/capture-spool"),
        validation_alias=renamed("SITS_CAPTURE_SPOOL_DIR", "SITS_SPOOL_DIR"),
        description="Durable spool for unpublished events.",
    )
    capture_spool_max_bytes: int = Field(
        256 << 20,
        ge=4096,
        validation_alias=renamed("SITS_CAPTURE_SPOOL_MAX_BYTES", "SITS_SPOOL_MAX_BYTES"),
        description="Spool bound; metric samples are dropped oldest-first past it, OOMs never.",
    )
    capture_spool_fsync: FsyncPolicy = Field(
        FsyncPolicy.INTERVAL,
        validation_alias=renamed("SITS_CAPTURE_SPOOL_FSYNC", "SITS_SPOOL_FSYNC"),
        description="fsync policy: always, interval or never.",
    )
    capture_spool_fsync_interval_s: float = Field(
        1.0,
        gt=0,
        le=60,
        validation_alias=renamed("SITS_CAPTURE_SPOOL_FSYNC_INTERVAL_S", "SITS_SPOOL_FSYNC_INTERVAL_S"),
        description="Most time between fsyncs with 'interval'.",
    )
    oom_hook_spool_dir: Path | None = Field(
        None,
        description="Folder the in-process OOM hooks spool into when capture was unreachable (the hook's own "
        "default: /tmp/sits-oom-spool); capture ingests it when set.",
    )
    oom_hook_spool_scan_s: float = Field(2.0, gt=0, le=3600, description="How often that folder is scanned.")
    capture_stream_buffer: int = Field(
        256, ge=1, le=100_000, description="StreamSamples per-client buffer; a client this far behind is closed."
    )
    capture_max_targets: int = Field(4096, ge=1, description="Targets whose latest state GetSnapshot keeps.")
    capture_publish_batch: int = Field(
        4096, ge=1, le=100_000, description="Events per Kafka publishing batch (a target's samples share a record)."
    )
    capture_trace_samples_above: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="Samples at or above this memory fraction are under pressure: they carry a trace (where "
        "incidents start) and travel on the urgent lane; calmer ones are published without a span.",
    )
    capture_urgent_lane: bool = Field(
        True,
        description="Publish samples at or above SITS_CAPTURE_TRACE_SAMPLES_ABOVE on sits.metrics.urgent.v1, which "
        "the decision and the validator handle before calm samples (false: every sample on sits.metrics.v1).",
    )
    capture_linger_ms: float = Field(
        0.0,
        ge=0.0,
        le=5000.0,
        description=(
            "How long calm samples may wait for more of their target's to share a Kafka record (0: none); "
            "OOMs and samples at or above SITS_CAPTURE_TRACE_SAMPLES_ABOVE go at once. For large fleets."
        ),
    )
