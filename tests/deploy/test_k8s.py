"""The kustomize base under deploy/k8s, checked structurally with PyYAML.

Services name their gRPC port `grpc-*` (Istio's protocol detection), probes use
grpc.health.v1, selectors of Services, PodDisruptionBudgets and the
ServiceMonitor match the pods, settings are real SITS_* names, and the
generated files (Istio resources, PrometheusRule) match their generators.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sits.runtime.settings import ENV_PREFIX
from sits_app.settings_cli import all_settings
from tests.deploy.test_compose import SITS_SERVICES, unknown_sits_variables, variables_of

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "k8s"

Resource = dict[str, Any]


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    document = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert document["kind"] == "Kustomization"
    return dict(document)


@pytest.fixture(scope="module")
def resources(kustomization: dict[str, Any]) -> list[Resource]:
    loaded: list[Resource] = []
    for entry in kustomization["resources"]:
        path = BASE / entry
        assert path.is_file(), f"kustomization names {entry}, which does not exist"
        assert path.resolve().is_relative_to(BASE), f"{entry} is outside the kustomization root"
        loaded.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return loaded


def one(resources: list[Resource], kind: str, name: str) -> Resource:
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


# Capture runs on every GPU node (a DaemonSet); the consumers are Deployments with replicas.
WORKLOAD_KINDS = ("Deployment", "DaemonSet")


def workload(resources: list[Resource], name: str) -> Resource:
    found = [r for r in resources if r["kind"] in WORKLOAD_KINDS and r["metadata"]["name"] == f"sits-{name}"]
    assert len(found) == 1, f"expected one Deployment or DaemonSet sits-{name}, found {len(found)}"
    return found[0]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def config_map(resources: list[Resource]) -> dict[str, str]:
    return dict(one(resources, "ConfigMap", "sits-settings")["data"])


def test_every_resource_has_identity(resources: list[Resource]) -> None:
    for resource in resources:
        assert resource.get("apiVersion") and resource.get("kind")
        assert resource["metadata"].get("name")
    names = [(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]) for r in resources]
    assert len(names) == len(set(names)), "duplicate resources"


def test_each_service_has_deployment_service_and_pdb_that_select_its_pods(resources: list[Resource]) -> None:
    settings = config_map(resources)
    for name in SITS_SERVICES:
        deployment = workload(resources, name)
        service = one(resources, "Service", f"sits-{name}")
        budget = one(resources, "PodDisruptionBudget", f"sits-{name}")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)
        assert matches(service["spec"]["selector"], pod_labels)
        assert matches(budget["spec"]["selector"]["matchLabels"], pod_labels)
        assert ("minAvailable" in budget["spec"]) != ("maxUnavailable" in budget["spec"])
        if deployment["spec"].get("replicas", 1) > 1:
            assert budget["spec"].get("minAvailable", 0) >= 1, f"{name}: a budget must keep one replica up"

        grpc_port = int(settings[f"SITS_{name.upper()}_ADDR"].rsplit(":", 1)[1])
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        grpc_ports = [p for n, p in ports.items() if n.startswith("grpc-") or n == "grpc"]
        assert [p["port"] for p in grpc_ports] == [grpc_port], f"{name}: one grpc-* port, the service's own"
        assert grpc_ports[0]["appProtocol"] == "grpc"
        assert ports["http-metrics"]["port"] == int(settings["SITS_METRICS_PORT"])

        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["args"] == [name]
        container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            assert container_ports[port["targetPort"]] == port["port"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port, f"{name} {probe} must use grpc.health.v1"
        assert container["readinessProbe"]["grpc"]["service"] == f"sits.v1.{name.capitalize()}"


def test_settings_are_real_sits_settings(resources: list[Resource]) -> None:
    settings = config_map(resources)
    known = {row[0] for row in all_settings()}
    assert unknown_sits_variables(settings, known) == []
    assert unknown_sits_variables({"SITS_NOT_A_SETTING": "1"}, known) == ["SITS_NOT_A_SETTING"]
    for name in SITS_SERVICES:
        deployment = workload(resources, name)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert {"configMapRef": {"name": "sits-settings"}} in container["envFrom"]
        env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
        cls = importlib.import_module(f"services.{name}.main").SETTINGS
        assert unknown_sits_variables({**settings, **env}, variables_of(cls)) == [], name
        assert all(v.startswith(ENV_PREFIX) or v.startswith("NVIDIA_") for v in env)


def test_the_token_secret_is_mounted_where_the_setting_points(resources: list[Resource]) -> None:
    token_file = Path(config_map(resources)["SITS_AUTH_TOKEN_FILE"])
    secret = one(resources, "Secret", "sits-token")
    assert token_file.name in secret["stringData"]
    for name in SITS_SERVICES:
        pod = workload(resources, name)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == str(token_file.parent)]
        assert len(mounts) == 1 and mounts[0]["readOnly"] is True
        assert volumes[mounts[0]["name"]]["secret"]["secretName"] == "sits-token"


def test_service_monitor_scrapes_every_service(resources: list[Resource]) -> None:
    monitor = one(resources, "ServiceMonitor", "sits")
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for name in SITS_SERVICES:
        service = one(resources, "Service", f"sits-{name}")
        assert matches(selector, service["metadata"]["labels"]), f"the ServiceMonitor misses sits-{name}"
        assert scraped_ports <= {p["name"] for p in service["spec"]["ports"]}


def test_prometheus_rule_carries_the_tested_rules(resources: list[Resource]) -> None:
    rule = one(resources, "PrometheusRule", "sits")
    source = yaml.safe_load((REPO / "deploy/prometheus/rules/sits.rules.yml").read_text())
    assert rule["spec"]["groups"] == source["groups"]


def test_istio_resources_are_present(resources: list[Resource]) -> None:
    filters = [r for r in resources if r["kind"] == "EnvoyFilter"]
    assert filters and all(r["apiVersion"].startswith("networking.istio.io/") for r in filters)
    assert all(f["spec"]["workloadSelector"]["labels"] for f in filters)
    rules = {r["metadata"]["name"]: r for r in resources if r["kind"] == "DestinationRule"}
    assert "sits-engine" in rules and "sits-services" in rules
    assert one(resources, "PeerAuthentication", "sits")["spec"]["mtls"]["mode"] == "STRICT"


def test_generated_files_match_their_generators() -> None:
    result = subprocess.run(
        [sys.executable, str(BASE / "render.py"), "--check"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_images_are_pinned_by_the_kustomization(kustomization: dict[str, Any], resources: list[Resource]) -> None:
    names = {image["name"] for image in kustomization["images"]}
    for resource in resources:
        if resource["kind"] in WORKLOAD_KINDS:
            for container in resource["spec"]["template"]["spec"]["containers"]:
                assert container["image"].split(":")[0] in names


def file_settings(resources: list[Resource], name: str) -> dict[str, str]:
    """Every SITS_*_FILE the container of sits-<name> gets (ConfigMap and its own env), with its path."""
    container = workload(resources, name)["spec"]["template"]["spec"]["containers"][0]
    values = dict(config_map(resources))
    values.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return {k: v for k, v in values.items() if k.startswith(ENV_PREFIX) and k.endswith("_FILE")}


def mounted_secret_file(resources: list[Resource], name: str, path: str) -> tuple[str, str]:
    """(secret name, key) that `path` is in sits-<name>'s container; fails if no mounted Secret holds it."""
    pod = workload(resources, name)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in pod["containers"][0]["volumeMounts"]:
        folder = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(folder):
            continue
        assert "subPath" not in mount, f"{name}: {path} is mounted with subPath, which never sees a rotation"
        secret = volumes[mount["name"]]["secret"]
        key = path[len(folder) :]
        items = secret.get("items")
        assert items is None or key in [i["path"] for i in items], f"{name}: {path} is not among the items"
        return str(secret["secretName"]), key
    raise AssertionError(f"{name}: nothing is mounted where {path} points")


