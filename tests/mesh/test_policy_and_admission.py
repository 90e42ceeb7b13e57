"""Pure logic: the policy model, Generate parsing, priorities, shedding, fallbacks."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
from smg_grpc_proto import vllm_engine_pb2

from sits.runtime.clock import ManualClock
from sits.runtime.contract import ALL_TIERS
from sits_mesh.admission import (
    AdmissionQuery,
    NotAGenerateRequest,
    RecentFreeKv,
    Verdict,
    fallback_verdict,
    format_bytes,
    frame_complete,
    kv_reason,
    parse_generate,
    priority_of,
    refusal_message,
    shed_reason,
)
from sits_mesh.ext_proc import FilePressure
from sits_mesh.policy import (
    PRIORITY_NAMES,
    Admission,
    MeshPolicy,
    PolicyError,
    Priorities,
    PriorityName,
    load_policy,
    parse_policy,
)
from sits_mesh.pressure import read_pressure, write_pressure
from tests.mesh.helpers import generate_request, grpc_frame

REPO = Path(__file__).resolve().parents[2]


def test_the_mesh_names_the_contract_tiers() -> None:
    assert get_args(PriorityName) == PRIORITY_NAMES == tuple(tier.mesh_name for tier in ALL_TIERS)


def test_the_default_policy_file_validates() -> None:
    policy = load_policy(REPO / "mesh" / "policy.yaml")
    assert policy.admin.address == "127.0.0.1"
    assert policy.http2.initial_stream_window_bytes == 65536
    assert set(policy.priorities.classes) == {"p0", "p1", "p2"}
    assert policy.cluster_for("p2") == "vllm_p2"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("admin: {address: 0.0.0.0, port: 9901}", "loopback"),
        ("http2: {initial_stream_window_bytes: 1000}", "http2.initial_stream_window_bytes"),
        (
            "http2: {initial_stream_window_bytes: 131072, initial_connection_window_bytes: 65536}",
            "initial_connection_window_bytes must be",
        ),
        ("overload: {shed_at: 0.96, stop_accepting_at: 0.95}", "shed_at must be lower"),
        ("priorities: {classes: {p0: {max_requests: 1}}}", "lacks"),
        ("rate_limit: {enabled_percent: 101}", "rate_limit.enabled_percent"),
        ("surprise: 1", "surprise"),
        ("- a list", "mapping"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(PolicyError, match=field):
        parse_policy(text)


def test_frames_and_generate_parsing() -> None:
    body = grpc_frame(generate_request(prompt_tokens=123, max_tokens=17).SerializeToString())
    assert not frame_complete(body[:4])
    assert not frame_complete(body[:-1])
    assert frame_complete(body)
    shape = parse_generate(body)
    assert (shape.prompt_tokens, shape.max_tokens) == (123, 17)
    with pytest.raises(NotAGenerateRequest):
        parse_generate(body[:-1])
    with pytest.raises(NotAGenerateRequest):
        parse_generate(b"\x01" + body[1:])


def test_text_prompts_and_several_samples_are_counted_generously() -> None:
    request = vllm_engine_pb2.GenerateRequest(
        text="x" * 400, sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=10, n=3)
    )
    shape = parse_generate(grpc_frame(request.SerializeToString()))
    assert shape.prompt_tokens == 101
    assert shape.max_tokens == 30
    assert shape.prompt_logprobs == 0
    request.sampling_params.prompt_logprobs = 4
    assert parse_generate(grpc_frame(request.SerializeToString())).prompt_logprobs == 4


def test_priorities_and_pressure_shedding() -> None:
    priorities = Priorities()
    assert priority_of("P2", priorities) == "p2"
    assert priority_of(None, priorities) == "p1"
    assert priority_of("urgent", priorities) == "p1"
    assert shed_reason("p2", 0.69, priorities) is None
    assert "priority p2 is shed" in (shed_reason("p2", 0.7, priorities) or "")
    assert shed_reason("p1", 0.8, priorities) is None
    assert shed_reason("p1", 0.9, priorities) is not None
    assert shed_reason("p0", 1.0, priorities) is None
    assert shed_reason("p2", None, priorities) is None


def test_fallback_admits_unless_over_the_local_cap() -> None:
    query = AdmissionQuery(prompt_tokens=900, max_tokens=200, priority="p0")
    assert fallback_verdict(query, Admission()).admitted
    refused = fallback_verdict(query, Admission(fallback_max_total_tokens=1000))
    assert not refused.admitted
    assert "1100 tokens" in refused.reason


def test_reasons_are_readable() -> None:
    assert format_bytes(41 << 30) == "41.0 GiB"
    assert format_bytes(3 << 20) == "3.0 MiB"
    assert format_bytes(12) == "12 B"
    assert kv_reason(41 << 30, 9 << 30, 100_000, 1000).startswith("the prompt needs 41.0 GiB of KV")
    assert kv_reason(41 << 30, 9 << 30, 100_000, 1000).endswith("and 9.0 GiB is free")
    message = refusal_message(Verdict(admitted=False, reason="", kv_bytes_needed=41 << 30, kv_bytes_free=9 << 30))
    assert message == "refused by SITS admission: the prompt needs 41.0 GiB of KV and 9.0 GiB is free"


def test_pressure_file_round_trip_and_cache(tmp_path: Path) -> None:
    path = tmp_path / "p"
    assert read_pressure(path) is None
    write_pressure(path, 0.5)
    assert read_pressure(path) == 0.5
    with pytest.raises(ValueError, match="within"):
        write_pressure(path, 1.5)
    clock = ManualClock()
    source = FilePressure(path, clock, max_age_s=1.0)
    assert source.current() == 0.5
    write_pressure(path, 0.9)
    assert source.current() == 0.5  # cached within max_age
    clock.advance(1.0)
    assert source.current() == 0.9
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # no staging files left behind


def test_default_policy_round_trips_through_yaml() -> None:
    import yaml

    policy = MeshPolicy()
    assert parse_policy(yaml.safe_dump(policy.model_dump())) == policy


def test_tiny_requests_are_admitted_locally_only_against_a_fresh_answer() -> None:
    clock = ManualClock()
    admission = Admission(local_admit_fraction=0.01, local_admit_max_age_s=0.5, kv_bytes_per_token=1024)
    recent = RecentFreeKv(admission, clock)
    tiny = AdmissionQuery(prompt_tokens=8, max_tokens=2, priority="p1")  # 10 KiB
    assert not recent.admits_locally(tiny)  # nothing heard yet: ask
    recent.remember(Verdict(admitted=True, reason="", kv_bytes_needed=10 << 10, kv_bytes_free=1 << 20))
    assert recent.admits_locally(tiny)  # 10 KiB <= 1% of 1 MiB
    assert not recent.admits_locally(AdmissionQuery(prompt_tokens=20, max_tokens=0, priority="p1"))
    clock.advance(0.6)
    assert not recent.admits_locally(tiny)  # stale: ask again
    never = RecentFreeKv(Admission(kv_bytes_per_token=0), clock)
    never.remember(Verdict(admitted=True, reason="", kv_bytes_free=1 << 40))
    assert not never.admits_locally(tiny)


def test_p0_that_fits_the_recent_free_kv_is_admitted_without_asking() -> None:
    # P0 is refused only when its own request does not fit: one that fits what was free a moment ago needs
    # no second hop. A lower tier of the same size still asks (the P0 reserve is the decision's to count).
    clock = ManualClock()
    admission = Admission(
        local_admit_fraction=0.01, local_admit_max_age_s=0.5, kv_bytes_per_token=1024, bypass_max_request_tokens=512
    )
    recent = RecentFreeKv(admission, clock)
    p0 = AdmissionQuery(prompt_tokens=200, max_tokens=100, priority="p0")  # 300 KiB
    assert not recent.admits_locally(p0)  # nothing heard yet: ask
    recent.remember(Verdict(admitted=False, reason="", kv_bytes_free=400 << 10))
    assert recent.admits_locally(p0)
    assert not recent.admits_locally(AdmissionQuery(200, 100, "p1"))
    assert not recent.admits_locally(AdmissionQuery(300, 150, "p0"))  # 450 KiB: more than is free
    assert not recent.admits_locally(AdmissionQuery(200, 100, "p0", prompt_logprobs=5))  # logits: the decision's
    recent.remember(Verdict(admitted=True, reason="", kv_bytes_free=1 << 30))
    assert not recent.admits_locally(AdmissionQuery(400, 200, "p0"))  # over the max model length: refused there
    clock.advance(0.6)
    assert not recent.admits_locally(p0)  # stale: ask again
    off = RecentFreeKv(Admission(local_admit_fraction=0.0, kv_bytes_per_token=1024), clock)
    off.remember(Verdict(admitted=True, reason="", kv_bytes_free=1 << 30))
    assert not off.admits_locally(p0)  # local admission off: P0 asks too
