"""Handing a target between decision replicas: what travels (latches, cooldowns, the controller's state, the
commands awaiting a verdict) keeps the next owner from acting again on what the last one already did."""

from __future__ import annotations

import json
import math

from aiokafka.partitioner import DefaultPartitioner

from services.decision.domain.controller import BudgetState, Move
from services.decision.domain.engine import DecisionEngine, budget_from_dict, budget_to_dict
from services.decision.domain.policy import Policy
from services.decision.domain.types import Target
from sits.runtime.bus import partition_of
from sits.runtime.clock import ManualClock
from tests.decision.decision_builders import TARGET, make_sample

OTHER = Target("host-b", "GPU-1", "", "vllm-1")
# 30 s steady, then +1%/s from 60%: the default policy's forecast rule fires on the way up.
RAMP = [0.6] * 300 + [0.6 + 0.01 * i / 10 for i in range(300)]


def feed(engine: DecisionEngine, clock: ManualClock, series: list[float], start: int = 0) -> list[str]:
    fired = []
    for i, frac in enumerate(series, start):
        t = i / 10
        clock.set(1_000_000.0 + t)
        fired += [c.command_id for c in engine.observe(make_sample(t, frac, seq=i + 1, event_id=f"e{i}"))]
    return fired


def warm(engine: DecisionEngine, series: list[float]) -> None:
    for i, frac in enumerate(series):
        engine.warm(make_sample(i / 10, frac, seq=i + 1, event_id=f"e{i}"))


def first_fire(policy: Policy) -> int:
    clock = ManualClock(1_000_000.0)
    engine = DecisionEngine(policy, clock)
    for i in range(len(RAMP)):
        if feed(engine, clock, RAMP[i : i + 1], i):
            return i
    raise AssertionError("the ramp never fired the rule")


def test_the_next_owner_does_not_fire_again_what_the_last_one_fired(policy: Policy) -> None:
    cut = first_fire(policy) + 5
    clock = ManualClock(1_000_000.0)
    old = DecisionEngine(policy, clock)
    assert feed(old, clock, RAMP[:cut]), "the old owner acted on the ramp"
    handed = json.loads(json.dumps(old.hand_over(lambda key: key == TARGET.key)))
    assert TARGET.key in handed and old.targets() == []

    # With the handover and the replayed window: the rule is still latched, nothing fires again.
    new = DecisionEngine(policy, clock)
    assert new.take_over(handed) == 1
    warm(new, RAMP[:cut])
    assert new.forecast_of(TARGET) is not None and new.forecast_of(TARGET).time_to_limit_s is not None
    assert feed(new, clock, RAMP[cut : cut + 20], cut) == []

    # Without it (a replica killed -9): the same window makes the next owner act again, which is what the
    # handover saves (the executor's command-id check cannot: these are new commands).
    bare = DecisionEngine(policy, clock)
    warm(bare, RAMP[:cut])
    assert feed(bare, clock, RAMP[cut : cut + 20], cut) != []


def test_hand_over_takes_only_the_targets_owned_elsewhere(engine: DecisionEngine, clock: ManualClock) -> None:
    for target in (TARGET, OTHER):
        engine.observe(make_sample(1.0, 0.5, target=target, seq=1, event_id=f"x-{target.engine}"))
    partitions = 4
    lost = partition_of(OTHER.key, partitions)
    handed = engine.hand_over(lambda key: partition_of(key, partitions) == lost)
    assert OTHER.key in handed
    assert [t.key for t in engine.targets()] == [t.key for t in (TARGET,) if partition_of(t.key, partitions) != lost]


def test_the_controller_state_survives_the_trip_through_json() -> None:
    state = BudgetState(
        budget=6,
        limits={1: 4, 2: 2},
        saturated_ticks=2,
        last_change_t=12.5,
        last_move=Move.DECREASE,
        awaiting_verdict="c-1",
        rate_mark=(3.0, 17),
        history=[(1.0, Move.ENGAGE, 8), (2.0, Move.DECREASE, None)],
    )
    back = budget_from_dict(json.loads(json.dumps(budget_to_dict(state))))
    assert back == state
    assert budget_from_dict(json.loads(json.dumps(budget_to_dict(BudgetState())))).last_change_t == -math.inf


def test_partition_of_is_the_kafka_clients_default_partitioner() -> None:
    # The producer and every replica must agree on a target's partition, or a replica would tick targets it
    # does not own: partition_of must be the client's own default (murmur2) choice.
    partitioner = DefaultPartitioner()
    for i in range(64):
        key = f"host/GPU-{i}//vllm-{i}"
        assert partition_of(key, 4) == partitioner(key.encode(), [0, 1, 2, 3], [0, 1, 2, 3])
    assert {partition_of(f"host/GPU-{i}//vllm-{i}", 4) for i in range(64)} == {0, 1, 2, 3}
