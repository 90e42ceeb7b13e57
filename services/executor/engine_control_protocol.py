"""The engine-control channel between the executor and the SITS scheduler plugin.

Transport: a small gRPC server inside the EngineCore process (a background
thread), not Redis. Why: a change must be live at the very next engine step,
and the executor must learn *that* it is live (the step it took effect at) in
the same round trip; gRPC gives a synchronous acknowledgement on loopback in
well under a millisecond, while Redis would need polling or pub/sub inside the
engine's hot loop and an extra hop to confirm. The executor already owns
Redis for leases and history; the engine should not depend on it.

Messages are JSON (UTF-8) carried by gRPC generic handlers, so the plugin needs
no generated code inside the engine process and nothing in `protos/` changes.
Method names and payloads are defined here and only here.
"""

from __future__ import annotations

import json
from typing import Any

SERVICE = "sits.executor.EngineControl"
GET_STATE = f"/{SERVICE}/GetState"
SET_LIMITS = f"/{SERVICE}/SetLimits"
LIST_REQUESTS = f"/{SERVICE}/ListRequests"

# Keys of the limits object; they mirror sits.v1.EngineLimits field names.
MAX_NUM_RUNNING_REQS = "max_num_running_reqs"
MAX_NUM_SCHEDULED_TOKENS = "max_num_scheduled_tokens"
MAX_PREFILL_CHUNK_TOKENS = "max_prefill_chunk_tokens"
ADMISSION_PAUSED = "admission_paused"
LIMIT_KEYS = (MAX_NUM_RUNNING_REQS, MAX_NUM_SCHEDULED_TOKENS, MAX_PREFILL_CHUNK_TOKENS, ADMISSION_PAUSED)


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    value = json.loads(data.decode() or "{}")
    if not isinstance(value, dict):
        raise ValueError("engine-control messages are JSON objects")
    return value


PRIORITY_PREFIXES = {"p0": 0, "p1": 1, "p2": 2}
LOWEST_TIER = 2


def priority_tier_of_request_id(request_id: str) -> int:
    """Tier 0 (P0, highest) .. 2 (P2) from a request id like "p1-5f3a...".

    vLLM's gRPC servicer passes no call metadata into the engine (it keeps only
    the trace context, and drops even that without an OTLP endpoint), so the
    engine cannot see `x-sits-priority`. SITS clients therefore also prefix the
    request id with the tier. An untagged request has claimed no protection and
    counts as the lowest tier.
    """
    prefix = request_id[:3].lower()
    if len(prefix) == 3 and prefix[2] in "-_:" and prefix[:2] in PRIORITY_PREFIXES:
        return PRIORITY_PREFIXES[prefix[:2]]
    return LOWEST_TIER


class LimitError(ValueError):
    """A limit the engine cannot take; the control server answers INVALID_ARGUMENT with it."""
