"""Variables the SITS scheduler plugin reads inside vLLM's engine core (not pydantic settings: they are
read in vLLM's process, at the scheduler's construction); `sits settings` lists them from here."""

from __future__ import annotations

ENGINE_CONTROL_ADDR = "SITS_ENGINE_CONTROL_ADDR"
ENGINE_EMPTY_CACHE_AT_START = "SITS_ENGINE_EMPTY_CACHE_AT_START"
ENGINE_QUEUE_POLL_S = "SITS_ENGINE_QUEUE_POLL_S"

# (variable, default, meaning)
ENVIRONMENT: tuple[tuple[str, str, str], ...] = (
    (
        ENGINE_CONTROL_ADDR,
        "",
        "host:port the scheduler plugin serves its engine-control endpoint on (the executor's control_addr, "
        "capture's SITS_ENGINE_CONTROL_ADDR); empty: no endpoint.",
    ),
    (
        ENGINE_EMPTY_CACHE_AT_START,
        "",
        "1 or true: the scheduler plugin empties the CUDA allocator's cache vLLM's warm-up left, when it starts.",
    ),
    (
        ENGINE_QUEUE_POLL_S,
        "",
        "Seconds a busy vLLM EngineCore or worker sleeps between checks of its shared-memory queue instead of "
        "spinning (0 to 0.1; the stack sets 0.0001 for CPU engines, which share their cores). Empty or 0: spin.",
    ),
)
