"""Session fixtures: a real Tansu broker, the real Redis, and per-test topic names.

Fixture modules under tests/fixtures/ (the vLLM engine, Envoy) are plugins of
this file, so every test folder can use them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sits.runtime.events import Topics
from sits.runtime.redis import check_redis, connect
from sits.runtime.settings import Settings
from sits_app.stack.tansu import TansuBroker

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py") if p.stem != "__init__"
)

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="session")
def broker(run_dir: Path) -> Iterator[TansuBroker]:
    tansu = TansuBroker(run_dir / "tansu")
    tansu.start()
    yield tansu
    tansu.stop()


@pytest.fixture(scope="session")
def redis_url() -> str:
    asyncio.run(check_redis(REDIS_URL))
    return REDIS_URL


@pytest.fixture
def topic_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def settings(broker: TansuBroker, redis_url: str, topic_prefix: str, tmp_path: Path) -> Settings:
    """Settings for one test: the session broker, real Redis, topics of its own."""
    return Settings(
        kafka_bootstrap=broker.bootstrap,
        redis_url=redis_url,
        topic_prefix=topic_prefix,
        kafka_partitions=2,
        host_name="test-host",
    )


@pytest.fixture
def topics(settings: Settings) -> Topics:
    return Topics(settings.topic_prefix)


@pytest.fixture
async def redis_client(redis_url: str, topic_prefix: str) -> AsyncIterator[object]:
    client = connect(redis_url)
    yield client
    keys = [k async for k in client.scan_iter(match=f"*{topic_prefix}*", count=1000)]
    if keys:
        await client.delete(*keys)
    await client.aclose()
