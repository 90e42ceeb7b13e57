"""A STAND-IN for NVML, CPU rehearsal only: samples of a GPU that is not there, so the loop runs end to end.

The rehearsal checks the wiring (engine with the plugin, capture, decision, executor, validator,
the step-budget rules and their commands), not the physics: nothing can run out of memory on
the CPU. This stand-in publishes, at `--hz`, a virtual device of `--total-bytes` whose used
memory is `--engine-bytes` plus what the co-tenant (`cotenant.py --device cpu`) says it holds
in its state file, tagged SAMPLE_SOURCE_REPLAY so nobody takes it for a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path

from scenarios.h200_oom.gpu_standin import publish_stand_in_samples, stand_in_parser
from sits.v1 import common_pb2


def held(state_file: Path) -> int:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return int(json.loads(state_file.read_text())["held_bytes"])
    return 0


async def publish(args: argparse.Namespace) -> None:
    def used_bytes(_now: float) -> int:
        return int(min(args.total_bytes, args.engine_bytes + held(args.state_file)))

    target = common_pb2.Target(host=args.host, gpu_uuid=args.gpu_uuid, engine=args.engine)
    await publish_stand_in_samples(
        args.bootstrap, args.topic_prefix, target, "scenario/cpu-gpu", args.total_bytes, used_bytes, args.hz, args.max_s
    )


def main(argv: list[str] | None = None) -> int:
    p = stand_in_parser(__doc__.split("\n")[0])
    p.add_argument("--total-bytes", type=int, required=True)
    p.add_argument("--engine-bytes", type=int, required=True)
    p.add_argument("--state-file", type=Path, required=True)
    p.add_argument("--hz", type=float, default=10.0)
    p.add_argument("--max-s", type=float, default=900.0)
    asyncio.run(publish(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
