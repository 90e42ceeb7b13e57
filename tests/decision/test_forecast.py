"""The envelope trend on its own: staircases, and how far a young trend may look ahead."""

import math
import random

import pytest

from services.decision.domain.forecast import EnvelopeTrend, Trend, staircase

BUCKET = 0.5


def _feed(trend: EnvelopeTrend, series: list[float], hz: float = 10.0) -> None:
    for i, value in enumerate(series):
        trend.add(i / hz, value)


def _stairs(
    base: float, step: float, every_s: float, steps: int, calm_s: float = 30.0, tail_s: float = 1.0
) -> list[float]:
    rng = random.Random(3)
    n = int((calm_s + steps * every_s + tail_s) * 10)
    out = []
    for i in range(n):
        t = i / 10
        done = 0 if t < calm_s else min(steps, 1 + math.floor((t - calm_s) / every_s))
        out.append(base + step * done + rng.gauss(0.0, 0.002))
    return out


def test_held_steps_make_a_staircase_trend_and_one_step_does_not() -> None:
    # Three steps of 9% every 6 s after a calm 30 s: a long fit still calls this noise.
    trend = EnvelopeTrend(min_history_s=30.0)
    _feed(trend, _stairs(0.55, 0.09, 6.0, 3))
    assert trend.trend.model == "steps"
    assert 0.009 < trend.trend.slope_lower <= trend.trend.slope < 0.02
    seconds = trend.trend.time_to_reach(trend.current_envelope(), 0.96, 300.0)
    assert seconds is not None and seconds < 20.0

    one = EnvelopeTrend(min_history_s=30.0)
    _feed(one, _stairs(0.55, 0.2, 6.0, 1, tail_s=20.0))
    assert one.trend.model == "none"


def test_a_staircase_that_stops_flattens_its_own_forecast() -> None:
    ts = [i * BUCKET for i in range(40)]
    ys = [0.5] * 8 + [0.6] * 8 + [0.7] * 8 + [0.8] * 16
    early = staircase(ts[:26], ys[:26], 0.02, BUCKET, 3)
    late = staircase(ts, ys, 0.02, BUCKET, 3)
    assert early is not None and late is not None
    assert late.slope == early.slope
    assert late.slope_lower < early.slope_lower


def test_spikes_that_fall_back_and_a_free_are_not_steps() -> None:
    ts = [i * BUCKET for i in range(40)]
    spikes = [0.6 + (0.05 if i % 5 == 0 else 0.0) for i in range(40)]
    assert staircase(ts, spikes, 0.02, BUCKET, 3) is None
    freed = [0.5] * 8 + [0.6] * 8 + [0.7] * 8 + [0.8] * 8 + [0.45] * 8
    assert staircase(ts, freed, 0.02, BUCKET, 3) is None
    # The newest step counts only once memory has held it for a bucket.
    fresh = [0.5] * 8 + [0.6] * 8 + [0.7] * 8 + [0.8]
    assert staircase(ts[:25], fresh, 0.02, BUCKET, 3) is None
    assert staircase(ts[:26], [*fresh, 0.8], 0.02, BUCKET, 3) is not None


def test_a_young_trend_looks_ahead_at_its_fastest_slope_and_no_further_than_its_reach() -> None:
    young = Trend(0.05, 0.01, 0.09, 1.0, 0.78, "long", reach_s=2.5)
    grown = Trend(0.05, 0.01, 0.09, 1.0, 0.78, "long")
    assert young.time_to_reach(0.78, 0.96, 300.0) == pytest.approx(2.0)
    assert grown.time_to_reach(0.78, 0.96, 300.0) == pytest.approx(18.0)
    assert young.time_to_reach(0.70, 0.96, 300.0) is None  # 2.9 s away: beyond its reach
