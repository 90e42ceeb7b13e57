"""Fixtures for the mesh tests: one real vLLM engine per session, a real Decision peer,
and per-test Envoy + admission processor stacks in front of the engine.

The engine is started here (`mesh_engine`) with `sits_app.stack.vllm_engine.VllmServer`;
swap it for the shared engine fixture once tests/fixtures/ has one that allows
`--max-logprobs 100` (the flow-control test needs big responses).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from sits.v1 import common_pb2, decision_pb2_grpc
from sits_app.stack.vllm_engine import VllmOpenAIServer, VllmServer, make_random_llama
from sits_mesh.envoy_process import EnvoyProcess
from sits_mesh.ext_proc import AdmissionProcessor, DecisionAdmitter, ExtProcServer, FilePressure
from sits_mesh.policy import MeshPolicy
from tests.mesh.helpers import KV_BYTES_PER_TOKEN, KvRuleDecision

# The peer says this much KV is free: 4096 tokens' worth of the test model (tests lower it).
FREE_KV_BYTES = 4096 * KV_BYTES_PER_TOKEN
PRESSURE_FILE = "gpu_pressure"


@pytest.fixture(scope="session")
async def mesh_engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmServer]:
    model = make_random_llama()
    log = tmp_path_factory.mktemp("mesh-vllm") / "vllm.log"
    async with VllmServer(
        model,
        scheduler_cls=None,
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        extra_args=("--max-logprobs", "100"),
        log_path=log,
    ) as server:
        yield server


@pytest.fixture(scope="module")
async def openai_engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmOpenAIServer]:
    """vLLM's OpenAI server through the SITS launcher, for one module at a time (never beside `mesh_engine`)."""
    model = make_random_llama()
    log = tmp_path_factory.mktemp("openai-vllm") / "vllm.log"
    async with VllmOpenAIServer(
        model, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024, log_path=log, startup_timeout_s=600
    ) as server:
        yield server


@pytest.fixture(scope="session")
async def decision_peer() -> AsyncIterator[tuple[str, KvRuleDecision]]:
    servicer = KvRuleDecision(FREE_KV_BYTES)
    server = grpc.aio.server()
    decision_pb2_grpc.add_DecisionServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(0.5)


@dataclass
class MeshStack:
    envoy: EnvoyProcess
    ext_proc: ExtProcServer
    processor: AdmissionProcessor
    admitter: DecisionAdmitter

    @property
    def address(self) -> str:
        return self.envoy.address

    @property
    def access_log(self) -> Path:
        assert self.envoy.policy.access_log_path is not None
        return Path(self.envoy.policy.access_log_path)


StartMesh = Callable[..., Any]


def _starter(
    stack: contextlib.AsyncExitStack, upstream_port: int, decision_addr: str, tmp_path: Path, **defaults: Any
) -> StartMesh:
    async def start(**fields: Any) -> MeshStack:
        if "http" in fields and "http" in defaults:
            fields = {**fields, "http": {**defaults["http"], **fields["http"]}}
        base = MeshPolicy.model_validate(
            {
                "listener": {"port": 0},
                "admin": {"port": 0},
                "upstream": {"address": "127.0.0.1", "port": upstream_port},
                "overload": {"pressure_file": str(tmp_path / PRESSURE_FILE)},
                "access_log_path": str(tmp_path / "access.log"),
                **defaults,
                **fields,
            }
        )
        admitter = DecisionAdmitter(decision_addr, common_pb2.Target(host="test-host", engine="vllm-0"), timeout_s=2.0)
        stack.push_async_callback(admitter.close)
        processor = AdmissionProcessor(base, admitter, FilePressure(tmp_path / PRESSURE_FILE, max_age_s=0.0))
        ext_proc = await stack.enter_async_context(ExtProcServer(processor))
        policy = base.model_copy(update={"admission": base.admission.model_copy(update={"port": ext_proc.port})})
        envoy = await stack.enter_async_context(EnvoyProcess(policy, workdir=tmp_path / "envoy"))
        return MeshStack(envoy, ext_proc, processor, admitter)

    return start


@pytest.fixture
async def start_mesh(
    mesh_engine: VllmServer, decision_peer: tuple[str, KvRuleDecision], tmp_path: Path
) -> AsyncIterator[StartMesh]:
    """`stack = await start_mesh(**policy_fields)`: Envoy + processor in front of the session engine."""
    decision_addr, peer = decision_peer
    peer.free_kv_bytes = FREE_KV_BYTES
    async with contextlib.AsyncExitStack() as stack:
        yield _starter(stack, mesh_engine.port, decision_addr, tmp_path)


@pytest.fixture
async def start_http_mesh(
    openai_engine: VllmOpenAIServer, decision_peer: tuple[str, KvRuleDecision], tmp_path: Path
) -> AsyncIterator[StartMesh]:
    """`stack = await start_http_mesh(**policy_fields)`: the HTTP path (engine_api openai)."""
    decision_addr, peer = decision_peer
    peer.free_kv_bytes = FREE_KV_BYTES
    http = {
        "models": [openai_engine.served_model_name],
        "tokenizer_path": str(openai_engine.model_dir / "tokenizer.json"),
        "max_model_len": openai_engine.max_model_len,
    }
    async with contextlib.AsyncExitStack() as stack:
        yield _starter(stack, openai_engine.port, decision_addr, tmp_path, engine_api="openai", http=http)
