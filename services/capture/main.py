"""Wiring of the capture service: settings, sources, spool, Kafka publisher, gRPC.

Run: `python -m services.capture.main` (or the CLI's capture subcommand).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from services.capture.grpc_api import MUTATING_METHODS, binding
from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.service import CaptureService
from services.capture.settings import CaptureSettings
from services.capture.sources.base import Source
from services.capture.sources.engine_control import EngineControlSource
from services.capture.sources.nvml import NvmlSource
from services.capture.sources.nvml_reader import NvmlReader
from services.capture.sources.replay import ReplaySource
from services.capture.sources.vllm_grpc import VllmGrpcSource
from services.capture.sources.vllm_metrics import VllmMetricsSource
from services.capture.spool import Spool
from services.capture.traces import TraceTarget
from sits.runtime.clock import SystemClock
from sits.runtime.events import Topics
from sits.runtime.grpc_tls import server_credentials
from sits.runtime.grpcserver import GrpcServer, read_token
from sits.runtime.lifecycle import run_service
from sits.runtime.metrics import serve_metrics
from sits.v1 import common_pb2

SETTINGS = CaptureSettings


def build_sources(settings: CaptureSettings) -> list[Source]:
    engine_target = common_pb2.Target(
        host=settings.host_name, gpu_uuid=settings.capture_engine_gpu_uuid, engine=settings.capture_engine_name
    )
    sources: list[Source] = []
    if settings.nvml_enabled:
        sources.append(
            NvmlSource(
                hz=settings.nvml_hz,
                reader=NvmlReader(include_processes=settings.nvml_processes),
                host=settings.host_name,
                # One capture per engine host: GPU samples are about the engine that runs there, so the
                # decision sees memory and engine load in one window and names an engine it can act on.
                engine=settings.capture_engine_name,
                engine_pids=frozenset(settings.capture_engine_pids),
            )
        )
    if settings.vllm_grpc_addr:
        sources.append(
            VllmGrpcSource(
                settings.vllm_grpc_addr,
                engine_target,
                interval_s=settings.vllm_loads_interval_s,
                timeout_s=settings.vllm_timeout_s,
                kv_events=settings.vllm_kv_events,
            )
        )
    if settings.engine_control_addr:
        sources.append(
            EngineControlSource(
                settings.engine_control_addr,
                engine_target,
                interval_s=settings.engine_control_interval_s,
                timeout_s=settings.vllm_timeout_s,
            )
        )
    if settings.vllm_metrics_url:
        sources.append(
            VllmMetricsSource(
                settings.vllm_metrics_url,
                engine_target,
                interval_s=settings.vllm_metrics_interval_s,
                timeout_s=settings.vllm_timeout_s,
            )
        )
    if settings.replay_trace is not None:
        as_engine = TraceTarget(settings.host_name, settings.capture_engine_gpu_uuid, "", settings.capture_engine_name)
        sources.append(
            ReplaySource(
                settings.replay_trace,
                speed=settings.replay_speed,
                loop=settings.replay_loop,
                target=as_engine if settings.replay_as_engine else None,
            )
        )
    return sources


async def serve(settings: CaptureSettings, stop: asyncio.Event) -> None:
    serve_metrics(settings.metrics_port, settings.metrics_bind)
    spool = Spool(
        settings.capture_spool_dir,
        max_bytes=settings.capture_spool_max_bytes,
        fsync=settings.capture_spool_fsync,
        fsync_interval_s=settings.capture_spool_fsync_interval_s,
    )
    publisher = CapturePublisher(
        lambda: TopicEnsuringProducer(settings),
        spool,
        Topics(settings.topic_prefix),
        batch_size=settings.capture_publish_batch,
        trace_samples_above=settings.capture_trace_samples_above,
    )
    service = CaptureService(
        publisher,
        SystemClock(),
        stream_buffer=settings.capture_stream_buffer,
        max_targets=settings.capture_max_targets,
    )
    for source in build_sources(settings):
        service.add_source(source)
    try:
        async with (
            GrpcServer(
                [binding(service)],
                bind=settings.grpc_bind,
                port=settings.port_of(settings.capture_addr),
                token=read_token(settings.auth_token_file),
                mutating_methods=MUTATING_METHODS,
                max_message_bytes=settings.grpc_max_message_bytes,
                credentials=server_credentials(settings),
            ),
            asyncio.TaskGroup() as tasks,
        ):
            tasks.create_task(publisher.run(stop))
            tasks.create_task(service.export_health(stop))
            source_tasks = [tasks.create_task(service.run_source(s, stop)) for s in service.sources.values()]
            if settings.oom_hook_spool_dir is not None:
                tasks.create_task(
                    service.watch_hook_spool(settings.oom_hook_spool_dir, settings.oom_hook_spool_scan_s, stop)
                )
            await stop.wait()
            # Sources wait on their own clocks and streams; cancelling them is how they stop.
            for task in source_tasks:
                task.cancel()
    finally:
        with contextlib.suppress(Exception):
            spool.close()


def main() -> int:
    return run_service("capture", CaptureSettings, serve)


if __name__ == "__main__":
    sys.exit(main())
