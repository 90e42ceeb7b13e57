"""Reading what landed in topics, for the security tests: every record with its headers, from the start."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from google.protobuf.message import Message

from sits.runtime.events import DLQ_REASON_HEADER, EnvelopeError, decode_event
from sits.v1 import events_pb2


@dataclass(frozen=True)
class Seen:
    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...]

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value.decode(errors="replace")
        return None

    @property
    def reason(self) -> str:
        return self.header(DLQ_REASON_HEADER) or ""

    def message(self) -> Message | None:
        try:
            return decode_event(self.headers, self.value)
        except EnvelopeError:
            return None


class Collector:
    """Keeps every record of `topics` (explicitly assigned, from offset 0) while running."""

    def __init__(self, client_options: dict[str, Any], topics: list[str]) -> None:
        self._consumer = AIOKafkaConsumer(**client_options, enable_auto_commit=False, fetch_max_wait_ms=20)
        self._topics = topics
        self.records: list[Seen] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        await self._consumer.start()
        await self._consumer._client.force_metadata_update()
        partitions = [
            TopicPartition(t, p) for t in self._topics for p in sorted(self._consumer.partitions_for_topic(t) or {0})
        ]
        self._consumer.assign(partitions)
        await self._consumer.seek_to_beginning(*partitions)
        self._task = asyncio.create_task(self._loop())
        return self

    async def _loop(self) -> None:
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=100)
            except KafkaError:
                await asyncio.sleep(0.2)
                continue
            for records in batches.values():
                self.records += [Seen(r.topic, r.key or b"", r.value or b"", tuple(r.headers)) for r in records]

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()

    def of(self, topic: str) -> list[Seen]:
        return [r for r in self.records if r.topic == topic]

    def results(self, topic: str) -> list[events_pb2.ActionResult]:
        out = []
        for record in self.of(topic):
            message = record.message()
            if isinstance(message, events_pb2.ActionResult):
                out.append(message)
        return out
