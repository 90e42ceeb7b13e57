"""Envoy in the data path, driven through the mesh's admin client and pressure file.

- Circuit breakers: `POST /runtime_modify?circuit_breakers.<cluster>.default.max_requests=N`
  takes effect at once. The mesh gives every priority tier its own cluster,
  `<upstream>_<p0|p1|p2>` (`sits_mesh.envoy_config.breaker_key` names the key).
- Rate limits and route shedding are runtime keys too (`sits.ratelimit.*`,
  `sits.shed.<p1|p2>` in percent); `runtime_modify` sets any of them.
- Pressure: `sits_mesh.pressure.write_pressure` replaces the file that the overload
  manager's `injected_resource` monitor reads.
"""

from __future__ import annotations

import urllib.error
from typing import cast

from sits.runtime.contract import Tier
from sits_mesh import envoy_process
from sits_mesh.envoy_config import breaker_key
from sits_mesh.policy import PriorityName


class EnvoyUnavailable(envoy_process.EnvoyError):
    pass


def _breaker_key(upstream_cluster: str, tier: Tier) -> str:
    return breaker_key(upstream_cluster, cast(PriorityName, tier.mesh_name))


class EnvoyAdmin(envoy_process.EnvoyAdmin):
    """The mesh's admin client with the executor's short timeout; every failure is an EnvoyUnavailable.

    An action fails with that message in its result, so the operator reads why Envoy was not changed.
    """

    def __init__(self, admin_url: str, timeout_s: float = 2.0) -> None:
        super().__init__(admin_url)
        self._timeout_s = timeout_s

    async def admin(self, method: str, path: str, timeout_s: float | None = None) -> tuple[int, str]:
        try:
            status, body = await super().admin(method, path, self._timeout_s if timeout_s is None else timeout_s)
        except (urllib.error.URLError, OSError) as error:
            raise EnvoyUnavailable(f"Envoy admin {self.admin_url} unreachable: {error}") from error
        if status >= 400:
            raise EnvoyUnavailable(f"Envoy admin {method} {path}: HTTP {status} {body[:200]!r}")
        return status, body

    async def set_breaker_limits(self, upstream_cluster: str, limits: dict[Tier, int]) -> None:
        await self.runtime_modify({_breaker_key(upstream_cluster, t): n for t, n in limits.items()})

    async def breaker_limits(self, upstream_cluster: str) -> dict[Tier, int | None]:
        runtime = await self.runtime()
        found: dict[Tier, int | None] = {}
        for tier in Tier:
            raw = runtime.get(_breaker_key(upstream_cluster, tier))
            found[tier] = int(raw) if raw not in (None, "") else None
        return found
