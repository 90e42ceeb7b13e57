"""H200: record SITS trace v1 files of four memory patterns for replay.

Usage: python -m scripts.gpu.capture_record_traces OUT_DIR NAME

(a) plateau       - weights + a preallocated KV pool, then matmul steps with
                    transient activations: an inference-like plateau.
(b) linear_oom    - allocations grow at a steady rate until CUDA OOM.
(c) sawtooth_frag - allocate/free cycles of growing, mixed sizes, keeping a third
                    of each cycle: reserved memory ratchets up, inactive split
                    bytes and allocator retries grow (fragmentation).
(d) contention    - this process (the target engine) serves bursts that it
                    returns to the driver; a second process on the same GPU grows
                    until this one hits OOM on a burst.

Samples come from NVML (the capture's own reader) and this process's
`torch.cuda.memory_stats` at 10 Hz; OOM records come from the SITS OOM hook's
spool. Each trace is written as traces/h200/<name>.jsonl.gz material.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.capture.sources.nvml_reader import NvmlReader
from sits.runtime.traces import TraceHeader, TraceTarget, write_trace
from sits_engine.oom_hook.hook import HookConfig, OomHook
from sits_engine.oom_hook.spool import spooled_events

GIB = 1 << 30
MIB = 1 << 20
HZ = 10.0


class Recorder:
    """Samples NVML + this process's allocator at HZ on a thread; stamps t from a shared start."""

    def __init__(self, torch: Any, reader: NvmlReader, peer_bytes: Any = None, peer_pid: Any = None) -> None:
        self.torch = torch
        self.reader = reader
        self.records: list[dict[str, Any]] = []
        self.peer_bytes = peer_bytes
        self.peer_pid = peer_pid
        self.nvml_processes_seen = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0_mono = time.monotonic()
        self.t0_wall = time.time()

    def start(self) -> None:
        self.t0_mono = time.monotonic()
        self.t0_wall = time.time()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self.records.append(self.sample())
            next_tick += 1.0 / HZ
            self._stop.wait(max(0.0, next_tick - time.monotonic()))

    def sample(self) -> dict[str, Any]:
        t = time.monotonic() - self.t0_mono
        gpu = self.reader.read()[0]
        stats = self.torch.cuda.memory_stats()
        me = os.getpid()
        processes = [
            {"pid": p.pid, "used_bytes": p.used_bytes, "name": p.name, "is_target_engine": p.pid == me}
            for p in gpu.processes
        ]
        if processes:
            self.nvml_processes_seen = True
        else:
            # NVML lists no processes inside this sandbox: fall back to what each process says it holds.
            processes = [
                {
                    "pid": me,
                    "used_bytes": int(stats.get("reserved_bytes.all.current", 0)),
                    "name": "target-engine",
                    "is_target_engine": True,
                }
            ]
            if self.peer_bytes is not None and self.peer_pid is not None and self.peer_pid.value:
                processes.append(
                    {
                        "pid": int(self.peer_pid.value),
                        "used_bytes": int(self.peer_bytes.value),
                        "name": "neighbour",
                        "is_target_engine": False,
                    }
                )
        return {
            "t": round(t, 4),
            "kind": "sample",
            "gpu": {
                "used_bytes": gpu.used_bytes,
                "total_bytes": gpu.total_bytes,
                "reserved_bytes": gpu.reserved_bytes,
                "free_bytes": gpu.free_bytes,
                "utilization_pct": gpu.utilization_pct or 0.0,
            },
            "processes": processes,
            "allocator": {
                "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
                "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
                "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
                "alloc_retries": int(stats.get("num_alloc_retries", 0)),
                "num_ooms": int(stats.get("num_ooms", 0)),
            },
        }


# ---------------------------------------------------------------------------- workloads


