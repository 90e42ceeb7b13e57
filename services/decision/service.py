"""The decision service's work: samples and OOM events in, HealingCommands out, the controller's tick.

Commands are published before the consumer commits the sample that caused
them (at-least-once); their command_id is derived from the cause's event id, so
a re-delivered sample yields the same command id and the executor skips it.
The tier controller runs on its own fixed tick (the policy's
`controller.tick_s`), over the latest signals the samples brought; results and
verdicts on its commands come back to it from the executor and the validator.

Replicas share the group SITS_DECISION_GROUP; each ticks only the targets on
the partitions it owns. On a move the per-target state goes through Redis
(services/decision/handover.py) and the new owner rebuilds forecast windows by
reading the last SITS_DECISION_REPLAY_RECORDS records of each metrics partition
again (docs/fleet.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from services.decision import convert, metrics
from services.decision.domain.admission import EngineProfile
from services.decision.domain.engine import ActionOutcome, DecisionEngine
from services.decision.domain.kv_model import ModelShape, known_model, shape_from_hf_config
from services.decision.domain.policy import parse_policy
from services.decision.domain.types import PlannedCommand
from services.decision.handover import HandoverStore
from services.decision.settings import DecisionSettings
from sits.runtime.bus import EventProducer, PartitionFollower, ReceivedEvent
from sits.runtime.clock import Clock, SystemClock
from sits.runtime.contract import ActionKind
from sits.runtime.events import Topics, seconds
from sits.runtime.settings import CommandSigningSettings
from sits.runtime.signing import Signer, file_signer
from sits.v1 import events_pb2

log = logging.getLogger(__name__)


class DecisionHandler:
    """Turns received metric samples and OOM events into published HealingCommands."""

    def __init__(self, engine: DecisionEngine, producer: EventProducer, topics: Topics) -> None:
        self._engine = engine
        self._producer = producer
        self._topics = topics
        self._drops_exported: dict[str, int] = {}
        self._pending: list[asyncio.Future[Any]] = []

    def _export_drops(self) -> None:
        drops = self._engine.drops
        if drops.total() == sum(self._drops_exported.values()):
            return
        for reason, count in drops.as_dict().items():
            metrics.DROPPED_SAMPLES.labels(reason=reason).inc(count - self._drops_exported.get(reason, 0))
        self._drops_exported = drops.as_dict()

    async def __call__(self, event: ReceivedEvent) -> None:
        message = event.message
        if event.replay:
            if isinstance(message, events_pb2.MetricSample):
                self._engine.warm(convert.sample_from_pb(message))
            return
        started = time.perf_counter()
        if isinstance(message, events_pb2.MetricSample):
            sample = convert.sample_from_pb(message)
            commands = self._engine.observe(sample)
            forecast = self._engine.forecast_of(sample.target)
            if forecast is not None:
                metrics.export_forecast(sample.target, forecast, self._engine.policy.spec.forecast.horizon_s)
            if sample.engine is not None and sample.engine.tiers:
                metrics.export_tiers(sample.target.engine, sample.engine.tiers)
            self._export_drops()
        elif isinstance(message, events_pb2.OomEvent):
            commands = self._engine.observe_oom(convert.oom_from_pb(message))
        elif isinstance(message, events_pb2.ValidationVerdict):
            outcome = events_pb2.Verdict.Name(message.verdict).removeprefix("VERDICT_")
            self._engine.observe_verdict(message.command_id, outcome, seconds(message.meta.produced_at))
            return
        elif isinstance(message, events_pb2.ActionResult):
            self._observe_result(message)
            return
        else:
            return
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        # Delivered before the batch's offsets are committed (EventConsumer before_commit).
        await self.publish(commands, wait=False)

    def _observe_result(self, result: events_pb2.ActionResult) -> None:
        status = events_pb2.ActionStatus.Name(result.status).removeprefix("ACTION_STATUS_")
        budget = sum(limit.max_requests for limit in result.after.budget) if result.after.budget else None
        self._engine.observe_result(
            ActionOutcome(
                command_id=result.command_id,
                action_id=result.action_id,
                status=status,
                rolled_back_action_id=result.rolled_back_action_id,
                t=seconds(result.meta.produced_at),
                budget=budget,
            )
        )

    async def tick(self, now: float) -> None:
        commands = self._engine.tick(now)
        metrics.P0_OBJECTIVE.set(self._engine.policy.spec.controller.p0_queue_wait_p90_s)
        for command in commands:
            if command.kind is ActionKind.SET_TIER_BUDGET:
                limits = command.params.get("limits")
                metrics.export_budget(command.target.engine, limits if isinstance(limits, dict) else None)
        await self.publish(commands)

    async def delivered(self) -> None:
        """Wait until every command enqueued since the last call is on the broker (before the samples that
        caused them are committed). Enqueuing instead of waiting per command lets one broker round trip
        carry a whole batch's commands: under a fleet's load that round trip, not CPU, bounds the decision."""
        pending, self._pending = self._pending, []
        if pending:
            await asyncio.gather(*pending)

    async def publish(self, commands: list[PlannedCommand], *, wait: bool = True) -> None:
        deliveries: list[asyncio.Future[Any]] = []
        for command in commands:
            metrics.COMMANDS.labels(kind=command.kind.name.lower(), rule=command.rule).inc()
            if command.reason != "controller renew: lower-tier budget renewed":
                log.info(
                    "command %s %s for %s: %s",
                    command.command_id,
                    command.kind.name,
                    command.target.key,
                    command.reason,
                )
            deliveries.append(await self._producer.enqueue(self._topics.commands, convert.command_to_pb(command)))
        if wait:
            await asyncio.gather(*deliveries)
        else:
            self._pending.extend(deliveries)


def build_engine(settings: DecisionSettings, clock: Clock) -> DecisionEngine:
    policy = parse_policy(settings.decision_policy_file.read_text(), version=1)
    profiles = {engine: EngineProfile(model_shape(model)) for engine, model in settings.decision_engine_models.items()}
    return DecisionEngine(policy, clock, profiles)


def command_signer(settings: CommandSigningSettings, service: str) -> Signer | None:
    """The signer of the commands `service` publishes; None (and a warning) when no key file is set."""
    signer = file_signer(settings.command_signing_key_file)
    if signer is None:
        log.warning(
            "%s: no SITS_COMMAND_SIGNING_KEY_FILE: commands go out unsigned, and executors refuse them", service
        )
    else:
        log.info("%s signs commands with key id %s", service, signer.key_id)
    return signer


def model_shape(model: str) -> ModelShape:
    """A known model's shape, or the shape a Hugging Face config.json names."""
    if model.endswith(".json"):
        return shape_from_hf_config(json.loads(Path(model).read_text()), name=Path(model).parent.name or model)
    return known_model(model)


