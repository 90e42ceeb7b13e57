"""Redis AUTH (password, ACL user) and TLS against real redis-server processes of the tests' own.

The shared Redis on 6379 is never touched: each test starts its own server on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from redis.exceptions import NoPermissionError

from services.executor.main import serve
from services.executor.settings import EngineEndpoints, ExecutorSettings
from sits.runtime.bus import EventProducer, ensure_topics
from sits.runtime.events import Topics, new_meta
from sits.runtime.grpcserver import bearer_metadata
from sits.runtime.kafka_security import kafka_client_options
from sits.runtime.procs import free_port
from sits.runtime.redis import RedisUnavailable, check_redis, connect, connect_with
from sits.runtime.secret_files import mask_url
from sits.runtime.settings import Settings
from sits.runtime.signing import Signer, new_key, write_key_file
from sits.v1 import common_pb2, events_pb2, executor_pb2_grpc
from sits_app.stack.embedded import wait_serving
from sits_app.stack.tansu import TansuBroker
from sits_mesh.pressure import read_pressure
from tests.security.conftest import Certs, PrivateRedis
from tests.security.records import Collector
from tests.waiting import eventually

PASSWORD = "redis-pa55-0a7f3c"


async def ping(client: object) -> bool:
    try:
        return bool(await client.ping())  # type: ignore[attr-defined]
    finally:
        await client.aclose()  # type: ignore[attr-defined]


async def test_password_from_a_file_or_the_url_and_the_url_is_only_shown_masked(tmp_path: Path) -> None:
    with PrivateRedis(tmp_path, "--requirepass", PASSWORD) as redis:
        url = f"redis://127.0.0.1:{redis.port}/0"
        password_file = tmp_path / "redis-password"
        password_file.write_text(PASSWORD + "\n")
        assert await ping(connect_with(Settings(redis_url=url, redis_password_file=password_file)))
        with_password = f"redis://:{PASSWORD}@127.0.0.1:{redis.port}/0"
        assert await ping(connect(with_password))
        assert PASSWORD not in mask_url(with_password) and "***" in mask_url(with_password)
        with pytest.raises(RedisUnavailable) as no_auth:
            await check_redis(url)
        assert "refused SITS's credentials" in str(no_auth.value)
        wrong = tmp_path / "wrong"
        wrong.write_text("not-it")
        with pytest.raises(RedisUnavailable) as bad:
            await check_redis(f"redis://:{PASSWORD}x@127.0.0.1:{redis.port}/0")
        assert PASSWORD not in str(bad.value) and "refused SITS's credentials" in str(bad.value)
        with pytest.raises(RedisUnavailable, match="refused SITS's credentials"):
            await check_redis(url, wrong)


async def test_an_acl_user_over_tls_with_rediss(tmp_path: Path, certs: Certs) -> None:
    acl = ["--user", "default", "off", "--user", "sits", "on", f">{PASSWORD}", "~sits:*", "+@all"]
    with PrivateRedis(tmp_path, *acl, tls=certs) as redis:
        password_file = tmp_path / "redis-password"
        password_file.write_text(PASSWORD)
        url = f"rediss://sits@127.0.0.1:{redis.port}/0?ssl_ca_certs={certs.ca}"
        client = connect_with(Settings(redis_url=url, redis_password_file=password_file))
        try:
            await client.set("sits:tls-test", "1")
            assert await client.get("sits:tls-test") == b"1"
            with pytest.raises(NoPermissionError):
                await client.set("other:key", "1")  # the ACL limits the user to sits:* keys
        finally:
            await client.aclose()
        with pytest.raises(RedisUnavailable):  # plaintext to the TLS port
            await check_redis(f"redis://sits@127.0.0.1:{redis.port}/0", password_file)
        with pytest.raises(RedisUnavailable):  # a CA that did not sign the server
            await check_redis(f"rediss://sits@127.0.0.1:{redis.port}/0?ssl_ca_certs={certs.rogue_ca}", password_file)


@pytest.fixture
async def secured_redis(tmp_path: Path) -> AsyncIterator[PrivateRedis]:
    with PrivateRedis(tmp_path, "--requirepass", PASSWORD) as redis:
        yield redis


@pytest.mark.timeout(120)
async def test_wrong_credentials_refuse_mutations_clearly_and_fixing_the_file_recovers_without_restart(
    broker: TansuBroker, secured_redis: PrivateRedis, topic_prefix: str, tmp_path: Path
) -> None:
    password_file = tmp_path / "redis-password"
    password_file.write_text("an-old-password")
    token = tmp_path / "token"
    token.write_text("grpc-token-1234")
    ring = tmp_path / "keys"
    key = new_key("k1")
    write_key_file(ring, [key])
    engine = f"{topic_prefix}redis"
    settings = ExecutorSettings(
        kafka_bootstrap=broker.bootstrap,
        redis_url=f"redis://127.0.0.1:{secured_redis.port}/0",
        redis_password_file=password_file,
        topic_prefix=topic_prefix,
        kafka_partitions=1,
        host_name="test-host",
        executor_addr=f"127.0.0.1:{free_port()}",
        metrics_port=0,
        auth_token_file=token,
        executor_targets={engine: EngineEndpoints(engine_addr="127.0.0.1:9", control_addr="127.0.0.1:9")},
        envoy_pressure_file=tmp_path / "pressure",
        executor_verify_keys_file=ring,
    )
    topics = Topics(topic_prefix)
    target = common_pb2.Target(host="test-host", gpu_uuid="GPU-r", engine=engine)

    def command(pressure: float) -> events_pb2.HealingCommand:
        now = time.time()
        c = events_pb2.HealingCommand(
            meta=new_meta("decision", target, now),
            command_id=f"{topic_prefix}{pressure}",
            kind=events_pb2.ACTION_KIND_SET_PRESSURE,
            pressure=pressure,
        )
        c.deadline.FromNanoseconds(int((now + 60) * 1e9))
        return c

    await ensure_topics(settings)
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop))
    try:
        async with (
            Collector(kafka_client_options(settings), [topics.results, topics.deadletter]) as collector,
            EventProducer(settings, signer=Signer([key])) as producer,
        ):
            from_kafka = command(0.3)
            await producer.publish(topics.commands, from_kafka)
            await wait_serving(settings.executor_addr, "sits.v1.Executor", 30)
            async with grpc.aio.insecure_channel(settings.executor_addr) as channel:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Apply(command(0.2), metadata=bearer_metadata("grpc-token-1234"), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "Redis refused SITS's credentials" in (refused.value.details() or "")
                assert collector.results(topics.results) == [] and read_pressure(settings.envoy_pressure_file) is None

                password_file.write_text(PASSWORD)  # the operator fixes the file: no restart
                applied = await stub.Apply(command(0.2), metadata=bearer_metadata("grpc-token-1234"), timeout=10)
                assert applied.status == events_pb2.ACTION_STATUS_APPLIED
            # The Kafka command waited (offset uncommitted) and is applied now too.
            assert await eventually(
                lambda: any(r.command_id == from_kafka.command_id for r in collector.results(topics.results)), 30
            )
            assert collector.of(topics.deadletter) == []
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(service, 30)