def test_every_secret_file_setting_is_a_mounted_secret_key(resources: list[Resource]) -> None:
    secrets = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Secret"}
    for name in SITS_SERVICES:
        for variable, path in file_settings(resources, name).items():
            secret, key = mounted_secret_file(resources, name, path)
            assert secret in secrets, f"{name}: {variable} reads Secret {secret}, which the base does not have"
            assert key in secrets[secret]["stringData"], f"{name}: {variable} reads {secret}/{key}, not in it"


def test_kafka_and_redis_are_reached_over_tls_with_credentials_from_secrets(resources: list[Resource]) -> None:
    settings = config_map(resources)
    assert settings["SITS_KAFKA_SECURITY_PROTOCOL"] in ("SSL", "SASL_SSL")
    assert settings["SITS_KAFKA_SSL_CA_FILE"] and settings["SITS_KAFKA_SASL_PASSWORD_FILE"]
    assert settings["SITS_REDIS_URL"].startswith("rediss://")
    assert ":" not in settings["SITS_REDIS_URL"].split("//", 1)[1].split("@", 1)[0], "no password in the URL"
    assert settings["SITS_REDIS_PASSWORD_FILE"]
    # Istio's mTLS carries the gRPC calls (and the kubelet's gRPC probes speak no TLS).
    assert settings.get("SITS_GRPC_TLS", "false") == "false"
    peer = one(resources, "PeerAuthentication", "sits")
    assert peer["spec"]["mtls"]["mode"] == "STRICT"


def test_signers_and_the_executor_get_their_command_keys(resources: list[Resource]) -> None:
    for name, variable, key in (
        ("decision", "SITS_COMMAND_SIGNING_KEY_FILE", "signing"),
        ("validator", "SITS_COMMAND_SIGNING_KEY_FILE", "signing"),
        ("executor", "SITS_EXECUTOR_VERIFY_KEYS_FILE", "verify"),
    ):
        path = file_settings(resources, name).get(variable)
        assert path is not None, f"{name} has no {variable}"
        assert mounted_secret_file(resources, name, path) == ("sits-command-keys", key)
    assert "SITS_EXECUTOR_VERIFY_KEYS_FILE" not in file_settings(resources, "decision")
    assert "SITS_EXECUTOR_ACCEPT_UNSIGNED" not in config_map(resources)
