"""The HTTP path's Envoy and Istio output (engine_api: openai): valid for the real binary, tiers from tenants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sits_mesh.envoy_config import (
    EXT_PROC_FILTER,
    HOLD_FILTER,
    local_reply_config,
    render_bootstrap,
    render_bootstrap_yaml,
)
from sits_mesh.istio import render_istio
from sits_mesh.policy import MeshPolicy
from tests.mesh.helpers import apply_bootstrap_patches, envoy_validate, manager_of, policy_with_pressure_file

pytestmark = pytest.mark.envoy

TENANTS = {
    "tenants": [
        {"name": "gold", "tier": "p0", "api_keys": ["key-gold"]},
        {"name": "free", "tier": "p2", "api_keys": ["key-free-1", "key-free-2"]},
    ],
    "tenant_header": "x-sits-tenant",
}
VARIANTS: dict[str, dict[str, Any]] = {
    "openai": {"engine_api": "openai"},
    "openai_tenants": {"engine_api": "openai", "http": TENANTS},
    "openai_no_admission": {"engine_api": "openai", "admission": {"enabled": False}},
    "openai_bypass": {
        "engine_api": "openai",
        "http": {"models": ["m"]},
        "admission": {"bypass_max_request_tokens": 1024},
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_http_config_passes_envoy_validate(variant: str, tmp_path: Path) -> None:
    result = envoy_validate(render_bootstrap_yaml(policy_with_pressure_file(VARIANTS[variant], tmp_path)), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_tenant_keys_decide_the_tier_and_the_clients_tier_header_matches_nothing(tmp_path: Path) -> None:
    bootstrap = render_bootstrap(policy_with_pressure_file(VARIANTS["openai_tenants"], tmp_path))
    manager = manager_of(bootstrap)
    assert manager["codec_type"] == "AUTO"
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    matched_headers = {h["name"] for r in routes for h in r["match"].get("headers", [])}
    assert matched_headers == {"authorization", "x-sits-tenant"}
    gold = next(r for r in routes if r["name"] == "tenant_gold_0_chat")
    assert gold["match"]["headers"][0]["string_match"]["exact"] == "Bearer key-gold"
    assert gold["route"]["cluster"] == "vllm_p0"
    assert gold["request_headers_to_add"][0]["header"] == {"key": "x-sits-priority", "value": "p0"}
    overrides = gold["typed_per_filter_config"][EXT_PROC_FILTER]["overrides"]["grpc_initial_metadata"]
    assert {m["key"]: m["value"] for m in overrides} == {"x-sits-priority": "p0", "x-sits-openai-endpoint": "chat"}
    # The free tier's shed route comes before its forwarding routes; the catch-all 404 comes last.
    names = [r["name"] for r in routes]
    assert names.index("shed_tenant_free_0") < names.index("tenant_free_0_completions")
    assert names[-1] == "not_found" and routes[-1]["direct_response"]["status"] == 404
    unlabelled = next(r for r in routes if r["name"] == "unlabelled_completions")
    assert "headers" not in unlabelled["match"] and unlabelled["route"]["cluster"] == "vllm_p1"
    # vLLM's OpenAI server is HTTP/1.1.
    for cluster in bootstrap["static_resources"]["clusters"][:3]:
        options = cluster["typed_extension_protocol_options"]
        assert next(iter(options.values()))["explicit_http_config"] == {"http_protocol_options": {}}


@pytest.mark.parametrize("variant", ["openai", "openai_bypass"])
def test_the_processor_gets_one_body_message_and_the_router_waits_for_its_answer(variant: str, tmp_path: Path) -> None:
    filters = manager_of(render_bootstrap(policy_with_pressure_file(VARIANTS[variant], tmp_path)))["http_filters"]
    names = [f["name"] for f in filters]
    mode = next(f for f in filters if f["name"] == EXT_PROC_FILTER)["typed_config"]["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SKIP", "BUFFERED")
    # Without the header phase, only the buffer filter between the processor and the router keeps a request
    # the processor refuses from opening an upstream request (test_http_live checks no refusal reaches vLLM).
    assert names[-3:] == [EXT_PROC_FILTER, HOLD_FILTER, "envoy.filters.http.router"]
    hold = filters[-2]["typed_config"]
    assert hold["max_request_bytes"] == MeshPolicy().http.max_body_bytes
    # What skips the processor skips the hold too: the bypass routes, and only they.
    routes = manager_of(render_bootstrap(policy_with_pressure_file(VARIANTS[variant], tmp_path)))["route_config"]
    held = {
        r["name"]: HOLD_FILTER not in r.get("typed_per_filter_config", {})
        for r in routes["virtual_hosts"][0]["routes"]
        if r["name"].endswith(("_chat", "_completions", "_chat_bypass", "_completions_bypass"))
    }
    assert held and all(is_held != name.endswith("_bypass") for name, is_held in held.items())
    assert any(name.endswith("_bypass") for name in held) == (variant == "openai_bypass")


def test_local_replies_are_openai_errors_with_retry_after_for_shedding_and_overload() -> None:
    config = local_reply_config(MeshPolicy.model_validate({"engine_api": "openai", "http": {"retry_after_s": 3}}))
    breaker, shed, overload = config["mappers"][:3]
    assert breaker["filter"] == {"response_flag_filter": {"flags": ["UO"]}} and breaker["status_code"] == 429
    for mapper in (breaker, shed, overload):
        assert mapper["headers_to_add"][0]["header"] == {"key": "retry-after", "value": "3"}
    error = overload["body_format_override"]["json_format"]["error"]
    assert error["message"] == "%LOCAL_REPLY_BODY%" and error["type"] == "overloaded_error"


@pytest.mark.parametrize("variant", ["openai", "openai_tenants"])
def test_the_http_istio_patches_are_valid_envoy_config(variant: str, tmp_path: Path) -> None:
    policy = policy_with_pressure_file(VARIANTS[variant], tmp_path)
    http_filters, clusters, rule = render_istio(policy)
    bootstrap = render_bootstrap(policy)
    manager = manager_of(bootstrap)
    patches = http_filters["spec"]["configPatches"]
    inserted = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER"]
    ext_proc = next(f for f in inserted if f["name"] == EXT_PROC_FILTER)["typed_config"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["processing_mode"]["request_header_mode"] == "SEND"
    merged = next(p for p in patches if p["applyTo"] == "NETWORK_FILTER")["patch"]["value"]["typed_config"]
    assert merged["local_reply_config"] == local_reply_config(policy)
    engine = clusters["spec"]["configPatches"][0]["patch"]["value"]
    options = next(iter(engine["typed_extension_protocol_options"].values()))
    assert options["explicit_http_config"] == {"http_protocol_options": {}}
    assert rule["kind"] == "DestinationRule"
    # Put the patches into a bootstrap the way the sidecar would and let Envoy judge them.
    manager["http_filters"] = [*inserted, manager["http_filters"][-1]]
    manager.update({k: v for k, v in merged.items() if k != "@type"})
    for cluster in bootstrap["static_resources"]["clusters"][:3]:
        cluster.update({k: v for k, v in engine.items()})
    apply_bootstrap_patches(bootstrap, clusters)
    result = envoy_validate(yaml.safe_dump(bootstrap), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
