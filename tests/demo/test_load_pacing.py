"""The demo's open-loop arrivals keep to their schedule while the event loop is busy, a stalled driver drops
what it is far behind on instead of sending it in a burst, and the load runs in processes of its own."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sits_app.demo.load import MAX_LAG_S, LoadDriver, LoadShape, RequestOutcome
from sits_app.demo.load_processes import LoadPlan, LoadProcesses

RATE = 100.0
SECONDS = 2.0


def driver_counting_issues(monkeypatch: pytest.MonkeyPatch) -> LoadDriver:
    # No server: an issued request is only counted (the channel is never used, so it never connects).
    driver = LoadDriver("127.0.0.1:9", LoadShape(rate=lambda _t: RATE))

    async def issue(_stub: Any) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(driver, "_issue", issue)
    return driver


async def hog(busy_s: float, every_s: float, until: float) -> None:
    """Block the event loop for `busy_s` out of every `every_s`, as the streams' handling does under load."""
    while time.monotonic() < until:
        time.sleep(busy_s)  # noqa: ASYNC251 - blocking the loop is the point
        await asyncio.sleep(every_s - busy_s)


async def test_arrivals_keep_their_rate_while_the_event_loop_is_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = driver_counting_issues(monkeypatch)
    busy = asyncio.create_task(hog(0.03, 0.04, time.monotonic() + SECONDS))
    await driver.run(SECONDS)
    await busy
    # About 200 are due (Poisson, sd 14). Sleeping a random gap after each wake-up, as the driver did, sent
    # 99 under the same hog (a scratch run of that loop on 2026-12-07).
    assert driver.sent >= 150, driver.sent
    assert driver.behind == 0 and driver.refused_locally == 0
    assert driver.sent_rate(0.0, SECONDS) == pytest.approx(driver.sent / SECONDS)


async def test_a_stalled_driver_drops_what_it_is_far_behind_on(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = driver_counting_issues(monkeypatch)

    async def stall() -> None:
        await asyncio.sleep(0.2)
        time.sleep(MAX_LAG_S + 0.5)  # noqa: ASYNC251 - a stalled loop, on purpose

    stalled = asyncio.create_task(stall())
    await driver.run(SECONDS)
    await stalled
    # Those due in the first 0.7 s of the stall were over MAX_LAG_S late when the loop came back: dropped
    # (about 70); the rest went out late, at once, or on time.
    assert 35 <= driver.behind <= 110, driver.behind
    assert 140 <= driver.sent + driver.behind <= 260, (driver.sent, driver.behind)
    assert driver.sent_rate(0.2 + MAX_LAG_S + 0.5, SECONDS) > 0.5 * RATE


def closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def plan_at(address: str, rate: float, seconds: float) -> LoadPlan:
    return LoadPlan(
        address=address,
        seconds=seconds,
        base_rps=rate,
        peak_factor=1.0,
        ramp_s=0.1,
        mix={"P0": 0.2, "P1": 0.3, "P2": 0.5},
        prompt_tokens=(8, 16),
        max_tokens=(4, 8),
    )


async def test_the_load_processes_send_each_tier_from_its_own_process_and_report_every_outcome() -> None:
    # Nothing listens on the port: every request ends at once, UNAVAILABLE, and still comes back as an outcome.
    load = LoadProcesses(plan_at(closed_port(), 40.0, 2.0))
    outcomes: list[RequestOutcome] = []
    load.on_outcome = outcomes.append
    began = time.monotonic()
    await asyncio.wait_for(load.run(2.0), 60)
    assert 40 <= load.sent <= 130, load.sent  # about 80 due
    assert len(outcomes) == load.sent and load.in_flight == 0
    assert {o.status for o in outcomes} == {"UNAVAILABLE"}
    by_tier = Counter(o.priority for o in outcomes)
    assert set(by_tier) == {"P0", "P1", "P2"} and by_tier["P0"] < by_tier["P2"]
    # The children's clock is the parent's: every outcome started inside the run.
    assert all(began <= o.started <= o.finished <= time.monotonic() for o in outcomes)
    assert load.sent_rate(0.0, 2.0) == pytest.approx(load.sent / 2.0)


async def test_stopping_the_load_ends_its_processes(tmp_path: Path) -> None:
    load = LoadProcesses(plan_at(closed_port(), 10.0, 60.0), log_path=tmp_path / "load.log")
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(1.5, stop.set)
    began = time.monotonic()
    await asyncio.wait_for(load.run(60.0, stop), 30)
    assert time.monotonic() - began < 20
    assert (tmp_path / "load.log").exists()  # where the children's errors would go, off the live view
