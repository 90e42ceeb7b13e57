"""Wiring of the validator service: settings, Redis, Kafka, gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pydantic import Field

from services.validator.audit import AuditStore
from services.validator.domain import Objectives, Validator
from services.validator.grpc_api import ValidatorApi
from services.validator.service import ValidatorService
from sits.runtime.bus import EventConsumer, EventProducer, ensure_topics
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
    validator_p0_latency_objective_s: float = Field(
        2.0, gt=0, le=600, description="P0 time-to-first-token p99 an action must keep."
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
        service = ValidatorService(
            validator=Validator(Objectives(p0_latency_objective_s=settings.validator_p0_latency_objective_s)),
            audit=AuditStore(redis, settings.topic_prefix),
            producer=producer,
            topics=topics,
            clock=SystemClock(),
            settle_overrides=settings.validator_settle_s,
        )
        await service.resume()
        consumer = stack.push_async_exit(
            EventConsumer(
                settings,
                group_id=f"{settings.topic_prefix}sits-validator",
                topics=[topics.results, topics.metrics, topics.oom],
                handler=service.handle,
                dead_letters=producer,
            )
        )
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
