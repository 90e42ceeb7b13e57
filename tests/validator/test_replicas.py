"""Two validator replicas over one Redis: a pending watch follows its target to the next owner, and an action
judged by both (a late judge during a move) gets one verdict in the topic, not two."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.validator.audit import AuditStore
from services.validator.domain import Validator
from services.validator.service import ValidatorService
from sits.runtime.bus import EventProducer, ReceivedEvent, ensure_topics
from sits.runtime.clock import ManualClock
from sits.runtime.contract import format_target_key
from sits.runtime.events import Topics
from sits.runtime.settings import Settings
from sits.v1 import events_pb2
from tests.runtime.test_bus import read_all
from tests.validator.test_service import TARGET, result

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
    )


def received(message: events_pb2.ActionResult) -> ReceivedEvent:
    return ReceivedEvent("results", 0, 0, KEY, message, ())


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
