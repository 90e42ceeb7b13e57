"""Builders for decision-service tests (imported as a plain module; tests/ has no packages)."""

from __future__ import annotations

from pathlib import Path

from services.decision.domain.types import AllocatorStats, EngineLoad, GpuMemory, ProcessMemory, Sample, Target

GIB = 1024**3
TOTAL = 140 * GIB
TARGET = Target("host-a", "GPU-0", "", "vllm-0")
DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "services" / "decision" / "default_policy.yaml"
# A latching rule with an undo, to exercise the rule machinery (latch, hysteresis, cooldown, on_clear). The
# default policy no longer sheds on KV usage: vLLM keeps its cache full by design, and the controller
# steers lower tiers by P0's queue wait instead.
KV_SHED_RULE = """
  - name: kv-usage-shed-p2
    description: The KV cache is more than 92% used; open the P2 breaker in the data path.
    when:
      kv_usage_above: 0.92
    then:
      - kind: SHED_PRIORITY
        priority: P2
        state: OPEN
        max_requests: 0
        ttl_seconds: 30
    on_clear:
      - kind: SHED_PRIORITY
        priority: P2
        state: CLOSED
"""


def rules_policy_text() -> str:
    """The default policy with the KV shed rule placed before the fragmentation rule (as it once was)."""
    text = DEFAULT_POLICY.read_text()
    marker = "  - name: fragmentation-cap-prefill"
    return text.replace(marker, KV_SHED_RULE.lstrip("\n") + "\n" + marker)


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
