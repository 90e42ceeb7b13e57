"""Envoy in the data path, driven through its admin API and the overload pressure file.

- Circuit breakers: `POST /runtime_modify?circuit_breakers.<cluster>.default.max_requests=N`
  takes effect at once. The mesh gives every priority tier its own cluster,
  `<upstream>_<p0|p1|p2>` (see sits_mesh.envoy_config.breaker_key).
- Rate limits and route shedding are runtime keys too (`sits.ratelimit.*`,
  `sits.shed.<p1|p2>` in percent); `runtime_modify` sets any of them.
- Pressure: the overload manager's `injected_resource` monitor reads a number
  in [0, 1] from a file that must be replaced by atomic rename.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from services.executor.domain import Tier


class EnvoyUnavailable(RuntimeError):
    pass


def breaker_runtime_key(upstream_cluster: str, tier: Tier, field: str = "max_requests") -> str:
    # The priority segment is Envoy's routing priority (lowercase); SITS tiers are separate clusters.
    return f"circuit_breakers.{upstream_cluster}_{tier.mesh_name}.default.{field}"


def shed_runtime_key(tier: Tier) -> str:
    return f"sits.shed.{tier.mesh_name}"


class EnvoyAdmin:
    def __init__(self, admin_url: str, timeout_s: float = 2.0) -> None:
        self.admin_url = admin_url.rstrip("/")
        self._timeout_s = timeout_s

    def _request(self, method: str, path: str) -> str:
        request = urllib.request.Request(self.admin_url + path, method=method, data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                body: bytes = response.read()
                return body.decode(errors="replace")
        except urllib.error.HTTPError as error:
            raise EnvoyUnavailable(f"Envoy admin {method} {path}: HTTP {error.code} {error.read()[:200]!r}") from error
        except (urllib.error.URLError, OSError) as error:
            raise EnvoyUnavailable(f"Envoy admin {self.admin_url} unreachable: {error}") from error

    async def runtime_modify(self, values: dict[str, int | float | str]) -> None:
        if not values:
            return
        query = urllib.parse.urlencode({k: str(v) for k, v in values.items()})
        await asyncio.to_thread(self._request, "POST", f"/runtime_modify?{query}")

    async def runtime(self) -> dict[str, str]:
        import json

        text = await asyncio.to_thread(self._request, "GET", "/runtime")
        entries = json.loads(text).get("entries", {})
        return {key: str(entry.get("final_value", "")) for key, entry in entries.items()}

    async def set_breaker_limits(self, upstream_cluster: str, limits: dict[Tier, int]) -> None:
        await self.runtime_modify({breaker_runtime_key(upstream_cluster, t): n for t, n in limits.items()})

    async def breaker_limits(self, upstream_cluster: str) -> dict[Tier, int | None]:
        runtime = await self.runtime()
        found: dict[Tier, int | None] = {}
        for tier in Tier:
            raw = runtime.get(breaker_runtime_key(upstream_cluster, tier))
            found[tier] = int(raw) if raw not in (None, "") else None
        return found


def write_pressure_file(path: Path, value: float) -> None:
    """Replace `path` with `value` by atomic rename, so Envoy never reads half a number."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"pressure must be within [0, 1], got {value}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{value:.4f}")
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise


def read_pressure_file(path: Path) -> float | None:
    try:
        value = float(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return value if 0.0 <= value <= 1.0 else None
