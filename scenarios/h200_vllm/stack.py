"""The SITS side of the scenario: one Tansu broker and one Redis for the whole run, and per mode
the services as their own processes (`python -m sits_app.cli <name>`, settings from `SITS_*`),
as `sits up` starts them; then every record of the mode's topics, read back for the report.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from sits.runtime.procs import ManagedProcess, free_port, port_open
from sits_app.stack.tansu import TansuBroker

REPO = Path(__file__).resolve().parents[2]
TOPIC_NAMES = {
    "metrics": "sits.metrics.v1",
    "oom": "sits.oom.v1",
    "commands": "sits.healing.commands.v1",
    "results": "sits.healing.results.v1",
    "verdicts": "sits.validation.v1",
}


class Redis:
    """A redis-server of our own on a free loopback port (or the URL of one already running)."""

    def __init__(self, binary: str, log_dir: Path, url: str = "") -> None:
        self.binary = binary
        self.port = free_port()
        self._url = url
        self._proc: ManagedProcess | None = None
        self._log_dir = log_dir

    @property
    def url(self) -> str:
        return self._url or f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self._url:
            return
        env = dict(os.environ)
        lib = os.environ.get("H200_REDIS_LIB", "")
        if lib:
            env["LD_LIBRARY_PATH"] = lib
        argv = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        self._proc = ManagedProcess("redis", [*argv, "--dir", str(self._log_dir)], self._log_dir / "redis.log", env=env)
        self._proc.start()
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", self.port):
            if not self._proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{self._proc.log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop(grace_s=3)


class Services:
    """capture, decision and (with SITS) executor and validator for one mode, each its own process."""

    def __init__(self, names: list[str], env: dict[str, str], log_dir: Path, mode: str) -> None:
        self.names = names
        self.env = env
        self.log_dir = log_dir
        self.mode = mode
        self.procs: dict[str, ManagedProcess] = {}

    def start(self) -> None:
        for name in self.names:
            proc = ManagedProcess(
                name,
                [sys.executable, "-m", "sits_app.cli", name],
                self.log_dir / f"{self.mode}-{name}.log",
                env=self.env,
                cwd=REPO,
            )
            proc.start()
            self.procs[name] = proc

    def wait_serving(self, timeout_s: float = 120.0) -> dict[str, float]:
        """Seconds until each service's gRPC port listens; raises with its log when one exits."""
        started = time.monotonic()
        ready: dict[str, float] = {}
        ports = {name: int(self.env[f"SITS_{name.upper()}_ADDR"].rsplit(":", 1)[1]) for name in self.names}
        while len(ready) < len(self.names):
            for name, proc in self.procs.items():
                if name in ready:
                    continue
                if port_open("127.0.0.1", ports[name]):
                    ready[name] = round(time.monotonic() - started, 2)
                elif not proc.alive():
                    raise RuntimeError(f"{name} exited at start:\n{proc.log_tail()}")
            if time.monotonic() - started > timeout_s:
                missing = sorted(set(self.names) - set(ready))
                raise TimeoutError(f"{', '.join(missing)} not serving after {timeout_s} s")
            time.sleep(0.1)
        return ready

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop(grace_s=5)


def services_env(
    *,
    bootstrap: str,
    redis_url: str,
    prefix: str,
    host: str,
    engine_name: str,
    gpu_uuid: str,
    engine_pids: list[int],
    engine_addr: str,
    control_addr: str,
    policy_file: Path,
    decision_model: str,
    token_file: Path,
    work: Path,
    nvml: bool,
) -> dict[str, str]:
    keys = command_keys(work / "command-keys")
    ports = {name: free_port() for name in ("capture", "decision", "executor", "validator")}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "SITS_KAFKA_BOOTSTRAP": bootstrap,
            "SITS_REDIS_URL": redis_url,
            "SITS_TOPIC_PREFIX": prefix,
            "SITS_HOST_NAME": host,
            "SITS_LOG_LEVEL": "INFO",
            "SITS_METRICS_PORT": "0",
            "SITS_AUTH_TOKEN_FILE": str(token_file),
            # Commands are signed as in `sits up`: decision and validator sign, the executor verifies.
            "SITS_COMMAND_SIGNING_KEY_FILE": str(keys),
            "SITS_EXECUTOR_VERIFY_KEYS_FILE": str(keys),
            **{f"SITS_{name.upper()}_ADDR": f"127.0.0.1:{port}" for name, port in ports.items()},
            # capture: NVML on the engine's GPU at 10 Hz, the plugin's state 4 times a second
            "SITS_CAPTURE_ENGINE_NAME": engine_name,
            "SITS_CAPTURE_ENGINE_GPU_UUID": gpu_uuid,
            "SITS_CAPTURE_ENGINE_PIDS": json.dumps(engine_pids),
            "SITS_NVML_ENABLED": "true" if nvml else "false",
            "SITS_NVML_HZ": "10",
            "SITS_ENGINE_CONTROL_ADDR": control_addr,
            "SITS_ENGINE_CONTROL_INTERVAL_S": "0.25",
            "SITS_CAPTURE_SPOOL_DIR": str(work / f"{prefix}spool"),
            "SITS_OOM_HOOK_SPOOL_DIR": str(work / "hook-spool"),
            # decision: the policy, and the engine's model shape for the activation estimate
            "SITS_DECISION_POLICY_FILE": str(policy_file),
            "SITS_DECISION_ENGINE_MODELS": json.dumps({engine_name: decision_model}),
            # executor: the engine's gRPC server and the plugin's control endpoint
            "SITS_EXECUTOR_TARGETS": json.dumps(
                {engine_name: {"engine_addr": engine_addr, "control_addr": control_addr, "gpu_uuid": gpu_uuid}}
            ),
            # validator: the engine's health through vLLM's own HealthCheck
            "SITS_VALIDATOR_ENGINES": json.dumps({engine_name: engine_addr}),
        }
    )
    return env


def command_keys(path: Path) -> Path:
    """A command-signing key file of the run's own (written once)."""
    from sits.runtime.signing import new_key, write_key_file

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_key_file(path, [new_key("scenario-1")])
    return path


def new_token(path: Path) -> Path:
    if not path.exists():
        path.write_text(secrets.token_urlsafe(32))
        path.chmod(0o600)
    return path


async def read_records(bootstrap: str, prefix: str, timeout_s: float = 20.0) -> dict[str, list[dict[str, Any]]]:
    """Every record of the mode's topics from the start, decoded, by TOPIC_NAMES key."""
    from sits.runtime.topic_dump import read_topics

    topics = {key: prefix + name for key, name in TOPIC_NAMES.items()}
    found = await read_topics(bootstrap, list(topics.values()), timeout_s, max_records=5000)
    return {key: found[name] for key, name in topics.items()}


def read_records_sync(bootstrap: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
    return asyncio.run(read_records(bootstrap, prefix))


__all__ = ["Redis", "Services", "TansuBroker", "new_token", "read_records_sync", "services_env"]
