"""bench.overload_http's capacity figures: the alternated pairs, and the side-by-side phase where a run has one."""

from __future__ import annotations

from typing import Any

from bench.overload_http import (
    SIDE_BY_SIDE,
    SIDE_BY_SIDE_ENVOY,
    capacity_figures,
    capacity_pairs,
    variant_figures,
)


def p0(ttft_p50_ms: float, tokens_per_s: float) -> dict[str, Any]:
    return {
        "ttft_p50_ms": ttft_p50_ms,
        "ttft_p99_ms": 2 * ttft_p50_ms,
        "output_tokens_per_s": tokens_per_s,
        "served": 100,
        "refused": 0,
        "refused_fraction": 0.0,
    }


def pairs(added_ms: list[float]) -> dict[str, dict[str, Any]]:
    phases: dict[str, dict[str, Any]] = {}
    for suffix, added in zip(capacity_pairs(), added_ms, strict=True):
        phases[f"direct_capacity{suffix}"] = {"p0": p0(20.0, 1000.0)}
        phases[f"sits_capacity{suffix}"] = {"p0": p0(20.0 + added, 950.0)}
    return phases


def test_the_side_by_side_phase_gives_its_own_figures_beside_the_pairs() -> None:
    phases = pairs([3.0, -1.0, 5.0])
    phases[SIDE_BY_SIDE] = {"direct": p0(30.0, 500.0), "sits": p0(30.5, 490.0)}
    phases[SIDE_BY_SIDE_ENVOY] = {"envoy": p0(32.0, 480.0), "sits": p0(31.0, 504.0)}
    figures, baseline = capacity_figures(phases)
    assert figures["ttft_p50_added_ms_over_envoy_alone"] == -1.0
    assert figures["throughput_ratio_over_envoy_alone"] == 1.05
    assert figures["ttft_p50_added_ms"] == 3.0  # the median of the pairs' differences
    assert figures["throughput_ratio"] == 0.95
    assert figures["ttft_p50_added_ms_side_by_side"] == 0.5
    assert figures["throughput_ratio_side_by_side"] == 0.98
    assert baseline["direct_ttft_p50_ms_side_by_side"] == 30.0


def test_a_run_from_before_the_side_by_side_phase_still_has_its_figures() -> None:
    figures, _ = capacity_figures(pairs([1.0, 2.0, 3.0]))
    assert "ttft_p50_added_ms_side_by_side" not in figures
    assert "ttft_p50_added_ms_over_envoy_alone" not in figures
    assert figures["ttft_p50_added_ms"] == 2.0


def test_the_side_by_side_phase_is_not_taken_for_a_p0_phase_of_the_overload_figures() -> None:
    phases = pairs([1.0, 1.0, 1.0])
    phases[SIDE_BY_SIDE] = {"direct": p0(30.0, 500.0), "sits": p0(31.0, 495.0)}
    for name in ("unloaded", "load_1x", "load_2x"):
        phases[f"with_{name}"] = phases[f"without_{name}"] = {"p0": p0(40.0, 300.0)}
    for name in ("with_loaded", "without_loaded"):
        phases[name] = {"p0": p0(50.0, 200.0), "p2": p0(50.0, 200.0)}
    figures, _ = variant_figures(phases)
    assert figures["p0_ttft_p99_ratio_with_sits"] == 1.25
    assert figures["ttft_p50_added_ms_side_by_side"] == 1.0
