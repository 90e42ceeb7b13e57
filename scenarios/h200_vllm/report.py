"""From the raw runs to the figures: deaths, requests served, warning lead, actions and verdicts.

Pure functions over the JSON `run.py` writes per scenario and mode (`summarize`), a plot per
scenario (`plot`), and the SITS trace of each run (`trace_records`) for the forecast benchmark.
Times are seconds from the run's t0 (when the clients and the co-tenant start).

- A run's engine died when its OOM hook reported an OOM, or vLLM's health check failed, or
  the engine's log shows a CUDA OOM; the death time is the OOM event's, else the first failed
  health check.
- The first warning is the first command the decision issued; in the run without SITS nothing
  applies it, so its lead over the death is measured in the same run (`lead_s`).
- Served: requests that got every token they asked for, over those sent.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

# How long after a command the engine's own memory is watched (the GPU policy's settle window, 4 s, plus margin).
ENGINE_GROWTH_WINDOW_S = 6.0
DEVICE_ONLY = {"gpu_memory_below"}


def ts(value: str | None) -> float | None:
    if not value:
        return None
    stamp = Timestamp()
    stamp.FromJsonString(value)
    return stamp.seconds + stamp.nanos / 1e9


def _rel(value: str | None, t0: float) -> float | None:
    t = ts(value)
    return None if t is None else round(t - t0, 3)


def commands(run: dict[str, Any]) -> list[dict[str, Any]]:
    t0 = float(run.get("t0") or 0.0)
    out = []
    for c in run.get("records", {}).get("commands", []):
        limits = c.get("engine_limits") or {}
        out.append(
            {
                "t": _rel(c.get("meta", {}).get("produced_at"), t0),
                "command_id": c.get("command_id"),
                "kind": str(c.get("kind", "")).removeprefix("ACTION_KIND_"),
                "rule": c.get("policy_rule"),
                "reason": c.get("reason"),
                "budget": limits.get("max_num_scheduled_tokens"),
                "promise_gpu_fraction": (c.get("promise") or {}).get("gpu_memory_fraction_below"),
                "promise_engine_bytes": (c.get("promise") or {}).get("engine_memory_bytes_below"),
            }
        )
    return sorted(out, key=lambda c: math.inf if c["t"] is None else c["t"])


def actions(run: dict[str, Any]) -> list[dict[str, Any]]:
    t0 = float(run.get("t0") or 0.0)
    out = []
    for r in run.get("records", {}).get("results", []):
        before = (r.get("before") or {}).get("engine_limits") or {}
        after = (r.get("after") or {}).get("engine_limits") or {}
        out.append(
            {
                "t": _rel(r.get("applied_at") or r.get("meta", {}).get("produced_at"), t0),
                "action_id": r.get("action_id"),
                "command_id": r.get("command_id"),
                "kind": str(r.get("kind", "")).removeprefix("ACTION_KIND_"),
                "status": str(r.get("status", "")).removeprefix("ACTION_STATUS_"),
                "direction": str(r.get("direction", "")).removeprefix("CHANGE_DIRECTION_"),
                "budget_before": before.get("max_num_scheduled_tokens"),
                "budget_after": after.get("max_num_scheduled_tokens"),
                "detail": r.get("detail", ""),
            }
        )
    return sorted(out, key=lambda a: math.inf if a["t"] is None else a["t"])


def verdicts(run: dict[str, Any]) -> list[dict[str, Any]]:
    t0 = float(run.get("t0") or 0.0)
    out = []
    for v in run.get("records", {}).get("verdicts", []):
        out.append(
            {
                "t": _rel(v.get("meta", {}).get("produced_at"), t0),
                "action_id": v.get("action_id"),
                "command_id": v.get("command_id"),
                "verdict": str(v.get("verdict", "")).removeprefix("VERDICT_"),
                "checks": [
                    {k: c.get(k) for k in ("name", "passed", "observed", "threshold", "detail")}
                    for c in v.get("checks", [])
                ],
            }
        )
    return sorted(out, key=lambda v: math.inf if v["t"] is None else v["t"])


def oom_times(run: dict[str, Any]) -> list[float]:
    t0 = float(run.get("t0") or 0.0)
    times = [_rel(o.get("meta", {}).get("produced_at"), t0) for o in run.get("records", {}).get("oom", [])]
    return sorted(t for t in times if t is not None)


def death(run: dict[str, Any]) -> tuple[bool, float | None]:
    """Whether the engine died in this run, and when (seconds from t0)."""
    ooms = oom_times(run)
    unhealthy = run.get("first_unhealthy_s")
    log_oom = bool(run.get("engine_log", {}).get("oom_in_log"))
    died = bool(ooms) or unhealthy is not None or log_oom
    candidates = [t for t in (ooms[0] if ooms else None, unhealthy) if t is not None]
    return died, (min(candidates) if candidates else None)


def served(run: dict[str, Any]) -> tuple[int, int]:
    outcomes = run.get("outcomes", [])
    return sum(1 for o in outcomes if o.get("completed")), len(outcomes)


def _engine_bytes(raw: dict[str, Any], pids: set[str]) -> int:
    """One recorded sample's device memory of the engine's processes (flagged, or among its pids)."""
    procs = raw.get("processes") or []
    return sum(int(p.get("used_bytes", 0)) for p in procs if p.get("is_target_engine") or str(p.get("pid")) in pids)


def engine_memory(run: dict[str, Any]) -> list[tuple[float, int]]:
    """The engine's own device memory over the run (NVML, its processes), seconds from t0."""
    t0 = float(run.get("t0") or 0.0)
    pids = {str(p) for p in _engine_pids(run)}
    series = []
    for raw in run.get("records", {}).get("metrics", []):
        mine = _engine_bytes(raw, pids)
        t = _rel(raw.get("meta", {}).get("produced_at"), t0)
        if mine > 0 and t is not None:
            series.append((t, mine))
    return series


