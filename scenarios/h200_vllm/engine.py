"""A real vLLM gRPC server process, the way production starts it, with or without SITS inside.

With SITS (`sits=True`): the SITS gRPC launcher (vLLM's own server plus the tier interceptor),
`--scheduler-cls ...SitsScheduler` (which becomes `SitsAsyncScheduler` when vLLM runs async
scheduling), its engine-control endpoint at `SITS_ENGINE_CONTROL_ADDR`, and capture's OOM hook
loaded by vLLM as a general plugin (entry point `vllm.general_plugins: sits_oom_hook`). Where
the SITS package is not pip-installed (the GPU machine runs it from the checkout), a
`sits_oom_hook` dist-info folder with that entry point is written beside the run and put on
the engine's PYTHONPATH, so vLLM's plugin loader finds it exactly as it would the installed
package's. Without SITS: vLLM's own gRPC server module, nothing of SITS in the process.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sits.runtime.procs import stop_group
from sits_app.stack.vllm_engine import vllm_server_module

REPO = Path(__file__).resolve().parents[2]
SITS_SCHEDULER = "sits_engine.vllm_plugin.scheduler.SitsScheduler"
SITS_LAUNCHER = "sits_engine.vllm_plugin.grpc_launcher"
HOOK_ENTRY_POINT = "sits_oom_hook = sits_engine.oom_hook.plugin:register"


def hook_entry_point_dir(work: Path) -> Path | None:
    """A folder to put on the engine's PYTHONPATH so vLLM loads the OOM hook; None if installed already."""
    installed = importlib.metadata.entry_points(group="vllm.general_plugins")
    if any(ep.name == "sits_oom_hook" for ep in installed):
        return None
    folder = work / "hook-entry-point"
    info = folder / "sits_oom_hook-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sits-oom-hook\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{HOOK_ENTRY_POINT}\n")
    return folder


@dataclass
class EngineConfig:
    model_dir: Path
    port: int
    control_port: int
    sits: bool
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float | None
    dummy_weights: bool
    enforce_eager: bool = True
    priority: bool = True
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


class Engine:
    def __init__(self, config: EngineConfig, log_path: Path, work: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.work = work
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.config.port}"

    @property
    def control_address(self) -> str:
        return f"127.0.0.1:{self.config.control_port}"

    def argv(self) -> list[str]:
        c = self.config
        module = SITS_LAUNCHER if c.sits else vllm_server_module()
        args = [
            sys.executable,
            "-m",
            module,
            "--model",
            str(c.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(c.port),
            "--skip-tokenizer-init",
            "--max-model-len",
            str(c.max_model_len),
            "--max-num-seqs",
            str(c.max_num_seqs),
            "--max-num-batched-tokens",
            str(c.max_num_batched_tokens),
            "--enable-chunked-prefill",
        ]
        if c.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        if c.dummy_weights:
            args += ["--load-format", "dummy"]
        if c.enforce_eager:
            args.append("--enforce-eager")
        if c.sits:
            args += ["--scheduler-cls", SITS_SCHEDULER]
            if c.priority:
                args += ["--scheduling-policy", "priority"]
        return args + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(REPO)]
        if self.config.sits:
            hook = hook_entry_point_dir(self.work)
            if hook is not None:
                paths.append(str(hook))
            env["SITS_ENGINE_CONTROL_ADDR"] = self.control_address
        else:
            env["SITS_OOM_HOOK_DISABLED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH", "")])])
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.update(self.config.env)
        return env

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.started_at = time.time()
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                cwd=REPO,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pids(self) -> list[int]:
        """The server process and its children (EngineCore), read from /proc."""
        if self.proc is None:
            return []
        found = [self.proc.pid]
        with contextlib.suppress(OSError):
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = (entry / "stat").read_text()
                    ppid = int(stat.rsplit(")", 1)[1].split()[1])
                    if ppid in found:
                        found.append(int(entry.name))
        return found

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self, grace_s: float = 15.0) -> None:
        proc = self.proc
        if proc is None:
            return
        stop_group(proc, grace_s)


_GIB = r"([0-9.]+) GiB"


def parse_engine_log(text: str) -> dict[str, float]:
    """What vLLM says of its memory at start: weights, peak activation, non-torch, KV cache (GiB)."""
    found: dict[str, float] = {}
    patterns = {
        "weights_gib": rf"Actual usage is {_GIB} for weight",
        "peak_activation_gib": rf"{_GIB} for peak activation",
        "non_torch_gib": rf"{_GIB} for non-torch memory",
        "kv_cache_gib": rf"Available KV cache memory: {_GIB}",
        "model_loading_gib": rf"Model loading took {_GIB}",
    }
    for key, pattern in patterns.items():
        match = re.search(pattern, text)
        if match:
            found[key] = float(match.group(1))
    for key, pattern in {
        "async_scheduling": r"Asynchronous scheduling is (enabled|disabled)",
    }.items():
        match = re.search(pattern, text)
        if match:
            found[key] = 1.0 if match.group(1) == "enabled" else 0.0
    match = re.search(r"(SitsAsyncScheduler|SitsScheduler): async scheduling (on|off)", text)
    if match:
        found["plugin_async"] = 1.0 if match.group(2) == "on" else 0.0
    found["oom_in_log"] = 1.0 if re.search(r"OutOfMemoryError|CUDA out of memory", text) else 0.0
    found["engine_dead_in_log"] = (
        1.0 if re.search(r"EngineDeadError|EngineCore.*died|Engine core .* died", text) else 0.0
    )
    return found
