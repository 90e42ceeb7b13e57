"""Per-target decision state handed between replicas through Redis.

When the group moves a partition, the replica losing it writes what it knows of
each target on it (rule latches, cooldowns, the controller's state, commands
awaiting a verdict: `DecisionEngine.hand_over`) into one Redis hash per
partition, and the replica gaining it reads and deletes that hash before it
handles the partition's first record. This state lives in Redis because it is
the decision's own memory: no topic holds it. Forecast windows do not travel:
they are a function of the samples, which the metrics topic still holds, so the
new owner reads the last records before the committed offset again
(`EventConsumer(replay=...)`). A replica killed with -9 hands nothing over; its
successor starts from the replayed windows and fresh latches, and command ids
derived from the cause keep a repeated decision from being applied twice.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# A handover nobody picks up (the topic was deleted, the group renamed) goes away by itself.
HANDOVER_TTL_S = 3600


class HandoverStore:
    def __init__(self, client: aioredis.Redis, namespace: str, group: str) -> None:
        self._r = client
        self._prefix = f"sits:{namespace}decision:handover:{group}:"

    def _key(self, partition: int) -> str:
        return f"{self._prefix}{partition}"

    async def put(self, by_partition: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> int:
        """Store each partition's targets; returns how many targets were written."""
        written = 0
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for partition, targets in by_partition.items():
                    if not targets:
                        continue
                    pipe.hset(self._key(partition), mapping={k: json.dumps(v) for k, v in targets.items()})
                    pipe.expire(self._key(partition), HANDOVER_TTL_S)
                    written += len(targets)
                await pipe.execute()
        except (RedisError, OSError) as error:
            log.warning("handover of %d target(s) not stored (%s): the next owner rebuilds them", written, error)
            return 0
        return written

    async def take(self, partitions: Iterable[int]) -> dict[str, dict[str, Any]]:
        """Read and delete what was handed over on `partitions`."""
        out: dict[str, dict[str, Any]] = {}
        try:
            for partition in partitions:
                async with self._r.pipeline(transaction=True) as pipe:
                    pipe.hgetall(self._key(partition))
                    pipe.delete(self._key(partition))
                    raw, _ = await pipe.execute()
                for key, value in raw.items():
                    name = key.decode() if isinstance(key, bytes) else str(key)
                    out[name] = json.loads(value)
        except (RedisError, OSError) as error:
            log.warning("handover not read (%s): targets start from the replayed windows", error)
        return out
