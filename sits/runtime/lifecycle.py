"""How a SITS process starts and stops.

A service is an async function `serve(settings, stop)` that runs until the
`stop` event is set and then drains: it finishes the record in hand, commits
and closes its clients (`sits.runtime.service.ServiceApp` owns them). Run as a
process, `stop` is None and the app makes its own: SIGTERM and the first SIGINT
set it; a second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from sits.runtime.settings import S, SettingsError, load_settings
from sits.runtime.tracing import setup_tracing

log = logging.getLogger(__name__)

# `stop` None: the service runs as the process and stops on SIGTERM/SIGINT.
Serve = Callable[[S, asyncio.Event | None], Coroutine[Any, Any, None]]


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # aiokafka logs every reconnect attempt at ERROR; the bus reports outages itself.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL if level != "DEBUG" else logging.DEBUG)


def install_stop_signals(stop: asyncio.Event) -> Callable[[], None]:
    """SIGTERM and SIGINT set `stop`; returns what puts the previous handlers back."""
    loop = asyncio.get_running_loop()
    interrupts = 0

    def on_interrupt() -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            log.warning("second interrupt: exiting now")
            os._exit(130)
        log.info("interrupt: draining (interrupt again to exit at once)")
        stop.set()

    def on_term() -> None:
        log.info("SIGTERM: draining")
        stop.set()

    loop.add_signal_handler(signal.SIGINT, on_interrupt)
    loop.add_signal_handler(signal.SIGTERM, on_term)

    def remove() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    return remove


def _freeze_after_full_collection(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


def freeze_long_lived_objects() -> None:
    """After each full collection, move the objects that survived it out of the collector's sight (`gc.freeze`).

    A decision replica keeps each target's recent samples (1,200 objects and their parts per target): at 5,000
    targets, tens of millions of objects that every full collection walks, in pauses that grew past a second
    and held the whole event loop, urgent records included (docs/fleet.md). Frozen, they still go as soon as
    nothing refers to them (reference counting), so the windows' old samples are freed as before; the next full
    collection walks only what was made since the last. The cost: a reference cycle among objects that had
    survived a full collection, once unreachable, is not reclaimed. The services keep few of those (their
    long-lived state is trees, not cycles).
    """
    if _freeze_after_full_collection not in gc.callbacks:
        gc.callbacks.append(_freeze_after_full_collection)


def run_service(name: str, settings_cls: type[S], serve: Serve[S]) -> int:
    """Load settings (failing fast), set up logs and traces, and run `serve` until a signal stops it."""
    try:
        settings = load_settings(settings_cls)
    except SettingsError as err:
        print(f"sits {name}: {err}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    setup_tracing(f"sits-{name}", settings.otlp_endpoint)
    freeze_long_lived_objects()

    asyncio.run(serve(settings, None))
    return 0
