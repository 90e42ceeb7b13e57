"""gRPC stubs for every service of an embedded stack, for the tests that call the services' APIs directly."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from sits.v1 import capture_pb2_grpc, decision_pb2_grpc, executor_pb2_grpc, validator_pb2_grpc
from sits_app.stack.embedded import EmbeddedStack


@dataclass(frozen=True)
class ServiceStubs:
    capture: capture_pb2_grpc.CaptureStub
    decision: decision_pb2_grpc.DecisionStub
    executor: executor_pb2_grpc.ExecutorStub
    validator: validator_pb2_grpc.ValidatorStub
    channels: dict[str, grpc.aio.Channel]  # by service name, for other stubs (health) on the same channels


@contextlib.asynccontextmanager
async def service_stubs(stack: EmbeddedStack) -> AsyncIterator[ServiceStubs]:
    """One plaintext channel per service (the stack's own credentials are per call, as metadata); closed on exit."""
    async with (
        grpc.aio.insecure_channel(stack.address_of("capture")) as capture,
        grpc.aio.insecure_channel(stack.address_of("decision")) as decision,
        grpc.aio.insecure_channel(stack.address_of("executor")) as executor,
        grpc.aio.insecure_channel(stack.address_of("validator")) as validator,
    ):
        yield ServiceStubs(
            capture_pb2_grpc.CaptureStub(capture),
            decision_pb2_grpc.DecisionStub(decision),
            executor_pb2_grpc.ExecutorStub(executor),
            validator_pb2_grpc.ValidatorStub(validator),
            {"capture": capture, "decision": decision, "executor": executor, "validator": validator},
        )
