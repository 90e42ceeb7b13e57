"""sits.v1.Capture over a real grpc.aio server, with events published to the real broker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from services.capture.sources.replay import ReplaySource
from sits.runtime.clock import ManualClock
from sits.runtime.traces import TraceTarget, read_trace
from sits.v1 import capture_pb2, common_pb2, events_pb2
from sits_engine.oom_hook.hook import HookConfig, OomHook
from tests.capture.conftest import RunningCapture

TRACES = Path(__file__).resolve().parents[2] / "traces" / "h200"
GIB = 1 << 30


def oom_event(**overrides: object) -> events_pb2.OomEvent:
    event = events_pb2.OomEvent(requested_bytes=4 * GIB, device_free_bytes=GIB, device_total_bytes=140 * GIB, pid=7)
    event.meta.target.host = "h1"
    event.meta.target.gpu_uuid = "GPU-known"
    event.allocator.allocated_bytes = 100 * GIB
    event.allocator.reserved_bytes = 120 * GIB
    for name, value in overrides.items():
        setattr(event, name, value)
    return event


def nvml_sample(gpu: str, used: int) -> events_pb2.MetricSample:
    sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_NVML)
    sample.meta.target.host = "h1"
    sample.meta.target.gpu_uuid = gpu
    sample.gpu.used_bytes = used
    sample.gpu.total_bytes = 140 * GIB
    return sample


async def wait_for(predicate, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_report_oom_accepted_and_published(capture: RunningCapture) -> None:
    reply = await capture.stub.ReportOom(oom_event())
    assert len(reply.event_id) == 32
    await wait_for(lambda: capture.publisher.stats.published >= 1)
    assert capture.publisher.spool.pending == 0


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"requested_bytes": -5}, "requested_bytes must be positive, got -5"),
        ({"device_free_bytes": -1}, "device_free_bytes must not be negative"),
        ({"device_total_bytes": 0}, "device_total_bytes must be positive"),
        ({"device_free_bytes": 200 * GIB}, "exceeds device_total_bytes"),
        ({"requested_bytes": 1 << 60}, "is beyond any GPU"),
        ({"pid": -3}, "pid must not be negative"),
    ],
)
async def test_report_oom_refuses_absurd_fields(
    capture: RunningCapture, overrides: dict[str, object], reason: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await capture.stub.ReportOom(oom_event(**overrides))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in (err.value.details() or "")


async def test_report_oom_refuses_missing_and_unknown_targets(capture: RunningCapture) -> None:
    no_target = oom_event()
    no_target.ClearField("meta")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await capture.stub.ReportOom(no_target)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "meta.target is missing" in (err.value.details() or "")
    capture.service.ingest_sample(nvml_sample("GPU-known", GIB), "nvml")  # NVML now knows this host's GPUs
    anonymous = oom_event()
    anonymous.meta.target.gpu_uuid = ""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await capture.stub.ReportOom(anonymous)
    assert "names neither a GPU" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        event = oom_event()
        event.meta.target.gpu_uuid = "GPU-elsewhere"
        await capture.stub.ReportOom(event)
    assert "unknown target: GPU 'GPU-elsewhere'" in (err.value.details() or "")
    assert (await capture.stub.ReportOom(oom_event())).event_id


async def test_stream_filters_by_target_and_snapshot_merges(capture: RunningCapture) -> None:
    only_b = capture_pb2.TargetFilter(gpu_uuid="GPU-b")
    call = capture.stub.StreamSamples(capture_pb2.StreamSamplesRequest(filter=only_b))
    await wait_for(lambda: capture.service.fanout.subscribers == 1)
    for i in range(5):
        capture.service.ingest_sample(nvml_sample("GPU-a", i), "nvml")
        capture.service.ingest_sample(nvml_sample("GPU-b", 100 + i), "nvml")
    got = []
    async for sample in call:
        got.append(sample)
        if len(got) == 5:
            break
    call.cancel()
    assert [s.gpu.used_bytes for s in got] == [100, 101, 102, 103, 104]
    assert [s.sequence for s in got] == [2, 4, 6, 8, 10]  # one sequence per source, stamped before fan-out
    assert all(s.meta.target.gpu_uuid == "GPU-b" for s in got)

    engine = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_ENGINE)
    engine.meta.target.CopyFrom(common_pb2.Target(host="h1", gpu_uuid="GPU-b"))
    engine.engine.kv_cache_usage = 0.75
    capture.service.ingest_sample(engine, "vllm-grpc")
    snap = await capture.stub.GetSnapshot(capture_pb2.GetSnapshotRequest(target=common_pb2.Target(gpu_uuid="GPU-b")))
    assert snap.latest.gpu.used_bytes == 104 and snap.latest.engine.kv_cache_usage == 0.75

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await capture.stub.GetSnapshot(capture_pb2.GetSnapshotRequest(target=common_pb2.Target(gpu_uuid="GPU-z")))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("stream_buffer", [4])
async def test_slow_client_is_cut_with_resource_exhausted(capture: RunningCapture) -> None:
    call = capture.stub.StreamSamples(capture_pb2.StreamSamplesRequest())
    await wait_for(lambda: capture.service.fanout.subscribers == 1)
    for i in range(50):  # the client reads nothing meanwhile
        capture.service.ingest_sample(nvml_sample("GPU-a", i), "nvml")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await wait_for(lambda: capture.service.fanout.subscribers == 0)


async def test_replayed_h200_trace_flows_to_stream_and_kafka(capture: RunningCapture) -> None:
    clock = ManualClock()

    async def fast_sleep(seconds: float) -> None:
        clock.advance(seconds)
        await asyncio.sleep(0)

    trace = read_trace(TRACES / "linear_oom.jsonl.gz")
    source = ReplaySource(
        trace,
        speed=1.0,
        clock=clock,
        sleep=fast_sleep,
        target=TraceTarget(host="h1", gpu_uuid="GPU-replay", engine="vllm-0"),
    )
    capture.service.add_source(source)
    stop = asyncio.Event()
    await asyncio.wait_for(capture.service.run_source(source, stop), 20)
    samples = len(list(trace.samples()))
    assert source.emitted == len(trace.records)
    assert clock.monotonic() == pytest.approx(trace.duration_s, abs=0.01)
    await wait_for(lambda: capture.publisher.stats.published == len(trace.records))
    snap = capture.service.snapshot(common_pb2.Target(gpu_uuid="GPU-replay"))
    assert snap is not None and snap.latest.sequence == samples
    assert [h.source for h in snap.sources] == ["replay"]


async def test_oom_hook_reports_over_grpc_and_falls_back_to_spool(capture: RunningCapture, tmp_path: Path) -> None:
    stats = {
        "allocated_bytes": 9 * GIB,
        "reserved_bytes": 10 * GIB,
        "inactive_split_bytes": GIB,
        "alloc_retries": 2,
        "num_ooms": 1,
    }
    hook = OomHook(
        HookConfig(
            capture_addr=capture.server.address, spool_dir=str(tmp_path / "hook"), engine="vllm-0", report_timeout_s=2.0
        ),
        stats_reader=lambda _device: stats,
        gpu_uuid_of=lambda _device: "GPU-hook",
    )
    # PyTorch calls the observer with (device, requested, device total, device free).
    await asyncio.to_thread(hook.on_oom, 0, 3 * GIB, 140 * GIB, GIB)
    await asyncio.to_thread(hook.wait_idle, 10)
    assert len(hook.reported) == 1 and hook.spooled == []
    await wait_for(lambda: capture.publisher.stats.published >= 1)

    unreachable = OomHook(
        HookConfig(capture_addr="127.0.0.1:1", spool_dir=str(tmp_path / "hook"), report_timeout_s=0.2),
        stats_reader=lambda _device: stats,
        gpu_uuid_of=lambda _device: "GPU-hook",
    )
    await asyncio.to_thread(unreachable.on_oom, 0, 5 * GIB, 140 * GIB, GIB)
    await asyncio.to_thread(unreachable.wait_idle, 10)
    assert len(unreachable.spooled) == 1
    assert capture.service.ingest_hook_spool(tmp_path / "hook") == 1
    assert list((tmp_path / "hook").iterdir()) == []
    await wait_for(lambda: capture.publisher.stats.published >= 2)
