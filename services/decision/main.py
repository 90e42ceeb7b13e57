"""Wiring of the decision service: Kafka in (metrics, both lanes; OOM, results, verdicts), out (commands), gRPC API.

The work itself is in services/decision/service.py. Every command is signed with
the first key of SITS_COMMAND_SIGNING_KEY_FILE: executors apply no unsigned command.
"""

from __future__ import annotations

import asyncio

from services.decision.grpc_api import MUTATING_METHODS, SERVICE_NAME, DecisionService
from services.decision.handover import HandoverStore
from services.decision.service import DecisionHandler, PartitionMoves, build_engine, command_signer, run_ticks
from services.decision.settings import DEFAULT_POLICY_FILE, DecisionSettings
from sits.runtime.clock import SystemClock
from sits.runtime.grpcserver import ServiceBinding
from sits.runtime.lifecycle import run_service
from sits.runtime.service import ServiceApp
from sits.v1 import decision_pb2_grpc

__all__ = ["DEFAULT_POLICY_FILE", "SETTINGS", "DecisionSettings", "main", "serve"]
SETTINGS = DecisionSettings


async def serve(settings: DecisionSettings, stop: asyncio.Event | None = None) -> None:
    engine = build_engine(settings, SystemClock())
    async with ServiceApp("decision", settings, stop) as app:
        producer = await app.producer(signer=command_signer(settings, "decision"))
        servicer = DecisionService(engine)
        binding = ServiceBinding(decision_pb2_grpc.add_DecisionServicer_to_server, servicer, SERVICE_NAME)
        await app.grpc([binding], addr=settings.decision_addr, mutating_methods=MUTATING_METHODS)
        handler = DecisionHandler(engine, producer, app.topics)
        moves = PartitionMoves(engine, HandoverStore(app.redis(), settings.topic_prefix, app.group), app.topics.metrics)
        moves.consumer = await app.consumer(
            [*app.topics.samples, app.topics.oom, app.topics.results, app.topics.validation],
            handler,
            on_assigned=moves.assigned,
            on_revoked=moves.revoked,
            replay=dict.fromkeys(app.topics.samples, settings.decision_replay_records),
            before_commit=handler.delivered,
            urgent_topics=app.topics.urgent,
        )
        await app.run(run_ticks(handler, engine, app.stop))


def main() -> int:
    return run_service("decision", DecisionSettings, serve)


if __name__ == "__main__":
    raise SystemExit(main())
