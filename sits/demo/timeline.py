"""What happened during a run, on one clock: samples, forecasts, actions, verdicts, requests.

Filled from the Kafka topics (through a TopicTap), the decision service's
Explain answers and the load driver's outcomes; read by the live view and the
report.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from google.protobuf.message import Message

from sits.demo.load import RequestOutcome
from sits.runtime.events import memory_fraction, seconds
from sits.v1 import common_pb2, events_pb2


@dataclass(frozen=True)
class SamplePoint:
    t: float
    target: str
    memory_fraction: float | None
    kv_usage: float | None
    running: int
    waiting: int


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


@dataclass(frozen=True)
class VerdictPoint:
    t: float
    target: str
    action_id: str
    verdict: str
    checks: str


@dataclass(frozen=True)
class RequestPoint:
    t: float
    priority: str
    ttft_s: float | None
    status: str
    tokens: int


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
            self.samples.append(
                SamplePoint(
                    self.rel(seconds(message.meta.produced_at)),
                    _target(message.meta.target),
                    memory_fraction(message),
                    engine.kv_cache_usage if engine is not None else None,
                    engine.num_requests_running if engine is not None else 0,
                    engine.num_requests_waiting if engine is not None else 0,
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
                    events_pb2.ActionKind.Name(message.kind).removeprefix("ACTION_KIND_"),
                    events_pb2.ActionStatus.Name(message.status).removeprefix("ACTION_STATUS_"),
                    message.detail,
                    self.commands.get(message.command_id, ""),
                )
            )
        elif isinstance(message, events_pb2.ValidationVerdict):
            self.verdicts.append(
                VerdictPoint(
                    self.rel(seconds(message.meta.produced_at)),
                    _target(message.meta.target),
                    message.action_id,
                    events_pb2.Verdict.Name(message.verdict).removeprefix("VERDICT_"),
                    "; ".join(f"{c.name}={'ok' if c.passed else 'FAILED'}" for c in message.checks),
                )
            )

    def on_forecast(self, target: str, time_to_oom_s: float | None, predicted: float, cause: str) -> None:
        self.forecasts.append(ForecastPoint(self.rel(time.time()), target, time_to_oom_s, predicted, cause))

    def on_request(self, outcome: RequestOutcome) -> None:
        self.requests.append(
            RequestPoint(
                outcome.started - self.started_mono, outcome.priority, outcome.ttft_s, outcome.status, outcome.tokens
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
