"""Child processes that never outlive their owner.

Every child starts in its own process group, so stopping it stops whatever it
started too (vLLM's engine core, say), and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

# Ports handed out below Linux's ephemeral range (32768-60999 by default). A port the kernel
# picks for `bind(0)` comes from that range, and so does the source port of every outgoing
# connection on the host: on a busy machine one of those could take a port between the moment
# it was chosen here and the moment the service binds it (seen: a service failing to start with
# "Failed to bind"). Below the range only another listener can collide.
_LOW_PORTS = (20000, 32767)
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    for _ in range(64):
        port = random.randint(*_LOW_PORTS)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class ManagedProcess:
    """A child process in its own group, with its output in a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def kill_hard(self) -> None:
        """SIGKILL the whole group at once (crash tests)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, wait up to grace_s, then SIGKILL it; safe to call twice."""
        if self.proc is not None:
            stop_group(self.proc, grace_s)

    async def astop(self, grace_s: float = 10.0) -> None:
        await asyncio.to_thread(self.stop, grace_s)


def stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """Stop `process` and its process group: SIGTERM, wait up to grace_s, then SIGKILL the group.

    `process` must lead its own group (`start_new_session=True`). The SIGKILL goes to the group
    even when the leader has exited, because children (vLLM's EngineCore) may outlive it.
    Safe to call on a process that has already been stopped.
    """
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


async def astop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """`stop_group` off the event loop."""
    await asyncio.to_thread(stop_group, process, grace_s)
