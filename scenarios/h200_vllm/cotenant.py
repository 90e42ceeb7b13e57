"""The co-tenant: a second process on the GPU that takes free memory in steps and holds it.

It waits for the scenario's start (`--go-file`, JSON with t0). From t0 + start_s it takes, in
`steps` equal steps `period_s` apart, what would leave the engine more than `leave_bytes` of
headroom: the device's free memory (cudaMemGetInfo) plus, with `--engine-control`, what the
engine's caching allocator holds beyond its floor (the SITS plugin's GetState). PyTorch empties
that cache and retries before it raises an OOM, so the engine can reach it: a squeeze sized on
free memory alone let every step run from the cache (the H100 run of 2026-12-06: 5-25 GiB
cached above the floor). After its steps it holds the line every `hold_period_s`: what the
engine's allocator gives back beyond the headroom is taken again, as a second caching allocator
(another server, a training job) would. It only ever takes free memory, so it never touches
another process's memory, and holds what it took until SIGTERM. A step that fails (the engine
grew in between) is recorded and the next one retries. On a CPU rehearsal (`--device cpu`)
nothing is allocated: it keeps a virtual device (`--cpu-free-bytes` free at start) and writes
what it holds to `--state-file`, which the rehearsal's stand-in for NVML reads.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scenarios.h200_oom.files import wait_for_file, write_json

# Kept free of the co-tenant's own steps so that its allocation never races the engine's last bytes.
_MARGIN_BYTES = 64 << 20
# Below this a hold takes nothing: the engine's allocator breathes by a few blocks between steps.
_HOLD_MIN_BYTES = 256 << 20


class Device:
    """Free memory and allocation, on the GPU or on the CPU rehearsal's virtual device."""

    def __init__(self, kind: str, cpu_free_bytes: int, state_file: Path | None) -> None:
        self.kind = kind
        self.held: list[Any] = []
        self.held_bytes = 0
        self._cpu_free = cpu_free_bytes
        self._state_file = state_file
        self._torch: Any = None
        if kind == "cuda":
            import torch

            self._torch = torch
            torch.cuda.init()  # type: ignore[no-untyped-call]
            torch.empty(1, device="cuda")  # the context first: its memory is not the squeeze's
        self.publish()

    def free_bytes(self) -> int:
        if self._torch is not None:
            free, _total = self._torch.cuda.mem_get_info()
            return int(free)
        return self._cpu_free - self.held_bytes

    def take(self, size: int) -> None:
        if self._torch is not None:
            block = self._torch.empty(size, dtype=self._torch.uint8, device="cuda")
            block.zero_()
            self._torch.cuda.synchronize()
            self.held.append(block)
        self.held_bytes += size
        self.publish()

    def publish(self) -> None:
        if self._state_file is not None:
            write_json(self._state_file, {"held_bytes": self.held_bytes, "wall": time.time()})


def step_bytes(free: int, reusable: int | None, leave: int, steps_left: int) -> int:
    """One of `steps_left` equal steps from the engine's headroom now down to `leave`; only free memory is taken."""
    want = max(0, free + (reusable or 0) - leave) // max(1, steps_left)
    return min(want, max(0, free - _MARGIN_BYTES))


class EngineCache:
    """What the engine's allocator holds beyond its floor (reserved - allocated floor), via the plugin."""

    def __init__(self, address: str | None) -> None:
        self._get_state: Any = None
        if address:
            import grpc

            from sits.runtime import engine_control as protocol

            channel = grpc.insecure_channel(address)
            self._get_state = channel.unary_unary(
                protocol.GET_STATE, request_serializer=protocol.encode, response_deserializer=protocol.decode
            )

    def reusable_bytes(self) -> int | None:
        """None when unknown (no address, no answer, no CUDA in the engine): the step counts free memory only."""
        if self._get_state is None:
            return None
        try:
            allocator = self._get_state({}, timeout=2.0).get("allocator") or {}
        except Exception:
            return None
        if "reserved_bytes" not in allocator:
            return None
        return max(0, int(allocator["reserved_bytes"]) - int(allocator["allocated_floor_bytes"]))


def _take(
    device: Device, engine_cache: EngineCache, t0: float, step: int, steps_left: int, leave: int
) -> dict[str, Any] | None:
    """One take toward `leave` of headroom: the event, or None for a hold with nothing worth taking."""
    free = device.free_bytes()
    reusable = engine_cache.reusable_bytes()
    want = step_bytes(free, reusable, leave, steps_left)
    if step == 0 and want < _HOLD_MIN_BYTES:
        return None
    event: dict[str, Any] = {
        "t": round(time.time() - t0, 4),
        "step": step,
        "free_before": free,
        "engine_reusable_before": reusable,
        "bytes": want,
    }
    try:
        if want > 0:
            device.take(want)
        event["ok"] = True
    except Exception as error:  # the co-tenant's own OOM (the engine grew in between): recorded, retried
        event["ok"] = False
        event["error"] = str(error).split("\n")[0][:300]
    event["held_bytes"] = device.held_bytes
    event["free_after"] = device.free_bytes()
    event["engine_reusable_after"] = engine_cache.reusable_bytes()
    print(json.dumps(event), flush=True)
    return event


def run(args: argparse.Namespace) -> dict[str, Any]:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    device = Device(args.device, args.cpu_free_bytes, args.state_file)
    engine_cache = EngineCache(args.engine_control)
    t0 = float(wait_for_file(args.go_file, timeout_s=900)["t0"])
    events: list[dict[str, Any]] = []
    step = 0
    next_at = t0 + args.start_s
    deadline = t0 + args.max_s
    while not stop.is_set() and time.time() < deadline:
        if time.time() >= next_at:
            if step < args.steps:
                step += 1
                event = _take(device, engine_cache, t0, step, args.steps - step + 1, args.leave_bytes)
                if event is not None and not event["ok"] and step == args.steps:
                    step -= 1  # the last step is retried until it lands
                next_at += args.period_s
            else:
                # Holding the line: what the engine's allocator gives back (it empties its cache and
                # retries when the device is full) is taken again, as a second allocator would.
                event = _take(device, engine_cache, t0, 0, 1, args.leave_bytes)
                next_at += args.hold_period_s
            if event is not None:
                events.append(event)
        stop.wait(0.01)
    return {
        "t0": t0,
        "leave_bytes": args.leave_bytes,
        "steps": args.steps,
        "period_s": args.period_s,
        "start_s": args.start_s,
        "held_bytes": device.held_bytes,
        "events": events,
        "failures": sum(1 for e in events if not e["ok"]),
        "holds": sum(1 for e in events if e["step"] == 0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--go-file", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--start-s", type=float, required=True)
    p.add_argument("--period-s", type=float, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--leave-bytes", type=int, required=True, help="the engine's headroom to leave: free + its cache")
    p.add_argument("--engine-control", default=None, help="the SITS plugin's control address (the engine's cache)")
    p.add_argument("--hold-period-s", type=float, default=0.25, help="after the steps, how often to take back")
    p.add_argument("--max-s", type=float, default=600.0)
    p.add_argument("--cpu-free-bytes", type=int, default=0)
    p.add_argument("--state-file", type=Path, default=None)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    result = run(args)
    write_json(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
