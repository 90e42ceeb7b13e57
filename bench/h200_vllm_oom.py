"""h200_vllm_oom: real vLLM on the H200 dies of a CUDA OOM without SITS and lives with it.

Turns what the H200 runs wrote (see docs/h200_oom_prevention.md) into
bench/results/h200_vllm_oom.json; the runs themselves need the GPU:

    OUT=dir scenarios/h200_vllm/run_h200.sh scenarios --shape llama-3-8b    # and --shape qwen2.5-14b
    OUT=dir scenarios/h200_vllm/run_h200.sh overhead
    python -m scenarios.h200_vllm.report RAW_DIR OUT_DIR   # -> summary.json (bench/results/h200_vllm_oom_runs.json)
    python -m bench.h200_vllm_oom [--runs FILE] [--overhead FILE]

Figures (keys of BENCHMARKS.md): per scenario, engine deaths without and with SITS, requests
served with SITS, the first warning's lead over the death in the run without SITS, actions and
verdicts; the totals; `plugin_decode_overhead_pct` (decode tokens/s lost with the SITS plugin,
capture polling it, against vLLM's own scheduler, async scheduling on in both); and the
estimator's activation need per step against vLLM's profiled peak and the engine's measured
allocator peak (`estimator_*`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from services.decision.domain.kv_model import known_model

NAME = "h200_vllm_oom"
COMMAND = (
    "scenarios/h200_vllm/run_h200.sh scenarios, then overhead (H200); python -m scenarios.h200_vllm.report; "
    "python -m bench.h200_vllm_oom"
)
GIB = 1 << 30
MAX_NUM_SEQS = 128


def estimate(model: str, tokens: int) -> int:
    """The estimator's allocated activation bytes of a full step of `tokens` (logits for MAX_NUM_SEQS)."""
    return known_model(model).activation_bytes(tokens, min(MAX_NUM_SEQS, tokens), 2)


def per_token(model: str) -> int:
    shape = known_model(model)
    return shape.activation_bytes(1, 0, 2)


def estimator_checks(runs: list[dict[str, Any]], overhead: dict[str, Any]) -> dict[str, Any]:
    """The estimator against vLLM's own profiled peak (its log) and against the allocator's measured peak."""
    profiled: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for run in runs:
        act = run.get("activation") or {}
        model, tokens, gib = run.get("shape"), act.get("profiled_at_tokens"), act.get("profiled_peak_activation_gib")
        if not (model and tokens and gib) or (model, tokens) in seen:
            continue
        seen.add((model, tokens))
        est = estimate(model, tokens)
        profiled.append(
            {
                "model": model,
                "tokens": tokens,
                "mode": "eager",
                "vllm_peak_activation_gib": gib,
                "estimate_gib": round(est / GIB, 3),
                "rel_error": round(est / (gib * GIB) - 1, 4),
            }
        )
    for variant in ("default", "sits"):
        log = (overhead.get(variant) or {}).get("engine_log") or {}
        tokens = (overhead.get("load") or {}).get("budget")
        model = overhead.get("shape")
        if log.get("peak_activation_gib") and tokens and model and variant == "default":
            est = estimate(model, tokens)
            profiled.append(
                {
                    "model": model,
                    "tokens": tokens,
                    "mode": "torch.compile + CUDA graphs",
                    "vllm_peak_activation_gib": log["peak_activation_gib"],
                    "estimate_gib": round(est / GIB, 3),
                    "rel_error": round(est / (log["peak_activation_gib"] * GIB) - 1, 4),
                }
            )
    # Measured: runs with SITS, where every step ran to its end (the largest at the budget in force
    # while long prompts were queued); per shape, the slope between two budgets gives bytes per token.
    measured: list[dict[str, Any]] = []
    for run in runs:
        act = run.get("activation") or {}
        if (
            run.get("mode") != "with"
            or not act.get("measured_peak_minus_floor_bytes")
            or not act.get("largest_step_budget")
        ):
            continue
        tokens, got = int(act["largest_step_budget"]), int(act["measured_peak_minus_floor_bytes"])
        measured.append(
            {
                "model": run.get("shape"),
                "scenario": run.get("scenario"),
                "tokens": tokens,
                "measured_bytes": got,
                "measured_gib": round(got / GIB, 3),
                "estimate_gib": round(estimate(str(run.get("shape")), tokens) / GIB, 3),
                "rel_error": round(estimate(str(run.get("shape")), tokens) / got - 1, 4),
            }
        )
    slopes = []
    for model in sorted({str(m["model"]) for m in measured}):
        points = sorted({(m["tokens"], m["measured_bytes"]) for m in measured if m["model"] == model})
        if len(points) >= 2 and points[-1][0] != points[0][0]:
            (t1, b1), (t2, b2) = points[0], points[-1]
            slope = (b2 - b1) / (t2 - t1)
            slopes.append(
                {
                    "model": model,
                    "measured_bytes_per_token": round(slope),
                    "estimate_bytes_per_token": per_token(model),
                    "rel_error": round(per_token(model) / slope - 1, 4),
                }
            )
    return {"vs_vllm_profile": profiled, "vs_measured_step": measured, "per_token_slope": slopes}


