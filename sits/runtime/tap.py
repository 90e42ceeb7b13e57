"""Read SITS topics without joining a consumer group.

For tools that watch (the live view, the demo recorder, SRE scripts): every
partition is assigned explicitly, which also works for clients whose group
support is weak, and starts in milliseconds. Given `Settings` instead of a
bootstrap address, it connects as the services do (TLS, SASL).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Self

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from google.protobuf.message import Message

from sits.runtime.events import EnvelopeError, decode_events
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.settings import Settings


class TopicTap:
    """Calls `on_event(topic, message)` for each event on `topics` (a MetricBatch: each of its samples),
    from now on (or from the start)."""

    def __init__(
        self,
        bootstrap: str | Settings,
        topics: Sequence[str],
        on_event: Callable[[str, Message], None],
        from_beginning: bool = False,
    ) -> None:
        self._topics = list(topics)
        self._on_event = on_event
        self._from_beginning = from_beginning
        self._consumer = AIOKafkaConsumer(**kafka_options_for(bootstrap), enable_auto_commit=False)
        self._task: asyncio.Task[None] | None = None
        self.undecodable = 0

    async def start(self) -> None:
        await self._consumer.start()
        partitions = [
            TopicPartition(topic, p)
            for topic in self._topics
            for p in sorted(self._consumer.partitions_for_topic(topic) or await self._partitions(topic))
        ]
        self._consumer.assign(partitions)
        if self._from_beginning:
            await self._consumer.seek_to_beginning(*partitions)
        else:
            await self._consumer.seek_to_end(*partitions)
        self._task = asyncio.create_task(self._loop())

    async def _partitions(self, topic: str) -> set[int]:
        await self._consumer._client.force_metadata_update()
        return self._consumer.partitions_for_topic(topic) or {0}

    async def _loop(self) -> None:
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=200)
            except KafkaError:
                await asyncio.sleep(0.5)
                continue
            for records in batches.values():
                for record in records:
                    try:
                        messages = decode_events(list(record.headers), record.value)
                    except EnvelopeError:
                        self.undecodable += 1
                        continue
                    for message in messages:
                        self._on_event(record.topic, message)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            await self._consumer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
