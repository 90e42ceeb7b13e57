"""NVML on a machine without a GPU, and the whole capture service wired by main.serve."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc
import pytest

from services.capture.main import serve
from services.capture.settings import CaptureSettings
from services.capture.sources.nvml import NvmlSource
from services.capture.sources.nvml_reader import NvmlReader, NvmlUnavailable
from sits.runtime.procs import free_port
from sits.runtime.settings import Settings
from sits.v1 import capture_pb2, capture_pb2_grpc, common_pb2, events_pb2

TRACE = Path(__file__).resolve().parents[2] / "traces" / "h200" / "plateau.jsonl.gz"


def test_reader_says_why_nvml_is_unavailable() -> None:
    with pytest.raises(NvmlUnavailable, match="NVML cannot be initialised"):
        NvmlReader().open()


async def test_nvml_source_reports_unavailable_once_and_ends() -> None:
    source = NvmlSource(hz=100)
    events = [e async for e in source.events()]
    assert events == []
    health = source.health()
    assert health.unavailable and not health.healthy
    assert "NVML cannot be initialised" in health.detail


@pytest.mark.parametrize("hz", [0, -1, 101])
def test_nvml_rate_is_bounded(hz: float) -> None:
    with pytest.raises(ValueError, match="NVML rate"):
        NvmlSource(hz=hz)


async def test_service_runs_end_to_end_from_settings(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    capture_settings = CaptureSettings(
        **{**settings.model_dump(), "capture_addr": f"127.0.0.1:{port}"},
        replay_trace=TRACE,
        replay_speed=50.0,
        capture_spool_dir=tmp_path / "spool",
        oom_hook_spool_dir=tmp_path / "hooks",
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve(capture_settings, stop))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = capture_pb2_grpc.CaptureStub(channel)
            deadline = time.monotonic() + 20
            snapshot = None
            while snapshot is None:
                assert time.monotonic() < deadline, "no snapshot from the replayed trace"
                with contextlib.suppress(grpc.aio.AioRpcError):
                    snapshot = await stub.GetSnapshot(capture_pb2.GetSnapshotRequest(target=common_pb2.Target()))
                await asyncio.sleep(0.1)
            assert snapshot.latest.source_kind == events_pb2.SAMPLE_SOURCE_REPLAY
            assert snapshot.latest.gpu.total_bytes > 100 << 30  # recorded on an H200
            health = {s.source: s for s in snapshot.sources}
            assert health["replay"].healthy
            assert not health["nvml"].healthy and "NVML" in health["nvml"].detail
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
