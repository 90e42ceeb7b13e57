"""The shared vocabulary: round trips against the generated enums, parse errors, and a light import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sits.runtime.contract import (
    ALL_TIERS,
    LOWEST_TIER,
    TIER_HEADER,
    ActionKind,
    Tier,
    action_kind_name,
    format_target_key,
    memory_fraction,
    parse_target_key,
)
from sits.v1 import common_pb2, events_pb2

HEAVY = ("grpc", "google.protobuf", "aiokafka", "pydantic_settings", "redis")


def test_target_key_wire_format_and_round_trip() -> None:
    target = common_pb2.Target(host="node-1", gpu_uuid="GPU-abc", mig_instance="MIG-2", engine="vllm-0")
    key = format_target_key(target)
    assert key == "node-1/GPU-abc/MIG-2/vllm-0"
    assert parse_target_key(key) == ("node-1", "GPU-abc", "MIG-2", "vllm-0")
    assert parse_target_key(key).engine == "vllm-0"
    assert parse_target_key(format_target_key(common_pb2.Target(host="h", engine="e"))) == ("h", "", "", "e")


@pytest.mark.parametrize("key", ["", "host", "h/g/m"])
def test_target_key_parse_refuses_short_keys(key: str) -> None:
    with pytest.raises(ValueError, match="host/gpu_uuid/mig_instance/engine"):
        parse_target_key(key)


def test_tier_matches_the_proto_priority() -> None:
    for tier in ALL_TIERS:
        proto = tier.to_proto()
        assert common_pb2.Priority.Name(proto) == f"PRIORITY_{tier.name}"  # type: ignore[arg-type]
        assert Tier.from_proto(proto) is tier
    assert [t.to_proto() for t in ALL_TIERS] == [v for v in common_pb2.Priority.values() if v]
    for bad in (common_pb2.PRIORITY_UNSPECIFIED, 4, -1):
        with pytest.raises(ValueError, match="not P0, P1 or P2"):
            Tier.from_proto(bad)


def test_tier_names() -> None:
    assert ALL_TIERS == (Tier.P0, Tier.P1, Tier.P2)
    assert LOWEST_TIER is Tier.P2 and max(ALL_TIERS) is LOWEST_TIER
    assert TIER_HEADER == "x-sits-priority"
    assert [t.mesh_name for t in ALL_TIERS] == ["p0", "p1", "p2"]
    assert Tier.parse("p1") is Tier.P1 and Tier.parse(" P2 ") is Tier.P2
    for bad in ("", "p3", "high", "0"):
        with pytest.raises(ValueError, match="unknown tier"):
            Tier.parse(bad)


def test_action_kind_matches_the_proto() -> None:
    wire = {v for v in events_pb2.ActionKind.values() if v}
    assert {k.to_proto() for k in ActionKind} == wire
    for kind in ActionKind:
        assert events_pb2.ActionKind.Name(kind.to_proto()) == f"ACTION_KIND_{kind.name}"  # type: ignore[arg-type]
        assert ActionKind.from_proto(kind.to_proto()) is kind
        assert ActionKind.parse(kind.name) is kind
        assert ActionKind.parse(f"ACTION_KIND_{kind.name}") is kind
        assert action_kind_name(kind) == kind.name
    assert action_kind_name(events_pb2.ACTION_KIND_UNSPECIFIED) == "UNSPECIFIED"
    assert action_kind_name(99) == "99"
    with pytest.raises(ValueError, match="unknown action kind"):
        ActionKind.from_proto(events_pb2.ACTION_KIND_UNSPECIFIED)
    with pytest.raises(ValueError, match="unknown action kind"):
        ActionKind.parse("REBOOT")


def test_memory_fraction() -> None:
    sample = events_pb2.MetricSample()
    assert memory_fraction(sample) is None
    sample.engine.kv_cache_usage = 0.25
    assert memory_fraction(sample) == 0.25
    sample.gpu.used_bytes, sample.gpu.total_bytes = 3, 4
    assert memory_fraction(sample) == 0.75


def test_importing_the_contract_loads_nothing_heavy() -> None:
    code = (
        "import sys, sits.runtime.contract\n"
        f"heavy = {HEAVY!r}\n"
        "print(','.join(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy))))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == ""
