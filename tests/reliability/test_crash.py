"""Crash: kill -9 each service in turn during a burst of 10,000 samples; nothing lost, nothing applied twice."""

from __future__ import annotations

from pathlib import Path
from pprint import pformat

import pytest

from bench.reliability_scenarios import CrashPlan, crash_scenario


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_kill_each_service_during_a_burst_loses_nothing_and_applies_nothing_twice(
    redis_url: str, topic_prefix: str, tmp_path: Path
) -> None:
    plan = CrashPlan()
    figures = await crash_scenario(tmp_path, redis_url, topic_prefix, plan)
    detail = pformat(figures, width=120)  # in full: pytest shortens a dict in the failure message

    assert figures["sent_by_test"] >= plan.samples + plan.ooms
    # Every record in the input topics was handled (alone or coalesced) or dead-lettered, and committed.
    assert figures["backlog_after"] == {"decision": 0, "executor": 0, "validator": 0}, detail
    assert figures["handled"] + figures["dead_lettered"] == figures["sent"], detail
    assert figures["dead_lettered"] == plan.garbage, detail
    # Each OOM led to exactly one command id; each command id has a result; at most one took effect.
    assert figures["ooms_without_exactly_one_command"] == 0, detail
    assert figures["commands"] > plan.ooms, "the samples' 90% crossings caused commands too"
    assert figures["commands_without_result"] == 0, detail
    assert figures["duplicates_applied"] == 0, detail
    assert figures["redis_agrees"], "the executor's action log names the same applied commands as the results topic"
    assert figures["lost"] == 0, detail
