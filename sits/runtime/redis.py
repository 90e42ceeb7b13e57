"""Redis access (redis.asyncio) and the idempotency guard handlers share.

Connections follow `SITS_REDIS_URL` (redis:// or rediss:// for TLS, an ACL user
name in the URL) and, when `SITS_REDIS_PASSWORD_FILE` is set, authenticate with
the password in that file, read again for each new connection: a password
rotated in the file is picked up without a restart. URLs are only ever shown
with their password masked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.credentials import CredentialProvider
from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError, RedisError

from sits.runtime.secret_files import mask_url, read_secret
from sits.runtime.settings import Settings

START_HINT = (
    "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save '' --appendonly no "
    "--dir /var/lib/redis --logfile /var/log/redis/ci.log"
)
CREDENTIALS_HINT = "the user in SITS_REDIS_URL and the password in SITS_REDIS_PASSWORD_FILE or the URL"


class RedisUnavailable(RuntimeError):
    """Redis cannot be reached; the message says how to start it."""


class PasswordFileCredentials(CredentialProvider):
    """AUTH with the URL's user and the password in a file, read for each new connection."""

    def __init__(self, username: str, password_file: Path) -> None:
        self.username = username
        self.password_file = password_file

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        password = read_secret(self.password_file, "Redis password")
        return (self.username, password) if self.username else (password,)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        return self.get_credentials()


def connect(url: str, *, password_file: Path | None = None) -> aioredis.Redis:
    options: dict[str, Any] = {"socket_connect_timeout": 1.0, "socket_timeout": 2.0}
    if password_file is not None:
        parts = urlsplit(url)
        userinfo, at, hostport = parts.netloc.rpartition("@")
        username = unquote(userinfo.split(":", 1)[0]) if at else ""
        # The file's password wins over one in the URL; the user name stays the URL's.
        url = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
        options["credential_provider"] = PasswordFileCredentials(username, password_file)
    return aioredis.Redis.from_url(url, **options)


def connect_with(settings: Settings) -> aioredis.Redis:
    """A client for SITS_REDIS_URL, authenticating with SITS_REDIS_PASSWORD_FILE when set."""
    return connect(settings.redis_url, password_file=settings.redis_password_file)


def explain(error: BaseException) -> str | None:
    """A readable cause for errors that are about SITS's own credentials, else None."""
    if isinstance(error, AuthenticationError | AuthenticationWrongNumberOfArgsError):
        return f"Redis refused SITS's credentials ({CREDENTIALS_HINT}): {error}"
    if isinstance(error, NoPermissionError):
        return f"the Redis user SITS authenticates as lacks a permission SITS needs (its ACL): {error}"
    return None


async def check_redis(url: str, password_file: Path | None = None) -> None:
    """Raise RedisUnavailable with the cause (credentials) or the command that starts a local server."""
    client = connect(url, password_file=password_file)
    try:
        await client.ping()
    except (RedisError, OSError) as err:
        shown = mask_url(url)
        reason = explain(err)
        if reason is not None:
            raise RedisUnavailable(f"Redis at {shown}: {reason}") from err
        raise RedisUnavailable(f"Redis at {shown} is unreachable ({err}). Start it with:\n  {START_HINT}") from err
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
