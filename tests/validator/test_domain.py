"""The validator's judgement, as pure logic on a manual timeline."""

from __future__ import annotations

from services.validator.domain import Outcome, PendingAction, Validator, settle_seconds


def pending(applied_at: float = 100.0, settle: float = 5.0, watermark: float = 0.9) -> PendingAction:
    return PendingAction(
        action_id="a1",
        command_id="c1",
        target_key="h/g//e",
        kind="SHED_PRIORITY",
        applied_at=applied_at,
        settle_until=applied_at + settle,
        watermark=watermark,
    )


def test_memory_under_watermark_at_the_end_of_the_window_confirms() -> None:
    v = Validator()
    p = pending()
    v.expect(p)
    for i, frac in enumerate([0.97, 0.95, 0.9, 0.86, 0.84, 0.83]):
        v.observe_memory("h/g//e", 100.0 + i, frac)
    assert v.due(104.9) == []
    assert v.due(105.0) == [p]
    judgement = v.judge(p)
    assert judgement.outcome is Outcome.CONFIRMED
    memory = next(c for c in judgement.checks if c.name == "memory_below_watermark")
    assert memory.passed and memory.observed == 0.86 and memory.threshold == 0.9


def test_memory_still_above_watermark_rolls_back_with_numbers() -> None:
    v = Validator()
    p = pending(watermark=0.8)
    v.expect(p)
    for i in range(6):
        v.observe_memory("h/g//e", 100.0 + i, 0.93)
    judgement = v.judge(p)
    assert judgement.outcome is Outcome.ROLLED_BACK
    memory = next(c for c in judgement.checks if c.name == "memory_below_watermark")
    assert not memory.passed and memory.observed == 0.93
    assert "93.0%" in memory.detail and "80.0%" in memory.detail


def test_an_oom_in_the_window_rolls_back_even_when_memory_looks_fine() -> None:
    v = Validator()
    p = pending()
    v.expect(p)
    v.observe_memory("h/g//e", 104.0, 0.5)
    v.observe_oom("h/g//e", 102.0)
    v.observe_oom("h/g//e", 99.0)  # before the action: not its fault
    judgement = v.judge(p)
    assert judgement.outcome is Outcome.ROLLED_BACK
    oom = next(c for c in judgement.checks if c.name == "no_oom")
    assert oom.observed == 1.0


def test_p0_latency_and_engine_health_are_checked_when_measured() -> None:
    v = Validator()
    p = pending()
    v.observe_memory("h/g//e", 104.0, 0.5)
    slow = v.judge(p, p0_latency_s=3.5, engine_healthy=True)
    assert slow.outcome is Outcome.ROLLED_BACK
    assert {c.name for c in slow.checks} == {"memory_below_watermark", "no_oom", "p0_latency", "engine_healthy"}
    assert v.judge(p, p0_latency_s=0.2, engine_healthy=True).outcome is Outcome.CONFIRMED
    assert v.judge(p, p0_latency_s=0.2, engine_healthy=False).outcome is Outcome.ROLLED_BACK


def test_nothing_measured_is_inconclusive() -> None:
    v = Validator()
    judgement = v.judge(pending())
    assert judgement.outcome is Outcome.INCONCLUSIVE


def test_redelivered_result_is_watched_once_and_targets_are_bounded() -> None:
    v = Validator(max_targets=3)
    assert v.expect(pending())
    assert not v.expect(pending())
    for i in range(10):
        v.observe_memory(f"t{i}", float(i), 0.5)
    assert len(v._targets) == 3
    assert set(v._targets) == {"t7", "t8", "t9"}


def test_absurd_memory_fractions_are_ignored() -> None:
    v = Validator()
    v.observe_memory("x", 1.0, -0.2)
    v.observe_memory("x", 2.0, 7.0)
    assert len(v.watch("x").samples) == 0


def test_settle_windows_per_kind_with_overrides() -> None:
    assert settle_seconds("MIG_REBALANCE") == 30.0
    assert settle_seconds("SHED_PRIORITY", {"SHED_PRIORITY": 1.5}) == 1.5
    assert settle_seconds("SOMETHING_NEW") == 5.0
