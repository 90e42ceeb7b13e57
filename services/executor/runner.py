"""The executor's work: commands from Kafka through the signature gate, the breaker reconcile loop.

Commands from Kafka pass `CommandGate` first (signature, deadline, replay); the gRPC
Apply/Rollback callers prove themselves with the bearer token, over TLS (mutual
with SITS_GRPC_TLS_REQUIRE_CLIENT_CERT, or Istio's mTLS): a call has no broker in
between that others may write to, so the channel is the proof there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypedDict

import redis.asyncio as aioredis

from services.executor import metrics
from services.executor.adapters.engine import EngineControlClient, VllmEngineClient
from services.executor.adapters.envoy import EnvoyAdmin
from services.executor.adapters.mig import NvmlMigHook
from services.executor.adapters.redis_state import RedisState, StateUnavailable
from services.executor.command_gate import CommandDigests, CommandGate
from services.executor.domain import BreakerPolicy
from services.executor.service import EngineTarget, Executor, InvalidCommand
from services.executor.settings import ExecutorSettings
from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent, find_action_event, partition_of
from sits.runtime.clock import SystemClock
from sits.runtime.events import Topics
from sits.runtime.signing import file_verifier
from sits.v1 import events_pb2

log = logging.getLogger(__name__)
REDIS_PREFIX = "sits:executor:"


class CommandConsumerOptions(TypedDict):
    coalesce: bool
    concurrent_partitions: bool


# How commands are consumed, by the service and by the benchmark that times it: each one handled (none folded
# into a later one), and each partition's handled by a task of its own while the others are fetched on: applying
# mostly waits on Redis, the engine and the broker, and a target's commands keep their order on their partition.
COMMAND_CONSUMER_OPTIONS = CommandConsumerOptions(coalesce=False, concurrent_partitions=True)


def build_executor(
    settings: ExecutorSettings, producer: EventProducer, redis: aioredis.Redis, redis_prefix: str = REDIS_PREFIX
) -> Executor:
    """The executor over its engines; `close_engine_clients` closes their channels."""
    topics = Topics(settings.topic_prefix)

    async def publish(result: events_pb2.ActionResult) -> None:
        await producer.publish(topics.results, result)
        metrics.count_result(result)

    async def result_published(key: str, action_id: str, written_at: float) -> bool:
        found = await find_action_event(settings, topics.results, key, events_pb2.ActionResult, action_id, written_at)
        return found is not None

    targets = {
        name: EngineTarget(
            name=name,
            control=EngineControlClient(endpoints.control_addr),
            engine=VllmEngineClient(endpoints.engine_addr),
            envoy_cluster=endpoints.envoy_cluster,
            gpu_uuid=endpoints.gpu_uuid,
        )
        for name, endpoints in settings.executor_targets.items()
    }
    return Executor(
        state=RedisState(redis, prefix=redis_prefix),
        targets=targets,
        publish=publish,
        clock=SystemClock(),
        envoy=EnvoyAdmin(settings.envoy_admin_url) if settings.envoy_admin_url else None,
        pressure_file=settings.envoy_pressure_file,
        policy=BreakerPolicy(
            closed_max_requests=settings.executor_breaker_closed_max_requests,
            half_open_max_requests=settings.executor_breaker_half_open_max_requests,
            default_ttl_s=settings.executor_breaker_default_ttl_s,
        ),
        lease_ttl_ms=settings.executor_lease_ttl_ms,
        flush_wait_idle_s=settings.executor_flush_wait_idle_s,
        mig=_mig_hook(settings),
        result_published=result_published,
    )


async def close_engine_clients(executor: Executor) -> None:
    """Close the gRPC channels `build_executor` opened to the engines."""
    for target in executor.targets.values():
        await target.control.close()
        await target.engine.close()


def _mig_hook(settings: ExecutorSettings) -> NvmlMigHook | None:
    if not settings.executor_mig_gpus:
        return None
    import pynvml

    return NvmlMigHook(pynvml, settings.executor_mig_gpus, apply=settings.executor_mig_apply)


def command_handler(executor: Executor) -> Callable[[ReceivedEvent], Awaitable[None]]:
    async def handle(event: ReceivedEvent) -> None:
        if not isinstance(event.message, events_pb2.HealingCommand):
            return
        try:
            await executor.handle(event.message)
        except InvalidCommand as error:
            # Bad input is answered, never retried: a REFUSED result, offset committed.
            result = executor.result_for(event.message, events_pb2.ACTION_STATUS_REFUSED, "; ".join(error.reasons))
            await executor.publish(result)
        except StateUnavailable as error:
            log.warning("command %s not applied, offset left uncommitted: %s", event.message.command_id, error)
            raise

    return handle


def command_gate(settings: ExecutorSettings, redis: aioredis.Redis, redis_prefix: str = REDIS_PREFIX) -> CommandGate:
    """The signature, deadline and replay checks in front of `command_handler` (see command_gate.py)."""
    verifier = file_verifier(settings.executor_verify_keys_file)
    if settings.executor_accept_unsigned:
        log.warning("SITS_EXECUTOR_ACCEPT_UNSIGNED: applying commands from Kafka WITHOUT checking signatures")
    elif verifier is None:
        log.error("no SITS_EXECUTOR_VERIFY_KEYS_FILE: every command from Kafka will be dead-lettered (no_keys)")
    else:
        log.info("applying commands signed by key ids %s", verifier.key_ids())
    digests = CommandDigests(redis, prefix=redis_prefix)
    return CommandGate(verifier, digests, SystemClock(), accept_unsigned=settings.executor_accept_unsigned)


class PartitionOwnership:
    """An executor replica reconciles the targets whose commands arrive on the partitions it owns."""

    def __init__(self, consumer: EventConsumer, state: RedisState, topic: str) -> None:
        self._consumer = consumer
        self._state = state
        self._topic = topic

    async def owned(self, names: list[str]) -> set[str]:
        count = self._consumer.partition_count(self._topic)
        mine = self._consumer.owned_partitions(self._topic)
        if not count or not mine:
            return set()  # not in the group yet (or owning nothing): another replica reconciles
        keys = await self._state.target_keys(names)
        # A target never commanded has no key yet: its name places it, so exactly one replica still looks after it.
        return {n for n in names if partition_of(keys.get(n, n), count) in mine}


async def reconcile_loop(executor: Executor, interval_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await executor.reconcile_breakers()
        except Exception:
            log.exception("breaker reconcile failed; will retry")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
