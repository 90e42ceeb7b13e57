"""The two paths every SITS claim compares: the same engine and load with SITS, and without it.

- `start_baseline`: vLLM as it ships (FCFS, vLLM's own gRPC launcher, no SITS
  code) behind Envoy alone: the mesh's config with its breakers at their
  defaults and no admission processor. What a platform team runs today.
- `start_sits`: the same engine with the SITS scheduler plugin (tiers, limits,
  signals) behind the same Envoy with the admission processor in a process of
  its own, and the whole loop (Tansu, Redis, capture, decision, executor,
  validator) as the embedded stack runs it.

Used by `sits demo` and by the overload benchmark, so that both measure one setup.
Everything started is registered on the caller's AsyncExitStack and stopped with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.decision.domain.kv_model import known_model
from sits.runtime.procs import ManagedProcess, free_port
from sits_app.stack.embedded import EmbeddedStack, StackConfig
from sits_app.stack.vllm_engine import CPU_QUEUE_POLL_S, VllmOpenAIServer, VllmServer
from sits_mesh.envoy_process import EnvoyProcess
from sits_mesh.policy import MeshPolicy, load_policy

REPO_ROOT = Path(__file__).resolve().parents[2]
MESH_POLICY = REPO_ROOT / "mesh" / "policy.yaml"
ENGINE = "vllm-0"
# The random-weight Llama sits_app.stack.vllm_engine serves, by its name in the estimator's table.
MODEL = "sits-random-llama"
KV_BYTES_PER_TOKEN = known_model(MODEL).kv_bytes_per_token(2, 1)

Progress = Callable[[str], None]
# vLLM's default KV block size, in tokens, in its CPU build and in its CUDA build.
CPU_BLOCK_TOKENS = 128
CUDA_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class EngineShape:
    """One engine's size, the same on both paths."""

    max_num_seqs: int = 16
    # In vLLM CPU's blocks of 128 tokens (its default); a GPU engine gets as many tokens in the CUDA build's
    # 16-token blocks, so both builds hold the same KV.
    kv_blocks: int = 24
    max_model_len: int = 1024
    max_num_batched_tokens: int = 1024
    # Run the engine on this many CPUs only (taskset), to see the loop on a slower machine; 0: all.
    cpus: int = 0
    # "grpc": vLLM's gRPC server; "openai": its OpenAI-compatible HTTP server (the HTTP path).
    api: str = "grpc"
    # The CUDA build of vLLM on this host's GPU instead of the CPU build (bench/overload.py --variants gpu):
    # the same model and limits, a faster machine. Both engines share the GPU, each taking this fraction.
    gpu_memory_utilization: float = 0.0

    def server(self, model: Path, log_path: Path, sits: bool) -> VllmServer:
        # On the GPU, as many blocks of 16 tokens would hold an eighth of the CPU engine's KV: with anything
        # running, less than twice the largest request would be free, and admission's bypass would never open
        # (docs/http.md). So the GPU engine gets the CPU's KV in tokens.
        on_gpu = bool(self.gpu_memory_utilization)
        blocks = self.kv_blocks * CPU_BLOCK_TOKENS // CUDA_BLOCK_TOKENS if on_gpu else self.kv_blocks
        extra: tuple[str, ...] = ("--num-gpu-blocks-override", str(blocks))
        if on_gpu:
            # bfloat16: the random Llama is saved in float32, and FlashAttention (vLLM's default on Hopper) takes
            # only 16-bit types.
            extra += ("--gpu-memory-utilization", str(self.gpu_memory_utilization), "--dtype", "bfloat16")
        kind = VllmOpenAIServer if self.api == "openai" else VllmServer
        return kind(
            model,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduler_cls=None if not sits else VllmServer.DEFAULT_SCHEDULER,
            extra_args=extra,
            log_path=log_path,
            cpus=self.cpus,
            # Two engines start at once; one pinned to a single CPU of a busy host took over 180 s.
            startup_timeout_s=600.0 if self.cpus else 300.0,
            queue_poll_s=0.0 if self.gpu_memory_utilization else CPU_QUEUE_POLL_S,
        )


