"""Capture's durable spool: an append log on disk for events Kafka could not take.

Layout: a folder of segment files `seg-<n>.log`, oldest first. Each record is

    u32 length (big-endian) | u32 CRC32 of the body | body

with body = u8 kind (1 metric sample, 2 OOM event) | u16 topic length | topic |
u32 payload length | payload (the serialized protobuf). A torn tail (a crash
mid-append) fails its length or CRC and is cut off when the spool opens.

- fsync policy: `always` (every append), `interval` (at most every
  `fsync_interval_s`, and on close), `never` (the OS decides).
- bounded: when an append would pass `max_bytes`, the metric samples of the
  oldest closed segments are dropped (segment rewritten without them, counted
  in `dropped_samples`); OOM events are never dropped, so a spool holding only
  OOM events may pass the bound (`overflow_bytes`).
- drain in order: `peek(n)` reads from the head, `commit(n)` forgets what was
  published. Delivery is at least once: a crash between publish and commit
  publishes the same events again, and consumers de-duplicate on event_id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from pathlib import Path

from services.capture.domain import SegmentUsage, plan_spool_compaction
from sits.runtime.clock import Clock, SystemClock

log = logging.getLogger(__name__)

_HEAD = struct.Struct(">II")
_TOPIC_LEN = struct.Struct(">H")
_PAYLOAD_LEN = struct.Struct(">I")
MAX_RECORD_BYTES = 16 << 20


class RecordKind(IntEnum):
    METRIC = 1
    OOM = 2


class FsyncPolicy(StrEnum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


@dataclass(frozen=True)
class SpoolRecord:
    kind: RecordKind
    topic: str
    payload: bytes

    def encode(self) -> bytes:
        topic = self.topic.encode()
        body = b"".join(
            (
                bytes((self.kind,)),
                _TOPIC_LEN.pack(len(topic)),
                topic,
                _PAYLOAD_LEN.pack(len(self.payload)),
                self.payload,
            )
        )
        return _HEAD.pack(len(body), zlib.crc32(body)) + body

    @classmethod
    def decode_body(cls, body: bytes) -> SpoolRecord:
        kind = RecordKind(body[0])
        (topic_len,) = _TOPIC_LEN.unpack_from(body, 1)
        topic = body[3 : 3 + topic_len].decode()
        (payload_len,) = _PAYLOAD_LEN.unpack_from(body, 3 + topic_len)
        start = 3 + topic_len + _PAYLOAD_LEN.size
        payload = body[start : start + payload_len]
        if len(payload) != payload_len:
            raise ValueError("payload shorter than its length")
        return cls(kind, topic, payload)


class SpoolCorrupt(Exception):
    pass


@dataclass
class _Segment:
    number: int
    path: Path
    total_bytes: int = 0
    metric_bytes: int = 0
    metric_records: int = 0
    records: int = 0

    def usage(self) -> SegmentUsage:
        return SegmentUsage(self.total_bytes, self.metric_bytes, self.metric_records)

    def add(self, kind: RecordKind, size: int) -> None:
        self.total_bytes += size
        self.records += 1
        if kind is RecordKind.METRIC:
            self.metric_bytes += size
            self.metric_records += 1


def _read_records(path: Path) -> tuple[list[tuple[SpoolRecord, int]], int]:
    """Records with their encoded size, and the byte offset where valid data ends."""
    data = path.read_bytes()
    records: list[tuple[SpoolRecord, int]] = []
    offset = 0
    while offset + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, offset)
        end = offset + _HEAD.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            break
        body = data[offset + _HEAD.size : end]
        if zlib.crc32(body) != crc:
            break
        try:
            record = SpoolRecord.decode_body(body)
        except (ValueError, IndexError, struct.error):
            break
        records.append((record, end - offset))
        offset = end
    return records, offset


class Spool:
    """Not thread-safe: one owner (the publisher) appends, peeks and commits."""

    def __init__(
        self,
        directory: str | Path,
        *,
        max_bytes: int = 256 << 20,
        fsync: FsyncPolicy | str = FsyncPolicy.INTERVAL,
        fsync_interval_s: float = 1.0,
        segment_bytes: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        if max_bytes < 4096:
            raise ValueError("spool max_bytes must be at least 4096")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fsync = FsyncPolicy(fsync)
        self.fsync_interval_s = fsync_interval_s
        # Small enough that dropping one segment's samples frees a useful, not a huge, share.
        self.segment_bytes = segment_bytes or max(4096, max_bytes // 16)
        self._clock = clock or SystemClock()
        self._segments: list[_Segment] = []
        self._head_records = 0  # records of the first segment already committed
        self._head_offset = 0
        self._file: int | None = None
        self._last_fsync = self._clock.monotonic()
        self._dirty = False
        self.dropped_samples = 0
        self.truncated_bytes = 0
        self._peeked_sizes: list[int] = []
        self._peek_stale = False
        self._open_existing()
        self._read_cursor()

    # ------------------------------------------------------------------ state

    @property
    def pending(self) -> int:
        return sum(s.records for s in self._segments) - self._head_records

    @property
    def total_bytes(self) -> int:
        return sum(s.total_bytes for s in self._segments)

    @property
    def overflow_bytes(self) -> int:
        return max(0, self.total_bytes - self.max_bytes)

    def _open_existing(self) -> None:
        numbers = sorted(int(p.stem.split("-")[1]) for p in self.directory.glob("seg-*.log"))
        for number in numbers:
            path = self._path(number)
            records, valid_end = _read_records(path)
            size = path.stat().st_size
            if valid_end < size:
                # A torn or corrupt tail: everything after the last good record is cut.
                log.warning("spool segment %s: cutting %d bytes of torn tail", path.name, size - valid_end)
                self.truncated_bytes += size - valid_end
                with open(path, "r+b") as stream:
                    stream.truncate(valid_end)
            segment = _Segment(number, path)
            for record, size_of in records:
                segment.add(record.kind, size_of)
            if segment.records:
                self._segments.append(segment)
            else:
                path.unlink()

    def _path(self, number: int) -> Path:
        return self.directory / f"seg-{number:010d}.log"

    # ------------------------------------------------------------------ append

    def append(self, record: SpoolRecord) -> bool:
        """Append durably (per the fsync policy). False when a metric sample was dropped for room."""
        data = record.encode()
        usage = [s.usage() for s in self._segments]
        plan = plan_spool_compaction(usage, len(data), record.kind is RecordKind.OOM, self.max_bytes)
        for index in sorted(plan.strip, reverse=True):
            self._strip_metrics(index)
        if plan.drop_incoming:
            self.dropped_samples += 1
            return False
        segment = self._writable_segment(len(data))
        assert self._file is not None
        os.write(self._file, data)
        segment.add(record.kind, len(data))
        self._dirty = True
        self._maybe_fsync()
        return True

    def _writable_segment(self, size: int) -> _Segment:
        last = self._segments[-1] if self._segments else None
        if last is None or self._file is None or last.total_bytes + size > self.segment_bytes:
            self._close_file()
            number = (last.number + 1) if last else 1
            last = _Segment(number, self._path(number))
            self._segments.append(last)
            self._file = os.open(last.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._fsync_dir()
        return last

    def _maybe_fsync(self) -> None:
        if self._file is None or not self._dirty or self.fsync is FsyncPolicy.NEVER:
            return
        now = self._clock.monotonic()
        if self.fsync is FsyncPolicy.ALWAYS or now - self._last_fsync >= self.fsync_interval_s:
            os.fsync(self._file)
            self._last_fsync = now
            self._dirty = False

    def sync(self) -> None:
        if self._file is not None and self._dirty:
            os.fsync(self._file)
            self._dirty = False
            self._last_fsync = self._clock.monotonic()

    def _fsync_dir(self) -> None:
        if self.fsync is FsyncPolicy.NEVER:
            return
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _strip_metrics(self, index: int) -> None:
        segment = self._segments[index]
        records, _ = _read_records(segment.path)
        skip = self._head_records if index == 0 else 0
        kept = [(r, n) for i, (r, n) in enumerate(records) if i >= skip and r.kind is RecordKind.OOM]
        dropped = sum(1 for i, (r, _n) in enumerate(records) if i >= skip and r.kind is RecordKind.METRIC)
        temporary = segment.path.with_suffix(".tmp")
        with open(temporary, "wb") as stream:
            for record, _size in kept:
                stream.write(record.encode())
            stream.flush()
            if self.fsync is not FsyncPolicy.NEVER:
                os.fsync(stream.fileno())
        os.replace(temporary, segment.path)
        self._fsync_dir()
        self.dropped_samples += dropped
        replacement = _Segment(segment.number, segment.path)
        for record, size in kept:
            replacement.add(record.kind, size)
        if index == 0:
            self._head_records = 0
            self._head_offset = 0
            # An outstanding peek no longer matches the file: its commit becomes a no-op and the
            # surviving OOM events are peeked again (a duplicate at worst, never a loss).
            self._peek_stale = bool(self._peeked_sizes)
            self._peeked_sizes = []
        if replacement.records:
            self._segments[index] = replacement
        else:
            segment.path.unlink()
            del self._segments[index]

    # ------------------------------------------------------------------ drain

    def peek(self, max_records: int) -> list[SpoolRecord]:
        """Up to `max_records` records from the head, oldest first, without removing them."""
        out: list[SpoolRecord] = []
        self._peeked_sizes = []
        self._peek_stale = False
        self.sync()
        for position, segment in enumerate(self._segments):
            if len(out) >= max_records:
                break
            with open(segment.path, "rb") as stream:
                stream.seek(self._head_offset if position == 0 else 0)
                while len(out) < max_records:
                    head = stream.read(_HEAD.size)
                    if len(head) < _HEAD.size:
                        break
                    length, crc = _HEAD.unpack(head)
                    body = stream.read(length)
                    if len(body) < length or zlib.crc32(body) != crc:
                        raise SpoolCorrupt(f"{segment.path.name}: bad record after a clean open")
                    out.append(SpoolRecord.decode_body(body))
                    self._peeked_sizes.append(_HEAD.size + length)
        return out

    def commit(self, count: int) -> None:
        """The first `count` records of the last peek are published: forget them."""
        if self._peek_stale:
            self._peek_stale = False
            return
        if count > len(self._peeked_sizes):
            raise ValueError(f"commit({count}) after peeking {len(self._peeked_sizes)} records")
        for size in self._peeked_sizes[:count]:
            head = self._segments[0]
            self._head_records += 1
            self._head_offset += size
            if self._head_records >= head.records:
                if head is self._segments[-1]:
                    self._close_file()
                head.path.unlink(missing_ok=True)
                self._segments.pop(0)
                self._head_records = 0
                self._head_offset = 0
        self._peeked_sizes = []
        self._write_cursor()

    def _write_cursor(self) -> None:
        # Where the drain stopped inside the head segment, so a restart republishes little.
        cursor = self.directory / "head.cursor"
        if not self._segments or self._head_records == 0:
            cursor.unlink(missing_ok=True)
            return
        temporary = cursor.with_suffix(".tmp")
        temporary.write_text(f"{self._segments[0].number} {self._head_records} {self._head_offset}\n")
        os.replace(temporary, cursor)

    def _read_cursor(self) -> None:
        cursor = self.directory / "head.cursor"
        if not self._segments or not cursor.exists():
            return
        try:
            number, records, offset = (int(x) for x in cursor.read_text().split())
        except ValueError:
            return
        head = self._segments[0]
        if number == head.number and 0 < records < head.records and 0 < offset < head.total_bytes:
            self._head_records, self._head_offset = records, offset

    # ------------------------------------------------------------------ close

    def _close_file(self) -> None:
        if self._file is not None:
            if self._dirty and self.fsync is not FsyncPolicy.NEVER:
                os.fsync(self._file)
                self._dirty = False
            os.close(self._file)
            self._file = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._close_file()
