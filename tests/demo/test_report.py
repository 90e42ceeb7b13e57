"""The demo's timeline and report, from real event messages."""

from __future__ import annotations

import math
import time
from pathlib import Path

from sits.runtime.events import new_meta
from sits.v1 import common_pb2, events_pb2
from sits_app.demo.live import render
from sits_app.demo.load import RequestOutcome, ramp
from sits_app.demo.report import WITHOUT_SITS, PhaseWindow, p0_queue_wait_ms, summarize, write_report
from sits_app.demo.timeline import Timeline

TARGET = common_pb2.Target(host="h", engine="vllm-0")


def test_timeline_and_report_from_events(tmp_path: Path) -> None:
    timeline = Timeline()
    now = time.time()
    for i in range(20):
        sample = events_pb2.MetricSample(meta=new_meta("capture", TARGET, now + i * 0.5))
        sample.engine.kv_cache_usage = min(1.0, 0.5 + i * 0.03)
        timeline.on_event("m", sample)
    command = events_pb2.HealingCommand(meta=new_meta("decision", TARGET, now), command_id="c1", reason="KV 96%")
    timeline.on_event("c", command)
    result = events_pb2.ActionResult(
        meta=new_meta("executor", TARGET, now + 5),
        action_id="a1",
        command_id="c1",
        kind=events_pb2.ACTION_KIND_SHED_PRIORITY,
        status=events_pb2.ACTION_STATUS_APPLIED,
    )
    timeline.on_event("r", result)
    verdict = events_pb2.ValidationVerdict(
        meta=new_meta("validator", TARGET, now + 10), action_id="a1", verdict=events_pb2.VERDICT_CONFIRMED
    )
    verdict.checks.add(name="memory_below_watermark", passed=True)
    timeline.on_event("v", verdict)
    mono = timeline.started_mono
    outcomes = [
        RequestOutcome("P0", mono + 1, 0.1, mono + 2, 10, "OK"),
        RequestOutcome("P0", mono + 2, 0.3, mono + 3, 10, "OK"),
        RequestOutcome("P2", mono + 2, None, mono + 2, 0, "UNAVAILABLE", "breaker open"),
        RequestOutcome("P2", mono + 3, None, mono + 9, 0, "DEADLINE_EXCEEDED"),
    ]
    for outcome in outcomes:
        timeline.on_request(outcome)

    assert len(timeline.samples) == 20 and timeline.samples[-1].kv_usage == 1.0
    assert timeline.actions[0].kind == "SHED_PRIORITY" and timeline.actions[0].reason == "KV 96%"
    assert timeline.verdicts[0].verdict == "CONFIRMED"
    rows = {r.priority: r for r in summarize(timeline)}
    assert (rows["P0"].submitted, rows["P0"].served, rows["P0"].shed) == (2, 2, 0)
    assert rows["P0"].ttft_p99_ms is not None and abs(rows["P0"].ttft_p99_ms - 300) < 1e-6
    assert (rows["P2"].shed, rows["P2"].failed) == (1, 1)

    page = write_report(timeline, tmp_path, "test report", ["a note"])
    html = page.read_text()
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SHED_PRIORITY" in html and "CONFIRMED" in html and "a note" in html
    assert Timeline.load(tmp_path / "timeline.json").verdicts[0].action_id == "a1"
    assert render(timeline, "phase", 1.0, 0) is not None


def test_the_queue_wait_line_breaks_over_the_phase_without_sits() -> None:
    timeline = Timeline()
    for i in range(10):
        sample = events_pb2.MetricSample(meta=new_meta("capture", TARGET, timeline.started + i))
        sample.engine.tiers.add(priority=common_pb2.PRIORITY_P0, queue_wait_p90_s=0.05 if i >= 5 else 0.0)
        timeline.on_event("m", sample)
    windows = [PhaseWindow(WITHOUT_SITS, 0.5, 1.0, 4.5), PhaseWindow("with SITS", 4.6, 5.0, 10.0)]
    waits = p0_queue_wait_ms(timeline, windows)
    assert len(waits) == 10
    assert all(math.isnan(ms) for t, ms in waits if 0.5 <= t <= 4.5)
    assert [round(ms) for t, ms in waits if t > 4.6] == [50] * 5


def test_ramp_goes_from_base_to_peak_and_stops() -> None:
    rate = ramp(10.0, 3.0, ramp_s=100.0, hold_s=50.0)
    assert rate(5.0) == 10.0
    assert 10.0 < rate(60.0) < 30.0
    assert rate(120.0) == 30.0
    assert rate(151.0) == 0.0
