"""Executor state in Redis: per-target leases with fencing tokens, applied commands, action log, breakers.

Keys (all under `prefix`, default "sits:executor:"):
- `lease:<target>`        the holder's id and fencing token, SET NX PX (expires on its own)
- `fence:<target>`        INCR counter; every lease gets a larger token than the last
- `applied:<command_id>`  the action_id that applied the command (de-duplication)
- `action:<action_id>`    the ActionResult (protobuf bytes), with before/after state
- `published:<action_id>` set once that result is on the results topic, so a redelivered command
  need not look for it there
- `actions:<target>`      sorted set of action ids by time, newest last
- `limits:<target>`       the last engine limits the executor set (for GetLimits while the engine is down)
- `breaker:<target>:<tier>`  JSON breaker record, expiring when it would read as closed
- `budget:<target>`       JSON tier budget (limits, lease end, command id), expiring with its lease
- `pressure:<target>`     the last pressure written
- `lease-audit:<target>`  every grant and release of the lease, stamped with Redis's own clock
  (`lease_overlaps` reads it: two executors must never hold one target at once)
- `target-key:<target>`   the record key of the target's commands (which partition, hence which
  executor replica, owns it)

Redis errors surface as `StateUnavailable`: the service refuses mutating
actions then, and leaves the command's offset uncommitted.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.executor.domain import BreakerBoard, BreakerRecord, BreakerState, TierBudgetRecord
from sits.runtime.contract import Tier
from sits.runtime.redis import explain as explain_redis_error
from sits.v1 import events_pb2

log = logging.getLogger(__name__)


class StateUnavailable(RuntimeError):
    """Redis cannot be reached or answered with an error.

    When the cause is SITS's own credentials (a wrong password, a missing AUTH, an ACL
    without the needed commands), the message says so instead of "unreachable".
    """

    def __str__(self) -> str:
        cause = self.__cause__
        reason = explain_redis_error(cause) if cause is not None else None
        return reason if reason is not None else super().__str__()


class LeaseHeld(RuntimeError):
    """Another executor holds this target's lease."""


@dataclass(frozen=True, slots=True)
class Lease:
    target: str
    holder: str
    fencing_token: int
    # The action that had already applied the command named when the lease was taken (read under the lease,
    # in the same round trip), or None.
    applied_action: str | None = None


# Take the lease (SET NX PX) with a fresh fencing token, and audit the grant with Redis's clock, the same
# clock its expiry runs on: an overlap in the audit is a real double hold, not clock skew between executors.
# With a fourth key (a command's applied:<id>), a granted lease also returns which action applied that command
# already: the duplicate check every command makes under its lease costs no round trip of its own.
_ACQUIRE = """
local token = redis.call('INCR', KEYS[2])
local value = ARGV[1] .. ':' .. token
if redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2]) then
  local t = redis.call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('RPUSH', KEYS[3], 'acquire ' .. value .. ' ' .. ms .. ' ' .. ARGV[2])
  redis.call('LTRIM', KEYS[3], -tonumber(ARGV[3]), -1)
  redis.call('PEXPIRE', KEYS[3], ARGV[4])
  if KEYS[4] then
    return {token, redis.call('GET', KEYS[4])}
  end
  return {token, false}
end
return {-token, false}
"""

# Release only our own lease: compare-and-delete in one step, audited like the grant.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  local t = redis.call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('RPUSH', KEYS[2], 'release ' .. ARGV[1] .. ' ' .. ms)
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[2]), -1)
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# The audit keeps this many grants and releases per target, and lives this long after the last one.
AUDIT_ENTRIES = 20_000
AUDIT_TTL_MS = 24 * 3600 * 1000


def lease_overlaps(entries: list[str]) -> list[tuple[str, str]]:
    """Pairs of holders whose hold on one target overlapped, from its audit (oldest first).

    A hold runs from its grant to its release, or to grant + TTL when it was never released (its holder
    crashed and Redis expired the key). Times are Redis's, in ms.
    """
    holds: dict[str, list[int]] = {}
    for entry in entries:
        parts = entry.split()
        if parts[0] == "acquire" and len(parts) == 4:
            start = int(parts[2])
            holds[parts[1]] = [start, start + int(parts[3])]
        elif parts[0] == "release" and len(parts) == 3 and parts[1] in holds:
            holds[parts[1]][1] = min(holds[parts[1]][1], int(parts[2]))
    ordered = sorted(holds.items(), key=lambda item: item[1][0])
    overlaps = []
    latest_end, latest_holder = -1, ""
    for holder, (start, end) in ordered:
        if start < latest_end:
            overlaps.append((latest_holder, holder))
        if end > latest_end:
            latest_end, latest_holder = end, holder
    return overlaps


