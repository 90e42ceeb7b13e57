"""capture, with its NVML samples tagged with the engine that runs on the sampled GPU.

The decision service keeps one window per target (host, GPU, MIG instance,
engine) and its limit actions go to `target.engine`. capture's vLLM source tags
engine samples with `SITS_ENGINE_NAME`; its wiring (`services/capture/main.py`)
builds the NVML source without an engine, so GPU memory and engine load land
in two windows and a memory forecast names no engine the executor knows. On
this one-GPU, one-engine host every NVML sample belongs to that engine; this
wrapper sets it and otherwise runs capture unchanged. It does nothing once
capture tags the samples itself.
"""

from __future__ import annotations

import sys

from services.capture import main as capture_main
from services.capture.settings import CaptureSettings
from services.capture.sources.base import Source
from services.capture.sources.nvml import NvmlSource

_build_sources = capture_main.build_sources


def build_sources(settings: CaptureSettings) -> list[Source]:
    sources = _build_sources(settings)
    for source in sources:
        if isinstance(source, NvmlSource) and not getattr(source, "_engine", "") and settings.engine_name:
            source._engine = settings.engine_name
    return sources


if __name__ == "__main__":
    capture_main.build_sources = build_sources
    sys.exit(capture_main.main())
