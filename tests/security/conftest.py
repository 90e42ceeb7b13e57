"""Security fixtures: certificates made here, Tansu behind a TLS-terminating Envoy, private Redis servers."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from sits.runtime.procs import ManagedProcess, free_port, port_open
from sits_app.stack.devcerts import DevCa, write_issued
from sits_app.stack.tansu import TansuBroker
from sits_mesh.envoy_process import envoy_binary


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path  # a CA nobody here trusts, and a client certificate it signed
    rogue_client_cert: Path
    rogue_client_key: Path


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("tls")
    ca, rogue = DevCa("test CA"), DevCa("rogue CA")
    (folder / "ca.crt").write_bytes(ca.cert_pem)
    (folder / "rogue-ca.crt").write_bytes(rogue.cert_pem)
    server = write_issued(folder, "server", ca.issue("server", ["localhost", "127.0.0.1"], client=False))
    client = write_issued(folder, "client", ca.issue("sits-client", [], server=False))
    rogue_client = write_issued(folder, "rogue-client", rogue.issue("rogue", [], server=False))
    return Certs(folder / "ca.crt", *server, *client, folder / "rogue-ca.crt", *rogue_client)


def tls_proxy_config(listen_port: int, upstream_port: int, certs: Certs, *, require_client_cert: bool) -> str:
    """Envoy terminating TLS on `listen_port` and passing the bytes on to 127.0.0.1:`upstream_port`."""
    tls: dict[str, object] = {
        "tls_certificates": [
            {
                "certificate_chain": {"filename": str(certs.server_cert)},
                "private_key": {"filename": str(certs.server_key)},
            }
        ]
    }
    if require_client_cert:
        tls["validation_context"] = {"trusted_ca": {"filename": str(certs.ca)}}
    config = {
        "static_resources": {
            "listeners": [
                {
                    "name": "tls",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                    "filter_chains": [
                        {
                            "transport_socket": {
                                "name": "envoy.transport_sockets.tls",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                                    "DownstreamTlsContext",
                                    "require_client_certificate": require_client_cert,
                                    "common_tls_context": tls,
                                },
                            },
                            "filters": [
                                {
                                    "name": "envoy.filters.network.tcp_proxy",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3."
                                        "TcpProxy",
                                        "stat_prefix": "kafka",
                                        "cluster": "upstream",
                                    },
                                }
                            ],
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "upstream",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": {
                        "cluster_name": "upstream",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {"address": "127.0.0.1", "port_value": upstream_port}
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        }
    }
    return yaml.safe_dump(config)


def wait_listening(process: ManagedProcess, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_open("127.0.0.1", port):
        if not process.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{process.name} did not listen on {port}:\n{process.log_tail()}")
        time.sleep(0.05)


@dataclass(frozen=True)
class TlsKafka:
    bootstrap: str  # Envoy's TLS port, which Tansu advertises
    broker: TansuBroker


def start_tls_kafka(folder: Path, certs: Certs, *, require_client_cert: bool) -> Iterator[TlsKafka]:
    tls_port = free_port()
    broker = TansuBroker(folder / "tansu", advertised_port=tls_port)
    broker.start()
    config = folder / "envoy.yaml"
    config.write_text(tls_proxy_config(tls_port, broker.port, certs, require_client_cert=require_client_cert))
    envoy = ManagedProcess(
        "envoy", [envoy_binary(), "-c", str(config), "--disable-hot-restart", "-l", "warning"], folder / "envoy.log"
    )
    envoy.start()
    try:
        wait_listening(envoy, tls_port)
        yield TlsKafka(f"127.0.0.1:{tls_port}", broker)
    finally:
        envoy.stop(grace_s=3.0)
        broker.stop()


@pytest.fixture(scope="module")
def tls_kafka(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[TlsKafka]:
    yield from start_tls_kafka(tmp_path_factory.mktemp("kafka-tls"), certs, require_client_cert=False)


@pytest.fixture(scope="module")
def mtls_kafka(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[TlsKafka]:
    yield from start_tls_kafka(tmp_path_factory.mktemp("kafka-mtls"), certs, require_client_cert=True)


class PrivateRedis:
    """A redis-server of the test's own on a free loopback port (never the shared one on 6379)."""

    def __init__(self, folder: Path, *args: str, tls: Certs | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self.port = free_port()
        ports = ["--port", str(self.port)]
        if tls is not None:
            ports = [
                "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(tls.server_cert),
                "--tls-key-file", str(tls.server_key), "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "no",
            ]  # fmt: skip
        self.process = ManagedProcess(
            "redis",
            [binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder), *args],
            folder / "redis.log",
            cwd=folder,
        )

    def __enter__(self) -> PrivateRedis:
        self.process.start()
        wait_listening(self.process, self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop(grace_s=3.0)
