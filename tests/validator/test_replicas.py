"""Two validator replicas over one Redis: a pending watch follows its target to the next owner, and an action
judged by both (a late judge during a move), or by a replica killed between publishing its verdict and recording
it, gets one verdict in the topic, not two."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.validator.audit import AuditStore
from services.validator.domain import Validator
from services.validator.service import ValidatorService, verdicts_on_topic
from sits.runtime.bus import EventProducer, ReceivedEvent, ensure_topics
from sits.runtime.clock import ManualClock
from sits.runtime.contract import format_target_key
from sits.runtime.events import Topics
from sits.runtime.settings import Settings
from sits.v1 import events_pb2
from tests.runtime.test_bus import read_all
from tests.validator.test_service import TARGET, result, sample

KEY = format_target_key(TARGET)


def replica(
    settings: Settings, topics: Topics, redis_client: object, producer: EventProducer, clock: ManualClock
) -> ValidatorService:
    return ValidatorService(
        validator=Validator(),
        audit=AuditStore(redis_client, settings.topic_prefix),  # type: ignore[arg-type]
        producer=producer,
        topics=topics,
        clock=clock,
        settle_overrides={"SHED_PRIORITY": 1.0},
        published_verdict=verdicts_on_topic(settings, topics),
    )


def received(message: events_pb2.ActionResult | events_pb2.MetricSample) -> ReceivedEvent:
    return ReceivedEvent("results", 0, 0, KEY, message, ())


class Killed(BaseException):
    """kill -9 at that line: nothing after it runs."""


async def killed(*_args: object, **_kwargs: object) -> None:
    raise Killed


async def verdicts(settings: Settings, topics: Topics, at_least: int) -> list[events_pb2.ValidationVerdict]:
    # Read a little past what is expected: a second verdict would show up here.
    records = await read_all(settings, topics.validation, at_least + 1, timeout_s=3.0)
    return [events_pb2.ValidationVerdict.FromString(r.value) for r in records]


@pytest.mark.timeout(60)
async def test_a_pending_watch_moves_with_its_target(settings: Settings, topics: Topics, redis_client) -> None:
    await ensure_topics(settings)
    clock = ManualClock(start=time.time())
    async with EventProducer(settings) as producer:
        old = replica(settings, topics, redis_client, producer, clock)
        new = replica(settings, topics, redis_client, producer, clock)
        await old.handle(received(result("moved", clock.now(), watermark=0.9)))
        # The partition is revoked from the old owner before the settle window ends; the new owner resumes it.
        assert old.release(lambda key: key == KEY) == 1
        assert await new.resume(lambda key: key == KEY) == 1
        assert await new.resume(lambda key: key != KEY) == 0
        clock.advance(2.0)
        assert await old.judge_due() == 0
        assert await new.judge_due() == 1
        found = await verdicts(settings, topics, 1)
        assert [v.action_id for v in found] == ["moved"]
        assert await new.resume(lambda key: key == KEY) == 0, "judged: no longer pending in Redis"


@pytest.mark.timeout(60)
async def test_two_replicas_judging_one_action_publish_one_verdict(
    settings: Settings, topics: Topics, redis_client
) -> None:
    await ensure_topics(settings)
    clock = ManualClock(start=time.time())
    async with EventProducer(settings) as producer:
        a = replica(settings, topics, redis_client, producer, clock)
        b = replica(settings, topics, redis_client, producer, clock)
        await a.handle(received(result("both", clock.now(), watermark=0.9)))
        assert await b.resume() == 1
        clock.advance(2.0)
        await asyncio.gather(a.judge_due(), b.judge_due())
        found = await verdicts(settings, topics, 1)
        assert [v.action_id for v in found] == ["both"]


@pytest.mark.timeout(60)
async def test_a_claim_left_by_a_killed_replica_runs_out_and_the_owner_judges(
    settings: Settings, topics: Topics, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("services.validator.audit.CLAIM_TTL_S", 1)
    await ensure_topics(settings)
    clock = ManualClock(start=time.time())
    async with EventProducer(settings) as producer:
        owner = replica(settings, topics, redis_client, producer, clock)
        await owner.handle(received(result("orphan", clock.now(), watermark=0.9)))
        # A replica claimed the verdict and was killed before publishing it.
        assert await AuditStore(redis_client, settings.topic_prefix).claim_verdict("orphan", "verdict-dead")  # type: ignore[arg-type]
        clock.advance(2.0)
        await owner.judge_due()
        assert "orphan" in owner.validator.pending, "still watched while the claim holds"
        await asyncio.sleep(1.5)  # the dead replica's claim runs out
        await owner.judge_due()
        assert "orphan" not in owner.validator.pending
        found = await verdicts(settings, topics, 1)
        assert [v.action_id for v in found] == ["orphan"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("outcome", ["CONFIRMED", "ROLLED_BACK"])
async def test_a_verdict_published_by_a_replica_killed_before_it_finished_is_not_published_again(
    settings: Settings, topics: Topics, redis_client, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    monkeypatch.setattr("services.validator.audit.CLAIM_TTL_S", 1)
    await ensure_topics(settings)
    clock = ManualClock(start=time.time())
    action = f"published-{outcome.lower()}"
    async with EventProducer(settings) as producer:
        dead = replica(settings, topics, redis_client, producer, clock)
        owner = replica(settings, topics, redis_client, producer, clock)
        # Memory stays at 80%: under a 90% watermark the shed is kept, over a 50% one it is rolled back.
        await dead.handle(received(result(action, clock.now(), watermark=0.9 if outcome == "CONFIRMED" else 0.5)))
        for i in range(3):
            await dead.handle(received(sample(clock.now() + i * 0.5, 0.8)))
        assert await owner.resume() == 1
        clock.advance(2.0)
        # The dead replica published its verdict, then was killed: before recording it (a kept shed) or
        # before sending the rollback that follows it (a rolled-back one).
        if outcome == "CONFIRMED":
            monkeypatch.setattr(dead._audit, "record_verdict", killed)
        else:
            monkeypatch.setattr(dead, "_publish_rollback", killed)
        with pytest.raises(Killed):
            await dead.judge_due()
        await asyncio.sleep(1.5)  # its claim runs out
        assert await owner.judge_due() == 1
        assert action not in owner.validator.pending
        found = await verdicts(settings, topics, 1)
        assert [(v.action_id, events_pb2.Verdict.Name(v.verdict)) for v in found] == [(action, f"VERDICT_{outcome}")]
        recorded = await AuditStore(redis_client, settings.topic_prefix).verdict_for_action(action)  # type: ignore[arg-type]
        assert recorded is not None and recorded.verdict == found[0].verdict
        rollbacks = [
            events_pb2.HealingCommand.FromString(r.value).command_id
            for r in await read_all(settings, topics.commands, 2, timeout_s=3.0)
        ]
        assert rollbacks == ([f"rollback-{action}"] if outcome == "ROLLED_BACK" else [])


@pytest.mark.timeout(60)
async def test_a_replica_that_stalled_past_its_claim_does_not_publish_a_second_verdict(
    settings: Settings, topics: Topics, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("services.validator.audit.CLAIM_TTL_S", 1)
    await ensure_topics(settings)
    clock = ManualClock(start=time.time())
    async with EventProducer(settings) as producer:
        stalled = replica(settings, topics, redis_client, producer, clock)
        owner = replica(settings, topics, redis_client, producer, clock)
        await stalled.handle(received(result("stalled", clock.now(), watermark=0.9)))
        assert await owner.resume() == 1
        clock.advance(2.0)
        looked = stalled._earlier_verdict
        resume = asyncio.Event()

        async def stall_after_looking(*args: object) -> object:
            found = await looked(*args)  # type: ignore[arg-type]
            # Claimed, looked on the topic and found nothing; then the process stops (a long pause).
            await resume.wait()
            return found

        monkeypatch.setattr(stalled, "_earlier_verdict", stall_after_looking)
        judging = asyncio.create_task(stalled.judge_due())
        await asyncio.sleep(1.5)  # its claim runs out
        assert await owner.judge_due() == 1
        assert "stalled" not in owner.validator.pending
        resume.set()
        await asyncio.wait_for(judging, 10)
        assert "stalled" in stalled.validator.pending, "not published: its next tick looks again"
        await stalled.judge_due()
        assert "stalled" not in stalled.validator.pending, "the owner's verdict found recorded"
        found = await verdicts(settings, topics, 1)
        assert [v.action_id for v in found] == ["stalled"]
