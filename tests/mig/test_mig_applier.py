"""The NVML applier, run against MigNvmlStandIn (no real GPU here may be repartitioned)."""

from __future__ import annotations

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.mig.nvml_applier import (
    MigApplyFailed,
    MigApplyRefused,
    NvmlMigApplier,
    apply_enabled_from_env,
)
from services.executor.mig.planner import (
    MigInstance,
    MigLayout,
    MigPlan,
    parse_layout_spec,
    plan_rebalance,
    validate_layout,
)
from services.executor.mig.profiles import GPU_MODELS, H200_141GB, gpu_model
from tests.mig.nvml_standin import MigNvmlStandIn

GIB = 1 << 30
H200 = "h200-141gb"


def seeded(spec: str, *, mig_enabled: bool = True) -> tuple[MigNvmlStandIn, MigLayout]:
    nvml = MigNvmlStandIn([H200_141GB], mig_enabled=True)
    current = parse_layout_spec(H200, spec)
    ids = nvml.seed([(i.profile, i.start) for i in current.instances])
    current = MigLayout(
        H200,
        tuple(
            MigInstance(i.profile, i.start, i.tenant, gi_id) for i, gi_id in zip(current.instances, ids, strict=True)
        ),
    )
    if not mig_enabled:
        nvml._devices[0].mig_current = pynvml.NVML_DEVICE_MIG_DISABLE
    return nvml, current


def make_plan(current: MigLayout, needs: dict[str, int]) -> MigPlan:
    result = plan_rebalance(current, needs)
    assert isinstance(result, MigPlan), result
    return result


def places(nvml: MigNvmlStandIn) -> list[tuple[str, int]]:
    return [(name, start) for name, start, _gi, _ci in nvml.layout()]


# ------------------------------------------------------------------ the stand-in enforces the rules


def test_stand_in_refuses_placements_the_hardware_refuses() -> None:
    nvml, _ = seeded("3g.71gb@0:a")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    two_g = H200_141GB.profile("2g.35gb")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # not a valid start for 2g
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, two_g.profile_id, pynvml.c_nvmlGpuInstancePlacement_t(1, 2)
        )
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # overlaps the 3g
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, two_g.profile_id, pynvml.c_nvmlGpuInstancePlacement_t(2, 2)
        )
    me = H200_141GB.profile("1g.18gb+me")
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, me.profile_id, pynvml.c_nvmlGpuInstancePlacement_t(4, 1))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # one +me per GPU
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, me.profile_id, pynvml.c_nvmlGpuInstancePlacement_t(5, 1))
    assert places(nvml) == [("1g.18gb+me", 4), ("3g.71gb", 0)]


def test_stand_in_will_not_destroy_an_instance_in_use() -> None:
    nvml, current = seeded("3g.71gb@0:a")
    gi_id = current.instances[0].gi_id
    assert gi_id is not None
    nvml.nvmlInit()
    gi = nvml.nvmlDeviceGetGpuInstanceById(nvml.nvmlDeviceGetHandleByIndex(0), gi_id)
    with pytest.raises(pynvml.NVMLError_InUse):  # its compute instance still exists
        nvml.nvmlGpuInstanceDestroy(gi)
    assert not hasattr(nvml, "nvmlDeviceSetMigMode")


# ------------------------------------------------------------------ the applier


def test_dry_run_is_the_default_and_makes_no_nvml_call() -> None:
    nvml, current = seeded("1g.18gb@4:b,3g.71gb@0:a")
    applier = NvmlMigApplier(nvml, H200_141GB)
    report = applier.execute(make_plan(current, {"b": 20 * GIB}), drained_tenants=["b"])
    assert report.dry_run
    assert [s.outcome for s in report.steps] == ["planned"] * 3
    assert nvml.calls == []
    assert places(nvml) == [("1g.18gb", 4), ("3g.71gb", 0)]


def test_apply_carries_out_the_plan_and_reports_the_new_layout() -> None:
    nvml, current = seeded("3g.71gb@0:a,1g.18gb@4:b,1g.18gb@5:c")
    plan = make_plan(current, {"b": 20 * GIB, "d": 10 * GIB})
    applier = NvmlMigApplier(nvml, H200_141GB, apply=True)
    report = applier.execute(plan, drained_tenants=["b"])
    assert not report.dry_run
    assert [s.outcome for s in report.steps] == ["done"] * len(plan.steps)
    assert sorted(places(nvml)) == sorted((i.profile, i.start) for i in plan.target.instances)
    assert report.layout_after is not None
    assert [i.label() for i in report.layout_after.instances] == [i.label() for i in plan.target.instances]
    # Untouched instances keep their NVML ids: nothing but the plan's instances was recreated.
    ids_before = {(i.profile, i.start): i.gi_id for i in current.instances}
    for kept in plan.kept:
        after = report.layout_after.tenant_instance(kept.tenant) if kept.tenant else None
        assert after is not None and after.gi_id == ids_before[(kept.profile, kept.start)]
    # Every created GPU instance got one compute instance spanning it.
    assert all(ci == 1 for _name, _start, _gi, ci in nvml.layout())


def test_apply_refuses_when_mig_mode_is_off_and_changes_nothing() -> None:
    nvml = MigNvmlStandIn([H200_141GB], mig_enabled=False, device_names=["NVIDIA H200"])
    plan = make_plan(MigLayout(H200), {"a": 10 * GIB})
    applier = NvmlMigApplier(nvml, H200_141GB, apply=True)
    with pytest.raises(MigApplyRefused, match="MIG mode is off"):
        applier.execute(plan)
    assert nvml.mutating_calls() == []


