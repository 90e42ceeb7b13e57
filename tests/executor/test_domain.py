"""Executor domain: validation reasons, breaker state machine on a manual clock, restore plans."""

from __future__ import annotations

from typing import Any

import pytest

from services.executor import domain
from services.executor.domain import BreakerPolicy, BreakerState, Limits
from sits.runtime.clock import ManualClock
from sits.runtime.contract import Tier
from sits.runtime.engine_control import priority_tier_of_request_id
from sits.v1 import common_pb2, events_pb2

INFO = domain.EngineInfo(max_num_seqs=32, max_num_batched_tokens=512, block_size=128)
POLICY = BreakerPolicy(closed_max_requests=1000, half_open_max_requests=3, half_open_ttls=1, default_ttl_s=30)


def command(kind: int, engine: str = "vllm-0", **params: object) -> events_pb2.HealingCommand:
    message = events_pb2.HealingCommand(command_id="c-1", kind=kind, **params)  # type: ignore[arg-type]
    message.meta.target.engine = engine
    return message


def limits_command(**fields: Any) -> events_pb2.HealingCommand:
    return command(events_pb2.ACTION_KIND_SET_ENGINE_LIMITS, engine_limits=events_pb2.EngineLimits(**fields))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_num_running_reqs": 0}, "max_num_running_reqs must be >= 1"),
        ({"max_num_running_reqs": -2}, "max_num_running_reqs must be >= 1"),
        ({"max_num_running_reqs": 33}, "max_num_seqs 32"),
        ({"max_num_scheduled_tokens": 127}, "at least one KV block (128 tokens)"),
        ({"max_num_scheduled_tokens": 0}, "at least one KV block"),
        ({"max_num_scheduled_tokens": 1024}, "max_num_batched_tokens 512"),
        ({"max_prefill_chunk_tokens": -1}, "max_prefill_chunk_tokens must be 0 (off) or positive"),
        ({"max_prefill_chunk_tokens": 64}, "at least one KV block (128)"),
        ({"max_num_running_reqs_factor": 0.0}, "max_num_running_reqs_factor must be in (0, 1]"),
        ({"max_num_running_reqs_factor": 1.5}, "max_num_running_reqs_factor must be in (0, 1]"),
    ],
)
def test_out_of_range_limits_have_a_reason(fields: dict[str, float], expected: str) -> None:
    reasons = domain.validate_command(limits_command(**fields), ["vllm-0"], INFO)
    assert any(expected in r for r in reasons), reasons


def test_in_range_limits_pass() -> None:
    cmd = limits_command(max_num_running_reqs=1, max_num_scheduled_tokens=128, max_prefill_chunk_tokens=0)
    assert domain.validate_command(cmd, ["vllm-0"], INFO) == []


def test_unknown_target_kind_and_params_are_refused() -> None:
    flush_elsewhere = command(events_pb2.ACTION_KIND_FLUSH_CACHE, engine="nope")
    assert "unknown target engine 'nope'" in domain.validate_command(flush_elsewhere, ["vllm-0"])[0]
    assert domain.validate_command(command(42), ["vllm-0"]) == ["unknown action kind ACTION_KIND_42"]
    assert "unknown action kind" in domain.validate_command(command(0), ["vllm-0"])[0]
    reasons = domain.validate_command(command(events_pb2.ACTION_KIND_SET_ENGINE_LIMITS), ["vllm-0"])
    assert reasons == ["ACTION_KIND_SET_ENGINE_LIMITS needs params.engine_limits, got none"]
    assert domain.validate_command(command(events_pb2.ACTION_KIND_SET_PRESSURE, pressure=1.5), ["vllm-0"]) == [
        "pressure must be in [0, 1], got 1.5"
    ]
    abort = events_pb2.AbortParams(at_or_below=common_pb2.PRIORITY_P2, max_streams=0)
    assert domain.validate_command(command(events_pb2.ACTION_KIND_ABORT_LOW_PRIORITY, abort=abort), ["vllm-0"]) == [
        "abort.max_streams must be >= 1, got 0"
    ]


