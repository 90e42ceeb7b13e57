"""After a run with every secret configured, none of them is in a log, a metric or a trace.

The embedded stack (the four services as processes, at DEBUG) with: a Redis password (its own
redis-server), the bearer token, the command signing key, and mutual TLS on every gRPC API. An OOM
report goes through capture → decision → signed command → executor → validator; a forged command
is dead-lettered; a call with a wrong token is refused. Then the logs, every service's /metrics
and the exported spans are searched for each secret.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from bench import reliability_harness as h
from sits.runtime.bus import EventProducer
from sits.runtime.grpc_tls import aio_channel, channel_credentials
from sits.runtime.grpcserver import bearer_metadata
from sits.runtime.signing import read_keys
from sits.v1 import capture_pb2_grpc, decision_pb2, decision_pb2_grpc
from sits_app.stack.devcerts import DevCa, write_issued
from sits_app.stack.embedded import EmbeddedStack
from sits_mesh.pressure import read_pressure
from tests.fixtures.otlp import OtlpReceiver
from tests.security.conftest import PrivateRedis
from tests.waiting import eventually

REDIS_PASSWORD = "redis-secret-5d1b9e2a"


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_no_secret_reaches_logs_metrics_or_traces(
    otlp_receiver: OtlpReceiver, topic_prefix: str, tmp_path: Path
) -> None:
    ca = DevCa("stack CA")
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    cert, key = write_issued(tmp_path, "service", ca.issue("sits", ["localhost", "127.0.0.1"]))
    password_file = tmp_path / "redis-password"
    password_file.write_text(REDIS_PASSWORD)
    engines = h.engine_names(topic_prefix, 1)
    with PrivateRedis(tmp_path, "--requirepass", REDIS_PASSWORD) as redis:
        config = h.stack_config(
            tmp_path / "run",
            f"redis://127.0.0.1:{redis.port}/0",
            topic_prefix,
            engines,
            extra_env={
                "SITS_LOG_LEVEL": "DEBUG",
                "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
                "SITS_GRPC_TLS": "true",
                "SITS_GRPC_TLS_CERT_FILE": str(cert),
                "SITS_GRPC_TLS_KEY_FILE": str(key),
                "SITS_GRPC_TLS_CA_FILE": str(tmp_path / "ca.crt"),
                "SITS_GRPC_TLS_REQUIRE_CLIENT_CERT": "true",
            },
        )
        config.redis_password_file = password_file
        async with EmbeddedStack(config) as stack:
            rs = h.ReliabilityStack(stack, engines, stack.settings.host_name, h.Topics(topic_prefix))
            token = rs.token
            credentials = channel_credentials(stack.grpc_settings())
            async with (
                aio_channel(stack.address_of("capture"), credentials) as capture_channel,
                aio_channel(stack.address_of("decision"), credentials) as decision_channel,
            ):
                capture = capture_pb2_grpc.CaptureStub(capture_channel)
                await capture.ReportOom(h.oom_event(rs.target(0), time.time()), metadata=bearer_metadata(token))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await decision_pb2_grpc.DecisionStub(decision_channel).PutPolicy(
                        decision_pb2.PutPolicyRequest(yaml="x: 1"), metadata=bearer_metadata("not-" + token)
                    )
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            pressure = stack.config.run_dir / "pressure"
            assert await eventually(lambda: read_pressure(pressure) == pytest.approx(0.95), 60), (
                "the OOM went through a signed command to the executor"
            )
            async with EventProducer(stack.settings) as unsigned:
                await unsigned.publish(rs.topics.commands, h.pressure_command(rs.target(0), 0.01, 60))
            executor_log = stack.config.run_dir / "logs" / "executor.log"
            assert await eventually(lambda: "unsigned:" in executor_log.read_text(), 30)
            await otlp_receiver.wait_for(lambda spans: any(s.service_name == "sits-executor" for s in spans), 30)
            metrics = {name: scrape(s.metrics_port) for name, s in stack.services.items()}
            command_key = read_keys(stack.command_keys_file)[0]
            key_text = stack.command_keys_file.read_text().split()[-1]

    logs = {p.name: p.read_text(errors="replace") for p in (stack.config.run_dir / "logs").glob("*.log")}
    assert set(logs) >= {"capture.log", "decision.log", "executor.log", "validator.log"}
    assert "signs commands with key id embedded-1" in logs["decision.log"], "the key id is logged, not the key"
    private_key_lines = [line for line in key.read_text().splitlines() if line and not line.startswith("-----")]
    secrets = {
        "redis password": REDIS_PASSWORD,
        "bearer token": token,
        "command key (file form)": key_text,
        "command key (hex)": command_key.secret.hex(),
        "TLS private key": max(private_key_lines, key=len),
    }
    spans = json.dumps([s.attributes for s in otlp_receiver.spans], default=str)
    for what, secret in secrets.items():
        assert len(secret) >= 16, what
        for name, text in logs.items():
            assert secret not in text, f"{what} in {name}"
        for name, text in metrics.items():
            assert secret not in text, f"{what} in {name}'s /metrics"
        assert secret not in spans, f"{what} in a span"
    assert f":{REDIS_PASSWORD}@" not in json.dumps(json.loads((stack.config.run_dir / "stack.json").read_text()))
