"""The skeleton every SITS service runs in: what each `main.py` used to wire by hand.

A `ServiceApp` (in the spirit of quix-streams' `Application`) owns, for one
process, its settings, the /metrics endpoint, the topics, one producer, the
consumers of the service's group (`SITS_<SERVICE>_GROUP` after
`SITS_TOPIC_PREFIX`), the gRPC server, the Redis client and the stop signals,
and closes all of them through one `AsyncExitStack`, in the reverse order they
were opened: consumers commit and leave the group while the producer and
Redis their callbacks use are still open.

    async def serve(settings, stop=None):
        async with ServiceApp("decision", settings, stop) as app:
            producer = await app.producer()
            await app.grpc([binding], addr=settings.decision_addr)
            await app.consumer([app.topics.metrics], handler)
            await app.run(background=[ticks(app.stop)])

Given no `stop` event (the service is the process) the app makes its own and
SIGTERM / SIGINT set it (`sits.runtime.lifecycle.install_stop_signals`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import redis.asyncio as aioredis

from sits.runtime.bus import EventConsumer, EventProducer, Handler, ensure_topics
from sits.runtime.events import Topics
from sits.runtime.grpc_tls import server_credentials
from sits.runtime.grpcserver import GrpcServer, ServiceBinding, read_token
from sits.runtime.lifecycle import install_stop_signals
from sits.runtime.metrics import start_metrics
from sits.runtime.redis import connect_with
from sits.runtime.settings import Settings
from sits.runtime.signing import Signer

S = TypeVar("S", bound=Settings)
T = TypeVar("T")


class ServiceApp(Generic[S]):
    """One service process's resources, opened on demand and closed together; an async context manager."""

    def __init__(self, name: str, settings: S, stop: asyncio.Event | None = None) -> None:
        self.name = name
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self._own_stop = stop is None
        self.stop = asyncio.Event() if stop is None else stop
        self.metrics_port = 0
        self.grpc_server: GrpcServer | None = None
        self.consumers: list[EventConsumer] = []
        self._stack = contextlib.AsyncExitStack()
        self._producer: EventProducer | None = None
        self._redis: aioredis.Redis | None = None

    @property
    def group(self) -> str:
        """The service's consumer group: SITS_TOPIC_PREFIX + SITS_<SERVICE>_GROUP."""
        field = f"{self.name}_group"
        if field not in type(self.settings).model_fields:
            raise AttributeError(f"{type(self.settings).__name__} has no SITS_{field.upper()}")
        return f"{self.settings.topic_prefix}{getattr(self.settings, field)}"

    async def __aenter__(self) -> Self:
        await self._stack.__aenter__()
        try:
            if self._own_stop:
                self._stack.callback(install_stop_signals(self.stop))
            self.metrics_port, stop_metrics = start_metrics(self.settings.metrics_port, self.settings.metrics_bind)
            self._stack.callback(stop_metrics)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.stop.set()
        return await self._stack.__aexit__(exc_type, exc, tb)

    async def enter(self, resource: contextlib.AbstractAsyncContextManager[T]) -> T:
        """Open `resource` now; it closes with the app (before whatever was opened earlier)."""
        return await self._stack.enter_async_context(resource)

    def on_close(self, close: Callable[[], Awaitable[Any] | None]) -> None:
        """Call (and await, when async) `close()` when the app closes (before whatever was opened earlier)."""

        async def call() -> None:
            result = close()
            if inspect.isawaitable(result):
                await result

        self._stack.push_async_callback(call)

    def redis(self) -> aioredis.Redis:
        """The process's Redis client (SITS_REDIS_URL), closed with the app."""
        if self._redis is None:
            self._redis = connect_with(self.settings)
            self.on_close(self._redis.aclose)
        return self._redis

    async def producer(self, *, signer: Signer | None = None) -> EventProducer:
        """The process's producer, started once the SITS topics exist; the first call's `signer` signs."""
        if self._producer is None:
            await ensure_topics(self.settings)
            self._producer = await self.enter(EventProducer(self.settings, signer=signer))
        return self._producer

    async def consumer(self, topics: Sequence[str], handler: Handler, **options: Any) -> EventConsumer:
        """A consumer in the service's group; `run` runs it, and it commits and stops when the app closes.

        Not started here: joining a group takes seconds on some brokers, so the gRPC server answers health
        checks first and the consumer joins in `run`. Dead letters go through the app's producer.
        """
        options.setdefault("dead_letters", await self.producer())
        consumer = EventConsumer(self.settings, group_id=self.group, topics=topics, handler=handler, **options)
        self._stack.push_async_exit(consumer)
        self.consumers.append(consumer)
        return consumer

    async def grpc(
        self, bindings: Sequence[ServiceBinding], *, addr: str, mutating_methods: Iterable[str] = ()
    ) -> GrpcServer:
        """Serve `bindings` on SITS_GRPC_BIND at `addr`'s port, with the token, TLS and limits from settings."""
        mutating = list(mutating_methods)
        settings = self.settings
        server = GrpcServer(
            bindings,
            bind=settings.grpc_bind,
            port=settings.port_of(addr),
            token=read_token(settings.auth_token_file) if mutating else None,
            mutating_methods=mutating,
            max_message_bytes=settings.grpc_max_message_bytes,
            credentials=server_credentials(settings),
        )
        self.grpc_server = await self.enter(server)
        return server

    async def run(self, *work: Awaitable[object], background: Iterable[Awaitable[object]] = ()) -> None:
        """Run the consumers and `work` until they end (they watch `stop` and drain), and `background`
        until `stop` is set (then cancelled). `stop` is set once all the work has ended; a failure in any
        of it cancels the rest and propagates (leaving the `async with` sets `stop` and closes everything)."""
        work = (*(consumer.run(self.stop) for consumer in self.consumers), *work)
        async with asyncio.TaskGroup() as tasks:
            waiting = [tasks.create_task(_awaited(item)) for item in background]
            tasks.create_task(self._cancel_on_stop(waiting))
            running = [tasks.create_task(_awaited(item)) for item in work]
            if running:
                await asyncio.wait(running)
                self.stop.set()

    async def _cancel_on_stop(self, tasks: list[asyncio.Task[None]]) -> None:
        await self.stop.wait()
        for task in tasks:
            task.cancel()


async def _awaited(item: Awaitable[object]) -> None:
    await item
