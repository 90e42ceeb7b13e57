"""The tier controller: one budget for lower-tier work per engine, moved on a fixed tick by feedback.

Pure: no I/O; time comes in as numbers (the tick's clock), so tests step it.

What it controls. Inside the engine the SITS scheduler already runs P0 first
(vLLM's priority policy, and a preemption when a P0 cannot start), so what is
left to steer is how much lower-tier work the engine is given: the budget `B`
of P1 and P2 streams Envoy lets in at once. P1 keeps up to `p1_share` of the
ceiling before P2 gets any, so a cut comes out of P2 first, then P1; P2's
part is counted from what P1 uses plus one stream, so an idle P1 does not
keep P2 out of an engine with room (`split_budget`). The
ceiling is the engine's running cap plus a small lookahead: more than that
would only wait inside the engine, where a stream costs memory and tells its
client nothing; refused at Envoy it can retry elsewhere at once.

The signals do not depend on machine speed: P0's queue wait p90 and oldest
waiting age (arrival to first scheduled step, from the plugin), requests
waiting beyond the lookahead, and free running slots.

How it moves (AIMD with a dead band, paced by validation):
- idle: no limits at all (the policy's defaults in Envoy) until the engine is
  saturated, a queue beyond the lookahead or P0's objective missed, for
  `engage_ticks` ticks; then B starts at what the lower tiers have running
  (halved if P0 is already missing its objective);
- multiplicative decrease when P0's objective is missed, at most once per
  expected drain (the time the excess takes to finish), since a cut shows
  only once the streams above it have drained;
- a trim to what runs plus the lookahead when the lower tiers queue in the
  engine beyond it;
- additive increase only with room to spare: P0 well inside its objective
  (under half of it), nothing of the lower tiers waiting, a free running slot,
  a tier at its limit (or held at zero) and the budget no higher than the
  trim's level, and only once the last change was confirmed by the
  validator (or its settle window passed with no verdict). A decrease, a trim
  or a rollback of an increase holds increases off for a backoff that doubles each
  time until a quiet spell; every change moves each tier's limit the budget's
  way only;
- release: a budget at its ceiling and not used for `release_after_s` hands
  Envoy back its defaults.
Between these, it holds, and renews the lease every third of it: a decision
service that stops renews nothing and the executor restores the defaults when
the lease runs out. After an OOM on the engine nothing is loosened for
`no_loosen_after_oom_s`.

This is the reasoning of Envoy's adaptive concurrency (a concurrency limit
found by feedback) and of the Gateway API Inference Extension's saturation
detector (queue depth and KV as the saturation signal), with the priority
inside the engine doing what flow control outside it cannot: docs/control.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.decision.domain.policy import ControllerSettings
from services.decision.domain.types import TierLoad

P0, P1, P2 = 0, 1, 2
LOWER_TIERS = (P1, P2)


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """One reading of an engine's tiers (from the plugin, through capture)."""

    t: float
    tiers: Mapping[int, TierLoad]
    running_cap: int
    # The engine's slot count (max_num_seqs): the P1/P2 split is sized on it, so a cap that moves does
    # not reshuffle the split. 0: the running cap.
    max_num_seqs: int = 0

    def tier(self, tier: int) -> TierLoad:
        return self.tiers.get(tier) or TierLoad(tier)

    @property
    def lower_running(self) -> int:
        return sum(self.tier(t).running for t in LOWER_TIERS)

    @property
    def lower_waiting(self) -> int:
        return sum(self.tier(t).waiting for t in LOWER_TIERS)

    @property
    def running(self) -> int:
        return sum(self.tier(t).running for t in (P0, *LOWER_TIERS))

    @property
    def waiting(self) -> int:
        return sum(self.tier(t).waiting for t in (P0, *LOWER_TIERS))


class Move(enum.Enum):
    ENGAGE = "engage"
    DECREASE = "decrease"
    TRIM = "trim"
    INCREASE = "increase"
    RELEASE = "release"
    RENEW = "renew"

    @property
    def loosens(self) -> bool:
        return self in (Move.INCREASE, Move.RELEASE)


@dataclass(frozen=True, slots=True)
class BudgetCommand:
    """What one tick wants sent: a change (validated) or a renewal of the state in place."""

    move: Move
    # None: released, Envoy's defaults (no limit from the controller).
    budget: int | None
    limits: Mapping[int, int]
    reason: str
    settle_s: float
    drain_backlog: bool = False


