"""The sources a capture reads, as its settings name them."""

from __future__ import annotations

from services.capture.settings import CaptureSettings
from services.capture.sources.base import Source
from services.capture.sources.engine_control import EngineControlSource
from services.capture.sources.nvml import NvmlSource
from services.capture.sources.nvml_reader import NvmlReader
from services.capture.sources.replay import ReplaySource
from services.capture.sources.vllm_grpc import VllmGrpcSource
from services.capture.sources.vllm_metrics import VllmMetricsSource
from sits.runtime.traces import TraceTarget
from sits.v1 import common_pb2


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
