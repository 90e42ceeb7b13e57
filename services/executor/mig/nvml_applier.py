"""Apply a MIG plan through NVML: destroy and create GPU and compute instances.

The applier runs only after the executor has drained the instances a plan touches (Envoy stops
routing to them; in-flight streams finish or move). Safety rules:
- dry-run is the default: without `apply=True` it makes no NVML call at all;
- `apply=True` comes from the executor setting SITS_EXECUTOR_MIG_APPLY (see `apply_enabled_from_env`);
- it refuses on a GPU whose MIG mode is off, and never changes MIG mode (there is no call for it here);
- it refuses when a drain step's tenant was not drained, or when the GPU's layout is not the one the
  plan was made from (a stale plan would destroy the wrong instances).
`nvml` is the pynvml module, or `tests/mig/nvml_standin.MigNvmlStandIn` in tests.
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from services.executor.mig.planner import MigInstance, MigLayout, MigPlan, PlanStep
from services.executor.mig.profiles import GpuModel, MigProfile, model_for_device_name

APPLY_SETTING = "SITS_EXECUTOR_MIG_APPLY"
FORMER_APPLY_SETTING = "SITS_MIG_APPLY"  # still read, as ExecutorSettings reads it
_TRUE = frozenset({"1", "true", "yes", "on"})
# Compute slices -> NVML_COMPUTE_INSTANCE_PROFILE_* index (nvml.h); each GPU instance gets one compute
# instance spanning all its slices, as `nvidia-smi mig -cgi ... -C` does.
_CI_PROFILE_FOR_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}

Outcome = Literal["planned", "done", "failed", "not_run"]


def apply_enabled_from_env(env: Mapping[str, str]) -> bool:
    """Whether SITS_EXECUTOR_MIG_APPLY (or its former name) asks for real changes ('1', 'true', 'yes', 'on')."""
    value = env.get(APPLY_SETTING, env.get(FORMER_APPLY_SETTING, ""))
    return value.strip().lower() in _TRUE


class MigApplyRefused(Exception):
    """The applier would not start: nothing was changed."""


class MigApplyFailed(Exception):
    """An NVML call failed part-way; `report` says which steps ran."""

    def __init__(self, message: str, report: ApplyReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class AppliedStep:
    step: PlanStep
    outcome: Outcome
    detail: str = ""
    gi_id: int | None = None

    def to_json(self, model: GpuModel | None = None) -> dict[str, Any]:
        row = self.step.to_json(model)
        row["outcome"] = self.outcome
        if self.detail:
            row["detail"] = self.detail
        if self.gi_id is not None:
            row["gi_id"] = self.gi_id
        return row


@dataclass(frozen=True)
class ApplyReport:
    dry_run: bool
    steps: tuple[AppliedStep, ...]
    layout_after: MigLayout | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


class MigApplier(Protocol):
    """What the executor action needs from an applier."""

    @property
    def applies(self) -> bool: ...

    def preflight(self, plan: MigPlan) -> None: ...

    def execute(self, plan: MigPlan, drained_tenants: Collection[str] = ()) -> ApplyReport: ...


class NvmlMigApplier:
    def __init__(self, nvml: Any, model: GpuModel, device_index: int = 0, *, apply: bool = False) -> None:
        self._nvml = nvml
        self._model = model
        self._device_index = device_index
        self._apply = apply

    @property
    def applies(self) -> bool:
        return self._apply

    # ------------------------------------------------------------ reading

    def read_layout(self, tenants_from: MigLayout | None = None) -> MigLayout:
        """The GPU instances NVML reports now (read-only), tenants copied from `tenants_from` by place."""
        nvml = self._nvml
        nvml.nvmlInit()
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(self._device_index)
            self._require_mig_mode(handle)
            return self._read_layout(handle, tenants_from)
        finally:
            nvml.nvmlShutdown()

    def _read_layout(self, handle: Any, *tenants_from: MigLayout | None) -> MigLayout:
        nvml = self._nvml
        tenant_at: dict[tuple[str, int], str | None] = {}
        for layout in reversed(tenants_from):  # the first layout given wins
            for known in layout.instances if layout is not None else ():
                if known.tenant is not None:
                    tenant_at[(known.profile, known.start)] = known.tenant
        instances = []
        for profile in self._model.profiles:
            for gi in self._gpu_instances(handle, profile):
                info = nvml.nvmlGpuInstanceGetInfo(gi)
                start = int(info.placement.start)
                instances.append(
                    MigInstance(profile.name, start, tenant_at.get((profile.name, start)), gi_id=int(info.id))
                )
        return MigLayout(self._model.key, tuple(instances)).sorted()

    def _gpu_instances(self, handle: Any, profile: MigProfile) -> list[Any]:
        nvml = self._nvml
        info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile.nvml_profile)
        instances = (nvml.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstances(handle, int(info.id), instances, ctypes.pointer(count))
        return [instances[i] for i in range(count.value)]

    def _require_mig_mode(self, handle: Any) -> None:
        current, _pending = self._nvml.nvmlDeviceGetMigMode(handle)
        if int(current) != int(self._nvml.NVML_DEVICE_MIG_ENABLE):
            raise MigApplyRefused(
                f"MIG mode is off on GPU {self._device_index}; SITS never changes MIG mode, so a MIG plan "
                "cannot be applied there (enable MIG in a maintenance window first)"
            )

    # ------------------------------------------------------------ executing

    def execute(self, plan: MigPlan, drained_tenants: Collection[str] = ()) -> ApplyReport:
        if not self._apply:
            return ApplyReport(
                dry_run=True,
                steps=tuple(AppliedStep(s, "planned") for s in plan.steps),
                notes=(f"dry run: set {APPLY_SETTING}=1 to apply",),
            )
        missing = [t for t in plan.drained_tenants() if t not in set(drained_tenants)]
        if missing:
            raise MigApplyRefused(
                f"tenants not drained yet: {', '.join(sorted(missing))}; "
                "the executor drains every instance a plan touches before applying it"
            )
        nvml = self._nvml
        nvml.nvmlInit()
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(self._device_index)
            live = self._check_ready(handle, plan)
            gi_at = {(i.profile, i.start): i.gi_id for i in live.instances}
            done: list[AppliedStep] = []
            for index, step in enumerate(plan.steps):
                try:
                    done.append(self._run_step(handle, step, gi_at))
                except nvml.NVMLError as exc:
                    done.append(AppliedStep(step, "failed", f"NVML: {exc}"))
                    done.extend(AppliedStep(s, "not_run") for s in plan.steps[index + 1 :])
                    after = self._read_layout(handle, plan.target, plan.current)
                    report = ApplyReport(False, tuple(done), after)
                    raise MigApplyFailed(f"{step.action} {step.instance.label()} failed: {exc}", report) from exc
            return ApplyReport(False, tuple(done), self._read_layout(handle, plan.target, plan.current))
        finally:
            nvml.nvmlShutdown()

    def preflight(self, plan: MigPlan) -> None:
        """The read-only checks `execute` makes, so the executor can refuse before draining anyone."""
        if not self._apply:
            return
        nvml = self._nvml
        nvml.nvmlInit()
        try:
            self._check_ready(nvml.nvmlDeviceGetHandleByIndex(self._device_index), plan)
        finally:
            nvml.nvmlShutdown()

    def _check_ready(self, handle: Any, plan: MigPlan) -> MigLayout:
        nvml = self._nvml
        device_name = str(nvml.nvmlDeviceGetName(handle))
        named_model = model_for_device_name(device_name)
        if named_model is not None and named_model.key != self._model.key:
            raise MigApplyRefused(
                f"GPU {self._device_index} is {device_name!r} ({named_model.key}); the plan is for {self._model.key}"
            )
        self._require_mig_mode(handle)
        live = self._read_layout(handle, plan.current)
        if _places(live) != _places(plan.current):
            raise MigApplyRefused(
                "the GPU's layout changed since the plan was made: "
                f"now {[i.label() for i in live.instances]}, "
                f"planned from {[i.label() for i in plan.current.sorted().instances]}"
            )
        return live

    def _run_step(self, handle: Any, step: PlanStep, gi_at: dict[tuple[str, int], int | None]) -> AppliedStep:
        instance = step.instance
        if step.action == "drain":
            return AppliedStep(step, "done", "drained by the executor before the plan was applied")
        if step.action == "assign":
            return AppliedStep(
                step, "done", "tenant label only; no NVML call", gi_id=gi_at.get((instance.profile, instance.start))
            )
        if step.action == "destroy":
            gi_id = gi_at.pop((instance.profile, instance.start), None)
            if gi_id is None:
                raise MigApplyRefused(f"no GPU instance {instance.label()} to destroy")
            self._destroy(handle, gi_id)
            return AppliedStep(step, "done", gi_id=gi_id)
        gi_id = self._create(handle, self._model.profile(instance.profile), instance.start)
        gi_at[(instance.profile, instance.start)] = gi_id
        return AppliedStep(step, "done", gi_id=gi_id)

    def _destroy(self, handle: Any, gi_id: int) -> None:
        nvml = self._nvml
        gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        for ci_profile in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
            try:
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, ci_profile, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except nvml.NVMLError:
                continue  # this compute profile does not exist inside this GPU instance
            instances = (nvml.c_nvmlComputeInstance_t * max(1, int(info.instanceCount)))()
            count = ctypes.c_uint(0)
            nvml.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), instances, ctypes.pointer(count))
            for i in range(count.value):
                nvml.nvmlComputeInstanceDestroy(instances[i])
        nvml.nvmlGpuInstanceDestroy(gi)

    def _create(self, handle: Any, profile: MigProfile, start: int) -> int:
        nvml = self._nvml
        info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile.nvml_profile)
        placement = nvml.c_nvmlGpuInstancePlacement_t()
        placement.start = start
        placement.size = profile.memory_slices
        gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, int(info.id), placement)
        gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
        ci_profile = _CI_PROFILE_FOR_SLICES[profile.compute_slices]
        ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, ci_profile, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        )
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, int(ci_info.id))
        return gi_id


def _places(layout: MigLayout) -> list[tuple[str, int]]:
    return sorted((i.profile, i.start) for i in layout.instances)