class RedisState:
    def __init__(self, client: aioredis.Redis, prefix: str = "sits:executor:", applied_ttl_s: int = 7 * 24 * 3600):
        self._client = client
        self._prefix = prefix
        self._applied_ttl_s = applied_ttl_s
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)

    def _key(self, *parts: str) -> str:
        return self._prefix + ":".join(parts)

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error

    # ------------------------------------------------------------ leases

    async def acquire_lease(self, target: str, ttl_ms: int, *, command_id: str = "") -> Lease:
        """The target's lease with a fresh fencing token, or LeaseHeld. With `command_id`, the lease also says
        which action applied that command already (`Lease.applied_action`), read once the lease is held."""
        holder = uuid.uuid4().hex
        keys = [self._key("lease", target), self._key("fence", target), self._key("lease-audit", target)]
        if command_id:
            keys.append(self._key("applied", command_id))
        try:
            raw_token, applied = await self._acquire(keys=keys, args=[holder, ttl_ms, AUDIT_ENTRIES, AUDIT_TTL_MS])
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable while taking the lease: {error}") from error
        token = int(raw_token)
        if token < 0:
            raise LeaseHeld(f"target {target} is leased by another executor")
        return Lease(
            target=target,
            holder=f"{holder}:{token}",
            fencing_token=token,
            applied_action=_text(applied) if applied is not None else None,
        )

    async def lease_audit(self, target: str) -> list[str]:
        try:
            raw = await self._client.lrange(self._key("lease-audit", target), 0, -1)
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        return [_text(r) for r in raw]

    async def remember_target_key(self, target: str, key: str) -> None:
        try:
            await self._client.set(self._key("target-key", target), key, ex=self._applied_ttl_s)
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error

    async def target_keys(self, targets: list[str]) -> dict[str, str]:
        """The record key each target's commands came with (targets never commanded are absent)."""
        if not targets:
            return {}
        try:
            raws = await self._client.mget([self._key("target-key", t) for t in targets])
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        return {t: _text(r) for t, r in zip(targets, raws, strict=True) if r is not None}

    async def release_lease(self, lease: Lease) -> None:
        try:
            await self._release(
                keys=[self._key("lease", lease.target), self._key("lease-audit", lease.target)],
                args=[lease.holder, AUDIT_ENTRIES],
            )
        except (RedisError, OSError):
            # It expires on its own; a failed release only delays the next holder.
            return

    async def lease_is_current(self, lease: Lease) -> bool:
        try:
            raw = await self._client.get(self._key("lease", lease.target))
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        return raw is not None and _text(raw) == lease.holder

    # ------------------------------------------------------------ commands and actions

    async def record(self, target: str, result: events_pb2.ActionResult, *, mark_applied: bool) -> None:
        """Store the action; with `mark_applied`, also remember its command as done."""
        score = result.applied_at.seconds + result.applied_at.nanos / 1e9
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(self._key("action", result.action_id), result.SerializeToString(), ex=self._applied_ttl_s)
                pipe.zadd(self._key("actions", target), {result.action_id: score})
                if mark_applied and result.command_id:
                    pipe.set(self._key("applied", result.command_id), result.action_id, ex=self._applied_ttl_s)
                await pipe.execute()
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable while recording action: {error}") from error

    async def mark_published(self, action_id: str) -> None:
        """Note that this action's result reached the results topic (best effort: a miss costs one topic read)."""
        try:
            await self._client.set(self._key("published", action_id), 1, ex=self._applied_ttl_s)
        except (RedisError, OSError) as error:
            log.warning("could not note that action %s's result was published: %s", action_id, error)

    async def was_published(self, action_id: str) -> bool:
        """True when `mark_published` noted it; False when not, or not known."""
        try:
            return bool(await self._client.exists(self._key("published", action_id)))
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error

    async def action(self, action_id: str) -> events_pb2.ActionResult | None:
        try:
            raw = await self._client.get(self._key("action", action_id))
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        if raw is None:
            return None
        result = events_pb2.ActionResult()
        result.ParseFromString(_bytes(raw))
        return result

    async def actions(self, target: str, limit: int) -> list[events_pb2.ActionResult]:
        try:
            ids = await self._client.zrevrange(self._key("actions", target), 0, max(0, limit - 1))
            raws = await self._client.mget([self._key("action", _text(i)) for i in ids]) if ids else []
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        results = []
        for raw in raws:
            if raw is not None:
                result = events_pb2.ActionResult()
                result.ParseFromString(_bytes(raw))
                results.append(result)
        return results

    # ------------------------------------------------------------ breakers and pressure

    async def breakers(self, target: str) -> BreakerBoard:
        try:
            raws = await self._client.mget([self._key("breaker", target, t.mesh_name) for t in Tier])
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        records: dict[Tier, BreakerRecord] = {}
        for tier, raw in zip(Tier, raws, strict=True):
            if raw is not None:
                data = json.loads(raw)
                records[tier] = BreakerRecord(
                    tier=tier,
                    state=BreakerState(int(data["state"])),
                    max_requests=int(data["max_requests"]),
                    opened_at=float(data["opened_at"]),
                    ttl_s=int(data["ttl_s"]),
                )
        return BreakerBoard(records)

    async def save_breakers(
        self, target: str, board: BreakerBoard, expires_at: dict[Tier, float | None], now: float, command_id: str = ""
    ) -> None:
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                for tier in Tier:
                    key = self._key("breaker", target, tier.mesh_name)
                    record = board.records.get(tier)
                    until = expires_at.get(tier)
                    if record is None or record.state is BreakerState.CLOSED or until is None:
                        pipe.delete(key)
                        continue
                    data = {
                        "state": int(record.state),
                        "max_requests": record.max_requests,
                        "opened_at": record.opened_at,
                        "ttl_s": record.ttl_s,
                        "command_id": command_id,
                    }
                    pipe.set(key, json.dumps(data), ex=max(1, math.ceil(until - now)))
                await pipe.execute()
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable while saving breakers: {error}") from error

    async def breaker_commands(self, target: str) -> dict[Tier, str]:
        """The command that last opened each tier's breaker that is still recorded."""
        try:
            raws = await self._client.mget([self._key("breaker", target, t.mesh_name) for t in Tier])
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        return {
            tier: str(json.loads(raw).get("command_id", ""))
            for tier, raw in zip(Tier, raws, strict=True)
            if raw is not None
        }

    async def budget(self, target: str) -> TierBudgetRecord | None:
        try:
            raw = await self._client.get(self._key("budget", target))
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        if raw is None:
            return None
        data = json.loads(raw)
        return TierBudgetRecord(
            limits={Tier[name]: int(n) for name, n in data["limits"].items()},
            until=float(data["until"]),
            command_id=str(data.get("command_id", "")),
            lease_s=float(data.get("lease_s", 0.0)),
        )

    async def save_budget(self, target: str, record: TierBudgetRecord | None) -> None:
        """Store the budget (None deletes it); the key outlives its lease a little, so expiry can be reported."""
        key = self._key("budget", target)
        try:
            if record is None:
                await self._client.delete(key)
                return
            data = {
                "limits": {tier.name: n for tier, n in record.limits.items()},
                "until": record.until,
                "command_id": record.command_id,
                "lease_s": record.lease_s,
            }
            await self._client.set(key, json.dumps(data), ex=max(1, math.ceil(record.lease_s)) + 60)
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable while saving the tier budget: {error}") from error

    async def breaker_targets(self) -> set[str]:
        """Targets with any breaker record (for the reconcile loop)."""
        found: set[str] = set()
        pattern = self._key("breaker", "*")
        try:
            async for key in self._client.scan_iter(match=pattern, count=200):
                name = key.decode()[len(self._key("breaker")) + 1 :]
                found.add(name.rsplit(":", 1)[0])
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        return found

    async def pressure(self, target: str) -> float | None:
        try:
            raw = await self._client.get(self._key("pressure", target))
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error
        return float(raw) if raw is not None else None

    async def save_pressure(self, target: str, value: float) -> None:
        try:
            await self._client.set(self._key("pressure", target), repr(value))
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable: {error}") from error


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
