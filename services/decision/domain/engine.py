"""The decision engine: samples in, planned healing commands out.

Pure: no I/O; wall time for deadlines comes from the injected clock, and all
reasoning about trends and cooldowns uses the samples' own times, so a replay
of a trace gives the same commands as the live run did.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from services.decision.domain import admission
from services.decision.domain.admission import AdmitDecision, EngineProfile
from services.decision.domain.controller import (
    BudgetCommand,
    BudgetState,
    EngineSignals,
    Move,
    TierController,
)
from services.decision.domain.policy import (
    AbortLowPriority,
    Action,
    Conditions,
    MigRebalance,
    Policy,
    Rule,
    SetEngineLimits,
    SetPressure,
    ShedPriority,
)
from services.decision.domain.root_cause import classify
from services.decision.domain.step_budget import StepBudgetTerms, StepMemory, step_memory
from services.decision.domain.types import (
    NO_ROOT_CAUSE,
    EngineLoad,
    Evidence,
    Forecast,
    OomEvent,
    PlannedCommand,
    RootCause,
    RootCauseKind,
    Sample,
    Target,
)
from services.decision.domain.window import DropCounter, DropReason, TargetWindow
from sits.runtime.clock import Clock
from sits.runtime.contract import ActionKind, Tier
from sits.runtime.promise import Promise

COMMAND_NAMESPACE = uuid.UUID("5e1c7a2e-0d6f-4b0e-9a55-3f1f6a1c0b7e")
MAX_TARGETS = 10_000
MAX_SEEN_OOMS = 1024
MAX_TRACKED_COMMANDS = 4096
# Kinds whose promise is P0's objective: they change who gets into the engine.
ADMISSION_KINDS = frozenset({ActionKind.SHED_PRIORITY, ActionKind.SET_TIER_BUDGET})


@dataclass(frozen=True, slots=True)
class WindowSettings:
    max_samples: int = 1200
    max_age_s: float = 120.0


@dataclass(frozen=True, slots=True)
class Explanation:
    target: Target
    window: tuple[Sample, ...]
    forecast: Forecast
    root_cause: RootCause
    last_command: PlannedCommand | None
    drops: dict[str, int]
    latched_rules: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EvaluateResult:
    forecast: Forecast
    root_cause: RootCause
    commands: tuple[PlannedCommand, ...]


EMPTY_FORECAST = Forecast(0.0, None, 0.0, 0.0, 0.0, "none")


@dataclass(slots=True)
class _TargetState:
    target: Target
    window: TargetWindow
    forecast: Forecast = EMPTY_FORECAST
    root_cause: RootCause = NO_ROOT_CAUSE
    root_cause_t: float = -math.inf
    latched: dict[str, float] = field(default_factory=dict)
    pending_clear: dict[str, Rule] = field(default_factory=dict)
    # Flap damping of rules with an undo: since when a latched rule's conditions have been clear,
    # when each was last undone, and how many times in a row it fired again soon after its undo.
    clear_since: dict[str, float] = field(default_factory=dict)
    undone_t: dict[str, float] = field(default_factory=dict)
    flaps: dict[str, int] = field(default_factory=dict)
    last_command: PlannedCommand | None = None
    ooms: int = 0
    last_oom_t: float = -math.inf
    budget: BudgetState = field(default_factory=BudgetState)


@dataclass(frozen=True, slots=True)
class ActionOutcome:
    """What the decision reads of an ActionResult."""

    command_id: str
    action_id: str
    status: str
    rolled_back_action_id: str = ""
    t: float = 0.0
    # The tier budget in force after it (None: Envoy's defaults, or not a budget action).
    budget: int | None = None


@dataclass(frozen=True, slots=True)
class _Issued:
    """What the decision remembers of a command it sent, to act on its verdict or result."""

    target_key: str
    rule: str
    clearing: bool
    controller: bool


@dataclass(slots=True)
class _Context:
    """What the conditions of one rule are checked against."""

    forecast: Forecast
    root_cause: RootCause
    tier: str
    # One step's memory at the engine's live token budget (None: not known for this target).
    step: StepMemory | None = None
    # Within controller.no_loosen_after_oom_s of an OOM on this target: nothing may loosen.
    after_oom: bool = False
    # The running requests the KV cache holds (_kv_room) and the engine's live running cap (None: not known).
    kv_room: int | None = None
    running_cap: int | None = None


class DecisionEngine:
    def __init__(
        self,
        policy: Policy,
        clock: Clock,
        profiles: Mapping[str, EngineProfile] | None = None,
        window: WindowSettings | None = None,
    ) -> None:
        self._clock = clock
        self._profiles: dict[str, EngineProfile] = dict(profiles or {})
        self._window_settings = window or WindowSettings()
        self._states: dict[str, _TargetState] = {}
        # (host, engine) → the key of that engine's target, for admission queries that name no GPU.
        self._engine_keys: dict[tuple[str, str], str] = {}
        # Last command time per command target (engine, or the GPU shared by several engines).
        self._last_command_t: dict[str, float] = {}
        self._rule_fired_t: dict[tuple[str, str], float] = {}
        self._seen_ooms: dict[str, None] = {}
        self._issued: dict[str, _Issued] = {}
        # action id -> command id, for results that name the action (rollbacks).
        self._actions: dict[str, str] = {}
        self.drops = DropCounter()
        self.set_policy(policy)

    # ------------------------------------------------------------------ policy

    @property
    def policy(self) -> Policy:
        return self._policy

    def set_policy(self, policy: Policy) -> None:
        self._policy = policy
        spec = policy.spec
        self._controller = TierController(spec.controller)
        self._sample_rules = tuple(r for r in spec.rules if not r.when.on_oom)
        self._oom_rules = tuple(r for r in spec.rules if r.when.on_oom)
        self._needs_root_cause = any(r.when.root_cause_in for r in spec.rules)
        # The KV room is read over the forecast window, every sample: only for a policy whose rules ask for it.
        self._needs_kv_room = any(r.when.kv_room_below_running_cap for r in spec.rules)
        names = {r.name for r in spec.rules}
        for state in self._states.values():
            for name in [n for n in state.latched if n not in names]:
                del state.latched[name]
            for name in [n for n in state.pending_clear if n not in names]:
                del state.pending_clear[name]
            for table in (state.clear_since, state.undone_t, state.flaps):
                for name in [n for n in table if n not in names]:
                    del table[name]

    def set_profile(self, engine: str, profile: EngineProfile) -> None:
        self._profiles[engine] = profile

    # ------------------------------------------------------------------ inputs

    def _state(self, target: Target) -> _TargetState:
        key = target.key
        state = self._states.get(key)
        if state is None:
            if len(self._states) >= MAX_TARGETS:
                # Forget the target heard from least recently; it rebuilds its window if it comes back.
                self._forget(min(self._states, key=lambda k: self._states[k].window.latest_t))
            fc = self._policy.spec.forecast
            ws = self._window_settings
            state = _TargetState(
                target,
                TargetWindow(
                    max_samples=ws.max_samples,
                    max_age_s=ws.max_age_s,
                    bucket_s=fc.bucket_s,
                    trend_window_s=fc.window_s,
                    min_history_s=fc.min_history_s,
                    young_horizon_s=fc.young_horizon_s,
                ),
            )
            self._states[key] = state
            self._engine_keys[(target.host, target.engine)] = key
        return state

    def _forget(self, key: str) -> _TargetState:
        """Drop a target's state, and the admission index's entry where it leads to that target."""
        state = self._states.pop(key)
        engine_key = (state.target.host, state.target.engine)
        if self._engine_keys.get(engine_key) == key:
            del self._engine_keys[engine_key]
        return state

    def _admission_state(self, target: Target) -> _TargetState | None:
        """The state an admission query is about. The admission processor names its engine by host and engine
        name only: the GPU it runs on is capture's to know (NVML), so a query without one finds the target
        that engine's samples came from."""
        state = self._states.get(target.key)
        if state is None and not target.gpu_uuid and not target.mig_instance:
            key = self._engine_keys.get((target.host, target.engine))
            state = self._states.get(key) if key is not None else None
        return state

    def observe(self, sample: Sample) -> list[PlannedCommand]:
        state = self._state(sample.target)
        reason = state.window.offer(sample)
        if reason is not None:
            self.drops.add(reason)
            return []
        t = sample.t
        state.forecast = self._forecast(state)
        due = t - state.root_cause_t >= self._policy.spec.defaults.root_cause_interval_s
        if due and (self._needs_root_cause or state.forecast.time_to_limit_s is not None):
            self._refresh_root_cause(state, t)
        return self._apply_rules(state, t, sample.event_id, self._sample_rules, None)

    def observe_oom(self, oom: OomEvent) -> list[PlannedCommand]:
        if oom.event_id:
            if oom.event_id in self._seen_ooms:
                self.drops.add(DropReason.DUPLICATE)
                return []
            self._seen_ooms[oom.event_id] = None
            if len(self._seen_ooms) > MAX_SEEN_OOMS:
                del self._seen_ooms[next(iter(self._seen_ooms))]
        if not math.isfinite(oom.t) or oom.requested_bytes < 0 or oom.device_free_bytes < 0:
            self.drops.add(DropReason.ABSURD_VALUE)
            return []
        state = self._state(oom.target)
        state.ooms += 1
        state.last_oom_t = max(state.last_oom_t, oom.t)
        self._controller.on_oom(state.budget, oom.t)
        state.root_cause = classify(
            list(state.window.samples), kv_bytes_per_token=self._bytes_per_token(state), oom_allocator=oom.allocator
        )
        state.root_cause_t = oom.t
        return self._apply_rules(state, oom.t, oom.event_id, self._oom_rules, oom)

    def warm(self, sample: Sample) -> None:
        """A sample read again after this engine took its target over: window and forecast only, no rules
        (the previous owner acted on it already)."""
        state = self._state(sample.target)
        if state.window.offer(sample) is None:
            state.forecast = self._forecast(state)

    # ------------------------------------------------------------------ handover between replicas

    def hand_over(self, owned_elsewhere: Callable[[str], bool]) -> dict[str, dict[str, Any]]:
        """Drop the targets whose key `owned_elsewhere` names, returning what the next owner needs of each:
        rule latches, cooldowns, OOM memory, the controller's state and the commands awaiting a verdict.
        Windows are not in it: the next owner rebuilds them from the metrics topic (`warm`)."""
        out: dict[str, dict[str, Any]] = {}
        for key in [k for k in self._states if owned_elsewhere(k)]:
            state = self._forget(key)
            gpu_key = state.target.gpu_level().key
            out[key] = {
                "target": [state.target.host, state.target.gpu_uuid, state.target.mig_instance, state.target.engine],
                "latched": dict(state.latched),
                "pending_clear": list(state.pending_clear),
                "undone_t": dict(state.undone_t),
                "flaps": dict(state.flaps),
                "ooms": state.ooms,
                "last_oom_t": state.last_oom_t,
                "budget": budget_to_dict(state.budget),
                "last_command_t": {k: t for k, t in self._last_command_t.items() if k in (key, gpu_key)},
                "rule_fired_t": [[rule, t] for (k, rule), t in self._rule_fired_t.items() if k == key],
                "issued": {
                    cid: [i.rule, i.clearing, i.controller] for cid, i in self._issued.items() if i.target_key == key
                },
            }
            for fired in [k for k in self._rule_fired_t if k[0] == key]:
                del self._rule_fired_t[fired]
            for cid in [c for c, i in self._issued.items() if i.target_key == key]:
                del self._issued[cid]
        return out

    def take_over(self, handed: Mapping[str, Mapping[str, Any]]) -> int:
        """Adopt targets another replica handed over (`hand_over`'s output); returns how many."""
        rules = {r.name: r for r in self._policy.spec.rules}
        for key, data in handed.items():
            host, gpu, mig, engine = (str(x) for x in data["target"])
            state = self._state(Target(host, gpu, mig, engine))
            state.latched.update({str(k): float(v) for k, v in data.get("latched", {}).items() if k in rules})
            state.pending_clear.update({n: rules[n] for n in data.get("pending_clear", []) if n in rules})
            state.undone_t.update({str(k): float(v) for k, v in data.get("undone_t", {}).items() if k in rules})
            state.flaps.update({str(k): int(v) for k, v in data.get("flaps", {}).items() if k in rules})
            state.ooms = max(state.ooms, int(data.get("ooms", 0)))
            state.last_oom_t = max(state.last_oom_t, float(data.get("last_oom_t", -math.inf)))
            if state.budget.last_sent_t == -math.inf and "budget" in data:
                state.budget = budget_from_dict(data["budget"])
            for k, t in data.get("last_command_t", {}).items():
                self._last_command_t[k] = max(float(t), self._last_command_t.get(k, -math.inf))
            for rule, t in data.get("rule_fired_t", []):
                self._rule_fired_t[(key, str(rule))] = float(t)
            for cid, (rule, clearing, controller) in data.get("issued", {}).items():
                self._remember(cid, _Issued(key, str(rule), bool(clearing), bool(controller)))
        return len(handed)

    def _bytes_per_token(self, state: _TargetState) -> int | None:
        profile = self._profiles.get(state.target.engine)
        return None if profile is None else profile.kv_bytes_per_token

    def _refresh_root_cause(self, state: _TargetState, t: float) -> None:
        state.root_cause = classify(state.window.samples, kv_bytes_per_token=self._bytes_per_token(state))
        state.root_cause_t = t

    def _forecast(self, state: _TargetState) -> Forecast:
        window = state.window
        fc = self._policy.spec.forecast
        trend = window.memory.trend
        level = window.memory.current_envelope()
        slope = trend.slope_lower
        tto = trend.time_to_reach(level, fc.limit_fraction, fc.horizon_s)
        gpu = window.latest_gpu
        total = gpu.total_bytes if gpu is not None else 0
        engine = window.latest_engine
        kv_usage = engine.kv_cache_usage if engine is not None else 0.0
        kv_tto = None
        model = f"envelope-{trend.model}"
        if engine is not None:
            kv_trend = window.kv_usage.trend
            kv_tto = kv_trend.time_to_reach(window.kv_usage.current_envelope(), 1.0, fc.horizon_s)
            model += "+kv"
        return Forecast(
            memory_fraction=window.memory_fraction,
            time_to_limit_s=tto,
            confidence=trend.confidence if tto != 0.0 else 1.0,
            predicted_fraction=min(2.0, level + slope * fc.horizon_s),
            slope_bytes_per_s=trend.slope * total,
            model=model,
            kv_cache_usage=kv_usage,
            fragmentation=window.fragmentation,
            kv_time_to_full_s=kv_tto,
        )

    # ------------------------------------------------------------------ rules

    def _holds(self, when: Conditions, ctx: _Context, relaxed: bool) -> bool:
        defaults = self._policy.spec.defaults
        margin = defaults.hysteresis if relaxed else 0.0
        fc = ctx.forecast
        if when.tier_in is not None and ctx.tier not in when.tier_in:
            return False
        if when.memory_fraction_above is not None and not fc.memory_fraction > when.memory_fraction_above - margin:
            return False
        if when.kv_usage_above is not None and not fc.kv_cache_usage > when.kv_usage_above - margin:
            return False
        if when.fragmentation_above is not None and not fc.fragmentation > when.fragmentation_above - margin:
            return False
        if when.kv_room_below_running_cap:
            if ctx.kv_room is None or ctx.running_cap is None:
                return False
            # Relaxed (a latched rule): a cap set to the room keeps the rule latched while the room stays there.
            if ctx.kv_room > ctx.running_cap or (ctx.kv_room == ctx.running_cap and not relaxed):
                return False
        if when.kv_time_to_full_below_s is not None:
            limit = when.kv_time_to_full_below_s + (defaults.hysteresis_s if relaxed else 0.0)
            if fc.kv_time_to_full_s is None or fc.kv_time_to_full_s >= limit:
                return False
        if when.time_to_limit_below_s is not None:
            limit = when.time_to_limit_below_s + (defaults.hysteresis_s if relaxed else 0.0)
            if fc.time_to_limit_s is None or fc.time_to_limit_s >= limit:
                return False
            if when.min_confidence is not None:
                floor = when.min_confidence / 2.0 if relaxed else when.min_confidence
                if fc.confidence < floor:
                    return False
        stepwise = when.step_headroom_below is not None or when.step_headroom_above is not None
        if stepwise and not self._step_holds(when, ctx, margin):
            return False
        return not (when.root_cause_in is not None and ctx.root_cause.kind.value not in when.root_cause_in)

    def _step_terms(self) -> StepBudgetTerms:
        s = self._policy.spec.step_budget
        return StepBudgetTerms(s.min_tokens, s.reserve_mib << 20, s.allocator_overhead, s.fill, s.multiple_of)

    def _step_memory(self, state: _TargetState) -> StepMemory | None:
        window = state.window
        engine = window.latest_engine
        if engine is None or engine.max_num_batched_tokens <= 0:
            engine = window.latest_plugin
        return step_memory(
            window.latest_gpu,
            engine,
            window.latest_allocator,
            self._profiles.get(state.target.engine),
            self._step_terms(),
            engine_used_bytes=window.latest_engine_bytes,
        )

    def _step_holds(self, when: Conditions, ctx: _Context, margin: float) -> bool:
        """The step-budget conditions: each also needs the budget it would set to differ from the live one."""
        step = ctx.step
        if step is None:
            return False
        fitted = step.fitted(self._step_terms())
        if when.step_headroom_below is not None and not (
            step.ratio < when.step_headroom_below + margin and fitted < step.live_budget
        ):
            return False
        return when.step_headroom_above is None or (
            not ctx.after_oom
            and step.live_budget < step.ceiling
            and step.ratio > when.step_headroom_above - margin
            and fitted > step.live_budget
        )

    def _apply_rules(
        self, state: _TargetState, t: float, cause_event_id: str, rules: Iterable[Rule], oom: OomEvent | None
    ) -> list[PlannedCommand]:
        latest = state.window.latest_plugin
        ctx = _Context(
            state.forecast,
            state.root_cause,
            self._policy.spec.tiers.of(state.target.engine),
            step=self._step_memory(state),
            after_oom=t < state.last_oom_t + self._policy.spec.controller.no_loosen_after_oom_s,
            kv_room=self._kv_room_now(state, t) if self._needs_kv_room else None,
            running_cap=latest.running_cap if latest is not None and latest.running_cap > 0 else None,
        )
        commands: list[PlannedCommand] = []
        claimed: set[str] = set()
        for rule in rules:
            name = rule.name
            if oom is None:
                if name in state.latched:
                    if self._holds(rule.when, ctx, relaxed=True):
                        state.clear_since.pop(name, None)
                        continue
                    if rule.on_clear:
                        since = state.clear_since.setdefault(name, t)
                        if t - since < self._clear_hold(state, name):
                            continue
                        room = self._undo_room(state, rule, t)
                        if room is not None:
                            commands.extend(self._lift_cap(state, rule, room, t, cause_event_id, claimed, ctx))
                            continue
                        state.pending_clear[name] = rule
                        state.undone_t[name] = t
                    del state.latched[name]
                    state.clear_since.pop(name, None)
                    continue
                if not self._holds(rule.when, ctx, relaxed=False):
                    continue
            elif not self._holds(rule.when, ctx, relaxed=False):
                continue
            planned = self._plan(state, rule, rule.then, t, cause_event_id, claimed, oom, clearing=False)
            if planned:
                commands.extend(planned)
                if oom is None:
                    state.latched[name] = t
                    self._count_flap(state, name, t)
                state.pending_clear.pop(name, None)
        after_oom = t < state.last_oom_t + self._policy.spec.controller.no_loosen_after_oom_s
        for name, rule in list(state.pending_clear.items()):
            if after_oom:
                break  # an undo loosens; after an OOM it waits (it stays pending)
            planned = self._plan(state, rule, rule.on_clear, t, cause_event_id, claimed, None, clearing=True)
            if planned:
                commands.extend(planned)
                del state.pending_clear[name]
        if commands:
            state.last_command = commands[-1]
        return commands

    def _undo_room(self, state: _TargetState, rule: Rule, t: float) -> int | None:
        """The running cap the KV cache has room for, where an undo of `rule` would lift a cap past it.

        None: the undo may restore in full (it restores no running cap, none is held below the start-up
        one, nothing was held back by it over the hold, the cache has room, or `undo_kv_fraction` is 0).
        Room is judged on the largest share of the cache a running request took over the hold, since the
        cap kept the cache from filling and the condition's clearing proves nothing about the load; an
        engine that preempted over the hold has none.
        """
        defaults = self._policy.spec.defaults
        restores = any(isinstance(a, SetEngineLimits) and a.restore_defaults for a in rule.on_clear)
        latest = state.window.latest_plugin  # the live cap: only the SITS plugin reports it
        if not restores or defaults.undo_kv_fraction <= 0.0 or latest is None:
            return None
        cap, seqs = latest.running_cap, latest.max_num_seqs
        if cap <= 0 or cap >= seqs:
            return None
        loads = self._loads_since(state, t - self._clear_hold(state, rule.name)) or [latest]
        if all(e.num_requests_waiting == 0 and e.num_requests_running < cap for e in loads):
            return None
        room = self._kv_room(loads)
        if room is None:
            return None
        counted = [e.num_preemptions for e in loads if e.tiers]  # the plugin's own count, one source
        if counted and max(counted) > min(counted):
            return cap  # preempting at the live cap already: the cache is at its edge
        return None if room >= seqs else room

    @staticmethod
    def _loads_since(state: _TargetState, since: float) -> list[EngineLoad]:
        return [s.engine for s in state.window.samples if s.engine is not None and s.t >= since]

    def _kv_room(self, loads: list[EngineLoad], largest: bool = True) -> int | None:
        """The running requests the KV cache holds within `defaults.undo_kv_fraction` of it (at least 1), at
        the largest share of it one running request took in `loads`, or (`largest=False`) at the mean share
        (all the usage over all the requests). None: no request was seen holding any, or the fraction is 0."""
        fraction = self._policy.spec.defaults.undo_kv_fraction
        busy = [e for e in loads if e.num_requests_running > 0 and e.kv_cache_usage > 0.0]
        if not busy or fraction <= 0.0:
            return None
        if largest:
            per_request = max(e.kv_cache_usage / e.num_requests_running for e in busy)
        else:
            per_request = sum(e.kv_cache_usage for e in busy) / sum(e.num_requests_running for e in busy)
        return max(1, math.floor(fraction / per_request))

    def _kv_room_now(self, state: _TargetState, t: float) -> int | None:
        """What a cut sizes a running cap by: _kv_room at the mean share over the forecast window ending at `t`.

        The mean, not the largest share an undo goes by: a sample of a few large requests (one prefill of a
        long prompt, the cache not yet freed after others finished) set 6 of 16 in make demo (2026-12-07),
        while 6 held 40 % of the cache; below P0's own load. What the mean leaves out, vLLM's priority
        preemption takes from the lowest tier, and the cut's promise counts preemptions."""
        return self._kv_room(self._loads_since(state, t - self._policy.spec.forecast.window_s), largest=False)

    def _lift_cap(
        self,
        state: _TargetState,
        rule: Rule,
        room: int,
        t: float,
        cause_event_id: str,
        claimed: set[str],
        ctx: _Context,
    ) -> list[PlannedCommand]:
        """Lift a latched rule's running cap part of the way back, as far as the KV cache has room for; the
        rule stays latched and holds again before the next step. Nothing while the cache has no room beyond
        the live cap, or after an OOM."""
        latest = state.window.latest_plugin
        if ctx.after_oom or latest is None or room <= latest.running_cap:
            return []
        lift = SetEngineLimits(kind="SET_ENGINE_LIMITS", max_num_running_reqs=room)
        reason = (
            f"{rule.name}: conditions cleared; the KV cache has room for {room} running requests of the recent "
            f"size, not the {latest.max_num_seqs} the engine started with: running cap {latest.running_cap} -> {room}"
        )
        planned = self._plan(state, rule, (lift,), t, cause_event_id, claimed, None, clearing=True, reason=reason)
        if planned:
            state.clear_since[rule.name] = t
        return planned

    def _clear_hold(self, state: _TargetState, name: str) -> float:
        """How long a latched rule's conditions must stay clear before its undo: doubled per flap."""
        defaults = self._policy.spec.defaults
        if defaults.clear_hold_s <= 0.0:
            return 0.0
        return min(defaults.max_clear_hold_s, defaults.clear_hold_s * 2.0 ** state.flaps.get(name, 0))

    def _count_flap(self, state: _TargetState, name: str, t: float) -> None:
        """A rule firing again soon after its undo flaps: its next hold doubles. Long quiet resets it."""
        undone = state.undone_t.get(name)
        if undone is not None and t - undone < self._policy.spec.defaults.max_clear_hold_s:
            state.flaps[name] = state.flaps.get(name, 0) + 1
        else:
            state.flaps.pop(name, None)

    def _plan(
        self,
        state: _TargetState,
        rule: Rule,
        actions: tuple[Action, ...],
        t: float,
        cause_event_id: str,
        claimed: set[str],
        oom: OomEvent | None,
        clearing: bool,
        reason: str | None = None,
    ) -> list[PlannedCommand]:
        """Commands for all of `actions`, or none when any of their targets is in its cooldown."""
        defaults = self._policy.spec.defaults
        rule_key = (state.target.key, rule.name + (":clear" if clearing else ""))
        cooldown = rule.cooldown_s if rule.cooldown_s is not None else defaults.cooldown_s
        last_fired = self._rule_fired_t.get(rule_key)
        if last_fired is not None and t - last_fired < cooldown:
            return []
        targets = [state.target if a.scope == "engine" else state.target.gpu_level() for a in actions]
        for target in targets:
            key = target.key
            if key in claimed:
                return []
            last = self._last_command_t.get(key)
            if last is not None and t - last < defaults.target_cooldown_s:
                return []
        now = self._clock.now()
        step = self._step_memory(state)
        evidence, because = self._evidence(state, rule, oom, clearing, step)
        reason = reason or because
        planned = []
        for action, target in zip(actions, targets, strict=True):
            kind = ActionKind.parse(action.kind)
            command_id = str(
                uuid.uuid5(COMMAND_NAMESPACE, f"{target.key}|{rule.name}|{kind.name}|{cause_event_id}|{t!r}|{clearing}")
            )
            params = self._params(state, action, step, t)
            self._remember(command_id, _Issued(state.target.key, rule.name, clearing, controller=False))
            planned.append(
                PlannedCommand(
                    command_id=command_id,
                    target=target,
                    kind=kind,
                    params=params,
                    reason=reason,
                    evidence=evidence,
                    rule=rule.name,
                    policy_version=self._policy.version,
                    target_memory_fraction=rule.target_memory_fraction or defaults.target_memory_fraction,
                    issued_at=now,
                    deadline=now + defaults.deadline_s,
                    cause_event_id=cause_event_id,
                    root_cause=state.root_cause,
                    promise=self._promise(kind, params, rule, target_engine=bool(target.engine), step=step),
                )
            )
            self._last_command_t[target.key] = t
            claimed.add(target.key)
        self._rule_fired_t[rule_key] = t
        return planned

    def _evidence(
        self, state: _TargetState, rule: Rule, oom: OomEvent | None, clearing: bool, step: StepMemory | None = None
    ) -> tuple[tuple[Evidence, ...], str]:
        fc = state.forecast
        evidence = [Evidence("memory_fraction", round(fc.memory_fraction, 4), "device memory used")]
        parts: list[str] = []
        when = rule.when
        if oom is not None:
            evidence.append(Evidence("oom_requested_bytes", oom.requested_bytes, oom.message[:200]))
            evidence.append(Evidence("oom_device_free_bytes", oom.device_free_bytes, "free when the OOM hit"))
            parts.append(f"CUDA OOM asking for {oom.requested_bytes / 2**30:.2f} GiB")
        if fc.time_to_limit_s is not None:
            evidence.append(
                Evidence(
                    "time_to_limit_s",
                    round(fc.time_to_limit_s, 3),
                    f"forecast ({fc.model}) reaches {self._policy.spec.forecast.limit_fraction:.0%} of the device",
                )
            )
            evidence.append(Evidence("forecast_confidence", fc.confidence, ""))
            evidence.append(Evidence("slope_bytes_per_s", round(fc.slope_bytes_per_s, 1), ""))
        if when.time_to_limit_below_s is not None and fc.time_to_limit_s is not None:
            parts.append(
                f"memory forecast to reach {self._policy.spec.forecast.limit_fraction:.0%} in "
                f"{fc.time_to_limit_s:.1f} s (confidence {fc.confidence:.2f})"
            )
        if when.kv_usage_above is not None or fc.kv_cache_usage > 0:
            evidence.append(Evidence("kv_cache_usage", round(fc.kv_cache_usage, 4), "engine KV cache in use"))
        if when.kv_usage_above is not None:
            parts.append(f"KV cache {fc.kv_cache_usage:.0%} used (rule: above {when.kv_usage_above:.0%})")
        if when.fragmentation_above is not None or fc.fragmentation > 0:
            evidence.append(
                Evidence("fragmentation", round(fc.fragmentation, 4), "allocator reserved but not allocated")
            )
        if when.fragmentation_above is not None:
            parts.append(f"fragmentation {fc.fragmentation:.0%} (rule: above {when.fragmentation_above:.0%})")
        if when.memory_fraction_above is not None:
            parts.append(f"memory {fc.memory_fraction:.0%} (rule: above {when.memory_fraction_above:.0%})")
        if step is not None and (when.step_headroom_below is not None or when.step_headroom_above is not None):
            fitted = step.fitted(self._step_terms())
            evidence.append(
                Evidence("step_headroom_bytes", step.headroom_bytes, "device free + engine cache - reserve")
            )
            evidence.append(Evidence("step_need_bytes", step.need_live_bytes, f"a full step at {step.live_budget}"))
            evidence.append(Evidence("step_fitted_budget", fitted, "tokens per step that fit"))
            parts.append(
                f"a step of {step.live_budget} tokens needs {step.need_live_bytes / 2**30:.2f} GiB, "
                f"{step.headroom_bytes / 2**30:.2f} GiB left (x{step.ratio:.2f}): "
                f"token budget {step.live_budget} -> {fitted}"
            )
        rc = state.root_cause
        if rc.kind is not RootCauseKind.NONE:
            evidence.append(Evidence("root_cause_confidence", rc.confidence, rc.kind.value))
            evidence.extend(rc.evidence)
            parts.append(f"root cause {rc.kind.value} ({rc.confidence:.2f})")
        if clearing:
            reason = f"{rule.name}: conditions cleared; undoing"
        else:
            reason = f"{rule.name}: " + ("; ".join(parts) if parts else rule.description or "conditions met")
        return tuple(evidence), reason

    def _params(
        self, state: _TargetState, action: Action, step: StepMemory | None = None, t: float | None = None
    ) -> dict[str, object]:
        if isinstance(action, SetEngineLimits):
            params: dict[str, object] = {}
            if action.fit_token_budget and step is not None:
                params["max_num_scheduled_tokens"] = step.fitted(self._step_terms())
            room = self._kv_room_now(state, t) if action.fit_kv_room and t is not None else None
            if room is not None:
                params["max_num_running_reqs"] = room
            if action.max_num_running_reqs is not None:
                params["max_num_running_reqs"] = action.max_num_running_reqs
            if action.max_num_running_reqs_factor is not None:
                engine = state.window.latest_engine
                running = engine.num_requests_running if engine is not None else 0
                if running > 0:
                    params["max_num_running_reqs"] = max(1, math.floor(running * action.max_num_running_reqs_factor))
                else:
                    # No engine load seen here: the executor resolves the factor against the live engine.
                    params["max_num_running_reqs_factor"] = action.max_num_running_reqs_factor
            for name in ("max_num_scheduled_tokens", "max_prefill_chunk_tokens", "admission_paused"):
                value = getattr(action, name)
                if value is not None:
                    params[name] = value
            if action.restore_defaults:
                params = {"restore_defaults": True}
            return params
        if isinstance(action, ShedPriority):
            return {
                "priority": action.priority,
                "state": action.state,
                "max_requests": action.max_requests,
                "ttl_seconds": action.ttl_seconds,
            }
        if isinstance(action, SetPressure):
            pressure = action.pressure
            if pressure == "forecast":
                pressure = max(0.0, min(1.0, state.forecast.predicted_fraction))
            return {"pressure": float(pressure)}
        if isinstance(action, AbortLowPriority):
            return {"at_or_below": action.at_or_below, "max_streams": action.max_streams}
        if isinstance(action, MigRebalance):
            tenants: dict[str, int] = {}
            latest = state.window.samples[-1] if state.window.samples else None
            if latest is not None:
                for proc in latest.processes:
                    tenants[proc.name or f"pid-{proc.pid}"] = proc.used_bytes
            return {"tenant_bytes": tenants, "dry_run": action.dry_run}
        return {}

    def _promise(
        self,
        kind: ActionKind,
        params: Mapping[str, object],
        rule: Rule,
        target_engine: bool,
        step: StepMemory | None = None,
    ) -> Promise:
        """What an action of a rule promises the validator (docs/control.md, "Promises")."""
        spec = self._policy.spec
        if kind in ADMISSION_KINDS:
            return Promise(
                p0_queue_wait_p90_s=spec.controller.p0_queue_wait_p90_s,
                no_p0_refused=True,
                engine_alive=target_engine,
            )
        if kind is ActionKind.SET_ENGINE_LIMITS:
            cap = params.get("max_num_running_reqs")
            memory_limit = spec.forecast.limit_fraction if rule.when.time_to_limit_below_s is not None else None
            budget = params.get("max_num_scheduled_tokens")
            fitted = any(isinstance(a, SetEngineLimits) and a.fit_token_budget for a in rule.then)
            engine_limit = None
            if fitted and step is not None and isinstance(budget, int):
                # Derived from the cut: memory now, plus what a full step at the new budget takes
                # beyond the engine's cache, plus the reserve. On the engine's own memory where NVML
                # reports it: a co-tenant that fills the device breaks no promise of this engine's cut.
                terms = self._step_terms()
                engine_limit = step.engine_bytes_after(budget, terms)
                memory_limit = None if engine_limit is not None else step.device_fraction_after(budget, terms)
            return Promise(
                settle_s=spec.promises.engine_limits_settle_s,
                engine_alive=True,
                # A memory rule promises memory under the line the forecast calls OOM; judged on GPU memory only.
                gpu_memory_fraction_below=memory_limit,
                engine_memory_bytes_below=engine_limit,
                preemptions_per_s_below=spec.promises.max_preemptions_per_s,
                running_at_most=int(cap) if isinstance(cap, int) else None,
            )
        effects = {
            ActionKind.ABORT_LOW_PRIORITY: "the lowest tiers' streams aborted, P0 untouched",
            ActionKind.FLUSH_CACHE: "the prefix cache flushed",
            ActionKind.PAUSE_ADMISSION: "no request admitted while paused",
            ActionKind.RESUME_ADMISSION: "admission open again",
            ActionKind.MIG_REBALANCE: "the MIG plan applied or recorded as a dry run",
            ActionKind.SET_PRESSURE: "Envoy's overload pressure set",
        }
        return Promise(engine_alive=target_engine, effect=effects.get(kind, ""))

    def _remember(self, command_id: str, issued: _Issued) -> None:
        self._issued[command_id] = issued
        if len(self._issued) > MAX_TRACKED_COMMANDS:
            del self._issued[next(iter(self._issued))]

    # ------------------------------------------------------------------ controller

    def tick(self, now: float) -> list[PlannedCommand]:
        """One controller tick over every engine whose plugin reports its tiers."""
        commands: list[PlannedCommand] = []
        for state in self._states.values():
            engine = state.window.latest_plugin
            signals = None
            if engine is not None:
                signals = EngineSignals(
                    t=state.window.latest_plugin_t,
                    tiers={t.tier: t for t in engine.tiers},
                    running_cap=engine.running_cap or engine.max_num_seqs or engine.num_requests_running,
                    max_num_seqs=engine.max_num_seqs,
                )
            elif state.budget.budget is None:
                continue
            wanted = self._controller.tick(state.budget, signals, now)
            if wanted is not None:
                command = self._budget_command(state, wanted, now)
                if wanted.move is not Move.RENEW:
                    self._controller.expect_verdict(state.budget, command.command_id)
                    state.last_command = command
                commands.append(command)
        return commands

    def _budget_command(self, state: _TargetState, wanted: BudgetCommand, now: float) -> PlannedCommand:
        c = self._policy.spec.controller
        key = state.target.key
        command_id = str(uuid.uuid5(COMMAND_NAMESPACE, f"{key}|controller|{wanted.move.value}|{now!r}"))
        self._remember(command_id, _Issued(key, "controller", wanted.move.loosens, controller=True))
        limits = {str(tier): n for tier, n in sorted(wanted.limits.items())}
        budget = "defaults" if wanted.budget is None else str(wanted.budget)
        evidence = tuple(
            Evidence(f"p{t.tier}_queue_wait_p90_s", round(t.queue_wait_p90_s, 4), f"waiting {t.waiting}")
            for t in (state.window.latest_plugin.tiers if state.window.latest_plugin is not None else ())
        )
        return PlannedCommand(
            command_id=command_id,
            target=state.target,
            kind=ActionKind.SET_TIER_BUDGET,
            params={
                "budget": wanted.budget,
                "limits": {int(t): n for t, n in limits.items()},
                "lease_s": c.lease_s,
                "drain_backlog": wanted.drain_backlog,
            },
            reason=f"controller {wanted.move.value}: lower-tier budget {budget} ({wanted.reason})",
            evidence=evidence,
            rule="controller",
            policy_version=self._policy.version,
            target_memory_fraction=0.0,
            issued_at=now,
            deadline=now + min(self._policy.spec.defaults.deadline_s, c.lease_s),
            promise=Promise(
                settle_s=wanted.settle_s,
                p0_queue_wait_p90_s=c.p0_queue_wait_p90_s,
                no_p0_refused=True,
                engine_alive=True,
            ),
        )

    def observe_verdict(self, command_id: str, outcome: str, t: float) -> None:
        """A verdict on a command this engine sent: the controller backs off, a rule escalates or re-latches."""
        issued = self._issued.get(command_id)
        if issued is None:
            return
        state = self._states.get(issued.target_key)
        if state is None:
            return
        if issued.controller:
            self._controller.on_verdict(state.budget, command_id, outcome, t)
            return
        if outcome == "NOT_KEPT" and not issued.clearing:
            # The cut did not keep its promise: let the rule fire again (its next stage) once its cooldown allows.
            state.latched.pop(issued.rule, None)
        elif outcome == "ROLLED_BACK" and issued.clearing:
            # The undo was undone: the rule's action is in force again, so it must clear again to undo it,
            # and holds twice as long first (the undo flapped).
            state.latched[issued.rule] = t
            state.clear_since.pop(issued.rule, None)
            state.flaps[issued.rule] = state.flaps.get(issued.rule, 0) + 1

    def observe_result(self, outcome: ActionOutcome) -> None:
        """An executor result: which action carried out a command, and state changed behind the decision's back
        (a rollback, an expired lease)."""
        if outcome.status == "APPLIED":
            if outcome.command_id in self._issued:
                self._actions[outcome.action_id] = outcome.command_id
                if len(self._actions) > MAX_TRACKED_COMMANDS:
                    del self._actions[next(iter(self._actions))]
            return
        if outcome.status == "ROLLED_BACK":
            command_id = self._actions.get(outcome.rolled_back_action_id, "")
        elif outcome.status == "EXPIRED":
            command_id = outcome.command_id
        else:
            return
        issued = self._issued.get(command_id)
        state = self._states.get(issued.target_key) if issued is not None else None
        if issued is None or state is None:
            return
        if outcome.status == "ROLLED_BACK":
            if issued.controller:
                self._controller.on_rollback(state.budget, outcome.budget)
        elif issued.controller:
            self._controller.on_expired(state.budget)
        else:
            state.latched.pop(issued.rule, None)

    # ------------------------------------------------------------------ queries

    def admit(
        self,
        target: Target,
        prompt_tokens: int,
        max_tokens: int,
        priority: Tier | None = None,
        prompt_logprobs: int = 0,
    ) -> AdmitDecision:
        state = self._admission_state(target)
        profile = self._profiles.get(target.engine)
        reserve = self._policy.spec.admission.p0_reserved_kv_fraction
        if state is None:
            return admission.decide(
                prompt_tokens, max_tokens, priority, None, profile, False, reserve, prompt_logprobs=prompt_logprobs
            )
        window = state.window
        return admission.decide(
            prompt_tokens,
            max_tokens,
            priority,
            window.latest_plugin or window.latest_engine,
            profile,
            state.forecast.time_to_limit_s == 0.0,
            reserve,
            prompt_logprobs=prompt_logprobs,
            headroom_bytes=admission.device_headroom(window.latest_gpu, window.latest_allocator),
        )

    def explain(self, target: Target) -> Explanation | None:
        state = self._states.get(target.key)
        if state is None:
            return None
        return Explanation(
            target=state.target,
            window=tuple(state.window.samples),
            forecast=state.forecast,
            root_cause=state.root_cause,
            last_command=state.last_command,
            drops=state.window.drops.as_dict(),
            latched_rules=tuple(state.latched),
        )

    def forecast_of(self, target: Target) -> Forecast | None:
        state = self._states.get(target.key)
        return None if state is None else state.forecast

    def targets(self) -> list[Target]:
        return [s.target for s in self._states.values()]

    def evaluate(
        self, samples: Iterable[Sample], ooms: Iterable[OomEvent] = (), target: Target | None = None
    ) -> EvaluateResult:
        """What-if: replay the given window through a fresh engine; this engine is not touched."""
        from sits.runtime.clock import ManualClock

        events: list[tuple[float, int, Sample | OomEvent]] = [(s.t, 0, s) for s in samples]
        events += [(o.t, 1, o) for o in ooms]
        events.sort(key=lambda e: (e[0] if math.isfinite(e[0]) else math.inf, e[1]))
        start = next((t for t, _, _ in events if math.isfinite(t) and t > 0), self._clock.now())
        clock = ManualClock(start)
        replay = DecisionEngine(self._policy, clock, self._profiles, self._window_settings)
        commands: list[PlannedCommand] = []
        for t, _, event in events:
            if math.isfinite(t):
                clock.set(t)
            if isinstance(event, Sample):
                commands += replay.observe(event if target is None else _retarget(event, target))
            else:
                commands += replay.observe_oom(event if target is None else _retarget_oom(event, target))
        key_target = target or (events[0][2].target if events else Target())
        explanation = replay.explain(key_target)
        if explanation is None:
            return EvaluateResult(EMPTY_FORECAST, NO_ROOT_CAUSE, tuple(commands))
        root_cause = explanation.root_cause
        if root_cause is NO_ROOT_CAUSE and explanation.window:
            root_cause = classify(
                explanation.window, kv_bytes_per_token=self._bytes_per_token(replay._states[key_target.key])
            )
        return EvaluateResult(explanation.forecast, root_cause, tuple(commands))