def test_apply_refuses_undrained_tenants_before_touching_nvml() -> None:
    nvml, current = seeded("3g.71gb@0:a,1g.18gb@4:b")
    applier = NvmlMigApplier(nvml, H200_141GB, apply=True)
    with pytest.raises(MigApplyRefused, match="not drained yet: b"):
        applier.execute(make_plan(current, {"b": 20 * GIB}), drained_tenants=[])
    assert nvml.calls == []


def test_apply_refuses_a_stale_plan() -> None:
    nvml, current = seeded("3g.71gb@0:a,1g.18gb@4:b")
    plan = make_plan(current, {"b": 20 * GIB})
    nvml.seed([("1g.18gb", 6)])  # someone changed the GPU after the plan was made
    with pytest.raises(MigApplyRefused, match="layout changed since the plan was made"):
        NvmlMigApplier(nvml, H200_141GB, apply=True).execute(plan, drained_tenants=["b"])
    assert nvml.mutating_calls() == []


def test_apply_refuses_a_plan_for_another_gpu_model() -> None:
    nvml = MigNvmlStandIn([H200_141GB], device_names=["NVIDIA H200"])
    plan = make_plan(MigLayout("a100-40gb"), {"a": GIB})
    with pytest.raises(MigApplyRefused, match="the plan is for a100-40gb"):
        NvmlMigApplier(nvml, gpu_model("a100-40gb"), apply=True).execute(plan)


def test_a_failing_nvml_call_stops_the_plan_and_reports_what_ran() -> None:
    nvml, current = seeded("3g.71gb@0:a,1g.18gb@4:b")
    b_id = current.tenant_instance("b")
    assert b_id is not None and b_id.gi_id is not None
    nvml.start_process(0, b_id.gi_id)  # the drain did not really empty it
    plan = make_plan(current, {"b": 20 * GIB})
    with pytest.raises(MigApplyFailed, match=r"destroy 1g\.18gb@4:b failed") as failure:
        NvmlMigApplier(nvml, H200_141GB, apply=True).execute(plan, drained_tenants=["b"])
    outcomes = [s.outcome for s in failure.value.report.steps]
    assert outcomes == ["done", "failed", "not_run"]
    after = failure.value.report.layout_after
    assert after is not None and [i.label() for i in after.instances] == ["3g.71gb@0:a", "1g.18gb@4:b"]


def test_read_layout_reads_instances_and_keeps_tenant_labels() -> None:
    nvml, current = seeded("3g.71gb@4:a,2g.35gb@0:b,1g.18gb@2")
    read = NvmlMigApplier(nvml, H200_141GB).read_layout(tenants_from=current)
    assert read == current.sorted()
    assert nvml.mutating_calls() == []


def test_apply_setting_comes_from_the_environment() -> None:
    assert apply_enabled_from_env({"SITS_MIG_APPLY": "1"})
    assert apply_enabled_from_env({"SITS_MIG_APPLY": "true"})
    assert not apply_enabled_from_env({"SITS_MIG_APPLY": "0"})
    assert not apply_enabled_from_env({})
    assert apply_enabled_from_env({"SITS_EXECUTOR_MIG_APPLY": "1"})
    assert not apply_enabled_from_env({"SITS_EXECUTOR_MIG_APPLY": "0", "SITS_MIG_APPLY": "1"})


@st.composite
def gpu_cases(draw: st.DrawFn) -> tuple[str, list[tuple[str, int, str | None]], dict[str, int]]:
    gpu = draw(st.sampled_from(sorted(GPU_MODELS)))
    model = gpu_model(gpu)
    chosen: list[tuple[str, int, str | None]] = []
    for n in range(draw(st.integers(0, 8))):
        profile = draw(st.sampled_from(model.profiles))
        start = draw(st.sampled_from(profile.starts))
        tenant = draw(st.one_of(st.none(), st.just(f"t{n}")))
        trial = MigLayout(gpu, tuple(MigInstance(p, s, t) for p, s, t in [*chosen, (profile.name, start, tenant)]))
        if not validate_layout(trial):
            chosen.append((profile.name, start, tenant))
    names = [t for _, _, t in chosen if t] + ["n1", "n2"]
    listed = draw(st.lists(st.sampled_from(names), unique=True))
    fractions = st.sampled_from([0, 0.01, 0.1, 0.12, 0.2, 0.3, 0.5, 0.9])
    needs = {t: int(draw(fractions) * model.largest.memory_bytes) for t in listed}
    return gpu, chosen, needs


@settings(max_examples=150, deadline=None)
@given(gpu_cases())
def test_every_plan_applies_cleanly_on_the_rule_enforcing_stand_in(
    case: tuple[str, list[tuple[str, int, str | None]], dict[str, int]],
) -> None:
    gpu, chosen, needs = case
    model = gpu_model(gpu)
    nvml = MigNvmlStandIn([model])
    ids = nvml.seed([(p, s) for p, s, _ in chosen])
    current = MigLayout(gpu, tuple(MigInstance(p, s, t, i) for (p, s, t), i in zip(chosen, ids, strict=True)))
    result = plan_rebalance(current, needs, move_unlisted=True)
    if not isinstance(result, MigPlan):
        return
    report = NvmlMigApplier(nvml, model, apply=True).execute(result, drained_tenants=result.drained_tenants())
    assert sorted(places(nvml)) == sorted((i.profile, i.start) for i in result.target.instances)
    assert report.layout_after is not None
    assert [(i.profile, i.start, i.tenant) for i in report.layout_after.instances] == [
        (i.profile, i.start, i.tenant) for i in result.target.instances
    ]
