"""The SITS event envelope: topics, record keys and CloudEvents headers.

Records follow the CloudEvents Kafka protocol binding in binary mode: the
protobuf message is the record value and the event attributes travel as
`ce_*` headers, so SRE tooling can read the topics with nothing but the
`.proto` files.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import timestamp_pb2
from google.protobuf.message import DecodeError, Message

from sits.runtime.contract import format_target_key
from sits.v1 import common_pb2, events_pb2

SPEC_VERSION = "1.0"
CONTENT_TYPE = "application/protobuf"
DLQ_REASON_HEADER = "sits_dlq_reason"

# ce_type is the message's full protobuf name; a type not listed is refused.
EVENT_TYPES: dict[str, type[Message]] = {
    cls.DESCRIPTOR.full_name: cls
    for cls in (
        events_pb2.MetricSample,
        events_pb2.MetricBatch,
        events_pb2.OomEvent,
        events_pb2.HealingCommand,
        events_pb2.ActionResult,
        events_pb2.ValidationVerdict,
    )
}


@dataclass(frozen=True)
class Topics:
    """Topic names; a prefix keeps test runs and tenants apart."""

    prefix: str = ""

    @property
    def metrics(self) -> str:
        return f"{self.prefix}sits.metrics.v1"

    @property
    def metrics_urgent(self) -> str:
        """Samples under memory pressure: a lane of their own, so a backlog of calm samples never delays them."""
        return f"{self.prefix}sits.metrics.urgent.v1"

    @property
    def oom(self) -> str:
        return f"{self.prefix}sits.oom.v1"

    @property
    def samples(self) -> list[str]:
        """Where metric samples travel: the calm lane, then the urgent one."""
        return [self.metrics, self.metrics_urgent]

    @property
    def urgent(self) -> list[str]:
        """What a consumer handles before anything else it has fetched."""
        return [self.metrics_urgent, self.oom]

    @property
    def commands(self) -> str:
        return f"{self.prefix}sits.healing.commands.v1"

    @property
    def results(self) -> str:
        return f"{self.prefix}sits.healing.results.v1"

    @property
    def validation(self) -> str:
        return f"{self.prefix}sits.validation.v1"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}sits.deadletter.v1"

    def all(self) -> list[str]:
        return [
            self.metrics,
            self.metrics_urgent,
            self.oom,
            self.commands,
            self.results,
            self.validation,
            self.deadletter,
        ]


class EnvelopeError(ValueError):
    """A record that is not a valid SITS event; the message is the dead-letter reason.

    `category` is a short, bounded label (for metrics): malformed_header,
    unknown_type, undecodable.
    """

    def __init__(self, category: str, reason: str) -> None:
        super().__init__(reason)
        self.category = category


def meta_of(message: Message) -> common_pb2.EventMeta:
    meta = getattr(message, "meta", None)
    if not isinstance(meta, common_pb2.EventMeta):
        raise TypeError(f"{type(message).__name__} carries no EventMeta")
    return meta


_SPEC_HEADER = ("ce_specversion", SPEC_VERSION.encode())
_CONTENT_TYPE_HEADER = ("content-type", CONTENT_TYPE.encode())


def rfc3339(seconds_since_epoch: float) -> str:
    whole = int(seconds_since_epoch)
    micros = round((seconds_since_epoch - whole) * 1e6)
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(whole))}.{micros:06d}Z"


def cloudevent_headers(message: Message, key: str | None = None) -> list[tuple[str, bytes]]:
    """The binary-mode CloudEvents headers of `message` (`key`: its target key, if already known)."""
    meta = meta_of(message)
    if not meta.event_id:
        raise ValueError(f"{type(message).__name__} has no meta.event_id")
    produced = seconds(meta.produced_at) if meta.HasField("produced_at") else time.time()
    return [
        _SPEC_HEADER,
        ("ce_id", meta.event_id.encode()),
        ("ce_type", message.DESCRIPTOR.full_name.encode()),
        ("ce_source", (meta.source or "sits").encode()),
        ("ce_time", rfc3339(produced).encode()),
        ("ce_subject", (key if key is not None else format_target_key(meta.target)).encode()),
        _CONTENT_TYPE_HEADER,
    ]


def header_value(headers: list[tuple[str, bytes]] | tuple[tuple[str, bytes], ...], name: str) -> str | None:
    for key, value in headers:
        if key == name:
            try:
                return value.decode()
            except UnicodeDecodeError as err:
                raise EnvelopeError("malformed_header", f"header {name} is not UTF-8") from err
    return None


def decode_event(headers: list[tuple[str, bytes]] | tuple[tuple[str, bytes], ...], value: bytes | None) -> Message:
    """Decode one record into its protobuf message, or raise EnvelopeError with the reason."""
    spec = header_value(headers, "ce_specversion")
    if spec != SPEC_VERSION:
        raise EnvelopeError("malformed_header", f"ce_specversion is {spec!r}, expected {SPEC_VERSION!r}")
    ce_type = header_value(headers, "ce_type")
    if not ce_type:
        raise EnvelopeError("malformed_header", "missing ce_type header")
    cls = EVENT_TYPES.get(ce_type)
    if cls is None:
        raise EnvelopeError("unknown_type", f"unknown ce_type {ce_type!r}")
    content_type = header_value(headers, "content-type")
    if content_type != CONTENT_TYPE:
        raise EnvelopeError("malformed_header", f"content-type is {content_type!r}, expected {CONTENT_TYPE!r}")
    ce_id = header_value(headers, "ce_id")
    if not ce_id:
        raise EnvelopeError("malformed_header", "missing ce_id header")
    if value is None:
        raise EnvelopeError("undecodable", "record has no value")
    message = cls()
    try:
        message.ParseFromString(value)
    except DecodeError as err:
        raise EnvelopeError("undecodable", f"value is not a valid {ce_type}: {err}") from err
    meta = meta_of(message)
    if meta.event_id != ce_id:
        raise EnvelopeError("undecodable", f"ce_id {ce_id!r} does not match meta.event_id {meta.event_id!r}")
    return message


def decode_events(
    headers: list[tuple[str, bytes]] | tuple[tuple[str, bytes], ...], value: bytes | None
) -> list[Message]:
    """The events of one record: its message, or the samples of a MetricBatch, oldest first.

    A batch holding a sample of another target is refused whole (EnvelopeError): its record key
    would have put that sample in a partition whose consumer does not own the target's order.
    """
    message = decode_event(headers, value)
    if not isinstance(message, events_pb2.MetricBatch):
        return [message]
    target = message.meta.target
    for index, sample in enumerate(message.samples):
        if sample.meta.target != target:
            raise EnvelopeError(
                "undecodable",
                f"MetricBatch sample {index} is for {format_target_key(sample.meta.target)!r}, "
                f"the batch for {format_target_key(target)!r}",
            )
    return list(message.samples)


def metric_batch(samples: Sequence[events_pb2.MetricSample], source: str) -> events_pb2.MetricBatch:
    """One record's worth of samples of one target (the first sample's), stamped as the last one."""
    last = samples[-1].meta
    batch = events_pb2.MetricBatch(meta=common_pb2.EventMeta(event_id=new_id(), source=source))
    batch.meta.target.CopyFrom(samples[0].meta.target)
    batch.meta.produced_at.CopyFrom(last.produced_at)
    batch.samples.extend(samples)
    return batch


def new_meta(source: str, target: common_pb2.Target, now: float) -> common_pb2.EventMeta:
    """Metadata for a new event produced at `now` (epoch seconds, from the caller's clock)."""
    meta = common_pb2.EventMeta(event_id=new_id(), source=source)
    meta.target.CopyFrom(target)
    meta.produced_at.FromNanoseconds(int(now * 1e9))
    return meta


def new_id() -> str:
    return uuid.uuid4().hex


def seconds(timestamp: timestamp_pb2.Timestamp) -> float:
    return timestamp.seconds + timestamp.nanos / 1e9
