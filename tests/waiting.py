"""Bounded waiting for tests: every wait has a count and a time limit."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


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


async def polled_until(
    read: Callable[[], Awaitable[T]], predicate: Callable[[T], bool], timeout_s: float, interval_s: float
) -> T:
    """Read until `predicate` holds of what was read and return it; after `timeout_s`, AssertionError with the last."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await read()
        if predicate(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"never matched within {timeout_s} s; last: {value}")
        await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def in_background(
    run: Callable[[asyncio.Event], Awaitable[object]], stop_s: float
) -> AsyncIterator[asyncio.Event]:
    """`run(stop)` as a task for the block; on the way out `stop` is set and the task has `stop_s` to end."""
    stop = asyncio.Event()
    task: asyncio.Future[object] = asyncio.ensure_future(run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, stop_s)
