"""The run report: a PNG timeline and an HTML page around it, with the run without SITS beside the run with it.

The timeline puts what people want to correlate on one time axis: the engine
(KV usage, running requests and its cap) with each action and verdict marked;
P0's queue wait in the engine against its objective, with the lower-tier budget
the controller set; every request's time to first token by tier; and what
happened to requests second by second. Phases (without SITS, with SITS) are
shaded and labelled. The page adds the peak-load summary of each phase side by
side, every action with why, and every verdict with the promise it checked.
"""

from __future__ import annotations

import base64
import html
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from sits.runtime.contract import ALL_TIERS
from sits_app.demo.timeline import Timeline, oscillations, percentile

COLORS = {"P0": "#1b7837", "P1": "#4393c3", "P2": "#d6604d"}
VERDICT_MARK = {
    "CONFIRMED": ("#1b7837", "v"),
    "NOT_KEPT": ("#e08214", "s"),
    "ROLLED_BACK": ("#b2182b", "x"),
    "INCONCLUSIVE": ("#878787", "o"),
}
PHASE_SHADE = {"without SITS": "#f4a582", "with SITS": "#92c5de"}
REFUSED = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")


# The phase on the engine without the plugin (`sits_app.demo.paths.start_baseline`): no queue-wait signal there.
WITHOUT_SITS = "without SITS"


@dataclass(frozen=True)
class PhaseWindow:
    """One phase of a run on the timeline's clock: its start, when the peak load begins, its end."""

    name: str
    start: float
    peak_start: float
    end: float


@dataclass(frozen=True)
class PrioritySummary:
    priority: str
    submitted: int
    served: int
    shed: int
    failed: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


def summarize(
    timeline: Timeline, since: float = 0.0, until: float = float("inf"), path: str | None = None
) -> list[PrioritySummary]:
    out = []
    for priority in (tier.name for tier in ALL_TIERS):
        reqs = [
            r
            for r in timeline.requests
            if r.priority == priority and since <= r.t < until and (path is None or r.path == path)
        ]
        ttfts = [r.ttft_s for r in reqs if r.ttft_s is not None and r.status == "OK"]
        shed = sum(1 for r in reqs if r.status in REFUSED)
        served = sum(1 for r in reqs if r.status == "OK")
        p50, p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
        out.append(
            PrioritySummary(
                priority,
                len(reqs),
                served,
                shed,
                len(reqs) - served - shed,
                None if p50 is None else p50 * 1000,
                None if p99 is None else p99 * 1000,
            )
        )
    return out


def _shade(axes: list[Any], windows: list[PhaseWindow]) -> None:
    for window in windows:
        for index, ax in enumerate(axes):
            ax.axvspan(window.start, window.end, color=PHASE_SHADE.get(window.name, "#dddddd"), alpha=0.12, lw=0)
            if index == 0:
                ax.text(
                    (window.start + window.end) / 2,
                    1.035,
                    window.name,
                    ha="center",
                    fontsize=9,
                    weight="bold",
                    transform=ax.get_xaxis_transform(),
                )


def p0_queue_wait_ms(timeline: Timeline, windows: list[PhaseWindow]) -> list[tuple[float, float]]:
    """(t, P0 queue wait p90 in ms) for the latency panel; NaN (a break in the line) over the phase without SITS.

    The plugin's engine idles through that phase: its zeros there say nothing about the phase.
    """
    unmeasured = [(w.start, w.end) for w in windows if w.name == WITHOUT_SITS]
    return [
        (s.t, math.nan if any(a <= s.t <= b for a, b in unmeasured) else s.p0_queue_wait_s * 1000)
        for s in timeline.samples
        if s.p0_queue_wait_s is not None
    ]


