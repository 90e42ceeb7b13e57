"""h200_oom_prevention: real CUDA OOMs on the H200, without SITS and with the SITS loop.

Turns the scenario's raw results (scenarios/h200_oom/run.py: one JSON per run)
into bench/results/h200_oom_prevention.json. The run itself needs the H200
(`OUT=dir scenarios/h200_oom/run_h200.sh`, see docs/h200_oom_prevention.md);
this script only reads what it wrote:

    python -m bench.h200_oom_prevention [--without FILE] [--with FILE]

Figures:
- ooms_without / ooms_with: CUDA OOMs inside the engine (each one kills it);
- served_ratio: requests completed with SITS / requests submitted;
- warning_lead_s: from SITS's first warning (the decision's first HealingCommand)
  in the run with SITS to the moment the OOM happened in the run without it
  (same workload, same co-tenant, both timed from their scenario start t0);
  warning_lead_same_run_s is the same span inside the run without SITS, where
  capture and decision watched, warned and nothing acted, so the OOM came.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result

NAME = "h200_oom_prevention"
COMMAND = "OUT=dir scenarios/h200_oom/run_h200.sh; python -m bench.h200_oom_prevention"


def first_warning_s(run: dict[str, Any]) -> float | None:
    times = [c["t"] for c in run.get("commands", []) if c.get("t") is not None]
    return min(times) if times else None


def ooms(run: dict[str, Any]) -> list[dict[str, Any]]:
    return list((run.get("workload") or {}).get("ooms") or [])


def oom_seconds(run: dict[str, Any]) -> list[float]:
    return [o["t"] - run["t0"] for o in ooms(run)]


def counts(run: dict[str, Any]) -> dict[str, int]:
    """Submitted, completed, lost (in the batch when the engine died) and never served."""
    workload = run.get("workload") or {}
    submitted = int(workload.get("submitted", 0))
    completed = int(workload.get("completed", 0))
    lost = sum(int(o.get("lost_requests", 0)) for o in ooms(run))
    return {
        "submitted": submitted,
        "completed": completed,
        "lost": lost,
        "never_served": submitted - completed - lost,
    }


def summarize(without: dict[str, Any], with_sits: dict[str, Any]) -> dict[str, Any]:
    oom_without = oom_seconds(without)
    warning_with = first_warning_s(with_sits)
    warning_without = first_warning_s(without)
    served = counts(with_sits)
    baseline_counts = counts(without)
    figures: dict[str, Any] = {
        "ooms_without": len(ooms(without)),
        "ooms_with": len(ooms(with_sits)),
        "served_ratio": round(served["completed"] / served["submitted"], 4) if served["submitted"] else None,
        "warning_lead_s": round(oom_without[0] - warning_with, 2) if oom_without and warning_with is not None else None,
        "warning_lead_same_run_s": round(oom_without[0] - warning_without, 2)
        if oom_without and warning_without is not None
        else None,
        "requests_lost_with": served["lost"],
        "requests_submitted": served["submitted"],
        "requests_completed_with": served["completed"],
        "first_warning_with_s": warning_with,
        "last_completion_with_s": max(
            (
                r["completed"]
                for r in (with_sits["workload"] or {}).get("requests", [])
                if r.get("completed") is not None
            ),
            default=None,
        ),
        "batch_cap_changes_with": [
            {"t_s": round(c["t"], 2), "max_num_running_reqs": c["limits"].get("max_num_running_reqs")}
            for c in (with_sits.get("workload") or {}).get("limit_changes") or []
        ],
        "preemptions_with": (with_sits.get("workload") or {}).get("preemptions"),
        "co_tenant_failures_with": (with_sits.get("squeezer") or {}).get("failures"),
        "peak_device_used_with_gib": round(
            max((s["used"] for s in with_sits.get("nvml", []) if "used" in s), default=0) / 2**30, 2
        ),
        "decode_step_s_median_with": round(float((with_sits.get("workload") or {}).get("step_s_median") or 0), 4),
    }
    baseline: dict[str, Any] = {
        "served_ratio_without": round(baseline_counts["completed"] / baseline_counts["submitted"], 4)
        if baseline_counts["submitted"]
        else None,
        "requests_lost_without": baseline_counts["lost"],
        "requests_never_served_without": baseline_counts["never_served"],
        "oom_at_s_without": round(oom_without[0], 2) if oom_without else None,
        "first_warning_without_s": warning_without,
        "decode_step_s_median_without": round(float((without.get("workload") or {}).get("step_s_median") or 0), 4),
    }
    return {"figures": figures, "baseline": baseline}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--without", type=Path, default=RESULTS / f"{NAME}_without.json")
    p.add_argument("--with", dest="with_sits", type=Path, default=RESULTS / f"{NAME}_with.json")
    args = p.parse_args(argv)
    without = json.loads(args.without.read_text())
    with_sits = json.loads(args.with_sits.read_text())
    summary = summarize(without, with_sits)
    squeezer = with_sits.get("squeezer") or {}
    steps = -(-int(squeezer.get("plateau_bytes", 0)) // max(1, int(squeezer.get("step_bytes", 1))))
    ready = (with_sits.get("workload") or {}).get("ready") or {}
    settings = (with_sits.get("workload") or {}).get("args") or {}
    notes = (
        "One run of each mode (device time is scarce), not a median. Workload: Llama-3-8B-shaped decoder "
        f"({ready.get('params')} random bf16 parameters), {settings.get('slots')} running slots, "
        f"{settings.get('requests')} requests of {settings.get('prompt_tokens')} prompt tokens and "
        f"{settings.get('min_new_tokens')}-{settings.get('max_new_tokens')} new tokens, submitted at t0; "
        f"co-tenant grows to {round(int(squeezer.get('plateau_bytes', 0)) / 2**30, 1)} GiB in {steps} steps, "
        f"one every {squeezer.get('period_s')} s from t0 + {squeezer.get('start_delay_s')} s. "
        "Default decision policy; no validator (see docs/h200_oom_prevention.md)."
    )
    path = write_result(
        NAME,
        command=COMMAND,
        figures=summary["figures"],
        baseline=summary["baseline"],
        goal={"ooms_without": ">= 1", "ooms_with": 0, "served_ratio": 0.95},
        machine_text="NVIDIA H200",
        notes=notes,
        extra={"measured_at": measured_at(with_sits)},
    )
    print(path.read_text())
    return 0


def measured_at(run: dict[str, Any]) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(float(run["t0"]), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


if __name__ == "__main__":
    sys.exit(main())