def test_stale_command_is_detected_on_the_injected_clock() -> None:
    clock = ManualClock(start=1000.0)
    cmd = limits_command(max_num_running_reqs=2)
    cmd.deadline.FromSeconds(1005)
    assert not domain.is_stale(cmd, clock.now())
    clock.advance(6)
    assert domain.is_stale(cmd, clock.now())


def test_merge_and_pause_resume_limits() -> None:
    current = Limits(32, 512, 0, False)
    change = events_pb2.EngineLimits(max_num_running_reqs=4)
    assert domain.merge_limits(current, change) == Limits(4, 512, 0, False)
    paused = domain.limits_after(events_pb2.ACTION_KIND_PAUSE_ADMISSION, current, command(6))
    assert paused.admission_paused
    assert not domain.limits_after(events_pb2.ACTION_KIND_RESUME_ADMISSION, paused, command(7)).admission_paused


def test_a_cap_factor_is_resolved_against_the_running_count_at_apply_time() -> None:
    current = Limits(32, 512, 0, False)
    kind = events_pb2.ACTION_KIND_SET_ENGINE_LIMITS
    factor = limits_command(max_num_running_reqs_factor=0.75)
    assert domain.validate_command(factor, ["vllm-0"], INFO) == []
    assert domain.limits_after(kind, current, factor, running=10).max_num_running_reqs == 7
    assert domain.limits_after(kind, current, factor, running=1).max_num_running_reqs == 1
    # Nothing running: a fraction of the current cap, never above it.
    assert domain.limits_after(kind, current, factor, running=0).max_num_running_reqs == 24
    assert domain.limits_after(kind, Limits(4, 512, 0, False), factor, running=40).max_num_running_reqs == 4
    # An absolute cap wins over the factor.
    both = limits_command(max_num_running_reqs=5, max_num_running_reqs_factor=0.5)
    assert domain.limits_after(kind, current, both, running=20).max_num_running_reqs == 5


def setting(priority: int, state: int, max_requests: int = 0, ttl: int = 10) -> events_pb2.BreakerSetting:
    return events_pb2.BreakerSetting(
        priority=priority,  # type: ignore[arg-type]
        state=state,  # type: ignore[arg-type]
        max_requests=max_requests,
        ttl_seconds=ttl,
    )


def test_breaker_opens_half_opens_and_closes_with_the_ttl() -> None:
    clock = ManualClock(start=100.0)
    board = domain.apply_breaker_setting(
        domain.BreakerBoard(),
        setting(common_pb2.PRIORITY_P2, events_pb2.BREAKER_STATE_OPEN, 0, 10),
        clock.now(),
        POLICY,
    )
    assert domain.envoy_limits(board, clock.now(), POLICY) == {Tier.P0: 1000, Tier.P1: 1000, Tier.P2: 0}
    clock.advance(9.9)
    assert board.effective(clock.now(), POLICY).get(Tier.P2, POLICY).state is BreakerState.OPEN
    clock.advance(0.2)
    half = board.effective(clock.now(), POLICY).get(Tier.P2, POLICY)
    assert half.state is BreakerState.HALF_OPEN and half.max_requests == 3
    clock.advance(10)
    assert board.effective(clock.now(), POLICY).get(Tier.P2, POLICY).state is BreakerState.CLOSED
    assert domain.envoy_limits(board, clock.now(), POLICY)[Tier.P2] == 1000


def test_p0_is_shed_last_and_admitted_first() -> None:
    now = 0.0
    board = domain.apply_breaker_setting(
        domain.BreakerBoard(), setting(common_pb2.PRIORITY_P1, events_pb2.BREAKER_STATE_OPEN, 5), now, POLICY
    )
    limits = domain.envoy_limits(board, now, POLICY)
    assert limits[Tier.P2] == 5 and limits[Tier.P1] == 5 and limits[Tier.P0] == 1000
    board = domain.apply_breaker_setting(
        board, setting(common_pb2.PRIORITY_P0, events_pb2.BREAKER_STATE_OPEN, 10), now, POLICY
    )
    limits = domain.envoy_limits(board, now, POLICY)
    # Opening P0 never loosens the lower tiers.
    assert limits == {Tier.P0: 10, Tier.P1: 5, Tier.P2: 5}
    board = domain.apply_breaker_setting(
        board, setting(common_pb2.PRIORITY_P1, events_pb2.BREAKER_STATE_CLOSED), now, POLICY
    )
    limits = domain.envoy_limits(board, now, POLICY)
    assert limits[Tier.P0] == 1000 and limits[Tier.P1] == 1000 and limits[Tier.P2] == 5