def plot_timeline(
    timeline: Timeline,
    path: Path,
    title: str = "SITS demo",
    windows: list[PhaseWindow] | None = None,
    objective_s: float | None = None,
) -> None:
    windows = windows or []
    fig, (ax_engine, ax_wait, ax_ttft, ax_req) = plt.subplots(
        4, 1, figsize=(13, 13), sharex=True, height_ratios=[3, 2, 3, 2]
    )
    fig.suptitle(title)
    targets = sorted({s.target for s in timeline.samples})
    for target in targets:
        points = [s for s in timeline.samples if s.target == target]
        kv = [(s.t, s.kv_usage) for s in points if s.kv_usage is not None]
        mem = [(s.t, s.memory_fraction) for s in points if s.memory_fraction is not None]
        if kv:
            ax_engine.plot(*zip(*kv, strict=True), label=f"{target} KV usage", lw=1.3)
        if mem and mem != kv:
            ax_engine.plot(*zip(*mem, strict=True), label=f"{target} memory", lw=1.0, ls="--")
    forecasts = [(f.t, f.predicted_fraction) for f in timeline.forecasts]
    if forecasts:
        ax_engine.plot(*zip(*forecasts, strict=True), label="forecast at horizon", lw=0.8, color="#9970ab", alpha=0.7)
    kinds = sorted({a.kind for a in timeline.actions if a.status == "APPLIED"})
    palette = plt.get_cmap("tab10")
    for index, kind in enumerate(kinds):
        times = [a.t for a in timeline.actions if a.kind == kind and a.status == "APPLIED"]
        for n, t in enumerate(times):
            ax_engine.axvline(t, color=palette(index), lw=1, alpha=0.5, label=f"action {kind}" if n == 0 else None)
    for verdict, (color, marker) in VERDICT_MARK.items():
        times = [v.t for v in timeline.verdicts if v.verdict == verdict]
        if times:
            ax_engine.scatter(
                times,
                [1.0] * len(times),
                color=color,
                marker=marker,
                s=40,
                label=f"verdict {verdict}",
                clip_on=False,
                zorder=5,
            )
    ax_engine.set_ylabel("fraction of the KV cache")
    ax_engine.set_ylim(0, 1.05)
    ax_engine.legend(loc="lower left", fontsize=7, ncol=3)
    ax_engine.grid(alpha=0.3)

    waits = p0_queue_wait_ms(timeline, windows)
    if waits:
        ax_wait.plot(*zip(*waits, strict=True), color=COLORS["P0"], lw=1.0, label="P0 queue wait in the engine (p90)")
    if objective_s is not None:
        ax_wait.axhline(objective_s * 1000, color="#b2182b", ls="--", lw=1.2, label="P0's objective")
    ax_wait.set_ylabel("ms")
    ax_wait.grid(alpha=0.3)
    budget_points = []
    for action in sorted(timeline.actions, key=lambda a: a.t):
        if action.kind == "SET_TIER_BUDGET" and action.status in ("APPLIED", "ROLLED_BACK", "EXPIRED"):
            limited = [v for k, v in action.values.items() if k.startswith("budget.")]
            budget_points.append((action.t, sum(limited) if limited else None))
    if budget_points:
        ax_budget = ax_wait.twinx()
        xs, ys = [], []
        for t, value in budget_points:
            xs.append(t)
            ys.append(float("nan") if value is None else value)
        ax_budget.step(xs, ys, where="post", color="#762a83", lw=1.3, label="lower-tier budget (streams)")
        ax_budget.set_ylabel("budget (streams)")
        ax_budget.set_ylim(bottom=0)
        ax_budget.legend(loc="upper right", fontsize=8)
    ax_wait.legend(loc="upper left", fontsize=8)

    for priority in (tier.name for tier in ALL_TIERS):
        pts = [(r.t, r.ttft_s * 1000) for r in timeline.requests if r.priority == priority and r.ttft_s is not None]
        if pts:
            ax_ttft.scatter(
                *zip(*pts, strict=True),
                s=5,
                alpha=0.45,
                color=COLORS[priority],
                label=f"{priority} time to first token",
            )
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_yscale("log")
    if any(r.ttft_s is not None for r in timeline.requests):
        ax_ttft.legend(loc="upper left", fontsize=8)
    else:
        ax_ttft.text(0.5, 0.5, "no client load in this run", transform=ax_ttft.transAxes, ha="center")
    ax_ttft.grid(alpha=0.3, which="both")

    if timeline.requests:
        end = max(1, int(max(r.t for r in timeline.requests)) + 1)
        start = min(0, int(min(r.t for r in timeline.requests)))
        served: Counter[int] = Counter(int(r.t) for r in timeline.requests if r.status == "OK")
        shed: Counter[int] = Counter(int(r.t) for r in timeline.requests if r.status in REFUSED)
        other: Counter[int] = Counter(int(r.t) for r in timeline.requests if r.status not in ("OK", *REFUSED))
        seconds = list(range(start, end))
        ax_req.stackplot(
            seconds,
            [served[x] for x in seconds],
            [shed[x] for x in seconds],
            [other[x] for x in seconds],
            labels=["served", "refused (retry later)", "failed"],
            colors=["#4d9221", "#fdae61", "#b2182b"],
            alpha=0.8,
        )
        ax_req.legend(loc="upper left", fontsize=8)
    ax_req.set_xlim(left=0)
    ax_req.set_ylabel("requests started / s")
    ax_req.set_xlabel("seconds since the load started")
    ax_req.grid(alpha=0.3)
    _shade([ax_engine, ax_wait, ax_ttft, ax_req], windows)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _summary_rows(timeline: Timeline, windows: list[PhaseWindow]) -> str:
    if not windows:
        groups = [("all", summarize(timeline))]
    else:
        groups = [(w.name, summarize(timeline, w.peak_start, w.end, path=w.name)) for w in windows]
    return "".join(
        f"<tr><td>{html.escape(name)}</td><td>{r.priority}</td><td>{r.submitted}</td><td>{r.served}</td>"
        f"<td>{r.shed}</td><td>{r.failed}</td><td>{_fmt(r.ttft_p50_ms)}</td><td>{_fmt(r.ttft_p99_ms)}</td></tr>"
        for name, rows in groups
        for r in rows
    )


