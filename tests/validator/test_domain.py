"""The validator's judgement, as pure logic on a manual timeline: each promise, and what a broken one leads to."""

from __future__ import annotations

from services.validator.domain import (
    EngineObservation,
    Outcome,
    PendingAction,
    Probed,
    Promise,
    Validator,
    settle_seconds,
)

KEY = "h/g//e"
P0_OBJECTIVE = Promise(p0_queue_wait_p90_s=0.1, no_p0_refused=True)


def pending(
    kind: str = "SET_TIER_BUDGET",
    direction: str = "TIGHTEN",
    promise: Promise = P0_OBJECTIVE,
    applied_at: float = 100.0,
    settle: float = 6.0,
    refused_at_start: float | None = None,
) -> PendingAction:
    return PendingAction(
        action_id="a1",
        command_id="c1",
        target_key=KEY,
        kind=kind,
        applied_at=applied_at,
        settle_until=applied_at + settle,
        promise=promise,
        direction=direction,
        detail="aborted 3 stream(s)",
        p0_refused_at_start=refused_at_start,
    )


def engine(v: Validator, at: float, p90: float, oldest: float = 0.0, preemptions: int = 0, running: int = 4) -> None:
    v.observe_engine(KEY, EngineObservation(at, p90, oldest, preemptions, running))


def check(judgement, name):  # type: ignore[no-untyped-def]
    return next(c for c in judgement.checks if c.name == name)


def test_a_cut_that_brings_p0_back_within_its_objective_is_confirmed() -> None:
    v = Validator()
    p = pending()
    v.expect(p)
    for i, p90 in enumerate([0.40, 0.30, 0.12, 0.05, 0.04, 0.03, 0.03]):
        engine(v, 100.0 + i, p90)
    assert v.due(105.9) == [] and v.due(106.0) == [p]
    judgement = v.judge(p, Probed(engine_healthy=True))
    assert judgement.outcome is Outcome.CONFIRMED
    objective = check(judgement, "p0_objective")
    assert objective.passed and objective.observed == 0.03 and objective.threshold == 0.1
    assert {c.name for c in judgement.checks} == {"no_oom", "p0_objective", "engine_alive"}


def test_a_cut_that_does_not_bring_p0_back_is_not_kept_and_never_rolled_back() -> None:
    v = Validator()
    p = pending()
    for i in range(7):
        engine(v, 100.0 + i, 0.35, oldest=0.2)
    judgement = v.judge(p, Probed(engine_healthy=True))
    # Rolling a cut back would admit more while P0 already suffers: the decision escalates instead.
    assert judgement.outcome is Outcome.NOT_KEPT
    objective = check(judgement, "p0_objective")
    assert not objective.passed and "350 ms" in objective.detail and "100 ms" in objective.detail


def test_an_increase_that_hurts_p0_is_rolled_back() -> None:
    v = Validator()
    p = pending(direction="LOOSEN")
    for i in range(7):
        engine(v, 100.0 + i, 0.05 if i < 3 else 0.25)
    assert v.judge(p, Probed(engine_healthy=True)).outcome is Outcome.ROLLED_BACK


def test_after_an_oom_a_cut_is_never_rolled_back() -> None:
    # The H200 replay: the decision cut the running cap 16 -> 12, and a CUDA OOM came inside the window.
    v = Validator()
    p = pending(kind="SET_ENGINE_LIMITS", promise=Promise(running_at_most=12, gpu_memory_fraction_below=0.96))
    v.observe_oom(KEY, 103.0)
    v.observe_oom(KEY, 99.0)  # before the action: not its fault
    for i in range(7):
        v.observe_gpu_memory(KEY, 100.0 + i, 0.97)
        engine(v, 100.0 + i, 0.0, running=12)
    judgement = v.judge(p)
    assert judgement.outcome is Outcome.NOT_KEPT
    assert check(judgement, "no_oom").observed == 1.0
    assert not check(judgement, "gpu_memory_below").passed
    assert check(judgement, "running_at_most").passed


def test_gpu_memory_is_judged_on_gpu_samples_only() -> None:
    v = Validator()
    p = pending(kind="SET_ENGINE_LIMITS", promise=Promise(gpu_memory_fraction_below=0.9))
    for i in range(7):
        engine(v, 100.0 + i, 0.0)
    # No NVML sample (a CPU engine, whose KV cache is full by design): the watermark is not measured.
    judgement = v.judge(p)
    assert "gpu_memory_below" not in {c.name for c in judgement.checks}
    for i, fraction in enumerate([0.95, 0.93, 0.91, 0.88, 0.86, 0.85, 0.85]):
        v.observe_gpu_memory(KEY, 100.0 + i, fraction)
    memory = check(v.judge(p), "gpu_memory_below")
    assert memory.passed and memory.observed == 0.88 and memory.threshold == 0.9


