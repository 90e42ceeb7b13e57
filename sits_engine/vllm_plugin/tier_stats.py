"""Per-tier queueing statistics the SITS scheduler keeps inside the engine.

Pure bookkeeping (no vLLM import), fed by the scheduler at each step and read
by the control endpoint. These are the controller's signals: they do not depend
on how fast the machine is, only on whether a tier waits.

- queue wait: arrival (the frontend's wall clock) to the first step that
  scheduled the request, kept for the last `window_s` seconds (at most
  `max_samples` per tier), reported as p50/p90;
- counters since start: requests first scheduled, preemptions suffered.
Waiting counts, the oldest waiting age and KV held are read from the
scheduler's queues when a snapshot is taken, not kept here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sits.runtime.contract import ALL_TIERS


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of unsorted values (0.0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass(slots=True)
class _TierCounters:
    waits: deque[tuple[float, float]]
    scheduled: int = 0
    preemptions: int = 0


@dataclass
class TierStats:
    # Short enough that a change's settle window (3 s at least) is judged on waits after it.
    window_s: float = 3.0
    max_samples: int = 256
    _tiers: dict[int, _TierCounters] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._tiers = {int(tier): _TierCounters(deque(maxlen=self.max_samples)) for tier in ALL_TIERS}

    def first_scheduled(self, tier: int, now: float, arrival: float) -> None:
        counters = self._tiers[tier]
        counters.scheduled += 1
        counters.waits.append((now, max(0.0, now - arrival)))

    def preempted(self, tier: int) -> None:
        self._tiers[tier].preemptions += 1

    def snapshot(self, now: float) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        horizon = now - self.window_s
        for tier, counters in self._tiers.items():
            recent = [wait for at, wait in counters.waits if at >= horizon]
            out[tier] = {
                "queue_wait_p50_s": quantile(recent, 0.5),
                "queue_wait_p90_s": quantile(recent, 0.9),
                "queue_wait_samples": float(len(recent)),
                "scheduled": float(counters.scheduled),
                "preemptions": float(counters.preemptions),
            }
        return out
