"""The validator's adapters: Kafka in, verdicts and rollback commands out.

Results of applied actions start a watch (persisted in Redis before the
result's offset is committed, so a restart resumes it); samples and OOM events
feed the watched targets; a ticker judges every watch whose settle window has
ended. Verdict and rollback ids derive from the action id, so a redelivered
result can never produce a second verdict or a second rollback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiokafka import TopicPartition
from opentelemetry import context as otel_context
from opentelemetry import trace

from services.validator import metrics
from services.validator.audit import AuditStore
from services.validator.domain import (
    NOT_VALIDATED,
    EngineObservation,
    Judgement,
    Outcome,
    PendingAction,
    Probed,
    Validator,
    settle_seconds,
)
from sits.runtime.bus import EventProducer, PartitionFollower, ReceivedEvent, find_action_event
from sits.runtime.clock import Clock
from sits.runtime.contract import ActionKind, action_kind_name, parse_target_key
from sits.runtime.events import Topics, header_value, new_meta, seconds
from sits.runtime.fanout import Fanout
from sits.runtime.promise import promise_from_pb
from sits.runtime.settings import Settings
from sits.runtime.tracing import current_trace_id, extract_headers
from sits.v1 import common_pb2, events_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sits.validator")

ROLLBACK_DEADLINE_S = 30.0


def rollback_command_id(action_id: str) -> str:
    return f"rollback-{action_id}"


class Probes(Protocol):
    """Live measurements the validator may have for a target; None when not measured."""

    async def p0_refused(self, target_key: str) -> float | None:
        """P0 requests refused so far (a counter: the validator compares two readings)."""
        ...

    async def engine_healthy(self, target_key: str) -> bool | None: ...


class PublishedVerdict(Protocol):
    """The verdict for `action_id` already on the validation topic (target key's partition), written after
    `since_s` (epoch seconds, the writer's clock); None when there is none. Raises when the topic cannot be read."""

    async def __call__(
        self, target_key: str, action_id: str, since_s: float
    ) -> events_pb2.ValidationVerdict | None: ...


def verdicts_on_topic(settings: Settings, topics: Topics) -> PublishedVerdict:
    """Looks for an action's verdict on the validation topic itself."""

    async def published(target_key: str, action_id: str, since_s: float) -> events_pb2.ValidationVerdict | None:
        return await find_action_event(
            settings, topics.validation, target_key, events_pb2.ValidationVerdict, action_id, since_s
        )

    return published


class NoProbes:
    async def p0_refused(self, target_key: str) -> float | None:
        return None

    async def engine_healthy(self, target_key: str) -> bool | None:
        return None


class ValidatorService:
    def __init__(
        self,
        *,
        validator: Validator,
        audit: AuditStore,
        producer: EventProducer,
        topics: Topics,
        clock: Clock,
        probes: Probes | None = None,
        settle_overrides: dict[str, float] | None = None,
        source: str = "validator",
        published_verdict: PublishedVerdict | None = None,
    ) -> None:
        self.validator = validator
        self._audit = audit
        self._producer = producer
        self._topics = topics
        self._clock = clock
        self._probes = probes or NoProbes()
        self._settle_overrides = settle_overrides or {}
        self._source = source
        self._published_verdict = published_verdict
        self._targets: dict[str, common_pb2.Target] = {}
        self.live: Fanout[tuple[str, events_pb2.ValidationVerdict]] = Fanout(buffer=256)
        self.on_verdict: Callable[[events_pb2.ValidationVerdict], Awaitable[None]] | None = None

    async def resume(self, owned: Callable[[str], bool] | None = None) -> int:
        """Reload the watches not judged yet (with `owned`: of the targets it accepts), e.g. those of a
        previous run or of the replica that owned these targets before a move."""
        pending = await self._audit.load_pending(owned)
        for item in pending:
            self.validator.expect(item)
        return len(pending)

    def release(self, owned_elsewhere: Callable[[str], bool]) -> int:
        """Stop watching the targets now owned by another replica; their watches stay in Redis for it."""
        gone = [p.action_id for p in self.validator.pending.values() if owned_elsewhere(p.target_key)]
        for action_id in gone:
            self.validator.forget(action_id)
        return len(gone)

    async def handle(self, event: ReceivedEvent) -> None:
        message = event.message
        if isinstance(message, events_pb2.MetricSample):
            at = seconds(message.meta.produced_at)
            if message.HasField("gpu") and message.gpu.total_bytes > 0:
                self.validator.observe_gpu_memory(event.key, at, message.gpu.used_bytes / message.gpu.total_bytes)
            engine_bytes = sum(p.used_bytes for p in message.processes if p.is_target_engine)
            if engine_bytes > 0:
                self.validator.observe_engine_memory(event.key, at, engine_bytes)
            if message.HasField("engine") and message.engine.tiers:
                self.validator.observe_engine(event.key, engine_observation(message.engine, at))
        elif isinstance(message, events_pb2.OomEvent):
            self.validator.observe_oom(event.key, seconds(message.meta.produced_at))
        elif isinstance(message, events_pb2.ActionResult):
            await self._watch(event, message)

    async def _watch(self, event: ReceivedEvent, result: events_pb2.ActionResult) -> None:
        kind = action_kind_name(result.kind)
        if result.status != events_pb2.ACTION_STATUS_APPLIED or int(result.kind) in NOT_VALIDATED:
            return
        self._targets[event.key] = result.meta.target
        if await self._audit.verdict_for_action(result.action_id) is not None:
            return  # judged before a restart or a redelivery: one verdict per action
        applied_at = seconds(result.applied_at) if result.HasField("applied_at") else seconds(result.meta.produced_at)
        promise = promise_from_pb(result.promise)
        pending = PendingAction(
            action_id=result.action_id,
            command_id=result.command_id,
            target_key=event.key,
            kind=kind,
            applied_at=applied_at,
            settle_until=applied_at + settle_seconds(kind, promise, self._settle_overrides),
            promise=promise,
            direction=events_pb2.ChangeDirection.Name(result.direction).removeprefix("CHANGE_DIRECTION_"),
            detail=result.detail,
            p0_refused_at_start=await self._probes.p0_refused(event.key) if promise.no_p0_refused else None,
            traceparent=header_value(list(event.headers), "traceparent") or "",
        )
        if self.validator.expect(pending):
            await self._audit.save_pending(pending)

    async def judge_due(self) -> int:
        """Judge every watch whose settle window has ended; returns how many."""
        due = self.validator.due(self._clock.now())
        for pending in due:
            probed = Probed(
                engine_healthy=await self._probes.engine_healthy(pending.target_key),
                p0_refused=await self._probes.p0_refused(pending.target_key) if pending.promise.no_p0_refused else None,
            )
            judgement = self.validator.judge(pending, probed)
            parent = extract_headers([("traceparent", pending.traceparent.encode())] if pending.traceparent else [])
            token = otel_context.attach(parent)
            try:
                with tracer.start_as_current_span("validate action", attributes={"sits.action_id": pending.action_id}):
                    concluded = await self._conclude(pending, judgement)
            finally:
                otel_context.detach(token)
            if concluded:
                self.validator.forget(pending.action_id)
        metrics.PENDING.set(len(self.validator.pending))
        return len(due)

    async def _conclude(self, pending: PendingAction, judgement: Judgement) -> bool:
        """Publish and record the verdict; False when it must be tried again later (see the claim)."""
        target = self._targets.get(pending.target_key) or _target_from_key(pending.target_key)
        now = self._clock.now()
        verdict = events_pb2.ValidationVerdict(
            meta=new_meta(self._source, target, now),
            verdict_id=f"verdict-{pending.action_id}",
            action_id=pending.action_id,
            command_id=pending.command_id,
            verdict=events_pb2.Verdict.Value(f"VERDICT_{judgement.outcome.value}"),
            trace_id=current_trace_id(),
            kind=events_pb2.ActionKind.ValueType(ActionKind.parse(pending.kind).to_proto()),
            direction=events_pb2.ChangeDirection.Value(f"CHANGE_DIRECTION_{pending.direction}"),
        )
        verdict.settled_at.FromNanoseconds(int(now * 1e9))
        for check in judgement.checks:
            verdict.checks.add(
                name=check.name,
                passed=check.passed,
                observed=check.observed,
                threshold=check.threshold,
                detail=check.detail,
            )
        # This attempt's own: a replica's claim tells it from another's (and from its own earlier attempts).
        token = f"{verdict.verdict_id}:{uuid.uuid4().hex}"
        if not await self._audit.claim_verdict(pending.action_id, token):
            if await self._audit.verdict_for_action(pending.action_id) is not None:
                log.info("action %s already has a verdict (another replica's); not judged again", pending.action_id)
                return True
            # Claimed and not recorded: another replica is publishing it, or died doing so and its claim runs
            # out. Keep watching; the next tick tries again.
            return False
        found = ""
        try:
            earlier = await self._earlier_verdict(pending, now)
            if earlier is not None:
                # An earlier claimant published it and died (or lost its answer) before recording it: that
                # verdict stands, and its rollback goes out again (the executor applies a command id once).
                verdict, found = earlier, " (an earlier attempt's, found on the topic)"
                if verdict.rollback_command_id:
                    await self._publish_rollback(pending, verdict, target, now)
            elif await self._audit.hold_claim(pending.action_id, token):
                await self._publish_verdict(pending, judgement, verdict, target, now)
            else:
                # Stalled past the claim's life: another replica may have claimed and judged it since, and its
                # verdict stands. Keep watching; the next tick finds it recorded, or claims afresh.
                log.warning("claim on action %s ran out before its verdict went out; not published", pending.action_id)
                return False
        except BaseException:
            await self._audit.unclaim_verdict(pending.action_id, token)
            raise
        outcome = events_pb2.Verdict.Name(verdict.verdict).removeprefix("VERDICT_")
        if await self._audit.record_verdict(verdict, pending.target_key, claimed=True):
            metrics.VERDICTS.labels(kind=pending.kind.lower(), verdict=outcome.lower()).inc()
            self.live.publish((pending.target_key, verdict))
            if self.on_verdict is not None:
                await self.on_verdict(verdict)
        log.info("verdict %s for action %s%s", outcome, pending.action_id, found)
        return True

    async def _earlier_verdict(self, pending: PendingAction, now: float) -> events_pb2.ValidationVerdict | None:
        """The verdict an earlier attempt at this action published, when there was one and it reached the topic."""
        first_at = await self._audit.first_attempt(pending.action_id, now)
        if first_at is None or self._published_verdict is None:
            return None
        return await self._published_verdict(pending.target_key, pending.action_id, first_at)

    async def _publish_verdict(
        self,
        pending: PendingAction,
        judgement: Judgement,
        verdict: events_pb2.ValidationVerdict,
        target: common_pb2.Target,
        now: float,
    ) -> None:
        # The verdict before its rollback: a successor that finds the verdict on the topic sends the rollback
        # again, while a rollback sent without its verdict would leave a successor judging afresh.
        if judgement.outcome is Outcome.ROLLED_BACK:
            verdict.rollback_command_id = rollback_command_id(pending.action_id)
        await self._producer.publish(self._topics.validation, verdict)
        if judgement.outcome is Outcome.ROLLED_BACK:
            await self._publish_rollback(pending, verdict, target, now)
            metrics.ROLLBACKS.labels(kind=pending.kind.lower()).inc()

    async def _publish_rollback(
        self, pending: PendingAction, verdict: events_pb2.ValidationVerdict, target: common_pb2.Target, now: float
    ) -> None:
        rollback = events_pb2.HealingCommand(
            meta=new_meta(self._source, target, now),
            command_id=rollback_command_id(pending.action_id),
            kind=events_pb2.ActionKind.ValueType(ActionKind.ROLLBACK.to_proto()),
            reason="validation failed: " + "; ".join(c.detail for c in verdict.checks if not c.passed),
            cause_event_id=pending.action_id,
        )
        rollback.rollback.action_id = pending.action_id
        rollback.deadline.FromNanoseconds(int((now + ROLLBACK_DEADLINE_S) * 1e9))
        await self._producer.publish(self._topics.commands, rollback)

    async def run_judge_loop(self, stop: asyncio.Event, tick_s: float = 0.1) -> None:
        while not stop.is_set():
            try:
                await self.judge_due()
            except Exception:
                log.exception("judging failed; retrying next tick")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick_s)


def engine_observation(engine: events_pb2.EngineLoad, at: float) -> EngineObservation:
    p0 = next((t for t in engine.tiers if t.priority == common_pb2.PRIORITY_P0), None)
    return EngineObservation(
        at=at,
        p0_queue_wait_p90_s=p0.queue_wait_p90_s if p0 is not None and p0.queue_wait_samples else None,
        p0_oldest_wait_s=p0.oldest_wait_s if p0 is not None else 0.0,
        preemptions=sum(t.preemptions for t in engine.tiers),
        running=engine.num_requests_running,
    )


def _target_from_key(key: str) -> common_pb2.Target:
    try:
        return common_pb2.Target(**parse_target_key(key)._asdict())
    except ValueError:
        # A key from an older writer: keep what it names rather than lose the verdict.
        host, gpu, mig = [*key.split("/"), "", ""][:3]
        return common_pb2.Target(host=host, gpu_uuid=gpu, mig_instance=mig)


class PendingMoves(PartitionFollower):
    """Watches follow their targets' partitions: pending verdicts live in Redis, so a replica that gains a
    partition picks them up there and one that loses it simply stops judging them."""

    def __init__(self, service: ValidatorService, results_topic: str) -> None:
        super().__init__(results_topic)
        self._service = service

    async def revoked(self, revoked: set[TopicPartition]) -> None:
        lost = {tp.partition for tp in revoked}
        released = self._service.release(self.keys_in(lost))
        log.info("partition(s) %s revoked: %d pending watch(es) left to their next owner", sorted(lost), released)

    async def assigned(self, assigned: set[TopicPartition]) -> None:
        partitions = {tp.partition for tp in assigned}
        mine = self.keys_in(partitions)
        self._service.release(lambda key: not mine(key))
        resumed = await self._service.resume(mine)
        log.info("assigned partition(s) %s: %d pending watch(es) resumed", sorted(partitions), resumed)