def test_a_rollback_restores_only_the_fields_its_action_set_and_still_holds() -> None:
    before = Limits(32, 512, 0, False).to_proto()
    after = Limits(8, 256, 0, False).to_proto()
    # Nothing replaced since: both fields go back.
    restored, restore = domain.restore_limits(Limits(8, 256, 0, False), before, after)
    assert restored == Limits(32, 512, 0, False)
    assert len(restore.restored) == 2 and not restore.kept
    # A later action cut the running cap to 4: that field belongs to it now; the token budget still goes back.
    restored, restore = domain.restore_limits(Limits(4, 256, 0, True), before, after)
    assert restored == Limits(4, 512, 0, True)
    assert restore.kept == ("max_num_running_reqs (now 4)",)
    # Fields the action did not change are never touched, whatever they hold now.
    assert domain.restore_limits(Limits(8, 256, 128, True), before, after)[0] == Limits(32, 512, 128, True)


def test_breaker_rollback_is_compare_and_set_per_tier() -> None:
    now = 100.0
    board = domain.apply_breaker_setting(
        domain.BreakerBoard(), setting(common_pb2.PRIORITY_P2, events_pb2.BREAKER_STATE_OPEN, 0, 60), now, POLICY
    )
    before = domain.BreakerBoard().to_proto(now, POLICY)
    after = board.to_proto(now, POLICY)
    # A later action opened P1 too (which also holds P2 at 0): P2 is still as the first action left it.
    later = domain.apply_breaker_setting(
        board, setting(common_pb2.PRIORITY_P1, events_pb2.BREAKER_STATE_OPEN, 2, 60), now, POLICY
    )
    restored, restore = domain.restore_breakers(later, before, after, now, POLICY)
    limits = domain.envoy_limits(restored, now, POLICY)
    assert limits[Tier.P2] == 1000 and limits[Tier.P1] == 2, "P1 belongs to the later action"
    assert [r.startswith("breaker P2") for r in restore.restored] == [True]
    # A later action replaced P2 itself: nothing is restored.
    replaced = domain.apply_breaker_setting(
        board, setting(common_pb2.PRIORITY_P2, events_pb2.BREAKER_STATE_OPEN, 1, 60), now, POLICY
    )
    kept, restore = domain.restore_breakers(replaced, before, after, now, POLICY)
    assert domain.envoy_limits(kept, now, POLICY)[Tier.P2] == 1 and not restore.restored


def test_budget_rollback_only_while_the_budget_is_still_the_actions() -> None:
    now = 50.0
    mine = domain.TierBudgetRecord({Tier.P1: 3, Tier.P2: 0}, until=60.0, command_id="c2", lease_s=5.0)
    before = events_pb2.ActionState(budget=[events_pb2.TierLimit(priority=common_pb2.PRIORITY_P1, max_requests=4)])
    after = events_pb2.ActionState(budget=mine.to_proto())
    limits, restore = domain.restore_budget(mine, before, after, now)
    assert limits == {Tier.P1: 4} and restore.restored
    newer = domain.TierBudgetRecord({Tier.P1: 2, Tier.P2: 0}, until=60.0, command_id="c3", lease_s=5.0)
    limits, restore = domain.restore_budget(newer, before, after, now)
    assert limits == {Tier.P1: 2, Tier.P2: 0} and not restore.restored and restore.kept
    # Expired meanwhile (the defaults are in force): not the action's any more either.
    assert not domain.restore_budget(mine, before, after, now=61.0)[1].restored


