"""Builders for decision-service tests (imported as a plain module; tests/ has no packages)."""

from __future__ import annotations

from pathlib import Path

from services.decision.domain.types import AllocatorStats, EngineLoad, GpuMemory, ProcessMemory, Sample, Target

GIB = 1024**3
TOTAL = 140 * GIB
TARGET = Target("host-a", "GPU-0", "", "vllm-0")
DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "services" / "decision" / "default_policy.yaml"


def make_sample(
    t: float,
    used_fraction: float | None = None,
    *,
    seq: int = 0,
    event_id: str = "",
    target: Target = TARGET,
    engine: EngineLoad | None = None,
    allocator: AllocatorStats | None = None,
    processes: tuple[ProcessMemory, ...] = (),
    total: int = TOTAL,
) -> Sample:
    gpu = None
    if used_fraction is not None:
        used = int(used_fraction * total)
        gpu = GpuMemory(used, total, 0, total - used, 50.0)
    return Sample(
        target=target,
        t=t,
        event_id=event_id,
        source="test",
        sequence=seq,
        gpu=gpu,
        processes=processes,
        engine=engine,
        allocator=allocator,
    )
