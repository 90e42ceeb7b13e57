"""The step token budget that fits the memory left: the arithmetic, and the rules that move it."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.decision.domain.admission import EngineProfile
from services.decision.domain.engine import DecisionEngine
from services.decision.domain.kv_model import known_model
from services.decision.domain.policy import PolicyError, parse_policy
from services.decision.domain.step_budget import StepBudgetTerms, step_memory
from services.decision.domain.types import (
    AllocatorStats,
    EngineLoad,
    GpuMemory,
    OomEvent,
    ProcessMemory,
    Sample,
)
from sits.runtime.clock import ManualClock
from sits.runtime.contract import ActionKind
from tests.decision.decision_builders import GIB, TARGET, TOTAL

MIB = 1 << 20
GPU_POLICY = Path(__file__).resolve().parents[2] / "scenarios" / "h200_vllm" / "gpu_policy.yaml"
PROFILE = EngineProfile(known_model("llama-3-8b"))
TERMS = StepBudgetTerms(min_tokens=512, reserve_bytes=256 * MIB, allocator_overhead=1.45, fill=0.8, multiple_of=256)
CEILING = 32768


def _engine(budget: int = CEILING) -> EngineLoad:
    return EngineLoad(max_num_seqs=256, token_budget=budget, max_num_batched_tokens=CEILING)


def _gpu(free: int) -> GpuMemory:
    return GpuMemory(TOTAL - free, TOTAL, 0, free, 90.0)


def test_a_full_step_needs_the_estimators_activation_times_the_allocator_overhead() -> None:
    step = step_memory(_gpu(40 * GIB), _engine(), None, PROFILE, TERMS)
    assert step is not None
    shape = PROFILE.shape
    allocated = shape.activation_bytes(CEILING, 256, 2)
    assert step.need(CEILING) == pytest.approx(1.45 * allocated, rel=1e-6)
    # Llama-3-8B: (4 x 4096 + 3 x 14336) x 2 bytes = 116 KiB per token allocated, 168 KiB on the device.
    assert step.per_token_bytes == pytest.approx(1.45 * (4 * 4096 + 3 * 14336) * 2)
    assert step.live_budget == CEILING and step.ceiling == CEILING
    assert step.headroom_bytes == 40 * GIB - 256 * MIB
    assert step.ratio > 5


def test_the_engines_cache_counts_as_headroom_and_the_fit_is_rounded_within_bounds() -> None:
    allocator = AllocatorStats(allocated_bytes=61 * GIB, reserved_bytes=62 * GIB, allocated_floor_bytes=60 * GIB)
    step = step_memory(_gpu(GIB), _engine(), allocator, PROFILE, TERMS)
    assert step is not None
    assert step.reusable_bytes == 2 * GIB
    assert step.headroom_bytes == 3 * GIB - 256 * MIB
    assert step.ratio < 1.0
    fitted = step.fitted(TERMS)
    assert fitted % 256 == 0 and 512 <= fitted < CEILING
    assert step.need(fitted) <= 0.8 * step.headroom_bytes < step.need(fitted + 256)
    # Nothing left: the floor, never zero; plenty left: the engine's own budget, never more.
    empty = step_memory(_gpu(0), _engine(), None, PROFILE, TERMS)
    assert empty is not None and empty.fitted(TERMS) == 512
    roomy = step_memory(_gpu(80 * GIB), _engine(2048), None, PROFILE, TERMS)
    assert roomy is not None and roomy.fitted(TERMS) == CEILING


def test_free_memory_and_the_engines_cache_come_from_one_snapshot_when_the_plugin_reads_both() -> None:
    # NVML (sampled a moment earlier) still says 3 GiB free; in the plugin's snapshot the engine has since
    # grown its cache by 2 GiB, so 1 GiB is free and 2 GiB more is reusable: the same 3 GiB of headroom.
    # Mixing the two readings counts the growth twice here (5 GiB); read in the other order it loses it
    # (1 GiB) and cuts a budget that fits: the second cut seen on the H200.
    grown = AllocatorStats(
        allocated_bytes=60 * GIB, reserved_bytes=62 * GIB, allocated_floor_bytes=60 * GIB, device_free_bytes=GIB
    )
    step = step_memory(_gpu(3 * GIB), _engine(), grown, PROFILE, TERMS)
    assert step is not None and step.headroom_bytes == 3 * GIB - 256 * MIB
    without_snapshot = AllocatorStats(allocated_bytes=60 * GIB, reserved_bytes=62 * GIB, allocated_floor_bytes=60 * GIB)
    mixed = step_memory(_gpu(3 * GIB), _engine(), without_snapshot, PROFILE, TERMS)
    assert mixed is not None and mixed.headroom_bytes == 5 * GIB - 256 * MIB


def test_unknown_figures_give_no_step_memory() -> None:
    assert step_memory(None, _engine(), None, PROFILE, TERMS) is None
    assert step_memory(_gpu(GIB), None, None, PROFILE, TERMS) is None
    assert step_memory(_gpu(GIB), _engine(), None, None, TERMS) is None
    assert step_memory(_gpu(GIB), EngineLoad(max_num_seqs=8), None, PROFILE, TERMS) is None


def test_the_promise_is_the_device_level_a_full_step_at_the_new_budget_brings() -> None:
    allocator = AllocatorStats(allocated_bytes=60 * GIB, reserved_bytes=61 * GIB, allocated_floor_bytes=60 * GIB)
    step = step_memory(_gpu(2 * GIB), _engine(), allocator, PROFILE, TERMS)
    assert step is not None
    fitted = step.fitted(TERMS)
    expected = (TOTAL - 2 * GIB + max(0, step.need(fitted) - GIB) + 256 * MIB) / TOTAL
    assert step.device_fraction_after(fitted, TERMS) == pytest.approx(expected)
    assert step.device_fraction_after(CEILING, TERMS) == 1.0


def test_the_engines_own_promise_is_its_memory_now_plus_one_step_at_the_new_budget() -> None:
    allocator = AllocatorStats(allocated_bytes=60 * GIB, reserved_bytes=61 * GIB, allocated_floor_bytes=60 * GIB)
    step = step_memory(_gpu(2 * GIB), _engine(), allocator, PROFILE, TERMS, engine_used_bytes=62 * GIB)
    assert step is not None
    fitted = step.fitted(TERMS)
    # The cache counts toward the fit, not toward the promise: a fragmented cache may not serve the step.
    assert step.engine_bytes_after(fitted, TERMS) == 62 * GIB + step.need(fitted) + 256 * MIB
    # An engine still running steps at the old budget outgrows it.
    assert step.engine_bytes_after(fitted, TERMS) < 62 * GIB + step.need(CEILING)  # type: ignore[operator]
    unknown = step_memory(_gpu(2 * GIB), _engine(), allocator, PROFILE, TERMS)
    assert unknown is not None and unknown.engine_bytes_after(fitted, TERMS) is None


def test_with_the_engines_processes_reported_a_cut_promises_the_engines_memory_not_the_devices() -> None:
    clock = ManualClock(1_000_000.0)
    engine = _gpu_engine(clock)
    engine_bytes = TOTAL - 40 * GIB
    for seq, (t, free) in enumerate([(0.0, 40 * GIB), (1.0, 2 * GIB)], start=1):
        clock.set(1_000_000.0 + t)
        commands = engine.observe(_sample(t, free, CEILING, seq)[0])
        nvml = Sample(
            TARGET,
            t + 0.01,
            f"g{seq}",
            "nvml",
            seq,
            gpu=_gpu(free),
            processes=(
                ProcessMemory(7, engine_bytes, "VLLM::EngineCore", is_target_engine=True),
                ProcessMemory(8, TOTAL - free - engine_bytes, "co-tenant"),
            ),
        )
        commands += engine.observe(nvml)
    assert [c.rule for c in commands] == ["step-budget-cut"]
    promise = commands[0].promise
    assert promise.gpu_memory_fraction_below is None
    assert promise.engine_memory_bytes_below is not None
    # The engine's memory now, plus a full step at the new budget (under 0.8 of the 2 GiB left), plus the reserve.
    assert engine_bytes + 256 * MIB < promise.engine_memory_bytes_below < engine_bytes + 2 * GIB


def _sample(t: float, free: int, budget: int, seq: int) -> list[Sample]:
    """The engine's report (its live budget), then NVML's."""
    gpu = Sample(TARGET, t + 0.01, f"g{seq}", "nvml", seq, gpu=_gpu(free))
    engine = Sample(
        TARGET,
        t,
        f"e{seq}",
        "engine-control",
        seq,
        engine=_engine(budget),
        allocator=AllocatorStats(allocated_bytes=60 * GIB, reserved_bytes=60 * GIB, allocated_floor_bytes=60 * GIB),
    )
    return [engine, gpu]


def _gpu_engine(clock: ManualClock) -> DecisionEngine:
    policy = parse_policy(GPU_POLICY.read_text())
    return DecisionEngine(policy, clock, {TARGET.engine: PROFILE})


def _feed(engine: DecisionEngine, clock: ManualClock, t: float, free: int, budget: int, seq: int) -> list:  # type: ignore[type-arg]
    clock.set(1_000_000.0 + t)
    out = []
    for sample in _sample(t, free, budget, seq):
        out += engine.observe(sample)
    return out


def test_a_squeeze_cuts_the_budget_to_what_fits_and_a_release_raises_it_again() -> None:
    clock = ManualClock(1_000_000.0)
    engine = _gpu_engine(clock)
    # Plenty free: nothing to do.
    assert _feed(engine, clock, 0.0, 40 * GIB, CEILING, 1) == []
    # A co-tenant leaves 2 GiB: a full 32k step (about 5 GiB on the device) does not fit.
    commands = _feed(engine, clock, 1.0, 2 * GIB, CEILING, 2)
    assert len(commands) == 1
    cut = commands[0]
    assert cut.kind is ActionKind.SET_ENGINE_LIMITS and cut.rule == "step-budget-cut"
    budget = cut.params["max_num_scheduled_tokens"]
    assert isinstance(budget, int) and 512 <= budget < CEILING and budget % 256 == 0
    assert {e.name for e in cut.evidence} >= {"step_headroom_bytes", "step_need_bytes", "step_fitted_budget"}
    assert f"token budget {CEILING} -> {budget}" in cut.reason
    assert cut.promise.engine_alive and cut.promise.no_oom
    assert cut.promise.gpu_memory_fraction_below is not None and cut.promise.gpu_memory_fraction_below < 1.0
    # The engine applied it: nothing more while the memory stays.
    assert _feed(engine, clock, 2.0, 2 * GIB, budget, 3) == []
    # The co-tenant grows again: a second, smaller cut (its cooldown is 1 s).
    again = _feed(engine, clock, 3.5, GIB, budget, 4)
    assert [c.rule for c in again] == ["step-budget-cut"]
    smaller = again[0].params["max_num_scheduled_tokens"]
    assert isinstance(smaller, int) and smaller < budget
    # The co-tenant leaves: the budget goes back up to the engine's own.
    raised = _feed(engine, clock, 20.0, 40 * GIB, smaller, 5)
    assert [c.rule for c in raised] == ["step-budget-raise"]
    assert raised[0].params == {"max_num_scheduled_tokens": CEILING}


def test_no_raise_after_an_oom() -> None:
    clock = ManualClock(1_000_000.0)
    engine = _gpu_engine(clock)
    _feed(engine, clock, 0.0, 40 * GIB, 2048, 1)
    engine.observe_oom(OomEvent(TARGET, 0.5, "oom-1", requested_bytes=GIB, device_free_bytes=0))
    assert [c.rule for c in _feed(engine, clock, 20.0, 40 * GIB, 2048, 2)] == []
    assert [c.rule for c in _feed(engine, clock, 61.0, 40 * GIB, 2048, 3)] == ["step-budget-raise"]


def test_without_the_engines_shape_the_step_rules_stay_quiet() -> None:
    clock = ManualClock(1_000_000.0)
    engine = DecisionEngine(parse_policy(GPU_POLICY.read_text()), clock)
    assert _feed(engine, clock, 1.0, 2 * GIB, CEILING, 1) == []


def test_fit_token_budget_and_a_fixed_budget_are_exclusive() -> None:
    text = """
rules:
  - name: both
    when: {step_headroom_below: 1.0}
    then:
      - kind: SET_ENGINE_LIMITS
        fit_token_budget: true
        max_num_scheduled_tokens: 2048
"""
    with pytest.raises(PolicyError, match="not both"):
        parse_policy(text)
    alone = parse_policy(
        "rules:\n  - name: fit\n    when: {step_headroom_above: 2.0}\n"
        "    then:\n      - {kind: SET_ENGINE_LIMITS, fit_token_budget: true}\n"
    )
    assert alone.spec.rules[0].when.step_headroom_above == 2.0
