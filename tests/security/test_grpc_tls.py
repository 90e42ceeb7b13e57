"""TLS and mutual TLS on the SITS gRPC servers, with the SITS clients: the admission processor, the OOM hook,
the embedded stack's health checks. Certificates are made by the test.

Under Istio none of this is switched on: the sidecars' mTLS does it (and the kubelet's gRPC probes
speak no TLS); the bearer token guards the mutating calls in both set-ups, as checked here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.capture.grpc_api import MUTATING_METHODS as CAPTURE_MUTATING
from services.capture.grpc_api import binding as capture_binding
from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.service import CaptureService
from services.capture.spool import Spool
from services.decision.domain.engine import DecisionEngine
from services.decision.domain.policy import parse_policy
from services.decision.grpc_api import MUTATING_METHODS, SERVICE_NAME, DecisionService
from services.decision.settings import DEFAULT_POLICY_FILE
from sits.runtime.clock import SystemClock
from sits.runtime.events import Topics
from sits.runtime.grpc_tls import aio_channel, channel_credentials, server_credentials
from sits.runtime.grpcserver import GrpcServer, ServiceBinding, bearer_metadata
from sits.runtime.settings import Settings, load_settings
from sits.v1 import common_pb2, decision_pb2, decision_pb2_grpc
from sits_app.stack.embedded import wait_serving
from sits_engine.oom_hook.hook import HookConfig, OomHook
from sits_mesh.admission import AdmissionQuery
from sits_mesh.ext_proc import AdmitterUnavailable, DecisionAdmitter
from tests.security.conftest import Certs
from tests.waiting import eventually

TOKEN = "grpc-bearer-token-7c1e"
TARGET = common_pb2.Target(host="h", engine="vllm-0")


def server_settings(certs: Certs, *, mutual: bool) -> Settings:
    return load_settings(
        Settings,
        grpc_tls=True,
        grpc_tls_cert_file=certs.server_cert,
        grpc_tls_key_file=certs.server_key,
        grpc_tls_ca_file=certs.ca,
        grpc_tls_require_client_cert=mutual,
    )


def client(certs: Certs, ca: Path | None = None, cert: tuple[Path, Path] | None = None) -> grpc.ChannelCredentials:
    values: dict[str, Any] = {"grpc_tls": True, "grpc_tls_ca_file": ca or certs.ca}
    if cert is not None:
        values.update(grpc_tls_cert_file=cert[0], grpc_tls_key_file=cert[1])
    credentials = channel_credentials(load_settings(Settings, **values))
    assert credentials is not None
    return credentials


@pytest.fixture(params=[False, True], ids=["tls", "mutual-tls"])
async def decision_server(request: pytest.FixtureRequest, certs: Certs) -> AsyncIterator[tuple[GrpcServer, bool]]:
    engine = DecisionEngine(parse_policy(DEFAULT_POLICY_FILE.read_text()), SystemClock())
    mutual = bool(request.param)
    server = GrpcServer(
        [ServiceBinding(decision_pb2_grpc.add_DecisionServicer_to_server, DecisionService(engine), SERVICE_NAME)],
        token=TOKEN,
        mutating_methods=MUTATING_METHODS,
        credentials=server_credentials(server_settings(certs, mutual=mutual)),
    )
    async with server:
        yield server, mutual


async def admit(address: str, credentials: grpc.ChannelCredentials | None) -> bool:
    admitter = DecisionAdmitter(address, TARGET, timeout_s=5.0, credentials=credentials)
    try:
        await admitter.admit(AdmissionQuery(prompt_tokens=10, max_tokens=10, priority="p1"))
        return True
    except AdmitterUnavailable:
        return False
    finally:
        await admitter.close()


async def test_the_admission_processor_reaches_a_tls_decision_service_only_as_the_server_allows(
    decision_server: tuple[GrpcServer, bool], certs: Certs
) -> None:
    server, mutual = decision_server
    address = f"localhost:{server.port}"
    own = (certs.client_cert, certs.client_key)
    rogue = (certs.rogue_client_cert, certs.rogue_client_key)
    assert server.tls
    assert not await admit(address, None), "plaintext is refused"
    assert not await admit(address, client(certs, ca=certs.rogue_ca, cert=own)), "a server not from our CA is refused"
    assert await admit(address, client(certs, cert=own)), "TLS with a client certificate from the CA"
    assert await admit(address, client(certs)) is not mutual, "without a client certificate: only plain TLS"
    assert await admit(address, client(certs, cert=rogue)) is not mutual, "a client certificate from another CA"
    await wait_serving(address, SERVICE_NAME, 10, client(certs, cert=own))


async def test_the_bearer_token_still_guards_mutating_calls_over_mutual_tls(certs: Certs) -> None:
    engine = DecisionEngine(parse_policy(DEFAULT_POLICY_FILE.read_text()), SystemClock())
    server = GrpcServer(
        [ServiceBinding(decision_pb2_grpc.add_DecisionServicer_to_server, DecisionService(engine), SERVICE_NAME)],
        token=TOKEN,
        mutating_methods=MUTATING_METHODS,
        credentials=server_credentials(server_settings(certs, mutual=True)),
    )
    credentials = client(certs, cert=(certs.client_cert, certs.client_key))
    async with server, aio_channel(f"localhost:{server.port}", credentials) as channel:
        stub = decision_pb2_grpc.DecisionStub(channel)
        policy = await stub.GetPolicy(decision_pb2.GetPolicyRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.PutPolicy(decision_pb2.PutPolicyRequest(yaml=policy.yaml), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        accepted = await stub.PutPolicy(
            decision_pb2.PutPolicyRequest(yaml=policy.yaml), metadata=bearer_metadata(TOKEN), timeout=5
        )
        assert accepted.version > policy.version


async def test_the_oom_hook_reports_to_a_capture_that_serves_mutual_tls(
    settings: Settings, certs: Certs, tmp_path: Path
) -> None:
    publisher = CapturePublisher(
        lambda: TopicEnsuringProducer(settings), Spool(tmp_path / "spool"), Topics(settings.topic_prefix)
    )
    service = CaptureService(publisher, SystemClock())
    stop = asyncio.Event()
    publishing = asyncio.create_task(publisher.run(stop))
    server = GrpcServer(
        [capture_binding(service)],
        token=TOKEN,
        mutating_methods=CAPTURE_MUTATING,
        credentials=server_credentials(server_settings(certs, mutual=True)),
    )
    stats = {"allocated_bytes": 1, "reserved_bytes": 2, "inactive_split_bytes": 0, "alloc_retries": 0, "num_ooms": 1}
    try:
        async with server:
            address = f"localhost:{server.port}"

            def hook(**tls: str) -> OomHook:
                config = HookConfig(
                    capture_addr=address, spool_dir=str(tmp_path / "hook"), engine="vllm-0", report_timeout_s=3.0,
                    auth_token=TOKEN, **tls,
                )  # fmt: skip
                return OomHook(config, stats_reader=lambda _d: stats, gpu_uuid_of=lambda _d: "GPU-tls")

            plain = hook()
            with_tls = hook(
                tls_ca_file=str(certs.ca), tls_cert_file=str(certs.client_cert), tls_key_file=str(certs.client_key)
            )
            for h in (plain, with_tls):
                await asyncio.to_thread(h.on_oom, 0, 1 << 30, 80 << 30, 1 << 20)
                await asyncio.to_thread(h.wait_idle, 10)
            assert (len(plain.reported), len(plain.spooled)) == (0, 1), "plaintext is refused: spooled instead"
            assert (len(with_tls.reported), len(with_tls.spooled)) == (1, 0)
            assert await eventually(lambda: publisher.stats.published >= 1, 20), "the reported OOM was published"
    finally:
        stop.set()
        await asyncio.wait_for(publishing, 15)


def test_a_server_without_its_certificate_does_not_start(certs: Certs) -> None:
    from sits.runtime.grpc_tls import GrpcTlsError

    with pytest.raises(GrpcTlsError, match="SITS_GRPC_TLS_CERT_FILE"):
        server_credentials(load_settings(Settings, grpc_tls=True))
    assert server_credentials(load_settings(Settings)) is None
    assert channel_credentials(load_settings(Settings)) is None
