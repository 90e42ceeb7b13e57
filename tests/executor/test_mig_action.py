"""MigRebalance through the executor: planned, applied on the NVML stand-in, recorded, rolled back.

The stand-in (MigNvmlStandIn) is used because no real GPU here may be
repartitioned; it enforces NVIDIA's placement rules and pynvml's calls.
"""

from __future__ import annotations

import json

import pytest

from services.executor.adapters.mig import MigGpu, NvmlMigHook
from services.executor.mig.profiles import H200_141GB
from services.executor.service import InvalidCommand
from sits.v1 import events_pb2
from sits_app.stack.vllm_engine import VllmServer
from tests.executor.conftest import Published, healing_command, make_executor
from tests.mig.nvml_standin import MigNvmlStandIn

pytestmark = pytest.mark.vllm
GIB = 1 << 30


def rebalance_command(dry_run: bool, **needs: int) -> events_pb2.HealingCommand:
    return healing_command(
        events_pb2.ACTION_KIND_MIG_REBALANCE,
        mig=events_pb2.MigRebalanceParams(tenant_bytes=needs, dry_run=dry_run),
    )


def instances(layout_json: str) -> list[tuple[str, int, str | None]]:
    return sorted((i["profile"], i["start"], i.get("tenant")) for i in json.loads(layout_json)["instances"])


async def test_mig_rebalance_applies_the_smallest_change_and_rolls_back(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str
) -> None:
    nvml = MigNvmlStandIn([H200_141GB])
    nvml.seed([("3g.71gb", 0), ("1g.18gb", 4)])
    published = Published()
    executor = make_executor(engine_limits_restored, redis_url, redis_prefix, published)
    executor.mig = NvmlMigHook(
        nvml,
        {"vllm-0": MigGpu(model="h200-141gb", tenants={"3g.71gb@0": "chat", "1g.18gb@4": "batch"})},
        apply=True,
        drain=lambda _instance: None,
    )

    planned = await executor.handle(rebalance_command(True, batch=30 * GIB))
    assert planned.status == events_pb2.ACTION_STATUS_APPLIED, planned.detail
    assert nvml.mutating_calls() == [], "a dry run touches nothing"
    assert instances(planned.before.mig_layout_json) == [("1g.18gb", 4, "batch"), ("3g.71gb", 0, "chat")]

    applied = await executor.handle(rebalance_command(False, batch=30 * GIB))
    assert applied.status == events_pb2.ACTION_STATUS_APPLIED, applied.detail
    after = instances(applied.after.mig_layout_json)
    # "chat" keeps its instance untouched; only "batch" moves to a profile with 30 GiB.
    assert ("3g.71gb", 0, "chat") in after
    assert any(p == "1g.35gb" and t == "batch" for p, _s, t in after)

    calls_before = len(nvml.calls)
    with pytest.raises(InvalidCommand) as refusal:
        await executor.handle(rebalance_command(False, batch=200 * GIB))
    assert "batch" in " ".join(refusal.value.reasons), refusal.value.reasons
    assert not [c for c in nvml.calls[calls_before:] if "Create" in c or "Destroy" in c]

    undone = await executor.rollback(applied.action_id, reason="validator said no")
    assert undone.status == events_pb2.ACTION_STATUS_ROLLED_BACK, undone.detail
    assert instances(await executor.mig.layout("vllm-0")) == instances(applied.before.mig_layout_json)
