"""The built-in profile tables against what NVML reported on the real H200 (recorded once, read-only)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from services.executor.mig.nvml_profiles import read_profiles_from_nvml
from services.executor.mig.profiles import (
    GPU_MODELS,
    H200_141GB,
    compare_with_nvml,
    gpu_model,
    model_for_device_name,
)
from tests.mig.nvml_standin import MigNvmlStandIn

DATA = Path(__file__).parent / "data"
RECORDED = json.loads((DATA / "h200_nvml_profiles.json").read_text())


def test_recorded_h200_nvml_profiles_agree_with_the_built_in_table() -> None:
    nvml = RECORDED["nvml"]
    assert nvml["device_name"] == "NVIDIA H200"
    assert nvml["errors"] == []
    assert len(nvml["profiles"]) == len(H200_141GB.profiles)
    assert compare_with_nvml(H200_141GB, nvml["profiles"]) == []


def test_recorded_profiles_match_the_verified_facts() -> None:
    # (slices, max instances, MiB) as FACTS.md lists them for the H200.
    facts = {
        "1g.18gb": (1, 7, 16384),
        "1g.18gb+me": (1, 1, 16384),
        "1g.35gb": (1, 4, 33280),
        "2g.35gb": (2, 3, 33280),
        "3g.71gb": (3, 2, 71424),
        "4g.71gb": (4, 1, 71424),
        "7g.141gb": (7, 1, 143360),
    }
    seen = {
        row["name"].removeprefix("MIG "): (row["slice_count"], row["instance_count"], row["memory_mib"])
        for row in RECORDED["nvml"]["profiles"]
    }
    assert seen == facts
    built_in = {p.name: (p.compute_slices, p.max_instances, p.memory_mib) for p in H200_141GB.profiles}
    assert built_in == facts


def test_recorded_nvidia_smi_placements_match_the_built_in_table() -> None:
    text = (DATA / "h200_nvidia_smi_mig.txt").read_text()
    lines = re.findall(r"Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}:(\d+)", text)
    assert len(lines) == 7
    for profile_id, starts, size in lines:
        profile = H200_141GB.by_profile_id(int(profile_id))
        assert tuple(int(s) for s in starts.split(",")) == profile.starts
        assert int(size) == profile.memory_slices


def test_comparison_reports_each_kind_of_difference() -> None:
    rows = copy.deepcopy(RECORDED["nvml"]["profiles"])
    by_name = {row["name"]: row for row in rows}
    by_name["MIG 3g.71gb"]["placements"] = [{"start": 0, "size": 4}, {"start": 2, "size": 4}]
    by_name["MIG 1g.35gb"]["memory_mib"] = 32768
    rows.remove(by_name["MIG 7g.141gb"])
    rows.append(
        {
            "name": "MIG 1g.18gb-me",
            "profile_id": 21,
            "slice_count": 1,
            "instance_count": 7,
            "memory_mib": 16384,
            "placements": None,
        }
    )
    differences = compare_with_nvml(H200_141GB, rows)
    assert any("3g.71gb: placements" in d for d in differences)
    assert any("1g.35gb: memory_mib built-in 33280 != NVML 32768" in d for d in differences)
    assert any("'7g.141gb' was not reported" in d for d in differences)
    assert any("'1g.18gb-me'" in d and "lacks" in d for d in differences)
    assert len(differences) == 4


@pytest.mark.parametrize("key", sorted(GPU_MODELS))
def test_every_built_in_table_is_self_consistent(key: str) -> None:
    model = gpu_model(key)
    assert len(model.profiles) == 7
    for profile in model.profiles:
        for start in profile.starts:
            assert start + profile.memory_slices <= model.memory_slices
        # Each start slot holds one instance at a time, so the limit never exceeds the slots
        # (except +me, whose single media engine is the limit).
        assert profile.max_instances <= len(profile.starts)
        assert profile.compute_slices <= model.compute_slices
    memories = [p.memory_mib for p in sorted(model.profiles, key=lambda p: p.memory_slices)]
    assert memories == sorted(memories)


@pytest.mark.parametrize("key", sorted(GPU_MODELS))
def test_read_profiles_from_nvml_through_the_stand_in_agrees_for_every_model(key: str) -> None:
    model = gpu_model(key)
    nvml = MigNvmlStandIn([model], mig_enabled=False)
    report = read_profiles_from_nvml(nvml)
    assert report["errors"] == []
    assert report["mig_mode"] == {"current": 0, "pending": 0}
    assert compare_with_nvml(model, report["profiles"]) == []
    assert nvml.mutating_calls() == []


def test_device_names_map_to_models() -> None:
    assert model_for_device_name("NVIDIA H200") is H200_141GB
    assert model_for_device_name("NVIDIA A100-SXM4-80GB") is gpu_model("a100-80gb")
    assert model_for_device_name("NVIDIA A100-SXM4-40GB") is gpu_model("a100-40gb")
    assert model_for_device_name("NVIDIA H100 80GB HBM3") is gpu_model("h100-80gb")
    assert model_for_device_name("NVIDIA L4") is None
    with pytest.raises(KeyError, match="unknown GPU model"):
        gpu_model("b200")