def engine_growth_after(run: dict[str, Any], window_s: float) -> list[dict[str, Any]]:
    """Per command: the engine's own memory when it was issued and the most it held in the next `window_s`.

    A step-budget cut can only hold the engine's own memory; what the device shows also moves with other
    tenants. This reads whether each cut held it, from the recorded samples.
    """
    series = engine_memory(run)
    out = []
    for c in commands(run):
        if c["t"] is None:
            continue
        before = [b for t, b in series if t <= c["t"]]
        after = [b for t, b in series if c["t"] <= t <= c["t"] + window_s]
        if before and after:
            out.append(
                {
                    "t": c["t"],
                    "rule": c["rule"],
                    "engine_bytes_at_command": before[-1],
                    "engine_bytes_max_after": max(after),
                    "growth_bytes": max(after) - before[-1],
                }
            )
    return out


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    died, death_t = death(run)
    cmds = commands(run)
    warned = next((c["t"] for c in cmds if c["t"] is not None), None)
    done, sent = served(run)
    acts = actions(run)
    judged = verdicts(run)
    budgets = [s["budget"] for s in run.get("plugin_states", []) if s.get("budget")]
    return {
        "shape": run.get("shape"),
        "scenario": run.get("scenario"),
        "mode": run.get("mode"),
        "repeat": int(run.get("repeat") or 1),
        "error": run.get("error"),
        "died": died,
        "death_t": death_t,
        "ooms": len(oom_times(run)),
        "first_warning_t": warned,
        "lead_s": round(death_t - warned, 3) if died and death_t is not None and warned is not None else None,
        "submitted": sent,
        "completed": done,
        "served_ratio": round(done / sent, 4) if sent else None,
        "commands": len(cmds),
        "rules": dict(Counter(str(c["rule"]) for c in cmds)),
        "actions_applied": sum(1 for a in acts if a["status"] == "APPLIED"),
        "verdicts": dict(Counter(v["verdict"] for v in judged)),
        "budget_min": min(budgets) if budgets else None,
        "budget_start": budgets[0] if budgets else None,
        "engine_ready_s": run.get("engine_ready_s"),
        "cotenant_failures": (run.get("cotenant") or {}).get("failures"),
        "activation": activation(run),
        "engine_log": run.get("engine_log", {}),
        "commands_detail": cmds,
        "actions_detail": acts,
        "verdicts_detail": judged,
        "engine_memory_after_commands": engine_growth_after(run, ENGINE_GROWTH_WINDOW_S),
        "oom_events": [
            {k: o.get(k) for k in ("requested_bytes", "device_free_bytes", "message")}
            for o in run.get("records", {}).get("oom", [])
        ],
    }


