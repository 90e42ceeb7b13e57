"""The co-tenant: a second process on the GPU that takes free memory in steps and holds it.

It waits for the scenario's start (`--go-file`, JSON with t0). From t0 + start_s it takes, in
`steps` equal steps `period_s` apart, the memory that is free at the time beyond
`leave_bytes`, reading the device's free memory before each step (cudaMemGetInfo): it only
ever takes what nobody holds, so it never touches another process's memory. It holds what it
took until SIGTERM. A step that fails (the engine grew in between) is recorded and the next
one retries. On a CPU rehearsal (`--device cpu`) nothing is allocated: it keeps a virtual
device (`--cpu-free-bytes` free at start) and writes what it holds to `--state-file`, which the
rehearsal's stand-in for NVML reads.
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    device = Device(args.device, args.cpu_free_bytes, args.state_file)
    t0 = float(wait_for_file(args.go_file, timeout_s=900)["t0"])
    events: list[dict[str, Any]] = []
    step = 0
    next_at = t0 + args.start_s
    deadline = t0 + args.max_s
    while not stop.is_set() and time.time() < deadline:
        if step < args.steps and time.time() >= next_at:
            step += 1
            free = device.free_bytes()
            # Equal steps from what is free now down to what must stay free.
            want = max(0, free - args.leave_bytes) // (args.steps - step + 1)
            event: dict[str, Any] = {"t": round(time.time() - t0, 4), "step": step, "free_before": free, "bytes": want}
            try:
                if want > 0:
                    device.take(want)
                event["ok"] = True
            except Exception as error:  # the co-tenant's own OOM: recorded, the next step retries
                event["ok"] = False
                event["error"] = str(error).split("\n")[0][:300]
                if step == args.steps:
                    step -= 1  # the last step is retried until it lands
            event["held_bytes"] = device.held_bytes
            event["free_after"] = device.free_bytes()
            events.append(event)
            print(json.dumps(event), flush=True)
            next_at += args.period_s
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
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--go-file", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--start-s", type=float, required=True)
    p.add_argument("--period-s", type=float, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--leave-bytes", type=int, required=True)
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
