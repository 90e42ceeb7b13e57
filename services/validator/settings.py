"""Validator settings (environment variables `SITS_*`), on top of the shared runtime settings."""

from __future__ import annotations

from pydantic import Field

from services.validator.audit import DEFAULT_RETENTION_S
from sits.runtime.settings import CommandSigningSettings


class ValidatorSettings(CommandSigningSettings):
    validator_engines: dict[str, str] = Field(
        default_factory=dict,
        description=(
            'Engines whose health the validator checks, as JSON: {"vllm-0": "host:port"} (vLLM gRPC) or '
            '{"vllm-0": "http://host:port"} (vLLM\'s OpenAI server, GET /health).'
        ),
    )
    validator_envoy_admin_url: str = Field(
        "", description="Envoy admin URL: P0 requests refused by its P0 cluster's breaker; empty: not measured."
    )
    validator_p0_cluster: str = Field("vllm_p0", description="The Envoy cluster P0 requests are routed to.")
    validator_admission_metrics_url: str = Field(
        "",
        description="The admission processor's /metrics URL: P0 requests SITS admission refused; empty: not measured.",
    )
    validator_group: str = Field(
        "sits-validator",
        description="Kafka consumer group of the validator replicas (after SITS_TOPIC_PREFIX); each judges the "
        "actions on the targets of the partitions it owns.",
    )
    validator_audit_retention_s: float = Field(
        DEFAULT_RETENTION_S,
        gt=0,
        description="How long the audit trail in Redis keeps a verdict (and knows its action was judged); older "
        "ones are dropped from every index. Keep it at least the results topic's retention, so a result replayed "
        "from Kafka is never judged twice.",
    )
    validator_settle_s: dict[str, float] = Field(
        default_factory=dict,
        description='Settle window per action kind, overriding the defaults (JSON, e.g. {"SHED_PRIORITY": 3}).',
    )
