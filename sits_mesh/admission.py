"""Admission of one Generate request: pure logic, no gRPC, no files.

The external processor (ext_proc.py) feeds this module the request's headers
and body chunks; it says whether the request is shed for its priority under
pressure, when enough of the body has arrived to judge it, and what the
request asks for (prompt tokens, max_tokens) so the `Admitter` can decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from google.protobuf.message import DecodeError
from smg_grpc_proto import vllm_engine_pb2

from sits.runtime.clock import Clock
from sits_mesh.policy import PRIORITY_NAMES, Admission, Priorities, PriorityName

GRPC_FRAME_PREFIX = 5
# A prompt's body beyond this is not parsed; it is refused (about 4M tokens).
MAX_BODY_BYTES = 32 << 20


@dataclass(frozen=True)
class GenerateShape:
    prompt_tokens: int
    max_tokens: int
    prompt_logprobs: int = 0


@dataclass(frozen=True)
class AdmissionQuery:
    prompt_tokens: int
    max_tokens: int
    priority: PriorityName
    prompt_logprobs: int = 0


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    reason: str
    kv_bytes_needed: int = 0
    kv_bytes_free: int = 0


class Admitter(Protocol):
    """Decides whether a request fits the engine's free KV memory (the decision service's Admit)."""

    async def admit(self, query: AdmissionQuery) -> Verdict: ...


class AdmitterUnavailable(Exception):
    """The admitter could not answer (down, timed out); the processor fails open."""


class RecentFreeKv:
    """The last free-KV figure from the decision service, to admit tiny requests without asking.

    A request whose KV need is at most `fraction` of the free KV reported less
    than `max_age_s` ago cannot be the one that kills the engine; anything
    larger, or any request when the figure is stale, goes to the decision service.
    P0 is refused only when its own request does not fit (the decision's rule, which
    counts what lower tiers hold as P0's too), so a P0 request that fits in all of
    that free KV is admitted here: under load on two cores the second hop cost P0
    up to the processor's whole wait for Admit (p90 over 300 ms, bench/p0_path.py).
    Not one with prompt logprobs (the decision checks their logits against the
    device) or one longer than the engine's max model length (refused with the reason).
    """

    def __init__(self, admission: Admission, clock: Clock) -> None:
        self._fraction = admission.local_admit_fraction
        self._max_age_s = admission.local_admit_max_age_s
        self._bytes_per_token = admission.kv_bytes_per_token
        self._max_request_tokens = admission.bypass_max_request_tokens
        self._clock = clock
        self._free: int | None = None
        self._seen_at = 0.0

    def remember(self, verdict: Verdict) -> None:
        if verdict.kv_bytes_free > 0:
            self._free = verdict.kv_bytes_free
            self._seen_at = self._clock.monotonic()

    def admits_locally(self, query: AdmissionQuery) -> bool:
        if self._free is None or not self._fraction or not self._bytes_per_token:
            return False
        if self._clock.monotonic() - self._seen_at > self._max_age_s:
            return False
        tokens = query.prompt_tokens + query.max_tokens
        needed = tokens * self._bytes_per_token
        if query.priority == "p0" and not query.prompt_logprobs:
            if 0 < self._max_request_tokens < tokens:
                return False
            return needed <= self._free
        return needed <= self._fraction * self._free


def priority_of(header_value: str | None, priorities: Priorities) -> PriorityName:
    value = (header_value or "").strip().lower()
    for name in PRIORITY_NAMES:
        if value == name:
            return name
    return priorities.default


def shed_reason(priority: PriorityName, pressure: float | None, priorities: Priorities) -> str | None:
    """Why this priority is shed at this GPU pressure, or None when it is not."""
    if pressure is None:
        return None
    threshold = priorities.classes[priority].shed_at_pressure
    if threshold < 1.0 and pressure >= threshold:
        return (
            f"shed by SITS: GPU memory pressure {pressure:.2f} is at or above {threshold:.2f}, "
            f"where priority {priority} is shed"
        )
    return None


def frame_complete(buffer: bytes | bytearray) -> bool:
    """True when the buffer holds the first whole gRPC message (5-byte prefix + body)."""
    if len(buffer) < GRPC_FRAME_PREFIX:
        return False
    length = int.from_bytes(buffer[1:5], "big")
    return len(buffer) >= GRPC_FRAME_PREFIX + length


class NotAGenerateRequest(ValueError):
    pass


def parse_generate(buffer: bytes | bytearray) -> GenerateShape:
    """Prompt length and max_tokens of the first gRPC message in `buffer`."""
    if not frame_complete(buffer):
        raise NotAGenerateRequest("the body ended before a whole gRPC message arrived")
    if buffer[0] != 0:
        raise NotAGenerateRequest("compressed gRPC messages are not inspected")
    length = int.from_bytes(buffer[1:5], "big")
    message = vllm_engine_pb2.GenerateRequest()
    try:
        message.ParseFromString(bytes(buffer[GRPC_FRAME_PREFIX : GRPC_FRAME_PREFIX + length]))
    except DecodeError as err:
        raise NotAGenerateRequest(f"not a GenerateRequest: {err}") from None
    if message.WhichOneof("input") != "tokenized":
        # Text prompts are tokenized by the engine; estimate one token per 4 bytes (generous).
        prompt_tokens = len(message.text.encode()) // 4 + 1
    else:
        prompt_tokens = len(message.tokenized.input_ids)
    params = message.sampling_params
    max_tokens = params.max_tokens if params.HasField("max_tokens") else 0
    samples = max(1, params.n)
    prompt_logprobs = params.prompt_logprobs if params.HasField("prompt_logprobs") else 0
    return GenerateShape(prompt_tokens=prompt_tokens, max_tokens=max_tokens * samples, prompt_logprobs=prompt_logprobs)


def fallback_verdict(query: AdmissionQuery, admission: Admission) -> Verdict:
    """What to do when the admitter cannot answer: admit, unless over the policy's local cap."""
    cap = admission.fallback_max_total_tokens
    total = query.prompt_tokens + query.max_tokens
    if cap and total > cap:
        return Verdict(
            admitted=False,
            reason=(
                f"the request needs {total} tokens of KV (prompt {query.prompt_tokens} + max_tokens "
                f"{query.max_tokens}) and the local cap while the decision service is unreachable is {cap}"
            ),
        )
    return Verdict(admitted=True, reason="decision service unreachable: admitted (fail open)")


def format_bytes(size: int) -> str:
    """GiB for the sizes that kill engines, smaller units for small test engines."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def kv_reason(needed_bytes: int, free_bytes: int, prompt_tokens: int, max_tokens: int) -> str:
    """The refusal a person reads, e.g. 'the prompt needs 41.0 GiB of KV and 9.0 GiB is free'."""
    return (
        f"the prompt needs {format_bytes(needed_bytes)} of KV ({prompt_tokens} prompt + {max_tokens} "
        f"new tokens) and {format_bytes(free_bytes)} is free"
    )


def refusal_message(verdict: Verdict) -> str:
    reason = verdict.reason
    if not reason and verdict.kv_bytes_needed:
        reason = (
            f"the prompt needs {format_bytes(verdict.kv_bytes_needed)} of KV and "
            f"{format_bytes(verdict.kv_bytes_free)} is free"
        )
    return f"refused by SITS admission: {reason or 'does not fit'}"
