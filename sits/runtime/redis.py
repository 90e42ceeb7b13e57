"""Redis access (redis.asyncio) and the idempotency guard handlers share."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import RedisError

START_HINT = (
    "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save '' --appendonly no "
    "--dir /var/lib/redis --logfile /var/log/redis/ci.log"
)


class RedisUnavailable(RuntimeError):
    """Redis cannot be reached; the message says how to start it."""


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0)


async def check_redis(url: str) -> None:
    """Raise RedisUnavailable with the command that starts a local server."""
    client = connect(url)
    try:
        await client.ping()
    except (RedisError, OSError) as err:
        raise RedisUnavailable(f"Redis at {url} is unreachable ({err}). Start it with:\n  {START_HINT}") from err
    finally:
        await client.aclose()


# Claim and effect in one step: the count moves only the first time an id is seen.
_CLAIM_AND_COUNT = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  redis.call('INCR', KEYS[2])
  return 1
end
return 0
"""


class IdempotencyGuard:
    """Remembers which ids a handler has already applied (per scope, with expiry)."""

    def __init__(self, client: aioredis.Redis, scope: str, ttl_s: int = 24 * 3600) -> None:
        self._client = client
        self._scope = scope
        self._ttl_s = ttl_s

    def _key(self, event_id: str) -> str:
        return f"sits:seen:{self._scope}:{event_id}"

    async def claim(self, event_id: str) -> bool:
        """True the first time `event_id` is claimed in this scope."""
        return bool(await self._client.set(self._key(event_id), "1", nx=True, ex=self._ttl_s))

    async def claim_and_count(self, event_id: str, counter_key: str) -> bool:
        """Claim and increment `counter_key` atomically: the count moves once per id."""
        result = await self._client.eval(_CLAIM_AND_COUNT, 2, self._key(event_id), counter_key, str(self._ttl_s))
        return bool(result)

    async def seen(self, event_id: str) -> bool:
        return bool(await self._client.exists(self._key(event_id)))
