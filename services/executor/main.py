"""Wiring of the executor: Kafka commands in (through the signature gate), ActionResults out, the gRPC API,
breaker TTLs. The work itself is in services/executor/runner.py."""

from __future__ import annotations

import asyncio

from services.executor.grpc_api import MUTATING_METHODS, SERVICE_NAME, ExecutorServicer
from services.executor.runner import (
    COMMAND_CONSUMER_OPTIONS,
    PartitionOwnership,
    build_executor,
    close_engine_clients,
    command_gate,
    command_handler,
    reconcile_loop,
)
from services.executor.settings import ExecutorSettings
from sits.runtime.grpcserver import ServiceBinding
from sits.runtime.lifecycle import run_service
from sits.runtime.service import ServiceApp
from sits.v1 import executor_pb2_grpc

SETTINGS = ExecutorSettings


async def serve(settings: ExecutorSettings, stop: asyncio.Event | None = None) -> None:
    async with ServiceApp("executor", settings, stop) as app:
        producer = await app.producer()
        executor = build_executor(settings, producer, app.redis())
        app.on_close(lambda: close_engine_clients(executor))
        servicer = ExecutorServicer(executor)
        binding = ServiceBinding(executor_pb2_grpc.add_ExecutorServicer_to_server, servicer, SERVICE_NAME)
        await app.grpc([binding], addr=settings.executor_addr, mutating_methods=MUTATING_METHODS)
        consumer = await app.consumer(
            [app.topics.commands],
            command_gate(settings, app.redis()).wrap(command_handler(executor)),
            **COMMAND_CONSUMER_OPTIONS,
        )
        executor.ownership = PartitionOwnership(consumer, executor.state, app.topics.commands)
        await app.run(background=[reconcile_loop(executor, settings.executor_reconcile_interval_s, app.stop)])


def main() -> int:
    return run_service("executor", ExecutorSettings, serve)


if __name__ == "__main__":
    raise SystemExit(main())
