"""Bounded waiting for tests: every wait has a count and a time limit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.05) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / interval_s) + 1):
        if condition():
            return True
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(interval_s)
    return condition()
