"""What each scenario does, and how big its squeeze is: pure data and arithmetic, no I/O.

Two causes of death, each a known failure of the field (docs/h200_oom_prevention.md):

- `cotenant_steps`: a co-tenant on the same GPU (a training job, a second server) grows in
  steps while long prompts keep arriving. vLLM sized its KV pool at start and holds it; its
  caching allocator keeps the activation memory of the largest step it has run. When a larger
  step comes (a cluster of long prompts) after the co-tenant took the rest of the device, the
  forward pass asks the device for more and dies (FACTS.md, "How it dies").
- `long_burst`: the device is flat: a second tenant arrived a while ago and holds its memory;
  the engine serves short chat prompts at its large step budget (steps of a few thousand
  tokens); then a burst of long prompts (a batch job) fills a whole step. No memory trend
  precedes it: only the step's activation need against what is left says it will not fit.

The squeeze leaves the engine `leave_bytes` of headroom after the co-tenant's plateau: free
device memory plus what its caching allocator holds beyond its floor (PyTorch gives that back
and retries before it raises an OOM, so it counts). That is half of what a full step at the
engine's start-up budget allocates (it dies) and more than a step of a fitted budget needs with
the allocator's overhead (it lives), sized from the estimator's activation model.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from services.decision.domain.kv_model import ModelShape

GIB = 1 << 30
# Device bytes per allocated activation byte at large steps (FACTS.md: 155 / 108 KiB per token).
ALLOCATOR_OVERHEAD = 1.45
TIERS = ("p0", "p1", "p2")


@dataclass(frozen=True)
class Arrival:
    t: float
    tier: str
    prompt_tokens: int
    max_tokens: int
    kind: str


@dataclass(frozen=True)
class Squeeze:
    """The co-tenant: from `start_s`, `steps` equal steps every `period_s` until `leave_bytes` are free."""

    start_s: float
    period_s: float
    steps: int
    leave_bytes: int


@dataclass(frozen=True)
class ScenarioPlan:
    name: str
    cause: str
    arrivals: tuple[Arrival, ...]
    squeeze: Squeeze
    load_s: float
    # When the step that cannot fit is due (the cluster or burst arrives): the would-be death.
    trigger_s: float
    notes: dict[str, float] = field(default_factory=dict)

    @property
    def submitted(self) -> int:
        return len(self.arrivals)


def step_need_bytes(shape: ModelShape, tokens: int, max_num_seqs: int) -> int:
    """What a full step of `tokens` asks of the device: the estimator's activations x the allocator's overhead."""
    return math.ceil(ALLOCATOR_OVERHEAD * shape.activation_bytes(tokens, min(max_num_seqs, tokens), 2))


def leave_bytes(shape: ModelShape, budget: int, max_num_seqs: int, floor: int = GIB) -> int:
    """The engine's headroom after the squeeze: half of what a full step at the start-up budget allocates.

    Half of the allocated bytes, not of the device bytes with the allocator's overhead: the
    headroom counts the allocator's cache, which a failing allocation empties and retries with
    (0.55 x the device need, left free, let the full steps of the re-runs of 2026-12-04 to 12-06
    run from the cache: docs/h200_oom_prevention.md).
    """
    return max(floor, int(0.5 * shape.activation_bytes(budget, min(max_num_seqs, budget), 2)))


def choose_utilization(total: int, weights: int) -> float:
    """The engine's gpu_memory_utilization on this GPU: 0.45 on a large one (as measured on the H200),
    else just enough for the weights plus 12 GiB (KV cache, activations, CUDA context)."""
    if total >= 100 * GIB:
        return 0.45
    return math.ceil(100 * (weights + 12 * GIB) / total) / 100


def check_device(total: int, free: int, utilization: float, weights: int) -> str | None:
    """Why this GPU cannot host the scenario, or None. Leaves other processes' memory alone: it only reads."""
    engine = int(total * utilization)
    if utilization > 0.9:
        return (
            f"a GPU of {total / GIB:.0f} GiB is too small for this shape ({weights / GIB:.1f} GiB of weights, "
            "the engine and a co-tenant beside it): pick a smaller --shape or a larger GPU"
        )
    if free < engine + 4 * GIB:
        return (
            f"the GPU has {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB; the engine takes "
            f"{engine / GIB:.1f} GiB (gpu_memory_utilization {utilization}) and the co-tenant needs at "
            "least 4 GiB more: free memory (stop other GPU work) or lower --gpu-memory-utilization"
        )
    if weights > 0.8 * engine:
        return (
            f"the model's weights ({weights / GIB:.1f} GiB) leave too little KV cache in "
            f"{engine / GIB:.1f} GiB: raise --gpu-memory-utilization or pick a smaller --shape"
        )
    return None


