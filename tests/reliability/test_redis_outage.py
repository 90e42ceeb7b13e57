"""Redis outage: the executor refuses mutating actions clearly, then applies the ones still in time, unrestarted."""

from __future__ import annotations

from pathlib import Path
from pprint import pformat

import pytest

from bench.reliability_scenarios import redis_outage_scenario


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_executor_refuses_while_redis_is_down_and_applies_once_it_is_back(
    topic_prefix: str, tmp_path: Path
) -> None:
    figures = await redis_outage_scenario(tmp_path, topic_prefix, outage_s=4.0)
    detail = pformat(figures, width=120)  # in full: pytest shortens a dict in the failure message

    assert figures["warm_applied"], detail
    assert figures["grpc_while_down"] == "UNAVAILABLE", detail
    assert "Redis unreachable" in figures["grpc_while_down_detail"], detail
    assert figures["results_while_down"] == 0, "nothing was applied or answered while Redis was down"
    assert figures["applied_after_recovery"], detail
    assert figures["stale_skipped"], "the command whose deadline passed meanwhile was dead-lettered, not applied"
    assert figures["grpc_after_recovery"] == "OK", detail
    assert not figures["executor_restarted"], detail
    assert figures["duplicates_applied"] == 0
    assert figures["lost"] == 0
