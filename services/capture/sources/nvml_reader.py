"""Reads GPU memory through NVML (`nvidia-ml-py`, module `pynvml`).

Standard library and pynvml only, so the same reader runs inside capture and in
the H200 recording scripts. Per GPU it reads the v2 memory struct (used, total,
reserved, free), utilization, and per-process memory; with MIG on, it reads
each MIG instance as its own reading. Utilization and the process list change
slowly and cost as much as the memory read: `read(details=False)` reads memory
only and repeats the last details read.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProcessReading:
    pid: int
    used_bytes: int
    name: str


@dataclass(frozen=True)
class GpuReading:
    index: int
    gpu_uuid: str
    mig_instance: str  # MIG instance UUID, or "" for the whole GPU
    used_bytes: int
    total_bytes: int
    reserved_bytes: int
    free_bytes: int
    utilization_pct: float | None  # None where NVML does not report it (MIG instances)
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
        # Per (GPU index, MIG instance): the last utilization and process list read.
        self._details: dict[tuple[int, str], tuple[float | None, tuple[ProcessReading, ...]]] = {}
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
        memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
        key = (index, mig)
        cached = self._details.get(key)
        if details or cached is None:
            utilization: float | None = None
            if with_utilization:
                try:
                    utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                except Exception:
                    utilization = None
            processes = self._processes(handle) if self._include_processes else ()
            self._details[key] = (utilization, processes)
        else:
            utilization, processes = cached
        return GpuReading(
            index=index,
            gpu_uuid=uuid,
            mig_instance=mig,
            used_bytes=int(memory.used),
            total_bytes=int(memory.total),
            reserved_bytes=int(memory.reserved),
            free_bytes=int(memory.free),
            utilization_pct=utilization,
            processes=processes,
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


def _proc_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as stream:
            return stream.read().strip()
    except OSError:
        return "" if pid != os.getpid() else "self"
