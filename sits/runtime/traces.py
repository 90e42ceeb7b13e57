"""SITS trace v1: recorded GPU memory histories for replay, tests and demos.

Format (documented for people in traces/README.md):

- gzip-compressed JSON Lines (`*.jsonl.gz`); plain `*.jsonl` is read too.
- Line 1 is the header::

    {"format": "sits-trace", "version": 1, "name": str, "description": str,
     "recorded_on": str, "target": {"host", "gpu_uuid", "mig_instance", "engine"},
     "total_bytes": int}

- Every further line is one record, sorted by `t` (seconds from the start)::

    {"t": 0.1, "kind": "sample",
     "gpu": {used_bytes, total_bytes, reserved_bytes, free_bytes, utilization_pct},
     "processes": [{pid, used_bytes, name, is_target_engine}],
     "allocator": {allocated_bytes, reserved_bytes, inactive_split_bytes, alloc_retries, num_ooms},
     "engine": {...EngineLoad fields}}
    {"t": 12.3, "kind": "oom", "requested_bytes", "device_free_bytes", "device_total_bytes",
     "allocator": {...}, "message": str}

  Sub-objects of a sample are optional. Unknown keys are kept and ignored, so
  recorders may add notes without breaking readers.

This module is pure apart from `read_trace`/`write_trace`; the protobuf
conversions import `sits.v1` lazily so that the writer also runs where only the
standard library is available (the H200 recorder).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from sits.v1 import events_pb2

FORMAT = "sits-trace"
VERSION = 1

Record = dict[str, Any]
RecordKind = Literal["sample", "oom"]

GPU_FIELDS = ("used_bytes", "total_bytes", "reserved_bytes", "free_bytes", "utilization_pct")
PROCESS_FIELDS = ("pid", "used_bytes", "name", "is_target_engine")
ALLOCATOR_FIELDS = (
    "allocated_bytes",
    "reserved_bytes",
    "inactive_split_bytes",
    "alloc_retries",
    "num_ooms",
    "allocated_floor_bytes",
    "device_free_bytes",
)
ENGINE_FIELDS = (
    "kv_cache_usage",
    "num_requests_running",
    "num_requests_waiting",
    "num_preemptions",
    "admission_rejections",
    "tokens_in_flight",
    "kv_blocks_total",
    "kv_blocks_used",
    "block_size",
    "lora_adapters_loaded",
    "max_num_seqs",
    "max_num_batched_tokens",
)
# Fields added after the first traces were recorded: written only when set, so older records read
# and write back unchanged.
OPTIONAL_FIELDS = frozenset({"allocated_floor_bytes", "device_free_bytes", "max_num_seqs", "max_num_batched_tokens"})
LIMIT_FIELDS = ("max_num_running_reqs", "max_num_scheduled_tokens", "max_prefill_chunk_tokens", "admission_paused")
OOM_FIELDS = ("requested_bytes", "device_free_bytes", "device_total_bytes")


class TraceFormatError(ValueError):
    """The file is not a valid SITS trace v1; the message says where and why."""


@dataclass(frozen=True)
class TraceTarget:
    host: str = ""
    gpu_uuid: str = ""
    mig_instance: str = ""
    engine: str = ""

    def to_json(self) -> dict[str, str]:
        return {
            "host": self.host,
            "gpu_uuid": self.gpu_uuid,
            "mig_instance": self.mig_instance,
            "engine": self.engine,
        }


@dataclass(frozen=True)
class TraceHeader:
    name: str
    description: str = ""
    recorded_on: str = ""
    target: TraceTarget = field(default_factory=TraceTarget)
    total_bytes: int = 0
    # Extra header keys a recorder added (kept on round trip).
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update(
            {
                "format": FORMAT,
                "version": VERSION,
                "name": self.name,
                "description": self.description,
                "recorded_on": self.recorded_on,
                "target": self.target.to_json(),
                "total_bytes": self.total_bytes,
            }
        )
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TraceHeader:
        if raw.get("format") != FORMAT:
            raise TraceFormatError(f"line 1: format is {raw.get('format')!r}, expected {FORMAT!r}")
        if raw.get("version") != VERSION:
            raise TraceFormatError(f"line 1: version {raw.get('version')!r} is not supported (want {VERSION})")
        target_raw = raw.get("target") or {}
        if not isinstance(target_raw, Mapping):
            raise TraceFormatError("line 1: target must be an object")
        known = {"format", "version", "name", "description", "recorded_on", "target", "total_bytes"}
        return cls(
            name=str(raw.get("name", "")),
            description=str(raw.get("description", "")),
            recorded_on=str(raw.get("recorded_on", "")),
            target=TraceTarget(
                host=str(target_raw.get("host", "")),
                gpu_uuid=str(target_raw.get("gpu_uuid", "")),
                mig_instance=str(target_raw.get("mig_instance", "")),
                engine=str(target_raw.get("engine", "")),
            ),
            total_bytes=int(raw.get("total_bytes", 0)),
            extra={k: v for k, v in raw.items() if k not in known},
        )


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    records: list[Record]

    @property
    def duration_s(self) -> float:
        return float(self.records[-1]["t"]) if self.records else 0.0

    def samples(self) -> Iterator[Record]:
        return (r for r in self.records if r["kind"] == "sample")

    def ooms(self) -> Iterator[Record]:
        return (r for r in self.records if r["kind"] == "oom")


def validate_record(record: Mapping[str, Any], line_no: int, previous_t: float) -> float:
    """Check one record; return its `t`. Raises TraceFormatError with the line number."""
    t = record.get("t")
    if not isinstance(t, int | float) or isinstance(t, bool):
        raise TraceFormatError(f"line {line_no}: t must be a number, got {t!r}")
    if t < previous_t:
        raise TraceFormatError(f"line {line_no}: records must be sorted by t ({t} < {previous_t})")
    kind = record.get("kind")
    if kind == "oom":
        for name in OOM_FIELDS:
            if not isinstance(record.get(name), int):
                raise TraceFormatError(f"line {line_no}: oom record needs integer {name}")
    elif kind != "sample":
        raise TraceFormatError(f"line {line_no}: kind must be 'sample' or 'oom', got {kind!r}")
    return float(t)


def _open_text(path: Path, mode: Literal["rt", "wt"]) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    with _open_text(path, "rt") as stream:
        lines = [line for line in stream if line.strip()]
    if not lines:
        raise TraceFormatError(f"{path}: empty file, expected a header line")
    try:
        raw_header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"line 1: not JSON ({exc})") from exc
    if not isinstance(raw_header, dict):
        raise TraceFormatError("line 1: the header must be an object")
    header = TraceHeader.from_json(raw_header)
    records: list[Record] = []
    previous_t = 0.0
    for line_no, line in enumerate(lines[1:], start=2):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"line {line_no}: not JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise TraceFormatError(f"line {line_no}: a record must be an object")
        previous_t = validate_record(record, line_no, previous_t)
        records.append(record)
    return Trace(header=header, records=records)


def write_trace(path: str | Path, header: TraceHeader | Mapping[str, Any], records: Iterable[Mapping[str, Any]]) -> int:
    """Write a trace (gzip when the name ends in .gz); returns the number of records written.

    Records are validated (sorted by t, known kinds) before anything is written.
    """
    path = Path(path)
    head = (
        header
        if isinstance(header, TraceHeader)
        else TraceHeader.from_json({"format": FORMAT, "version": VERSION, **header})
    )
    checked: list[Mapping[str, Any]] = []
    previous_t = 0.0
    for line_no, record in enumerate(records, start=2):
        previous_t = validate_record(record, line_no, previous_t)
        checked.append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open_text(path, "wt") as stream:
        stream.write(json.dumps(head.to_json(), separators=(",", ":")) + "\n")
        for record in checked:
            stream.write(json.dumps(record, separators=(",", ":")) + "\n")
    return len(checked)


# ------------------------------------------------------------------ protobuf conversion


def _pick(raw: Mapping[str, Any] | None, names: tuple[str, ...]) -> dict[str, Any]:
    if not raw:
        return {}
    return {name: raw[name] for name in names if name in raw and raw[name] is not None}


def _target_pb(target: TraceTarget) -> Any:
    from sits.v1 import common_pb2

    return common_pb2.Target(
        host=target.host, gpu_uuid=target.gpu_uuid, mig_instance=target.mig_instance, engine=target.engine
    )


def record_to_sample(
    record: Mapping[str, Any],
    target: TraceTarget,
    *,
    produced_at: float,
    sequence: int,
    event_id: str,
    source: str = "capture/replay",
) -> events_pb2.MetricSample:
    """A `kind: sample` record as a MetricSample stamped at wall time `produced_at`."""
    from sits.v1 import events_pb2

    sample = events_pb2.MetricSample(source_kind=events_pb2.SAMPLE_SOURCE_REPLAY, sequence=sequence)
    sample.meta.event_id = event_id
    sample.meta.source = source
    sample.meta.target.CopyFrom(_target_pb(target))
    sample.meta.produced_at.FromNanoseconds(int(produced_at * 1e9))
    if record.get("gpu"):
        sample.gpu.CopyFrom(events_pb2.GpuMemory(**_pick(record["gpu"], GPU_FIELDS)))
    for proc in record.get("processes") or ():
        sample.processes.append(events_pb2.ProcessMemory(**_pick(proc, PROCESS_FIELDS)))
    if record.get("allocator"):
        sample.allocator.CopyFrom(events_pb2.AllocatorStats(**_pick(record["allocator"], ALLOCATOR_FIELDS)))
    if record.get("engine"):
        sample.engine.CopyFrom(events_pb2.EngineLoad(**_pick(record["engine"], ENGINE_FIELDS)))
        if record["engine"].get("limits"):
            sample.engine.limits.CopyFrom(events_pb2.EngineLimits(**_pick(record["engine"]["limits"], LIMIT_FIELDS)))
    return sample


def record_to_oom(
    record: Mapping[str, Any],
    target: TraceTarget,
    *,
    produced_at: float,
    event_id: str,
    source: str = "capture/replay",
) -> events_pb2.OomEvent:
    from sits.v1 import events_pb2

    oom = events_pb2.OomEvent(
        requested_bytes=int(record["requested_bytes"]),
        device_free_bytes=int(record["device_free_bytes"]),
        device_total_bytes=int(record["device_total_bytes"]),
        device_index=int(record.get("device_index", 0)),
        pid=int(record.get("pid", 0)),
        memory_snapshot_path=str(record.get("memory_snapshot_path", "")),
        message=str(record.get("message", "")),
    )
    oom.meta.event_id = event_id
    oom.meta.source = source
    oom.meta.target.CopyFrom(_target_pb(target))
    oom.meta.produced_at.FromNanoseconds(int(produced_at * 1e9))
    if record.get("allocator"):
        oom.allocator.CopyFrom(events_pb2.AllocatorStats(**_pick(record["allocator"], ALLOCATOR_FIELDS)))
    return oom


def _message_fields(message: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(message, name) for name in names if name not in OPTIONAL_FIELDS or getattr(message, name)}


def sample_to_record(sample: events_pb2.MetricSample, t: float) -> Record:
    """A MetricSample as a `kind: sample` record at `t` seconds from the trace start."""
    record: Record = {"t": round(t, 6), "kind": "sample"}
    if sample.HasField("gpu"):
        record["gpu"] = _message_fields(sample.gpu, GPU_FIELDS)
    if sample.processes:
        record["processes"] = [_message_fields(p, PROCESS_FIELDS) for p in sample.processes]
    if sample.HasField("allocator"):
        record["allocator"] = _message_fields(sample.allocator, ALLOCATOR_FIELDS)
    if sample.HasField("engine"):
        record["engine"] = _message_fields(sample.engine, ENGINE_FIELDS)
        limits: Any = sample.engine.limits
        if sample.engine.HasField("limits"):
            record["engine"]["limits"] = {name: getattr(limits, name) for name in LIMIT_FIELDS if limits.HasField(name)}
    return record


def oom_to_record(oom: events_pb2.OomEvent, t: float) -> Record:
    record: Record = {
        "t": round(t, 6),
        "kind": "oom",
        "requested_bytes": oom.requested_bytes,
        "device_free_bytes": oom.device_free_bytes,
        "device_total_bytes": oom.device_total_bytes,
        "message": oom.message,
    }
    if oom.HasField("allocator"):
        record["allocator"] = _message_fields(oom.allocator, ALLOCATOR_FIELDS)
    if oom.device_index:
        record["device_index"] = oom.device_index
    if oom.pid:
        record["pid"] = oom.pid
    if oom.memory_snapshot_path:
        record["memory_snapshot_path"] = oom.memory_snapshot_path
    return record


def header_target_from_pb(target: Any) -> TraceTarget:
    return TraceTarget(
        host=target.host, gpu_uuid=target.gpu_uuid, mig_instance=target.mig_instance, engine=target.engine
    )
