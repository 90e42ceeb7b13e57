"""Wiring of the validator service: settings, Redis, Kafka, gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import TopicPartition
from pydantic import Field

from services.validator.audit import AuditStore
from services.validator.domain import Validator
from services.validator.grpc_api import ValidatorApi
from services.validator.probes import LiveProbes
from services.validator.service import ValidatorService
from sits.runtime.bus import EventConsumer, EventProducer, ensure_topics, partition_of
from sits.runtime.clock import SystemClock
from sits.runtime.events import Topics
from sits.runtime.grpc_tls import server_credentials
from sits.runtime.grpcserver import GrpcServer, ServiceBinding
from sits.runtime.metrics import serve_metrics
from sits.runtime.redis import connect_with
from sits.runtime.settings import CommandSigningSettings
from sits.runtime.signing import file_signer
from sits.v1 import validator_pb2, validator_pb2_grpc


class ValidatorSettings(CommandSigningSettings):
    validator_engines: dict[str, str] = Field(
        default_factory=dict,
        description=(
            'Engines whose health the validator checks, as JSON: {"vllm-0": "host:port"} (vLLM gRPC) or '
            '{"vllm-0": "http://host:port"} (vLLM\'s OpenAI server, GET /health).'
        ),
    )
    validator_envoy_admin_url: str = Field(
        "", description="Envoy admin URL: P0 requests refused by its P0 cluster's breaker; empty: not measured."
    )
    validator_p0_cluster: str = Field("vllm_p0", description="The Envoy cluster P0 requests are routed to.")
    validator_admission_metrics_url: str = Field(
        "",
        description="The admission processor's /metrics URL: P0 requests SITS admission refused; empty: not measured.",
    )
    validator_group: str = Field(
        "sits-validator",
        description="Kafka consumer group of the validator replicas (after SITS_TOPIC_PREFIX); each judges the "
        "actions on the targets of the partitions it owns.",
    )
    validator_settle_s: dict[str, float] = Field(
        default_factory=dict,
        description='Settle window per action kind, overriding the defaults (JSON, e.g. {"SHED_PRIORITY": 3}).',
    )


SETTINGS = ValidatorSettings
log = logging.getLogger(__name__)


async def serve(settings: ValidatorSettings, stop: asyncio.Event) -> None:
    topics = Topics(settings.topic_prefix)
    serve_metrics(settings.metrics_port, settings.metrics_bind)
    await ensure_topics(settings)
    redis = connect_with(settings)
    # Rollbacks are HealingCommands: signed like the decision's, or executors refuse them.
    signer = file_signer(settings.command_signing_key_file)
    if signer is None:
        log.warning("validator: no SITS_COMMAND_SIGNING_KEY_FILE: rollbacks go out unsigned, and executors refuse them")
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(redis.aclose)
        producer = await stack.enter_async_context(EventProducer(settings, signer=signer))
        probes = LiveProbes(
            settings.validator_engines,
            envoy_admin_url=settings.validator_envoy_admin_url,
            p0_cluster=settings.validator_p0_cluster,
            admission_metrics_url=settings.validator_admission_metrics_url,
        )
        stack.push_async_callback(probes.close)
        service = ValidatorService(
            validator=Validator(),
            audit=AuditStore(redis, settings.topic_prefix),
            producer=producer,
            topics=topics,
            clock=SystemClock(),
            probes=probes,
            settle_overrides=settings.validator_settle_s,
        )
        moves = PendingMoves(service, topics.results)
        consumer = stack.push_async_exit(
            EventConsumer(
                settings,
                group_id=f"{settings.topic_prefix}{settings.validator_group}",
                topics=[topics.results, topics.metrics, topics.oom],
                handler=service.handle,
                dead_letters=producer,
                on_assigned=moves.assigned,
                on_revoked=moves.revoked,
            )
        )
        moves.consumer = consumer
        api = ValidatorApi(AuditStore(redis, settings.topic_prefix), service.live)
        await stack.enter_async_context(
            GrpcServer(
                [
                    ServiceBinding(
                        validator_pb2_grpc.add_ValidatorServicer_to_server,
                        api,
                        validator_pb2.DESCRIPTOR.services_by_name["Validator"].full_name,
                    )
                ],
                bind=settings.grpc_bind,
                port=settings.port_of(settings.validator_addr),
                max_message_bytes=settings.grpc_max_message_bytes,
                credentials=server_credentials(settings),
            )
        )
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(consumer.run(stop))
            tasks.create_task(service.run_judge_loop(stop))


class PendingMoves:
    """Watches follow their targets' partitions: pending verdicts live in Redis, so a replica that gains a
    partition picks them up there and one that loses it simply stops judging them."""

    def __init__(self, service: ValidatorService, results_topic: str) -> None:
        self._service = service
        self._topic = results_topic
        self.consumer: EventConsumer | None = None

    def _count(self) -> int:
        count = self.consumer.partition_count(self._topic) if self.consumer is not None else None
        return count or 1

    async def revoked(self, revoked: set[TopicPartition]) -> None:
        lost = {tp.partition for tp in revoked}
        count = self._count()
        released = self._service.release(lambda key: partition_of(key, count) in lost)
        log.info("partition(s) %s revoked: %d pending watch(es) left to their next owner", sorted(lost), released)

    async def assigned(self, assigned: set[TopicPartition]) -> None:
        mine = {tp.partition for tp in assigned}
        count = self._count()
        self._service.release(lambda key: partition_of(key, count) not in mine)
        resumed = await self._service.resume(lambda key: partition_of(key, count) in mine)
        log.info("assigned partition(s) %s: %d pending watch(es) resumed", sorted(mine), resumed)
