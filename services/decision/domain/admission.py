"""Does one request fit the engine now? A few lookups and some arithmetic.

The mesh asks this for every request, so it must answer in microseconds: it
reads only the engine's latest KV block figures and the engine's profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.decision.domain.kv_model import ModelShape
from services.decision.domain.types import AllocatorStats, EngineLoad, GpuMemory
from sits.runtime.contract import Tier

GIB = 1024**3
MAX_REQUEST_TOKENS = 100_000_000


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What the decision service knows of an engine's model, to turn tokens into bytes."""

    shape: ModelShape
    kv_dtype_bytes: int = 2
    tp: int = 1
    max_model_len: int | None = None
    act_dtype_bytes: int = 2
    # vLLM's V2 GPU model runner (0.26 on) computes prompt logprobs 1024 tokens at a time
    # (vllm/v1/worker/gpu/sample/prompt_logprob.py); 0: over the whole step (the V1 runner).
    prompt_logprobs_chunk_tokens: int = 1024

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token(self.kv_dtype_bytes, self.tp)


@dataclass(frozen=True, slots=True)
class AdmitDecision:
    admitted: bool
    reason: str
    kv_bytes_needed: int = 0
    kv_bytes_free: int = 0


def check_request(prompt_tokens: int, max_tokens: int, prompt_logprobs: int = 0) -> None:
    if prompt_tokens <= 0:
        raise ValueError("prompt_tokens must be positive")
    if max_tokens < 0:
        raise ValueError("max_tokens must not be negative")
    if prompt_logprobs < -1:
        raise ValueError("prompt_logprobs must be -1 (the whole vocabulary), 0 (none) or a positive count")
    if prompt_tokens + max_tokens > MAX_REQUEST_TOKENS:
        raise ValueError(f"prompt_tokens + max_tokens must be at most {MAX_REQUEST_TOKENS}")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def device_headroom(gpu: GpuMemory | None, allocator: AllocatorStats | None) -> int | None:
    """Bytes a step's transients can still get: free on the device plus what the allocator caches.

    Cached means reserved beyond what lives between steps (weights, KV, buffers); None when no
    source reported device memory.
    """
    if allocator is not None and allocator.device_free_bytes > 0:
        floor = allocator.allocated_floor_bytes or allocator.allocated_bytes
        return allocator.device_free_bytes + max(0, allocator.reserved_bytes - floor)
    if gpu is not None and gpu.total_bytes > 0:
        return gpu.free_bytes or max(0, gpu.total_bytes - gpu.used_bytes)
    return None


def _prompt_logprobs_refusal(
    prompt_tokens: int, engine: EngineLoad | None, profile: EngineProfile, headroom: int
) -> AdmitDecision | None:
    """A refusal when the logits of one prefill chunk would not fit the device; any tier (it would kill the engine)."""
    budget = (engine.token_budget or engine.max_num_batched_tokens) if engine is not None else 0
    limits = [n for n in (prompt_tokens, budget, profile.prompt_logprobs_chunk_tokens) if n > 0]
    chunk = min(limits)
    needed = profile.shape.prompt_logprobs_bytes(chunk, profile.act_dtype_bytes)
    if needed <= headroom:
        return None
    return AdmitDecision(
        False,
        f"prompt_logprobs over a {chunk}-token prefill chunk needs {_gib(needed)} of logits "
        f"({profile.shape.vocab_size} vocabulary entries per token) and the device has {_gib(headroom)} left; "
        "ask without prompt_logprobs or with a shorter prompt",
    )


def decide(
    prompt_tokens: int,
    max_tokens: int,
    priority: Tier | None,
    engine: EngineLoad | None,
    profile: EngineProfile | None,
    memory_at_limit: bool,
    p0_reserved_kv_fraction: float = 0.0,
    *,
    prompt_logprobs: int = 0,
    headroom_bytes: int | None = None,
) -> AdmitDecision:
    """Admit or refuse one request by the KV it needs, by tier.

    A request that needs more blocks than the whole cache holds can never run: refused, any tier.
    P0 may take the blocks lower tiers hold (the SITS scheduler preempts them for it), so it is
    refused only when its own request does not fit in what is free plus what they hold. P1 and P2
    are kept out of a share of the cache reserved for P0 (`p0_reserved_kv_fraction`).
    A request with prompt_logprobs is also refused, any tier, when the logits of one of its prefill
    steps would not fit the device's `headroom_bytes` (see `device_headroom`).
    """
    check_request(prompt_tokens, max_tokens, prompt_logprobs)
    tokens = prompt_tokens + max_tokens
    per_token = profile.kv_bytes_per_token if profile is not None else 0
    needed = tokens * per_token
    is_p0 = priority is Tier.P0
    if profile is not None and profile.max_model_len is not None and tokens > profile.max_model_len:
        return AdmitDecision(
            False,
            f"the request needs {tokens} tokens and the engine's max model length is {profile.max_model_len}",
            needed,
            0,
        )
    if prompt_logprobs and profile is not None and headroom_bytes is not None:
        refused = _prompt_logprobs_refusal(prompt_tokens, engine, profile, headroom_bytes)
        if refused is not None:
            return refused
    if engine is None or engine.kv_blocks_total <= 0 or engine.block_size <= 0:
        if memory_at_limit and not is_p0:
            return AdmitDecision(False, "device memory is at the policy's limit; only P0 is admitted", needed, 0)
        return AdmitDecision(True, "no KV block figures for this engine yet; admitted", needed, 0)
    block = engine.block_size
    total_blocks = engine.kv_blocks_total
    free_blocks = total_blocks - engine.kv_blocks_used
    need_blocks = -(-tokens // block)

    def refuse(what: str, available_blocks: int) -> AdmitDecision:
        available = available_blocks * block * per_token
        if per_token:
            reason = (
                f"the request needs {_gib(needed)} of KV ({tokens} tokens) and {what} holds "
                f"{_gib(available)} ({available_blocks * block} tokens)"
            )
        else:
            reason = f"the request needs {need_blocks} KV blocks ({tokens} tokens) and {what} holds {available_blocks}"
        return AdmitDecision(False, reason, needed, free_blocks * block * per_token)

    if need_blocks > total_blocks:
        return refuse("the engine's whole KV cache", total_blocks)
    free = free_blocks * block * per_token
    if is_p0:
        lower_held = sum(t.kv_blocks for t in engine.tiers if t.tier > 0)
        available_blocks = free_blocks + lower_held
        if need_blocks > available_blocks:
            return refuse("what is free plus what lower tiers hold", available_blocks)
        return AdmitDecision(True, f"fits: {need_blocks} of {available_blocks} KV blocks P0 can use", needed, free)
    reserve = math.ceil(p0_reserved_kv_fraction * total_blocks)
    available_blocks = max(0, free_blocks - reserve)
    if need_blocks > available_blocks:
        what = f"free KV beyond the {reserve} blocks reserved for P0" if reserve else "free KV"
        return refuse(what, available_blocks)
    if memory_at_limit:
        return AdmitDecision(False, "device memory is at the policy's limit; only P0 is admitted", needed, free)
    return AdmitDecision(True, f"fits: {need_blocks} of {available_blocks} free KV blocks", needed, free)
