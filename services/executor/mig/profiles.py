"""Built-in MIG GPU-instance profile tables for the GPUs SITS repartitions.

Where the numbers come from:

- Placements (valid start slots and sizes, in *memory slices* of 8): NVIDIA's `nvidia-smi mig -lgipp`
  output as printed in the MIG User Guide ("Getting Started with MIG", A100) and in NVIDIA's technical
  blog on the H100 NVL ("Profile ID 9 Placements: {0,4}:4" etc.); NVML documents a placement as
  "start: index of first occupied memory slice, size: number of memory slices occupied", and says that
  creating a GPU instance fails if its memory slices overlap an existing instance's
  (nvmlDeviceGetGpuInstancePossiblePlacements_v2, NVML API reference). All four GPUs below share the
  same placement grid: 1g {0..6}:1, 1g+me {0..6}:1, 1g with two memory slices {0,2,4,6}:2,
  2g {0,2,4}:2, 3g {0,4}:4, 4g {0}:4, 7g {0}:8.
- Maximum instances: the "Number of Instances Available" column of the MIG User Guide's
  "Supported MIG Profiles" tables (7, 1, 4, 3, 2, 1, 1).
- Memory (MiB): H200-141GB as read through NVML on the H200 machine (see FACTS.md and
  tests/mig/data/h200_nvml_profiles.json). The others are `nvidia-smi mig -lgip` "Memory GiB" columns
  published for each card (H100-80GB: 9.75/19.62/39.50/79.25; A100-80GB: 9.50/19.50/39.25/79.00;
  A100-40GB: 4.75/9.75/19.62/39.50) times 1024. They move by a few hundred MiB between driver
  releases, so on a live machine `nvml_profiles.read_profiles_from_nvml` is the authority.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of one GPU model."""

    name: str
    # Index into NVML's NVML_GPU_INSTANCE_PROFILE_* enum (what nvmlDeviceGetGpuInstanceProfileInfo takes).
    nvml_profile: int
    # The profile ID NVML returns in info.id and nvidia-smi prints; creation and placement calls take it.
    profile_id: int
    compute_slices: int
    memory_slices: int
    memory_mib: int
    max_instances: int
    starts: tuple[int, ...]
    media_extensions: bool = False

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    def slices_at(self, start: int) -> range:
        return range(start, start + self.memory_slices)


@dataclass(frozen=True)
class GpuModel:
    """A MIG-capable GPU: its slice grid and the profiles that can be carved from it."""

    key: str
    # Substrings of nvmlDeviceGetName() that identify this model.
    name_markers: tuple[str, ...]
    profiles: tuple[MigProfile, ...]
    compute_slices: int = 7
    memory_slices: int = 8

    def profile(self, name: str) -> MigProfile:
        for profile in self.profiles:
            if profile.name == name:
                return profile
        known = ", ".join(p.name for p in self.profiles)
        raise KeyError(f"{self.key} has no MIG profile {name!r} (known: {known})")

    def has_profile(self, name: str) -> bool:
        return any(p.name == name for p in self.profiles)

    def by_profile_id(self, profile_id: int) -> MigProfile:
        for profile in self.profiles:
            if profile.profile_id == profile_id:
                return profile
        raise KeyError(f"{self.key} has no MIG profile with NVML profile ID {profile_id}")

    @property
    def largest(self) -> MigProfile:
        return max(self.profiles, key=lambda p: (p.memory_mib, p.compute_slices))


# NVML_GPU_INSTANCE_PROFILE_* enum values (nvml.h), kept here so this module needs no pynvml.
NVML_PROFILE_1_SLICE = 0
NVML_PROFILE_2_SLICE = 1
NVML_PROFILE_3_SLICE = 2
NVML_PROFILE_4_SLICE = 3
NVML_PROFILE_7_SLICE = 4
NVML_PROFILE_1_SLICE_REV1 = 7  # 1g with media extensions (+me)
NVML_PROFILE_1_SLICE_REV2 = 9  # 1g with two memory slices

_ALL_STARTS_1 = (0, 1, 2, 3, 4, 5, 6)


def _standard_profiles(
    one: tuple[str, int],
    one_double: tuple[str, int],
    two: tuple[str, int],
    three: tuple[str, int],
    four: tuple[str, int],
    seven: tuple[str, int],
) -> tuple[MigProfile, ...]:
    """The seven profiles every 7-compute/8-memory-slice card has; only names and memory differ."""
    return (
        MigProfile(one[0], NVML_PROFILE_1_SLICE, 19, 1, 1, one[1], 7, _ALL_STARTS_1),
        MigProfile(
            f"{one[0]}+me", NVML_PROFILE_1_SLICE_REV1, 20, 1, 1, one[1], 1, _ALL_STARTS_1, media_extensions=True
        ),
        MigProfile(one_double[0], NVML_PROFILE_1_SLICE_REV2, 15, 1, 2, one_double[1], 4, (0, 2, 4, 6)),
        MigProfile(two[0], NVML_PROFILE_2_SLICE, 14, 2, 2, two[1], 3, (0, 2, 4)),
        MigProfile(three[0], NVML_PROFILE_3_SLICE, 9, 3, 4, three[1], 2, (0, 4)),
        MigProfile(four[0], NVML_PROFILE_4_SLICE, 5, 4, 4, four[1], 1, (0,)),
        MigProfile(seven[0], NVML_PROFILE_7_SLICE, 0, 7, 8, seven[1], 1, (0,)),
    )


