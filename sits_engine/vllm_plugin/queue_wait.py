"""How vLLM's engine processes wait for each other while busy (`vllm.general_plugins`: `sits_queue_wait`).

vLLM's EngineCore and its workers pass every step over a shared-memory queue. A reader that read within
the last second spins on it (`SpinCondition.wait`: yield the CPU, check again at once) and only after a
second without messages sleeps on the writer's notify socket. On a GPU node that costs one host core per
process, of many. On a CPU engine the EngineCore spins for the whole of every step the worker computes:
on a two-core host it holds the core the API server, Envoy and the SITS services would run on, and every
request's latency pays for it (docs/control.md, "The engine stops spinning").

SITS_ENGINE_QUEUE_POLL_S makes a busy reader sleep that long between checks instead: each hand-over
then ends up to that much later, and the core is free meanwhile. The stack sets 0.1 ms: a step of its
CPU engine takes about 4 ms and has two hand-overs, and 0.5 ms cost that engine a fifth of its
throughput (docs/control.md). The idle path (sleeping on the notify socket after a second) is vLLM's
own, untouched. Unset or 0, vLLM spins as it does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from sits_engine.vllm_plugin.environment import ENGINE_QUEUE_POLL_S

log = logging.getLogger("vllm.sits.queue_wait")


def poll_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """The sleep between checks SITS_ENGINE_QUEUE_POLL_S asks for; 0 where it is unset, empty or 0.

    A value that is not a number of seconds from 0 to 0.1 raises ValueError naming the variable, so a typo
    stops the engine at start-up instead of leaving it spinning, or sleeping through its steps, unnoticed.
    """
    raw = environ.get(ENGINE_QUEUE_POLL_S, "").strip()
    if not raw:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{ENGINE_QUEUE_POLL_S}={raw!r}: not a number of seconds") from None
    if not 0 <= seconds <= 0.1:
        raise ValueError(f"{ENGINE_QUEUE_POLL_S}={raw!r}: must be from 0 to 0.1 s")
    return seconds


def install(seconds: float, condition_cls: Any) -> None:
    """Make every busy `condition_cls` reader sleep `seconds` per check, including ones made before this ran."""
    original = getattr(condition_cls.wait, "__wrapped__", condition_cls.wait)

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(seconds)
        else:
            original(self, timeout_ms)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    condition_cls.wait = wait


def register() -> None:
    seconds = poll_seconds()
    if not seconds:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        # A vLLM without the spinning queue (older or newer): nothing to tune, and nothing worth failing on.
        with contextlib.suppress(Exception):
            log.warning("%s is set but this vLLM has no SpinCondition; left as it is", ENGINE_QUEUE_POLL_S)
        return
    install(seconds, SpinCondition)
    log.info("SITS: busy engine queue readers sleep %.3g ms between checks (%s)", seconds * 1000, ENGINE_QUEUE_POLL_S)
