"""The fleet parts of the Kubernetes manifests, checked structurally: capture on every GPU node, the
consumer services as several replicas with budgets that keep one up, KEDA scaling each on its own group's
lag within the partition count, and Chaos Mesh experiments that hit each service and the links to Kafka and
Redis named in the settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.decision.settings import DecisionSettings
from services.executor.settings import ExecutorSettings
from services.validator.settings import ValidatorSettings
from sits.runtime.events import Topics
from tests.deploy.test_k8s import BASE, Resource, config_map, matches, one, workload

CONSUMERS = ("decision", "executor", "validator")
# The group each service joins, and the topics whose lag says it is behind: its busiest input, and the urgent
# lane where it reads one (a backlog there delays the actions and verdicts themselves).
GROUPS = {
    "decision": (
        DecisionSettings.model_fields["decision_group"].default,
        {Topics("").metrics, Topics("").metrics_urgent},
    ),
    "executor": (ExecutorSettings.model_fields["executor_group"].default, {Topics("").commands}),
    "validator": (
        ValidatorSettings.model_fields["validator_group"].default,
        {Topics("").results, Topics("").metrics_urgent},
    ),
}


def load_kustomization(folder: Path) -> list[Resource]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    out: list[Resource] = []
    for entry in kustomization["resources"]:
        path = (folder / entry).resolve()
        if path.is_dir():
            out += load_kustomization(path)
            continue
        assert path.is_file(), f"{folder.name}/kustomization.yaml names {entry}, which does not exist"
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


@pytest.fixture(scope="module")
def base() -> list[Resource]:
    return load_kustomization(BASE)


@pytest.fixture(scope="module")
def keda() -> list[Resource]:
    return load_kustomization(BASE / "keda")


@pytest.fixture(scope="module")
def chaos() -> list[Resource]:
    return load_kustomization(BASE / "chaos")


def pod_labels(resources: list[Resource], name: str) -> dict[str, str]:
    return dict(workload(resources, name)["spec"]["template"]["metadata"]["labels"])


def test_capture_runs_once_on_every_gpu_node(base: list[Resource]) -> None:
    capture = workload(base, "capture")
    assert capture["kind"] == "DaemonSet"
    assert "replicas" not in capture["spec"]
    pod = capture["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" for t in pod["tolerations"])
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    # Its samples name the node they come from: that is what keys (and partitions) them per target.
    assert env["SITS_HOST_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert capture["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def test_consumers_run_several_replicas_and_a_budget_keeps_one_up(base: list[Resource]) -> None:
    partitions = int(config_map(base)["SITS_KAFKA_PARTITIONS"])
    for name in CONSUMERS:
        deployment = workload(base, name)
        assert deployment["kind"] == "Deployment"
        replicas = deployment["spec"]["replicas"]
        assert 2 <= replicas <= partitions, f"{name}: {replicas} replicas over {partitions} partitions"
        budget = one(base, "PodDisruptionBudget", f"sits-{name}")
        assert matches(budget["spec"]["selector"]["matchLabels"], pod_labels(base, name))
        # At least one up, and a drain can still move one (a budget equal to replicas would block it).
        assert 1 <= budget["spec"]["minAvailable"] < replicas
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_keda_scales_each_consumer_on_its_own_groups_lag(base: list[Resource], keda: list[Resource]) -> None:
    settings = config_map(base)
    partitions = int(settings["SITS_KAFKA_PARTITIONS"])
    prefix = settings.get("SITS_TOPIC_PREFIX", "")
    auths = {r["metadata"]["name"]: r for r in keda if r["kind"] == "TriggerAuthentication"}
    secrets = {r["metadata"]["name"]: r for r in keda if r["kind"] == "Secret"}
    scaled = {r["metadata"]["name"]: r for r in keda if r["kind"] == "ScaledObject"}
    assert set(scaled) == {f"sits-{n}" for n in CONSUMERS}
    for name in CONSUMERS:
        spec = scaled[f"sits-{name}"]["spec"]
        target = spec["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", f"sits-{name}")
        assert workload(keda, name)["kind"] == "Deployment", "the overlay carries the base"
        budget = one(base, "PodDisruptionBudget", f"sits-{name}")["spec"]["minAvailable"]
        assert budget < spec["minReplicaCount"] <= spec["maxReplicaCount"] <= partitions
        group, topics = GROUPS[name]
        triggers = spec["triggers"]
        assert {t["metadata"]["topic"] for t in triggers} == {f"{prefix}{t}" for t in topics}
        assert len(triggers) == len(topics)
        for trigger in triggers:
            assert trigger["type"] == "kafka"
            meta = trigger["metadata"]
            assert meta["consumerGroup"] == f"{prefix}{group}", f"{name} scales on another group's lag"
            assert meta["bootstrapServers"] == settings["SITS_KAFKA_BOOTSTRAP"]
            assert int(meta["lagThreshold"]) > 0 and meta["allowIdleConsumers"] == "false"
            # Authenticated like the services: every secret it reads exists and has the key.
            auth = auths[trigger["authenticationRef"]["name"]]
            params = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
            assert {"sasl", "username", "password", "tls", "ca"} <= params
            for ref in auth["spec"]["secretTargetRef"]:
                secret = secrets.get(ref["name"]) or one(base, "Secret", ref["name"])
                assert ref["key"] in secret["stringData"], f"{ref['name']} has no key {ref['key']}"
        # A backlog of samples under pressure must scale out sooner than one of calm samples.
        lanes = {t["metadata"]["topic"]: int(t["metadata"]["lagThreshold"]) for t in triggers}
        urgent, calm = f"{prefix}{Topics('').metrics_urgent}", f"{prefix}{Topics('').metrics}"
        if urgent in lanes and calm in lanes:
            assert lanes[urgent] < lanes[calm]
    # KEDA spells SCRAM-SHA-512 as scram_sha512 (its Kafka scaler's `sasl` values).
    mechanism = settings["SITS_KAFKA_SASL_MECHANISM"].lower().replace("scram-sha-", "scram_sha")
    assert secrets["sits-kafka-keda"]["stringData"]["sasl"] == mechanism
    assert secrets["sits-kafka-keda"]["stringData"]["username"] == settings["SITS_KAFKA_SASL_USERNAME"]


def test_chaos_kills_one_pod_of_each_service(base: list[Resource], chaos: list[Resource]) -> None:
    kills = [r for r in chaos if r["kind"] == "PodChaos"]
    for name in ("capture", *CONSUMERS):
        hits = [
            k
            for k in kills
            if k["spec"]["selector"]["namespaces"] == [workload(base, name)["metadata"]["namespace"]]
            and matches(k["spec"]["selector"]["labelSelectors"], pod_labels(base, name))
        ]
        assert len(hits) == 1, f"one PodChaos must kill a {name} pod"
        spec = hits[0]["spec"]
        assert spec["action"] == "pod-kill" and spec["mode"] == "one" and spec["gracePeriod"] == 0


def network(chaos: list[Resource], name: str) -> dict[str, Any]:
    found = [r for r in chaos if r["kind"] == "NetworkChaos" and r["metadata"]["name"] == name]
    assert len(found) == 1, f"no NetworkChaos {name}"
    return dict(found[0]["spec"])


def test_chaos_cuts_the_links_the_settings_name_and_slows_the_broker(
    base: list[Resource], chaos: list[Resource]
) -> None:
    settings = config_map(base)
    kafka_hosts = sorted({b.rsplit(":", 1)[0] for b in settings["SITS_KAFKA_BOOTSTRAP"].split(",")})
    redis_host = urlsplit(settings["SITS_REDIS_URL"]).hostname
    kafka = network(chaos, "sits-partition-kafka")
    redis = network(chaos, "sits-partition-redis")
    latency = network(chaos, "sits-broker-latency")
    assert (kafka["action"], redis["action"], latency["action"]) == ("partition", "partition", "delay")
    assert sorted(kafka["externalTargets"]) == kafka_hosts == sorted(latency["externalTargets"])
    assert redis["externalTargets"] == [redis_host]
    assert int(latency["delay"]["latency"].removesuffix("ms")) > 0
    # The partitions hit the services that hold that link: every SITS pod for Kafka, the executor for Redis.
    assert matches(kafka["selector"]["labelSelectors"], pod_labels(base, "decision"))
    assert matches(kafka["selector"]["labelSelectors"], pod_labels(base, "capture"))
    assert matches(redis["selector"]["labelSelectors"], pod_labels(base, "executor"))
    for spec in (kafka, redis, latency):
        # Bounded: an experiment that never heals is an outage, not an experiment.
        assert spec["duration"].endswith("s") and 0 < int(spec["duration"][:-1]) <= 600
        assert spec["selector"]["namespaces"] == ["sits"]
