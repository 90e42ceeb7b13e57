"""The service skeleton on the real broker and Redis: it starts, serves /metrics and gRPC, runs its consumers in
the service's group, and on stop closes everything it opened (the group is left, the ports are free)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import Field

from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent
from sits.runtime.procs import free_port
from sits.runtime.service import ServiceApp
from sits.runtime.settings import Settings
from tests.runtime.test_bus import sample
from tests.waiting import eventually


class DemoSettings(Settings):
    demo_group: str = Field("sits-demo", description="Consumer group of the demo service.")
    demo_addr: str = Field("127.0.0.1:0", description="Where the demo service's gRPC API listens.")


def demo_settings(settings: Settings) -> DemoSettings:
    # A short session: a member that stopped heartbeating is out of the group within seconds.
    changes = {"demo_addr": f"127.0.0.1:{free_port()}", "consumer_session_timeout_ms": 3000}
    return DemoSettings(**settings.model_dump() | changes)


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        # Closed connections may linger in TIME_WAIT on the port; only a listener still there makes bind fail.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


async def redis_has_client(app: ServiceApp[DemoSettings], client_id: int) -> bool:
    from sits.runtime.redis import connect

    observer = connect(app.settings.redis_url)
    try:
        listed = await observer.execute_command("CLIENT", "LIST", "ID", str(client_id))
    finally:
        await observer.aclose()
    return f"id={client_id} " in (listed.decode() if isinstance(listed, bytes) else str(listed))


async def test_group_is_prefix_and_the_service_setting(settings: Settings) -> None:
    app = ServiceApp("demo", demo_settings(settings), asyncio.Event())
    assert app.group == f"{settings.topic_prefix}sits-demo"
    with pytest.raises(AttributeError, match="SITS_NOPE_GROUP"):
        _ = ServiceApp("nope", settings, asyncio.Event()).group


@pytest.mark.timeout(120)
async def test_starts_serves_and_closes_everything_on_stop(settings: Settings) -> None:
    demo = demo_settings(settings)
    grpc_port = demo.port_of(demo.demo_addr)
    handled: list[int] = []
    joined = asyncio.Event()

    async def handle(event: ReceivedEvent) -> None:
        handled.append(event.message.sequence)

    async def assigned(_partitions: object) -> None:
        joined.set()

    stop = asyncio.Event()
    async with ServiceApp("demo", demo, stop) as app:
        await app.producer()
        await app.grpc([], addr=demo.demo_addr)
        await app.consumer([app.topics.metrics], handle, on_assigned=assigned)
        redis_id = int(await app.redis().client_id())
        running = asyncio.create_task(app.run())

        assert "sits_events_in_total" in metrics_text(app.metrics_port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.wait_for(joined.wait(), 60)
        async with EventProducer(settings) as producer:
            await producer.publish(app.topics.metrics, sample(7))
        assert await eventually(lambda: handled == [7], 30)

        stop.set()
        await asyncio.wait_for(running, 30)
    metrics_port = app.metrics_port

    assert port_is_free(grpc_port)
    assert port_is_free(metrics_port)
    assert not await redis_has_client(app, redis_id)
    # The member left the group (Tansu still lists a member that left until its session ends, so the
    # client's side is what shows it: aiokafka logs the LeaveGroup the broker answered).
    # Out of the group, its offsets committed: a newcomer in the group gets every partition and starts after the
    # handled record. (Tansu runs groups at generation 0, where aiokafka sends no LeaveGroup: the old member is
    # dropped when its short session ends, so this shows that it stopped heartbeating, not a LeaveGroup.)
    newcomer = EventConsumer(
        demo, group_id=app.group, topics=[app.topics.metrics], handler=handle, dead_letters=EventProducer(demo)
    )
    newcomer_stop = asyncio.Event()
    newcomer_running = asyncio.create_task(newcomer.run(newcomer_stop))
    try:
        assert await eventually(lambda: len(newcomer.owned_partitions(app.topics.metrics)) == 2, 30)
        async with EventProducer(settings) as producer:
            await producer.publish(app.topics.metrics, sample(8))
        assert await eventually(lambda: handled == [7, 8], 30), handled
    finally:
        newcomer_stop.set()
        await asyncio.wait_for(newcomer_running, 30)
        await newcomer.stop()


async def test_background_is_cancelled_on_stop_and_a_failure_stops_the_rest(settings: Settings) -> None:
    demo = demo_settings(settings)
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def fail() -> None:
        raise RuntimeError("work failed")

    stop = asyncio.Event()
    with pytest.raises(ExceptionGroup) as failed:
        async with ServiceApp("demo", demo, stop) as app:
            await app.run(fail(), background=[forever()])
    assert failed.group_contains(RuntimeError, match="work failed")
    assert cancelled.is_set() and stop.is_set()
    assert port_is_free(app.metrics_port)

    async with ServiceApp("demo", demo, asyncio.Event()) as app:
        cancelled.clear()
        app.stop.set()
        await app.run(background=[forever()])
    assert cancelled.is_set()


async def test_sigterm_stops_an_app_that_owns_its_stop(settings: Settings) -> None:
    demo = demo_settings(settings)
    before = signal.getsignal(signal.SIGTERM)
    async with ServiceApp("demo", demo) as app:
        await app.grpc([], addr=demo.demo_addr)
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(app.run(), 10)
        assert app.stop.is_set()
    assert signal.getsignal(signal.SIGTERM) == before
    assert port_is_free(demo.port_of(demo.demo_addr))
