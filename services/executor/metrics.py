"""The executor's Prometheus metrics (names are the contract in deploy/METRICS.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from services.executor import domain
from sits.runtime.contract import ALL_TIERS, action_kind_name
from sits.v1 import events_pb2

ACTIONS = Counter("sits_actions_total", "Action results published, by action kind and status.", ["kind", "status"])
BREAKER_STATE = Gauge(
    "sits_breaker_state",
    "1 for the current state of each priority's breaker on each engine, 0 for the other states.",
    ["engine", "priority", "state"],
)


def count_result(result: events_pb2.ActionResult) -> None:
    ACTIONS.labels(
        kind=action_kind_name(result.kind).lower(),
        status=events_pb2.ActionStatus.Name(result.status).removeprefix("ACTION_STATUS_").lower(),
    ).inc()


def export_breakers(engine: str, board: domain.BreakerBoard, now: float, policy: domain.BreakerPolicy) -> None:
    effective = board.effective(now, policy)
    for tier in ALL_TIERS:
        current = effective.get(tier, policy).state
        for state in domain.BreakerState:
            BREAKER_STATE.labels(engine=engine, priority=tier.name, state=state.name.lower()).set(
                1.0 if state is current else 0.0
            )
