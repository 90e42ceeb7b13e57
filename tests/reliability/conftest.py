"""One embedded stack shared by the bad-input and auth tests (the scenario tests start their own)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench import reliability_harness as h
from sits.runtime.events import Topics
from sits_app.stack.embedded import EmbeddedStack

MAX_MESSAGE_BYTES = 64 * 1024


@pytest.fixture(scope="package")
async def api_stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> AsyncIterator[h.ReliabilityStack]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    run_dir: Path = tmp_path_factory.mktemp("reliability-api")
    engines = h.engine_names(prefix, 2)
    config = h.stack_config(
        run_dir, redis_url, prefix, engines, extra_env={"SITS_GRPC_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES)}
    )
    async with EmbeddedStack(config) as stack:
        yield h.ReliabilityStack(stack, engines, stack.settings.host_name, Topics(prefix))
        await h.forget_executor_keys(redis_url, engines, [])
