"""Validation as pure logic: did an action keep its promise?

After an action is applied the target is watched for a settle window (per
action kind). Then each promise is checked: memory under the watermark the
decision aimed for, no OOM on the target, P0 latency within its objective and
the engine healthy, each where it was measured. All measured checks passing
confirms the action; any failing rolls it back; nothing measured is
inconclusive. No I/O here; time comes from the caller.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

DEFAULT_SETTLE_S: dict[str, float] = {
    "SET_ENGINE_LIMITS": 5.0,
    "SHED_PRIORITY": 5.0,
    "SET_PRESSURE": 3.0,
    "FLUSH_CACHE": 2.0,
    "ABORT_LOW_PRIORITY": 3.0,
    "PAUSE_ADMISSION": 3.0,
    "RESUME_ADMISSION": 3.0,
    "MIG_REBALANCE": 30.0,
}
# Actions that are not themselves validated: a rollback restores a state already judged.
NOT_VALIDATED = frozenset({"ROLLBACK"})


class Outcome(enum.Enum):
    CONFIRMED = "CONFIRMED"
    ROLLED_BACK = "ROLLED_BACK"
    INCONCLUSIVE = "INCONCLUSIVE"


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    observed: float
    threshold: float
    detail: str


@dataclass(frozen=True)
class Judgement:
    outcome: Outcome
    checks: tuple[CheckResult, ...]


@dataclass(frozen=True)
class PendingAction:
    """An applied action waiting for its settle window to end."""

    action_id: str
    command_id: str
    target_key: str
    kind: str
    applied_at: float
    settle_until: float
    watermark: float
    # W3C traceparent of the result that started the watch, so the verdict joins its trace.
    traceparent: str = ""


@dataclass
class Observation:
    at: float
    memory_fraction: float


@dataclass
class TargetWatch:
    """What the validator has seen of one target recently (bounded)."""

    samples: deque[Observation] = field(default_factory=lambda: deque(maxlen=512))
    oom_times: deque[float] = field(default_factory=lambda: deque(maxlen=64))


@dataclass(frozen=True)
class Objectives:
    p0_latency_objective_s: float = 2.0
    # Fraction of the settle window, at its end, whose samples must sit under the watermark.
    tail_fraction: float = 0.5


def settle_seconds(kind: str, overrides: dict[str, float] | None = None) -> float:
    table = {**DEFAULT_SETTLE_S, **(overrides or {})}
    return table.get(kind, 5.0)


class Validator:
    """Tracks targets and pending actions; `due(now)` yields judgements whose window has ended."""

    def __init__(self, objectives: Objectives | None = None, max_targets: int = 10_000) -> None:
        self.objectives = objectives or Objectives()
        self._targets: dict[str, TargetWatch] = {}
        self._pending: dict[str, PendingAction] = {}
        self._max_targets = max_targets

    @property
    def pending(self) -> dict[str, PendingAction]:
        return self._pending

    def watch(self, target_key: str) -> TargetWatch:
        watch = self._targets.get(target_key)
        if watch is None:
            if len(self._targets) >= self._max_targets:
                # Forget the target seen least recently: bounded memory under any number of targets.
                oldest = min(self._targets, key=lambda k: self._last_seen(self._targets[k]))
                del self._targets[oldest]
            watch = self._targets[target_key] = TargetWatch()
        return watch

    @staticmethod
    def _last_seen(watch: TargetWatch) -> float:
        return watch.samples[-1].at if watch.samples else float("-inf")

    def observe_memory(self, target_key: str, at: float, memory_fraction: float) -> None:
        if not 0.0 <= memory_fraction <= 1.5:
            return
        self.watch(target_key).samples.append(Observation(at, memory_fraction))

    def observe_oom(self, target_key: str, at: float) -> None:
        self.watch(target_key).oom_times.append(at)

    def expect(self, pending: PendingAction) -> bool:
        """Start watching an applied action; False if it is already watched (redelivery)."""
        if pending.action_id in self._pending:
            return False
        self._pending[pending.action_id] = pending
        return True

    def due(self, now: float) -> list[PendingAction]:
        return sorted((p for p in self._pending.values() if p.settle_until <= now), key=lambda p: p.settle_until)

    def forget(self, action_id: str) -> None:
        self._pending.pop(action_id, None)

    def judge(
        self,
        pending: PendingAction,
        *,
        p0_latency_s: float | None = None,
        engine_healthy: bool | None = None,
    ) -> Judgement:
        watch = self.watch(pending.target_key)
        checks: list[CheckResult] = []
        window = [o for o in watch.samples if pending.applied_at <= o.at <= pending.settle_until]
        tail_start = pending.settle_until - (pending.settle_until - pending.applied_at) * self.objectives.tail_fraction
        tail = [o for o in window if o.at >= tail_start] or window[-1:]
        if tail:
            worst = max(o.memory_fraction for o in tail)
            checks.append(
                CheckResult(
                    "memory_below_watermark",
                    worst <= pending.watermark,
                    worst,
                    pending.watermark,
                    f"highest memory {worst:.1%} over the last {len(tail)} samples; watermark {pending.watermark:.1%}",
                )
            )
        ooms = [t for t in watch.oom_times if pending.applied_at <= t <= pending.settle_until]
        checks.append(
            CheckResult(
                "no_oom",
                not ooms,
                float(len(ooms)),
                0.0,
                f"{len(ooms)} OOM event(s) on the target during the settle window",
            )
        )
        if p0_latency_s is not None:
            objective = self.objectives.p0_latency_objective_s
            checks.append(
                CheckResult(
                    "p0_latency",
                    p0_latency_s <= objective,
                    p0_latency_s,
                    objective,
                    f"P0 p99 time to first token {p0_latency_s * 1000:.0f} ms; objective {objective * 1000:.0f} ms",
                )
            )
        if engine_healthy is not None:
            checks.append(
                CheckResult(
                    "engine_healthy",
                    engine_healthy,
                    1.0 if engine_healthy else 0.0,
                    1.0,
                    "engine answered its health check" if engine_healthy else "engine failed its health check",
                )
            )
        if any(not c.passed for c in checks):
            outcome = Outcome.ROLLED_BACK
        elif not window and p0_latency_s is None and engine_healthy is None:
            # Only "no OOM" was checked, on a target we never saw: not enough to confirm.
            outcome = Outcome.INCONCLUSIVE
        else:
            outcome = Outcome.CONFIRMED
        return Judgement(outcome, tuple(checks))