class PartitionMoves(PartitionFollower):
    """Hands targets over through Redis when the group moves partitions between decision replicas."""

    def __init__(self, engine: DecisionEngine, store: HandoverStore, metrics_topic: str) -> None:
        super().__init__(metrics_topic)
        self._engine = engine
        self._store = store

    async def revoked(self, revoked: set[TopicPartition]) -> None:
        lost = {tp.partition for tp in revoked}
        if not lost:
            return
        handed = self._engine.hand_over(self.keys_in(lost))
        partition = self.partition_counter()
        by_partition: dict[int, dict[str, dict[str, Any]]] = {}
        for key, data in handed.items():
            by_partition.setdefault(partition(key), {})[key] = data
        written = await self._store.put(by_partition)
        log.info("handed over %d target(s) on partition(s) %s", written, sorted(lost))

    async def assigned(self, assigned: set[TopicPartition]) -> None:
        gained = {tp.partition for tp in assigned}
        owned = self.keys_in(gained)
        # Targets of partitions this replica no longer owns (a move it did not see revoked): not ours to tick.
        self._engine.hand_over(lambda key: not owned(key))
        taken = self._engine.take_over(await self._store.take(gained)) if gained else 0
        log.info("assigned partition(s) %s; took over %d target(s)", sorted(gained), taken)


async def run_ticks(handler: DecisionHandler, engine: DecisionEngine, stop: asyncio.Event) -> None:
    """The controller's fixed tick (a policy change takes effect at the next one)."""
    clock = SystemClock()
    while not stop.is_set():
        try:
            await handler.tick(clock.now())
        except Exception:
            log.exception("controller tick failed; next tick retries")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), engine.policy.spec.controller.tick_s)
