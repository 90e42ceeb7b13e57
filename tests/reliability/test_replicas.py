"""Replicas: 2 decision + 2 executor + 2 validator under a burst; one of each killed -9 and one of each added
mid-burst. Nothing lost, nothing applied twice, every applied action judged exactly once, and the executors'
lease audit in Redis never shows two holders of one target at once."""

from __future__ import annotations

from pathlib import Path
from pprint import pformat

import pytest

from bench.reliability_scenarios import ReplicaPlan, replicas_scenario


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_replicas_killed_and_added_mid_burst_lose_nothing_and_apply_nothing_twice(
    redis_url: str, topic_prefix: str, tmp_path: Path
) -> None:
    plan = ReplicaPlan()
    figures = await replicas_scenario(tmp_path, redis_url, topic_prefix, plan)
    detail = pformat(figures, width=120)  # in full: pytest shortens a dict in the failure message

    assert figures["replicas_killed"] == 3 and figures["replicas_added"] == 3, detail
    assert figures["sent_by_test"] >= plan.samples + plan.ooms
    assert figures["backlog_after"] == {"decision": 0, "executor": 0, "validator": 0}, detail
    assert figures["handled"] + figures["dead_lettered"] == figures["sent"], detail
    assert figures["dead_lettered"] == plan.garbage, detail
    assert figures["lost"] == 0, detail
    # Every OOM caused exactly one command, and that command took effect.
    assert figures["ooms_without_exactly_one_command"] == 0, detail
    assert figures["ooms_not_applied"] == 0, detail
    assert figures["commands_without_result"] == 0, detail
    assert figures["duplicates_applied"] == 0, detail
    assert figures["redis_agrees"], detail
    # The lease was taken many times and never by two executors at once.
    assert figures["lease_grants"] >= figures["applied"] > 0, detail
    assert figures["double_leases"] == 0, detail
    # Every applied action has one verdict: none lost in a move, none given twice.
    assert figures["actions_to_judge"] > 0, detail
    assert figures["actions_without_verdict"] == 0, detail
    assert figures["actions_with_several_verdicts"] == 0, detail
