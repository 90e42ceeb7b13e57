"""Reads GPU memory through NVML (`nvidia-ml-py`, module `pynvml`).

Standard library and pynvml only, so the same reader runs inside capture and in
the H200 recording scripts. Per GPU it reads the v2 memory struct (used, total,
reserved, free), utilization, and per-process memory; with MIG on, it reads
each MIG instance as its own reading. Utilization, the process list and the
driver's reserved memory change slowly and cost as much as the memory read:
`read(details=False)` reads only the v1 memory struct, which counts the
reserved memory as used, and subtracts the reserved bytes of the last details
read, so `used_bytes` means the same in both. It calls NVML's C function
directly into one struct: at 100 Hz on the H200 machine that costs 0.38% of a
core, against 0.58% through pynvml's wrapper and 0.78% for the v2 read
(scripts/gpu/nvml_call_costs.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass
from typing import Any, NamedTuple


class ProcessReading(NamedTuple):
    pid: int
    used_bytes: int
    name: str


class GpuReading(NamedTuple):  # a tuple: made once per GPU per tick, up to 100 times a second
    gpu_index: int
    gpu_uuid: str
    mig_instance: str  # MIG instance UUID, or "" for the whole GPU
    used_bytes: int
    total_bytes: int
    reserved_bytes: int
    free_bytes: int
    utilization_pct: float | None  # None where NVML does not report it (MIG instances)
    processes: tuple[ProcessReading, ...]


@dataclass(frozen=True)
class _Details:
    reserved_bytes: int
    utilization_pct: float | None
    processes: tuple[ProcessReading, ...]


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine (no driver, no GPU, no pynvml)."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    def __init__(self, nvml: Any = None, *, include_processes: bool = True, include_mig: bool = True) -> None:
        self._nvml = nvml
        self._include_processes = include_processes
        self._include_mig = include_mig
        self._devices: list[tuple[int, Any, str, list[tuple[Any, str]]]] = []
        self._names: dict[int, str] = {}
        # Per (GPU index, MIG instance): the last reserved bytes, utilization and process list read.
        self._details: dict[tuple[int, str], _Details] = {}
        self._memory_v1: Any = None
        self._opened = False

    def open(self) -> None:
        """Initialise NVML and enumerate GPUs (and MIG instances); raises NvmlUnavailable."""
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            nvml = self._nvml
            nvml.nvmlInit()
        except Exception as exc:
            raise NvmlUnavailable(f"NVML cannot be initialised: {exc}") from exc
        self._opened = True
        try:
            count = nvml.nvmlDeviceGetCount()
            if count == 0:
                raise NvmlUnavailable("NVML sees no GPU")
            for index in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                self._devices.append((index, handle, uuid, self._mig_handles(handle)))
        except NvmlUnavailable:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise NvmlUnavailable(f"NVML cannot enumerate GPUs: {exc}") from exc
        self._memory_v1 = _direct_memory_v1(nvml)

    def _mig_handles(self, handle: Any) -> list[tuple[Any, str]]:
        if not self._include_mig:
            return []
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except Exception:  # not a MIG-capable GPU
            return []
        if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        instances: list[tuple[Any, str]] = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except Exception:  # empty slot
                continue
            instances.append((mig, _text(nvml.nvmlDeviceGetUUID(mig))))
        return instances

    @property
    def gpu_count(self) -> int:
        return len(self._devices)

    def close(self) -> None:
        if self._opened:
            self._opened = False
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._devices = []
        self._details = {}

    def read(self, details: bool = True) -> list[GpuReading]:
        readings: list[GpuReading] = []
        for index, handle, uuid, migs in self._devices:
            readings.append(self._read_one(index, handle, uuid, "", with_utilization=True, details=details))
            for mig_handle, mig_uuid in migs:
                readings.append(
                    self._read_one(index, mig_handle, uuid, mig_uuid, with_utilization=False, details=details)
                )
        return readings

    def _read_one(
        self, index: int, handle: Any, uuid: str, mig: str, *, with_utilization: bool, details: bool
    ) -> GpuReading:
        nvml = self._nvml
        key = (index, mig)
        cached = self._details.get(key)
        if details or cached is None:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            utilization: float | None = None
            if with_utilization:
                try:
                    utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                except Exception:
                    utilization = None
            processes = self._processes(handle) if self._include_processes else ()
            cached = _Details(int(memory.reserved), utilization, processes)
            self._details[key] = cached
            used = int(memory.used)
        else:
            memory = self._memory_v1(handle) if self._memory_v1 else nvml.nvmlDeviceGetMemoryInfo(handle)
            used = max(0, int(memory.used) - cached.reserved_bytes)
        return GpuReading(
            gpu_index=index,
            gpu_uuid=uuid,
            mig_instance=mig,
            used_bytes=used,
            total_bytes=int(memory.total),
            reserved_bytes=cached.reserved_bytes,
            free_bytes=int(memory.free),
            utilization_pct=cached.utilization_pct,
            processes=cached.processes,
        )

    def _processes(self, handle: Any) -> tuple[ProcessReading, ...]:
        try:
            raw = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return ()
        out = []
        for proc in raw:
            used = proc.usedGpuMemory
            out.append(ProcessReading(pid=int(proc.pid), used_bytes=int(used or 0), name=self._name(int(proc.pid))))
        return tuple(out)

    def _name(self, pid: int) -> str:
        # Names are looked up once per pid: the lookup reads /proc, the sampling path must not.
        name = self._names.get(pid)
        if name is None:
            try:
                name = _text(self._nvml.nvmlSystemGetProcessName(pid))
            except Exception:
                name = _proc_comm(pid)
            if len(self._names) > 4096:
                self._names.clear()
            self._names[pid] = name
        return name


def _direct_memory_v1(nvml: Any) -> Any:
    """nvmlDeviceGetMemoryInfo (v1) called through ctypes into one reused struct, or None.

    pynvml builds a struct and checks the version on every call; the sampler reads each
    struct before the next call, so one struct per reader is enough.
    """
    try:
        function = nvml._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo")
        memory = nvml.c_nvmlMemory_t()
        pointer = ctypes.byref(memory)
        error = nvml.NVMLError
    except Exception:  # another binding or a stand-in: use its public call
        return None

    def read(handle: Any) -> Any:
        status = function(handle, pointer)
        if status != 0:
            raise error(status)
        return memory

    return read


def _proc_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as stream:
            return stream.read().strip()
    except OSError:
        return "" if pid != os.getpid() else "self"
