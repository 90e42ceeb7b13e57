"""docker-compose.yml, checked structurally (no Docker engine runs here).

Every service has an image, health check and sound depends_on; every SITS_*
variable set on a SITS service is a field of that service's settings class
(and loads, with its value, through that class); the vLLM container's SITS_*
variables are ones its plugins read; mounted files exist; Envoy's config is
the generator's output and passes `envoy --mode validate`.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from sits.runtime.settings import ENV_PREFIX
from sits_app.settings_cli import all_settings
from sits_app.stack.vllm_engine import SITS_GRPC_LAUNCHER, SITS_SCHEDULER_CLS
from sits_mesh.envoy_process import validate_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
SITS_SERVICES = ("capture", "decision", "executor", "validator")
INFRA = ("kafka", "redis", "jaeger", "prometheus", "grafana", "envoy", "vllm")
PLUGIN_SOURCES = (
    REPO / "sits_engine/oom_hook/hook.py",
    REPO / "sits_engine/oom_hook/plugin.py",
    REPO / "sits_engine/vllm_plugin/scheduler.py",
    REPO / "sits_engine/vllm_plugin/environment.py",
    REPO / "sits_app/stack/vllm_engine.py",
)
_DEFAULTED = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}")


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with VAR unset."""
    return _DEFAULTED.sub(lambda m: m.group(1), value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict)
    return document


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def env_of(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    assert isinstance(environment, dict), "write environment as a mapping"
    return {str(k): interpolate(str(v)) for k, v in environment.items()}


def settings_class(name: str) -> type[BaseSettings]:
    """The service's own settings class; a missing main is a failure, not a skip."""
    module = importlib.import_module(f"services.{name}.main")
    cls = module.SETTINGS
    assert isinstance(cls, type) and issubclass(cls, BaseSettings)
    return cls


def variables_of(cls: type[BaseSettings]) -> set[str]:
    names = set()
    for field_name, field in cls.model_fields.items():
        alias = field.validation_alias
        names.add(alias if isinstance(alias, str) else f"{ENV_PREFIX}{field_name.upper()}")
    return names


def unknown_sits_variables(env: dict[str, str], known: set[str]) -> list[str]:
    return sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known)


def plugin_variables() -> set[str]:
    """SITS_* names the plugins inside the vLLM process read (they have no settings class)."""
    names: set[str] = set()
    for path in PLUGIN_SOURCES:
        text = path.read_text()
        names.update(re.findall(r"\"(SITS_[A-Z0-9_]+)\"", text))
        if "SITS_OOM_HOOK_" in text:
            names.update(f"SITS_OOM_HOOK_{n}" for n in re.findall(r"\bget\(\"([A-Z0-9_]+)\"", text))
    return names


def test_every_part_of_the_stack_is_there(services: dict[str, dict[str, Any]]) -> None:
    missing = [name for name in (*INFRA, *SITS_SERVICES) if name not in services]
    assert missing == []


def test_every_service_has_an_image_and_a_health_check(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert service.get("image"), f"{name} has no image"
        check = service.get("healthcheck")
        assert check and check.get("test"), f"{name} has no health check"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), f"{name}: health check must be CMD or CMD-SHELL"
        assert check.get("interval") and check.get("retries"), f"{name}: health check needs interval and retries"


