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

from sits.runtime.contract import ALL_TIERS, LOWEST_TIER, Tier

SERVICE = "sits.executor.EngineControl"
GET_STATE = f"/{SERVICE}/GetState"
SET_LIMITS = f"/{SERVICE}/SetLimits"
LIST_REQUESTS = f"/{SERVICE}/ListRequests"
# {"wait_idle_s": s} -> {"reset": bool, "reason": str}: the prefix cache, emptied once nothing runs.
RESET_PREFIX_CACHE = f"/{SERVICE}/ResetPrefixCache"
# {"request_ids": [client ids, as ListRequests gives them]} -> {"aborted": [ids], "applied": bool}: the
# requests finished as aborted at the next step, their streams ended with finish reason "abort" (the same
# on the gRPC and the OpenAI server: the OpenAI server has no abort call of its own).
ABORT_REQUESTS = f"/{SERVICE}/AbortRequests"

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


# vLLM's OpenAI server names a request "cmpl-<X-Request-Id>..." or "chatcmpl-<X-Request-Id>..."; the SITS
# OpenAI launcher (`vllm_plugin.openai_launcher`) writes the tier into X-Request-Id, so it follows these.
OPENAI_ID_PREFIXES = ("chatcmpl-", "cmpl-")
_TIERS_BY_NAME = {tier.mesh_name: int(tier) for tier in ALL_TIERS}


def _leading_tier(request_id: str) -> int | None:
    prefix = request_id[:3].lower()
    if len(prefix) == 3 and prefix[2] in "-_:" and prefix[:2] in _TIERS_BY_NAME:
        return _TIERS_BY_NAME[prefix[:2]]
    return None


def _tier_prefix(request_id: str) -> int | None:
    for server_prefix in OPENAI_ID_PREFIXES:
        if request_id.startswith(server_prefix):
            return _leading_tier(request_id[len(server_prefix) :])
    return _leading_tier(request_id)


def priority_tier_of_request_id(request_id: str) -> int:
    """Tier 0 (P0, highest) .. 2 (P2) from a request id like "p1-5f3a...".

    vLLM's gRPC servicer passes no call metadata into the engine (it keeps only
    the trace context), so the tier travels in the request id. Behind the mesh
    the SITS gRPC launcher (`vllm_plugin.grpc_launcher`) rewrites the id's
    prefix from the routed tier header (`retag_request_id`), so a client cannot
    claim P0 by naming its id. An untagged request has claimed no protection
    and counts as the lowest tier.
    """
    tier = _tier_prefix(request_id)
    return int(LOWEST_TIER) if tier is None else tier


def retag_request_id(request_id: str, tier_name: str) -> str:
    """`request_id` carrying `tier_name` ("p0".."p2", any case) instead of whatever tier it named."""
    tier = Tier.parse(tier_name)
    bare = request_id[3:] if _leading_tier(request_id) is not None else request_id
    return f"{tier.mesh_name}-{bare}"


class LimitError(ValueError):
    """A limit the engine cannot take; the control server answers INVALID_ARGUMENT with it."""
