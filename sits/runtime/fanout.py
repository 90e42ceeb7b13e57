"""Live streams to many gRPC clients without unbounded memory.

Each subscriber gets a bounded queue. Publishing never waits: a subscriber
whose queue is full is cut off (it sees `SubscriberTooSlow`, which the gRPC
layer turns into RESOURCE_EXHAUSTED) instead of making the server buffer for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SubscriberTooSlow(Exception):
    """The subscriber fell more than its buffer behind and was closed."""


class Subscription(Generic[T]):
    def __init__(self, fanout: Fanout[T], accepts: Callable[[T], bool], buffer: int) -> None:
        self._fanout = fanout
        self.accepts = accepts
        self.queue: asyncio.Queue[T] = asyncio.Queue(maxsize=buffer)
        self.overflowed = False
        self._wakeup = asyncio.Event()

    def offer(self, item: T) -> None:
        if self.overflowed or not self.accepts(item):
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed = True
            self._wakeup.set()

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            while True:
                if self.overflowed:
                    raise SubscriberTooSlow(f"client fell more than {self.queue.maxsize} items behind")
                if self.queue.empty():
                    getter = asyncio.ensure_future(self.queue.get())
                    waker = asyncio.ensure_future(self._wakeup.wait())
                    done, _ = await asyncio.wait({getter, waker}, return_when=asyncio.FIRST_COMPLETED)
                    waker.cancel()
                    if getter in done:
                        yield getter.result()
                    else:
                        getter.cancel()
                    continue
                yield self.queue.get_nowait()
        finally:
            self._fanout.unsubscribe(self)


class Fanout(Generic[T]):
    def __init__(self, buffer: int = 256) -> None:
        self._buffer = buffer
        self._subscribers: set[Subscription[T]] = set()

    def subscribe(self, accepts: Callable[[T], bool] = lambda _item: True) -> Subscription[T]:
        subscription = Subscription(self, accepts, self._buffer)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription[T]) -> None:
        self._subscribers.discard(subscription)

    def publish(self, item: T) -> None:
        for subscription in list(self._subscribers):
            subscription.offer(item)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
