"""H200: CPU per NVML call kind when sampled periodically (not in a tight loop).

Usage: python -m scripts.gpu.nvml_call_costs [seconds_per_variant] [hz]

A tight loop of NVML reads keeps caches warm and hides what one read costs
when it comes alone every 10 ms, which is how capture samples. Each variant
runs in a thread at `hz` for the given seconds; printed: process CPU % of a
core over wall time, and the baseline with no NVML call at all.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time
from collections.abc import Callable

import pynvml


def periodic(call: Callable[[], object], hz: float, seconds: float, timed_event_wait: bool = False) -> float:
    stop = threading.Event()

    def loop() -> None:
        period = 1.0 / hz
        next_tick = time.monotonic()
        while not stop.is_set():
            call()
            next_tick += period
            now = time.monotonic()
            next_tick = max(next_tick, now)
            if timed_event_wait:
                stop.wait(next_tick - now)
            else:
                time.sleep(next_tick - now)

    cpu0, wall0 = time.process_time(), time.monotonic()
    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return 100.0 * (time.process_time() - cpu0) / (time.monotonic() - wall0)


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    hz = float(sys.argv[2]) if len(sys.argv) > 2 else 100.0
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    # The v1 call without pynvml's wrapper (struct made once, no version check): what is left is
    # the driver call itself.
    memory_v1_raw = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo")
    memory_struct = ctypes.byref(pynvml.c_nvmlMemory_t())
    variants: dict[str, Callable[[], object]] = {
        "nothing": lambda: None,
        "memory_v2": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2),
        "memory_v1": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
        "memory_v1_without_wrapper": lambda: memory_v1_raw(handle, memory_struct),
        "utilization": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
        "processes": lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
    }
    result = {name: round(periodic(call, hz, seconds), 3) for name, call in variants.items()}
    result["nothing_timed_event_wait"] = round(periodic(lambda: None, hz, seconds, timed_event_wait=True), 3)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    fields = {
        "v1": {"total": v1.total, "used": v1.used, "free": v1.free},
        "v2": {"total": v2.total, "reserved": v2.reserved, "used": v2.used, "free": v2.free},
    }
    pynvml.nvmlShutdown()
    print(json.dumps({"hz": hz, "seconds": seconds, "cpu_pct_of_a_core": result, "memory_fields": fields}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
