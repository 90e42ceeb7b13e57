#!/usr/bin/env bash
# The CPU floor of periodic sampling on this machine, native vs Python, in one run:
#   C: wake at 100 Hz (clock_nanosleep, absolute deadlines), then the same plus one NVML v1 memory read;
#   Python: the same two through scripts/gpu/nvml_call_costs.py (a thread, as capture samples).
# Usage (repository root; the H200 through the device tool, carry ["build/wake_floor"] when the
# machine has no C compiler): OUT=dir bash scripts/gpu/wake_floor.sh [seconds]
# Result: $OUT/wake_floor.json (copy to bench/results/wake_floor_h200.json) and $OUT/wake_floor.log.
set -euo pipefail
out="${OUT:-/tmp/wake-floor}"
seconds="${1:-10}"
mkdir -p "$out" build/wake_floor
if command -v cc >/dev/null; then
  cc -O2 -o build/wake_floor/wake_floor scripts/gpu/wake_floor.c -ldl
fi
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  for mode in 0 1 0 1; do build/wake_floor/wake_floor 100 "$seconds" "$mode"; done
  build/wake_floor/wake_floor 10 "$seconds" 1
  PYTHONPATH="$PWD" python3 -m scripts.gpu.nvml_call_costs "$seconds" 100
} 2>&1 | tee "$out/wake_floor.log"
PYTHONPATH="$PWD" python3 - "$out" <<'PY'
import datetime as dt
import json
import sys
from pathlib import Path

from bench.common import median

out = Path(sys.argv[1])
lines = [json.loads(l) for l in (out / "wake_floor.log").read_text().splitlines() if l.startswith("{")]
native = [r for r in lines if "mode" in r]
python = [r for r in lines if "mode" not in r]

figures = {
    "native_wake_only_cpu_pct_100hz": median([r["cpu_pct"] for r in native if r["mode"] == 0 and r["hz"] == 100]),
    "native_wake_and_v1_read_cpu_pct_100hz": median([r["cpu_pct"] for r in native if r["mode"] == 1 and r["hz"] == 100]),
    "native_wake_and_v1_read_cpu_pct_10hz": median([r["cpu_pct"] for r in native if r["mode"] == 1 and r["hz"] == 10]),
}
costs = python[0]["cpu_pct_of_a_core"]
baseline = {
    "python_wake_only_cpu_pct_100hz": costs["nothing"],
    "python_wake_and_v1_read_cpu_pct_100hz": costs["memory_v1_without_wrapper"],
}
result = {
    "name": "wake_floor_h200",
    "measured_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "machine": (out / "wake_floor.log").read_text().splitlines()[0],
    "command": "bash scripts/gpu/wake_floor.sh (on the H200, through the device tool's run)",
    "figures": figures,
    "baseline": baseline,
    "goal": {},
    "notes": "% of one core. Native: a C thread with absolute clock_nanosleep deadlines, v1 memory read "
    "through libnvidia-ml; baseline: the same in a Python thread (scripts/gpu/nvml_call_costs.py).",
    "native_runs": native,
    "python_call_costs": python,
}
(out / "wake_floor.json").write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({**figures, **baseline}))
PY
