import math

from hypothesis import given, settings
from hypothesis import strategies as st

from services.decision.domain.engine import DecisionEngine
from services.decision.domain.policy import Policy, parse_policy
from services.decision.domain.types import AllocatorStats, EngineLoad, GpuMemory, Sample
from services.decision.domain.window import DropReason, TargetWindow
from sits.runtime.clock import ManualClock
from tests.decision.decision_builders import DEFAULT_POLICY, TARGET, TOTAL, make_sample


def test_bad_samples_are_dropped_with_a_counted_reason() -> None:
    window = TargetWindow()
    assert window.offer(make_sample(10.0, 0.5, seq=5, event_id="a")) is None
    assert window.offer(make_sample(10.1, 0.5, seq=6, event_id="a")) is DropReason.DUPLICATE
    assert window.offer(make_sample(10.2, 0.5, seq=5, event_id="b")) is DropReason.DUPLICATE
    assert window.offer(make_sample(10.3, 0.5, seq=4, event_id="c")) is DropReason.OUT_OF_ORDER
    assert window.offer(make_sample(9.0, 0.5, seq=7, event_id="d")) is DropReason.OUT_OF_ORDER
    assert window.offer(make_sample(10.4, None, seq=8, event_id="e")) is DropReason.MISSING_FIELDS
    over = Sample(TARGET, 10.5, "f", "test", 9, GpuMemory(TOTAL + 1, TOTAL))
    negative = Sample(TARGET, 10.6, "g", "test", 10, GpuMemory(-5, TOTAL))
    nan_kv = Sample(TARGET, 10.7, "h", "test", 11, engine=EngineLoad(kv_cache_usage=math.nan))
    alloc = Sample(TARGET, 10.8, "i", "test", 12, allocator=AllocatorStats(allocated_bytes=10, reserved_bytes=5))
    for bad in (over, negative, nan_kv, alloc):
        assert window.offer(bad) is DropReason.ABSURD_VALUE
    assert window.drops.as_dict() == {"duplicate": 2, "out_of_order": 2, "missing_fields": 1, "absurd_value": 4}
    assert len(window) == 1
    assert window.memory_fraction == 0.5


def test_dropped_samples_do_not_poison_the_forecast(policy: Policy) -> None:
    clock = ManualClock(0.0)
    engine = DecisionEngine(policy, clock)
    for i in range(600):
        t = 100.0 + i * 0.1
        engine.observe(make_sample(t, 0.6, seq=i + 1, event_id=f"s{i}"))
        # A producer bug: a sample claiming the device is over-full.
        engine.observe(Sample(TARGET, t + 0.05, f"bad{i}", "test", 0, GpuMemory(2 * TOTAL, TOTAL)))
    explanation = engine.explain(TARGET)
    assert explanation is not None
    assert explanation.forecast.time_to_limit_s is None
    assert explanation.forecast.memory_fraction == 0.6
    assert engine.drops.get(DropReason.ABSURD_VALUE) == 600


def test_window_is_bounded_in_count_and_age() -> None:
    window = TargetWindow(max_samples=50, max_age_s=3.0)
    for i in range(200):
        window.offer(make_sample(i * 0.1, 0.5))
    assert len(window) <= 31
    assert window.samples[0].t >= 200 * 0.1 - 0.1 - 3.0


_bytes = st.integers(min_value=-(2**62), max_value=2**62)
_floats = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def absurd_samples(draw: st.DrawFn) -> Sample:
    gpu = draw(st.none() | st.builds(GpuMemory, _bytes, _bytes, _bytes, _bytes, _floats))
    engine = draw(
        st.none()
        | st.builds(
            EngineLoad,
            _floats,
            st.integers(-10, 10**12),
            st.integers(-10, 10),
            st.integers(-10, 10),
            st.integers(-10, 10),
            _bytes,
            _bytes,
            _bytes,
            st.integers(-10, 100),
            st.integers(-10, 10),
        )
    )
    allocator = draw(st.none() | st.builds(AllocatorStats, _bytes, _bytes, _bytes, _bytes, _bytes))
    return Sample(
        TARGET,
        draw(_floats),
        draw(st.text(max_size=3)),
        draw(st.sampled_from(["a", "b"])),
        draw(st.integers(0, 5)),
        gpu,
        (),
        engine,
        allocator,
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(absurd_samples(), max_size=40))
def test_absurd_inputs_never_crash_the_engine(samples: list[Sample]) -> None:
    policy = parse_policy(DEFAULT_POLICY.read_text())
    engine = DecisionEngine(policy, ManualClock(0.0))
    for sample in samples:
        commands = engine.observe(sample)
        assert isinstance(commands, list)
    explanation = engine.explain(TARGET)
    if explanation is not None:
        assert 0.0 <= explanation.forecast.memory_fraction <= 1.0
        assert math.isfinite(explanation.forecast.predicted_fraction)
    assert engine.admit(TARGET, 10, 10).reason


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1)), min_size=1, max_size=200))
def test_forecast_on_any_sound_series_is_finite(points: list[tuple[float, float]]) -> None:
    policy = parse_policy(DEFAULT_POLICY.read_text())
    engine = DecisionEngine(policy, ManualClock(0.0))
    for t, frac in sorted(points):
        engine.observe(make_sample(t, frac))
    explanation = engine.explain(TARGET)
    assert explanation is not None
    fc = explanation.forecast
    assert math.isfinite(fc.slope_bytes_per_s) and 0.0 <= fc.confidence <= 1.0
    assert fc.time_to_limit_s is None or 0.0 <= fc.time_to_limit_s <= policy.spec.forecast.horizon_s