def test_a_budget_cut_is_judged_on_the_engines_own_memory_not_on_a_co_tenant_filling_the_device() -> None:
    # The H100 runs of 2026-12-06: after the cut a co-tenant took back all the device freed (99% used),
    # while the engine's own memory stayed where the cut left it. The cut kept its promise.
    gib = 1 << 30
    v = Validator()
    p = pending(kind="SET_ENGINE_LIMITS", promise=Promise(engine_memory_bytes_below=27 * gib))
    for i in range(7):
        engine(v, 100.0 + i, 0.0)
        v.observe_gpu_memory(KEY, 100.0 + i, 0.993)
        v.observe_engine_memory(KEY, 100.0 + i, 26 * gib + i * (1 << 20))
    judgement = v.judge(p, Probed(engine_healthy=True))
    assert judgement.outcome is Outcome.CONFIRMED
    held = check(judgement, "engine_memory_below")
    assert held.passed and held.observed == 26 * gib + 6 * (1 << 20) and held.threshold == 27 * gib
    assert "gpu_memory_below" not in {c.name for c in judgement.checks}
    # The engine itself grew past what a full step at its new budget needs: the cut did not hold.
    v.observe_engine_memory(KEY, 105.5, 28 * gib)
    grown = v.judge(p, Probed(engine_healthy=True))
    assert grown.outcome is Outcome.NOT_KEPT and not check(grown, "engine_memory_below").passed
    # No sample names the engine's processes: the term is not measured.
    quiet = Validator()
    for i in range(7):
        quiet.observe_engine(KEY, EngineObservation(100.0 + i, 0.0, 0.0, 0, 4))
        quiet.observe_engine_memory(KEY, 100.0 + i, 0)
    assert "engine_memory_below" not in {c.name for c in quiet.judge(p).checks}


def test_p0_refusals_are_counted_over_the_window() -> None:
    v = Validator()
    for i in range(7):
        engine(v, 100.0 + i, 0.02)
    p = pending(refused_at_start=12.0)
    assert v.judge(p, Probed(p0_refused=12.0)).outcome is Outcome.CONFIRMED
    refused = v.judge(p, Probed(p0_refused=14.0))
    assert refused.outcome is Outcome.NOT_KEPT and check(refused, "no_p0_refused").observed == 2.0
    # An un-shed that refused P0 (it loosened) is undone.
    loose = pending(direction="LOOSEN", refused_at_start=12.0)
    assert v.judge(loose, Probed(p0_refused=13.0)).outcome is Outcome.ROLLED_BACK


def test_what_cannot_be_undone_is_judged_by_its_effect_and_never_rolled_back() -> None:
    v = Validator()
    p = pending(kind="ABORT_LOW_PRIORITY", direction="LOOSEN", promise=Promise(effect="streams aborted"))
    for i in range(7):
        engine(v, 100.0 + i, 0.0)
    good = v.judge(p, Probed(engine_healthy=True))
    assert good.outcome is Outcome.CONFIRMED and "aborted 3 stream(s)" in check(good, "effect").detail
    v.observe_oom(KEY, 101.0)
    assert v.judge(p, Probed(engine_healthy=True)).outcome is Outcome.NOT_KEPT


def test_an_engine_that_dies_breaks_the_promise() -> None:
    v = Validator()
    p = pending(direction="LOOSEN")
    for i in range(7):
        engine(v, 100.0 + i, 0.01)
    judgement = v.judge(p, Probed(engine_healthy=False))
    assert judgement.outcome is Outcome.ROLLED_BACK and not check(judgement, "engine_alive").passed
    # Without a probe, an engine that stopped reporting half-way did not stay alive.
    quiet = Validator()
    for i in range(2):
        engine(quiet, 100.0 + i, 0.01)
    assert not check(quiet.judge(pending()), "engine_alive").passed


def test_nothing_measured_is_inconclusive() -> None:
    assert Validator().judge(pending()).outcome is Outcome.INCONCLUSIVE


def test_redelivered_result_is_watched_once_and_targets_are_bounded() -> None:
    v = Validator(max_targets=3)
    assert v.expect(pending())
    assert not v.expect(pending())
    for i in range(10):
        v.observe_gpu_memory(f"t{i}", float(i), 0.5)
    assert set(v._targets) == {"t7", "t8", "t9"}


def test_absurd_memory_fractions_are_ignored() -> None:
    v = Validator()
    v.observe_gpu_memory("x", 1.0, -0.2)
    v.observe_gpu_memory("x", 2.0, 7.0)
    assert len(v.watch("x").gpu_memory) == 0


def test_settle_window_follows_the_promise_then_the_kind() -> None:
    assert settle_seconds("SET_TIER_BUDGET", Promise(settle_s=7.5)) == 7.5
    assert settle_seconds("MIG_REBALANCE") == 30.0
    assert settle_seconds("SHED_PRIORITY", None, {"SHED_PRIORITY": 1.5}) == 1.5
    assert settle_seconds("SOMETHING_NEW") == 5.0