A100_40GB = GpuModel(
    key="a100-40gb",
    name_markers=("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
    # 1g.10gb is absent from the published -lgip listing (older driver); it has the same two memory
    # slices as 2g.10gb, so it gets 2g.10gb's memory.
    profiles=_standard_profiles(
        ("1g.5gb", 4864),
        ("1g.10gb", 9984),
        ("2g.10gb", 9984),
        ("3g.20gb", 20096),
        ("4g.20gb", 20096),
        ("7g.40gb", 40448),
    ),
)
A100_80GB = GpuModel(
    key="a100-80gb",
    name_markers=("A100-SXM4-80GB", "A100-PCIE-80GB", "A100 80GB"),
    profiles=_standard_profiles(
        ("1g.10gb", 9728),
        ("1g.20gb", 19968),
        ("2g.20gb", 19968),
        ("3g.40gb", 40192),
        ("4g.40gb", 40192),
        ("7g.80gb", 80896),
    ),
)
H100_80GB = GpuModel(
    key="h100-80gb",
    name_markers=("H100 80GB", "H100-SXM5-80GB", "H100 PCIe"),
    profiles=_standard_profiles(
        ("1g.10gb", 9984),
        ("1g.20gb", 20096),
        ("2g.20gb", 20096),
        ("3g.40gb", 40448),
        ("4g.40gb", 40448),
        ("7g.80gb", 81152),
    ),
)
H200_141GB = GpuModel(
    key="h200-141gb",
    name_markers=("H200",),
    profiles=_standard_profiles(
        ("1g.18gb", 16384),
        ("1g.35gb", 33280),
        ("2g.35gb", 33280),
        ("3g.71gb", 71424),
        ("4g.71gb", 71424),
        ("7g.141gb", 143360),
    ),
)

GPU_MODELS: Mapping[str, GpuModel] = {m.key: m for m in (A100_40GB, A100_80GB, H100_80GB, H200_141GB)}


def gpu_model(key: str) -> GpuModel:
    try:
        return GPU_MODELS[key.lower()]
    except KeyError:
        raise KeyError(f"unknown GPU model {key!r} (known: {', '.join(GPU_MODELS)})") from None


def model_for_device_name(device_name: str) -> GpuModel | None:
    """The built-in model whose markers occur in an NVML device name, e.g. 'NVIDIA H200'."""
    for model in GPU_MODELS.values():
        if any(marker.lower() in device_name.lower() for marker in model.name_markers):
            return model
    return None


def profile_table(model: GpuModel) -> list[dict[str, Any]]:
    """The table as plain JSON-ready rows (for the CLI and for comparison with NVML)."""
    return [
        {
            "name": p.name,
            "profile_id": p.profile_id,
            "nvml_profile": p.nvml_profile,
            "compute_slices": p.compute_slices,
            "memory_slices": p.memory_slices,
            "memory_mib": p.memory_mib,
            "max_instances": p.max_instances,
            "placements": [{"start": s, "size": p.memory_slices} for s in p.starts],
        }
        for p in model.profiles
    ]


def compare_with_nvml(model: GpuModel, nvml_profiles: Iterable[Mapping[str, Any]]) -> list[str]:
    """Differences between the built-in table and profiles read from NVML; empty when they agree.

    `nvml_profiles` rows carry what NVML reports: name ("MIG 1g.18gb" or "1g.18gb"), profile_id,
    slice_count, instance_count, memory_mib and placements [{start, size}] (placements may be absent
    when NVML would not answer; then they are not compared).
    """
    differences: list[str] = []
    seen: set[str] = set()
    for row in nvml_profiles:
        name = str(row["name"]).removeprefix("MIG ").strip()
        seen.add(name)
        if not model.has_profile(name):
            differences.append(f"NVML reports {name!r}, which the built-in {model.key} table lacks")
            continue
        built_in = model.profile(name)
        checks: list[tuple[str, object, object]] = [
            ("profile_id", built_in.profile_id, row.get("profile_id")),
            ("compute_slices", built_in.compute_slices, row.get("slice_count")),
            ("max_instances", built_in.max_instances, row.get("instance_count")),
            ("memory_mib", built_in.memory_mib, row.get("memory_mib")),
        ]
        placements = row.get("placements")
        if placements is not None:
            nvml_placements = sorted((int(p["start"]), int(p["size"])) for p in placements)
            checks.append(("placements", [(s, built_in.memory_slices) for s in built_in.starts], nvml_placements))
        for field, ours, theirs in checks:
            if theirs is not None and ours != theirs:
                differences.append(f"{name}: {field} built-in {ours} != NVML {theirs}")
    for profile in model.profiles:
        if profile.name not in seen:
            differences.append(f"built-in {model.key} profile {profile.name!r} was not reported by NVML")
    return differences