def _prompt_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def prompt_for(arrival: Arrival, index: int, vocab: int, seed: int = 0) -> list[int]:
    """A prompt of random ids, different for every request (no prefix-cache hits shrink a step)."""
    return _prompt_ids(random.Random(seed * 1_000_003 + index), arrival.prompt_tokens, vocab)


def _chat_tokens(budget: int, tokens: int) -> int:
    """A chat prompt of `tokens` at a 32k step budget, scaled down for small engines (the CPU rehearsal)."""
    return max(8, min(tokens, tokens * budget // 32768))


def cotenant_steps(budget: int, leave: int, *, long_tokens: int | None = None) -> ScenarioPlan:
    long = long_tokens or max(256, (budget * 3 // 16) // 256 * 256)
    cluster = math.ceil(1.5 * budget / long)
    chat = _chat_tokens(budget, 512)
    arrivals: list[Arrival] = []
    load_s = 24.0
    t = 0.0
    while t < load_s:
        arrivals.append(Arrival(round(t, 3), "p0", chat, 32, "chat"))
        t += 0.5
    t = 0.25
    while t < load_s:
        arrivals.append(Arrival(round(t, 3), "p1", long, 32, "long"))
        t += 1.0
    trigger = 16.0
    arrivals += [Arrival(trigger, "p2", long, 32, "cluster") for _ in range(cluster)]
    arrivals.sort(key=lambda a: a.t)
    return ScenarioPlan(
        name="cotenant_steps",
        cause="a co-tenant grows in steps while long prompts keep arriving; a cluster of them fills a step",
        arrivals=tuple(arrivals),
        squeeze=Squeeze(start_s=4.0, period_s=1.0, steps=8, leave_bytes=leave),
        load_s=load_s,
        trigger_s=trigger,
        notes={"long_prompt_tokens": long, "cluster_prompts": cluster},
    )


def long_burst(budget: int, leave: int, *, long_tokens: int | None = None) -> ScenarioPlan:
    long = long_tokens or max(256, (budget // 4) // 256 * 256)
    burst = math.ceil(3 * budget / long)
    arrivals: list[Arrival] = []
    load_s = 22.0
    t = 0.0
    i = 0
    while t < load_s:
        arrivals.append(Arrival(round(t, 3), "p0", _chat_tokens(budget, (256, 512, 1024)[i % 3]), 64, "chat"))
        t += 0.25
        i += 1
    t = 0.1
    while t < load_s:
        arrivals.append(Arrival(round(t, 3), "p1", _chat_tokens(budget, 1024), 128, "chat"))
        t += 0.5
    trigger = 14.0
    arrivals += [Arrival(trigger, "p2", long, 32, "burst") for _ in range(burst)]
    arrivals.sort(key=lambda a: a.t)
    return ScenarioPlan(
        name="long_burst",
        cause="a burst of long prompts at a large step budget, the device flat since a co-tenant arrived",
        arrivals=tuple(arrivals),
        squeeze=Squeeze(start_s=3.0, period_s=1.0, steps=1, leave_bytes=leave),
        load_s=load_s,
        trigger_s=trigger,
        notes={"long_prompt_tokens": long, "burst_prompts": burst},
    )


PLANS = {"cotenant_steps": cotenant_steps, "long_burst": long_burst}
