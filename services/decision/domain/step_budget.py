"""The token budget of one engine step that fits the memory left: the lever real vLLM dies by.

vLLM keeps its KV pool full by design and sizes it at start; what kills it is the forward
pass's transient memory, linear in the tokens of one step (FACTS.md, H200: a Llama-3-8B shape
allocates ~108 KiB per prefill token; at large steps the device gives ~155 KiB per token because
of the caching allocator's rounding). A step at token budget B needs

    need(B) = allocator_overhead x activation_bytes(B)        (the estimator's activation model)

and may use what the device has free (NVML) plus what the engine's own allocator holds and does
not use between steps (reserved - allocated floor, from the SITS plugin), less a reserve. The
ratio headroom / need(live budget) below 1 means the next full step can die; the budget that
fits is the largest whose need is `fill` of the headroom, rounded down, never below
`min_tokens` nor above the engine's start-up budget.

Pure arithmetic over the domain types; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.decision.domain.admission import EngineProfile
from services.decision.domain.types import AllocatorStats, EngineLoad, GpuMemory

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class StepBudgetTerms:
    """The policy's `step_budget` block, as plain data."""

    min_tokens: int = 512
    reserve_bytes: int = 256 * MIB
    allocator_overhead: float = 1.45
    fill: float = 0.8
    multiple_of: int = 256


@dataclass(frozen=True, slots=True)
class StepMemory:
    """What one step of an engine needs and may use, now."""

    live_budget: int
    ceiling: int
    headroom_bytes: int
    # need(tokens) = per_token_bytes x tokens + fixed_bytes (device bytes, overhead included)
    per_token_bytes: float
    fixed_bytes: int
    device_used_bytes: int
    device_total_bytes: int
    # What the engine's allocator holds that the next step can reuse without asking the device.
    reusable_bytes: int
    # The engine's own device memory (NVML, its processes); 0: not reported.
    engine_used_bytes: int = 0

    def need(self, tokens: int) -> int:
        return math.ceil(self.per_token_bytes * tokens) + self.fixed_bytes

    @property
    def need_live_bytes(self) -> int:
        return self.need(self.live_budget)

    @property
    def ratio(self) -> float:
        """Headroom over the need of a full step at the live budget (below 1: it may not fit)."""
        need = self.need_live_bytes
        return math.inf if need <= 0 else self.headroom_bytes / need

    def fitted(self, terms: StepBudgetTerms) -> int:
        """The largest budget whose step needs at most `fill` of the headroom, within the engine's bounds."""
        room = terms.fill * self.headroom_bytes - self.fixed_bytes
        tokens = int(room // self.per_token_bytes) if room > 0 else 0
        step = max(1, terms.multiple_of)
        tokens -= tokens % step
        floor = min(terms.min_tokens, self.ceiling)
        return max(floor, min(self.ceiling, tokens))

    def device_fraction_after(self, budget: int, terms: StepBudgetTerms) -> float:
        """Device memory (a fraction) once a full step at `budget` runs, plus the reserve: what a
        budget change promises the validator (judged on NVML samples)."""
        if self.device_total_bytes <= 0:
            return 1.0
        extra = max(0, self.need(budget) - self.reusable_bytes)
        used = self.device_used_bytes + extra + terms.reserve_bytes
        return min(1.0, used / self.device_total_bytes)

    def engine_bytes_after(self, budget: int, terms: StepBudgetTerms) -> int | None:
        """The most the engine's own device memory may reach once a step at `budget` runs: its memory
        now, plus one full step, plus the reserve; None when the engine's processes are not reported.

        What a cut promises: other tenants may still fill the device, which no budget of this engine
        can prevent. The allocator's cache is not credited here as it is in the fit: a fragmented
        cache may not serve the step (seen on the H100, 2026-12-06: the engine grew 360 MiB with
        6.1 GiB cached beyond its floor), and only an engine that ran a step larger than the new
        budget grows by more than one such step.
        """
        if self.engine_used_bytes <= 0:
            return None
        return self.engine_used_bytes + self.need(budget) + terms.reserve_bytes


def step_memory(
    gpu: GpuMemory | None,
    engine: EngineLoad | None,
    allocator: AllocatorStats | None,
    profile: EngineProfile | None,
    terms: StepBudgetTerms,
    engine_used_bytes: int = 0,
) -> StepMemory | None:
    """The engine's step memory, or None when a figure it needs is unknown (then no rule acts on it)."""
    if gpu is None or engine is None or profile is None or gpu.total_bytes <= 0:
        return None
    ceiling = engine.max_num_batched_tokens
    live = engine.token_budget or ceiling
    if ceiling <= 0 or live <= 0:
        return None
    free = gpu.free_bytes if gpu.free_bytes > 0 else max(0, gpu.total_bytes - gpu.used_bytes)
    reusable = 0
    if allocator is not None and allocator.allocated_floor_bytes > 0:
        reusable = max(0, allocator.reserved_bytes - allocator.allocated_floor_bytes)
        if allocator.device_free_bytes > 0:
            # Free and reusable from one snapshot (the plugin reads both at once): NVML's free memory,
            # sampled at another moment, would count the engine's own growth between the two as lost
            # headroom, and cut a budget that fits.
            free = allocator.device_free_bytes
    shape = profile.shape
    # Logits for every sequence a step may carry, at most one per token of the budget.
    batch = max(1, min(engine.max_num_seqs or 1, ceiling))
    act_bytes = 2  # bf16/fp16 activations
    fixed = shape.activation_bytes(0, batch, act_bytes, profile.tp)
    per_token = (shape.activation_bytes(ceiling, batch, act_bytes, profile.tp) - fixed) / ceiling
    overhead = max(1.0, terms.allocator_overhead)
    return StepMemory(
        live_budget=live,
        ceiling=ceiling,
        headroom_bytes=max(0, free + reusable - terms.reserve_bytes),
        per_token_bytes=per_token * overhead,
        fixed_bytes=math.ceil(fixed * overhead),
        device_used_bytes=gpu.used_bytes,
        device_total_bytes=gpu.total_bytes,
        reusable_bytes=reusable,
        engine_used_bytes=engine_used_bytes,
    )
