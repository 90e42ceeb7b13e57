"""Settings shared by every SITS process.

One name everywhere: every setting is read from an environment variable
`SITS_<FIELD>` (upper case), frozen once loaded, and validated so that a bad
value stops the process at start with a message naming the variable. Each
service extends `Settings` with its own fields, named after the service
(`SITS_<SERVICE>_...`); a setting renamed keeps its old names readable through
`renamed`. `sits settings --markdown` renders all of them into the README.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

from pydantic import AliasChoices, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SITS_"

KafkaSecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
KafkaSaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


def renamed(new: str, *old: str) -> AliasChoices:
    """`validation_alias` of a setting now named `new` (its SITS_<FIELD>) that existing deployments still
    set under its `old` names; `new` wins when both are set."""
    return AliasChoices(new, *old)


def variable_of(field: str, alias: object) -> str:
    """The environment variable a field is read from (its first name when renamed)."""
    if isinstance(alias, str):
        return alias
    if isinstance(alias, AliasChoices) and isinstance(alias.choices[0], str):
        return alias.choices[0]
    return f"{ENV_PREFIX}{field.upper()}"


def former_names(alias: object) -> list[str]:
    """The old names a renamed setting is still read under."""
    if isinstance(alias, AliasChoices):
        return [choice for choice in alias.choices[1:] if isinstance(choice, str)]
    return []


class SettingsError(Exception):
    """A setting is missing or out of range; the message names the variable."""


class Settings(BaseSettings):
    """Settings every service reads."""

    # populate_by_name: code and tests build settings by field name, renamed fields included.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore", populate_by_name=True)

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
    kafka_security_protocol: KafkaSecurityProtocol = Field(
        "PLAINTEXT",
        description="How every Kafka client connects: PLAINTEXT, SSL (TLS), SASL_SSL (SASL over TLS), SASL_PLAINTEXT.",
    )
    kafka_ssl_ca_file: Path | None = Field(
        None, description="CA bundle (PEM) the brokers' certificates chain to (SSL, SASL_SSL); unset: the system's."
    )
    kafka_ssl_cert_file: Path | None = Field(
        None, description="Client certificate (PEM) for brokers that require one (mutual TLS)."
    )
    kafka_ssl_key_file: Path | None = Field(None, description="Private key (PEM) of SITS_KAFKA_SSL_CERT_FILE.")
    kafka_ssl_check_hostname: bool = Field(
        True, description="Check that a broker's certificate names the host SITS connects to."
    )
    kafka_sasl_mechanism: KafkaSaslMechanism = Field(
        "SCRAM-SHA-512", description="SASL mechanism (SASL_SSL, SASL_PLAINTEXT): PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512."
    )
    kafka_sasl_username: str = Field("", description="SASL user name.")
    kafka_sasl_password_file: Path | None = Field(
        None, description="File holding the SASL password (read at start, never logged)."
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
    consumer_calm_fetch_max_wait_ms: int = Field(
        50,
        ge=1,
        le=5000,
        description="The same for the other topics of a service that reads an urgent lane (decision, validator): "
        "their records wait up to this long, and an idle replica makes fewer empty fetches.",
    )
    consumer_commit_interval_ms: int = Field(
        0,
        ge=0,
        le=60_000,
        description="Most time between offset commits of a consumer (0: after every batch). Handled offsets "
        "are always committed on revocation and on stop; a crash redelivers at most this much (handlers are "
        "idempotent).",
    )
    consumer_session_timeout_ms: int = Field(
        10_000,
        ge=1000,
        le=300_000,
        description="How long the group waits for a consumer that stopped heartbeating (a killed replica) "
        "before it gives that replica's partitions to the others.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis for leases, idempotency and state: redis://[user[:password]@]host:port/db, or rediss:// "
        "for TLS (CA: ?ssl_ca_certs=FILE; client certificate: &ssl_certfile=FILE&ssl_keyfile=FILE). "
        "Logged with the password masked.",
    )
    redis_password_file: Path | None = Field(
        None,
        description="File holding the Redis password (AUTH; the ACL user name goes in SITS_REDIS_URL), so the URL "
        "carries no secret.",
    )
    host_name: str = Field(default_factory=socket.gethostname, description="This host's name in event targets.")
    grpc_bind: str = Field("127.0.0.1", description="Address the gRPC servers listen on.")
    grpc_max_message_bytes: int = Field(
        1 << 20, ge=1024, le=64 << 20, description="Largest gRPC message accepted; larger ones are refused."
    )
    auth_token_file: Path | None = Field(
        None, description="File holding the bearer token that mutating gRPC calls must present."
    )
    grpc_tls: bool = Field(
        False,
        description="Serve and call the SITS gRPC APIs over TLS. Under Istio leave it off: the mesh's mTLS "
        "encrypts and authenticates every call instead.",
    )
    grpc_tls_cert_file: Path | None = Field(
        None,
        description="This process's certificate (PEM): served by its gRPC servers, and presented to SITS servers "
        "that require client certificates.",
    )
    grpc_tls_key_file: Path | None = Field(None, description="Private key (PEM) of SITS_GRPC_TLS_CERT_FILE.")
    grpc_tls_ca_file: Path | None = Field(
        None,
        description="CA (PEM) the SITS gRPC certificates chain to: clients check servers with it, servers check "
        "client certificates with it. Unset: the system's.",
    )
    grpc_tls_require_client_cert: bool = Field(
        False,
        description="gRPC servers refuse clients without a certificate from SITS_GRPC_TLS_CA_FILE (mutual TLS).",
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

    @model_validator(mode="after")
    def _security_is_consistent(self) -> Self:
        problems = []
        tls = self.kafka_security_protocol in ("SSL", "SASL_SSL")
        sasl = self.kafka_security_protocol.startswith("SASL_")
        tls_files = [self.kafka_ssl_ca_file, self.kafka_ssl_cert_file, self.kafka_ssl_key_file]
        if not tls and any(f is not None for f in tls_files):
            problems.append(
                f"SITS_KAFKA_SSL_* files are set but SITS_KAFKA_SECURITY_PROTOCOL is {self.kafka_security_protocol}: "
                "use SSL or SASL_SSL"
            )
        if (self.kafka_ssl_cert_file is None) != (self.kafka_ssl_key_file is None):
            problems.append("SITS_KAFKA_SSL_CERT_FILE and SITS_KAFKA_SSL_KEY_FILE go together")
        if sasl and (not self.kafka_sasl_username or self.kafka_sasl_password_file is None):
            problems.append(
                f"SITS_KAFKA_SECURITY_PROTOCOL {self.kafka_security_protocol} needs SITS_KAFKA_SASL_USERNAME and "
                "SITS_KAFKA_SASL_PASSWORD_FILE"
            )
        if (self.grpc_tls_cert_file is None) != (self.grpc_tls_key_file is None):
            problems.append("SITS_GRPC_TLS_CERT_FILE and SITS_GRPC_TLS_KEY_FILE go together")
        if self.grpc_tls_require_client_cert and (not self.grpc_tls or self.grpc_tls_ca_file is None):
            problems.append("SITS_GRPC_TLS_REQUIRE_CLIENT_CERT needs SITS_GRPC_TLS=true and SITS_GRPC_TLS_CA_FILE")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def port_of(self, addr: str) -> int:
        return int(addr.rsplit(":", 1)[1])


class CommandSigningSettings(Settings):
    """Settings of the services that publish HealingCommands (the decision, the validator's rollbacks)."""

    command_signing_key_file: Path | None = Field(
        None,
        description="Decision and validator: key file whose first key signs every HealingCommand they publish "
        "('<key id> <base64 secret>' per line; `sits keys new` makes one). Unset: commands go out unsigned "
        "and executors dead-letter them.",
    )


S = TypeVar("S", bound=Settings)


def _renamed_field(cls: type[Settings], variable: str) -> FieldInfo | None:
    """The field read under `variable`, one of the names of a renamed setting."""
    for info in cls.model_fields.values():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices) and variable.upper() in {str(c).upper() for c in alias.choices}:
            return info
    return None


def load_settings(cls: type[S] = Settings, **overrides: Any) -> S:  # type: ignore[assignment]
    """Read settings from the environment; raise SettingsError naming each bad variable."""
    try:
        return cls(**overrides)
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            field = ".".join(str(p) for p in problem["loc"])
            if not field:  # a check across settings: its message names the variables
                lines.append(str(problem["msg"]).removeprefix("Value error, "))
                continue
            info = cls.model_fields.get(field) or _renamed_field(cls, field)
            alias = info.validation_alias if info is not None else None
            name = variable_of(field, alias)
            if former_names(alias):
                name += f" (or {', '.join(former_names(alias))})"
            lines.append(f"{name}: {problem['msg']} (got {problem.get('input')!r})")
        raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None
