"""Estimator against measured peak memory on the H200 (forward + greedy generate, random weights).

On the GPU machine this runs scripts/gpu/estimator.py and records the result;
elsewhere it turns that script's raw output (`--raw FILE`) into the result file.
Baseline, from the same measurements: the naive estimate weights + KV alone.

    python3 -m bench.estimator_validation                # on the H200
    .venv/bin/python -m bench.estimator_validation --raw raw.json
writes bench/results/estimator_validation.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def measure() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "raw.json"
        subprocess.run([sys.executable, "-m", "scripts.gpu.estimator", "--out", str(out)], cwd=ROOT, check=True)
        raw: dict[str, Any] = json.loads(out.read_text())
        return raw


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    models = []
    naive_errors = []
    for case in raw["cases"]:
        measured = case["measured"]
        estimate = case["estimate"]
        naive = estimate["weights_bytes"] + estimate["kv_bytes"]
        naive_error = (naive - measured["peak_allocated_bytes"]) / measured["peak_allocated_bytes"]
        naive_errors.append(abs(naive_error))
        models.append(
            {
                "model": case["model"],
                "batch": case["batch"],
                "seq_len": case["prompt_len"] + case["new_tokens"],
                "prefill_chunk_tokens": case["prefill_chunk_tokens"],
                "estimate_gib": round(estimate["allocator_bytes"] / 2**30, 3),
                "peak_allocated_gib": round(measured["peak_allocated_bytes"] / 2**30, 3),
                "peak_reserved_gib": round(measured["peak_reserved_bytes"] / 2**30, 3),
                "nvml_process_gib": None
                if measured["nvml_process_bytes"] is None
                else round(measured["nvml_process_bytes"] / 2**30, 3),
                "rel_error_allocated": round(case["rel_error_allocated"], 5),
                "rel_error_reserved": round(case["rel_error_reserved"], 5),
                "rel_error_nvml": None if case["rel_error_nvml"] is None else round(case["rel_error_nvml"], 5),
                "rel_error_weights": round(case["rel_error_weights"], 5),
                "rel_error_kv": round(case["rel_error_kv"], 5),
                "naive_rel_error": round(naive_error, 5),
            }
        )
    return {
        "name": "estimator_validation",
        "measured_at": raw["measured_at"],
        "machine": f"{raw['device']}, torch {raw['torch']}",
        "command": "python3 -m scripts.gpu.estimator (on the H200), then python3 -m bench.estimator_validation --raw",
        "figures": {
            "models": len(models),
            "max_rel_error": round(max(abs(m["rel_error_allocated"]) for m in models), 5),
            "max_rel_error_reserved": round(max(abs(m["rel_error_reserved"]) for m in models), 5),
            "per_model": models,
        },
        "baseline": {"naive_weights_plus_kv_max_rel_error": round(max(naive_errors), 5)},
        "goal": {"max_rel_error": 0.05},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raw", type=Path, help="raw output of scripts/gpu/estimator.py")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "estimator_validation.json")
    args = parser.parse_args()
    raw = json.loads(args.raw.read_text()) if args.raw else measure()
    result = summarise(raw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["figures"] | {"baseline": result["baseline"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
