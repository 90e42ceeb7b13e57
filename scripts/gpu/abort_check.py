"""The plugin's AbortRequests on vLLM's CUDA build (0.26 on the device machine): streams held in the queue end.

The CPU build (0.32) is covered by the tests (tests/executor/test_executor_service.py, tests/mesh/test_http_live.py);
this runs the same check on the version the GPU serves with, whose scheduler and engine core the plugin reads
through the same names (`finish_requests`, `update_from_output`, `EngineCoreOutput(..., finish_reason=ABORT)`).
Run by scripts/gpu/abort_check.sh; prints one JSON line and exits 0 when every stream ended as aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from services.executor.adapters.engine import EngineControlClient
from sits_app.demo.paths import EngineShape
from sits_app.stack.vllm_engine import make_random_llama, vllm_version
from tests.executor.engine_streams import start_streams
from tests.fixtures.vllm import engine_state
from tests.waiting import polled_until


async def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sits-abort-check-"))
    shape = EngineShape(
        max_num_seqs=4, kv_blocks=64, max_model_len=512, max_num_batched_tokens=512, gpu_memory_utilization=0.15
    )
    engine = shape.server(make_random_llama(), workdir / "vllm-sits.log", sits=True)
    async with contextlib.AsyncExitStack() as stack:
        await engine.start()
        stack.push_async_callback(engine.stop)
        assert engine.control_address
        control = await stack.enter_async_context(EngineControlClient(engine.control_address))
        await control.set_limits({"admission_paused": True})
        channel, tasks = await start_streams(engine.address, 3, prompt_len=16, max_tokens=32, prefix="p2-held")
        try:
            await polled_until(control.in_flight, lambda requests: len(requests) >= 3, 60.0, 0.05)
            # The first two streams started (the engine lists its queue in its own order, not theirs).
            ids = [f"p2-held-{i}" for i in range(3)]
            aborted = await control.abort(ids[:2])
            ended = await asyncio.wait_for(asyncio.gather(*tasks[:2]), timeout=30)
            left = [r.request_id for r in await control.in_flight()]
            await control.set_limits({"admission_paused": False})
            served = await asyncio.wait_for(tasks[2], timeout=60)
        finally:
            await control.set_limits({"admission_paused": False})
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
            await channel.close(grace=None)
        state = await engine_state(engine.control_address)
    report = {
        "vllm": vllm_version(),
        "async_scheduling": state["engine"]["async_scheduling"],
        "aborted": sorted(aborted),
        "ended": [(o.request_id, o.finish_reason, len(o.tokens)) for o in ended],
        "left_in_engine": left,
        "served_after": (served.request_id, served.finish_reason, len(served.tokens)),
    }
    print(json.dumps(report), flush=True)
    ok = (
        sorted(aborted) == sorted(ids[:2])
        and all(o.finish_reason == "abort" and not o.tokens for o in ended)
        and left == [ids[2]]
        and len(served.tokens) == 32
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
