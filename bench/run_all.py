"""`make bench`: run every CPU benchmark in turn, then render the results table.

GPU benchmarks (capture_overhead, estimator_validation, kernels_*, h200_oom_prevention)
run on the H200 through the device tool; their committed results are rendered too.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CPU_BENCHMARKS = [
    "capture_publish.py",
    "decision_throughput.py",
    "forecast_quality.py",
    "executor_reaction.py",
    "reaction_e2e.py",
    "pipeline_throughput.py",
    "envoy_overhead.py",
    "overload.py",
    "p0_path.py",
    "overload_http.py",
    "reliability.py",
    "reliability_replicas.py",
]


def main() -> int:
    failures = []
    for index, script in enumerate(CPU_BENCHMARKS, 1):
        path = BENCH / script
        if not path.exists():
            print(f"[{index}/{len(CPU_BENCHMARKS)}] {script}: missing", flush=True)
            failures.append(script)
            continue
        print(f"[{index}/{len(CPU_BENCHMARKS)}] {script} ...", flush=True)
        started = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", f"bench.{path.stem}"], cwd=BENCH.parent)
        print(f"    exit {rc} after {time.monotonic() - started:.0f} s", flush=True)
        if rc != 0:
            failures.append(script)
    subprocess.check_call([sys.executable, "-m", "bench.render_results"], cwd=BENCH.parent)
    if failures:
        print(f"failed or missing: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
