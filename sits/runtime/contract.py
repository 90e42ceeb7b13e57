"""The loop's vocabulary, written once: target keys, priority tiers, action kinds, memory fraction.

Every service, the mesh and the vLLM plugin speak it, so it stays light: the standard library only
(no grpc, protobuf, Kafka, Redis or settings), since the plugin imports it inside the engine process.
Protobuf enums cross it as plain ints and protobuf messages as duck-typed objects.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol

if TYPE_CHECKING:
    # Only the annotation: the sample is passed in, generated code is never imported here.
    from sits.v1 import events_pb2

# ---------------------------------------------------------------- target keys


class _TargetLike(Protocol):
    @property
    def host(self) -> str: ...
    @property
    def gpu_uuid(self) -> str: ...
    @property
    def mig_instance(self) -> str: ...
    @property
    def engine(self) -> str: ...


class TargetKey(NamedTuple):
    host: str
    gpu_uuid: str
    mig_instance: str
    engine: str


def format_target_key(target: _TargetLike) -> str:
    """The record key `host/gpu_uuid/mig_instance/engine` (sits.v1.Target or any object with those fields).

    It keys Kafka records (one consumer owns one target's order), Redis entries and command digests.
    """
    return f"{target.host}/{target.gpu_uuid}/{target.mig_instance}/{target.engine}"


def parse_target_key(key: str) -> TargetKey:
    """The four parts of a key made by `format_target_key`; ValueError when it has fewer."""
    parts = key.split("/", 3)
    if len(parts) != 4:
        raise ValueError(f"target key {key!r} is not host/gpu_uuid/mig_instance/engine")
    return TargetKey(*parts)


# ---------------------------------------------------------------- priority tiers


class Tier(enum.IntEnum):
    """SITS priority tiers; a smaller value is more important (P0 highest).

    On the wire (sits.v1.Priority) a tier is its value + 1: 0 there is PRIORITY_UNSPECIFIED.
    """

    P0 = 0
    P1 = 1
    P2 = 2

    @classmethod
    def from_proto(cls, priority: int) -> Tier:
        """The tier of a sits.v1.Priority value; ValueError for UNSPECIFIED or an unknown value."""
        if not 1 <= priority <= len(cls):
            raise ValueError(f"priority {priority} is not P0, P1 or P2")
        return cls(priority - 1)

    def to_proto(self) -> int:
        return int(self) + 1

    @classmethod
    def parse(cls, name: str) -> Tier:
        """The tier named "p0".."p2" in any case (surrounding blanks ignored); ValueError otherwise."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown tier {name!r}: expected p0, p1 or p2") from None

    @property
    def mesh_name(self) -> str:
        """The tier's name in the mesh (Envoy cluster suffix, runtime keys, header value): p0, p1, p2."""
        return self.name.lower()


ALL_TIERS: Final[tuple[Tier, ...]] = tuple(Tier)
# An untagged request has claimed no protection and counts as this tier.
LOWEST_TIER: Final = Tier.P2
# The header Envoy routes by and, on every route, overwrites with the tier it routed the request as
# (sits_mesh.envoy_config): behind the mesh its value is the routed tier, never the client's claim.
TIER_HEADER: Final = "x-sits-priority"


# ---------------------------------------------------------------- action kinds


class ActionKind(enum.IntEnum):
    """Healing actions; values are sits.v1.ActionKind's, names drop its ACTION_KIND_ prefix."""

    SET_ENGINE_LIMITS = 1
    SHED_PRIORITY = 2
    SET_PRESSURE = 3
    FLUSH_CACHE = 4
    ABORT_LOW_PRIORITY = 5
    PAUSE_ADMISSION = 6
    RESUME_ADMISSION = 7
    MIG_REBALANCE = 8
    ROLLBACK = 9
    SET_TIER_BUDGET = 10

    @classmethod
    def from_proto(cls, kind: int) -> ActionKind:
        """The kind of a sits.v1.ActionKind value; ValueError for UNSPECIFIED or an unknown value."""
        try:
            return cls(kind)
        except ValueError:
            raise ValueError(f"unknown action kind {kind}") from None

    def to_proto(self) -> int:
        return int(self)

    @classmethod
    def parse(cls, name: str) -> ActionKind:
        """The kind named like "SET_ENGINE_LIMITS" (the ACTION_KIND_ prefix allowed); ValueError otherwise."""
        try:
            return cls[name.removeprefix("ACTION_KIND_")]
        except KeyError:
            raise ValueError(f"unknown action kind {name!r}") from None


def action_kind_name(kind: int) -> str:
    """The name of a sits.v1.ActionKind value without its prefix: "UNSPECIFIED" for 0, the number for one no
    kind has (messages, logs and metric labels must not fail on a bad value)."""
    if kind == 0:
        return "UNSPECIFIED"
    try:
        return ActionKind(kind).name
    except ValueError:
        return str(kind)


# ---------------------------------------------------------------- memory


def memory_fraction(sample: events_pb2.MetricSample) -> float | None:
    """How full the target is: device memory when NVML measured it, else the engine's KV cache."""
    if sample.HasField("gpu") and sample.gpu.total_bytes > 0:
        return sample.gpu.used_bytes / sample.gpu.total_bytes
    if sample.HasField("engine"):
        return sample.engine.kv_cache_usage
    return None