def test_depends_on_names_services_and_waits_only_on_health_checked_ones(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        assert isinstance(depends, dict), f"{name}: depends_on must be a mapping with conditions"
        for other, condition in depends.items():
            assert other in services, f"{name} depends on unknown service {other}"
            assert condition["condition"] in ("service_started", "service_healthy")
            if condition["condition"] == "service_healthy":
                assert services[other].get("healthcheck"), f"{name} waits on {other}, which has no health check"
        network_mode = str(service.get("network_mode", ""))
        if network_mode.startswith("service:"):
            shared = network_mode.removeprefix("service:")
            assert shared in depends, f"{name} shares {shared}'s network and must depend on it"
            assert "ports" not in service, f"{name} shares a network namespace; publish ports on {shared}"


def test_kafka_is_apache_kafka_in_kraft_mode(services: dict[str, dict[str, Any]]) -> None:
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = env_of(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "CONTROLLER" in env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert "kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert not any("zookeeper" in name for name in services)


def test_sits_services_are_wired_alike(services: dict[str, dict[str, Any]]) -> None:
    for name in SITS_SERVICES:
        service = services[name]
        env = env_of(service)
        assert service["command"] == [name]
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert env["SITS_KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert env["SITS_REDIS_URL"].startswith(("redis://redis:6379/", "rediss://sits@redis:6379/"))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["SITS_GRPC_BIND"] == "0.0.0.0"
        assert env["SITS_AUTH_TOKEN_FILE"] == "/run/secrets/sits_token"
        assert "sits_token" in service["secrets"]
        for dependency in ("kafka", "redis"):
            assert service["depends_on"][dependency]["condition"] == "service_healthy"
        port = env[f"SITS_{name.upper()}_ADDR"].rsplit(":", 1)[1]
        assert service["healthcheck"]["test"][1:] == [
            "grpc-health",
            f"127.0.0.1:{port}",
            f"sits.v1.{name.capitalize()}",
        ]
        published = services[service["network_mode"].removeprefix("service:")] if "network_mode" in service else service
        replicas = int((service.get("deploy") or {}).get("replicas", 1))
        if replicas == 1:
            assert f"{port}:{port}" in published["ports"], f"{name}'s gRPC port {port} is not published"
        else:
            # Replicas cannot share a host port: a range with room for each (and for scaling up a little).
            ranges = [p for p in published["ports"] if p.endswith(f":{port}") and "-" in p.split(":")[0]]
            assert ranges, f"{name} runs {replicas} replicas: publish its port {port} on a host port range"
            first, last = (int(x) for x in ranges[0].rsplit(":", 1)[0].split("-"))
            assert last - first + 1 >= replicas, f"{name}: the host port range is smaller than its replicas"


def test_every_sits_variable_on_a_service_is_one_of_its_settings(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    everywhere = {row[0] for row in all_settings()}
    for name in SITS_SERVICES:
        env = env_of(services[name])
        cls = settings_class(name)
        assert unknown_sits_variables(env, variables_of(cls)) == [], f"{name} sets settings it does not have"
        assert unknown_sits_variables(env, everywhere) == []
        # The values load through the real class: a bad one fails here, not on the GPU host.
        for variable in [v for v in os.environ if v.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(variable)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        loaded = cls()
        for field_name in cls.model_fields:
            variable = f"{ENV_PREFIX}{field_name.upper()}"
            if variable in env and isinstance(getattr(loaded, field_name), str):
                assert getattr(loaded, field_name) == env[variable]
        monkeypatch.undo()


def test_an_unknown_sits_variable_is_reported() -> None:
    known = {row[0] for row in all_settings()}
    env = {"SITS_KAFKA_BOOTSTRAP": "kafka:9092", "SITS_NO_SUCH_SETTING": "1", "HF_TOKEN": ""}
    assert unknown_sits_variables(env, known) == ["SITS_NO_SUCH_SETTING"]


def test_vllm_runs_the_grpc_server_with_the_sits_plugins_on_a_gpu(services: dict[str, dict[str, Any]]) -> None:
    vllm = services["vllm"]
    command = " ".join(vllm["command"])
    # vLLM's own gRPC server through the SITS launcher (the routed tier in each request id), priority policy.
    assert f"-m {SITS_GRPC_LAUNCHER}" in command
    assert f"--scheduler-cls {SITS_SCHEDULER_CLS} --scheduling-policy priority" in command
    assert "--port 50051" in command
    assert vllm["build"]["dockerfile"] == "deploy/docker/Dockerfile.vllm"
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    env = env_of(vllm)
    assert unknown_sits_variables(env, plugin_variables()) == []
    assert env["SITS_OOM_HOOK_CAPTURE_ADDR"] == env_of(services["capture"])["SITS_CAPTURE_ADDR"]
    control_port = env["SITS_ENGINE_CONTROL_ADDR"].rsplit(":", 1)[1]
    targets = yaml.safe_load(env_of(services["executor"])["SITS_EXECUTOR_TARGETS"])
    assert targets["vllm-0"]["control_addr"] == f"vllm:{control_port}"
    assert targets["vllm-0"]["engine_addr"] == "vllm:50051"
    assert "SITS_OOM_HOOK_CAPTURE_ADDR" in plugin_variables()  # the scan itself finds the hook's names


def test_tracing_goes_to_jaeger_over_otlp(services: dict[str, dict[str, Any]]) -> None:
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert env_of(jaeger)["COLLECTOR_OTLP_ENABLED"] == "true"
    assert any(str(p).startswith("4317:") for p in jaeger["ports"])


# Made by the set-up commands in docker-compose.yml's header, not committed.
SECRETS_MADE_BY = {
    "./.secrets/tls": "sits tls dev-certs .secrets/tls",
    "./.secrets/sits_token": "> .secrets/sits_token",
    "./.secrets/sits_command_keys": "sits keys new .secrets/sits_command_keys",
}


def test_mounted_files_exist(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    header = COMPOSE.read_text().split("\nname:", 1)[0]
    sources = [str(v).split(":", 1)[0] for s in services.values() for v in s.get("volumes", [])]
    sources += [str(secret["file"]) for secret in compose.get("secrets", {}).values()]
    for source in sources:
        if source.startswith("./.secrets/"):
            assert source in SECRETS_MADE_BY and SECRETS_MADE_BY[source] in header, f"nothing says how {source} is made"
        elif source.startswith("./"):
            assert (REPO / source).exists(), f"{source} is mounted but does not exist"
    for service in services.values():
        build = service.get("build")
        if build:
            assert (REPO / build["context"] / build["dockerfile"]).is_file()


def test_executor_drives_envoy_through_a_shared_namespace_and_pressure_file(
    services: dict[str, dict[str, Any]],
) -> None:
    executor, envoy = services["executor"], services["envoy"]
    assert executor["network_mode"] == "service:envoy"
    env = env_of(executor)
    assert env["SITS_ENVOY_ADMIN_URL"] == "http://127.0.0.1:9901"
    pressure_dir = str(Path(env["SITS_ENVOY_PRESSURE_FILE"]).parent)
    executor_volumes = {v.split(":")[0]: v.split(":")[1] for v in executor["volumes"]}
    envoy_volumes = {v.split(":")[0]: v.split(":")[1] for v in envoy["volumes"]}
    assert executor_volumes["sits-pressure"] == envoy_volumes["sits-pressure"] == pressure_dir
    envoy_config = yaml.safe_load((REPO / "deploy/compose/envoy.yaml").read_text())
    monitors = envoy_config["overload_manager"]["resource_monitors"]
    assert [m["typed_config"]["filename"] for m in monitors] == [env["SITS_ENVOY_PRESSURE_FILE"]]


def test_envoy_config_is_the_generators_output_and_valid(tmp_path: Path) -> None:
    check = subprocess.run(
        [sys.executable, str(REPO / "deploy/compose/render_envoy.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    # Envoy validates that the pressure file exists; in compose it is a mounted volume,
    # here a file of our own stands in for it at the same place in the config.
    config = yaml.safe_load((REPO / "deploy/compose/envoy.yaml").read_text())
    (monitor,) = config["overload_manager"]["resource_monitors"]
    pressure = tmp_path / "gpu_pressure"
    pressure.write_text("0")
    monitor["typed_config"]["filename"] = str(pressure)
    local = tmp_path / "envoy.yaml"
    local.write_text(yaml.safe_dump(config))
    result = validate_config(local)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_every_service_on_its_metrics_port(services: dict[str, dict[str, Any]]) -> None:
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }
    for name in (*SITS_SERVICES, "admission"):
        service = services[name]
        host = service["network_mode"].removeprefix("service:") if "network_mode" in service else name
        assert f"{host}:{env_of(service)['SITS_METRICS_PORT']}" in targets
    assert "envoy:9902" in targets


def tls_references(services: dict[str, dict[str, Any]]) -> dict[str, set[str]]:
    """Per service, the file names it reads from where ./.secrets/tls is mounted (env, command, health check)."""
    out: dict[str, set[str]] = {}
    for name, service in services.items():
        mounts = [v.split(":")[1] for v in service.get("volumes", []) if v.startswith("./.secrets/tls:")]
        if not mounts:
            continue
        text = " ".join(
            [
                *env_of(service).values(),
                *map(str, service.get("command") or []),
                *map(str, service["healthcheck"]["test"]),
            ]
        )
        names = {m.group(1) for mount in mounts for m in re.finditer(re.escape(mount) + r"/([A-Za-z0-9_.-]+)", text)}
        if name == "kafka":  # the apache/kafka image takes file names inside /etc/kafka/secrets
            env = env_of(service)
            names |= {env[k] for k in env if k.endswith(("_FILENAME", "_CREDENTIALS"))}
        out[name] = names
    return out


def test_the_tls_set_up_reads_only_files_dev_certs_writes_and_they_fit(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import pkcs12

    from sits_app.stack.devcerts import write_compose_certs

    written = {p.name: p for p in write_compose_certs(tmp_path)}
    references = tls_references(services)
    assert {"kafka", "redis", "vllm", *SITS_SERVICES, "admission"} <= set(references)
    for name, files in references.items():
        assert files, f"{name} mounts the TLS folder and reads nothing from it"
        assert files <= set(written), f"{name} reads {sorted(files - set(written))}, which dev-certs does not write"

    def hosts(cert: str) -> set[str]:
        loaded = x509.load_pem_x509_certificate(written[cert].read_bytes())
        names = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {str(n.value) for n in names}

    assert {"kafka", "localhost"} <= hosts("kafka.crt")  # advertised host, and the health check's
    assert "redis" in hosts("redis.crt")
    sits_hosts = {env_of(services[n])[f"SITS_{n.upper()}_ADDR"].rsplit(":", 1)[0] for n in SITS_SERVICES}
    assert sits_hosts | {"localhost"} <= hosts("sits.crt")
    password = written["kafka_keystore_password"].read_bytes()
    key, cert, _ = pkcs12.load_key_and_certificates(written["kafka.p12"].read_bytes(), password)
    assert key is not None and cert is not None and "kafka" in str(cert.subject)
    acl = written["redis_users.acl"].read_text()
    assert "user default off" in acl and "user sits on #" in acl
    assert written["redis_password"].read_text() not in acl, "the ACL file holds the password hashed"


def test_sits_speaks_tls_everywhere_and_only_signed_commands_steer(services: dict[str, dict[str, Any]]) -> None:
    kafka = env_of(services["kafka"])
    assert kafka["KAFKA_ADVERTISED_LISTENERS"].startswith("SSL://")
    assert "PLAINTEXT://" not in kafka["KAFKA_LISTENERS"].replace("CONTROLLER://", "")
    redis = [str(a) for a in services["redis"]["command"]]
    assert redis[redis.index("--port") + 1] == "0" and "--tls-port" in redis and "--aclfile" in redis
    for name in (*SITS_SERVICES, "admission"):
        env = env_of(services[name])
        assert env["SITS_KAFKA_SECURITY_PROTOCOL"] == "SSL"
        assert env["SITS_REDIS_URL"].startswith("rediss://") and env["SITS_REDIS_PASSWORD_FILE"]
        assert env["SITS_GRPC_TLS"] == "true" and env["SITS_GRPC_TLS_REQUIRE_CLIENT_CERT"] == "true"
    vllm = env_of(services["vllm"])
    assert {"SITS_OOM_HOOK_TLS_CA_FILE", "SITS_OOM_HOOK_TLS_CERT_FILE", "SITS_OOM_HOOK_TLS_KEY_FILE"} <= set(vllm)
    for name, variable in (
        ("decision", "SITS_COMMAND_SIGNING_KEY_FILE"),
        ("validator", "SITS_COMMAND_SIGNING_KEY_FILE"),
        ("executor", "SITS_EXECUTOR_VERIFY_KEYS_FILE"),
    ):
        assert env_of(services[name])[variable] == "/run/secrets/sits_command_keys"
        assert "sits_command_keys" in services[name]["secrets"]
    assert "sits_command_keys" not in services["capture"].get("secrets", [])
    assert not any("SITS_EXECUTOR_ACCEPT_UNSIGNED" in env_of(s) for s in services.values())
