"""The executor's Kafka entry: only commands SITS signed, still in time and never seen with other content, pass.

Anyone who can produce to `sits.healing.commands.v1` could otherwise steer an
engine. Before a command read from Kafka reaches the executor, this gate
checks, in order:

1. the signature (headers `sits_signature_key`, `sits_signature`) against the
   executor's key ring: `unsigned`, `unknown_key`, `bad_signature`;
2. the deadline: a command must carry one (`bad_deadline`), at most a day
   ahead (`bad_deadline`), and not past (`expired`: a replay of an old command,
   or one that waited too long, is never applied late);
3. the content: the first time a command_id passes, a digest of what it asks
   (everything but its event metadata, deadline and reason, which a
   re-publication may renew) is stored in Redis; the same id asking something
   else later is a replay (`replayed`).

A refused record goes to the dead-letter topic with the reason in
`sits_dlq_reason` and changes nothing. The same command redelivered (same
content) passes, and the executor answers it as a duplicate.

With no key ring configured every command is refused (`no_keys`), unless the
executor was told to accept unsigned commands (development, benchmarks).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.executor.adapters.redis_state import StateUnavailable
from sits.runtime.bus import DeadLetter, ReceivedEvent
from sits.runtime.clock import Clock
from sits.runtime.contract import format_target_key
from sits.runtime.events import seconds
from sits.runtime.signing import SignatureError, Verifier
from sits.v1 import events_pb2

log = logging.getLogger(__name__)

Handler = Callable[[ReceivedEvent], Awaitable[None]]

MAX_DEADLINE_AHEAD_S = 24 * 3600
DIGEST_TTL_S = 7 * 24 * 3600  # as long as the executor remembers applied commands

# First content wins: store the digest if the id is new, and answer the digest stored for it.
_FIRST_DIGEST = """
local stored = redis.call('GET', KEYS[1])
if stored then
  return stored
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return ARGV[1]
"""


def action_digest(command: events_pb2.HealingCommand) -> str:
    """What a command asks for, as a digest: its event metadata, deadline and reason left out."""
    content = events_pb2.HealingCommand()
    content.CopyFrom(command)
    content.ClearField("meta")
    content.ClearField("deadline")
    content.reason = ""
    key = format_target_key(command.meta.target).encode()
    return hashlib.sha256(key + b"\x00" + content.SerializeToString(deterministic=True)).hexdigest()


class CommandDigests:
    """The first content digest seen per command_id, in Redis (`<prefix>digest:<command_id>`)."""

    def __init__(self, client: aioredis.Redis, prefix: str = "sits:executor:", ttl_s: int = DIGEST_TTL_S) -> None:
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._script = client.register_script(_FIRST_DIGEST)

    async def first(self, command_id: str, digest: str) -> str:
        """The digest stored for `command_id`: `digest` itself when the id is new."""
        try:
            stored = await self._script(keys=[f"{self._prefix}digest:{command_id}"], args=[digest, self._ttl_s])
        except (RedisError, OSError) as error:
            raise StateUnavailable(f"Redis unreachable while checking command {command_id}: {error}") from error
        return stored.decode() if isinstance(stored, bytes) else str(stored)


class CommandGate:
    """Checks each command record before `handler` sees it; raises DeadLetter with the reason."""

    def __init__(
        self,
        verifier: Verifier | None,
        digests: CommandDigests,
        clock: Clock,
        *,
        accept_unsigned: bool = False,
    ) -> None:
        self._verifier = verifier
        self._digests = digests
        self._clock = clock
        self._accept_unsigned = accept_unsigned
        self.passed = 0
        self.refused: dict[str, int] = {}

    def wrap(self, handler: Handler) -> Handler:
        async def gated(event: ReceivedEvent) -> None:
            if isinstance(event.message, events_pb2.HealingCommand):
                await self.check(event, event.message)
            await handler(event)

        return gated

    async def check(self, event: ReceivedEvent, command: events_pb2.HealingCommand) -> None:
        if self._accept_unsigned:
            self.passed += 1
            return
        try:
            if self._verifier is None:
                raise DeadLetter(
                    "no_keys",
                    "no_keys: this executor has no verifying keys (SITS_EXECUTOR_VERIFY_KEYS_FILE) and applies "
                    "no command from Kafka",
                )
            try:
                key_id = self._verifier.verify(event.headers, event.record_key, event.record_value)
            except SignatureError as error:
                raise DeadLetter(error.category, f"{error.category}: {error}; command {command.command_id!r}") from None
            self._check_deadline(command)
            digest = action_digest(command)
            stored = await self._digests.first(command.command_id, digest)
            if stored != digest:
                raise DeadLetter(
                    "replayed",
                    f"replayed: command {command.command_id!r} was seen before asking something else "
                    f"(signed by key {key_id!r})",
                )
        except DeadLetter as refused:
            self.refused[refused.category] = self.refused.get(refused.category, 0) + 1
            raise
        self.passed += 1

    def _check_deadline(self, command: events_pb2.HealingCommand) -> None:
        if not command.HasField("deadline"):
            raise DeadLetter("bad_deadline", f"bad_deadline: command {command.command_id!r} has no deadline")
        deadline = seconds(command.deadline)
        now = self._clock.now()
        if now > deadline:
            raise DeadLetter(
                "expired",
                f"expired: command {command.command_id!r} passed its deadline {now - deadline:.3f} s ago "
                "(a replay, or it waited too long); not applied",
            )
        if deadline - now > MAX_DEADLINE_AHEAD_S:
            raise DeadLetter(
                "bad_deadline",
                f"bad_deadline: command {command.command_id!r} has a deadline {deadline - now:.0f} s ahead "
                f"(at most {MAX_DEADLINE_AHEAD_S} s)",
            )
