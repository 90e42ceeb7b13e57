"""The mesh policy: one validated file from which every Envoy and Istio config is rendered.

Pure: no I/O except `load_policy`, which only reads the YAML file it is given.
Values are range-checked here so that a policy that validates always renders a
config Envoy accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sits.runtime.contract import ALL_TIERS

# The tiers' mesh names (sits.runtime.contract.Tier.mesh_name) spelled as a type, so pydantic checks a policy's
# class names; tests/mesh/test_policy_and_admission.py holds it to the contract.
PriorityName = Literal["p0", "p1", "p2"]
PRIORITY_NAMES: tuple[PriorityName, ...] = tuple(cast(PriorityName, tier.mesh_name) for tier in ALL_TIERS)

# HTTP/2 (RFC 9113) bounds; Envoy rejects windows outside them.
MIN_H2_WINDOW = 65_535
MAX_H2_WINDOW = 2**31 - 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Endpoint(_Frozen):
    address: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)


class Http2Limits(_Frozen):
    """Flow-control limits, set on both the listener and the upstream cluster.

    Envoy 1.36+ defaults to 16 MiB stream / 24 MiB connection windows, which
    would let one slow client pin megabytes; these keep every stream small.
    """

    initial_stream_window_bytes: int = Field(65_536, ge=MIN_H2_WINDOW, le=MAX_H2_WINDOW)
    initial_connection_window_bytes: int = Field(1_048_576, ge=MIN_H2_WINDOW, le=MAX_H2_WINDOW)
    max_concurrent_streams: int = Field(256, ge=1, le=2**31 - 1)
    per_connection_buffer_limit_bytes: int = Field(65_536, ge=1024, le=64 << 20)

    @model_validator(mode="after")
    def _connection_window_holds_a_stream(self) -> Http2Limits:
        if self.initial_connection_window_bytes < self.initial_stream_window_bytes:
            raise ValueError("initial_connection_window_bytes must be >= initial_stream_window_bytes")
        return self


class Timeouts(_Frozen):
    connect_s: float = Field(2.0, gt=0, le=60)
    # Token streams can run for minutes: the route timeout is off and an idle
    # timeout catches streams that stopped moving instead.
    stream_idle_s: float = Field(30.0, gt=0, le=3600)


class PriorityClass(_Frozen):
    """Circuit-breaker limits of one priority's cluster; the executor moves them at runtime."""

    max_connections: int = Field(64, ge=0, le=1_000_000)
    max_pending_requests: int = Field(64, ge=0, le=1_000_000)
    max_requests: int = Field(256, ge=0, le=1_000_000)
    max_retries: int = Field(0, ge=0, le=1_000_000)
    # Fraction of pressure (0..1) at which the external processor sheds this
    # priority; 1.0 means never (the overload manager still stops everything).
    shed_at_pressure: float = Field(1.0, ge=0.0, le=1.0)


def _default_priorities() -> dict[PriorityName, PriorityClass]:
    return {
        "p0": PriorityClass(max_requests=256, shed_at_pressure=1.0),
        "p1": PriorityClass(max_requests=128, shed_at_pressure=0.85),
        "p2": PriorityClass(max_requests=64, shed_at_pressure=0.7),
    }


class Priorities(_Frozen):
    header: str = Field("x-sits-priority", pattern=r"^[a-z0-9-]+$")
    default: PriorityName = "p1"
    classes: dict[PriorityName, PriorityClass] = Field(default_factory=_default_priorities)

    @model_validator(mode="after")
    def _all_classes(self) -> Priorities:
        missing = [p for p in PRIORITY_NAMES if p not in self.classes]
        if missing:
            raise ValueError(f"priorities.classes lacks {missing}")
        return self


class Overload(_Frozen):
    """GPU pressure, written by SITS into a file that Envoy's `injected_resource` monitor reads."""

    pressure_file: str = "/var/run/sits/gpu_pressure"
    # Above `shed_at`, new streams are refused at header decoding (load-shed point);
    # above `stop_accepting_at`, the overload manager stops accepting requests.
    shed_at: float = Field(0.9, gt=0.0, le=1.0)
    stop_accepting_at: float = Field(0.95, gt=0.0, le=1.0)
    refresh_interval_s: float = Field(0.05, gt=0, le=10)

    @model_validator(mode="after")
    def _shed_below_stop(self) -> Overload:
        if self.shed_at >= self.stop_accepting_at:
            raise ValueError("overload.shed_at must be lower than overload.stop_accepting_at")
        return self


