"""Every generated config passes `envoy --mode validate`; Istio output and the CLI; EnvoyProcess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from sits.runtime.procs import free_port
from sits_mesh import cli
from sits_mesh.envoy_config import (
    ADMISSION_BYPASS_KEY,
    EXT_PROC_FILTER,
    LOCAL_RATELIMIT_FILTER,
    render_bootstrap,
    render_bootstrap_yaml,
)
from sits_mesh.envoy_process import EnvoyProcess
from sits_mesh.istio import render_istio, render_istio_yaml
from sits_mesh.policy import MeshPolicy, load_policy
from tests.mesh.helpers import apply_bootstrap_patches, envoy_validate, manager_of, policy_with_pressure_file

pytestmark = pytest.mark.envoy

REPO = Path(__file__).resolve().parents[2]

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "no_admission": {"admission": {"enabled": False}},
    "tight_windows": {
        "http2": {
            "initial_stream_window_bytes": 65535,
            "initial_connection_window_bytes": 65535,
            "per_connection_buffer_limit_bytes": 16384,
            "max_concurrent_streams": 8,
        }
    },
    "access_log_and_dns_upstream": {
        "access_log_path": "/dev/stdout",
        "upstream": {"address": "localhost", "port": 50051},
    },
    "buffered_partial_with_headers": {"admission": {"body_mode": "BUFFERED_PARTIAL", "send_headers": True}},
    "fallback_cap": {"admission": {"fallback_max_total_tokens": 4096}, "rate_limit": {"max_tokens": 1}},
    "bypass": {"admission": {"bypass_max_request_tokens": 8192}},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_generated_config_passes_envoy_validate(variant: str, tmp_path: Path) -> None:
    policy = policy_with_pressure_file(VARIANTS[variant], tmp_path)
    result = envoy_validate(render_bootstrap_yaml(policy), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_the_shipped_policy_renders_to_a_valid_config(tmp_path: Path) -> None:
    shipped = load_policy(REPO / "mesh" / "policy.yaml")
    pressure = tmp_path / "gpu_pressure"
    pressure.write_text("0")
    overload = shipped.overload.model_copy(update={"pressure_file": str(pressure)})
    policy = shipped.model_copy(update={"overload": overload})
    result = envoy_validate(render_bootstrap_yaml(policy), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_config_is_refused_by_validate(tmp_path: Path) -> None:
    # Guards the guard: validate really checks (the priority_load_shed filter is not in 1.40).
    policy = policy_with_pressure_file({}, tmp_path)
    bootstrap = render_bootstrap(policy)
    manager = manager_of(bootstrap)
    manager["http_filters"].insert(
        0,
        {
            "name": "envoy.filters.http.priority_load_shed",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.priority_load_shed.v3.PriorityLoadShed"
            },
        },
    )
    assert envoy_validate(yaml.safe_dump(bootstrap), tmp_path).returncode != 0


def test_flow_control_is_explicit_on_listener_and_clusters() -> None:
    policy = MeshPolicy()
    bootstrap = render_bootstrap(policy)
    listener = bootstrap["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert listener["per_connection_buffer_limit_bytes"] == 65536
    assert manager["http2_protocol_options"]["initial_stream_window_size"] == 65536
    assert manager["stream_idle_timeout"] == "30s"
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert [layer["name"] for layer in bootstrap["layered_runtime"]["layers"]] == ["static", "admin"]
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    for name in ("vllm_p0", "vllm_p1", "vllm_p2"):
        cluster = clusters[name]
        h2 = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert h2["explicit_http_config"]["http2_protocol_options"]["initial_connection_window_size"] == 1048576
        assert cluster["per_connection_buffer_limit_bytes"] == 65536
        assert cluster["circuit_breakers"]["thresholds"][0]["track_remaining"] is True
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert all(r["route"]["timeout"] == "0s" for r in routes if "route" in r)
    assert [r["name"] for r in routes][:2] == ["shed_p2", "shed_p1"]
    # Only Generate goes to the processor; shed streams and other methods skip it.
    skips = [r["name"] for r in routes if r.get("typed_per_filter_config", {}).get(EXT_PROC_FILTER, {}).get("disabled")]
    assert skips == ["shed_p2", "shed_p1", "p0_other", "p1_other", "p2_other", "unlabelled_other"]


def test_istio_output_carries_the_same_limits() -> None:
    policy = MeshPolicy()
    http_filters, clusters, rule = render_istio(policy)
    assert http_filters["kind"] == clusters["kind"] == "EnvoyFilter"
    inserted = [
        p["patch"]["value"]["name"] for p in http_filters["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"
    ]
    assert inserted == [LOCAL_RATELIMIT_FILTER, EXT_PROC_FILTER]
    applied = [p["applyTo"] for p in clusters["spec"]["configPatches"]]
    assert applied == ["CLUSTER", "CLUSTER", "BOOTSTRAP"]
    window = clusters["spec"]["configPatches"][0]["patch"]["value"]
    assert window["per_connection_buffer_limit_bytes"] == 65536
    assert rule["kind"] == "DestinationRule"
    assert rule["spec"]["trafficPolicy"]["outlierDetection"]["consecutive5xxErrors"] == 5
    assert rule["spec"]["trafficPolicy"]["connectionPool"]["http"]["http2MaxRequests"] == 256
    assert len(list(yaml.safe_load_all(render_istio_yaml(policy)))) == 3


def test_the_istio_patches_are_valid_envoy_config(tmp_path: Path) -> None:
    # The EnvoyFilter values are Envoy API objects: put them into a bootstrap and let Envoy judge.
    policy = policy_with_pressure_file({}, tmp_path)
    bootstrap = render_bootstrap(policy)
    http_filters, clusters, _ = render_istio(policy)
    manager = manager_of(bootstrap)
    patched = [p["patch"]["value"] for p in http_filters["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
    manager["http_filters"] = [*patched, manager["http_filters"][-1]]
    apply_bootstrap_patches(bootstrap, clusters)
    result = envoy_validate(yaml.safe_dump(bootstrap), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cli_renders_and_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy_path = tmp_path / "policy.yaml"
    pressure = tmp_path / "gpu_pressure"
    pressure.write_text("0")
    data = yaml.safe_load((REPO / "mesh" / "policy.yaml").read_text())
    data["overload"]["pressure_file"] = str(pressure)
    policy_path.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    assert cli.main(["render", "--policy", str(policy_path), "--out", str(out), "--istio", "--validate"]) == 0
    assert (out / "envoy.yaml").exists() and (out / "istio.yaml").exists()
    assert "validate OK" in capsys.readouterr().out
    policy_path.write_text("admin: {address: 0.0.0.0, port: 1}")
    assert cli.main(["render", "--policy", str(policy_path), "--out", str(out)]) == 2
    assert "loopback" in capsys.readouterr().err


async def test_envoy_process_serves_admin_on_loopback_and_stops_twice(tmp_path: Path) -> None:
    policy = MeshPolicy.model_validate(
        {
            "listener": {"port": 0},
            "admin": {"port": 0},
            "overload": {"pressure_file": "gpu_pressure"},
            "admission": {"enabled": False},
        }
    )
    envoy = EnvoyProcess(policy, workdir=tmp_path / "envoy")
    async with envoy:
        status, body = await envoy.admin("GET", "/server_info")
        assert status == 200 and '"state": "LIVE"' in body
        status, listeners = await envoy.admin("GET", "/listeners")
        assert envoy.address in listeners
        await envoy.runtime_modify({"sits.shed.p2": 50})
        status, runtime = await envoy.admin("GET", "/runtime")
        assert '"sits.shed.p2"' in runtime and '"50"' in runtime
        envoy.set_pressure(0.5)
        assert (tmp_path / "envoy" / "gpu_pressure").read_text() == "0.5000"
    await envoy.stop()  # safe twice
    assert envoy.admin_url.startswith("http://127.0.0.1:")


def test_the_bypass_route_comes_first_skips_the_processor_and_defaults_to_inspecting() -> None:
    def generate_routes(policy: MeshPolicy) -> list[dict[str, Any]]:
        manager = render_bootstrap(policy)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        routes = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
        return [r for r in routes if r["name"].startswith("p0_generate")]

    bypass, inspected = generate_routes(MeshPolicy.model_validate({"admission": {"bypass_max_request_tokens": 8192}}))
    assert (bypass["name"], inspected["name"]) == ("p0_generate_bypass", "p0_generate")
    assert bypass["match"]["runtime_fraction"] == {
        "default_value": {"numerator": 0, "denominator": "HUNDRED"},
        "runtime_key": ADMISSION_BYPASS_KEY,
    }
    assert bypass["match"]["path"] == inspected["match"]["path"]
    assert bypass["typed_per_filter_config"][EXT_PROC_FILTER]["disabled"] is True
    assert [r["name"] for r in generate_routes(MeshPolicy())] == ["p0_generate"]


@pytest.mark.parametrize("decision_from", ["flag", "SITS_DECISION_ADDR"])
def test_cli_serves_the_processor_with_its_metrics_and_stops_on_sigterm(tmp_path: Path, decision_from: str) -> None:
    processor_port, metrics_port, nobody = free_port(), free_port(), free_port()
    policy_path = tmp_path / "policy.yaml"
    data = yaml.safe_load((REPO / "mesh" / "policy.yaml").read_text())
    data["admission"].update({"port": processor_port, "bypass_check_interval_s": 0.05})
    data["overload"]["pressure_file"] = str(tmp_path / "gpu_pressure")
    policy_path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "SITS_METRICS_PORT": str(metrics_port), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "sits_mesh.cli", "ext-proc", "--policy", str(policy_path)]
    # Neither the decision service nor Envoy is there: the processor serves anyway (fail open)
    # and its bypass probe keeps every request inspected.
    argv += ["--envoy-admin", f"http://127.0.0.1:{nobody}"]
    if decision_from == "flag":
        argv += ["--decision-addr", f"127.0.0.1:{nobody}"]
    else:  # the setting every SITS process reads, not a default of the command's own
        env["SITS_DECISION_ADDR"] = f"127.0.0.1:{nobody}"
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        assert child.stdout is not None
        banner = child.stdout.readline()
        assert f"admission processor on 127.0.0.1:{processor_port}" in banner, banner
        assert f"/metrics on 127.0.0.1:{metrics_port}" in banner
        assert f"decision at 127.0.0.1:{nobody}," in banner
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            exposition = response.read().decode()
        assert "# TYPE sits_shed_requests_total counter" in exposition
        assert "sits_admission_bypass_open" in exposition
        socket.create_connection(("127.0.0.1", processor_port), timeout=5).close()
    finally:
        child.send_signal(signal.SIGTERM)
        output, _ = child.communicate(timeout=20)
    assert child.returncode == 0, output
    # One warning for the unreachable Envoy, not one per probe.
    assert output.count(f"could not set {ADMISSION_BYPASS_KEY} in Envoy") <= 1, output
