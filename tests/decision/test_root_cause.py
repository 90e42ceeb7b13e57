"""One synthetic window per cause; each must be recognised, and not taken for another."""

from collections.abc import Callable

import pytest

from services.decision.domain.root_cause import classify
from services.decision.domain.types import AllocatorStats, EngineLoad, ProcessMemory, RootCauseKind, Sample
from tests.decision.decision_builders import GIB, TOTAL, make_sample

N = 90


def _own(used: float) -> ProcessMemory:
    return ProcessMemory(100, int(used), "vllm", True)


def kv_growth() -> list[Sample]:
    out = []
    for i in range(N):
        tokens = 10_000 + 1_000 * i
        allocated = 60 * GIB + tokens * 131072
        alloc = AllocatorStats(int(allocated), int(allocated + 2 * GIB), 0)
        out.append(
            make_sample(
                i * 0.5,
                (allocated + 3 * GIB) / TOTAL,
                allocator=alloc,
                engine=EngineLoad(kv_cache_usage=0.3 + 0.007 * i, tokens_in_flight=tokens),
                processes=(_own(allocated + 3 * GIB),),
            )
        )
    return out


def adapter_leak() -> list[Sample]:
    out = []
    for i in range(N):
        adapters = min(i // 10, 6) if i < 60 else 1
        allocated = 50 * GIB + min(i // 10, 6) * GIB  # memory stays after the unload at i = 60
        alloc = AllocatorStats(int(allocated), int(allocated + GIB), 0)
        out.append(
            make_sample(
                i * 0.5,
                (allocated + 2 * GIB) / TOTAL,
                allocator=alloc,
                engine=EngineLoad(kv_cache_usage=0.4, tokens_in_flight=5000, lora_adapters_loaded=adapters),
                processes=(_own(allocated + 2 * GIB),),
            )
        )
    return out


def collective_growth() -> list[Sample]:
    out = []
    for i in range(N):
        reserved = 70 * GIB
        outside = 1 * GIB + i * 0.2 * GIB  # NCCL buffers: NVML sees them, the allocator does not
        alloc = AllocatorStats(int(reserved - 2 * GIB), int(reserved), int(0.5 * GIB))
        own = reserved + outside
        out.append(
            make_sample(
                i * 0.5,
                own / TOTAL,
                allocator=alloc,
                processes=(_own(own),),
                engine=EngineLoad(kv_cache_usage=0.5, tokens_in_flight=20_000),
            )
        )
    return out


def fragmentation() -> list[Sample]:
    out = []
    for i in range(N):
        reserved = 80 * GIB
        allocated = 40 * GIB + (i % 5) * GIB
        alloc = AllocatorStats(int(allocated), int(reserved), int(25 * GIB))
        out.append(
            make_sample(
                i * 0.5,
                (reserved + GIB) / TOTAL,
                allocator=alloc,
                processes=(_own(reserved + GIB),),
                engine=EngineLoad(kv_cache_usage=0.5, tokens_in_flight=20_000),
            )
        )
    return out


def contention() -> list[Sample]:
    out = []
    for i in range(N):
        own = 60 * GIB
        other = 5 * GIB + i * 0.5 * GIB
        alloc = AllocatorStats(int(own - 3 * GIB), int(own - GIB), 0)
        out.append(
            make_sample(
                i * 0.5,
                (own + other) / TOTAL,
                allocator=alloc,
                processes=(_own(own), ProcessMemory(200, int(other), "trainer", False)),
                engine=EngineLoad(kv_cache_usage=0.5, tokens_in_flight=20_000),
            )
        )
    return out


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        (kv_growth, RootCauseKind.LONG_CONTEXT_KV_GROWTH),
        (adapter_leak, RootCauseKind.ADAPTER_LEAK),
        (collective_growth, RootCauseKind.COLLECTIVE_BUFFER_GROWTH),
        (fragmentation, RootCauseKind.FRAGMENTATION),
        (contention, RootCauseKind.MULTI_TENANT_CONTENTION),
    ],
)
def test_each_cause_is_recognised_with_evidence(window: Callable[[], list[Sample]], expected: RootCauseKind) -> None:
    cause = classify(window(), kv_bytes_per_token=131072)
    assert cause.kind is expected
    assert cause.confidence >= 0.5
    assert cause.evidence


def test_collective_growth_is_not_taken_for_fragmentation_or_kv_growth() -> None:
    cause = classify(collective_growth())
    assert cause.kind is RootCauseKind.COLLECTIVE_BUFFER_GROWTH
    assert [e.name for e in cause.evidence] == ["outside_allocator_rise_bytes"]


def test_a_quiet_window_has_no_cause() -> None:
    quiet = [
        make_sample(
            i * 0.5,
            0.5,
            allocator=AllocatorStats(60 * GIB, 62 * GIB, 0),
            engine=EngineLoad(kv_cache_usage=0.5, tokens_in_flight=1000),
        )
        for i in range(N)
    ]
    assert classify(quiet).kind is RootCauseKind.NONE
    assert classify([]).kind is RootCauseKind.NONE
