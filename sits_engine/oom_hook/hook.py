"""Attach PyTorch's OOM observer and report each CUDA OOM without ever hurting the host.

The observer runs on the allocating thread, after the caching allocator has
released its lock and just before PyTorch raises `OutOfMemoryError`. It only
reads allocator statistics (microseconds), optionally dumps a bounded
memory-history snapshot, and queues the event: a background thread reports it
to capture's `ReportOom` with a short timeout, and spools it to disk when capture
cannot be reached. Every step is guarded: nothing raised here reaches the host,
and the host's own `OutOfMemoryError` surfaces exactly as it would without us.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sits_engine.oom_hook.spool import spool_event

log = logging.getLogger("sits.oom_hook")

ENV_PREFIX = "SITS_OOM_HOOK_"
QUEUE_CAPACITY = 64

# (variable, default, meaning) of every SITS_OOM_HOOK_* variable, for `sits settings`: the hook runs inside
# the engine's processes, which read them from the environment (`HookConfig.from_env`, `plugin.register`).
ENVIRONMENT: tuple[tuple[str, str, str], ...] = (
    (f"{ENV_PREFIX}DISABLED", "", "1, true or yes: vLLM loads the plugin but the OOM hook is not installed."),
    (
        f"{ENV_PREFIX}CAPTURE_ADDR",
        "",
        "Capture's gRPC address (host:port) the hook reports OOMs to; empty: spool only.",
    ),
    (f"{ENV_PREFIX}SPOOL_DIR", "/tmp/sits-oom-spool", "Folder OOM reports go to when capture cannot be reached."),
    (f"{ENV_PREFIX}TIMEOUT_S", "0.5", "Deadline of one ReportOom call."),
    (f"{ENV_PREFIX}ENGINE", "", "Target.engine of the OOM events (the engine's name, as capture names it)."),
    (f"{ENV_PREFIX}HOST", "", "Target.host of the OOM events; empty: this host's name."),
    (f"{ENV_PREFIX}SNAPSHOT_DIR", "", "Folder for a bounded memory-history snapshot at each OOM; empty: none."),
    (f"{ENV_PREFIX}SNAPSHOT_MAX_ENTRIES", "20000", "Allocations the memory-history snapshot keeps."),
    (f"{ENV_PREFIX}TOKEN", "", "Bearer token for capture's ReportOom (a mutating call)."),
    (f"{ENV_PREFIX}TLS_CA_FILE", "", "CA (PEM) of a capture that serves TLS."),
    (f"{ENV_PREFIX}TLS_CERT_FILE", "", "Client certificate (PEM) for a capture that wants one."),
    (f"{ENV_PREFIX}TLS_KEY_FILE", "", "Private key (PEM) of SITS_OOM_HOOK_TLS_CERT_FILE."),
)

# (device) -> the allocator figures the event carries; injectable for tests.
StatsReader = Callable[[int], dict[str, int]]
# (event dict) -> None; raises when the event was not delivered.
Reporter = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class HookConfig:
    """How the hook reports. Read from SITS_OOM_HOOK_* variables when loaded as a plugin."""

    capture_addr: str = ""  # host:port of capture's gRPC server; "" = spool only
    spool_dir: str = "/tmp/sits-oom-spool"
    report_timeout_s: float = 0.5
    engine: str = ""
    host: str = field(default_factory=socket.gethostname)
    snapshot_dir: str = ""  # "" = no memory-history snapshot
    snapshot_max_entries: int = 20_000
    auth_token: str = ""
    # TLS to a capture that serves it (SITS_GRPC_TLS): the CA, and a client certificate if it wants one.
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> HookConfig:
        env = dict(os.environ if environ is None else environ)

        def get(name: str, default: str) -> str:
            return env.get(ENV_PREFIX + name, default)

        return cls(
            capture_addr=get("CAPTURE_ADDR", ""),
            spool_dir=get("SPOOL_DIR", cls.spool_dir),
            report_timeout_s=float(get("TIMEOUT_S", str(cls.report_timeout_s))),
            engine=get("ENGINE", ""),
            host=get("HOST", "") or socket.gethostname(),
            snapshot_dir=get("SNAPSHOT_DIR", ""),
            snapshot_max_entries=int(get("SNAPSHOT_MAX_ENTRIES", str(cls.snapshot_max_entries))),
            auth_token=get("TOKEN", ""),
            tls_ca_file=get("TLS_CA_FILE", ""),
            tls_cert_file=get("TLS_CERT_FILE", ""),
            tls_key_file=get("TLS_KEY_FILE", ""),
        )


def torch_allocator_stats(device: int) -> dict[str, int]:
    import torch

    stats = torch.cuda.memory_stats(device)
    return {
        "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
        "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
        "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
    }


def new_traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


class OomHook:
    def __init__(
        self,
        config: HookConfig,
        *,
        stats_reader: StatsReader = torch_allocator_stats,
        reporter: Reporter | None = None,
        gpu_uuid_of: Callable[[int], str] | None = None,
    ) -> None:
        self.config = config
        self._stats_reader = stats_reader
        self._reporter = reporter if reporter is not None else GrpcReporter(config)
        self._gpu_uuid_of = gpu_uuid_of if gpu_uuid_of is not None else _torch_gpu_uuid
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=QUEUE_CAPACITY)
        self._sender: threading.Thread | None = None
        self._sender_lock = threading.Lock()
        self.attached = False
        self.status = "not installed"
        # Outcomes, for tests and the host's own logs: event ids reported / spooled.
        self.reported: list[str] = []
        self.spooled: list[str] = []
        self.failures = 0
        atexit.register(self.flush_to_spool)

    # ------------------------------------------------------------------ install

    def install(self) -> bool:
        """Attach to PyTorch; defers until CUDA initialises so a forking host is not disturbed."""
        try:
            import torch
        except Exception as exc:  # no torch: nothing to watch
            self.status = f"unavailable: torch cannot be imported ({exc})"
            return False
        if not hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
            self.status = "unavailable: this torch has no CUDA OOM observer (CPU build)"
            return False
        # Attaching before CUDA initialises would find no per-device allocators and attach
        # nothing; initialising CUDA ourselves would break hosts that fork workers later.
        torch.cuda._lazy_call(self._attach_guarded)  # type: ignore[no-untyped-call]
        self.status = "attached" if self.attached else "waiting for CUDA initialisation"
        return True

    def _attach_guarded(self) -> None:
        # A queued call that raises would fail the host's CUDA initialisation.
        try:
            import torch

            torch._C._cuda_attach_out_of_memory_observer(self.on_oom)  # type: ignore[attr-defined]
            if self.config.snapshot_dir:
                # Python frames only: with C++ frames the first dump symbolises for seconds (seen on
                # the H200: 5.7 s inside the failing allocation), which would stall the host at its OOM.
                torch.cuda.memory._record_memory_history(max_entries=self.config.snapshot_max_entries, stacks="python")
            self.attached = True
            self.status = "attached"
        except Exception as exc:
            self.status = f"unavailable: attach failed ({exc})"

    # ------------------------------------------------------------------ observer

    def on_oom(self, device: int, requested: int, device_total: int, device_free: int) -> None:
        """PyTorch's observer callback: (device, requested bytes, device total, device free)."""
        try:
            event = self.build_event(device, requested, device_total, device_free)
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self._spool(event)
                return
            self._ensure_sender()
        except BaseException:
            self.failures += 1
            with contextlib.suppress(BaseException):
                log.exception("sits oom hook failed to record an OOM; the host is unaffected")

    def build_event(self, device: int, requested: int, device_total: int, device_free: int) -> dict[str, Any]:
        try:
            allocator = self._stats_reader(device)
        except Exception:
            allocator = {}
        try:
            gpu_uuid = self._gpu_uuid_of(device)
        except Exception:
            gpu_uuid = ""
        event_id = secrets.token_hex(16)
        produced_at = time.time()
        event: dict[str, Any] = {
            "event_id": event_id,
            "produced_at": produced_at,
            "source": "capture/oom-hook",
            "target": {
                "host": self.config.host,
                "gpu_uuid": gpu_uuid,
                "mig_instance": "",
                "engine": self.config.engine,
            },
            "traceparent": new_traceparent(),
            "requested_bytes": int(requested),
            "device_free_bytes": int(device_free),
            "device_total_bytes": int(device_total),
            "device_index": int(device),
            "pid": os.getpid(),
            "allocator": allocator,
            "memory_snapshot_path": self._dump_snapshot(event_id),
            "message": (
                f"CUDA out of memory on device {device}: tried to allocate {requested} bytes, "
                f"{device_free} of {device_total} bytes free"
            ),
        }
        return event

    def _dump_snapshot(self, event_id: str) -> str:
        if not self.config.snapshot_dir or not self.attached:
            return ""
        try:
            import torch

            folder = Path(self.config.snapshot_dir)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"oom-{os.getpid()}-{event_id}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]
            return str(path)
        except Exception:
            return ""

    # ------------------------------------------------------------------ delivery

    def _ensure_sender(self) -> None:
        # Started on first use rather than at install: a thread started before a fork
        # would not exist in the child.
        with self._sender_lock:
            if self._sender is None or not self._sender.is_alive():
                self._sender = threading.Thread(target=self._send_loop, name="sits-oom-hook", daemon=True)
                self._sender.start()

    def _send_loop(self) -> None:
        while True:
            event = self._queue.get()
            try:
                self._deliver(event)
            finally:
                self._queue.task_done()

    def _deliver(self, event: dict[str, Any]) -> None:
        try:
            self._reporter(event)
            self.reported.append(event["event_id"])
        except Exception as exc:
            with contextlib.suppress(Exception):
                log.warning("capture unreachable (%s); spooling OOM event %s", exc, event["event_id"])
            self._spool(event)

    def _spool(self, event: dict[str, Any]) -> None:
        try:
            spool_event(self.config.spool_dir, event)
            self.spooled.append(event["event_id"])
        except Exception:
            self.failures += 1
            with contextlib.suppress(Exception):
                log.exception("sits oom hook could not spool event %s", event.get("event_id"))

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued events are delivered or spooled (tests, orderly shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return False

    def flush_to_spool(self) -> None:
        """At interpreter exit: whatever is still queued goes to the spool, never over the network."""
        while True:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return
            self._spool(event)
            self._queue.task_done()


def _torch_gpu_uuid(device: int) -> str:
    import torch

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


class GrpcReporter:
    """Sends the event to capture's ReportOom; raises when it was not accepted in time."""

    def __init__(self, config: HookConfig) -> None:
        self._config = config
        self._call: Any = None

    def __call__(self, event: dict[str, Any]) -> None:
        if not self._config.capture_addr:
            raise ConnectionError("no capture address configured")
        if self._call is None:
            import grpc

            from sits.v1 import capture_pb2, events_pb2

            channel = self._channel(grpc)
            self._call = channel.unary_unary(
                "/sits.v1.Capture/ReportOom",
                request_serializer=events_pb2.OomEvent.SerializeToString,
                response_deserializer=capture_pb2.ReportOomResponse.FromString,
            )
        metadata = [("traceparent", event["traceparent"])]
        if self._config.auth_token:
            metadata.append(("authorization", f"Bearer {self._config.auth_token}"))
        self._call(event_to_proto(event), timeout=self._config.report_timeout_s, metadata=metadata)

    def _channel(self, grpc: Any) -> Any:
        config = self._config
        if not config.tls_ca_file:
            return grpc.insecure_channel(config.capture_addr)
        key = Path(config.tls_key_file).read_bytes() if config.tls_key_file else None
        chain = Path(config.tls_cert_file).read_bytes() if config.tls_cert_file else None
        credentials = grpc.ssl_channel_credentials(Path(config.tls_ca_file).read_bytes(), key, chain)
        return grpc.secure_channel(config.capture_addr, credentials)


def event_to_proto(event: dict[str, Any]) -> Any:
    """The hook's event dict (also the spool file's content) as a sits.v1.OomEvent."""
    from sits.runtime.traces import TraceTarget, record_to_oom

    target = event.get("target") or {}
    return record_to_oom(
        event,
        TraceTarget(
            host=str(target.get("host", "")),
            gpu_uuid=str(target.get("gpu_uuid", "")),
            mig_instance=str(target.get("mig_instance", "")),
            engine=str(target.get("engine", "")),
        ),
        produced_at=float(event.get("produced_at", 0.0)),
        event_id=str(event.get("event_id", "")),
        source=str(event.get("source", "capture/oom-hook")),
    )


_installed: OomHook | None = None


def install(config: HookConfig | None = None) -> OomHook:
    """Install the process-wide hook once; later calls return the same hook."""
    global _installed
    if _installed is None:
        _installed = OomHook(config or HookConfig.from_env())
        _installed.install()
    return _installed
