"""Executor settings (environment variables `SITS_*`), on top of the shared runtime settings."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.executor.adapters.mig import MigGpu
from sits.runtime.settings import Settings, renamed


class EngineEndpoints(BaseModel):
    """How the executor reaches one engine (a target, named by `Target.engine`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_addr: str = Field(description="vLLM gRPC server (Abort), host:port; cache flushes go through control_addr.")
    control_addr: str = Field(description="SITS engine-control endpoint inside the EngineCore, host:port.")
    envoy_cluster: str = Field("vllm", description="Mesh upstream cluster prefix; tiers are <prefix>_p0.._p2.")
    gpu_uuid: str = Field("", description="GPU the engine runs on; GPU-level commands for it come here.")


class ExecutorSettings(Settings):
    executor_targets: dict[str, EngineEndpoints] = Field(
        default_factory=dict,
        description='Engines this executor may act on, as JSON: {"vllm-0": {"engine_addr": ..., "control_addr": ...}}.',
    )
    envoy_admin_url: str = Field("", description="Envoy admin URL (http://127.0.0.1:9901); empty: no Envoy actions.")
    envoy_pressure_file: Path | None = Field(
        None, description="File Envoy's injected_resource overload monitor reads; replaced by atomic rename."
    )
    executor_group: str = Field(
        "sits-executor",
        validation_alias=renamed("SITS_EXECUTOR_GROUP", "SITS_EXECUTOR_GROUP_ID"),
        description="Kafka consumer group of the executor replicas (after SITS_TOPIC_PREFIX), for healing commands.",
    )
    executor_lease_ttl_ms: int = Field(
        10_000, ge=100, le=600_000, description="Per-target lease lifetime; bounds how long a crashed executor blocks."
    )
    executor_flush_wait_idle_s: float = Field(
        2.0, ge=0.0, le=60.0, description="FlushCache waits this long for the engine to go idle."
    )
    executor_reconcile_interval_s: float = Field(
        1.0, gt=0.0, le=60.0, description="How often breaker TTLs are re-evaluated and pushed to Envoy."
    )
    executor_breaker_closed_max_requests: int = Field(
        1024,
        ge=1,
        validation_alias=renamed("SITS_EXECUTOR_BREAKER_CLOSED_MAX_REQUESTS", "SITS_BREAKER_CLOSED_MAX_REQUESTS"),
        description="Envoy max_requests of a closed tier.",
    )
    executor_breaker_half_open_max_requests: int = Field(
        4,
        ge=1,
        validation_alias=renamed("SITS_EXECUTOR_BREAKER_HALF_OPEN_MAX_REQUESTS", "SITS_BREAKER_HALF_OPEN_MAX_REQUESTS"),
        description="Envoy max_requests while half-open (probes).",
    )
    executor_breaker_default_ttl_s: int = Field(
        30,
        ge=1,
        le=86_400,
        validation_alias=renamed("SITS_EXECUTOR_BREAKER_DEFAULT_TTL_S", "SITS_BREAKER_DEFAULT_TTL_S"),
        description="Open time of a breaker without a TTL.",
    )
    executor_mig_gpus: dict[str, MigGpu] = Field(
        default_factory=dict,
        description='MIG GPU under each target, as JSON: {"vllm-0": {"model": "h200-141gb", "device_index": 0}}.',
    )
    executor_mig_apply: bool = Field(
        False,
        validation_alias=renamed("SITS_EXECUTOR_MIG_APPLY", "SITS_MIG_APPLY"),
        description="Let MIG rebalancing change the GPU; off, every MIG plan is a dry run.",
    )
    executor_verify_keys_file: Path | None = Field(
        None,
        description="Key ring the executor checks command signatures with: every key in the file is accepted "
        "(two during a rotation). Unset: every command from Kafka is dead-lettered.",
    )
    executor_accept_unsigned: bool = Field(
        False,
        description="Apply commands from Kafka without checking signatures, deadlines or replays: benchmarks and "
        "experiments only, never in production (anyone who can write to the topic steers the engines).",
    )