def budget_to_dict(budget: BudgetState) -> dict[str, Any]:
    """The controller's memory of one engine as JSON-able values (for a handover)."""
    out: dict[str, Any] = {}
    for f in fields(budget):
        value = getattr(budget, f.name)
        if isinstance(value, Move):
            value = value.value
        elif f.name == "history":
            value = [[t, move.value, b] for t, move, b in value]
        elif f.name == "rate_mark" and value is not None:
            value = list(value)
        out[f.name] = value
    return out


def budget_from_dict(data: Mapping[str, Any]) -> BudgetState:
    known = {f.name for f in fields(BudgetState)}
    values = {k: v for k, v in data.items() if k in known}
    if values.get("last_move") is not None:
        values["last_move"] = Move(values["last_move"])
    values["history"] = [(float(t), Move(m), b) for t, m, b in values.get("history", [])]
    # JSON keys are strings; the tiers are numbers.
    values["limits"] = {int(tier): int(n) for tier, n in values.get("limits", {}).items()}
    if values.get("rate_mark") is not None:
        t, n = values["rate_mark"]
        values["rate_mark"] = (float(t), int(n))
    return BudgetState(**values)


def _retarget(sample: Sample, target: Target) -> Sample:
    if sample.target == target:
        return sample
    from dataclasses import replace

    return replace(sample, target=target)


def _retarget_oom(oom: OomEvent, target: Target) -> OomEvent:
    if oom.target == target:
        return oom
    from dataclasses import replace

    return replace(oom, target=target)
