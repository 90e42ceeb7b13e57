"""Wiring of the validator service: settings, Redis, Kafka, gRPC. The work is in services/validator/service.py."""

from __future__ import annotations

import asyncio
import logging

from services.validator.audit import AuditStore
from services.validator.domain import Validator
from services.validator.grpc_api import ValidatorApi
from services.validator.probes import LiveProbes
from services.validator.service import PendingMoves, ValidatorService, verdicts_on_topic
from services.validator.settings import ValidatorSettings
from sits.runtime.clock import SystemClock
from sits.runtime.grpcserver import ServiceBinding
from sits.runtime.lifecycle import run_service
from sits.runtime.service import ServiceApp
from sits.runtime.signing import file_signer
from sits.v1 import validator_pb2, validator_pb2_grpc

SETTINGS = ValidatorSettings
log = logging.getLogger(__name__)


async def serve(settings: ValidatorSettings, stop: asyncio.Event | None = None) -> None:
    # Rollbacks are HealingCommands: signed like the decision's, or executors refuse them.
    signer = file_signer(settings.command_signing_key_file)
    if signer is None:
        log.warning("validator: no SITS_COMMAND_SIGNING_KEY_FILE: rollbacks go out unsigned, and executors refuse them")
    async with ServiceApp("validator", settings, stop) as app:
        producer = await app.producer(signer=signer)
        probes = LiveProbes(
            settings.validator_engines,
            envoy_admin_url=settings.validator_envoy_admin_url,
            p0_cluster=settings.validator_p0_cluster,
            admission_metrics_url=settings.validator_admission_metrics_url,
        )
        app.on_close(probes.close)
        audit = AuditStore(app.redis(), settings.topic_prefix, settings.validator_audit_retention_s)
        service = ValidatorService(
            validator=Validator(),
            audit=audit,
            producer=producer,
            topics=app.topics,
            clock=SystemClock(),
            probes=probes,
            settle_overrides=settings.validator_settle_s,
            published_verdict=verdicts_on_topic(settings, app.topics),
        )
        moves = PendingMoves(service, app.topics.results)
        moves.consumer = await app.consumer(
            [app.topics.results, *app.topics.samples, app.topics.oom],
            service.handle,
            on_assigned=moves.assigned,
            on_revoked=moves.revoked,
            urgent_topics=app.topics.urgent,
        )
        api = ValidatorApi(audit, service.live)
        name = validator_pb2.DESCRIPTOR.services_by_name["Validator"].full_name
        await app.grpc(
            [ServiceBinding(validator_pb2_grpc.add_ValidatorServicer_to_server, api, name)],
            addr=settings.validator_addr,
        )
        await app.run(service.run_judge_loop(app.stop))


def main() -> int:
    return run_service("validator", ValidatorSettings, serve)


if __name__ == "__main__":
    raise SystemExit(main())
