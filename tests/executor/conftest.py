"""Executor test wiring: an Executor on the shared engine, real Redis with a prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from services.executor.adapters.engine import EngineControlClient, VllmEngineClient
from services.executor.adapters.envoy import EnvoyAdmin
from services.executor.adapters.redis_state import RedisState
from services.executor.domain import BreakerPolicy
from services.executor.service import EngineTarget, Executor
from sits.runtime.clock import ManualClock, SystemClock
from sits.runtime.redis import connect
from sits.v1 import events_pb2
from sits_app.stack.vllm_engine import VllmServer
from sits_mesh.policy import Endpoint, MeshPolicy

ENGINE = "vllm-0"


def policy_in_front_of(engine: VllmServer, **fields: Any) -> MeshPolicy:
    """A mesh policy whose Envoy, on free ports, routes to `engine`."""
    host, port = engine.address.rsplit(":", 1)
    return MeshPolicy(
        upstream=Endpoint(address=host, port=int(port)),
        listener=Endpoint(address="127.0.0.1", port=0),
        admin=Endpoint(address="127.0.0.1", port=0),
        **fields,
    )


@dataclass
class Published:
    results: list[events_pb2.ActionResult] = field(default_factory=list)

    async def __call__(self, result: events_pb2.ActionResult) -> None:
        self.results.append(result)


@pytest.fixture
async def redis_prefix(redis_url: str) -> AsyncIterator[str]:
    prefix = f"test:executor:{uuid.uuid4().hex[:10]}:"
    yield prefix
    client = connect(redis_url)
    keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def make_executor(
    engine: VllmServer,
    redis_url: str,
    prefix: str,
    publish: Published,
    *,
    clock: ManualClock | SystemClock | None = None,
    envoy_admin_url: str | None = None,
    pressure_file: Path | None = None,
) -> Executor:
    assert engine.control_address
    target = EngineTarget(
        name=ENGINE, control=EngineControlClient(engine.control_address), engine=VllmEngineClient(engine.address)
    )
    return Executor(
        state=RedisState(connect(redis_url), prefix=prefix),
        targets={ENGINE: target},
        publish=publish,
        clock=clock or SystemClock(),
        envoy=EnvoyAdmin(envoy_admin_url) if envoy_admin_url else None,
        pressure_file=pressure_file,
        policy=BreakerPolicy(closed_max_requests=1000, half_open_max_requests=3, default_ttl_s=30),
    )


def healing_command(kind: int, command_id: str | None = None, **params: object) -> events_pb2.HealingCommand:
    command = events_pb2.HealingCommand(
        command_id=command_id or uuid.uuid4().hex,
        kind=kind,  # type: ignore[arg-type]
        reason="test",
        **params,  # type: ignore[arg-type]
    )
    command.meta.event_id = uuid.uuid4().hex
    command.meta.source = "test"
    command.meta.target.engine = ENGINE
    return command