@dataclass(slots=True)
class BudgetState:
    """The controller's memory of one engine."""

    budget: int | None = None
    # The P1/P2 limits last sent (empty: none, or not known since a rollback or an expired lease).
    limits: dict[int, int] = field(default_factory=dict)
    saturated_ticks: int = 0
    # Consecutive ticks P0 missed its objective: one tick's spike is noise, not a reason to cut.
    missed_ticks: int = 0
    last_change_t: float = -math.inf
    last_settle_s: float = 0.0
    last_move: Move | None = None
    awaiting_verdict: str = ""
    awaiting_until: float = -math.inf
    hold_increase_until: float = -math.inf
    backoff_s: float = 0.0
    last_backoff_t: float = -math.inf
    last_sent_t: float = -math.inf
    unused_since: float | None = None
    last_oom_t: float = -math.inf
    # (time, lower-tier requests first scheduled so far): their service rate sizes the drain.
    rate_mark: tuple[float, int] | None = None
    service_rate: float = 0.0
    history: list[tuple[float, Move, int | None]] = field(default_factory=list)


def split_budget(budget: int, ceiling: int, p1_share: float, *, p1_in_engine: int) -> dict[int, int]:
    """Envoy limits for P1 and P2 out of `budget`: P1 first, up to its share; P2 gets the rest.

    The rest is counted from what P1 has in the engine (`p1_in_engine`, running or waiting) plus
    one stream, not from P1's whole limit: a share held for an absent or light P1 would leave P2
    refused while the engine has room, and refused at Envoy P2's demand is out of the controller's
    sight, so nothing would give it back. P1 keeps its limit: if it grows into it, the queue or P0's
    objective shows it and the next cut, counted afresh, comes out of P2.
    """
    p1_cap = max(1, math.ceil(ceiling * p1_share))
    p1 = min(budget, p1_cap)
    reserved = min(p1, p1_in_engine + 1)
    return {P1: p1, P2: budget - reserved}


