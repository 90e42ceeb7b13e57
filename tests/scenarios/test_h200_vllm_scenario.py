"""The real-vLLM scenario's pure parts: plans, the squeeze size, the refusals, and how runs are judged.

The runs themselves need a GPU (`make demo-gpu`; on the H200: scenarios/h200_vllm/run_h200.sh);
`python -m scenarios.h200_vllm.run --device cpu` rehearses the whole wiring on the CPU build.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.h200_vllm_oom import estimator_checks
from scenarios.h200_vllm import cotenant, plan, report
from scenarios.h200_vllm.engine import hook_entry_point_dir, parse_engine_log
from scenarios.h200_vllm.shapes import SHAPES
from services.decision.domain.kv_model import known_model, shape_from_hf_config

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
LLAMA = known_model("llama-3-8b")


def test_the_squeeze_leaves_less_than_a_full_step_needs_and_more_than_a_fitted_one() -> None:
    leave = plan.leave_bytes(LLAMA, 32768, 128)
    # What the step allocates, before the allocator's overhead: even with every cached byte reused it dies.
    allocated = LLAMA.activation_bytes(32768, 128, 2)
    assert leave < 0.6 * allocated
    assert leave < plan.step_need_bytes(LLAMA, 32768, 128) / 2
    assert plan.step_need_bytes(LLAMA, 8192, 128) < leave
    assert plan.leave_bytes(LLAMA, 512, 32) == GIB  # never below the floor
    assert plan.leave_bytes(LLAMA, 512, 32, floor=0) < GIB


def test_the_cotenant_counts_the_engines_cache_as_headroom_and_takes_only_free_memory() -> None:
    # 10 GiB free, 3 GiB cached in the engine, 2 GiB to leave: 11 GiB to take over the steps left.
    assert cotenant.step_bytes(10 * GIB, 3 * GIB, 2 * GIB, 1) == 10 * GIB - (64 << 20)
    assert cotenant.step_bytes(10 * GIB, 3 * GIB, 2 * GIB, 4) == 11 * GIB // 4
    assert cotenant.step_bytes(10 * GIB, None, 2 * GIB, 2) == 4 * GIB  # cache unknown: free memory only
    assert cotenant.step_bytes(GIB, 0, 2 * GIB, 1) == 0  # already below: nothing taken


@pytest.mark.parametrize("name", list(plan.PLANS))
def test_each_plan_brings_a_step_larger_than_the_budget_after_the_squeeze(name: str) -> None:
    scenario = plan.PLANS[name](32768, 3 * GIB)
    trigger = [a for a in scenario.arrivals if a.t == scenario.trigger_s and a.kind in ("cluster", "burst")]
    assert sum(a.prompt_tokens for a in trigger) > 32768
    squeeze_done = scenario.squeeze.start_s + scenario.squeeze.period_s * (scenario.squeeze.steps - 1)
    assert squeeze_done < scenario.trigger_s < scenario.load_s
    assert [a.t for a in scenario.arrivals] == sorted(a.t for a in scenario.arrivals)
    assert {a.tier for a in scenario.arrivals} <= set(plan.TIERS)
    # Before the trigger, no step is anywhere near the budget.
    before = [a for a in scenario.arrivals if a.t < scenario.trigger_s]
    assert max(a.prompt_tokens for a in before) <= 32768 // 4


def test_prompts_differ_per_request_and_stay_in_the_vocabulary() -> None:
    arrival = plan.Arrival(0.0, "p1", 64, 8, "long")
    one, two = plan.prompt_for(arrival, 1, 1000), plan.prompt_for(arrival, 2, 1000)
    assert one != two and len(one) == 64
    assert all(10 <= t < 990 for t in one + two)
    assert plan.prompt_for(arrival, 1, 1000) == one


def test_the_device_check_says_why_it_refuses() -> None:
    weights = LLAMA.weight_bytes_per_rank(2)
    assert plan.check_device(140 * GIB, 139 * GIB, 0.45, weights) is None
    reason = plan.check_device(140 * GIB, 40 * GIB, 0.45, weights)
    assert reason is not None and "free" in reason and "gpu_memory_utilization" in reason
    reason = plan.check_device(24 * GIB, 24 * GIB, 0.5, weights)
    assert reason is not None
    tiny_gpu = plan.check_device(80 * GIB, 80 * GIB, 0.2, weights)
    assert tiny_gpu is not None and "weights" in tiny_gpu


def test_the_shapes_are_the_decisions_known_models() -> None:
    for shape in SHAPES.values():
        from_config = shape_from_hf_config(shape.config, name=shape.decision_model)
        assert from_config == known_model(shape.decision_model)


def test_vllm_start_up_memory_is_read_from_its_log() -> None:
    text = (
        "INFO Asynchronous scheduling is enabled.\n"
        "INFO Available KV cache memory: 44.31 GiB\n"
        "INFO ... Actual usage is 14.97 GiB for weight, 3.41 GiB for peak activation, 0.22 GiB for non-torch memory\n"
        "ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB.\n"
    )
    found = parse_engine_log(text)
    assert found["peak_activation_gib"] == 3.41 and found["kv_cache_gib"] == 44.31 and found["weights_gib"] == 14.97
    assert found["async_scheduling"] == 1.0 and found["oom_in_log"] == 1.0


def test_the_oom_hook_entry_point_is_found_by_the_plugin_loader(tmp_path: Path) -> None:
    installed = any(ep.name == "sits_oom_hook" for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))
    folder = hook_entry_point_dir(tmp_path)
    if installed:
        assert folder is None  # the package's own entry point serves
        return
    assert folder is not None
    code = (
        "import importlib.metadata as m; "
        "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'sits_oom_hook'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(folder)}, capture_output=True, text=True, check=True
    )
    assert "sits_engine.oom_hook.plugin:register" in out.stdout


def _run(mode: str, *, died: bool, warn_t: float | None, death_t: float | None, completed: int) -> dict[str, Any]:
    t0 = 1_800_000_000.0

    def stamp(t: float) -> str:
        from google.protobuf.timestamp_pb2 import Timestamp

        ts = Timestamp()
        ts.FromNanoseconds(int((t0 + t) * 1e9))
        return ts.ToJsonString()

    commands = [] if warn_t is None else [{"meta": {"produced_at": stamp(warn_t)}, "policy_rule": "step-budget-cut"}]
    ooms = [{"meta": {"produced_at": stamp(death_t)}, "requested_bytes": "1"}] if died and death_t else []
    verdicts = [{"meta": {"produced_at": stamp(9.0)}, "verdict": "VERDICT_CONFIRMED"}] if mode == "with" else []
    return {
        "shape": "llama-3-8b",
        "scenario": "cotenant_steps",
        "mode": mode,
        "t0": t0,
        "records": {"commands": commands, "oom": ooms, "verdicts": verdicts, "results": []},
        "outcomes": [{"completed": i < completed} for i in range(10)],
        "first_unhealthy_s": death_t + 0.3 if died and death_t else None,
        "engine_log": {"oom_in_log": 1.0 if died else 0.0, "peak_activation_gib": 3.41},
        "engine_args": {"max_num_batched_tokens": 32768},
        "plan": {"trigger_s": 16.0, "load_s": 24.0},
        "plugin_states": [
            {"t": 1.0, "budget": 32768, "waiting": 0, "peak": 70 * GIB, "floor": 60 * GIB},
            {"t": 16.5, "budget": 17152, "waiting": 8, "peak": 62 * GIB, "floor": 60 * GIB},
        ],
    }


def test_a_run_is_judged_by_its_death_its_first_warning_and_what_it_served() -> None:
    without = _run("without", died=True, warn_t=11.0, death_t=16.1, completed=4)
    with_ = _run("with", died=False, warn_t=11.1, death_t=None, completed=10)
    s = report.summarize([without, with_])
    assert s["totals"] == {
        "engine": "",
        "scenarios": 1,
        "engine_deaths_without": 1,
        "engine_deaths_with": 0,
        "served_ratio_with": 1.0,
        "validator_ran": 1,
        "warning_lead_s_min": pytest.approx(5.1),
        "verdicts_failed_only_on_device_memory": 0,
    }
    row = s["scenarios"][0]
    assert row["served_without"] == "4/10" and row["death_t_without"] == pytest.approx(16.1)
    run = next(r for r in s["runs"] if r["mode"] == "with")
    assert run["activation"]["largest_step_budget"] == 17152
    assert run["activation"]["measured_peak_minus_floor_bytes"] == 10 * GIB


def test_a_cut_is_read_against_the_engines_own_memory_while_a_co_tenant_fills_the_device() -> None:
    with_ = _run("with", died=False, warn_t=11.0, death_t=None, completed=10)
    t0 = with_["t0"]

    def nvml(t: float, engine_gib: float, other_gib: float) -> dict[str, Any]:
        from google.protobuf.timestamp_pb2 import Timestamp

        ts = Timestamp()
        ts.FromNanoseconds(int((t0 + t) * 1e9))
        return {
            "meta": {"produced_at": ts.ToJsonString()},
            "gpu": {"used_bytes": str(int((engine_gib + other_gib) * GIB)), "total_bytes": str(80 * GIB)},
            "processes": [
                {"pid": 7, "used_bytes": str(int(engine_gib * GIB)), "is_target_engine": True},
                {"pid": 8, "used_bytes": str(int(other_gib * GIB))},
            ],
        }

    # The co-tenant grows from 40 to 49 GiB after the cut; the engine stays at 30 GiB, then 30.25.
    with_["records"]["metrics"] = [nvml(10.0 + i, 30.0 if i < 4 else 30.25, 40.0 + i) for i in range(10)]
    with_["records"]["verdicts"] = [
        {
            "meta": {"produced_at": with_["records"]["commands"][0]["meta"]["produced_at"]},
            "verdict": "VERDICT_NOT_KEPT",
            "checks": [{"name": "no_oom", "passed": True}, {"name": "gpu_memory_below", "observed": 0.99}],
        }
    ]
    s = report.summarize([_run("without", died=True, warn_t=11.0, death_t=16.1, completed=4), with_])
    run = next(r for r in s["runs"] if r["mode"] == "with")
    [after] = run["engine_memory_after_commands"]
    assert after["engine_bytes_at_command"] == 30 * GIB and after["growth_bytes"] == GIB // 4
    assert s["totals"]["engine_memory_growth_after_cuts_max_bytes"] == GIB // 4
    assert s["totals"]["verdicts_failed_only_on_device_memory"] == 1


def test_the_estimator_is_checked_against_vllms_profile_and_the_measured_slope() -> None:
    runs = [
        {
            "shape": "llama-3-8b",
            "mode": "with",
            "scenario": name,
            "activation": {
                "profiled_at_tokens": 32768,
                "profiled_peak_activation_gib": 3.41,
                "largest_step_budget": tokens,
                "measured_peak_minus_floor_bytes": tokens * 110_000,
            },
        }
        for name, tokens in (("a", 13056), ("b", 17152))
    ]
    checks = estimator_checks(runs, {})
    assert checks["vs_vllm_profile"][0]["rel_error"] == pytest.approx(0.09, abs=0.005)
    slope = checks["per_token_slope"][0]
    assert slope["measured_bytes_per_token"] == pytest.approx(110_000, rel=1e-3)
    assert slope["estimate_bytes_per_token"] == (4 * 4096 + 3 * 14336) * 2


def test_the_runner_refuses_without_a_gpu_or_vllm_and_says_why(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "scenarios.h200_vllm.run", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode == 0:
        pytest.skip("a GPU and vLLM are here: the runner ran")
    assert out.returncode == 2
    assert "cannot run here" in out.stderr
    assert any(w in out.stderr for w in ("GPU", "NVML", "vLLM")), out.stderr
    assert not (tmp_path / "summary.json").exists()


def test_the_engine_is_sized_from_the_gpu_found() -> None:
    weights = LLAMA.weight_bytes_per_rank(2)
    assert plan.choose_utilization(140 * GIB, weights) == 0.45  # the H200 configuration
    on_80 = plan.choose_utilization(80 * GIB, weights)
    assert 0.3 < on_80 < 0.45 and plan.check_device(80 * GIB, 79 * GIB, on_80, weights) is None
    on_24 = plan.choose_utilization(24 * GIB, weights)
    reason = plan.check_device(24 * GIB, 24 * GIB, on_24, weights)
    assert reason is not None and "too small" in reason
