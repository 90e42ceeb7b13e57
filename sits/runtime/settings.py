"""Settings shared by every SITS process.

One name everywhere: every setting is read from an environment variable
`SITS_<FIELD>` (upper case), frozen once loaded, and validated so that a bad
value stops the process at start with a message naming the variable. Each
service extends `Settings` with its own fields; `scripts/settings_doc.py`
renders all of them into the README.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SITS_"


class SettingsError(Exception):
    """A setting is missing or out of range; the message names the variable."""


class Settings(BaseSettings):
    """Settings every service reads."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, host:port[,host:port].")
    kafka_enable_idempotence: bool = Field(
        False, description="Idempotent producer; keep off for Tansu, which does not support InitProducerId."
    )
    kafka_partitions: int = Field(4, ge=1, le=256, description="Partitions for topics SITS creates.")
    kafka_request_timeout_ms: int = Field(
        5000, ge=100, le=120_000, description="How long a produce request may wait for the broker."
    )
    topic_prefix: str = Field(
        "", pattern=r"^[A-Za-z0-9._-]*$", description="Prefix for every topic name (isolates test runs)."
    )
    consumer_max_batch: int = Field(
        500, ge=1, le=100_000, description="Most records one consumer handles per poll; bounds its memory."
    )
    consumer_fetch_max_wait_ms: int = Field(
        10,
        ge=1,
        le=5000,
        description="How long a fetch may wait for data. Tansu answers only when this wait ends, so it bounds "
        "reaction time.",
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for leases, idempotency and state.")
    host_name: str = Field(default_factory=socket.gethostname, description="This host's name in event targets.")
    grpc_bind: str = Field("127.0.0.1", description="Address the gRPC servers listen on.")
    grpc_max_message_bytes: int = Field(
        1 << 20, ge=1024, le=64 << 20, description="Largest gRPC message accepted; larger ones are refused."
    )
    auth_token_file: Path | None = Field(
        None, description="File holding the bearer token that mutating gRPC calls must present."
    )
    capture_addr: str = Field("127.0.0.1:50061", description="Where the capture service's gRPC API listens.")
    decision_addr: str = Field("127.0.0.1:50062", description="Where the decision service's gRPC API listens.")
    executor_addr: str = Field("127.0.0.1:50063", description="Where the executor service's gRPC API listens.")
    validator_addr: str = Field("127.0.0.1:50064", description="Where the validator service's gRPC API listens.")
    metrics_bind: str = Field("127.0.0.1", description="Address the /metrics endpoint listens on.")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus /metrics port of this process (0: pick a free one)."
    )
    otlp_endpoint: str | None = Field(
        None,
        validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT",
        description="OTLP gRPC endpoint for traces (standard OpenTelemetry variable); unset: no export.",
    )
    log_level: str = Field("INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$", description="Log level.")

    def port_of(self, addr: str) -> int:
        return int(addr.rsplit(":", 1)[1])


S = TypeVar("S", bound=Settings)


def load_settings(cls: type[S] = Settings, **overrides: Any) -> S:  # type: ignore[assignment]
    """Read settings from the environment; raise SettingsError naming each bad variable."""
    try:
        return cls(**overrides)
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            field = ".".join(str(p) for p in problem["loc"])
            info = cls.model_fields.get(field)
            alias = info.validation_alias if info is not None else None
            name = alias if isinstance(alias, str) else f"{ENV_PREFIX}{field.upper()}"
            lines.append(f"{name}: {problem['msg']} (got {problem.get('input')!r})")
        raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None
