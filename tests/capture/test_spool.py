"""The durable spool on a real disk: order, durability across reopen, torn tails, bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.capture.spool import FsyncPolicy, RecordKind, Spool, SpoolRecord
from sits.runtime.clock import ManualClock


def metric(i: int, size: int = 100) -> SpoolRecord:
    return SpoolRecord(RecordKind.METRIC, "sits.metrics.v1", i.to_bytes(4, "big") + b"m" * size)


def oom(i: int) -> SpoolRecord:
    return SpoolRecord(RecordKind.OOM, "sits.oom.v1", i.to_bytes(4, "big") + b"oom")


def ids(records: list[SpoolRecord]) -> list[int]:
    return [int.from_bytes(r.payload[:4], "big") for r in records]


@pytest.mark.parametrize("policy", list(FsyncPolicy))
def test_records_survive_reopen_in_order(tmp_path: Path, policy: FsyncPolicy) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, fsync=policy, segment_bytes=1000)
    for i in range(30):
        assert spool.append(oom(i) if i % 7 == 0 else metric(i))
    spool.close()
    again = Spool(tmp_path, max_bytes=1 << 20, fsync=policy, segment_bytes=1000)
    assert again.pending == 30
    peeked = again.peek(100)
    assert ids(peeked) == list(range(30))
    assert [r.kind for r in peeked][:2] == [RecordKind.OOM, RecordKind.METRIC]
    assert peeked[0].topic == "sits.oom.v1"


def test_drain_commits_and_resumes_after_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=700)
    for i in range(20):
        spool.append(metric(i))
    assert ids(spool.peek(5)) == [0, 1, 2, 3, 4]
    spool.commit(5)
    assert spool.pending == 15
    assert ids(spool.peek(3)) == [5, 6, 7]
    spool.commit(2)
    spool.close()
    # The cursor keeps a restart from publishing the committed head again.
    again = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=700)
    assert ids(again.peek(100)) == list(range(7, 20))
    again.commit(13)
    assert again.pending == 0
    assert list(tmp_path.glob("seg-*.log")) == []


def test_torn_tail_is_cut_and_earlier_records_kept(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, fsync="always")
    for i in range(3):
        spool.append(metric(i))
    spool.close()
    segment = next(tmp_path.glob("seg-*.log"))
    data = segment.read_bytes()
    segment.write_bytes(data + metric(99).encode()[:-10])  # a crash mid-append
    again = Spool(tmp_path, max_bytes=1 << 20)
    assert ids(again.peek(10)) == [0, 1, 2]
    assert again.truncated_bytes > 0
    assert segment.stat().st_size == len(data)


def test_corrupt_crc_stops_at_the_bad_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, fsync="always")
    for i in range(4):
        spool.append(metric(i, size=10))
    spool.close()
    segment = next(tmp_path.glob("seg-*.log"))
    data = bytearray(segment.read_bytes())
    record_size = len(metric(0, size=10).encode())
    data[2 * record_size + 12] ^= 0xFF  # flip a byte inside the third record's body
    segment.write_bytes(bytes(data))
    assert ids(Spool(tmp_path, max_bytes=1 << 20).peek(10)) == [0, 1]


def test_bound_drops_oldest_metrics_and_never_ooms(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=8192, segment_bytes=1024, fsync="never")
    appended = []
    for i in range(200):
        record = oom(i) if i % 10 == 0 else metric(i)
        spool.append(record)
        appended.append(record)
    assert spool.dropped_samples > 0
    assert spool.total_bytes <= 8192
    remaining = spool.peek(1000)
    kept = ids(remaining)
    # Every OOM survives; the metric samples kept are the newest ones, in order.
    assert [i for i in kept if i % 10 == 0] == list(range(0, 200, 10))
    metrics_kept = [i for i in kept if i % 10]
    assert metrics_kept == sorted(metrics_kept)
    assert metrics_kept[-1] == 199
    assert kept == sorted(kept)
    assert spool.dropped_samples + len(metrics_kept) == 180


def test_ooms_alone_may_pass_the_bound(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=4096, segment_bytes=512, fsync="never")
    for i in range(400):
        assert spool.append(oom(i))
    assert spool.total_bytes > 4096 and spool.overflow_bytes > 0
    assert spool.append(metric(1000)) is False  # a sample finds no room: dropped and counted
    assert spool.dropped_samples == 1
    assert ids(spool.peek(1000)) == list(range(400))


def test_interval_fsync_follows_the_clock(tmp_path: Path) -> None:
    clock = ManualClock()
    spool = Spool(tmp_path, max_bytes=1 << 20, fsync="interval", fsync_interval_s=1.0, clock=clock)
    spool.append(metric(1))
    assert spool._dirty  # within the interval: not yet synced
    clock.advance(1.5)
    spool.append(metric(2))
    assert not spool._dirty


def test_strip_during_outstanding_peek_loses_no_oom(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=4096, segment_bytes=600, fsync="never")
    spool.append(oom(0))
    for i in range(1, 8):
        spool.append(metric(i))
    peeked = spool.peek(3)
    assert ids(peeked) == [0, 1, 2]
    for i in range(8, 60):
        spool.append(metric(i))  # forces the head segment to be stripped
    spool.commit(3)  # stale: ignored
    assert 0 in ids(spool.peek(1000))
