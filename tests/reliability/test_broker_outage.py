"""Broker outage: 30 s without Kafka under capture's load; the spool takes it, drains in order, nothing lost."""

from __future__ import annotations

from pathlib import Path
from pprint import pformat

import pytest

from bench.reliability_scenarios import broker_outage_scenario


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_capture_spools_through_a_30s_broker_outage_and_drains_in_order(
    redis_url: str, topic_prefix: str, tmp_path: Path
) -> None:
    figures = await broker_outage_scenario(tmp_path, redis_url, topic_prefix, outage_s=30.0)
    detail = pformat(figures, width=120)  # in full: pytest shortens a dict in the failure message

    assert figures["spool_peak_pending"] > 0, "capture spooled to disk while the broker was away"
    assert figures["spool_files_during_outage"] > 0
    assert figures["spool_drained"], detail
    assert figures["after_outage"] > 0
    assert figures["out_of_order"] == 0, detail
    assert figures["lost"] == 0, detail
    # No service was restarted; an OOM sent after the broker returned became an applied action.
    assert figures["services_alive_without_restart"], detail
    assert figures["pipeline_recovered_s"] is not None, detail
