"""The decision service's Prometheus metrics (names are the contract in deploy/METRICS.md)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.decision.domain.types import Forecast, Target, TierLoad

TARGET_LABELS = ("host", "gpu", "mig_instance", "engine", "tenant")

DECISION_SECONDS = Histogram(
    "sits_decision_seconds",
    "Time the domain takes to decide on one sample or OOM event.",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
)
COMMANDS = Counter("sits_commands_total", "Healing commands issued, by action kind and policy rule.", ["kind", "rule"])
PREDICTED_FRACTION = Gauge(
    "sits_forecast_predicted_fraction",
    "Memory fraction the forecast expects at the policy horizon.",
    [*TARGET_LABELS, "horizon_seconds"],
)
TIME_TO_OOM = Gauge(
    "sits_forecast_time_to_oom_seconds",
    "Seconds until memory reaches the policy limit at the current trend (+Inf when it does not).",
    TARGET_LABELS,
)
TIER_QUEUE_WAIT = Gauge(
    "sits_tier_queue_wait_p90_seconds",
    "Queue wait (arrival to first scheduled step) p90 in the engine, per tier, from the SITS plugin.",
    ["engine", "priority"],
)
TIER_WAITING = Gauge("sits_tier_waiting", "Requests waiting in the engine, per tier.", ["engine", "priority"])
TIER_BUDGET = Gauge(
    "sits_tier_budget_max_requests",
    "The controller's limit on a tier's streams in the engine (+Inf: none).",
    ["engine", "priority"],
)
P0_OBJECTIVE = Gauge(
    "sits_p0_queue_wait_objective_seconds", "P0's objective in the policy: its queue wait p90 at most this."
)
DROPPED_SAMPLES = Counter(
    "sits_decision_dropped_samples_total", "Samples refused by the window, by reason.", ["reason"]
)


# Labelled children per target, looked up once: this runs for every sample the service handles.
_CHILDREN: dict[tuple[str, float], tuple[Any, Any]] = {}
MAX_TARGETS = 100_000


def export_forecast(target: Target, forecast: Forecast, horizon_s: float) -> None:
    children = _CHILDREN.get((target.key, horizon_s))
    if children is None:
        labels = {
            "host": target.host,
            "gpu": target.gpu_uuid,
            "mig_instance": target.mig_instance,
            "engine": target.engine,
            "tenant": target.engine,
        }
        if len(_CHILDREN) >= MAX_TARGETS:
            _CHILDREN.clear()
        children = _CHILDREN[(target.key, horizon_s)] = (
            PREDICTED_FRACTION.labels(**labels, horizon_seconds=f"{horizon_s:g}"),
            TIME_TO_OOM.labels(**labels),
        )
    predicted, time_to_oom = children
    predicted.set(forecast.predicted_fraction)
    tto = forecast.time_to_limit_s
    time_to_oom.set(float("inf") if tto is None else tto)


def export_tiers(engine: str, tiers: tuple[TierLoad, ...]) -> None:
    for tier in tiers:
        priority = f"p{tier.tier}"
        TIER_QUEUE_WAIT.labels(engine=engine, priority=priority).set(tier.queue_wait_p90_s)
        TIER_WAITING.labels(engine=engine, priority=priority).set(tier.waiting)


def export_budget(engine: str, limits: dict[int, int] | None) -> None:
    for tier in (1, 2):
        value = float("inf") if not limits else float(limits.get(tier, float("inf")))
        TIER_BUDGET.labels(engine=engine, priority=f"p{tier}").set(value)
