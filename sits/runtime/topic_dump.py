"""Every event of some topics, from the start, decoded to JSON-ready dicts: what a scenario keeps of a run.

Partitions are assigned, not joined through a consumer group, so reading leaves no offsets behind.
Reading stops at the end offsets taken when it began, or at the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from google.protobuf.json_format import MessageToDict

from sits.runtime.events import decode_events
from sits.runtime.kafka_security import kafka_options_for


async def read_topics(
    bootstrap: str, topics: Sequence[str], timeout_s: float = 5.0, max_records: int | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Each topic's events in order, with `_kafka_ts` (the record's time, seconds); a record that does not
    decode stands as `{"undecodable": reason}`. `max_records` bounds one fetch (None: the client's default)."""
    consumer = AIOKafkaConsumer(**kafka_options_for(bootstrap), enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    found: dict[str, list[dict[str, Any]]] = {t: [] for t in topics}
    try:
        await consumer.topics()  # fetches the cluster's metadata
        partitions = [TopicPartition(t, p) for t in topics for p in (consumer.partitions_for_topic(t) or ())]
        if not partitions:
            return found
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            positions = {tp: await consumer.position(tp) for tp in partitions}
            if all(positions[tp] >= ends[tp] for tp in partitions):
                break
            batch = await consumer.getmany(timeout_ms=200, max_records=max_records)
            for tp, records in batch.items():
                for record in records:
                    try:
                        messages = decode_events(list(record.headers), record.value)
                    except Exception as error:
                        found[tp.topic].append({"undecodable": str(error)})
                        continue
                    for message in messages:
                        item = MessageToDict(message, preserving_proto_field_name=True)
                        item["_kafka_ts"] = record.timestamp / 1000.0
                        found[tp.topic].append(item)
    finally:
        await consumer.stop()
    return found
