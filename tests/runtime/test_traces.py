"""SITS trace v1 reader/writer and protobuf conversion."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sits.runtime.traces import (
    TraceFormatError,
    TraceHeader,
    TraceTarget,
    oom_to_record,
    read_trace,
    record_to_oom,
    record_to_sample,
    sample_to_record,
    write_trace,
)

TARGET = TraceTarget(host="h1", gpu_uuid="GPU-1", mig_instance="", engine="vllm-0")
GIB = 1 << 30


def _records() -> list[dict[str, object]]:
    return [
        {
            "t": 0.0,
            "kind": "sample",
            "gpu": {
                "used_bytes": 10 * GIB,
                "total_bytes": 80 * GIB,
                "reserved_bytes": GIB,
                "free_bytes": 69 * GIB,
                "utilization_pct": 42.5,
            },
            "processes": [{"pid": 7, "used_bytes": 9 * GIB, "name": "python", "is_target_engine": True}],
            "allocator": {
                "allocated_bytes": 8 * GIB,
                "reserved_bytes": 9 * GIB,
                "inactive_split_bytes": 3,
                "alloc_retries": 0,
                "num_ooms": 0,
            },
            "engine": {"kv_cache_usage": 0.5, "num_requests_running": 3, "num_requests_waiting": 1},
        },
        {"t": 0.1, "kind": "sample", "gpu": {"used_bytes": 11 * GIB, "total_bytes": 80 * GIB}},
        {
            "t": 0.2,
            "kind": "oom",
            "requested_bytes": 2 * GIB,
            "device_free_bytes": GIB,
            "device_total_bytes": 80 * GIB,
            "allocator": {"num_ooms": 1},
            "message": "boom",
        },
    ]


@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.jsonl"])
def test_write_then_read_round_trips(tmp_path: Path, name: str) -> None:
    header = TraceHeader(
        name="steady", description="d", recorded_on="H200", target=TARGET, total_bytes=80 * GIB, extra={"note": "x"}
    )
    path = tmp_path / name
    assert write_trace(path, header, _records()) == 3
    trace = read_trace(path)
    assert trace.header == header
    assert trace.records == _records()
    assert trace.duration_s == pytest.approx(0.2)
    assert len(list(trace.samples())) == 2 and len(list(trace.ooms())) == 1
    if name.endswith(".gz"):
        with gzip.open(path, "rt") as stream:
            assert json.loads(stream.readline())["format"] == "sits-trace"


def test_unsorted_records_are_refused(tmp_path: Path) -> None:
    records = _records()
    records[1]["t"] = -1.0
    with pytest.raises(TraceFormatError, match="line 3: records must be sorted"):
        write_trace(tmp_path / "x.jsonl", {"name": "x"}, records)


@pytest.mark.parametrize(
    ("header", "line", "reason"),
    [
        ({"format": "other", "version": 1}, None, "format is 'other'"),
        ({"format": "sits-trace", "version": 2}, None, "version 2 is not supported"),
        ({"format": "sits-trace", "version": 1}, {"t": 1, "kind": "weird"}, "line 2: kind must be"),
        ({"format": "sits-trace", "version": 1}, {"t": 1, "kind": "oom"}, "needs integer requested_bytes"),
        ({"format": "sits-trace", "version": 1}, {"t": "soon", "kind": "sample"}, "t must be a number"),
    ],
)
def test_bad_files_say_why(tmp_path: Path, header: dict[str, object], line: object, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    text = json.dumps(header) + "\n" + (json.dumps(line) + "\n" if line else "")
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=reason):
        read_trace(path)


def test_sample_record_converts_to_protobuf_and_back() -> None:
    record = _records()[0]
    sample = record_to_sample(record, TARGET, produced_at=1_700_000_000.5, sequence=9, event_id="e1")
    assert sample.meta.target.gpu_uuid == "GPU-1" and sample.meta.event_id == "e1"
    assert sample.sequence == 9
    assert sample.meta.produced_at.ToNanoseconds() == 1_700_000_000_500_000_000
    assert sample.gpu.used_bytes == 10 * GIB and sample.gpu.utilization_pct == 42.5
    assert sample.processes[0].is_target_engine
    assert sample.engine.num_requests_running == 3
    back = sample_to_record(sample, 0.0)
    assert back["gpu"] == record["gpu"]
    assert back["allocator"] == record["allocator"]
    assert back["processes"] == record["processes"]
    assert back["engine"]["kv_cache_usage"] == 0.5


def test_oom_record_converts_to_protobuf_and_back() -> None:
    record = _records()[2]
    oom = record_to_oom(record, TARGET, produced_at=5.0, event_id="o1")
    assert (oom.requested_bytes, oom.device_free_bytes, oom.allocator.num_ooms) == (2 * GIB, GIB, 1)
    back = oom_to_record(oom, 0.2)
    for key in ("requested_bytes", "device_free_bytes", "device_total_bytes", "message", "kind", "t"):
        assert back[key] == record[key]