def test_direction_of_an_action() -> None:
    loose = events_pb2.ActionState(engine_limits=Limits(32, 512, 0, False).to_proto())
    tight = events_pb2.ActionState(engine_limits=Limits(8, 512, 0, False).to_proto())
    assert domain.direction(loose, tight) == events_pb2.CHANGE_DIRECTION_TIGHTEN
    assert domain.direction(tight, loose) == events_pb2.CHANGE_DIRECTION_LOOSEN
    assert domain.direction(loose, loose) == events_pb2.CHANGE_DIRECTION_NONE
    paused = events_pb2.ActionState(engine_limits=Limits(32, 512, 0, True).to_proto())
    assert domain.direction(loose, paused) == events_pb2.CHANGE_DIRECTION_TIGHTEN
    capped_chunk = events_pb2.ActionState(engine_limits=Limits(32, 512, 256, False).to_proto())
    assert domain.direction(loose, capped_chunk) == events_pb2.CHANGE_DIRECTION_TIGHTEN
    no_budget = events_pb2.ActionState()
    budget = events_pb2.ActionState(budget=[events_pb2.TierLimit(priority=common_pb2.PRIORITY_P2, max_requests=3)])
    assert domain.direction(no_budget, budget) == events_pb2.CHANGE_DIRECTION_TIGHTEN
    assert domain.direction(budget, no_budget) == events_pb2.CHANGE_DIRECTION_LOOSEN
    mixed = events_pb2.ActionState(engine_limits=Limits(8, 1024, 0, False).to_proto())
    assert domain.direction(loose, mixed) == events_pb2.CHANGE_DIRECTION_MIXED


def test_budget_limits_are_checked() -> None:
    ok = events_pb2.TierBudget(lease_seconds=5, limits=[events_pb2.TierLimit(priority=common_pb2.PRIORITY_P2)])
    assert domain.budget_reasons(ok, POLICY) == []
    p0 = events_pb2.TierBudget(lease_seconds=5, limits=[events_pb2.TierLimit(priority=common_pb2.PRIORITY_P0)])
    assert "P0 is never limited" in domain.budget_reasons(p0, POLICY)[0]
    no_lease = events_pb2.TierBudget(limits=[events_pb2.TierLimit(priority=common_pb2.PRIORITY_P1, max_requests=2)])
    assert "lease_seconds" in domain.budget_reasons(no_lease, POLICY)[0]
    huge = events_pb2.TierBudget(
        lease_seconds=5, limits=[events_pb2.TierLimit(priority=common_pb2.PRIORITY_P1, max_requests=10**6)]
    )
    assert "max_requests must be in [0, 1000]" in domain.budget_reasons(huge, POLICY)[0]
    # A budget holds the tier to the tighter of it and its breaker, and only while leased.
    record = domain.TierBudgetRecord({Tier.P2: 2}, until=10.0)
    assert domain.envoy_limits(domain.BreakerBoard(), 5.0, POLICY, record)[Tier.P2] == 2
    assert domain.envoy_limits(domain.BreakerBoard(), 11.0, POLICY, record)[Tier.P2] == 1000


def test_abort_victims_lowest_tier_newest_first() -> None:
    flights = [
        domain.InFlightRequest("p0-a", 0, True, 1.0),
        domain.InFlightRequest("p2-old", 2, True, 1.0),
        domain.InFlightRequest("p2-new", 2, True, 5.0),
        domain.InFlightRequest("p1-a", 1, True, 9.0),
    ]
    assert domain.choose_abort_victims(flights, Tier.P1, 3) == ["p2-new", "p2-old", "p1-a"]
    assert domain.choose_abort_victims(flights, Tier.P2, 10) == ["p2-new", "p2-old"]


@pytest.mark.parametrize(("request_id", "tier"), [("p0-x", 0), ("P1_y", 1), ("p2:z", 2), ("untagged", 2), ("p9-x", 2)])
def test_priority_from_request_id(request_id: str, tier: int) -> None:
    assert priority_tier_of_request_id(request_id) == tier