class RateLimit(_Frozen):
    max_tokens: int = Field(1000, ge=1, le=10_000_000)
    tokens_per_fill: int = Field(1000, ge=1, le=10_000_000)
    fill_interval_s: float = Field(1.0, ge=0.05, le=3600)
    # Percent of requests the filter looks at / enforces on; runtime can move both.
    enabled_percent: int = Field(100, ge=0, le=100)
    enforced_percent: int = Field(100, ge=0, le=100)


class Admission(_Frozen):
    """The external processor that checks each Generate against free KV memory."""

    enabled: bool = True
    address: str = "127.0.0.1"
    port: int = Field(50070, ge=1, le=65535)
    # How long Envoy waits for one processor answer before failing open.
    message_timeout_s: float = Field(0.5, gt=0, le=10)
    # Processor's own wait for the decision service, after which it admits.
    decision_timeout_s: float = Field(0.2, gt=0, le=10)
    # Only this gRPC method carries prompts; everything else passes untouched.
    generate_path: str = "/vllm.grpc.engine.VllmEngine/Generate"
    # When the decision service cannot answer, the processor still refuses
    # requests whose prompt + max_tokens exceed this (0: no local cap).
    fallback_max_total_tokens: int = Field(0, ge=0, le=10_000_000)
    # Engine name sent in AdmitRequest.target.engine.
    engine: str = "vllm-0"
    # False: Envoy sends only the body; the route tells the processor the
    # priority through the ext_proc stream's metadata (one round trip less).
    # True: headers go to the processor too (Istio output always sends them).
    send_headers: bool = False
    # STREAMED: Envoy forwards headers at once and holds only the body chunk that
    # completes the message. BUFFERED_PARTIAL: Envoy holds headers and body (up to
    # its buffer limit) until the processor answers.
    body_mode: Literal["STREAMED", "BUFFERED_PARTIAL"] = "STREAMED"
    # Small requests skip the decision service: admitted locally when their KV
    # need is at most this fraction of the free KV in an Admit answer younger
    # than `local_admit_max_age_s` (0: always ask).
    local_admit_fraction: float = Field(0.01, ge=0.0, le=0.5)
    local_admit_max_age_s: float = Field(0.5, ge=0.0, le=10.0)
    # KV bytes per token of the served model, for the local estimate (0: unknown, always ask).
    kv_bytes_per_token: int = Field(0, ge=0, le=1 << 30)
    # Bypass (sits_mesh/bypass.py): while one request of `bypass_max_request_tokens`
    # (the engine's max model length) fits `bypass_headroom` times over in the free
    # KV and pressure sheds no priority, no verdict could refuse, so Envoy routes
    # Generate past the processor. The processor probes the decision service every
    # `bypass_check_interval_s`; the bypass opens after `bypass_open_after_s` of
    # clear probes and closes at the first that is not. 0: inspect every request.
    bypass_max_request_tokens: int = Field(0, ge=0, le=10_000_000)
    bypass_headroom: float = Field(2.0, ge=1.0, le=1000.0)
    bypass_check_interval_s: float = Field(0.1, ge=0.01, le=10)
    bypass_open_after_s: float = Field(1.0, ge=0.0, le=600)