@dataclass
class Served:
    """One path's front door and what is behind it."""

    name: str
    engine: VllmServer
    envoy: EnvoyProcess
    stack: EmbeddedStack | None = None
    processor: ManagedProcess | None = None
    processor_metrics_url: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.envoy.address


def engine_policy_fields(engine: VllmServer) -> dict[str, Any]:
    """The mesh policy's engine API for this engine: the HTTP path for vLLM's OpenAI server."""
    if not isinstance(engine, VllmOpenAIServer):
        return {}
    http = {
        "models": [engine.served_model_name],
        "tokenizer_path": str(engine.model_dir / "tokenizer.json"),
        "max_model_len": engine.max_model_len,
    }
    return {"engine_api": "openai", "http": http}


def mesh_policy(
    engine_port: int,
    workdir: Path,
    admission_port: int | None,
    max_model_len: int,
    engine_fields: dict[str, Any] | None = None,
) -> MeshPolicy:
    """The shipped mesh policy on loopback ports, sized for the random Llama; admission off without a port."""
    shipped = load_policy(MESH_POLICY)
    if engine_fields:
        shipped = MeshPolicy.model_validate({**shipped.model_dump(mode="json"), **engine_fields})
    admission: dict[str, Any] = {
        "enabled": admission_port is not None,
        "port": admission_port or shipped.admission.port,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "bypass_max_request_tokens": max_model_len,
        "engine": ENGINE,
    }
    return shipped.model_copy(
        update={
            "listener": shipped.listener.model_copy(update={"address": "127.0.0.1", "port": 0}),
            "admin": shipped.admin.model_copy(update={"port": 0}),
            "upstream": shipped.upstream.model_copy(update={"address": "127.0.0.1", "port": engine_port}),
            "overload": shipped.overload.model_copy(update={"pressure_file": str(workdir / "gpu_pressure")}),
            "admission": shipped.admission.model_copy(update=admission),
        }
    )


async def start_engines(
    stack: contextlib.AsyncExitStack, model: Path, shape: EngineShape, workdir: Path, *, baseline: bool, sits: bool
) -> dict[str, VllmServer]:
    """Start the engines the paths need, at once on CPUs (each takes tens of seconds on two cores)."""
    wanted = {"baseline": baseline, "sits": sits}
    engines = {
        name: shape.server(model, workdir / f"vllm-{name}.log", name == "sits") for name, on in wanted.items() if on
    }
    for engine in engines.values():
        stack.push_async_callback(engine.stop)
    if shape.gpu_memory_utilization:
        # One after the other on a shared GPU: vLLM sizes its memory from what the GPU has free while it
        # profiles, and another engine loading at the same moment would be counted against it.
        for engine in engines.values():
            await engine.start()
    else:
        await asyncio.gather(*(engine.start() for engine in engines.values()))
    return engines


async def start_baseline(stack: contextlib.AsyncExitStack, engine: VllmServer, workdir: Path) -> Served:
    policy = mesh_policy(
        engine.port, workdir / "envoy-baseline", None, engine.max_model_len, engine_policy_fields(engine)
    )
    envoy = await stack.enter_async_context(EnvoyProcess(policy, workdir=workdir / "envoy-baseline"))
    return Served("without SITS", engine, envoy)


