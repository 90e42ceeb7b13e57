"""What a healing action promises the validator: one vocabulary for the decision that states it
and the validator that checks it (on the wire: sits.v1.Promise).

An unset term (None, False) is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from sits.v1 import events_pb2


@dataclass(frozen=True, slots=True)
class Promise:
    settle_s: float = 0.0
    p0_queue_wait_p90_s: float | None = None
    no_p0_refused: bool = False
    engine_alive: bool = True
    no_oom: bool = True
    gpu_memory_fraction_below: float | None = None
    preemptions_per_s_below: float | None = None
    running_at_most: int | None = None
    effect: str = ""
    engine_memory_bytes_below: int | None = None


_Optional = Literal[
    "p0_queue_wait_p90_s",
    "gpu_memory_fraction_below",
    "preemptions_per_s_below",
    "running_at_most",
    "engine_memory_bytes_below",
]
_OPTIONAL: Final[tuple[_Optional, ...]] = (
    "p0_queue_wait_p90_s",
    "gpu_memory_fraction_below",
    "preemptions_per_s_below",
    "running_at_most",
    "engine_memory_bytes_below",
)


def promise_to_pb(promise: Promise) -> events_pb2.Promise:
    message = events_pb2.Promise(
        settle_seconds=promise.settle_s,
        no_p0_refused=promise.no_p0_refused,
        engine_alive=promise.engine_alive,
        no_oom=promise.no_oom,
        effect=promise.effect,
    )
    for name in _OPTIONAL:
        value = getattr(promise, name)
        if value is not None:
            setattr(message, name, value)
    return message


def promise_from_pb(message: events_pb2.Promise) -> Promise:
    optional = {name: getattr(message, name) if message.HasField(name) else None for name in _OPTIONAL}
    return Promise(
        settle_s=message.settle_seconds,
        no_p0_refused=message.no_p0_refused,
        engine_alive=message.engine_alive,
        no_oom=message.no_oom,
        effect=message.effect,
        **optional,
    )