def activation(run: dict[str, Any]) -> dict[str, Any]:
    """The largest step's activation memory as the engine's allocator measured it, beside vLLM's own profile.

    Measured: the allocator's peak minus its floor (what stays between steps), read by the plugin.
    The step: the largest token budget in force once the long prompts were queued (from the plan's
    trigger to the end of the load, while requests waited), which the queued prompts filled.
    """
    states = run.get("plugin_states", [])
    plan = run.get("plan", {})
    trigger, end = float(plan.get("trigger_s", 0.0)), float(plan.get("load_s", 0.0))
    peaks = [s["peak"] for s in states if s.get("peak")]
    floors = [s["floor"] for s in states if s.get("floor")]
    loaded = [
        s["budget"] for s in states if s.get("budget") and trigger <= s["t"] <= end and (s.get("waiting") or 0) > 0
    ]
    return {
        "profiled_peak_activation_gib": run.get("engine_log", {}).get("peak_activation_gib"),
        "profiled_at_tokens": (run.get("engine_args") or {}).get("max_num_batched_tokens"),
        "measured_peak_minus_floor_bytes": (max(peaks) - min(floors)) if peaks and floors else None,
        "largest_step_budget": max(loaded) if loaded else None,
    }


def summarize(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    per_run = []
    engine = ""
    for run in runs:
        s = summarize_run(run)
        per_run.append(s)
        engine = engine or str(run.get("engine", ""))
        key = (str(run.get("shape")), str(run.get("scenario")), s["repeat"])
        row = rows.setdefault(key, {"shape": key[0], "scenario": key[1], "repeat": key[2], "cause": run.get("cause")})
        mode = s["mode"]
        row[f"died_{mode}"] = s["died"]
        row[f"served_{mode}"] = f"{s['completed']}/{s['submitted']}"
        row[f"served_ratio_{mode}"] = s["served_ratio"]
        row[f"first_warning_t_{mode}"] = s["first_warning_t"]
        if mode == "without":
            row["death_t_without"] = s["death_t"]
            row["warning_lead_s"] = s["lead_s"]
        else:
            row["actions_with"] = s["actions_applied"]
            row["verdicts_with"] = s["verdicts"]
            row["budget_min_with"] = s["budget_min"]
            row["rules_with"] = s["rules"]
    table = list(rows.values())
    with_runs = [s for s in per_run if s["mode"] == "with"]
    leads = [r["warning_lead_s"] for r in table if r.get("warning_lead_s") is not None]
    done = sum(s["completed"] for s in with_runs)
    sent = sum(s["submitted"] for s in with_runs)
    totals = {
        "engine": engine,
        "scenarios": len(table),
        "engine_deaths_without": sum(1 for r in table if r.get("died_without")),
        "engine_deaths_with": sum(1 for r in table if r.get("died_with")),
        "served_ratio_with": round(done / sent, 4) if sent else None,
        "validator_ran": int(any(sum(s["verdicts"].values()) > 0 for s in with_runs)),
        "warning_lead_s_min": min(leads) if leads else None,
    }
    # The cuts (every command but a raise) against the engine's own memory, and the verdicts that failed
    # only on the device's memory: what a co-tenant took, not what the engine used.
    growth = [
        g["growth_bytes"] for s in with_runs for g in s["engine_memory_after_commands"] if "raise" not in str(g["rule"])
    ]
    if growth:
        totals["engine_memory_growth_after_cuts_max_bytes"] = max(growth)
    totals["verdicts_failed_only_on_device_memory"] = sum(
        1
        for s in with_runs
        for v in s["verdicts_detail"]
        if v["verdict"] != "CONFIRMED" and {c["name"] for c in v["checks"] if not c.get("passed")} == DEVICE_ONLY
    )
    return {"totals": totals, "scenarios": table, "runs": per_run}


def trace_records(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's metric samples and OOM events (as capture published them) as SITS trace v1 records."""
    from google.protobuf.json_format import ParseDict

    from sits.runtime.traces import oom_to_record, sample_to_record
    from sits.v1 import events_pb2

    t0 = float(run.get("t0") or 0.0)
    records = []
    for raw in run.get("records", {}).get("metrics", []):
        body = {k: v for k, v in raw.items() if not k.startswith("_")}
        if "undecodable" in body:
            continue
        sample = ParseDict(body, events_pb2.MetricSample(), ignore_unknown_fields=True)
        t = sample.meta.produced_at.seconds + sample.meta.produced_at.nanos / 1e9 - t0
        records.append(sample_to_record(sample, t))
    for raw in run.get("records", {}).get("oom", []):
        body = {k: v for k, v in raw.items() if not k.startswith("_")}
        oom = ParseDict(body, events_pb2.OomEvent(), ignore_unknown_fields=True)
        t = oom.meta.produced_at.seconds + oom.meta.produced_at.nanos / 1e9 - t0
        records.append(oom_to_record(oom, t))
    records.sort(key=lambda r: r["t"])
    if not records:
        return []
    start = records[0]["t"]
    for r in records:
        r["t"] = round(r["t"] - start, 4)
    return records


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """One figure per scenario: memory by process, the step token budget, requests served; without | with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_mode = {r["mode"]: r for r in runs}
    modes = [m for m in ("without", "with") if m in by_mode]
    fig, axes = plt.subplots(3, len(modes), figsize=(6.5 * len(modes), 9), sharex=True, squeeze=False)
    gib = float(1 << 30)
    for col, mode in enumerate(modes):
        run = by_mode[mode]
        t0 = float(run.get("t0") or 0.0)
        engine_pids = {str(p) for p in _engine_pids(run)}
        ts_, used, eng, other = [], [], [], []
        for raw in run.get("records", {}).get("metrics", []):
            gpu = raw.get("gpu")
            if not gpu:
                continue
            t = _rel(raw.get("meta", {}).get("produced_at"), t0)
            if t is None:
                continue
            mine = _engine_bytes(raw, engine_pids)
            rest = sum(int(p.get("used_bytes", 0)) for p in raw.get("processes", [])) - mine
            ts_.append(t)
            used.append(int(gpu.get("used_bytes", 0)) / gib)
            eng.append(mine / gib)
            other.append(rest / gib)
        ax = axes[0][col]
        if ts_:
            total = (
                max(int(r.get("gpu", {}).get("total_bytes", 0)) for r in run["records"]["metrics"] if r.get("gpu"))
                / gib
            )
            ax.stackplot(ts_, eng, other, labels=["vLLM engine", "co-tenant and others"], alpha=0.7)
            ax.plot(ts_, used, color="black", lw=0.8, label="device used")
            ax.axhline(total, color="red", ls="--", lw=0.8, label="device total")
        died, death_t = death(run)
        for a in axes[:, col]:
            if died and death_t is not None:
                a.axvline(death_t, color="red", lw=1.5)
            for c in commands(run)[:1]:
                if c["t"] is not None:
                    a.axvline(c["t"], color="orange", lw=1, ls=":")
        ax.set_ylabel("GiB")
        title = f"{run.get('scenario')} - {mode} SITS" + (" (engine died)" if died else "")
        ax.set_title(title)
        ax.legend(loc="lower right", fontsize=7)
        states = run.get("plugin_states", [])
        axes[1][col].step([s["t"] for s in states], [s.get("budget") or 0 for s in states], where="post")
        axes[1][col].set_ylabel("step token budget")
        axes[1][col].set_ylim(bottom=0)
        outcomes = sorted((o["t_done"], o["completed"]) for o in run.get("outcomes", []) if o.get("t_done") is not None)
        done_t, done_n, failed_n = [], [], []
        n_ok = n_bad = 0
        for t, ok in outcomes:
            n_ok += int(ok)
            n_bad += int(not ok)
            done_t.append(t)
            done_n.append(n_ok)
            failed_n.append(n_bad)
        axes[2][col].step(done_t, done_n, where="post", label="served")
        axes[2][col].step(done_t, failed_n, where="post", color="red", label="failed")
        axes[2][col].set_ylabel("requests")
        axes[2][col].set_xlabel("seconds from t0 (orange: first warning, red: death)")
        axes[2][col].legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _engine_pids(run: dict[str, Any]) -> list[int]:
    return [int(p) for p in run.get("engine_pids", [])]


def write_trace_of(run: dict[str, Any], path: str, name: str = "") -> int:
    """The run as a SITS trace v1 file; its header says what ran and how it ended."""
    from sits.runtime.traces import TraceHeader, TraceTarget, write_trace

    records = trace_records(run)
    if not records:
        return 0
    died, death_t = death(run)
    device = run.get("device") or {}
    header = TraceHeader(
        name=name or f"{run.get('shape')}_{run.get('scenario')}_{run.get('mode')}",
        description=f"real vLLM ({run.get('engine')}), {run.get('cause')}; SITS {run.get('mode')}",
        recorded_on=f"{device.get('name', '')}, driver {device.get('driver', '')}",
        target=TraceTarget(host="gpu-host", gpu_uuid=str(device.get("uuid", "")), engine="vllm-0"),
        total_bytes=int(device.get("total", 0)),
        extra={
            "recorder": "scenarios/h200_vllm (capture's own samples from sits.metrics.v1)",
            "outcome": "engine died of a CUDA OOM" if died else "engine alive",
            "sits_acting": run.get("mode") == "with",
            "decision_model": run.get("shape"),
            "death_t_from_t0": death_t,
            "t0_offset_s": round(float(run.get("t0") or 0.0) - _first_t(run), 3),
        },
    )
    return write_trace(path, header, records)


def _first_t(run: dict[str, Any]) -> float:
    times = [ts(r.get("meta", {}).get("produced_at")) for r in run.get("records", {}).get("metrics", [])]
    found = [t for t in times if t is not None]
    return min(found) if found else float(run.get("t0") or 0.0)


def main(argv: list[str] | None = None) -> int:
    """python -m scenarios.h200_vllm.report RAW_DIR [RAW_DIR ...] OUT_DIR: summary.json, a plot per scenario, traces.

    Several raw directories may hold repeats of the same scenario (one device call each): each run is
    numbered in the order given, per shape, scenario and mode.
    """
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("raw", type=Path, nargs="+")
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    seen: Counter[tuple[str, str, str]] = Counter()
    for raw in args.raw:
        for path in sorted(raw.glob("*.json")):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and "scenario" in data and "mode" in data:
                key = (str(data.get("shape")), str(data["scenario"]), str(data["mode"]))
                seen[key] += 1
                data["repeat"] = seen[key]
                runs.append(data)
    runs.sort(key=lambda r: (str(r.get("shape")), str(r.get("scenario")), r["repeat"], r.get("mode") != "without"))
    summary = summarize(runs)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((str(run.get("shape")), str(run.get("scenario")), run["repeat"]), []).append(run)
    for (shape_name, scenario, repeat), group in groups.items():
        stem = f"{shape_name}_{scenario}" + (f"_r{repeat}" if max(seen.values()) > 1 else "")
        plot(group, str(args.out / f"{stem}.png"))
        for run in group:
            write_trace_of(run, str(args.out / f"{stem}_{run['mode']}.jsonl.gz"), name=f"{stem}_{run['mode']}")
    print(json.dumps(summary["totals"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