async def start_sits(
    stack: contextlib.AsyncExitStack,
    engine: VllmServer,
    workdir: Path,
    decision_policy: Path,
    progress: Progress | None = None,
    service_env: dict[str, str] | None = None,
) -> Served:
    """The engine (with the plugin) behind Envoy and the admission processor, and the four services."""
    assert engine.control_address is not None, "the SITS path needs the engine's control endpoint"
    say = progress or (lambda _message: None)
    embedded = EmbeddedStack(StackConfig(run_dir=workdir / "stack", topic_prefix=""), progress=progress)
    processor_port = free_port()
    processor_metrics_port = free_port()
    policy = mesh_policy(
        engine.port, workdir / "envoy", processor_port, engine.max_model_len, engine_policy_fields(engine)
    )
    policy_file = workdir / "mesh-policy.yaml"
    policy_file.parent.mkdir(parents=True, exist_ok=True)
    policy_file.write_text(yaml.safe_dump(policy.model_dump(mode="json")))
    envoy = await stack.enter_async_context(EnvoyProcess(policy, workdir=workdir / "envoy"))
    say("starting the SITS admission processor (its own process) in front of the engine")
    processor = ManagedProcess(
        "admission",
        [
            sys.executable,
            "-m",
            "sits_app.cli",
            "mesh",
            "ext-proc",
            "--policy",
            str(policy_file),
            "--decision-addr",
            embedded.settings.decision_addr,
            "--envoy-admin",
            envoy.admin_url,
        ],
        workdir / "logs" / "admission.log",
        env={**embedded.env(), "SITS_METRICS_PORT": str(processor_metrics_port)},
    )
    processor.start()
    stack.push_async_callback(processor.astop)
    await _wait_for_line(processor, "admission processor on", 120.0)
    metrics_url = f"http://127.0.0.1:{processor_metrics_port}/metrics"
    env = {
        "SITS_NVML_ENABLED": "false",
        "SITS_CAPTURE_ENGINE_NAME": ENGINE,
        # The plugin's state is the engine sample (tiers, limits, exact KV blocks); vLLM's own GetLoads
        # would interleave samples without them.
        "SITS_ENGINE_CONTROL_ADDR": engine.control_address,
        "SITS_VLLM_GRPC_ADDR": "",
        "SITS_EXECUTOR_TARGETS": json.dumps(
            {ENGINE: {"engine_addr": engine.address, "control_addr": engine.control_address}}
        ),
        "SITS_ENVOY_ADMIN_URL": envoy.admin_url,
        "SITS_ENVOY_PRESSURE_FILE": str(envoy.pressure_file),
        "SITS_DECISION_POLICY_FILE": str(decision_policy),
        # KV bytes per token of the served model: admission answers in bytes, and the processor's bypass
        # (no inspection while one request of the engine's largest size fits twice over) needs them.
        "SITS_DECISION_ENGINE_MODELS": json.dumps({ENGINE: MODEL}),
        # The validator's health probe: vLLM's gRPC HealthCheck, or GET /health of the OpenAI server.
        "SITS_VALIDATOR_ENGINES": json.dumps(
            {ENGINE: f"http://{engine.address}" if isinstance(engine, VllmOpenAIServer) else engine.address}
        ),
        "SITS_VALIDATOR_ENVOY_ADMIN_URL": envoy.admin_url,
        "SITS_VALIDATOR_ADMISSION_METRICS_URL": metrics_url,
        # Tansu answers a fetch only when its wait ends: at the default 10 ms every consumer polls 100
        # times a second, and on a two-core machine the broker and the services then take about a third of
        # a core from the engine's own API server. The controller ticks every 0.5 s, so 50 ms costs it nothing.
        "SITS_CONSUMER_FETCH_MAX_WAIT_MS": "50",
        **(service_env or {}),
    }
    embedded.config.extra_env.update(env)
    say("starting Tansu, checking Redis, starting capture, decision, executor, validator")
    await stack.enter_async_context(embedded)
    return Served("with SITS", engine, envoy, embedded, processor, metrics_url)


async def _wait_for_line(process: ManagedProcess, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in process.log_tail(200):
        if not process.alive():
            raise RuntimeError(f"{process.name} exited while starting; its log:\n{process.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{process.name} did not start within {timeout_s:.0f} s; its log:\n{process.log_tail()}")
        await asyncio.sleep(0.1)
