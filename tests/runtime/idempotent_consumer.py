"""A consumer process for the at-least-once test: counts each event_id once in Redis.

With TEST_CRASH_AFTER=N it exits with os._exit(137) after handling N records:
no drain, no commit, like kill -9.
"""

from __future__ import annotations

import asyncio
import os

from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent
from sits.runtime.events import Topics
from sits.runtime.redis import IdempotencyGuard, connect
from sits.runtime.settings import Settings, load_settings


async def main() -> None:
    settings = load_settings(Settings)
    topics = Topics(settings.topic_prefix)
    crash_after = int(os.environ.get("TEST_CRASH_AFTER", "0"))
    expected = int(os.environ["TEST_EXPECTED"])
    counter, handled_key = os.environ["TEST_COUNTER_KEY"], os.environ["TEST_HANDLED_KEY"]
    client = connect(settings.redis_url)
    guard = IdempotencyGuard(client, scope=f"{settings.topic_prefix}test")
    handled = 0
    stop = asyncio.Event()

    async def handle(event: ReceivedEvent) -> None:
        nonlocal handled
        event_id = event.message.meta.event_id
        await client.rpush(handled_key, event_id)
        await guard.claim_and_count(event_id, counter)
        handled += 1
        if crash_after and handled >= crash_after:
            os._exit(137)
        if int(await client.get(counter) or 0) >= expected:
            stop.set()

    async with EventProducer(settings) as producer:
        consumer = EventConsumer(
            settings,
            group_id=f"{settings.topic_prefix}idem",
            topics=[topics.oom],
            handler=handle,
            dead_letters=producer,
            coalesce=False,
        )
        async with consumer:
            await asyncio.wait_for(consumer.run(stop), 45)
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
