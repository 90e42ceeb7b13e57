"""The audit trail's retention on the real Redis: verdicts expire, indexes are trimmed, judged stays judged."""

from __future__ import annotations

import time

from services.validator.audit import AuditStore
from sits.v1 import events_pb2

RETENTION_S = 60.0


def verdict(
    action_id: str, settled_at: float, outcome: int = events_pb2.VERDICT_CONFIRMED
) -> events_pb2.ValidationVerdict:
    v = events_pb2.ValidationVerdict(verdict_id=f"verdict-{action_id}", action_id=action_id, verdict=outcome)
    v.settled_at.FromNanoseconds(int(settled_at * 1e9))
    return v


async def test_a_verdict_and_its_claim_expire_after_the_retention(redis_client, topic_prefix: str) -> None:
    audit = AuditStore(redis_client, topic_prefix, retention_s=RETENTION_S)
    assert await audit.record_verdict(verdict("a1", time.time()), "host/gpu-0/vllm-0")

    ns = f"sits:{topic_prefix}validator"
    for key in (f"{ns}:verdict:verdict-a1", f"{ns}:by-action:a1", f"{ns}:target:host/gpu-0/vllm-0"):
        ttl_ms = await redis_client.pttl(key)
        assert 0 < ttl_ms <= RETENTION_S * 1000, (key, ttl_ms)
    # Within the retention the action stays judged: a replayed result gets no second verdict.
    assert not await audit.record_verdict(verdict("a1", time.time()), "host/gpu-0/vllm-0")


async def test_a_new_verdict_trims_entries_older_than_the_retention(redis_client, topic_prefix: str) -> None:
    audit = AuditStore(redis_client, topic_prefix, retention_s=RETENTION_S)
    now = time.time()
    target = "host/gpu-1/vllm-1"
    assert await audit.record_verdict(verdict("old", now - 2 * RETENTION_S), target)
    assert await audit.record_verdict(verdict("recent", now - RETENTION_S / 2), target)
    assert await audit.record_verdict(verdict("new", now), target)

    listed = await audit.list_verdicts(target_key=None, outcome=None, limit=10)
    assert [v.action_id for v in listed] == ["new", "recent"]
    by_target = await audit.list_verdicts(target_key=target, outcome=None, limit=10)
    assert [v.action_id for v in by_target] == ["new", "recent"]
    by_outcome = await audit.list_verdicts(target_key=None, outcome=events_pb2.VERDICT_CONFIRMED, limit=10)
    assert [v.action_id for v in by_outcome] == ["new", "recent"]
    ns = f"sits:{topic_prefix}validator"
    assert await redis_client.zscore(f"{ns}:all", "verdict-old") is None
