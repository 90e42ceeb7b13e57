"""Declarative healing policy: YAML validated by pydantic, errors naming field and line.

A policy is an ordered list of rules. Each rule has conditions (`when`, all
must hold), the actions it takes when it fires (`then`, at most one per scope:
the engine, or the GPU it runs on) and optionally the actions that undo them
once the conditions clear (`on_clear`). Rules listed first win when two want
the same scope at once. See services/decision/default_policy.yaml.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.decision.domain.types import RootCauseKind

# contract.Tier's names spelled as a type, so pydantic checks a policy's tiers (tests/decision/test_policy.py
# holds it to the contract).
TierName = Literal["P0", "P1", "P2"]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ForecastSettings(_Strict):
    # The memory fraction treated as "out of memory" by the forecast (act before it).
    limit_fraction: float = Field(default=0.96, gt=0.0, le=1.0)
    horizon_s: float = Field(default=300.0, gt=0.0, le=3600.0)
    bucket_s: float = Field(default=0.5, gt=0.0, le=10.0)
    window_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    # No trend is trusted before this much history of a target (the level alone still counts).
    min_history_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    # A trend younger than min_history_s may warn only when, at its fastest plausible slope,
    # the limit is this close: on a fresh target the first tooth of a sawtooth climbs exactly
    # like a ramp to OOM, so it waits for the last safe moment (the 2 s the loop needs to
    # act, plus one bucket between two decisions).
    young_horizon_s: float = Field(default=2.5, gt=0.0, le=3600.0)

    @model_validator(mode="after")
    def _window_holds_buckets(self) -> ForecastSettings:
        if self.window_s < 4 * self.bucket_s:
            raise ValueError("window_s must hold at least 4 buckets of bucket_s")
        if self.min_history_s > self.window_s:
            raise ValueError("min_history_s must not exceed window_s")
        return self


class Defaults(_Strict):
    cooldown_s: float = Field(default=30.0, ge=0.0, le=86400.0)
    # No two commands for one target closer than this, whatever the rules.
    target_cooldown_s: float = Field(default=5.0, ge=0.0, le=3600.0)
    deadline_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    # A fired rule stays latched until its fraction conditions clear by this margin...
    hysteresis: Fraction = 0.03
    # ...and its time-to-limit condition by this many seconds.
    hysteresis_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    # A latched rule with an undo (`on_clear`) undoes only once its conditions stayed clear this long,
    # as Kubernetes' HPA waits out a scale-down stabilization window: a limit that made its own
    # condition clear (a running cap stops the KV cache filling) is no proof the pressure has gone.
    clear_hold_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    # Flap damping: each time such a rule fires again within this long of its undo, its next hold
    # doubles, up to this.
    max_clear_hold_s: float = Field(default=300.0, ge=0.0, le=86400.0)
    # An undo that lifts a running cap back to the engine's start-up one waits while the KV cache, at the
    # size recent requests take in it, has no room for that many (it lifts the cap only as far as the
    # cache has room for, this fraction of it): lifting it further refills the cache and preempts.
    # 0: undo in full once the hold is over.
    undo_kv_fraction: Fraction = 0.9
    target_memory_fraction: float = Field(default=0.9, gt=0.0, le=1.0)
    root_cause_interval_s: float = Field(default=5.0, gt=0.0, le=600.0)

    @model_validator(mode="after")
    def _hold_within_its_bound(self) -> Defaults:
        if self.clear_hold_s > self.max_clear_hold_s:
            raise ValueError(
                f"clear_hold_s ({self.clear_hold_s:g}) is above max_clear_hold_s ({self.max_clear_hold_s:g})"
            )
        return self


class ControllerSettings(_Strict):
    """The tier controller (services/decision/domain/controller.py; docs/control.md)."""

    enabled: bool = True
    # The controller runs on this fixed tick, whatever the rate of samples.
    tick_s: float = Field(default=0.5, ge=0.05, le=60.0)
    # P0's objective: its queue wait p90 inside the engine (arrival to first scheduled step).
    p0_queue_wait_p90_s: float = Field(default=0.1, gt=0.0, le=600.0)
    # Lower-tier streams allowed to wait beyond the engine's running cap: the budget's ceiling
    # is the cap plus this.
    lookahead: int = Field(default=2, ge=0, le=10_000)
    budget_min: int = Field(default=1, ge=0, le=100_000)
    decrease_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    increase_step: int = Field(default=1, ge=1, le=10_000)
    # Share of the ceiling P1 keeps before P2 gets any: a cut comes out of P2 first.
    p1_share: Fraction = 0.6
    # Consecutive saturated ticks (a queue beyond the lookahead, or P0's objective missed) before
    # the lower tiers are limited at all.
    engage_ticks: int = Field(default=2, ge=1, le=1000)
    # A budget at its ceiling and unused this long hands Envoy back its defaults.
    release_after_s: float = Field(default=15.0, ge=0.0, le=86400.0)
    # Each command holds this long unless the next tick renews it (at a third of it).
    lease_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    # After a decrease or a rolled-back increase, no increase for this long (doubling, up to max_backoff_s,
    # until a quiet spell of max_backoff_s).
    backoff_s: float = Field(default=60.0, ge=0.0, le=86400.0)
    max_backoff_s: float = Field(default=300.0, ge=0.0, le=86400.0)
    # Abort lower-tier requests waiting in the engine beyond a cut (newest first).
    drain_backlog: bool = True
    # The settle window of a change is its expected drain time, clamped to these.
    settle_min_s: float = Field(default=2.0, gt=0.0, le=3600.0)
    settle_max_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    # Signals older than this are not acted on (the lease then runs out).
    max_signal_age_s: float = Field(default=3.0, gt=0.0, le=3600.0)
    # After an OOM on the engine, nothing is loosened for this long.
    no_loosen_after_oom_s: float = Field(default=60.0, ge=0.0, le=86400.0)

    @model_validator(mode="after")
    def _consistent(self) -> ControllerSettings:
        if self.lease_s < 2 * self.tick_s:
            raise ValueError("lease_s must be at least two ticks (2 x tick_s), or the lease runs out between renewals")
        if self.settle_min_s > self.settle_max_s:
            raise ValueError("settle_min_s must not exceed settle_max_s")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError("max_backoff_s must not be below backoff_s")
        if self.max_signal_age_s < self.tick_s:
            raise ValueError("max_signal_age_s must be at least one tick")
        return self


class Promises(_Strict):
    """What engine-limit actions promise (the controller's and sheds' promise is P0's objective)."""

    # No preemption storm: preemptions per second after the settle window at most this.
    max_preemptions_per_s: float = Field(default=5.0, ge=0.0, le=1e6)
    # Settle window of engine-limit actions (the drain of what the cut preempted or held back).
    engine_limits_settle_s: float = Field(default=5.0, gt=0.0, le=3600.0)


class AdmissionSettings(_Strict):
    """Per-request admission by KV (Decision/Admit, asked by the mesh's processor)."""

    # Share of the engine's KV cache P1 and P2 may not use, so a P0 request finds room.
    p0_reserved_kv_fraction: Fraction = 0.1


class StepBudgetSettings(_Strict):
    """How the step-budget conditions and `fit_token_budget` size one engine step
    (services/decision/domain/step_budget.py): the activation need from the engine's model
    shape, times the allocator's overhead, against the device's free memory plus what the
    engine's allocator holds between steps, less the reserve."""

    # A fitted budget is never below this (nor above the engine's start-up budget).
    min_tokens: int = Field(default=512, ge=1, le=10_000_000)
    # Device memory kept free beyond a full step's need.
    reserve_mib: int = Field(default=256, ge=0, le=1_000_000)
    # Device bytes per allocated activation byte at large steps (caching allocator rounding);
    # 155/108 KiB per token was measured on the H200 (FACTS.md).
    allocator_overhead: float = Field(default=1.45, ge=1.0, le=4.0)
    # A fitted budget's full step needs at most this share of the headroom.
    fill: float = Field(default=0.8, gt=0.0, le=1.0)
    # Fitted budgets are rounded down to a multiple of this many tokens.
    multiple_of: int = Field(default=256, ge=1, le=65_536)


class Tiers(_Strict):
    default: TierName = "P1"
    engines: dict[str, TierName] = Field(default_factory=dict)

    def of(self, engine: str) -> TierName:
        return self.engines.get(engine, self.default)


class Conditions(_Strict):
    on_oom: bool = False
    memory_fraction_above: Fraction | None = None
    time_to_limit_below_s: float | None = Field(default=None, gt=0.0, le=3600.0)
    min_confidence: Fraction | None = None
    kv_usage_above: Fraction | None = None
    # The engine's KV pool forecast to fill within this many seconds (the KV-usage trend).
    kv_time_to_full_below_s: float | None = Field(default=None, gt=0.0, le=3600.0)
    fragmentation_above: Fraction | None = None
    root_cause_in: tuple[str, ...] | None = None
    tier_in: tuple[TierName, ...] | None = None
    # Headroom over the need of a full step at the engine's live token budget (step_budget.py):
    # below, when a smaller budget would fit better (a cut is possible); above, when the budget
    # is below the engine's start-up budget and a larger one fits (never within
    # controller.no_loosen_after_oom_s of an OOM: raising the budget loosens).
    step_headroom_below: float | None = Field(default=None, gt=0.0, le=100.0)
    step_headroom_above: float | None = Field(default=None, gt=0.0, le=100.0)
    # The KV cache holds fewer running requests than the engine's live running cap, at the mean share of it one
    # running request took over the forecast window (within defaults.undo_kv_fraction of the cache); the live
    # cap comes from the SITS plugin's samples, so never true without it.
    kv_room_below_running_cap: bool = False

    @field_validator("root_cause_in")
    @classmethod
    def _known_causes(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        known = {k.value for k in RootCauseKind}
        unknown = [v for v in value if v not in known]
        if unknown:
            raise ValueError(f"unknown root cause {unknown[0]!r}; known: {', '.join(sorted(known))}")
        if not value:
            raise ValueError("root_cause_in must name at least one cause")
        return value

    @model_validator(mode="after")
    def _something(self) -> Conditions:
        if not (self.on_oom or self.kv_room_below_running_cap) and all(
            getattr(self, name) is None
            for name in (
                "memory_fraction_above",
                "time_to_limit_below_s",
                "kv_usage_above",
                "kv_time_to_full_below_s",
                "fragmentation_above",
                "root_cause_in",
                "step_headroom_below",
                "step_headroom_above",
            )
        ):
            raise ValueError(
                "a rule needs at least one condition (on_oom, memory_fraction_above, "
                "time_to_limit_below_s, kv_usage_above, kv_time_to_full_below_s, fragmentation_above, root_cause_in, "
                "step_headroom_below, step_headroom_above, kv_room_below_running_cap)"
            )
        return self


class _Action(_Strict):
    scope: Literal["engine", "gpu"] = "engine"


class SetEngineLimits(_Action):
    kind: Literal["SET_ENGINE_LIMITS"]
    max_num_running_reqs: int | None = Field(default=None, ge=1, le=1_000_000)
    # Relative to the requests running when the rule fires (at least 1); where the decision has seen no
    # engine load, the executor resolves it against the live engine when it applies the command.
    max_num_running_reqs_factor: float | None = Field(default=None, gt=0.0, le=1.0)
    max_num_scheduled_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    max_prefill_chunk_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    admission_paused: bool | None = None
    # The token budget whose full step fits the memory left (the policy's step_budget block).
    fit_token_budget: bool = False
    # The running cap the KV cache holds (the kv_room_below_running_cap condition's room), rather than a share
    # of whatever happens to run when the rule fires: early in a ramp that share was 2 of 16.
    fit_kv_room: bool = False
    # Back to the engine's start-up running cap and token budget (what an on_clear undoes a cut with);
    # the prefill chunk cap and admission stay as they are.
    restore_defaults: bool = False

    @model_validator(mode="after")
    def _one_limit(self) -> SetEngineLimits:
        if self.max_num_running_reqs is not None and self.max_num_running_reqs_factor is not None:
            raise ValueError("give max_num_running_reqs or max_num_running_reqs_factor, not both")
        if self.fit_token_budget and self.max_num_scheduled_tokens is not None:
            raise ValueError("give max_num_scheduled_tokens or fit_token_budget, not both")
        if self.fit_kv_room and (self.max_num_running_reqs is not None or self.max_num_running_reqs_factor is not None):
            raise ValueError("give max_num_running_reqs, max_num_running_reqs_factor or fit_kv_room, only one")
        if self.restore_defaults:
            return self
        if (
            all(
                v is None
                for v in (
                    self.max_num_running_reqs,
                    self.max_num_running_reqs_factor,
                    self.max_num_scheduled_tokens,
                    self.max_prefill_chunk_tokens,
                    self.admission_paused,
                )
            )
            and not self.fit_token_budget
            and not self.fit_kv_room
        ):
            raise ValueError("SET_ENGINE_LIMITS needs at least one limit (or restore_defaults: true)")
        return self


class ShedPriority(_Action):
    kind: Literal["SHED_PRIORITY"]
    priority: TierName = "P2"
    state: Literal["OPEN", "HALF_OPEN", "CLOSED"] = "OPEN"
    max_requests: int = Field(default=0, ge=0, le=1_000_000)
    ttl_seconds: int = Field(default=30, ge=1, le=86400)


class SetPressure(_Action):
    kind: Literal["SET_PRESSURE"]
    # A fixed pressure in [0, 1], or "forecast": the predicted fraction at the horizon.
    pressure: float | Literal["forecast"] = "forecast"

    @field_validator("pressure")
    @classmethod
    def _range(cls, value: float | str) -> float | str:
        if isinstance(value, float) and not (0.0 <= value <= 1.0 and math.isfinite(value)):
            raise ValueError("pressure must be in [0, 1] or 'forecast'")
        return value


class FlushCache(_Action):
    kind: Literal["FLUSH_CACHE"]


class AbortLowPriority(_Action):
    kind: Literal["ABORT_LOW_PRIORITY"]
    at_or_below: TierName = "P2"
    max_streams: int = Field(default=8, ge=1, le=100_000)


class PauseAdmission(_Action):
    kind: Literal["PAUSE_ADMISSION"]


class ResumeAdmission(_Action):
    kind: Literal["RESUME_ADMISSION"]


class MigRebalance(_Action):
    kind: Literal["MIG_REBALANCE"]
    scope: Literal["engine", "gpu"] = "gpu"
    # Plans only; the executor applies a MIG change only when dry_run is false.
    dry_run: bool = True


Action = Annotated[
    SetEngineLimits
    | ShedPriority
    | SetPressure
    | FlushCache
    | AbortLowPriority
    | PauseAdmission
    | ResumeAdmission
    | MigRebalance,
    Field(discriminator="kind"),
]


def _one_per_scope(actions: tuple[Action, ...], what: str) -> tuple[Action, ...]:
    scopes = [a.scope for a in actions]
    for scope in set(scopes):
        if scopes.count(scope) > 1:
            raise ValueError(f"{what} has two actions for scope {scope!r}; one command per target at a time")
    return actions


class Rule(_Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    when: Conditions
    then: tuple[Action, ...] = Field(min_length=1)
    on_clear: tuple[Action, ...] = ()
    cooldown_s: float | None = Field(default=None, ge=0.0, le=86400.0)
    target_memory_fraction: float | None = Field(default=None, gt=0.0, le=1.0)

    @field_validator("then", "on_clear", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value

    @field_validator("then")
    @classmethod
    def _then_scopes(cls, value: tuple[Action, ...]) -> tuple[Action, ...]:
        return _one_per_scope(value, "then")

    @field_validator("on_clear")
    @classmethod
    def _clear_scopes(cls, value: tuple[Action, ...]) -> tuple[Action, ...]:
        return _one_per_scope(value, "on_clear")

    @model_validator(mode="after")
    def _clear_needs_state(self) -> Rule:
        if self.on_clear and self.when.on_oom:
            raise ValueError("an on_oom rule has nothing to clear: on_clear is not allowed with on_oom")
        return self

    @model_validator(mode="after")
    def _room_needs_its_condition(self) -> Rule:
        fits_room = any(isinstance(a, SetEngineLimits) and a.fit_kv_room for a in self.then)
        if fits_room and not self.when.kv_room_below_running_cap:
            raise ValueError("fit_kv_room sizes the cap from kv_room_below_running_cap: the rule's when needs it")
        return self


class PolicySpec(_Strict):
    forecast: ForecastSettings = Field(default_factory=ForecastSettings)
    defaults: Defaults = Field(default_factory=Defaults)
    controller: ControllerSettings = Field(default_factory=ControllerSettings)
    promises: Promises = Field(default_factory=Promises)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    step_budget: StepBudgetSettings = Field(default_factory=StepBudgetSettings)
    tiers: Tiers = Field(default_factory=Tiers)
    rules: tuple[Rule, ...] = Field(min_length=1)

    @field_validator("rules")
    @classmethod
    def _unique_names(cls, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
        seen: set[str] = set()
        for rule in rules:
            if rule.name in seen:
                raise ValueError(f"two rules are named {rule.name!r}")
            seen.add(rule.name)
        return rules


@dataclass(frozen=True, slots=True)
class PolicyProblem:
    field: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}" if self.line is not None else "unknown line"
        return f"{where}: {self.field or '(document)'}: {self.message}"


class PolicyError(ValueError):
    def __init__(self, problems: Sequence[PolicyProblem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(str(p) for p in self.problems))


@dataclass(frozen=True, slots=True)
class Policy:
    spec: PolicySpec
    yaml_text: str
    version: int


def _line_of(root: yaml.Node | None, loc: Sequence[int | str]) -> int | None:
    """Line (1-based) of the deepest YAML node the pydantic location reaches."""
    if root is None:
        return None
    node = root
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                    node = value
                    break
            else:
                # Discriminator tags and missing keys: stay on the node that should hold it.
                continue
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if 0 <= part < len(node.value):
                node = node.value[part]
        else:
            break
    return node.start_mark.line + 1


def parse_policy(text: str, version: int = 1) -> Policy:
    """Validate policy YAML; raise PolicyError naming each bad field and its line."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = None if mark is None else mark.line + 1
        raise PolicyError([PolicyProblem("", line, f"not valid YAML: {exc.problem or exc}")]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([PolicyProblem("", None, f"not valid YAML: {exc}")]) from None
    if not isinstance(data, dict):
        line = None if root is None else root.start_mark.line + 1
        raise PolicyError([PolicyProblem("", line, "a policy is a mapping with a 'rules' list")])
    try:
        spec = PolicySpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        errors = exc.errors()
        locs = [tuple(e["loc"]) for e in errors]
        for error in errors:
            loc = tuple(error["loc"])
            # A list emptied by its own bad items says nothing the item errors do not.
            if error["type"] == "too_short" and any(len(o) > len(loc) and o[: len(loc)] == loc for o in locs):
                continue
            shown = ".".join(str(p) for p in loc if not (isinstance(p, str) and p.isupper()))
            problems.append(PolicyProblem(shown, _line_of(root, loc), error["msg"]))
        raise PolicyError(problems) from None
    return Policy(spec=spec, yaml_text=text, version=version)
