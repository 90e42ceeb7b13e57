"""Does one request fit the engine now? A few lookups and some arithmetic.

The mesh asks this for every request, so it must answer in microseconds: it
reads only the engine's latest KV block figures and the engine's profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.decision.domain.kv_model import ModelShape
from services.decision.domain.types import EngineLoad, Priority

GIB = 1024**3
MAX_REQUEST_TOKENS = 100_000_000


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What the decision service knows of an engine's model, to turn tokens into bytes."""

    shape: ModelShape
    kv_dtype_bytes: int = 2
    tp: int = 1
    max_model_len: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token(self.kv_dtype_bytes, self.tp)


@dataclass(frozen=True, slots=True)
class AdmitDecision:
    admitted: bool
    reason: str
    kv_bytes_needed: int = 0
    kv_bytes_free: int = 0


def check_request(prompt_tokens: int, max_tokens: int) -> None:
    if prompt_tokens <= 0:
        raise ValueError("prompt_tokens must be positive")
    if max_tokens < 0:
        raise ValueError("max_tokens must not be negative")
    if prompt_tokens + max_tokens > MAX_REQUEST_TOKENS:
        raise ValueError(f"prompt_tokens + max_tokens must be at most {MAX_REQUEST_TOKENS}")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def decide(
    prompt_tokens: int,
    max_tokens: int,
    priority: Priority,
    engine: EngineLoad | None,
    profile: EngineProfile | None,
    memory_at_limit: bool,
) -> AdmitDecision:
    check_request(prompt_tokens, max_tokens)
    tokens = prompt_tokens + max_tokens
    per_token = profile.kv_bytes_per_token if profile is not None else 0
    needed = tokens * per_token
    if profile is not None and profile.max_model_len is not None and tokens > profile.max_model_len:
        return AdmitDecision(
            False,
            f"the request needs {tokens} tokens and the engine's max model length is {profile.max_model_len}",
            needed,
            0,
        )
    if engine is None or engine.kv_blocks_total <= 0 or engine.block_size <= 0:
        if memory_at_limit and priority != Priority.P0:
            return AdmitDecision(False, "device memory is at the policy's limit; only P0 is admitted", needed, 0)
        return AdmitDecision(True, "no KV block figures for this engine yet; admitted", needed, 0)
    free_blocks = engine.kv_blocks_total - engine.kv_blocks_used
    free_tokens = free_blocks * engine.block_size
    free = free_tokens * per_token
    need_blocks = -(-tokens // engine.block_size)
    if need_blocks > free_blocks:
        if per_token:
            reason = (
                f"the request needs {_gib(needed)} of KV ({tokens} tokens) and {_gib(free)} "
                f"({free_tokens} tokens) is free"
            )
        else:
            reason = f"the request needs {need_blocks} KV blocks ({tokens} tokens) and {free_blocks} are free"
        return AdmitDecision(False, reason, needed, free)
    if memory_at_limit and priority != Priority.P0:
        return AdmitDecision(False, "device memory is at the policy's limit; only P0 is admitted", needed, free)
    return AdmitDecision(True, f"fits: {need_blocks} of {free_blocks} free KV blocks", needed, free)
