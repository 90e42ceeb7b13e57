"""Runs the OOM-prevention scenario: the engine and a growing co-tenant on one GPU, without and with SITS.

Per run (`--modes without with`):
1. the workload (`workload.py`) loads and warms up, then reports ready;
2. the SITS services start as processes (`python -m services.<name>.main`, settings
   from SITS_* variables) against one Tansu broker and one Redis for the whole
   scenario, each run with its own topic prefix:
   - "without": capture and decision only. They watch and warn, but no executor
     acts, so the engine behaves exactly as it would without SITS; the run
     measures the OOM and, in the same run, how long before it the first warning
     (a HealingCommand) came;
   - "with": capture, decision and executor: the full loop;
3. after `--history-s` of flat memory (the forecast's history), the scenario
   starts at t0: every request is submitted and the co-tenant (`squeezer.py`)
   begins to grow in steps;
4. the run ends when the engine finished, died of a CUDA OOM, or hit its deadline.

The co-tenant's plateau is sized once, from the first run's ready report, so
that the engine at its full batch needs more than is left (an OOM) while at 75%
of it (the default policy's cut) it fits: plateau = free after warm-up -
`--fit-fraction` x the cache at the full batch and longest context - activations.
Both runs use the same plateau.

Output under --out: <mode>.json per run (workload result, co-tenant steps, NVML
timeline, the commands and action results read back from Kafka, sizing), and
logs/ with every process's log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scenarios.h200_oom.files import wait_for_file, write_json
from sits.runtime.procs import ManagedProcess, free_port, port_open
from sits_app.stack.tansu import TansuBroker

log = logging.getLogger("h200_oom.run")
GIB = 1 << 30
ENGINE = "h200-engine"
HOST = "h200"
REPO = Path(__file__).resolve().parents[2]
CPU_GPU_UUID = "GPU-cpu-dry-run"


class NvmlTimeline:
    """Device memory and per-process memory at `hz`, read by the orchestrator itself (for the plot)."""

    def __init__(self, hz: float = 10.0) -> None:
        self.period = 1.0 / hz
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = False
        self.uuid = ""
        self.t0 = 0.0
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            uuid = pynvml.nvmlDeviceGetUUID(self._handle)
            self.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            self.available = True
        except Exception as error:
            log.info("NVML not available here (%s): no memory timeline", error)

    def start(self) -> None:
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="nvml-timeline", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        nvml = self._nvml
        while not self._stop.is_set():
            now = time.time()
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(self._handle)
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
                self.samples.append(
                    {
                        "t": round(now - self.t0, 3) if self.t0 else None,
                        "wall": now,
                        "used": int(info.used),
                        "total": int(info.total),
                        "procs": {str(p.pid): int(p.usedGpuMemory or 0) for p in procs},
                    }
                )
            except Exception as error:
                self.samples.append({"wall": now, "error": str(error)})
            self._stop.wait(self.period)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for sample in self.samples:
            if self.t0 and "wall" in sample:
                sample["t"] = round(sample["wall"] - self.t0, 3)
        return self.samples


def python_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{path}" if path else str(REPO)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def service_module(name: str) -> str:
    return f"services.{name}.main"


class Redis:
    def __init__(self, binary: str, log_dir: Path) -> None:
        self.port = free_port()
        env = dict(os.environ)
        lib_dir = os.environ.get("H200_OOM_REDIS_LIB", "")
        if lib_dir:
            env["LD_LIBRARY_PATH"] = lib_dir
        self.proc = ManagedProcess(
            "redis",
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(log_dir),
            ],
            log_dir / "redis.log",
            env=env,
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc.start()
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", self.port):
            if not self.proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"redis did not start:\n{self.proc.log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.stop(grace_s=3)


def timestamp_seconds(value: str | None) -> float | None:
    if not value:
        return None
    from google.protobuf.timestamp_pb2 import Timestamp

    ts = Timestamp()
    ts.FromJsonString(value)
    return ts.seconds + ts.nanos / 1e9


class Scenario:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.broker = TansuBroker(self.logs, port=None)
        self.redis = Redis(args.redis_server, self.logs) if args.redis_server else None
        self.plateau_bytes: int | None = None
        self.sizing: dict[str, Any] = {}

    def workload_argv(self, mode: str, ports: dict[str, int], files: dict[str, Path]) -> list[str]:
        a = self.args
        return [
            sys.executable,
            "-m",
            "scenarios.h200_oom.workload",
            "--device",
            a.device,
            "--shape",
            a.shape,
            "--slots",
            str(a.slots),
            "--chunk-tokens",
            str(a.chunk_tokens),
            "--max-model-len",
            str(a.max_model_len),
            "--max-batched-tokens",
            str(a.max_batched_tokens),
            "--prompt-tokens",
            str(a.prompt_tokens),
            "--min-new-tokens",
            str(a.min_new_tokens),
            "--max-new-tokens",
            str(a.max_new_tokens),
            "--requests",
            str(a.requests),
            "--deadline-s",
            str(a.deadline_s),
            "--engine-name",
            ENGINE,
            "--control-addr",
            f"127.0.0.1:{ports['control']}",
            "--loads-addr",
            f"127.0.0.1:{ports['loads']}",
            "--capture-addr",
            f"127.0.0.1:{ports['capture']}",
            "--hook-spool-dir",
            str(self.work / f"{mode}-hook"),
            "--ready-file",
            str(files["ready"]),
            "--go-file",
            str(files["go"]),
            "--result",
            str(files["result"]),
        ]

    def size_squeezer(self, ready: dict[str, Any]) -> None:
        a = self.args
        if a.device != "cuda":
            self.plateau_bytes = a.slots * GIB // 1000  # nothing is allocated on the CPU dry run
            self.sizing = {"cpu_dry_run": True}
            return
        free = int(ready["device_free"])
        kv_full = int(ready["kv_full_bytes"])
        activations = int(a.activation_reserve_gib * GIB)
        plateau = free - int(a.fit_fraction * kv_full) - activations
        self.plateau_bytes = max(GIB, plateau)
        self.sizing = {
            "device_total": ready.get("device_total"),
            "free_after_warmup": free,
            "kv_full_bytes": kv_full,
            "chunk_bytes": ready.get("chunk_bytes"),
            "fit_fraction": a.fit_fraction,
            "activation_reserve_bytes": activations,
            "plateau_bytes": self.plateau_bytes,
            "kv_room_bytes": free - self.plateau_bytes - activations,
        }

    def services_env(self, mode: str, ports: dict[str, int], engine_pid: int, gpu_uuid: str) -> dict[str, str]:
        env = {
            "SITS_KAFKA_BOOTSTRAP": self.broker.bootstrap,
            "SITS_TOPIC_PREFIX": f"h200oom-{mode}-{int(time.time())}.",
            "SITS_HOST_NAME": HOST,
            "SITS_LOG_LEVEL": "INFO",
            "SITS_METRICS_PORT": "0",
            "SITS_CAPTURE_ADDR": f"127.0.0.1:{ports['capture']}",
            "SITS_DECISION_ADDR": f"127.0.0.1:{ports['decision']}",
            "SITS_EXECUTOR_ADDR": f"127.0.0.1:{ports['executor']}",
            "SITS_VALIDATOR_ADDR": f"127.0.0.1:{ports['validator']}",
            "SITS_CAPTURE_ENGINE_NAME": ENGINE,
            "SITS_CAPTURE_ENGINE_GPU_UUID": gpu_uuid,
            "SITS_CAPTURE_ENGINE_PIDS": json.dumps([engine_pid]),
            "SITS_NVML_ENABLED": "true" if self.args.device == "cuda" else "false",
            "SITS_NVML_HZ": str(self.args.nvml_hz),
            "SITS_VLLM_GRPC_ADDR": f"127.0.0.1:{ports['loads']}",
            "SITS_VLLM_KV_EVENTS": "false",
            "SITS_VLLM_LOADS_INTERVAL_S": "0.25",
            "SITS_CAPTURE_SPOOL_DIR": str(self.work / f"{mode}-spool"),
            "SITS_OOM_HOOK_SPOOL_DIR": str(self.work / f"{mode}-hook"),
            "SITS_EXECUTOR_TARGETS": json.dumps(
                {
                    ENGINE: {
                        "engine_addr": f"127.0.0.1:{ports['loads']}",
                        "control_addr": f"127.0.0.1:{ports['control']}",
                    }
                }
            ),
        }
        if self.redis is not None:
            env["SITS_REDIS_URL"] = self.redis.url
        if self.args.policy_file:
            env["SITS_DECISION_POLICY_FILE"] = str(self.args.policy_file)
        return env

    def run_mode(self, mode: str) -> dict[str, Any]:
        a = self.args
        ports = {name: free_port() for name in ("control", "loads", "capture", "decision", "executor", "validator")}
        files = {
            "ready": self.work / f"{mode}-ready.json",
            "go": self.work / f"{mode}-go.json",
            "result": self.work / f"{mode}-workload.json",
            "squeezer": self.work / f"{mode}-squeezer.json",
        }
        for path in files.values():
            path.unlink(missing_ok=True)
        log.info("== %s: starting the workload", mode)
        workload = ManagedProcess(
            "workload",
            self.workload_argv(mode, ports, files),
            self.logs / f"{mode}-workload.log",
            env=python_env({"SITS_HOST_NAME": HOST}),
            cwd=REPO,
        )
        workload.start()
        procs: list[ManagedProcess] = []
        timeline = NvmlTimeline(hz=10.0)
        services: list[str] = []
        env: dict[str, str] = {"SITS_TOPIC_PREFIX": ""}
        t0 = 0.0
        squeezer_pid = 0
        try:
            ready = wait_for_file(files["ready"], timeout_s=a.ready_timeout_s)
            if self.plateau_bytes is None:
                self.size_squeezer(ready)
            assert self.plateau_bytes is not None
            services = ["capture", "decision"] + (["executor"] if mode == "with" else [])
            gpu_uuid = timeline.uuid or (CPU_GPU_UUID if a.device == "cpu" else "")
            env = self.services_env(mode, ports, int(ready["pid"]), gpu_uuid)
            if a.device == "cpu":
                # No GPU here: a stand-in publishes the memory curve NVML would have shown.
                procs.append(
                    ManagedProcess(
                        "synthetic-gpu",
                        [
                            sys.executable,
                            "-m",
                            "scenarios.h200_oom.gpu_standin",
                            "--bootstrap",
                            self.broker.bootstrap,
                            "--topic-prefix",
                            env["SITS_TOPIC_PREFIX"],
                            "--host",
                            HOST,
                            "--gpu-uuid",
                            CPU_GPU_UUID,
                            "--engine",
                            ENGINE,
                            "--go-file",
                            str(files["go"]),
                        ],
                        self.logs / f"{mode}-synthetic-gpu.log",
                        env=python_env({}),
                        cwd=REPO,
                    )
                )
                procs[-1].start()
            for name in services:
                proc = ManagedProcess(
                    name,
                    [sys.executable, "-m", service_module(name)],
                    self.logs / f"{mode}-{name}.log",
                    env=python_env(env),
                    cwd=REPO,
                )
                proc.start()
                procs.append(proc)
            deadline = time.monotonic() + 60
            for name in services:
                port = ports[name]
                while not port_open("127.0.0.1", port):
                    proc = next(p for p in procs if p.name == name)
                    if not proc.alive():
                        raise RuntimeError(f"{name} exited at start:\n{proc.log_tail()}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name} did not serve on {port}")
                    time.sleep(0.1)
            log.info("== %s: services up; %.0f s of history before t0", mode, a.history_s)
            timeline.start()
            time.sleep(a.history_s)
            t0 = time.time() + 0.5
            timeline.t0 = t0
            step_bytes = -(-self.plateau_bytes // a.squeeze_steps)
            squeezer = ManagedProcess(
                "squeezer",
                [
                    sys.executable,
                    "-m",
                    "scenarios.h200_oom.squeezer",
                    "--device",
                    a.device,
                    "--go-file",
                    str(files["go"]),
                    "--result",
                    str(files["squeezer"]),
                    "--start-delay-s",
                    str(a.squeeze_delay_s),
                    "--period-s",
                    str(a.squeeze_period_s),
                    "--step-bytes",
                    str(step_bytes),
                    "--plateau-bytes",
                    str(self.plateau_bytes),
                ],
                self.logs / f"{mode}-squeezer.log",
                env=python_env({}),
                cwd=REPO,
            )
            squeezer.start()
            squeezer_pid = squeezer.pid
            procs.append(squeezer)
            time.sleep(0.2)
            write_json(files["go"], {"t0": t0})
            finish = time.monotonic() + a.deadline_s + 60
            while workload.alive() and time.monotonic() < finish:
                time.sleep(0.2)
            if workload.alive():
                log.warning("%s: workload still running past its deadline; stopping it", mode)
            # Let the decision see the end state, and the OOM event travel, before everything stops.
            time.sleep(a.tail_s)
        finally:
            samples = timeline.stop()
            for proc in reversed(procs):
                proc.stop(grace_s=5)
            workload.stop(grace_s=10)
        topics = [
            f"{env['SITS_TOPIC_PREFIX']}sits.{name}" for name in ("healing.commands.v1", "healing.results.v1", "oom.v1")
        ]
        from sits.runtime.topic_dump import read_topics

        records = asyncio.run(read_topics(self.broker.bootstrap, topics))
        workload_result = json.loads(files["result"].read_text()) if files["result"].exists() else None
        squeezer_result = json.loads(files["squeezer"].read_text()) if files["squeezer"].exists() else None
        result = {
            "mode": mode,
            "t0": t0,
            "services": services,
            "sizing": self.sizing,
            "workload": workload_result,
            "squeezer": squeezer_result,
            "squeezer_pid": squeezer_pid,
            "nvml": samples,
            "gpu_uuid": timeline.uuid,
            "commands": [relative_command(c, t0) for c in records[topics[0]]],
            "results": [relative_result(r, t0) for r in records[topics[1]]],
            "oom_events": [relative_oom(o, t0) for o in records[topics[2]]],
        }
        write_json(self.out / f"{mode}.json", result)
        return result

    def run(self) -> int:
        self.broker.start()
        if self.redis is not None:
            self.redis.start()
        try:
            for mode in self.args.modes:
                result = self.run_mode(mode)
                summary(result)
        finally:
            if self.redis is not None:
                self.redis.stop()
            self.broker.stop()
        return 0


def relative_command(command: dict[str, Any], t0: float) -> dict[str, Any]:
    meta = command.get("meta", {})
    produced = timestamp_seconds(meta.get("produced_at"))
    return {
        "t": None if produced is None else round(produced - t0, 3),
        "command_id": command.get("command_id"),
        "kind": command.get("kind"),
        "rule": command.get("policy_rule"),
        "reason": command.get("reason"),
        "engine": meta.get("target", {}).get("engine"),
        "engine_limits": command.get("engine_limits"),
        "evidence": command.get("evidence"),
    }


def relative_result(result: dict[str, Any], t0: float) -> dict[str, Any]:
    applied = timestamp_seconds(result.get("applied_at"))
    return {
        "t": None if applied is None else round(applied - t0, 3),
        "command_id": result.get("command_id"),
        "kind": result.get("kind"),
        "status": result.get("status"),
        "detail": result.get("detail"),
        "before": result.get("before", {}).get("engine_limits"),
        "after": result.get("after", {}).get("engine_limits"),
    }


def relative_oom(event: dict[str, Any], t0: float) -> dict[str, Any]:
    produced = timestamp_seconds(event.get("meta", {}).get("produced_at"))
    return {
        "t": None if produced is None else round(produced - t0, 3),
        "requested_bytes": event.get("requested_bytes"),
        "message": event.get("message"),
    }


def summary(result: dict[str, Any]) -> None:
    w = result.get("workload") or {}
    first = next((c for c in result["commands"] if c.get("t") is not None), None)
    print(
        json.dumps(
            {
                "mode": result["mode"],
                "outcome": w.get("outcome"),
                "submitted": w.get("submitted"),
                "completed": w.get("completed"),
                "lost": w.get("lost"),
                "ooms": len(w.get("ooms") or []),
                "oom_t": [round(o["t"] - result["t0"], 2) for o in w.get("ooms") or []],
                "first_command": first,
                "commands": len(result["commands"]),
                "limit_changes": w.get("limit_changes"),
                "step_s_median": w.get("step_s_median"),
                "squeezer_failures": (result.get("squeezer") or {}).get("failures"),
                "sizing": result.get("sizing"),
            },
            indent=1,
        ),
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", default="/tmp/h200-oom-work")
    p.add_argument("--modes", nargs="+", default=["without", "with"], choices=["without", "with"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="llama8b")
    p.add_argument("--slots", type=int, default=160)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--min-new-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=1536)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--deadline-s", type=float, default=150.0)
    p.add_argument("--history-s", type=float, default=10.0, help="flat memory the forecast sees before t0")
    p.add_argument("--tail-s", type=float, default=2.0)
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    p.add_argument("--nvml-hz", type=float, default=10.0)
    p.add_argument(
        "--fit-fraction",
        type=float,
        default=0.85,
        help="share of the full-batch cache left free beside the co-tenant's plateau",
    )
    p.add_argument("--activation-reserve-gib", type=float, default=2.0)
    p.add_argument("--squeeze-steps", type=int, default=8)
    p.add_argument("--squeeze-period-s", type=float, default=1.0)
    p.add_argument("--squeeze-delay-s", type=float, default=1.0)
    p.add_argument("--policy-file", type=Path, default=None, help="decision policy (default: the service's own)")
    p.add_argument("--redis-server", default=shutil.which("redis-server") or "")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if importlib.util.find_spec("services.executor.main") is None:
        raise SystemExit("services/executor/main.py is missing")
    with contextlib.suppress(KeyboardInterrupt):
        return Scenario(args).run()
    return 130


if __name__ == "__main__":
    sys.exit(main())
