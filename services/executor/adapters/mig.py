"""MIG re-partitioning as an executor action: the executor's MigHook over NVML.

NVML knows GPU instances but not tenants, so the hook remembers the last
layout it saw or made per target and carries tenant names over by placement.
A refusal (impossible request, MIG mode off, applying not enabled) is invalid
input for the command, reported as REFUSED with the planner's reasons.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.executor.actions.base import InvalidCommand
from services.executor.mig.action import Drainer, MigRebalanceRefused, rebalance, restore
from services.executor.mig.nvml_applier import NvmlMigApplier
from services.executor.mig.planner import MigInstance, MigLayout
from services.executor.mig.profiles import gpu_model
from sits.v1 import events_pb2


class MigGpu(BaseModel):
    """The GPU under one executor target, as the MIG hook needs it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="GPU model key, e.g. h200-141gb (see `sits mig profiles`).")
    device_index: int = Field(0, ge=0, description="NVML device index.")
    tenants: dict[str, str] = Field(
        default_factory=dict, description='Tenant of each existing instance, by "profile@start".'
    )


class NvmlMigHook:
    def __init__(self, nvml: Any, gpus: Mapping[str, MigGpu], *, apply: bool, drain: Drainer | None = None) -> None:
        self._nvml = nvml
        self._gpus = dict(gpus)
        self._apply = apply
        self._drain = drain
        self._known: dict[str, MigLayout] = {}

    def _applier(self, target: str) -> NvmlMigApplier:
        gpu = self._gpus.get(target)
        if gpu is None:
            raise InvalidCommand([f"target {target!r} has no MIG GPU configured (SITS_EXECUTOR_MIG_GPUS)"])
        return NvmlMigApplier(self._nvml, gpu_model(gpu.model), gpu.device_index, apply=self._apply)

    def _current(self, target: str) -> MigLayout:
        layout = self._applier(target).read_layout(tenants_from=self._known.get(target))
        if target not in self._known:
            names = self._gpus[target].tenants
            layout = MigLayout(
                layout.gpu,
                tuple(
                    MigInstance(i.profile, i.start, names.get(f"{i.profile}@{i.start}", i.tenant), i.gi_id)
                    for i in layout.instances
                ),
            )
        self._known[target] = layout
        return layout

    async def layout(self, target: str) -> str:
        return (await asyncio.to_thread(self._current, target)).to_json_text()

    async def rebalance(self, target: str, params: events_pb2.MigRebalanceParams) -> str:
        return await asyncio.to_thread(self._carry, target, dict(params.tenant_bytes), params.dry_run, None)

    async def restore(self, target: str, layout_json: str) -> str:
        return await asyncio.to_thread(self._carry, target, None, False, layout_json)

    def _carry(self, target: str, needs: dict[str, int] | None, dry_run: bool, back_to: str | None) -> str:
        applier = self._applier(target)
        current = self._current(target)
        try:
            if back_to is not None:
                _before, after, _steps = restore(current, back_to, applier, dry_run, drain=self._drain)
            else:
                assert needs is not None
                _before, after, _steps = rebalance(current, needs, applier, dry_run, drain=self._drain)
        except MigRebalanceRefused as refusal:
            raise InvalidCommand(list(refusal.reasons)) from refusal
        self._known[target] = MigLayout.from_json(json.loads(after))
        return after
