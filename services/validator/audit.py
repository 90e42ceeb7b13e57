"""The audit trail in Redis: command -> action -> verdict, with trace ids.

Verdicts are stored once per action (the first wins, so a redelivered result
never produces a second verdict), indexed by time, by target and by outcome
for ListVerdicts. Pending watches live here too, so a restarted validator
picks up the actions it was watching.

The trail is kept for `retention_s` (SITS_VALIDATOR_AUDIT_RETENTION_S): each
verdict's keys expire then, each new verdict trims the indexes it joins of
entries older than that, and a target's index expires once the target has had
no verdict for that long (a GPU taken out of the fleet leaves nothing behind).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict

import redis.asyncio as aioredis

from services.validator.domain import PendingAction
from sits.runtime.promise import Promise
from sits.v1 import events_pb2

# Longer than publishing a verdict ever takes, short enough that a crashed claimant's action is judged soon.
CLAIM_TTL_S = 30
# The claim is still this claimant's: renew it (milliseconds in ARGV[2]) and answer 1; else 0.
HOLD_CLAIM_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
DEFAULT_RETENTION_S = 7 * 24 * 3600.0


class AuditStore:
    def __init__(self, client: aioredis.Redis, namespace: str = "", retention_s: float = DEFAULT_RETENTION_S) -> None:
        self._r = client
        self._ns = f"sits:{namespace}validator"
        self._retention_ms = max(1, int(retention_s * 1000))

    def _k(self, *parts: str) -> str:
        return ":".join((self._ns, *parts))

    async def claim_verdict(self, action_id: str, token: str) -> bool:
        """Take the one verdict this action may have (SET NX), before it is published: of two validator
        replicas judging one action during a move, only one publishes. False: it is taken. The claim
        expires unless `record_verdict` makes it permanent, so a claimant killed before publishing does
        not leave the action without a verdict forever. `token` is this attempt's own (see `hold_claim`)."""
        return bool(await self._r.set(self._k("by-action", action_id), token, nx=True, ex=CLAIM_TTL_S))

    async def hold_claim(self, action_id: str, token: str) -> bool:
        """Whether the claim taken with `token` is still held, renewed for CLAIM_TTL_S if so. Asked right before
        the verdict is published: a claimant that stalled past its claim's life (another replica may have
        claimed and published since) must not publish a second verdict."""
        held = await self._r.eval(HOLD_CLAIM_SCRIPT, 1, self._k("by-action", action_id), token, CLAIM_TTL_S * 1000)
        return bool(held)

    async def first_attempt(self, action_id: str, now: float) -> float | None:
        """Note that this action's verdict is about to be published; None for the first attempt, else when the
        first one began. A later attempt follows a claimant that was killed, or whose publish failed, after the
        verdict may have reached the topic: the caller looks there before publishing again."""
        # SET NX GET (Redis 7): the mark and the earlier one's time in one step.
        earlier = await self._r.set(self._k("attempt", action_id), repr(now), nx=True, px=self._retention_ms, get=True)
        return None if earlier is None else float(_text(earlier))

    async def unclaim_verdict(self, action_id: str, token: str) -> None:
        """Give the claim back when the verdict could not be published, so the next try can."""
        raw = await self._r.get(self._k("by-action", action_id))
        if raw is not None and _text(raw) == token:
            await self._r.delete(self._k("by-action", action_id))

    async def record_verdict(
        self, verdict: events_pb2.ValidationVerdict, target_key: str, claimed: bool = False
    ) -> bool:
        """Store a verdict; False if this action already has one. `claimed`: `claim_verdict` took it already."""
        if not claimed and not await self.claim_verdict(verdict.action_id, verdict.verdict_id):
            return False
        score = verdict.settled_at.seconds + verdict.settled_at.nanos / 1e9
        oldest = score - self._retention_ms / 1000
        by_target = self._k("target", target_key)
        indexes = (self._k("all"), by_target, self._k("outcome", str(verdict.verdict)))
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(self._k("by-action", verdict.action_id), verdict.verdict_id, px=self._retention_ms)
            pipe.set(self._k("verdict", verdict.verdict_id), verdict.SerializeToString(), px=self._retention_ms)
            for index in indexes:
                pipe.zadd(index, {verdict.verdict_id: score})
                pipe.zremrangebyscore(index, "-inf", f"({oldest}")
            pipe.pexpire(by_target, self._retention_ms)
            pipe.hdel(self._k("pending"), verdict.action_id)
            await pipe.execute()
        return True

    async def verdict(self, verdict_id: str) -> events_pb2.ValidationVerdict | None:
        raw = await self._r.get(self._k("verdict", verdict_id))
        if raw is None:
            return None
        return events_pb2.ValidationVerdict.FromString(_bytes(raw))

    async def verdict_for_action(self, action_id: str) -> events_pb2.ValidationVerdict | None:
        verdict_id = await self._r.get(self._k("by-action", action_id))
        return None if verdict_id is None else await self.verdict(_text(verdict_id))

    async def list_verdicts(
        self, *, target_key: str | None, outcome: int | None, limit: int
    ) -> list[events_pb2.ValidationVerdict]:
        if target_key is not None:
            index = self._k("target", target_key)
        elif outcome is not None:
            index = self._k("outcome", str(outcome))
        else:
            index = self._k("all")
        # Read past `limit` when both filters apply: the second one is checked here.
        ids = await self._r.zrevrange(index, 0, limit * 4 if target_key and outcome else limit - 1)
        out: list[events_pb2.ValidationVerdict] = []
        for raw_id in ids:
            verdict = await self.verdict(_text(raw_id))
            if verdict is None or (outcome is not None and verdict.verdict != outcome):
                continue
            out.append(verdict)
            if len(out) >= limit:
                break
        return out

    async def save_pending(self, pending: PendingAction) -> None:
        await self._r.hset(self._k("pending"), pending.action_id, json.dumps(asdict(pending)))

    async def load_pending(self, owned: Callable[[str], bool] | None = None) -> list[PendingAction]:
        """Watches not judged yet; with `owned`, only those whose target key it accepts."""
        raw = await self._r.hgetall(self._k("pending"))
        found = [_pending(json.loads(v)) for v in raw.values()]
        return found if owned is None else [p for p in found if owned(p.target_key)]


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pending(data: dict[str, object]) -> PendingAction:
    """A stored watch; fields a newer validator does not know are dropped, missing ones take defaults."""
    known = set(PendingAction.__dataclass_fields__)
    fields = {k: v for k, v in data.items() if k in known}
    promise = fields.get("promise")
    if isinstance(promise, dict):
        terms = set(Promise.__dataclass_fields__)
        fields["promise"] = Promise(**{k: v for k, v in promise.items() if k in terms})
    return PendingAction(**fields)  # type: ignore[arg-type]
