"""Time-to-limit forecasting that rides the allocate/free sawtooth and ignores noise.

Samples are folded into fixed-width time buckets; each bucket keeps its
maximum, so the series follows the upper envelope of the sawtooth rather
than its troughs. When a bucket closes, two least-squares lines are fitted
over the bucket maxima, both in fractions of the device:

- a long fit over every bucket in the window (slow leaks, steady ramps);
- a short fit over the last few buckets (fast ramps), whose standard error
  uses the noise measured by the long fit, and which only counts while the
  series is making new highs (a sawtooth that stays below its earlier peaks
  climbs on every tooth, but never above them) and is still climbing in its
  last half (a single step up is steep across the window but flat at its end).

A third, step-aware trend reads a staircase: the envelope jumps, dwells,
jumps again (allocations in whole chunks: a batch of long prompts, an
adapter, a graph capture). A staircase is a ramp with an irregular beat, but
its residuals from a line follow each other, so the long fit (rightly, for a
slow wave) distrusts it and sees it only after many steps; a few big steps
can reach the limit first. A step counts while memory holds it (a noise
spike falls back, a free ends the staircase), and the staircase trend needs
`min_steps` of them: one step is a model load, not a trend.

Before `min_history_s` of buckets a trend is young: on a fresh target the
first tooth of a slow sawtooth cannot be told from a ramp, so a young trend
extrapolates no further ahead than half the history it has seen, and never
more than `young_horizon_s`: it warns only when waiting for more history
would leave too little time to act. That is a question about the latest safe
moment, so a young trend answers it with the fastest slope its data allow
(slope + 2·se): with the lower bound, a noisy real climb would look slower,
and so less urgent, than a clean sawtooth tooth. A first tooth so steep that
a ramp going on from its peak would fill the device within that time still
warns: until it falls, nothing in its samples tells it from that ramp.
Residual autocorrelation widens the errors, so a slow wave does not pass for
a trend.

A fit counts when its slope is at least `min_t` standard errors above zero;
once a trend has its history, the slope used is the lower confidence bound
(slope − 2·se), so a noisy trend predicts later rather than sooner. Fitting
happens once per bucket, not per sample: the per-sample cost is a comparison
and a division.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from itertools import pairwise

# The long fit pools buckets down to this many points: its cost is paid once per bucket.
LONG_FIT_POINTS = 40
# How far ahead a young trend may extrapolate, as a share of the history it has seen.
YOUNG_REACH = 0.5
# A rise between buckets counts as a step when it is this many sample noises: the bucket
# maxima of plain noise differ by well under that, a whole allocation by more.
STEP_NOISE = 6.0


@dataclass(frozen=True, slots=True)
class LineFit:
    slope: float
    intercept: float
    # Standard error of the slope, in the same units per second.
    slope_se: float
    residual_sd: float
    points: int

    def t_stat(self) -> float:
        if self.slope_se > 0.0:
            return self.slope / self.slope_se
        return math.inf if self.slope > 0.0 else 0.0


def fit_line(ts: list[float], ys: list[float], noise_sd: float | None = None) -> LineFit | None:
    """Ordinary least squares; `noise_sd`, when given, replaces the residual spread in the error."""
    n = len(ts)
    if n < 3:
        return None
    mean_t = math.fsum(ts) / n
    mean_y = math.fsum(ys) / n
    stt = 0.0
    sty = 0.0
    for t, y in zip(ts, ys, strict=True):
        dt = t - mean_t
        stt += dt * dt
        sty += dt * (y - mean_y)
    if stt <= 0.0:
        return None
    slope = sty / stt
    intercept = mean_y - slope * mean_t
    sse = 0.0
    lagged = 0.0
    previous = 0.0
    for i, (t, y) in enumerate(zip(ts, ys, strict=True)):
        r = y - (intercept + slope * t)
        sse += r * r
        if i:
            lagged += r * previous
        previous = r
    residual_sd = math.sqrt(sse / (n - 2))
    sd = residual_sd if noise_sd is None else max(noise_sd, residual_sd)
    # Residuals that follow each other (a sawtooth, a slow wave) carry fewer independent
    # points than there are buckets: widen the error by the lag-1 autocorrelation.
    rho = 0.0 if sse <= 0.0 else min(0.98, max(0.0, lagged / sse))
    inflation = math.sqrt((1.0 + rho) / (1.0 - rho))
    return LineFit(slope, intercept, sd * inflation / math.sqrt(stt), residual_sd, n)


@dataclass(frozen=True, slots=True)
class Trend:
    """The outcome of the last bucket close, in fractions of the device per second."""

    slope: float
    slope_lower: float
    slope_upper: float
    confidence: float
    envelope: float
    model: str
    # How far ahead this trend may extrapolate: without limit once it has min_history_s
    # behind it; while young, half the history it has seen and at most young_horizon_s.
    reach_s: float = math.inf

    @staticmethod
    def flat(envelope: float = 0.0) -> Trend:
        return Trend(0.0, 0.0, 0.0, 0.0, envelope, "none")

    @property
    def young(self) -> bool:
        return self.reach_s != math.inf

    def time_to_reach(self, level: float, limit: float, horizon_s: float) -> float | None:
        """Seconds to `limit`, or None when that is beyond the horizon or this trend's reach.

        A trend with its history predicts with its lower slope; a young one only says whether
        the limit could be within its reach at its upper slope (the latest safe moment).
        """
        slope = self.slope_upper if self.young else self.slope_lower
        seconds = time_to_reach(level, limit, slope, horizon_s)
        if seconds is not None and seconds > self.reach_s:
            return None
        return seconds


class EnvelopeTrend:
    """Bucketed upper envelope of one series (values in [0, ~1]) with its fitted trend."""

    def __init__(
        self,
        bucket_s: float = 0.5,
        window_s: float = 60.0,
        short_buckets: int = 8,
        min_buckets: int = 4,
        min_t: float = 4.0,
        new_high_margin: float = 0.002,
        min_steps: int = 3,
        min_history_s: float = 0.0,
        young_horizon_s: float = math.inf,
    ) -> None:
        if bucket_s <= 0 or window_s < bucket_s * min_buckets:
            raise ValueError("the window must hold at least min_buckets buckets")
        if min_steps < 2:
            raise ValueError("a staircase needs at least two steps")
        self.bucket_s = bucket_s
        self.short_buckets = short_buckets
        self.min_buckets = min_buckets
        self.min_t = min_t
        self.new_high_margin = new_high_margin
        self.min_steps = min_steps
        self.min_history_s = min_history_s
        self.young_horizon_s = young_horizon_s
        self._max_buckets = max(min_buckets, int(window_s / bucket_s))
        self._ts: deque[float] = deque(maxlen=self._max_buckets)
        self._ys: deque[float] = deque(maxlen=self._max_buckets)
        self._bucket_start: float | None = None
        self._bucket_max = -math.inf
        self.trend = Trend.flat()

    @property
    def buckets(self) -> int:
        return len(self._ts)

    def current_envelope(self) -> float:
        """Highest value of the open bucket and the last closed one."""
        last = self._ys[-1] if self._ys else -math.inf
        value = max(last, self._bucket_max)
        return 0.0 if value == -math.inf else value

    def add(self, t: float, value: float) -> None:
        start = self._bucket_start
        if start is None:
            self._bucket_start = t
            self._bucket_max = value
            return
        if t - start >= self.bucket_s:
            self._close(start)
            gap = t - start
            # A long silence (capture restart) breaks the series: old buckets say nothing about now.
            if gap > self._max_buckets * self.bucket_s:
                self._ts.clear()
                self._ys.clear()
                self.trend = Trend.flat()
            self._bucket_start = start + self.bucket_s * math.floor(gap / self.bucket_s)
            self._bucket_max = value
            return
        if value > self._bucket_max:
            self._bucket_max = value

    def _close(self, start: float) -> None:
        self._ts.append(start + self.bucket_s / 2.0)
        self._ys.append(self._bucket_max)
        self.trend = self._fit()

    def _fit(self) -> Trend:
        n = len(self._ts)
        envelope = self._ys[-1]
        if n < self.min_buckets:
            return Trend.flat(envelope)
        ts = list(self._ts)
        ys = list(self._ys)
        long_fit = fit_line(*_pooled(ts, ys, LONG_FIT_POINTS))
        if long_fit is None:
            return Trend.flat(envelope)
        best = Trend.flat(envelope)
        long_t = long_fit.t_stat()
        if long_t >= self.min_t:
            lower = max(0.0, long_fit.slope - 2.0 * long_fit.slope_se)
            upper = long_fit.slope + 2.0 * long_fit.slope_se
            best = Trend(long_fit.slope, lower, upper, _confidence(long_t, n, self.min_buckets), envelope, "long")
        noise = difference_noise(ys[-(LONG_FIT_POINTS + 1) :])
        if n > self.short_buckets:
            previous_high = max(ys[: -self.short_buckets // 2])
            margin = max(self.new_high_margin, 3.0 * noise)
            if envelope >= previous_high + margin:
                short = fit_line(ts[-self.short_buckets :], ys[-self.short_buckets :], noise_sd=noise)
                # A step up is steep across the short window but flat at its end; a ramp is
                # still climbing in the last half.
                tail = fit_line(ts[-(self.short_buckets // 2) :], ys[-(self.short_buckets // 2) :])
                still_rising = tail is not None and short is not None and tail.slope >= 0.5 * short.slope
                if short is not None and still_rising and short.t_stat() >= self.min_t:
                    lower = max(0.0, short.slope - 2.0 * short.slope_se)
                    if lower > best.slope_lower:
                        best = Trend(
                            short.slope,
                            lower,
                            short.slope + 2.0 * short.slope_se,
                            _confidence(short.t_stat(), short.points, self.min_buckets),
                            envelope,
                            "short",
                        )
        stairs = staircase(ts, ys, max(self.new_high_margin, STEP_NOISE * noise), self.bucket_s, self.min_steps)
        if stairs is not None and stairs.slope_lower > best.slope_lower:
            best = stairs
        history = self._ts[-1] - self._ts[0] + self.bucket_s
        if history >= self.min_history_s:
            return best
        return replace(best, reach_s=min(YOUNG_REACH * history, self.young_horizon_s))


def staircase(ts: list[float], ys: list[float], jump: float, bucket_s: float, min_steps: int) -> Trend | None:
    """The trend of a staircase in bucket maxima: `min_steps` or more rises of over `jump` that hold.

    A run of rising buckets is one step (a ramp is one long step, and the short fit's to
    judge). A step holds while the envelope stays above the level it rose from: a noise
    spike falls back, a free falls below them all. The newest step counts once a bucket
    after it has held. The slope is the mean step over the mean beat; the lower slope
    leaves out the first step and counts the dwell since the last one, so a staircase
    that stops flattens its own forecast instead of warning on the level it reached.
    """
    steps: list[tuple[float, float, float]] = []  # (time of the step's last bucket, height, level before)
    rising = False
    for i in range(1, len(ys)):
        rise = ys[i] - ys[i - 1]
        if rise > jump:
            if rising:
                _, height, base = steps[-1]
                steps[-1] = (ts[i], height + rise, base)
            else:
                steps.append((ts[i], rise, ys[i - 1]))
            rising = True
            continue
        rising = False
        while steps and ys[i] < steps[-1][2] + jump / 2.0:
            steps.pop()
    if steps and steps[-1][0] == ts[-1]:
        steps.pop()
    if len(steps) < min_steps:
        return None
    first_t = steps[0][0]
    beats = steps[-1][0] - first_t
    since_first = ts[-1] + bucket_s / 2.0 - first_t
    if beats <= 0.0 or since_first <= 0.0:
        return None
    heights = [h for _, h, _ in steps]
    slope = math.fsum(heights) / len(heights) / (beats / (len(steps) - 1))
    lower = min(slope, math.fsum(heights[1:]) / since_first)
    confidence = round(min(1.0, (len(steps) - 1) / (2.0 * (min_steps - 1))), 4)
    return Trend(slope, lower, slope, confidence, ys[-1], "steps")


def _pooled(ts: list[float], ys: list[float], points: int) -> tuple[list[float], list[float]]:
    """At most `points` buckets for the long fit: neighbours merged, keeping each group's maximum."""
    n = len(ts)
    if n <= points:
        return ts, ys
    group = -(-n // points)
    start = n % group
    pooled_ts = [ts[i + group - 1] for i in range(start, n, group)]
    pooled_ys = [max(ys[i : i + group]) for i in range(start, n, group)]
    return pooled_ts, pooled_ys


def difference_noise(ys: list[float]) -> float:
    """Sample noise from successive differences (MAD): blind to trends, steps and sawtooth drops."""
    diffs = sorted(abs(b - a) for a, b in pairwise(ys))
    if not diffs:
        return 0.0
    return diffs[len(diffs) // 2] / 0.6745 / math.sqrt(2.0)


def _confidence(t_stat: float, points: int, min_points: int) -> float:
    strength = 1.0 if math.isinf(t_stat) else min(1.0, t_stat / 10.0)
    fill = min(1.0, points / (2.0 * min_points))
    return round(max(0.0, min(1.0, strength * fill)), 4)


def time_to_reach(level: float, limit: float, slope: float, horizon_s: float) -> float | None:
    """Seconds until `level` reaches `limit` at `slope`; None beyond the horizon."""
    if level >= limit:
        return 0.0
    if slope <= 0.0:
        return None
    seconds = (limit - level) / slope
    return seconds if seconds <= horizon_s else None
