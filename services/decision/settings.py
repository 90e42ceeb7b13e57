"""Decision settings (environment variables `SITS_*`), on top of the shared runtime settings."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from sits.runtime.settings import CommandSigningSettings

DEFAULT_POLICY_FILE = Path(__file__).with_name("default_policy.yaml")


class DecisionSettings(CommandSigningSettings):
    decision_policy_file: Path = Field(DEFAULT_POLICY_FILE, description="Healing policy YAML loaded at start.")
    decision_engine_models: dict[str, str] = Field(
        default_factory=dict,
        description="Engine name -> known model name (sits estimate's table) or the path of the model's "
        "config.json, to turn tokens into KV and activation bytes.",
    )
    decision_group: str = Field(
        "sits-decision", description="Kafka consumer group of the decision service (after SITS_TOPIC_PREFIX)."
    )
    decision_replay_records: int = Field(
        2000,
        ge=0,
        le=1_000_000,
        description="Records of a metrics partition read again, before its committed offset, when a decision "
        "replica is assigned it: they rebuild the forecast windows of the targets it takes over (0: none).",
    )