class TierController:
    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings

    def ceiling(self, signals: EngineSignals) -> int:
        return max(self.settings.budget_min, signals.running_cap + self.settings.lookahead)

    def split(self, budget: int, signals: EngineSignals) -> dict[int, int]:
        slots = max(signals.max_num_seqs, signals.running_cap)
        p1 = signals.tier(P1)
        return split_budget(
            budget, slots + self.settings.lookahead, self.settings.p1_share, p1_in_engine=p1.running + p1.waiting
        )

    def limits_in_force(self, state: BudgetState, budget: int, signals: EngineSignals) -> dict[int, int]:
        """The limits last sent; after a rollback or an expired lease, the split of `budget`."""
        return state.limits or self.split(budget, signals)

    def in_use(self, limits: Mapping[int, int], signals: EngineSignals) -> bool:
        """Lower-tier demand presses on the budget: a tier fills its limit, or a tier is held at zero.

        Per tier, not in sum: a P1 that leaves its spare stream unused must not hide a P2 at its limit.
        A tier at zero counts as pressing, since Envoy refuses its demand out of the engine's sight.
        """
        for tier in LOWER_TIERS:
            limit = limits.get(tier, 0)
            load = signals.tier(tier)
            if limit <= 0 or load.running + load.waiting >= limit:
                return True
        return False

    def p0_missed(self, signals: EngineSignals) -> bool:
        objective = self.settings.p0_queue_wait_p90_s
        p0 = signals.tier(P0)
        return (p0.queue_wait_samples > 0 and p0.queue_wait_p90_s > objective) or p0.oldest_wait_s > objective

    def p0_comfortable(self, signals: EngineSignals) -> bool:
        half = self.settings.p0_queue_wait_p90_s / 2.0
        p0 = signals.tier(P0)
        return p0.queue_wait_p90_s <= half and p0.oldest_wait_s <= half

    # ------------------------------------------------------------ feedback

    def on_verdict(self, state: BudgetState, command_id: str, outcome: str, now: float) -> None:
        """A verdict on one of this controller's changes: CONFIRMED, ROLLED_BACK, NOT_KEPT, INCONCLUSIVE."""
        if command_id != state.awaiting_verdict:
            return
        state.awaiting_verdict = ""
        if outcome == "ROLLED_BACK":
            # The executor put the previous budget back; do not try that increase again soon.
            self._hold_increases(state, now)
        elif outcome == "NOT_KEPT":
            # A cut that did not bring P0 back: the next cut need not wait for another drain.
            state.last_settle_s = 0.0

    def on_rollback(self, state: BudgetState, budget: int | None) -> None:
        """The executor restored `budget` (None: the defaults)."""
        state.budget = budget
        state.limits = {}

    def on_expired(self, state: BudgetState) -> None:
        """The lease ran out and the executor restored the defaults."""
        state.budget = None
        state.limits = {}
        state.saturated_ticks = 0

    def on_oom(self, state: BudgetState, t: float) -> None:
        state.last_oom_t = t

    # ------------------------------------------------------------ the tick

    def tick(self, state: BudgetState, signals: EngineSignals | None, now: float) -> BudgetCommand | None:
        s = self.settings
        if not s.enabled:
            return None
        if signals is None or now - signals.t > s.max_signal_age_s:
            # No fresh reading: change nothing, and keep a budget in place only while its lease
            # runs; a lease left to run out hands Envoy back its defaults.
            return None
        self._track_rate(state, signals)
        command = self._decide(state, signals, now)
        if command is not None:
            self._record(state, command, now)
            return command
        if state.budget is not None and now - state.last_sent_t >= s.lease_s / 3.0:
            state.last_sent_t = now
            # The limits in force, not a fresh split: a renewal changes nothing, so it needs no verdict.
            limits = self.limits_in_force(state, state.budget, signals)
            return BudgetCommand(Move.RENEW, state.budget, limits, "budget renewed", 0.0)
        return None

    def _decide(self, state: BudgetState, signals: EngineSignals, now: float) -> BudgetCommand | None:
        s = self.settings
        ceiling = self.ceiling(signals)
        missed_now = self.p0_missed(signals)
        state.missed_ticks = state.missed_ticks + 1 if missed_now else 0
        missed = state.missed_ticks >= s.engage_ticks
        queued = signals.waiting > s.lookahead
        state.saturated_ticks = state.saturated_ticks + 1 if (missed_now or queued) else 0
        if state.budget is None:
            if state.saturated_ticks < s.engage_ticks:
                return None
            budget = max(s.budget_min, min(ceiling, signals.lower_running))
            if missed:
                budget = max(s.budget_min, math.floor(budget * s.decrease_factor))
            why = self._why(signals, missed)
            return self._change(state, Move.ENGAGE, budget, ceiling, signals, f"engine saturated ({why})")
        budget = state.budget
        drained = now - state.last_change_t >= state.last_settle_s
        if missed_now:
            if not missed or budget <= s.budget_min or not drained:
                return None
            new = max(s.budget_min, math.floor(budget * s.decrease_factor))
            return self._change(
                state, Move.DECREASE, new, ceiling, signals, f"P0 misses its objective ({self._why(signals, True)})"
            )
        trimmed = max(s.budget_min, signals.lower_running + s.lookahead)
        if signals.lower_waiting > s.lookahead and trimmed < budget and state.saturated_ticks >= s.engage_ticks:
            if drained:
                return self._change(
                    state,
                    Move.TRIM,
                    trimmed,
                    ceiling,
                    signals,
                    f"{signals.lower_waiting} lower-tier requests wait in the engine beyond its lookahead",
                )
            return None
        if now < state.last_oom_t + s.no_loosen_after_oom_s:
            return None
        limits = self.limits_in_force(state, budget, signals)
        in_use = self.in_use(limits, signals)
        if budget >= ceiling:
            state.unused_since = None if in_use else (state.unused_since if state.unused_since is not None else now)
            unused_long = state.unused_since is not None and now - state.unused_since >= s.release_after_s
            if unused_long and self._settled(state, now):
                return self._change(state, Move.RELEASE, None, ceiling, signals, "budget unused at its ceiling")
            return None
        state.unused_since = None
        room = signals.running < signals.running_cap and signals.lower_waiting == 0
        # Never above the trim's level (what runs plus the lookahead): past it the next queue would
        # trim it back, and the two would take turns. A P2 held at zero runs nothing to count.
        if (
            room
            and in_use
            and (budget + s.increase_step <= trimmed or limits[P2] <= 0)
            and self.p0_comfortable(signals)
            and now >= state.hold_increase_until
            and self._settled(state, now)
        ):
            new = min(ceiling, budget + s.increase_step)
            return self._change(
                state, Move.INCREASE, new, ceiling, signals, "room in the engine and P0 well inside its objective"
            )
        return None

    def _settled(self, state: BudgetState, now: float) -> bool:
        """The last change was judged, or its settle window (plus a tick) passed without a verdict."""
        return not state.awaiting_verdict or now >= state.awaiting_until

    def _change(
        self,
        state: BudgetState,
        move: Move,
        budget: int | None,
        ceiling: int,
        signals: EngineSignals,
        reason: str,
    ) -> BudgetCommand:
        s = self.settings
        limits = self.split(budget, signals) if budget is not None else {}
        # The window a change needs to show: the streams above a cut must finish first; an increase
        # shows once the newly admitted streams run.
        if budget is None or (state.budget is not None and budget > state.budget):
            excess = s.increase_step
        else:
            excess = max(1, signals.lower_running + signals.lower_waiting - budget)
        if budget is not None and state.budget is not None and state.limits:
            # One direction for every tier: the split follows what P1 has in the engine, so counted
            # afresh an increase could lower P2's limit (and a cut raise it), and each tier's limit
            # would saw back and forth while the budget moves one way.
            pick = max if budget > state.budget else min
            limits = {t: pick(v, state.limits.get(t, v)) for t, v in limits.items()}
        drain = move in (Move.ENGAGE, Move.DECREASE, Move.TRIM) and s.drain_backlog
        return BudgetCommand(move, budget, limits, reason, self._settle_for(state, excess), drain_backlog=drain)

    def _record(self, state: BudgetState, command: BudgetCommand, now: float) -> None:
        state.budget = command.budget
        state.limits = dict(command.limits)
        state.last_change_t = now
        state.last_settle_s = command.settle_s
        state.last_move = command.move
        state.last_sent_t = now
        if command.move is Move.RELEASE:
            state.saturated_ticks = 0
        state.unused_since = None
        state.awaiting_until = now + command.settle_s + self.settings.tick_s
        if command.move in (Move.DECREASE, Move.TRIM):
            self._hold_increases(state, now)
        state.history.append((now, command.move, command.budget))
        del state.history[:-64]

    def _hold_increases(self, state: BudgetState, now: float) -> None:
        """The increases before overshot (P0 missed its objective, the lower tiers queued beyond the
        lookahead, or an increase was rolled back): no increase for the backoff, doubled at each such
        event since the last quiet spell of `max_backoff_s`. Climbing straight back to the level that
        failed makes a sawtooth of every tier's limit (seen in make demo, 2026-12-06: 4 reversals of
        P1's limit in 21 s; in bench/overload a trim was followed by an increase 3.6 s later)."""
        s = self.settings
        quiet = now - state.last_backoff_t >= s.max_backoff_s
        state.backoff_s = s.backoff_s if quiet else min(s.max_backoff_s, max(s.backoff_s, state.backoff_s * 2))
        state.hold_increase_until = max(state.hold_increase_until, now + state.backoff_s)
        state.last_backoff_t = now

    def expect_verdict(self, state: BudgetState, command_id: str) -> None:
        state.awaiting_verdict = command_id

    def _track_rate(self, state: BudgetState, signals: EngineSignals) -> None:
        scheduled = sum(signals.tier(t).scheduled for t in LOWER_TIERS)
        mark = state.rate_mark
        if mark is None or scheduled < mark[1]:
            state.rate_mark = (signals.t, scheduled)
            return
        elapsed = signals.t - mark[0]
        if elapsed >= 2.0:
            rate = (scheduled - mark[1]) / elapsed
            state.service_rate = rate if state.service_rate == 0.0 else 0.5 * state.service_rate + 0.5 * rate
            state.rate_mark = (signals.t, scheduled)

    def _settle_for(self, state: BudgetState, excess: int) -> float:
        s = self.settings
        if state.service_rate <= 0.0:
            return min(s.settle_max_s, max(s.settle_min_s, 5.0))
        return min(s.settle_max_s, max(s.settle_min_s, excess / state.service_rate))

    def _why(self, signals: EngineSignals, missed: bool) -> str:
        p0 = signals.tier(P0)
        objective_ms = self.settings.p0_queue_wait_p90_s * 1000
        if missed:
            return (
                f"P0 queue wait p90 {p0.queue_wait_p90_s * 1000:.0f} ms, oldest waiting "
                f"{p0.oldest_wait_s * 1000:.0f} ms; objective {objective_ms:.0f} ms"
            )
        return f"{signals.waiting} requests waiting for {signals.running_cap} running slots"
