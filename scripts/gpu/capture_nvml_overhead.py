"""H200: CPU cost of capture's NVML sampling at 10 Hz and 100 Hz.

Usage: python -m scripts.gpu.capture_nvml_overhead OUT_JSON [seconds]

Runs capture's real `NvmlSource` (asyncio loop, NVML v2 memory + utilization +
per-process memory, conversion to sits.v1.MetricSample) alone in this process
and divides the process's CPU seconds by the wall seconds sampled and by the
number of GPUs. Where the protobuf stubs do not import on the machine, it times
the `NvmlReader` in a thread instead and says so in `mode`. Baselines measured
in the same run: the same source with the NVML read replaced by nothing, and
the earlier design that sampled on the event loop itself (one loop wake-up per
sample). On a machine with several GPUs, the source also runs on the first GPU
alone (`runs_first_gpu_only`): the thread's wake-ups are paid once per tick for
all GPUs, so the per-GPU figure depends on how many GPUs one capture samples.
`v1_minus_reserved_vs_v2`: the reader's cheap path (v1 memory minus the reserved
bytes of the last v2 read) against a v2 read right after it.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.capture.sources.nvml_reader import NvmlReader


def per_call_us(reader: NvmlReader, calls: int = 2000) -> dict[str, float]:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        reader.read()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return {"median_us": statistics.median(times), "p99_us": times[int(0.99 * len(times))]}


class FirstGpuReader(NvmlReader):
    def open(self) -> None:
        super().open()
        self._devices = self._devices[:1]


def v1_path_check(samples: int = 200) -> dict[str, Any]:
    import pynvml

    reader = NvmlReader()
    reader.open()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    reader.read(details=True)
    diffs = []
    for _ in range(samples):
        cheap = reader.read(details=False)[0]
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        diffs.append(abs(cheap.used_bytes - int(v2.used)))
    reader.close()
    return {"samples": samples, "max_abs_used_diff_bytes": max(diffs), "reserved_bytes": int(v2.reserved)}


def consume_source(source: Any, seconds: float) -> dict[str, Any]:
    """Consume `source.events()` on an asyncio loop for `seconds`: process CPU, wall time, samples."""

    async def consume() -> int:
        count = 0
        async for _sample in source.events():
            count += 1
            if time.monotonic() >= end:
                break
        return count

    async def driver() -> int:
        task = asyncio.create_task(consume())
        await asyncio.sleep(seconds)
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return int(source.samples_taken)

    cpu0, wall0 = time.process_time(), time.monotonic()
    end = wall0 + seconds
    samples = asyncio.run(driver())
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    return {"cpu_s": cpu, "wall_s": wall, "samples": samples}


def run_source(hz: float, seconds: float, *, with_nvml: bool, first_gpu_only: bool = False) -> dict[str, Any]:
    from services.capture.sources.nvml import NvmlSource

    class NullReader(NvmlReader):
        def open(self) -> None:
            pass

        def read(self, details: bool = True) -> list[Any]:
            return []

    reader = (FirstGpuReader() if first_gpu_only else NvmlReader()) if with_nvml else NullReader()
    return consume_source(NvmlSource(hz=hz, reader=reader), seconds)


def run_on_loop(hz: float, seconds: float) -> dict[str, Any]:
    """The earlier design: read and convert on the event loop, one wake-up per sample."""
    from services.capture.sources.nvml import reading_to_sample

    reader = NvmlReader()
    reader.open()

    async def loop() -> int:
        n, period = 0, 1.0 / hz
        next_tick = time.monotonic()
        while time.monotonic() < end:
            for reading in reader.read():
                reading_to_sample(reading, host="h200")
                n += 1
            next_tick += period
            now = time.monotonic()
            next_tick = max(next_tick, now)
            await asyncio.sleep(next_tick - now)
        return n

    cpu0, wall0 = time.process_time(), time.monotonic()
    end = wall0 + seconds
    samples = asyncio.run(loop())
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    gpus = max(1, reader.gpu_count)
    reader.close()
    return {"cpu_s": cpu, "wall_s": wall, "samples": samples, "cpu_pct_per_gpu": 100.0 * cpu / wall / gpus}


def thread_loop(work: Callable[[int], object], hz: float, seconds: float) -> dict[str, Any]:
    """`work(tick)` in a thread at `hz` for `seconds`, paced as NvmlSource paces its sampling thread
    (a missed tick is skipped, not burst): the thread's own CPU, wall time and ticks."""
    out: dict[str, Any] = {}

    def loop() -> None:
        cpu0, wall0 = time.thread_time(), time.monotonic()
        period, tick, next_tick = 1.0 / hz, 0, wall0
        while time.monotonic() - wall0 < seconds:
            work(tick)
            tick += 1
            next_tick += period
            now = time.monotonic()
            next_tick = max(next_tick, now)
            time.sleep(next_tick - now)
        out.update(cpu_s=time.thread_time() - cpu0, wall_s=time.monotonic() - wall0, samples=tick)

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    return out


