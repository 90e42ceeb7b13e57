"""Capture overhead: CPU per GPU of NVML sampling at 10 Hz and 100 Hz (runs on the H200).

    python -m bench.capture_overhead                  # on a GPU machine: measure, then write the result
    python -m bench.capture_overhead --from RAW.json  # write the result from a raw H200 measurement

The measurement is scripts/gpu/capture_nvml_overhead.py (also run by
scripts/gpu/capture_h200.sh): capture's real NvmlSource, alone in a process,
CPU seconds over wall seconds per GPU. Its baselines, measured in the same run:
the same source with the NVML read replaced by nothing, and the earlier design
that sampled on the event loop (one loop wake-up per sample).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import utc_stamp

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "capture_overhead.json"


def result_from_raw(raw: dict[str, Any], measured_at: str, command: str, note: str = "") -> dict[str, object]:
    runs = raw["runs"]
    assert isinstance(runs, dict)
    return {
        "name": "capture_overhead",
        "measured_at": measured_at,
        "machine": f"NVIDIA H200 ({raw['gpus']} GPU), device machine, kernel {raw.get('kernel', '?')}",
        "command": command,
        "figures": {
            "cpu_pct_per_gpu_10hz": round(runs["10hz"]["cpu_pct_per_gpu"], 3),
            "cpu_pct_per_gpu_100hz": round(runs["100hz"]["cpu_pct_per_gpu"], 3),
            "nvml_read_median_us": round(raw["read_all_gpus"]["median_us"], 1),
            "seconds_per_rate": raw["seconds_per_rate"],
            **{
                f"cpu_pct_first_gpu_only_{rate}": round(one["cpu_pct"], 3)
                for rate, one in raw.get("runs_first_gpu_only", {}).items()
            },
            **(
                {"v1_path_max_used_diff_mib": round(check["max_abs_used_diff_bytes"] / 2**20, 2)}
                if (check := raw.get("v1_minus_reserved_vs_v2"))
                else {}
            ),
        },
        "baseline": {
            "asyncio_loop_without_nvml_cpu_pct_10hz": round(runs["10hz"]["baseline_loop_without_nvml"]["cpu_pct"], 3),
            "asyncio_loop_without_nvml_cpu_pct_100hz": round(runs["100hz"]["baseline_loop_without_nvml"]["cpu_pct"], 3),
            **{
                f"sampling_on_the_event_loop_cpu_pct_per_gpu_{rate}": round(on_loop["cpu_pct_per_gpu"], 3)
                for rate in ("10hz", "100hz")
                if (on_loop := runs[rate].get("baseline_sampling_on_the_event_loop"))
            },
        },
        "goal": {"cpu_pct_per_gpu_100hz": 1.0},
        "notes": f"{raw['mode']}. {note}".strip(),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--from", dest="raw", type=Path, help="raw JSON written by capture_nvml_overhead.py")
    parser.add_argument("--measured-at", default=None)
    parser.add_argument("--note", default="", help="what the reader must know about this measurement")
    args = parser.parse_args()
    if args.raw is None:
        raw_path = Path(tempfile.mkdtemp()) / "raw.json"
        subprocess.run(
            [sys.executable, "-m", "scripts.gpu.capture_nvml_overhead", str(raw_path), "30"], cwd=ROOT, check=True
        )
        measured_at = utc_stamp()
        command = "python -m bench.capture_overhead (on the H200)"
    else:
        raw_path = args.raw
        measured_at = args.measured_at or utc_stamp()
        command = (
            "python -m scripts.gpu.capture_nvml_overhead RAW 15 (on the H200); "
            "python -m bench.capture_overhead --from RAW"
        )
    result = result_from_raw(json.loads(raw_path.read_text()), measured_at, command, args.note)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["figures"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
