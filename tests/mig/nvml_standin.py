"""MigNvmlStandIn: an in-process stand-in for the pynvml MIG calls the applier makes.

It is a STAND-IN, not a real GPU: no GPU reachable from this project may be repartitioned (the H200
machine's MIG mode must never change), so the applier is tested against this object instead. It keeps
pynvml's call shapes and semantics so the same applier code runs against both:

- handles for GPU and compute instances are ctypes pointers (pynvml.c_nvmlGpuInstance_t /
  c_nvmlComputeInstance_t), so they fit in the ctypes arrays that nvmlDeviceGetGpuInstances and
  nvmlGpuInstanceGetComputeInstances fill; they are never dereferenced;
- failures raise pynvml.NVMLError subclasses with NVML's codes;
- count/array out-parameters are filled through ctypes pointers, as the C library does.

Rules it enforces (the real placement rules, from the built-in profile tables):
- creating anything needs MIG mode on (NVML_ERROR_NOT_SUPPORTED otherwise; the applier refuses
  before it gets here);
- a GPU instance must use one of its profile's possible placements (NVML_ERROR_INVALID_ARGUMENT), must
  not overlap occupied memory slices, and must stay within the profile's instance limit and the GPU's
  compute slices (NVML_ERROR_INSUFFICIENT_RESOURCES);
- a GPU instance that still has compute instances, or a compute instance with processes on it,
  cannot be destroyed (NVML_ERROR_IN_USE).
It has no nvmlDeviceSetMigMode at all: nothing may call it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml

from services.executor.mig.profiles import GpuModel, MigProfile

# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices (nvml.h).
_CI_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6, 7: 1}
_GI_BASE = 0x5170_0000
_CI_BASE = 0x5171_0000
_SUCCESS: int = 0  # NVML_SUCCESS


@dataclass
class _ComputeInstance:
    id: int
    profile_id: int
    start: int
    slices: int
    processes: int = 0


@dataclass
class _GpuInstance:
    id: int
    profile: MigProfile
    start: int
    compute_instances: dict[int, _ComputeInstance] = field(default_factory=dict)
    next_ci_id: int = 0


@dataclass
class _Device:
    index: int
    model: GpuModel
    name: str
    mig_current: int
    mig_pending: int
    gpu_instances: dict[int, _GpuInstance] = field(default_factory=dict)
    next_gi_id: int = 1


@dataclass(frozen=True)
class _DeviceHandle:
    index: int


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class MigNvmlStandIn:
    """Stand-in for the pynvml module's MIG calls on one or more simulated GPUs."""

    NVMLError = pynvml.NVMLError
    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_DEVICE_MIG_DISABLE = pynvml.NVML_DEVICE_MIG_DISABLE
    NVML_GPU_INSTANCE_PROFILE_COUNT = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    NVML_ERROR_IN_USE = pynvml.NVML_ERROR_IN_USE
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
    NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_INSUFFICIENT_RESOURCES = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t
    c_nvmlGpuInstance_t = pynvml.c_nvmlGpuInstance_t
    c_nvmlComputeInstance_t = pynvml.c_nvmlComputeInstance_t

    def __init__(
        self, models: list[GpuModel], *, mig_enabled: bool = True, device_names: list[str] | None = None
    ) -> None:
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        names = device_names or [f"NVIDIA {m.key.upper()} (MigNvmlStandIn)" for m in models]
        self._devices = [_Device(i, m, names[i], mode, mode) for i, m in enumerate(models)]
        self.calls: list[str] = []
        self._initialized = 0

    # ------------------------------------------------------------ helpers for tests

    def mutating_calls(self) -> list[str]:
        mutating = ("Create", "Destroy", "SetMigMode")
        return [c for c in self.calls if any(m in c for m in mutating)]

    def seed(self, instances: list[tuple[str, int]], device_index: int = 0) -> list[int]:
        """Create GPU instances (profile name, start), each with a full compute instance, through the
        same rule-enforcing calls the applier uses; returns their GPU-instance ids."""
        handle = _DeviceHandle(device_index)
        self._initialized += 1
        try:
            ids = []
            for name, start in instances:
                profile = self._devices[device_index].model.profile(name)
                placement = pynvml.c_nvmlGpuInstancePlacement_t(start, profile.memory_slices)
                gi = self.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile.profile_id, placement)
                ci_profile = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[profile.compute_slices]
                self.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
                ids.append(int(self.nvmlGpuInstanceGetInfo(gi).id))
            return ids
        finally:
            self._initialized -= 1
            self.calls.clear()

    def start_process(self, device_index: int, gi_id: int) -> None:
        """Put a process on the first compute instance of a GPU instance (it then cannot be destroyed)."""
        gi = self._devices[device_index].gpu_instances[gi_id]
        if not gi.compute_instances:
            raise ValueError(f"GPU instance {gi_id} has no compute instance to run on")
        next(iter(gi.compute_instances.values())).processes += 1

    def layout(self, device_index: int = 0) -> list[tuple[str, int, int, int]]:
        """(profile, start, gi_id, compute instances) per GPU instance, sorted by start."""
        device = self._devices[device_index]
        return sorted(
            (gi.profile.name, gi.start, gi.id, len(gi.compute_instances)) for gi in device.gpu_instances.values()
        )

    # ------------------------------------------------------------ handle plumbing

    def _record(self, name: str) -> None:
        self.calls.append(name)
        if self._initialized <= 0 and name not in ("nvmlInit",):
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: Any) -> _Device:
        if not isinstance(handle, _DeviceHandle) or not 0 <= handle.index < len(self._devices):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._devices[handle.index]

    @staticmethod
    def _address(handle: Any) -> int:
        value = ctypes.cast(handle, ctypes.c_void_p).value
        if value is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(value)

    def _gi_handle(self, device: _Device, gi: _GpuInstance) -> Any:
        return ctypes.cast(ctypes.c_void_p(_GI_BASE + device.index * 256 + gi.id), pynvml.c_nvmlGpuInstance_t)

    def _gi(self, handle: Any) -> tuple[_Device, _GpuInstance]:
        offset = self._address(handle) - _GI_BASE
        device_index, gi_id = divmod(offset, 256)
        if not 0 <= device_index < len(self._devices):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        device = self._devices[device_index]
        gi = device.gpu_instances.get(gi_id)
        if gi is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return device, gi

    def _ci_handle(self, device: _Device, gi: _GpuInstance, ci: _ComputeInstance) -> Any:
        address = _CI_BASE + (device.index * 256 + gi.id) * 256 + ci.id
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlComputeInstance_t)

    def _ci(self, handle: Any) -> tuple[_GpuInstance, _ComputeInstance]:
        offset = self._address(handle) - _CI_BASE
        gi_key, ci_id = divmod(offset, 256)
        device_index, gi_id = divmod(gi_key, 256)
        if not 0 <= device_index < len(self._devices):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi = self._devices[device_index].gpu_instances.get(gi_id)
        if gi is None or ci_id not in gi.compute_instances:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gi, gi.compute_instances[ci_id]

    @staticmethod
    def _profile_by_id(device: _Device, profile_id: int) -> MigProfile:
        try:
            return device.model.by_profile_id(profile_id)
        except KeyError:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None

    # ------------------------------------------------------------ read-only calls

    def nvmlInit(self) -> None:
        self._record("nvmlInit")
        self._initialized += 1

    def nvmlShutdown(self) -> None:
        self._record("nvmlShutdown")
        self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._record("nvmlSystemGetDriverVersion")
        return "stand-in"

    def nvmlDeviceGetCount(self) -> int:
        self._record("nvmlDeviceGetCount")
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _DeviceHandle:
        self._record("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._devices):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _DeviceHandle(index)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._record("nvmlDeviceGetName")
        return self._device(handle).name

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        self._record("nvmlDeviceGetMigMode")
        device = self._device(handle)
        return [device.mig_current, device.mig_pending]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any:
        self._record("nvmlDeviceGetGpuInstanceProfileInfo")
        device = self._device(handle)
        for p in device.model.profiles:
            if p.nvml_profile == profile:
                info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.id = p.profile_id
                info.sliceCount = p.compute_slices
                info.instanceCount = p.max_instances
                info.memorySizeMB = p.memory_mib
                info.name = f"MIG {p.name}".encode()
                return info
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: Any, profile_id: int, placements: Any, count: Any
    ) -> int:
        self._record("nvmlDeviceGetGpuInstancePossiblePlacements")
        profile = self._profile_by_id(self._device(handle), profile_id)
        count.contents.value = len(profile.starts)
        if placements is not None:
            for i, start in enumerate(profile.starts):
                placements[i].start = start
                placements[i].size = profile.memory_slices
        return _SUCCESS

    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int, instances: Any, count: Any) -> int:
        self._record("nvmlDeviceGetGpuInstances")
        device = self._device(handle)
        self._require_mig(device)
        profile = self._profile_by_id(device, profile_id)
        found = [gi for gi in device.gpu_instances.values() if gi.profile == profile]
        count.contents.value = len(found)
        for i, gi in enumerate(found):
            instances[i] = self._gi_handle(device, gi)
        return _SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> Any:
        self._record("nvmlDeviceGetGpuInstanceById")
        device = self._device(handle)
        self._require_mig(device)
        gi = device.gpu_instances.get(gi_id)
        if gi is None:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._gi_handle(device, gi)

    def nvmlGpuInstanceGetInfo(self, handle: Any) -> Any:
        self._record("nvmlGpuInstanceGetInfo")
        _, gi = self._gi(handle)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id = gi.id
        info.profileId = gi.profile.profile_id
        info.placement.start = gi.start
        info.placement.size = gi.profile.memory_slices
        return info

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, handle: Any, profile: int, eng_profile: int, version: int = 2
    ) -> Any:
        self._record("nvmlGpuInstanceGetComputeInstanceProfileInfo")
        _, gi = self._gi(handle)
        slices = _CI_PROFILE_SLICES.get(profile)
        if slices is None or slices > gi.profile.compute_slices:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = gi.profile.compute_slices // slices
        return info

    def nvmlGpuInstanceGetComputeInstances(self, handle: Any, profile_id: int, instances: Any, count: Any) -> int:
        self._record("nvmlGpuInstanceGetComputeInstances")
        device, gi = self._gi(handle)
        found = [ci for ci in gi.compute_instances.values() if ci.profile_id == profile_id]
        count.contents.value = len(found)
        for i, ci in enumerate(found):
            instances[i] = self._ci_handle(device, gi, ci)
        return _SUCCESS

    # ------------------------------------------------------------ mutating calls

    @staticmethod
    def _require_mig(device: _Device) -> None:
        if device.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int, placement: Any) -> Any:
        self._record("nvmlDeviceCreateGpuInstanceWithPlacement")
        device = self._device(handle)
        self._require_mig(device)
        profile = self._profile_by_id(device, profile_id)
        start, size = int(placement.start), int(placement.size)
        if start not in profile.starts or size != profile.memory_slices:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        occupied = {s for gi in device.gpu_instances.values() for s in gi.profile.slices_at(gi.start)}
        if occupied & set(profile.slices_at(start)):
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        same_profile = sum(1 for gi in device.gpu_instances.values() if gi.profile == profile)
        if same_profile >= profile.max_instances:
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        compute = sum(gi.profile.compute_slices for gi in device.gpu_instances.values())
        if compute + profile.compute_slices > device.model.compute_slices:
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = device.next_gi_id
        device.next_gi_id += 1
        gi = _GpuInstance(gi_id, profile, start)
        device.gpu_instances[gi_id] = gi
        return self._gi_handle(device, gi)

    def nvmlGpuInstanceDestroy(self, handle: Any) -> int:
        self._record("nvmlGpuInstanceDestroy")
        device, gi = self._gi(handle)
        if gi.compute_instances:
            raise _error(pynvml.NVML_ERROR_IN_USE)
        del device.gpu_instances[gi.id]
        return _SUCCESS

    def nvmlGpuInstanceCreateComputeInstance(self, handle: Any, profile_id: int) -> Any:
        self._record("nvmlGpuInstanceCreateComputeInstance")
        device, gi = self._gi(handle)
        self._require_mig(device)
        slices = _CI_PROFILE_SLICES.get(profile_id)
        if slices is None or slices > gi.profile.compute_slices:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        used = sum(ci.slices for ci in gi.compute_instances.values())
        if used + slices > gi.profile.compute_slices:
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci = _ComputeInstance(gi.next_ci_id, profile_id, used, slices)
        gi.next_ci_id += 1
        gi.compute_instances[ci.id] = ci
        return self._ci_handle(device, gi, ci)

    def nvmlComputeInstanceDestroy(self, handle: Any) -> int:
        self._record("nvmlComputeInstanceDestroy")
        gi, ci = self._ci(handle)
        if ci.processes:
            raise _error(pynvml.NVML_ERROR_IN_USE)
        del gi.compute_instances[ci.id]
        return _SUCCESS