def run_reader_thread(hz: float, seconds: float) -> dict[str, Any]:
    reader = NvmlReader()
    reader.open()
    details_every = max(1, round(hz / 10))  # as NvmlSource: details 10x/s
    out = thread_loop(lambda tick: reader.read(details=tick % details_every == 0), hz, seconds)
    reader.close()
    return out


def main() -> int:
    out_path = Path(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
    reader = NvmlReader()
    reader.open()
    gpus = reader.gpu_count
    first = reader.read()[0]
    calls = per_call_us(reader)
    reader.close()
    try:
        from services.capture.sources.nvml import NvmlSource  # noqa: F401

        mode = "NvmlSource (asyncio + protobuf), whole-process CPU"
    except Exception as exc:
        mode = f"NvmlReader in a thread, thread CPU (stubs do not import: {exc})"
    result: dict[str, Any] = {
        "gpus": gpus,
        "kernel": platform.release(),
        "gpu_uuid": first.gpu_uuid,
        "processes_visible": len(first.processes),
        "read_all_gpus": calls,
        "seconds_per_rate": seconds,
        "mode": mode,
        "v1_minus_reserved_vs_v2": v1_path_check(),
        "runs": {},
    }
    for hz in (10.0, 100.0):
        if mode.startswith("NvmlSource"):
            baseline = run_source(hz, min(5.0, seconds), with_nvml=False)
            run = run_source(hz, seconds, with_nvml=True)
            on_loop = run_on_loop(hz, seconds)
        else:
            baseline = {"cpu_s": 0.0, "wall_s": 1.0, "samples": 0}
            run = run_reader_thread(hz, seconds)
            on_loop = {}
        pct = 100.0 * run["cpu_s"] / run["wall_s"] / gpus
        result["runs"][f"{int(hz)}hz"] = {
            **run,
            "achieved_hz": run["samples"] / run["wall_s"] / gpus,
            "cpu_pct_per_gpu": pct,
            "cpu_s_per_sampled_s_per_gpu": run["cpu_s"] / run["wall_s"] / gpus,
            "baseline_loop_without_nvml": {
                **baseline,
                "cpu_pct": 100.0 * baseline["cpu_s"] / baseline["wall_s"],
            },
            "baseline_sampling_on_the_event_loop": on_loop,
        }
        print(f"{int(hz)} Hz: {pct:.3f}% of a core per GPU ({run['samples']} samples in {run['wall_s']:.1f} s)")
        if gpus > 1 and mode.startswith("NvmlSource"):
            one = run_source(hz, seconds, with_nvml=True, first_gpu_only=True)
            one["cpu_pct"] = 100.0 * one["cpu_s"] / one["wall_s"]
            result.setdefault("runs_first_gpu_only", {})[f"{int(hz)}hz"] = one
            print(f"{int(hz)} Hz, first GPU only: {one['cpu_pct']:.3f}% of a core")
    out_path.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
