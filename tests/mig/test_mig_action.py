"""The executor's MigRebalance action: state before and after as JSON, refusals with reasons."""

from __future__ import annotations

import json

import pytest

from services.executor.mig.action import MigRebalanceRefused, rebalance, restore
from services.executor.mig.nvml_applier import NvmlMigApplier
from services.executor.mig.planner import MigInstance, MigLayout, parse_layout_spec
from services.executor.mig.profiles import H200_141GB
from tests.mig.nvml_standin import MigNvmlStandIn

GIB = 1 << 30
H200 = "h200-141gb"


def seeded(spec: str) -> tuple[MigNvmlStandIn, MigLayout]:
    nvml = MigNvmlStandIn([H200_141GB], device_names=["NVIDIA H200"])
    layout = parse_layout_spec(H200, spec)
    ids = nvml.seed([(i.profile, i.start) for i in layout.instances])
    return nvml, MigLayout(
        H200, tuple(MigInstance(i.profile, i.start, i.tenant, gi) for i, gi in zip(layout.instances, ids, strict=True))
    )


def test_dry_run_reports_the_plan_and_leaves_the_layout() -> None:
    nvml, current = seeded("3g.71gb@0:a,1g.18gb@4:b")
    applier = NvmlMigApplier(nvml, H200_141GB, apply=True)
    before, after, steps = rebalance(current, {"b": 20 * GIB}, applier, dry_run=True)
    assert before == after
    assert json.loads(before)["instances"][1]["tenant"] == "b"
    assert [(s["action"], s["outcome"]) for s in steps] == [
        ("drain", "planned"),
        ("destroy", "planned"),
        ("create", "planned"),
    ]
    assert nvml.mutating_calls() == []


def test_apply_drains_first_then_changes_only_what_it_must() -> None:
    nvml, current = seeded("3g.71gb@0:a,1g.18gb@4:b,1g.18gb@5:c")
    drained: list[str] = []

    def drain(instance: MigInstance) -> None:
        assert nvml.mutating_calls() == [], "drain must come before any NVML change"
        drained.append(instance.label())

    applier = NvmlMigApplier(nvml, H200_141GB, apply=True)
    before, after, steps = rebalance(current, {"b": 20 * GIB}, applier, dry_run=False, drain=drain)
    assert drained == ["1g.18gb@4:b"]
    after_layout = MigLayout.from_json(json.loads(after))
    assert [i.label() for i in after_layout.instances] == ["3g.71gb@0:a", "1g.18gb@5:c", "1g.35gb@6:b"]
    assert all(s["outcome"] == "done" for s in steps)
    ids = {i.tenant: i.gi_id for i in after_layout.instances}
    assert ids["a"] == current.instances[0].gi_id and ids["c"] == current.instances[2].gi_id
    assert json.loads(before) == current.to_json()


def test_apply_without_the_setting_is_refused() -> None:
    nvml, current = seeded("1g.18gb@4:b")
    with pytest.raises(MigRebalanceRefused, match="SITS_EXECUTOR_MIG_APPLY is off") as refused:
        rebalance(current, {"b": 20 * GIB}, NvmlMigApplier(nvml, H200_141GB), dry_run=False, drain=lambda _i: None)
    assert refused.value.before_json == current.to_json_text()
    assert nvml.mutating_calls() == []


def test_an_impossible_request_is_refused_with_reasons() -> None:
    nvml, current = seeded("3g.71gb@0:a")
    with pytest.raises(MigRebalanceRefused) as refused:
        rebalance(current, {"huge": 200 * GIB}, NvmlMigApplier(nvml, H200_141GB, apply=True), dry_run=False)
    assert "more than any h200-141gb profile gives" in refused.value.reasons[0]


def test_mig_mode_off_is_refused_before_anyone_is_drained() -> None:
    nvml, current = seeded("1g.18gb@4:b")
    nvml._devices[0].mig_current = 0
    drained: list[MigInstance] = []
    with pytest.raises(MigRebalanceRefused, match="MIG mode is off"):
        rebalance(
            current, {"b": 20 * GIB}, NvmlMigApplier(nvml, H200_141GB, apply=True), dry_run=False, drain=drained.append
        )
    assert drained == []
    assert nvml.mutating_calls() == []


def test_restore_returns_to_the_recorded_layout() -> None:
    nvml, current = seeded("3g.71gb@0:a,1g.18gb@4:b,1g.18gb@5:c")
    applier = NvmlMigApplier(nvml, H200_141GB, apply=True)
    before, after, _ = rebalance(current, {"b": 20 * GIB, "d": 10 * GIB}, applier, dry_run=False, drain=lambda _i: None)
    moved = MigLayout.from_json(json.loads(after))
    drained: list[str] = []
    restored_before, restored_after, steps = restore(
        moved, before, applier, dry_run=False, drain=lambda i: drained.append(i.label())
    )
    assert restored_before == after
    assert [(i["profile"], i["start"], i["tenant"]) for i in json.loads(restored_after)["instances"]] == [
        (i["profile"], i["start"], i["tenant"]) for i in json.loads(before)["instances"]
    ]
    assert sorted(drained) == sorted(
        s["profile"] + "@" + str(s["start"]) + ":" + s["tenant"] for s in steps if s["action"] == "drain"
    )
    # a (never moved) was not touched by either direction.
    assert all(s["tenant"] != "a" for s in steps)


def test_restore_of_an_invalid_recorded_layout_is_refused() -> None:
    nvml, current = seeded("3g.71gb@0:a")
    bad = json.dumps({"gpu": H200, "instances": [{"profile": "3g.71gb", "start": 2, "tenant": "a"}]})
    with pytest.raises(MigRebalanceRefused, match="layout to restore is invalid"):
        restore(current, bad, NvmlMigApplier(nvml, H200_141GB, apply=True), dry_run=True)