def build(
    runs_summary: dict[str, Any], overhead: dict[str, Any], measured_steps: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    totals = runs_summary["totals"]
    runs = runs_summary["runs"]
    rows = []
    for row in runs_summary["scenarios"]:
        rows.append(
            {
                "shape": row["shape"],
                "scenario": row["scenario"],
                "repeat": row.get("repeat", 1),
                "cause": row.get("cause"),
                "engine_deaths_without": int(bool(row.get("died_without"))),
                "engine_deaths_with": int(bool(row.get("died_with"))),
                "served_with": row.get("served_with"),
                "served_ratio_with": row.get("served_ratio_with"),
                "served_without": row.get("served_without"),
                "warning_lead_s": row.get("warning_lead_s"),
                "death_t_without_s": row.get("death_t_without"),
                "first_warning_t_without_s": row.get("first_warning_t_without"),
                "first_warning_t_with_s": row.get("first_warning_t_with"),
                "actions_with": row.get("actions_with"),
                "verdicts_with": row.get("verdicts_with"),
                "token_budget_min_with": row.get("budget_min_with"),
            }
        )
    checks = estimator_checks(runs, overhead)
    if not measured_steps:
        checks["vs_measured_step"], checks["per_token_slope"] = [], []
    errors = [abs(c["rel_error"]) for c in checks["vs_vllm_profile"] + checks["per_token_slope"]]
    figures = {
        "engine": totals["engine"],
        "scenarios": rows,
        "engine_deaths_without": totals["engine_deaths_without"],
        "engine_deaths_with": totals["engine_deaths_with"],
        "served_ratio_with": totals["served_ratio_with"],
        "validator_ran": totals["validator_ran"],
        "warning_lead_s_min": totals["warning_lead_s_min"],
        "engine_memory_growth_after_cuts_max_bytes": totals.get("engine_memory_growth_after_cuts_max_bytes"),
        "verdicts_failed_only_on_device_memory": totals.get("verdicts_failed_only_on_device_memory"),
        "plugin_decode_overhead_pct": overhead.get("plugin_decode_overhead_pct"),
        "plugin_decode_overhead_pct_median": overhead.get("plugin_decode_overhead_pct_median"),
        "plugin_step_time_added_pct": overhead.get("step_time_added_pct"),
        "scenario_runs": len(rows),
        "verdicts_confirmed": sum((r.get("verdicts_with") or {}).get("CONFIRMED", 0) for r in rows),
        "verdicts_total": sum(sum((r.get("verdicts_with") or {}).values()) for r in rows),
        # Against vLLM's profiled peak and the measured bytes per token (the model's slope)...
        "estimator_max_rel_error": round(max(errors), 4) if errors else None,
        # ...and against one measured step whole: the estimate also counts logits for every sequence
        # the engine may hold, which a prefill step does not have (it errs on the safe side).
        "estimator_step_max_rel_error": round(max(abs(m["rel_error"]) for m in checks["vs_measured_step"]), 4)
        if checks["vs_measured_step"]
        else None,
        "estimator": checks,
    }
    without = [r for r in runs if r["mode"] == "without"]
    sent = sum(r["submitted"] for r in without)
    done = sum(r["completed"] for r in without)
    baseline = {
        "served_ratio_without": round(done / sent, 4) if sent else None,
        "tokens_per_s_default_scheduler": (overhead.get("default") or {}).get("tokens_per_s_best"),
        "tokens_per_s_sits_plugin": (overhead.get("sits") or {}).get("tokens_per_s_best"),
    }
    return figures, baseline


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, default=RESULTS / "h200_vllm_oom_runs.json")
    p.add_argument("--overhead", default=str(RESULTS / "h200_vllm_overhead.json"), help="'' for none")
    p.add_argument("--measured-at", default="2026-12-04T00:44:37Z")
    p.add_argument("--name", default=NAME, help="the result's name (another device than the H200: say which)")
    p.add_argument("--machine", default="NVIDIA H200 (143771 MiB, driver 580.159.04), vLLM 0.26.0, torch 2.11.0+cu130")
    p.add_argument("--notes", default="single runs per scenario and mode (device time is short)")
    p.add_argument(
        "--profile-only-estimator",
        action="store_true",
        help="check the estimator against vLLM's profile only: where a co-tenant holds the line, the engine's "
        "allocator empties its cache and grows it again, so its peak minus floor no longer measures one step",
    )
    args = p.parse_args()
    overhead = json.loads(Path(args.overhead).read_text()) if args.overhead else {}
    figures, baseline = build(json.loads(args.runs.read_text()), overhead, not args.profile_only_estimator)
    path = write_result(
        args.name,
        command=COMMAND,
        figures=figures,
        baseline=baseline,
        goal={
            "engine_deaths_without": figures["scenario_runs"],
            "engine_deaths_with": 0,
            "served_ratio_with": 0.95,
            "validator_ran": 1,
            "plugin_decode_overhead_pct": 1.0,
            "estimator_max_rel_error": 0.1,
        },
        machine_text=args.machine,
        notes=f"{args.notes}; deaths from the OOM hook's event and vLLM's health check; lead = death - first "
        "decision command, inside the run without SITS",
        extra={"measured_at": args.measured_at},
    )
    print(path)
    print(json.dumps({k: v for k, v in figures.items() if k not in ("scenarios", "estimator")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
