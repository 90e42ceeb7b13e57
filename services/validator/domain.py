"""Validation as pure logic: did an action keep its promise, and what follows if not?

Each applied action carries its promise (sits.v1.Promise, stated by the
decision or defaulted per kind) and the direction it moved things. After its
settle window (the expected drain, stated in the promise) each stated part is
checked on what was observed of the target:
- `no_oom`: no OOM event on the target inside the window;
- `p0_objective`: P0's queue wait p90 in the engine at the end of the window
  (the plugin's figure over its last few seconds) within the objective, and no
  P0 request waiting longer than it;
- `no_p0_refused`: no P0 request refused while the window lasted (a probe
  reads Envoy's and SITS admission's counters at the start and at the end);
- `engine_alive`: the engine answers its health check (probe), or, with no
  probe, kept reporting through the window;
- `gpu_memory_below`: GPU memory (NVML samples only: a KV cache vLLM keeps full
  by design says nothing) at most the promised fraction at the end;
- `engine_memory_below`: the engine's own GPU memory (NVML, its processes) at
  most the promised bytes at the end (a step-budget cut's promise: a co-tenant
  filling the device is not the cut's to prevent);
- `no_preemption_storm`: the engine's preemptions per second at most the bound;
- `running_at_most`: the engine's running requests within a new cap;
- `effect`: for actions that cannot be undone, the effect the executor reported.

Outcome: every measured part kept confirms. A broken promise rolls the action
back only when the action loosened (admitted more); a tightening, or an action
that cannot be undone, is NOT_KEPT: rolling it back would loosen a limit the
engine may need (never after an OOM), so nothing is undone and the decision
escalates. Nothing measured is inconclusive. No I/O here; time comes from the caller.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from sits.runtime.contract import ActionKind
from sits.runtime.promise import Promise

DEFAULT_SETTLE_S: dict[ActionKind, float] = {
    ActionKind.SET_ENGINE_LIMITS: 5.0,
    ActionKind.SHED_PRIORITY: 5.0,
    ActionKind.SET_TIER_BUDGET: 5.0,
    ActionKind.SET_PRESSURE: 3.0,
    ActionKind.FLUSH_CACHE: 2.0,
    ActionKind.ABORT_LOW_PRIORITY: 3.0,
    ActionKind.PAUSE_ADMISSION: 3.0,
    ActionKind.RESUME_ADMISSION: 3.0,
    ActionKind.MIG_REBALANCE: 30.0,
}
FALLBACK_SETTLE_S = 5.0
GIB = float(1 << 30)
# Actions that are not themselves validated: a rollback restores a state already judged.
NOT_VALIDATED = frozenset({ActionKind.ROLLBACK})
# Kinds whose effect cannot be put back: their verdict is "effect observed", never a rollback.
NOT_UNDOABLE = frozenset({ActionKind.FLUSH_CACHE, ActionKind.ABORT_LOW_PRIORITY})


class Outcome(enum.Enum):
    CONFIRMED = "CONFIRMED"
    ROLLED_BACK = "ROLLED_BACK"
    INCONCLUSIVE = "INCONCLUSIVE"
    NOT_KEPT = "NOT_KEPT"


class Direction(enum.Enum):
    NONE = "NONE"
    TIGHTEN = "TIGHTEN"
    LOOSEN = "LOOSEN"
    MIXED = "MIXED"


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
    # An ActionKind's name (the pending action is kept in Redis as JSON).
    kind: str
    applied_at: float
    settle_until: float
    promise: Promise = field(default_factory=Promise)
    direction: str = Direction.NONE.value
    # What the executor reported doing (an effect, for actions that cannot be undone).
    detail: str = ""
    # P0 refusals counted by the probe when the watch started (None: not measured).
    p0_refused_at_start: float | None = None
    # W3C traceparent of the result that started the watch, so the verdict joins its trace.
    traceparent: str = ""


@dataclass(frozen=True)
class EngineObservation:
    at: float
    p0_queue_wait_p90_s: float | None
    p0_oldest_wait_s: float
    preemptions: int
    running: int


@dataclass
class TargetWatch:
    """What the validator has seen of one target recently (bounded)."""

    gpu_memory: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=512))
    engine_memory: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=512))
    engine: deque[EngineObservation] = field(default_factory=lambda: deque(maxlen=512))
    oom_times: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    last_seen: float = float("-inf")


@dataclass(frozen=True)
class Probed:
    """What the probes measured at judgement time (None: not measured)."""

    engine_healthy: bool | None = None
    p0_refused: float | None = None


def settle_seconds(kind: str, promise: Promise | None = None, overrides: dict[str, float] | None = None) -> float:
    if promise is not None and promise.settle_s > 0:
        return promise.settle_s
    if overrides and kind in overrides:
        return overrides[kind]
    try:
        return DEFAULT_SETTLE_S.get(ActionKind.parse(kind), FALLBACK_SETTLE_S)
    except ValueError:
        return FALLBACK_SETTLE_S


class Validator:
    """Tracks targets and pending actions; `due(now)` yields those whose window has ended."""

    def __init__(self, max_targets: int = 10_000) -> None:
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
                oldest = min(self._targets, key=lambda k: self._targets[k].last_seen)
                del self._targets[oldest]
            watch = self._targets[target_key] = TargetWatch()
        return watch

    def observe_gpu_memory(self, target_key: str, at: float, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.5:
            return
        watch = self.watch(target_key)
        watch.gpu_memory.append((at, fraction))
        watch.last_seen = max(watch.last_seen, at)

    def observe_engine_memory(self, target_key: str, at: float, used_bytes: int) -> None:
        if used_bytes <= 0:
            return
        watch = self.watch(target_key)
        watch.engine_memory.append((at, used_bytes))
        watch.last_seen = max(watch.last_seen, at)

    def observe_engine(self, target_key: str, observation: EngineObservation) -> None:
        watch = self.watch(target_key)
        watch.engine.append(observation)
        watch.last_seen = max(watch.last_seen, observation.at)

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

    def judge(self, pending: PendingAction, probed: Probed | None = None) -> Judgement:
        probed = probed or Probed()
        promise = pending.promise
        watch = self.watch(pending.target_key)
        start, end = pending.applied_at, pending.settle_until
        tail_start = end - (end - start) / 2.0
        checks: list[CheckResult] = []
        if promise.no_oom:
            ooms = [t for t in watch.oom_times if start <= t <= end]
            checks.append(
                CheckResult("no_oom", not ooms, float(len(ooms)), 0.0, f"{len(ooms)} OOM event(s) on the target")
            )
        engine = [o for o in watch.engine if start <= o.at <= end]
        tail = [o for o in engine if o.at >= tail_start] or engine[-1:]
        if promise.p0_queue_wait_p90_s is not None and tail:
            checks.append(_p0_objective(tail, promise.p0_queue_wait_p90_s))
        if promise.no_p0_refused and probed.p0_refused is not None and pending.p0_refused_at_start is not None:
            refused = max(0.0, probed.p0_refused - pending.p0_refused_at_start)
            checks.append(
                CheckResult("no_p0_refused", refused == 0, refused, 0.0, f"{refused:.0f} P0 request(s) refused")
            )
        if promise.engine_alive:
            if probed.engine_healthy is not None:
                alive = probed.engine_healthy
                how = "answered its health check" if alive else "failed its health check"
            elif engine:
                alive = any(o.at >= tail_start for o in engine)
                how = "kept reporting" if alive else "stopped reporting in the second half of the window"
            else:
                alive, how = None, ""
            if alive is not None:
                checks.append(CheckResult("engine_alive", alive, 1.0 if alive else 0.0, 1.0, f"the engine {how}"))
        if promise.gpu_memory_fraction_below is not None:
            memory = [f for at, f in watch.gpu_memory if tail_start <= at <= end]
            if memory:
                worst = max(memory)
                limit = promise.gpu_memory_fraction_below
                checks.append(
                    CheckResult(
                        "gpu_memory_below",
                        worst <= limit,
                        worst,
                        limit,
                        f"GPU memory at most {worst:.1%} over the last {len(memory)} samples; promised {limit:.1%}",
                    )
                )
        if promise.engine_memory_bytes_below is not None:
            held = [b for at, b in watch.engine_memory if tail_start <= at <= end]
            if held:
                worst_bytes, limit_bytes = max(held), promise.engine_memory_bytes_below
                checks.append(
                    CheckResult(
                        "engine_memory_below",
                        worst_bytes <= limit_bytes,
                        float(worst_bytes),
                        float(limit_bytes),
                        f"the engine held at most {worst_bytes / GIB:.2f} GiB over the last {len(held)} samples; "
                        f"promised {limit_bytes / GIB:.2f} GiB",
                    )
                )
        if promise.preemptions_per_s_below is not None and len(tail) >= 2:
            rate = max(0, tail[-1].preemptions - tail[0].preemptions) / max(1e-3, tail[-1].at - tail[0].at)
            limit = promise.preemptions_per_s_below
            checks.append(
                CheckResult(
                    "no_preemption_storm", rate <= limit, rate, limit, f"{rate:.1f} preemptions/s; at most {limit:g}"
                )
            )
        if promise.running_at_most is not None and tail:
            running = tail[-1].running
            cap = promise.running_at_most
            checks.append(
                CheckResult("running_at_most", running <= cap, float(running), float(cap), f"{running} running")
            )
        if promise.effect:
            checks.append(CheckResult("effect", True, 1.0, 1.0, f"{promise.effect}: {pending.detail}"))
        if not checks or (len(checks) == 1 and checks[0].name in ("no_oom", "effect") and not engine):
            return Judgement(Outcome.INCONCLUSIVE, tuple(checks))
        if all(c.passed for c in checks):
            return Judgement(Outcome.CONFIRMED, tuple(checks))
        undoable = pending.kind not in {k.name for k in NOT_UNDOABLE}
        if undoable and pending.direction == Direction.LOOSEN.value:
            return Judgement(Outcome.ROLLED_BACK, tuple(checks))
        return Judgement(Outcome.NOT_KEPT, tuple(checks))


def _p0_objective(tail: list[EngineObservation], objective: float) -> CheckResult:
    last = tail[-1]
    p90 = last.p0_queue_wait_p90_s or 0.0
    oldest = max(o.p0_oldest_wait_s for o in tail)
    worst = max(p90, oldest)
    return CheckResult(
        "p0_objective",
        worst <= objective,
        worst,
        objective,
        f"P0 queue wait p90 {p90 * 1000:.0f} ms, longest P0 wait {oldest * 1000:.0f} ms; "
        f"objective {objective * 1000:.0f} ms",
    )
