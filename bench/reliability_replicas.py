"""Replicas under faults (issue 22): 2 decision + 2 executor + 2 validator under a burst, one of each killed -9
and one of each added mid-burst, on real Tansu and Redis; the same scenario as tests/reliability/test_replicas.py.

    .venv/bin/python -m bench.reliability_replicas [--runs N]

writes bench/results/reliability_replicas.json (the BENCHMARKS.md format): figures sum the runs, per-run
figures under `runs`. Needs the local Redis on 127.0.0.1:6379; starts its own Tansu and services.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.reliability_scenarios import ReplicaPlan, replicas_scenario

REDIS_URL = "redis://127.0.0.1:6379/0"
COMMAND = ".venv/bin/python -m bench.reliability_replicas"
SUMMED = ("sent", "handled", "lost", "duplicates_applied", "double_leases", "replicas_killed", "replicas_added")


async def run(runs: int, work: Path) -> list[dict[str, Any]]:
    out = []
    for index in range(runs):
        out.append(await replicas_scenario(work / f"run{index}", REDIS_URL, f"b{uuid.uuid4().hex[:10]}."))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sits-replicas-") as tmp:
        results = asyncio.run(run(args.runs, Path(tmp)))
    figures = {k: sum(int(r[k]) for r in results) for k in SUMMED}
    figures["verdicts"] = sum(int(r["verdicts"]) for r in results)
    figures["actions_without_verdict"] = sum(int(r["actions_without_verdict"]) for r in results)
    figures["actions_with_several_verdicts"] = sum(int(r["actions_with_several_verdicts"]) for r in results)
    plan = ReplicaPlan()
    path = write_result(
        "reliability_replicas",
        command=f"{COMMAND} --runs {args.runs}",
        figures=figures,
        baseline={
            "applied": sum(int(r["applied"]) for r in results),
            "lease_grants": sum(r["lease_grants"] for r in results),
        },
        goal={"lost": 0, "duplicates_applied": 0, "double_leases": 0, "actions_without_verdict": 0},
        notes=f"{args.runs} run(s) of {plan.replicas} replicas per service over {plan.partitions} partitions, "
        f"{plan.samples} samples + {plan.ooms} OOMs + {plan.garbage} garbage records per run; figures sum the runs. "
        f"Wall time {time.monotonic() - started:.0f} s.",
        extra={"runs": results},
    )
    print(f"wrote {path}")
    print(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
