"""Plot of the two runs: GPU memory by process without and with SITS, and the requests served."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GIB = 1 << 30


def first_command_t(run: dict[str, Any]) -> float | None:
    times = [c["t"] for c in run.get("commands", []) if c.get("t") is not None]
    return min(times) if times else None


def oom_times(run: dict[str, Any]) -> list[float]:
    workload = run.get("workload") or {}
    return [o["t"] - run["t0"] for o in workload.get("ooms") or []]


def memory_series(run: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds since t0 -> GiB: device, engine process and co-tenant (NVML), and the engine's KV cache."""
    engine_pid = str(((run.get("workload") or {}).get("ready") or {}).get("pid", ""))
    squeezer_pid = str(run.get("squeezer_pid", ""))
    series: dict[str, tuple[list[float], list[float]]] = {}
    samples = [s for s in run.get("nvml", []) if "used" in s and s.get("t") is not None]
    if samples:
        ts = [s["t"] for s in samples]
        series["device used"] = (ts, [s["used"] / GIB for s in samples])
        series["engine"] = (ts, [s["procs"].get(engine_pid, 0) / GIB for s in samples])
        series["co-tenant"] = (ts, [s["procs"].get(squeezer_pid, 0) / GIB for s in samples])
        series["device total"] = (ts, [s["total"] / GIB for s in samples])
    timeline = (run.get("workload") or {}).get("timeline") or []
    if timeline:
        series["engine KV cache"] = ([p["t"] for p in timeline], [p["kv_bytes"] / GIB for p in timeline])
    return series


def completed_series(run: dict[str, Any]) -> tuple[list[float], list[int]]:
    requests = (run.get("workload") or {}).get("requests") or []
    done = sorted(r["completed"] for r in requests if r.get("completed") is not None)
    return done, list(range(1, len(done) + 1))


def plot(without: dict[str, Any], with_sits: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 11), sharex=True)
    colours = {
        "device used": "black",
        "engine": "tab:blue",
        "co-tenant": "tab:purple",
        "device total": "grey",
        "engine KV cache": "tab:cyan",
    }
    for ax, run, title in (
        (axes[0], without, "without SITS (capture + decision watch, nothing acts)"),
        (axes[1], with_sits, "with SITS (capture -> decision -> executor)"),
    ):
        for name, (ts, values) in memory_series(run).items():
            style = "--" if name == "device total" else "-"
            ax.plot(ts, values, style, label=name, color=colours.get(name), linewidth=1.2)
        warning = first_command_t(run)
        if warning is not None:
            ax.axvline(warning, color="tab:orange", linestyle="--", label=f"first warning {warning:.1f} s")
        for t in oom_times(run):
            ax.axvline(t, color="red", linewidth=2, label=f"CUDA OOM {t:.1f} s (engine dead)")
        for change in (run.get("workload") or {}).get("limit_changes") or []:
            cap = change["limits"].get("max_num_running_reqs")
            ax.axvline(
                change["t"],
                color="tab:green",
                linestyle=":",
                label=f"batch cap -> {cap} at {change['t']:.1f} s",
            )
        ax.set_ylabel("GiB")
        ax.set_title(title)
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[2]
    for run, label, colour in (
        (without, "completed, without SITS", "tab:red"),
        (with_sits, "completed, with SITS", "tab:green"),
    ):
        ts, counts = completed_series(run)
        submitted = (run.get("workload") or {}).get("submitted", 0)
        ax.step(ts, counts, where="post", color=colour, label=f"{label} ({len(counts)}/{submitted})")
    ax.set_ylabel("requests")
    ax.set_xlabel("seconds since the scenario started (t0)")
    twin = ax.twinx()
    timeline = (with_sits.get("workload") or {}).get("timeline") or []
    twin.plot(
        [p["t"] for p in timeline],
        [p["running"] for p in timeline],
        color="tab:blue",
        alpha=0.5,
        label="running, with SITS",
    )
    twin.plot(
        [p["t"] for p in timeline],
        [p["cap"] for p in timeline],
        color="tab:blue",
        linestyle="--",
        label="batch cap, with SITS",
    )
    twin.set_ylabel("running requests / cap")
    lines = ax.get_legend_handles_labels()
    twin_lines = twin.get_legend_handles_labels()
    ax.legend(lines[0] + twin_lines[0], lines[1] + twin_lines[1], loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder, out = Path(args[0]), Path(args[1])
    without = json.loads((folder / "without.json").read_text())
    with_sits = json.loads((folder / "with.json").read_text())
    plot(without, with_sits, out)
    print(f"plot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
