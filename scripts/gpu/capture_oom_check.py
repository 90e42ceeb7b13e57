"""H200: grow PyTorch allocations until CUDA OOM with the SITS OOM hook installed.

Checks, and writes to $OUT/capture_oom_check.json:
- the host's own `torch.cuda.OutOfMemoryError` still surfaces, and the process
  keeps working afterwards;
- the captured event carries the requested bytes, the device free/total bytes
  and the allocator statistics the host itself sees at the exception;
- round 1 reports over gRPC to a local server standing in for capture (the raw
  bytes are parsed as sits.v1.OomEvent when the stubs import on that machine);
  round 2 has capture unreachable and must land in the spool.
The hook is installed before CUDA initialises, the way the vLLM plugin does it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

from sits_engine.oom_hook.hook import HookConfig, OomHook
from sits_engine.oom_hook.spool import spooled_events

GIB = 1 << 30


def start_fake_capture() -> tuple[Any, int, list[bytes]]:
    """A gRPC server that accepts /sits.v1.Capture/ReportOom as raw bytes (no stubs needed)."""
    import grpc

    received: list[bytes] = []

    def report(request: bytes, context: Any) -> bytes:
        received.append(request)
        return b""

    handler = grpc.method_handlers_generic_handler(
        "sits.v1.Capture",
        {"ReportOom": grpc.unary_unary_rpc_method_handler(report)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, received


def grow_until_oom(torch: Any, chunk_bytes: int, limit: int = 400) -> dict[str, Any]:
    held = []
    observed: dict[str, Any] = {"chunk_bytes": chunk_bytes}
    t0 = time.perf_counter()
    try:
        for _ in range(limit):
            held.append(torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda"))
        observed["raised"] = None
    except torch.cuda.OutOfMemoryError as exc:
        observed["raised"] = type(exc).__module__ + "." + type(exc).__qualname__
        observed["exception_first_line"] = str(exc).splitlines()[0][:300]
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        observed.update(
            chunks_held=len(held),
            free_at_exception=free,
            total_at_exception=total,
            allocated_at_exception=int(stats["allocated_bytes.all.current"]),
            reserved_at_exception=int(stats["reserved_bytes.all.current"]),
            inactive_split_at_exception=int(stats.get("inactive_split_bytes.all.current", 0)),
            num_ooms_at_exception=int(stats.get("num_ooms", 0)),
            alloc_retries_at_exception=int(stats.get("num_alloc_retries", 0)),
        )
    observed["grow_s"] = time.perf_counter() - t0
    del held
    torch.cuda.empty_cache()
    return observed


def main() -> int:
    out_dir = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    spool_dir = Path(tempfile.mkdtemp(prefix="sits-oom-spool-"))
    snapshot_dir = Path(tempfile.mkdtemp(prefix="sits-oom-snap-"))
    server, port, received = start_fake_capture()
    hook = OomHook(
        HookConfig(
            capture_addr=f"127.0.0.1:{port}",
            spool_dir=str(spool_dir),
            report_timeout_s=0.5,
            engine="h200-oom-check",
            snapshot_dir=str(snapshot_dir),
            snapshot_max_entries=2000,
        )
    )
    import torch

    before_cuda = {"installed": hook.install(), "status_before_cuda_init": hook.status}
    torch.cuda.init()  # type: ignore[no-untyped-call]
    result: dict[str, Any] = {"hook": before_cuda, "status_after_cuda_init": hook.status}
    result["torch"] = torch.__version__
    result["device"] = torch.cuda.get_device_name(0)

    # Observer timing: wrap the hook's callback to see what it adds to the failing call.
    observer_calls: list[dict[str, float]] = []
    real_on_oom = hook.build_event

    def timed_build(*args: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        event = real_on_oom(*args)
        observer_calls.append({"build_event_ms": (time.perf_counter() - t0) * 1e3})
        return event

    hook.build_event = timed_build  # type: ignore[method-assign,assignment]

    rounds = []
    for round_no, chunk in enumerate((4 * GIB, 3 * GIB), start=1):
        if round_no == 2:
            # Capture unreachable: the event must go to the spool.
            server.stop(0)
        observed = grow_until_oom(torch, chunk)
        hook.wait_idle(5.0)
        observed["after_oom_small_alloc_ok"] = bool(torch.ones(1024, device="cuda").sum().item() == 1024)
        rounds.append(observed)
        if round_no == 1:
            # Snapshot recording slows every allocation; round 2 runs without it.
            torch.cuda.memory._record_memory_history(enabled=None)
            hook.config = dataclasses.replace(hook.config, snapshot_dir="")

    spooled = [event for _path, event in spooled_events(spool_dir) if event is not None]
    result["rounds"] = rounds
    result["observer_calls"] = observer_calls
    result["reported_ids"] = hook.reported
    result["spooled_ids"] = hook.spooled
    result["spooled_events"] = spooled
    result["grpc_received_bytes"] = [len(b) for b in received]
    try:
        from sits.v1 import events_pb2

        result["grpc_received"] = [
            {
                "event_id": m.meta.event_id,
                "requested_bytes": m.requested_bytes,
                "device_free_bytes": m.device_free_bytes,
                "device_total_bytes": m.device_total_bytes,
                "allocated_bytes": m.allocator.allocated_bytes,
                "num_ooms": m.allocator.num_ooms,
                "memory_snapshot_path": m.memory_snapshot_path,
                "snapshot_bytes": (os.path.getsize(m.memory_snapshot_path) if m.memory_snapshot_path else 0),
            }
            for m in (events_pb2.OomEvent.FromString(b) for b in received)
        ]
    except Exception as exc:
        result["grpc_received"] = f"stubs do not import here: {exc}"
    result["hook_failures"] = hook.failures

    checks: dict[str, bool] = {}
    for index, observed in enumerate(rounds):
        checks[f"round{index + 1}_host_raised_oom"] = observed.get("raised", "").endswith("OutOfMemoryError")
        checks[f"round{index + 1}_process_still_works"] = observed["after_oom_small_alloc_ok"]
    events: list[dict[str, Any]] = []
    if isinstance(result["grpc_received"], list):
        events.extend({**e, "via": "grpc"} for e in result["grpc_received"])
    events.extend(
        {
            **e,
            "allocated_bytes": e["allocator"].get("allocated_bytes"),
            "num_ooms": e["allocator"].get("num_ooms"),
            "via": "spool",
        }
        for e in spooled
    )
    result["events_seen"] = len(events)
    for index, observed in enumerate(rounds):
        match = [e for e in events if e["requested_bytes"] == observed["chunk_bytes"]]
        name = f"round{index + 1}"
        checks[f"{name}_event_captured"] = len(match) == 1
        if match:
            event = match[0]
            checks[f"{name}_requested_bytes_exact"] = event["requested_bytes"] == observed["chunk_bytes"]
            checks[f"{name}_free_bytes_within_64MiB"] = abs(
                event["device_free_bytes"] - observed["free_at_exception"]
            ) <= 64 * (1 << 20)
            checks[f"{name}_total_bytes_match"] = event["device_total_bytes"] == observed["total_at_exception"]
            checks[f"{name}_allocated_bytes_match"] = event["allocated_bytes"] == observed["allocated_at_exception"]
            checks[f"{name}_num_ooms_match"] = event["num_ooms"] == observed["num_ooms_at_exception"]
            checks[f"{name}_delivered_via"] = event["via"] == ("grpc" if index == 0 else "spool")
    result["checks"] = checks
    result["all_passed"] = all(checks.values())
    (out_dir / "capture_oom_check.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({"oom_checks": checks, "all_passed": result["all_passed"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
