"""The live terminal view: per target, the engine, P0's queue wait against its objective, the lower-tier budget,
the forecast, each action and verdict; per tier, served, refused and time to first token."""

from __future__ import annotations

import time

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sits.runtime.contract import ALL_TIERS
from sits_app.demo.timeline import Timeline, percentile

WINDOW_S = 10.0


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms"


def render(timeline: Timeline, phase: str, load_rps: float, in_flight: int, objective_s: float | None = None) -> Group:
    now = time.time() - timeline.started
    targets = Table(
        title=f"{phase}  ·  t={now:5.1f}s  ·  offered load {load_rps:4.1f} req/s  ·  in flight {in_flight}",
        title_justify="left",
        expand=True,
    )
    for column in (
        "target",
        "KV usage",
        "memory",
        "running/cap, waiting",
        "P0 queue wait",
        "lower-tier budget",
        "forecast",
        "last action",
        "last verdict",
    ):
        targets.add_column(column)
    names = sorted({s.target for s in timeline.samples})
    for name in names:
        latest = next((s for s in reversed(timeline.samples) if s.target == name), None)
        forecast = next((f for f in reversed(timeline.forecasts) if f.target == name), None)
        action = next((a for a in reversed(timeline.actions) if a.target == name), None)
        verdict = next((v for v in reversed(timeline.verdicts) if v.target == name), None)
        if forecast is None:
            forecast_text = "–"
        elif forecast.time_to_oom_s is None:
            forecast_text = f"no OOM in horizon ({forecast.predicted_fraction:.0%})"
        else:
            forecast_text = f"OOM in {forecast.time_to_oom_s:.0f} s"
        kv = latest.kv_usage if latest else None
        wait = next((s.p0_queue_wait_s for s in reversed(timeline.samples) if s.target == name), None)
        missed = wait is not None and objective_s is not None and wait > objective_s
        budget = next((a for a in reversed(timeline.actions) if a.target == name and a.kind == "SET_TIER_BUDGET"), None)
        limits = {k.removeprefix("budget."): int(v) for k, v in budget.values.items()} if budget else {}
        cap = f"/{latest.running_cap}" if latest and latest.running_cap else ""
        targets.add_row(
            name,
            Text(_pct(kv), style="bold red" if kv is not None and kv > 0.92 else ""),
            _pct(latest.memory_fraction if latest else None),
            f"{latest.running}{cap}, {latest.waiting}" if latest else "–",
            Text(
                _ms(wait) + ("" if objective_s is None else f" (objective {objective_s * 1000:.0f})"),
                style="bold red" if missed else "green",
            ),
            ", ".join(f"{k} <= {v}" for k, v in sorted(limits.items())) or "none",
            forecast_text,
            f"{action.kind} {action.status} @{action.t:.0f}s" if action else "–",
            Text(f"{verdict.verdict} @{verdict.t:.0f}s", style="green" if verdict.verdict == "CONFIRMED" else "red")
            if verdict
            else "–",
        )
    latency = Table(title=f"requests in the last {WINDOW_S:.0f} s", title_justify="left", expand=True)
    for column in ("priority", "served", "refused", "TTFT p50", "TTFT p99"):
        latency.add_column(column)
    recent_mono = time.monotonic() - timeline.started_mono - WINDOW_S
    for priority in (tier.name for tier in ALL_TIERS):
        recent = [r for r in timeline.requests if r.priority == priority and r.t >= recent_mono]
        ttfts = [r.ttft_s for r in recent if r.ttft_s is not None]
        latency.add_row(
            priority,
            str(sum(1 for r in recent if r.status == "OK")),
            str(sum(1 for r in recent if r.status in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"))),
            _ms(percentile(ttfts, 0.5)),
            _ms(percentile(ttfts, 0.99)),
        )
    recent_actions = Table(title="latest actions and verdicts", title_justify="left", expand=True)
    recent_actions.add_column("t")
    recent_actions.add_column("what")
    shown = [a for a in timeline.actions if a.status != "RENEWED"][-6:]
    events = [(a.t, f"{a.kind} {a.status} on {a.target}: {a.reason or a.detail}") for a in shown]
    events += [(v.t, f"verdict {v.verdict} for {v.kind} {v.action_id[:8]}: {v.checks}") for v in timeline.verdicts[-6:]]
    for t, what in sorted(events)[-8:]:
        recent_actions.add_row(f"{t:5.1f}s", what)
    return Group(Panel(targets), Panel(latency), Panel(recent_actions))
