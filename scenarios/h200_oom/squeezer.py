"""The co-tenant: a second process on the GPU whose memory grows in steps.

It waits for the scenario's start (`--go-file`, JSON with t0), then from
t0 + `--start-delay-s` allocates `--step-bytes` more every `--period-s` until it
holds `--plateau-bytes`, and keeps that until SIGTERM. An allocation that fails
(the GPU is full) is recorded and tried again at the next period: the co-tenant's
own failures are reported apart from the engine's OOMs. On a CPU dry run it only
keeps the timeline, allocating nothing.
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

GIB = 1 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--go-file", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--start-delay-s", type=float, default=1.0)
    p.add_argument("--period-s", type=float, default=1.0)
    p.add_argument("--step-bytes", type=int, required=True)
    p.add_argument("--plateau-bytes", type=int, required=True)
    p.add_argument("--max-s", type=float, default=600.0, help="give up holding after this long")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    held: list[Any] = []
    held_bytes = 0
    events: list[dict[str, Any]] = []
    torch: Any = None
    if args.device == "cuda":
        import torch as torch_module

        torch = torch_module
        torch.cuda.init()
    t0 = float(wait_for_file(args.go_file, timeout_s=600)["t0"])
    next_at = t0 + args.start_delay_s
    while not stop.is_set() and time.time() - t0 < args.max_s:
        if held_bytes < args.plateau_bytes and time.time() >= next_at:
            size = min(args.step_bytes, args.plateau_bytes - held_bytes)
            event: dict[str, Any] = {"t": round(time.time() - t0, 4), "bytes": size}
            try:
                if torch is not None:
                    block = torch.empty(size, dtype=torch.uint8, device="cuda")
                    block.zero_()
                    torch.cuda.synchronize()
                    held.append(block)
                held_bytes += size
                event["ok"] = True
            except Exception as error:  # the co-tenant's own OOM: recorded, retried next period
                event["ok"] = False
                event["error"] = str(error).split("\n")[0][:300]
            event["held_bytes"] = held_bytes
            events.append(event)
            print(json.dumps(event), flush=True)
            next_at += args.period_s
        stop.wait(0.01)
    write_json(
        args.result,
        {
            "t0": t0,
            "plateau_bytes": args.plateau_bytes,
            "step_bytes": args.step_bytes,
            "period_s": args.period_s,
            "start_delay_s": args.start_delay_s,
            "held_bytes": held_bytes,
            "events": events,
            "failures": sum(1 for e in events if not e["ok"]),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
