"""Read MIG profiles and placements from NVML, with read-only calls only.

Nothing here creates, destroys or changes anything on the GPU (no MIG mode change, no instance
creation): it is safe on a machine whose layout must not be touched. NVML documents that
nvmlDeviceGetGpuInstancePossiblePlacements_v2 "returns all the possible placements for the given
profile regardless of whether MIG is enabled or not"; whatever NVML refuses to answer is reported
under `errors` instead of failing the whole read.
"""

from __future__ import annotations

import ctypes
from typing import Any

# NVML_ERROR_NOT_SUPPORTED / NVML_ERROR_INVALID_ARGUMENT: the profile index does not exist on this GPU.
_PROFILE_ABSENT_CODES = (3, 2)
_VERSION_CODES = (13, 25)  # NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


def _error(exc: Exception) -> dict[str, Any]:
    return {"code": getattr(exc, "value", None), "message": str(exc)}


def _profile_info(nvml: Any, handle: Any, index: int) -> Any:
    try:
        return nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)  # the V (v2) call in pynvml
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) in _VERSION_CODES:
            return nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index, version=1)
        raise


def read_possible_placements(nvml: Any, handle: Any, profile_id: int) -> list[dict[str, int]]:
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.pointer(count))
    if count.value == 0:
        return []
    placements = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, placements, ctypes.pointer(count))
    return [{"start": int(placements[i].start), "size": int(placements[i].size)} for i in range(count.value)]


def read_profiles_from_nvml(nvml: Any, device_index: int = 0) -> dict[str, Any]:
    """Profile info and possible placements of every GPU-instance profile NVML knows for one GPU.

    `nvml` is the pynvml module (or a stand-in with the same functions). Returns a JSON-ready dict:
    device_name, driver_version, mig_mode {current, pending}, profiles [rows], absent_profiles
    [NVML profile indexes this GPU lacks], errors [what NVML would not answer].
    """
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
        report: dict[str, Any] = {
            "device_index": device_index,
            "device_name": _text(nvml.nvmlDeviceGetName(handle)),
            "profiles": [],
            "absent_profiles": [],
            "errors": [],
        }
        try:
            report["driver_version"] = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError as exc:
            report["errors"].append({"call": "nvmlSystemGetDriverVersion", **_error(exc)})
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
            report["mig_mode"] = {"current": int(current), "pending": int(pending)}
        except nvml.NVMLError as exc:
            report["mig_mode"] = None
            report["errors"].append({"call": "nvmlDeviceGetMigMode", **_error(exc)})

        for index in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            try:
                info = _profile_info(nvml, handle, index)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) in _PROFILE_ABSENT_CODES:
                    report["absent_profiles"].append(index)
                else:
                    report["errors"].append(
                        {"call": "nvmlDeviceGetGpuInstanceProfileInfo", "nvml_profile": index, **_error(exc)}
                    )
                continue
            row: dict[str, Any] = {
                "nvml_profile": index,
                "name": _text(getattr(info, "name", "")),
                "profile_id": int(info.id),
                "slice_count": int(info.sliceCount),
                "instance_count": int(info.instanceCount),
                "memory_mib": int(info.memorySizeMB),
                "multiprocessor_count": int(info.multiprocessorCount),
                "copy_engine_count": int(info.copyEngineCount),
                "decoder_count": int(info.decoderCount),
                "encoder_count": int(info.encoderCount),
                "jpeg_count": int(info.jpegCount),
                "ofa_count": int(info.ofaCount),
                "p2p_supported": int(info.isP2pSupported),
            }
            try:
                row["placements"] = read_possible_placements(nvml, handle, int(info.id))
            except nvml.NVMLError as exc:
                row["placements"] = None
                report["errors"].append(
                    {"call": "nvmlDeviceGetGpuInstancePossiblePlacements", "profile_id": int(info.id), **_error(exc)}
                )
            report["profiles"].append(row)
        return report
    finally:
        nvml.nvmlShutdown()
