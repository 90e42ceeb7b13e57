"""What every executor action is: validate, record before, apply, restore, and which way it moved things.

One module per action kind (or family of kinds) under `services/executor/actions/`;
`services/executor/service.py` keeps only what all share: the per-target lease,
idempotency on command_id, and the published result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from services.executor import domain
from services.executor.adapters.engine import EngineControlClient, MethodUnsupported, VllmEngineClient
from services.executor.adapters.envoy import EnvoyAdmin
from services.executor.adapters.redis_state import RedisState
from sits.runtime.clock import Clock
from sits.v1 import events_pb2


class InvalidCommand(ValueError):
    """The command is out of range or names something unknown; nothing was applied."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


class ActionNotFound(LookupError):
    pass


class NotUndoable(Exception):
    """The action cannot be rolled back; the message says why."""


class Renewal(Exception):
    """The desired state is already in place: only its lease was extended (no action, nothing to validate)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class MigHook(Protocol):
    """MIG re-partitioning (services/executor/mig owns it); returns layouts as JSON."""

    async def layout(self, target: str) -> str: ...

    async def rebalance(self, target: str, params: events_pb2.MigRebalanceParams) -> str: ...

    async def restore(self, target: str, layout_json: str) -> str: ...


@dataclass
class EngineTarget:
    name: str
    control: EngineControlClient
    engine: VllmEngineClient
    envoy_cluster: str = "vllm"
    info: domain.EngineInfo | None = None
    # The GPU the engine runs on: GPU-level commands (engine "") name the GPU, not the engine.
    gpu_uuid: str = ""


async def abort_streams(target: EngineTarget, request_ids: list[str]) -> None:
    """End the streams through the SITS plugin, behind vLLM's gRPC and OpenAI servers alike; through vLLM's
    gRPC Abort where the engine's plugin predates AbortRequests (an executor upgraded before its engines)."""
    try:
        await target.control.abort(request_ids)
    except MethodUnsupported:
        await target.engine.abort(request_ids)


class ActionContext(Protocol):
    """The executor's adapters, as the actions use them."""

    state: RedisState
    clock: Clock
    envoy: EnvoyAdmin | None
    pressure_file: Path | None
    policy: domain.BreakerPolicy
    mig: MigHook | None
    flush_wait_idle_s: float

    async def push_tier_limits(self, target: EngineTarget) -> None: ...


class Action:
    """One action kind's behaviour. Subclasses set `kinds` and override what applies to them."""

    kinds: ClassVar[tuple[int, ...]] = ()
    # Why it cannot be undone (empty: it can).
    not_undoable: ClassVar[str] = ""
    # Whether validating it needs the engine's facts (slot count, token ceiling, block size).
    needs_engine_info: ClassVar[bool] = False

    async def record(self, ctx: ActionContext, target: EngineTarget) -> events_pb2.ActionState:
        """What this action may change, as it is now."""
        return events_pb2.ActionState()

    async def apply(
        self,
        ctx: ActionContext,
        target: EngineTarget,
        command: events_pb2.HealingCommand,
        before: events_pb2.ActionState,
    ) -> str:
        """Carry the command out; returns a detail line ("" lets the state diff speak)."""
        raise NotImplementedError

    async def restore(
        self, ctx: ActionContext, target: EngineTarget, before: events_pb2.ActionState, after: events_pb2.ActionState
    ) -> domain.Restore:
        """Put back what the action changed, where a later action has not replaced it (compare-and-set)."""
        raise NotUndoable(self.not_undoable or "this action cannot be rolled back")
