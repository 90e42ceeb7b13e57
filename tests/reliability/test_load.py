"""Load: 10x the normal metric rate for 60 s; each service stays under its memory limit and lag recovers."""

from __future__ import annotations

from pathlib import Path
from pprint import pformat

import pytest

from bench.reliability_scenarios import LoadPlan, load_scenario


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_ten_times_the_metric_rate_stays_bounded_and_lag_recovers(
    redis_url: str, topic_prefix: str, tmp_path: Path
) -> None:
    figures = await load_scenario(tmp_path, redis_url, topic_prefix, LoadPlan(duration_s=60.0))
    detail = pformat(figures, width=120)  # in full: pytest shortens a dict in the failure message

    assert figures["sent"] > 0
    assert figures["under_bound"], detail
    assert all(v is not None for v in figures["lag_recovered_s"].values()), detail
    assert figures["lost"] == 0, detail
