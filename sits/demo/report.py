"""The run report: a PNG timeline and an HTML page around it, plus a summary table.

The timeline puts what people want to correlate on one time axis: memory and
KV usage with each action and verdict marked, then P0 and P2 time to first
token, then what happened to requests (served, shed) second by second.
"""

from __future__ import annotations

import base64
import html
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from sits.demo.timeline import Timeline, percentile

COLORS = {"P0": "#1b7837", "P1": "#4393c3", "P2": "#d6604d"}
VERDICT_MARK = {"CONFIRMED": ("#1b7837", "v"), "ROLLED_BACK": ("#b2182b", "x"), "INCONCLUSIVE": ("#878787", "o")}


@dataclass(frozen=True)
class PrioritySummary:
    priority: str
    submitted: int
    served: int
    shed: int
    failed: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


def summarize(timeline: Timeline, since: float = 0.0, until: float = float("inf")) -> list[PrioritySummary]:
    out = []
    for priority in ("P0", "P1", "P2"):
        reqs = [r for r in timeline.requests if r.priority == priority and since <= r.t < until]
        ttfts = [r.ttft_s for r in reqs if r.ttft_s is not None and r.status == "OK"]
        shed = sum(1 for r in reqs if r.status in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"))
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


def plot_timeline(timeline: Timeline, path: Path, title: str = "SITS demo") -> None:
    fig, (ax_mem, ax_ttft, ax_req) = plt.subplots(3, 1, figsize=(13, 10), sharex=True, height_ratios=[3, 3, 2])
    fig.suptitle(title)
    targets = sorted({s.target for s in timeline.samples})
    for target in targets:
        points = [s for s in timeline.samples if s.target == target]
        kv = [(s.t, s.kv_usage) for s in points if s.kv_usage is not None]
        mem = [(s.t, s.memory_fraction) for s in points if s.memory_fraction is not None]
        if kv:
            ax_mem.plot(*zip(*kv, strict=True), label=f"{target} KV usage", lw=1.3)
        if mem and mem != kv:
            ax_mem.plot(*zip(*mem, strict=True), label=f"{target} memory", lw=1.0, ls="--")
    forecasts = [(f.t, f.predicted_fraction) for f in timeline.forecasts]
    if forecasts:
        ax_mem.plot(*zip(*forecasts, strict=True), label="forecast at horizon", lw=0.8, color="#9970ab", alpha=0.7)
    kinds = sorted({a.kind for a in timeline.actions})
    palette = plt.get_cmap("tab10")
    for index, kind in enumerate(kinds):
        times = [a.t for a in timeline.actions if a.kind == kind and a.status == "APPLIED"]
        for n, t in enumerate(times):
            ax_mem.axvline(t, color=palette(index), lw=1, alpha=0.6, label=f"action {kind}" if n == 0 else None)
    for verdict, (color, marker) in VERDICT_MARK.items():
        times = [v.t for v in timeline.verdicts if v.verdict == verdict]
        if times:
            ax_mem.scatter(
                times,
                [1.02] * len(times),
                color=color,
                marker=marker,
                s=40,
                label=f"verdict {verdict}",
                clip_on=False,
                zorder=5,
            )
    ax_mem.set_ylabel("fraction of capacity")
    ax_mem.set_ylim(0, 1.05)
    ax_mem.legend(loc="upper left", fontsize=7, ncol=3)
    ax_mem.grid(alpha=0.3)

    for priority in ("P0", "P2"):
        pts = [(r.t, r.ttft_s * 1000) for r in timeline.requests if r.priority == priority and r.ttft_s is not None]
        if pts:
            ax_ttft.scatter(
                *zip(*pts, strict=True), s=6, alpha=0.5, color=COLORS[priority], label=f"{priority} time to first token"
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
        served = Counter(int(r.t) for r in timeline.requests if r.status == "OK")
        shed = Counter(int(r.t) for r in timeline.requests if r.status in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"))
        other = Counter(
            int(r.t) for r in timeline.requests if r.status not in ("OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED")
        )
        xs = list(range(end))
        ax_req.stackplot(
            xs,
            [served[x] for x in xs],
            [shed[x] for x in xs],
            [other[x] for x in xs],
            labels=["served", "shed (retry later)", "failed"],
            colors=["#4d9221", "#fdae61", "#b2182b"],
            alpha=0.8,
        )
        ax_req.legend(loc="upper left", fontsize=8)
    ax_req.set_xlim(left=0)
    ax_req.set_ylabel("requests started / s")
    ax_req.set_xlabel("seconds since start")
    ax_req.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_html(timeline: Timeline, png: Path, path: Path, title: str, notes: list[str]) -> None:
    rows = summarize(timeline)
    image = base64.b64encode(png.read_bytes()).decode()

    def fmt(value: float | None) -> str:
        return "–" if value is None else f"{value:.0f}"

    summary = "".join(
        f"<tr><td>{r.priority}</td><td>{r.submitted}</td><td>{r.served}</td><td>{r.shed}</td><td>{r.failed}</td>"
        f"<td>{fmt(r.ttft_p50_ms)}</td><td>{fmt(r.ttft_p99_ms)}</td></tr>"
        for r in rows
    )
    actions = "".join(
        f"<tr><td>{a.t:.1f}</td><td>{html.escape(a.target)}</td><td>{a.kind}</td><td>{a.status}</td>"
        f"<td>{html.escape(a.reason or a.detail)}</td></tr>"
        for a in timeline.actions
    )
    verdicts = "".join(
        f"<tr><td>{v.t:.1f}</td><td>{html.escape(v.action_id[:12])}</td><td>{v.verdict}</td>"
        f"<td>{html.escape(v.checks)}</td></tr>"
        for v in timeline.verdicts
    )
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    path.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1300px}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}
th{{background:#f3f3f3}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{notes_html}</ul>
<h2>Requests by priority</h2>
<table><tr><th>priority</th><th>submitted</th><th>served</th><th>shed</th><th>failed</th>
<th>TTFT p50 (ms)</th><th>TTFT p99 (ms)</th></tr>{summary}</table>
<h2>Timeline</h2><img alt="timeline" src="data:image/png;base64,{image}">
<h2>Actions ({len(timeline.actions)})</h2>
<table><tr><th>t (s)</th><th>target</th><th>action</th><th>status</th><th>why</th></tr>{actions}</table>
<h2>Verdicts ({len(timeline.verdicts)})</h2>
<table><tr><th>t (s)</th><th>action</th><th>verdict</th><th>checks</th></tr>{verdicts}</table>
</body></html>
""")


def write_report(timeline: Timeline, out_dir: Path, title: str, notes: list[str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "timeline.png"
    plot_timeline(timeline, png, title)
    page = out_dir / "report.html"
    write_html(timeline, png, page, title, notes)
    timeline.save(out_dir / "timeline.json")
    return page
