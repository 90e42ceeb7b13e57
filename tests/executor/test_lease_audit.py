"""The per-target lease under contention, on the real Redis: its audit (stamped with Redis's clock) shows every
grant and release, and two executors never hold one target at once, even when a holder dies without releasing."""

from __future__ import annotations

import asyncio

import pytest

from services.executor.adapters.redis_state import LeaseHeld, RedisState, lease_overlaps
from sits.runtime.redis import connect
from sits.v1 import events_pb2


def test_overlapping_holds_are_found_in_an_audit() -> None:
    clean = ["acquire a:1 1000 500", "release a:1 1200", "acquire b:2 1200 500", "acquire c:3 1701 500"]
    assert lease_overlaps(clean) == []
    # b's lease was never released: it runs to 1700, so c taking it at 1650 would be a double hold.
    assert lease_overlaps([*clean[:3], "acquire c:3 1650 500"]) == [("b:2", "c:3")]
    assert lease_overlaps(["acquire a:1 1000 500", "acquire b:2 1100 500", "release b:2 1150"]) == [("a:1", "b:2")]


async def test_two_executors_racing_for_one_target_never_hold_it_together(redis_url: str, redis_prefix: str) -> None:
    states = [RedisState(connect(redis_url), prefix=redis_prefix) for _ in range(2)]
    target = "vllm-race"
    granted = 0
    refused = 0

    async def worker(state: RedisState, rounds: int) -> None:
        nonlocal granted, refused
        for _ in range(rounds):
            try:
                lease = await state.acquire_lease(target, ttl_ms=200)
            except LeaseHeld:
                refused += 1
                await asyncio.sleep(0.001)
                continue
            granted += 1
            assert await state.lease_is_current(lease)
            await asyncio.sleep(0.002)
            await state.release_lease(lease)

    await asyncio.wait_for(asyncio.gather(*(worker(s, 150) for s in states)), timeout=60)
    # A holder that dies without releasing (kill -9): the next grant comes only after its TTL ran out.
    dead = await states[0].acquire_lease(target, ttl_ms=150)
    with pytest.raises(LeaseHeld):
        await states[1].acquire_lease(target, ttl_ms=150)
    for _ in range(100):
        try:
            await states[1].acquire_lease(target, ttl_ms=150)
            break
        except LeaseHeld:
            await asyncio.sleep(0.02)
    else:
        raise AssertionError("the dead holder's lease never expired")

    audit = await states[0].lease_audit(target)
    grants = [e for e in audit if e.startswith("acquire ")]
    assert granted > 0 and refused > 0, "the two executors did contend"
    assert len(grants) == granted + 2
    assert sum(1 for e in audit if e.startswith("release ")) == granted
    assert any(e.split()[1] == dead.holder for e in grants)
    assert lease_overlaps(audit) == []
    for state in states:
        await state._client.aclose()


async def test_a_lease_taken_for_a_command_says_which_action_applied_it_already(
    redis_url: str, redis_prefix: str
) -> None:
    state = RedisState(connect(redis_url), prefix=redis_prefix)
    target = "vllm-duplicate-check"
    fresh = await state.acquire_lease(target, ttl_ms=2000, command_id="cmd-1")
    assert fresh.applied_action is None
    applied = events_pb2.ActionResult(action_id="act-1", command_id="cmd-1")
    applied.applied_at.FromNanoseconds(1_000_000_000)
    await state.record(target, applied, mark_applied=True)
    await state.release_lease(fresh)

    again = await state.acquire_lease(target, ttl_ms=2000, command_id="cmd-1")
    assert again.applied_action == "act-1"
    # Refused while held: no answer about the command leaks to an executor without the lease.
    with pytest.raises(LeaseHeld):
        await state.acquire_lease(target, ttl_ms=2000, command_id="cmd-1")
    await state.release_lease(again)
    other = await state.acquire_lease(target, ttl_ms=2000, command_id="cmd-2")
    assert other.applied_action is None
    assert (await state.acquire_lease("vllm-no-command", ttl_ms=2000)).applied_action is None
    await state._client.aclose()