def write_html(
    timeline: Timeline,
    png: Path,
    path: Path,
    title: str,
    notes: list[str],
    windows: list[PhaseWindow] | None = None,
    objective_s: float | None = None,
) -> None:
    windows = windows or []
    image = base64.b64encode(png.read_bytes()).decode()
    actions = "".join(
        f"<tr><td>{a.t:.1f}</td><td>{html.escape(a.target)}</td><td>{a.kind}</td><td>{a.status}</td>"
        f"<td>{a.direction}</td><td>{html.escape(a.reason or a.detail)}</td></tr>"
        for a in timeline.actions
        if a.status != "RENEWED"
    )
    renewals = sum(1 for a in timeline.actions if a.status == "RENEWED")
    verdicts = "".join(
        f"<tr><td>{v.t:.1f}</td><td>{html.escape(v.kind)}</td><td>{html.escape(v.action_id[:12])}</td>"
        f"<td>{v.verdict}</td><td>{html.escape(v.checks).replace('; ', '<br>')}</td></tr>"
        for v in timeline.verdicts
    )
    mix = Counter(v.verdict for v in timeline.verdicts)
    swinging = oscillations(timeline.actions)
    objective = (
        f"P0's objective: queue wait p90 in the engine at most {objective_s * 1000:.0f} ms. " if objective_s else ""
    )
    applied = sum(1 for a in timeline.actions if a.status == "APPLIED")
    action_head = "<th>t (s)</th><th>target</th><th>action</th><th>status</th><th>direction</th><th>why</th>"
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    path.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1300px}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;
vertical-align:top}}th{{background:#f3f3f3}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{notes_html}</ul>
<h2>Requests by priority at the peak of each phase</h2>
<p>Each phase's peak: the stretch held at the highest load. Refused requests got a retry hint
(UNAVAILABLE or RESOURCE_EXHAUSTED) at once instead of waiting.</p>
<table><tr><th>phase</th><th>priority</th><th>submitted</th><th>served</th><th>refused</th><th>failed</th>
<th>TTFT p50 (ms)</th><th>TTFT p99 (ms)</th></tr>{_summary_rows(timeline, windows)}</table>
<h2>Timeline</h2><p>{objective}Verdicts: {", ".join(f"{k.lower()} {n}" for k, n in sorted(mix.items())) or "none"};
fields moved back and forth more than twice a minute: {len(swinging)}.</p>
<img alt="timeline" src="data:image/png;base64,{image}">
<h2>Actions ({applied} applied; {renewals} lease renewals not listed)</h2>
<table><tr>{action_head}</tr>{actions}</table>
<h2>Verdicts ({len(timeline.verdicts)}), each with the promise it checked</h2>
<table><tr><th>t (s)</th><th>action</th><th>id</th><th>verdict</th><th>checks</th></tr>{verdicts}</table>
</body></html>
""")


def write_report(
    timeline: Timeline,
    out_dir: Path,
    title: str,
    notes: list[str],
    windows: list[PhaseWindow] | None = None,
    objective_s: float | None = None,
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "timeline.png"
    plot_timeline(timeline, png, title, windows, objective_s)
    page = out_dir / "report.html"
    write_html(timeline, png, page, title, notes, windows, objective_s)
    timeline.save(out_dir / "timeline.json")
    return page