def plateau(torch: Any, duration_s: float, **_: Any) -> str:
    weights = torch.empty(16 * GIB, dtype=torch.uint8, device="cuda")
    kv_pool = torch.empty(60 * GIB, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + duration_s
    steps = 0
    while time.monotonic() < end:
        batch = random.randint(2, 12)
        activations = torch.randn(batch, 4096, 8192, device="cuda", dtype=torch.bfloat16)
        (activations @ a).sum().item()
        del activations
        steps += 1
    del weights, kv_pool, a
    return f"{steps} steps"


def linear_oom(torch: Any, duration_s: float, **_: Any) -> str:
    held = [torch.empty(16 * GIB, dtype=torch.uint8, device="cuda")]
    step_bytes = 768 * MIB
    try:
        while True:
            held.append(torch.empty(step_bytes, dtype=torch.uint8, device="cuda"))
            time.sleep(0.1)
    except torch.cuda.OutOfMemoryError:
        outcome = f"OOM after {len(held)} allocations"
    time.sleep(1.0)
    del held
    return outcome


def sawtooth_frag(torch: Any, duration_s: float, **_: Any) -> str:
    rng = random.Random(7)
    base = torch.empty(40 * GIB, dtype=torch.uint8, device="cuda")
    kept: list[Any] = []
    end = time.monotonic() + duration_s
    cycle = 0
    outcome = "no OOM"
    try:
        while time.monotonic() < end:
            top = 96 + 48 * cycle
            burst = [
                torch.empty(rng.randint(8, top) * MIB + rng.randint(0, MIB), dtype=torch.uint8, device="cuda")
                for _ in range(24)
            ]
            time.sleep(0.15)
            kept.extend(burst[::3])
            del burst
            time.sleep(0.15)
            cycle += 1
    except torch.cuda.OutOfMemoryError:
        outcome = f"OOM in cycle {cycle}"
        time.sleep(1.0)
    del kept, base
    return f"{cycle} cycles, {outcome}"


def _neighbour(stop: Any, held_bytes: Any, pid: Any, step_bytes: int) -> None:
    import torch

    pid.value = os.getpid()
    held = []
    while not stop.is_set():
        try:
            held.append(torch.empty(step_bytes, dtype=torch.uint8, device="cuda"))
            held_bytes.value = int(torch.cuda.memory_reserved())
        except torch.cuda.OutOfMemoryError:
            pass
        time.sleep(0.1)
    time.sleep(0.5)


def contention(torch: Any, duration_s: float, *, stop: Any = None, start_neighbour: Callable[[], None]) -> str:
    weights = torch.empty(40 * GIB, dtype=torch.uint8, device="cuda")
    rng = random.Random(11)
    end = time.monotonic() + duration_s
    started = False
    bursts = 0
    outcome = "no OOM"
    t_start = time.monotonic()
    try:
        while time.monotonic() < end:
            if not started and time.monotonic() - t_start > 2.0:
                start_neighbour()
                started = True
            activations = torch.empty(int((4 + rng.random() * 4) * GIB), dtype=torch.uint8, device="cuda")
            time.sleep(0.1)
            del activations
            # This engine gives its burst memory back, so the neighbour can take it.
            torch.cuda.empty_cache()
            time.sleep(0.1)
            bursts += 1
    except torch.cuda.OutOfMemoryError:
        outcome = f"OOM on burst {bursts}"
        stop.set()
        time.sleep(1.0)
    stop.set()
    del weights
    return outcome


DESCRIPTIONS = {
    "plateau": "Inference-like plateau: 16 GiB weights + 60 GiB preallocated KV pool, then bf16 matmul "
    "steps with transient activations of 2-12 x 4096 x 8192 bf16.",
    "linear_oom": "Linear growth: 16 GiB base, then 768 MiB every 100 ms until CUDA OOM, then 1 s more.",
    "sawtooth_frag": "Allocate/free sawtooth: 40 GiB base, cycles of 24 tensors of random sizes up to "
    "96+48*cycle MiB, a third of each cycle kept: reserved ratchets up, fragmentation grows.",
    "contention": "Two processes on one GPU: the target holds 40 GiB and serves 4-8 GiB bursts returned "
    "with empty_cache(); from t=2 s a second process grows 2 GiB every 100 ms until the target OOMs.",
}


def record(name: str, out_dir: Path, duration_s: float) -> dict[str, Any]:
    import torch

    spool = Path(tempfile.mkdtemp(prefix=f"sits-trace-{name}-"))
    hook = OomHook(HookConfig(capture_addr="", spool_dir=str(spool), engine=f"trace-{name}"))
    hook.install()
    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    reader = NvmlReader()
    reader.open()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    peer_bytes = ctx.Value("q", 0)
    peer_pid = ctx.Value("q", 0)
    neighbour: list[Any] = []

    def start_neighbour() -> None:
        proc = ctx.Process(target=_neighbour, args=(stop, peer_bytes, peer_pid, 2 * GIB), daemon=True)
        proc.start()
        neighbour.append(proc)

    recorder = Recorder(torch, reader, peer_bytes, peer_pid)
    workloads = {"plateau": plateau, "linear_oom": linear_oom, "sawtooth_frag": sawtooth_frag, "contention": contention}
    recorder.start()
    time.sleep(0.5)
    outcome = workloads[name](torch, duration_s, stop=stop, start_neighbour=start_neighbour)
    torch.cuda.empty_cache()
    time.sleep(0.5)
    recorder.stop()
    stop.set()
    for proc in neighbour:
        proc.join(10)
    hook.wait_idle(5)
    records = recorder.records
    for _path, event in spooled_events(spool):
        if event is None:
            continue
        records.append(
            {
                "t": round(event["produced_at"] - recorder.t0_wall, 4),
                "kind": "oom",
                "requested_bytes": event["requested_bytes"],
                "device_free_bytes": event["device_free_bytes"],
                "device_total_bytes": event["device_total_bytes"],
                "allocator": event["allocator"],
                "message": event["message"],
                "pid": event["pid"],
            }
        )
    records.sort(key=lambda r: (r["t"], r["kind"] == "oom"))
    first_gpu = reader.read()[0]
    header = TraceHeader(
        name=name,
        description=DESCRIPTIONS[name],
        recorded_on=f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(recorder.t0_wall))}",
        target=TraceTarget(
            host=socket.gethostname(), gpu_uuid=first_gpu.gpu_uuid, mig_instance="", engine=f"trace-{name}"
        ),
        total_bytes=first_gpu.total_bytes,
        extra={
            "sample_hz": HZ,
            "outcome": outcome,
            "processes_source": "nvml" if recorder.nvml_processes_seen else "self-reported",
            "recorder": "scripts/gpu/capture_record_traces.py",
        },
    )
    reader.close()
    path = out_dir / f"{name}.jsonl.gz"
    count = write_trace(path, header, records)
    ooms = sum(1 for r in records if r["kind"] == "oom")
    peak = max((r["gpu"]["used_bytes"] for r in records if r["kind"] == "sample"), default=0)
    return {
        "name": name,
        "records": count,
        "ooms": ooms,
        "outcome": outcome,
        "peak_used_gib": peak / GIB,
        "bytes": path.stat().st_size,
        "processes_source": header.extra["processes_source"],
    }


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    # One trace per process, so each starts with a fresh allocator (num_ooms, retries at 0).
    name = sys.argv[2]
    duration = float(os.environ.get("TRACE_SECONDS", "15"))
    summary = record(name, out_dir, duration)
    print(json.dumps(summary))
    with open(out_dir / "summary.jsonl", "a", encoding="utf-8") as stream:
        stream.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
