"""Redis outage: the executor refuses mutating actions clearly, then applies the ones still in time, unrestarted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.reliability_scenarios import redis_outage_scenario


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_executor_refuses_while_redis_is_down_and_applies_once_it_is_back(
    topic_prefix: str, tmp_path: Path
) -> None:
    figures = await redis_outage_scenario(tmp_path, topic_prefix, outage_s=4.0)

    assert figures["warm_applied"], figures
    assert figures["grpc_while_down"] == "UNAVAILABLE", figures
    assert "Redis unreachable" in figures["grpc_while_down_detail"], figures
    assert figures["results_while_down"] == 0, "nothing was applied or answered while Redis was down"
    assert figures["applied_after_recovery"], figures
    assert figures["stale_skipped"], "the command whose deadline passed meanwhile was dead-lettered, not applied"
    assert figures["grpc_after_recovery"] == "OK", figures
    assert not figures["executor_restarted"], figures
    assert figures["duplicates_applied"] == 0
    assert figures["lost"] == 0