class Tenant(_Frozen):
    """A tenant of the OpenAI-compatible API and the tier its requests run at (what gateways map)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    tier: PriorityName
    # `Authorization: Bearer <key>` values that identify this tenant.
    api_keys: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _keys_are_printable(self) -> Tenant:
        for key in self.api_keys:
            if not key or any(not (33 <= ord(c) < 127) for c in key):
                raise ValueError(f"tenant {self.name}: an API key must be printable ASCII without spaces")
        return self


class HttpApi(_Frozen):
    """The OpenAI-compatible HTTP path (`engine_api: openai`): vLLM's `/v1/completions` and `/v1/chat/completions`."""

    # Served model names; a request for another model gets 404 before the engine (empty: not checked).
    models: list[str] = Field(default_factory=list)
    # The served model's `tokenizer.json` for counting prompt tokens; None: UTF-8 bytes, a bound that never
    # undercounts a byte-level tokenizer.
    tokenizer_path: str | None = None
    # The engine's max model length: the `max_tokens` a request that names none may reach (0: unknown).
    max_model_len: int = Field(0, ge=0, le=10_000_000)
    # Bodies over this get 413 from Envoy before anything is parsed; Envoy holds at most this per request.
    max_body_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    # Seconds a shed or overloaded client is told to wait (`Retry-After`).
    retry_after_s: int = Field(1, ge=0, le=3600)
    # Tier by API key (or by `tenant_header`, when a gateway in front sets it). With tenants, the client's
    # own tier header is ignored: a key without a tenant runs at `priorities.default`.
    tenants: list[Tenant] = Field(default_factory=list)
    tenant_header: str | None = Field(None, pattern=r"^[a-z0-9-]+$")

    @model_validator(mode="after")
    def _unique_tenants(self) -> HttpApi:
        names = [t.name for t in self.tenants]
        keys = [k for t in self.tenants for k in t.api_keys]
        if len(set(names)) != len(names):
            raise ValueError("http.tenants: tenant names must be unique")
        if len(set(keys)) != len(keys):
            raise ValueError("http.tenants: an API key may belong to one tenant only")
        return self


class OutlierDetection(_Frozen):
    """Istio DestinationRule outlier detection: eject an engine that keeps failing."""

    consecutive_5xx_errors: int = Field(5, ge=1, le=1000)
    interval_s: float = Field(10.0, gt=0, le=3600)
    base_ejection_time_s: float = Field(30.0, gt=0, le=3600)
    max_ejection_percent: int = Field(50, ge=0, le=100)


class MeshPolicy(_Frozen):
    version: int = Field(1, ge=1)
    name: str = Field("sits", pattern=r"^[a-z0-9-]+$")
    listener: Endpoint = Endpoint(address="0.0.0.0", port=10000)
    admin: Endpoint = Endpoint(address="127.0.0.1", port=9901)
    upstream: Endpoint = Endpoint(address="127.0.0.1", port=50051)
    upstream_cluster: str = Field("vllm", pattern=r"^[a-z0-9_]+$")
    http2: Http2Limits = Http2Limits()
    timeouts: Timeouts = Timeouts()
    priorities: Priorities = Priorities()
    overload: Overload = Overload()
    rate_limit: RateLimit = RateLimit()
    admission: Admission = Admission()
    outlier_detection: OutlierDetection = OutlierDetection()
    # The engine's API behind the listener: vLLM's gRPC `Generate`, or its OpenAI-compatible HTTP server.
    engine_api: Literal["grpc", "openai"] = "grpc"
    http: HttpApi = HttpApi()
    # One line per stream, with the client's W3C traceparent; None: no access log.
    access_log_path: str | None = None
    # Istio output.
    namespace: str = Field("default", pattern=r"^[a-z0-9-]+$")
    service_host: str = "vllm.default.svc.cluster.local"
    workload_labels: dict[str, str] = Field(default_factory=lambda: {"app": "vllm"})

    @model_validator(mode="after")
    def _admin_on_loopback(self) -> MeshPolicy:
        if self.admin.address not in ("127.0.0.1", "::1"):
            raise ValueError("admin.address must be loopback (127.0.0.1 or ::1): the admin API can reconfigure")
        return self

    def cluster_for(self, priority: PriorityName) -> str:
        return tier_cluster(self.upstream_cluster, priority)


def tier_cluster(upstream_cluster: str, priority: PriorityName) -> str:
    """The Envoy cluster of one priority tier of the upstream (the executor names it from its own config)."""
    return f"{upstream_cluster}_{priority}"


class PolicyError(ValueError):
    """The policy file does not validate; the message names each bad field."""


def parse_policy(text: str, source: str = "<policy>") -> MeshPolicy:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise PolicyError(f"{source}: not YAML: {err}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: the top level must be a mapping")
    try:
        return MeshPolicy.model_validate(data)
    except ValidationError as err:
        lines = [
            f"{'.'.join(str(p) for p in problem['loc']) or '<root>'}: {problem['msg']}" for problem in err.errors()
        ]
        raise PolicyError(f"{source}: invalid mesh policy:\n  " + "\n  ".join(lines)) from None


def load_policy(path: Path) -> MeshPolicy:
    return parse_policy(path.read_text(), str(path))
