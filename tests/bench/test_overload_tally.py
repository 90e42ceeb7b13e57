"""bench/overload.py's Tally: the samples of runs on a machine that gives ten minutes a call, summed."""

from __future__ import annotations

from pathlib import Path

from bench.overload import Tally


def one_run(p0_ms: list[float], verdict: str, moved: dict[str, int]) -> Tally:
    tally = Tally(
        waits=[5.0],
        verdicts=[{"t": 1.0, "kind": "SET_TIER_BUDGET", "verdict": verdict, "checks": []}],
        actions_by_kind={"SET_TIER_BUDGET TIGHTEN": 1},
        oscillating=moved,
        rounds=2,
        runs=1,
    )
    for name in tally.raw:
        tally.raw[name]["p0"] = list(p0_ms)
    tally.raw["with_loaded"]["p1"] = [50.0]
    tally.raw["with_loaded"]["p1_refused"] = [1.0]
    return tally


def test_a_carried_over_run_adds_its_samples_counts_and_verdicts(tmp_path: Path) -> None:
    path = tmp_path / "carry.json"
    first = Tally.load(path)
    assert first.runs == 0
    first.add(one_run([10.0] * 99, "CONFIRMED", {}))
    first.save(path)

    second = Tally.load(path)
    second.add(one_run([20.0] * 99 + [900.0], "NOT_KEPT", {"engine-0 budget.P2": 3}))
    result = second.result()

    assert second.runs == 2 and second.rounds == 4
    assert result["figures"]["p0_samples_per_phase"] == 199
    assert result["detail"]["phases"]["with_loaded"]["refused"]["p1"] == 2
    assert result["detail"]["verdict_mix"] == {"CONFIRMED": 1, "NOT_KEPT": 1}
    assert result["figures"]["verdicts_confirmed_fraction"] == 0.5
    assert result["figures"]["actions"] == 2
    assert result["detail"]["oscillating_fields"] == {"engine-0 budget.P2": 3}
    assert result["detail"]["verdicts_not_confirmed"][0]["verdict"] == "NOT_KEPT"
    # The p99 is of the pooled samples: the second run's outlier is one of 199.
    assert result["detail"]["phases"]["with_loaded"]["p0_ttft_p99_ms"] < 900.0
    assert result["detail"]["phases"]["with_loaded"]["p0_ttft_p50_ms"] == 20.0
