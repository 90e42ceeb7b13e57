"""What happened during a run, on one clock: samples, forecasts, actions, verdicts, requests.

Filled from the Kafka topics (through a TopicTap), the decision service's
Explain answers and the load driver's outcomes; read by the live view and the
report.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from google.protobuf.message import Message

from sits.runtime.contract import action_kind_name, memory_fraction
from sits.runtime.events import seconds
from sits.v1 import common_pb2, events_pb2
from sits_app.demo.load import RequestOutcome


@dataclass(frozen=True)
class SamplePoint:
    t: float
    target: str
    memory_fraction: float | None
    kv_usage: float | None
    running: int
    waiting: int
    # From the SITS plugin (None without it): P0's queue wait p90 in the engine, and the running cap.
    p0_queue_wait_s: float | None = None
    running_cap: int | None = None


@dataclass(frozen=True)
class ForecastPoint:
    t: float
    target: str
    time_to_oom_s: float | None
    predicted_fraction: float
    root_cause: str


@dataclass(frozen=True)
class ActionPoint:
    t: float
    target: str
    action_id: str
    kind: str
    status: str
    detail: str
    reason: str = ""
    # What the action left in force, field by field (tier budget per tier, engine limits).
    values: dict[str, float] = field(default_factory=dict)
    direction: str = ""


@dataclass(frozen=True)
class VerdictPoint:
    t: float
    target: str
    action_id: str
    verdict: str
    checks: str
    kind: str = ""


@dataclass(frozen=True)
class RequestPoint:
    t: float
    priority: str
    ttft_s: float | None
    status: str
    tokens: int
    # "with SITS" / "without SITS" when a run compares the two paths.
    path: str = ""


@dataclass
class Timeline:
    started: float = field(default_factory=time.time)
    # Monotonic start for client-side times (the load driver measures with time.monotonic).
    started_mono: float = field(default_factory=time.monotonic)
    samples: deque[SamplePoint] = field(default_factory=lambda: deque(maxlen=200_000))
    forecasts: deque[ForecastPoint] = field(default_factory=lambda: deque(maxlen=50_000))
    commands: dict[str, str] = field(default_factory=dict)
    actions: list[ActionPoint] = field(default_factory=list)
    verdicts: list[VerdictPoint] = field(default_factory=list)
    requests: deque[RequestPoint] = field(default_factory=lambda: deque(maxlen=200_000))
    # The full target of each name seen, for calls that need it (Explain).
    targets: dict[str, common_pb2.Target] = field(default_factory=dict)

    def restart_clock(self) -> None:
        """Count time from now (the start of load) and forget what was recorded before it."""
        self.started = time.time()
        self.started_mono = time.monotonic()
        for series in (self.samples, self.forecasts, self.actions, self.verdicts, self.requests):
            series.clear()

    def rel(self, wall: float) -> float:
        return wall - self.started

    def on_event(self, _topic: str, message: Message) -> None:
        if isinstance(message, events_pb2.MetricSample):
            self.targets.setdefault(_target(message.meta.target), message.meta.target)
            engine = message.engine if message.HasField("engine") else None
            p0 = next((t for t in engine.tiers if t.priority == common_pb2.PRIORITY_P0), None) if engine else None
            self.samples.append(
                SamplePoint(
                    self.rel(seconds(message.meta.produced_at)),
                    _target(message.meta.target),
                    memory_fraction(message),
                    engine.kv_cache_usage if engine is not None else None,
                    engine.num_requests_running if engine is not None else 0,
                    engine.num_requests_waiting if engine is not None else 0,
                    max(p0.queue_wait_p90_s, p0.oldest_wait_s) if p0 is not None else None,
                    engine.limits.max_num_running_reqs
                    if engine is not None and engine.limits.HasField("max_num_running_reqs")
                    else None,
                )
            )
        elif isinstance(message, events_pb2.HealingCommand):
            self.commands[message.command_id] = message.reason
        elif isinstance(message, events_pb2.ActionResult):
            self.actions.append(
                ActionPoint(
                    self.rel(seconds(message.meta.produced_at)),
                    _target(message.meta.target),
                    message.action_id,
                    action_kind_name(message.kind),
                    events_pb2.ActionStatus.Name(message.status).removeprefix("ACTION_STATUS_"),
                    message.detail,
                    self.commands.get(message.command_id, ""),
                    state_values(message.after),
                    events_pb2.ChangeDirection.Name(message.direction).removeprefix("CHANGE_DIRECTION_"),
                )
            )
        elif isinstance(message, events_pb2.ValidationVerdict):
            self.verdicts.append(
                VerdictPoint(
                    self.rel(seconds(message.meta.produced_at)),
                    _target(message.meta.target),
                    message.action_id,
                    events_pb2.Verdict.Name(message.verdict).removeprefix("VERDICT_"),
                    "; ".join(f"{c.name}={'ok' if c.passed else 'FAILED'}: {c.detail}" for c in message.checks),
                    action_kind_name(message.kind),
                )
            )

    def on_forecast(self, target: str, time_to_oom_s: float | None, predicted: float, cause: str) -> None:
        self.forecasts.append(ForecastPoint(self.rel(time.time()), target, time_to_oom_s, predicted, cause))

    def on_request(self, outcome: RequestOutcome, path: str = "") -> None:
        self.requests.append(
            RequestPoint(
                outcome.started - self.started_mono,
                outcome.priority,
                outcome.ttft_s,
                outcome.status,
                outcome.tokens,
                path,
            )
        )

    def save(self, path: Path) -> None:
        data = {
            "started": self.started,
            "samples": [asdict(s) for s in self.samples],
            "forecasts": [asdict(f) for f in self.forecasts],
            "actions": [asdict(a) for a in self.actions],
            "verdicts": [asdict(v) for v in self.verdicts],
            "requests": [asdict(r) for r in self.requests],
        }
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> Timeline:
        data = json.loads(path.read_text())
        timeline = cls(started=data["started"])
        timeline.samples.extend(SamplePoint(**s) for s in data["samples"])
        timeline.forecasts.extend(ForecastPoint(**f) for f in data["forecasts"])
        timeline.actions.extend(ActionPoint(**a) for a in data["actions"])
        timeline.verdicts.extend(VerdictPoint(**v) for v in data["verdicts"])
        timeline.requests.extend(RequestPoint(**r) for r in data["requests"])
        return timeline


def state_values(state: events_pb2.ActionState) -> dict[str, float]:
    """What an action left in force, one number per field (for oscillation counts and plots)."""
    values: dict[str, float] = {}
    limits = state.engine_limits
    for name in ("max_num_running_reqs", "max_num_scheduled_tokens", "max_prefill_chunk_tokens"):
        if limits.HasField(name):
            values[name] = float(getattr(limits, name))
    if limits.HasField("admission_paused"):
        values["admission_paused"] = float(limits.admission_paused)
    for breaker in state.breakers:
        values[f"breaker.{common_pb2.Priority.Name(breaker.priority).removeprefix('PRIORITY_')}"] = float(
            breaker.max_requests
        )
    for limit in state.budget:
        values[f"budget.{common_pb2.Priority.Name(limit.priority).removeprefix('PRIORITY_')}"] = float(
            limit.max_requests
        )
    if state.HasField("pressure"):
        values["pressure"] = state.pressure
    return values


def oscillations(actions: list[ActionPoint], window_s: float = 60.0, allowed: int = 2) -> dict[str, int]:
    """Fields moved back and forth more than `allowed` times within `window_s`: field -> most reversals seen.

    A reversal is a change whose direction is the opposite of the field's previous change (a cut after a
    raise, a raise after a cut), timed at that change. Fields an action stopped holding (a released
    budget) count as back at their unlimited value.
    """
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for action in sorted(actions, key=lambda a: a.t):
        if action.status not in ("APPLIED", "ROLLED_BACK", "EXPIRED"):
            continue
        for name, value in action.values.items():
            series.setdefault((action.target, name), []).append((action.t, value))
        if action.kind == "SET_TIER_BUDGET" and not any(k.startswith("budget.") for k in action.values):
            for (target, name), points in series.items():
                if target == action.target and name.startswith("budget."):
                    points.append((action.t, float("inf")))
    found: dict[str, int] = {}
    for (target, name), points in series.items():
        reversals: list[float] = []
        last_move = 0.0
        for (_, a), (t, b) in itertools.pairwise(points):
            move = (b > a) - (b < a)
            if move == 0:
                continue
            if last_move and move != last_move:
                reversals.append(t)
            last_move = move
        worst = max((sum(1 for r in reversals if t <= r < t + window_s) for t in reversals), default=0)
        if worst > allowed:
            found[f"{target}:{name}"] = worst
    return found


def _target(target: object) -> str:
    engine = getattr(target, "engine", "")
    gpu = getattr(target, "gpu_uuid", "")
    return engine or gpu or "?"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]
