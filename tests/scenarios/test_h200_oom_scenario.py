"""The H200 OOM scenario's engine on the CPU: scheduling, the control channel the executor drives, the model.

The GPU run itself is scenarios/h200_oom/run_h200.sh; these check the pieces it relies on.
"""

from __future__ import annotations

import argparse
import itertools

import pytest
import torch

from scenarios.h200_oom.batching import EngineControl, EngineShape, Request, ScenarioLimitError, Scheduler
from scenarios.h200_oom.model import TINY, KvCache, LlamaModel
from scenarios.h200_oom.workload import Engine, start_engine_control
from services.executor.adapters.engine import EngineControlClient, EngineRejected
from services.executor.domain import Limits
from sits.runtime.procs import free_port

SHAPE = EngineShape(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)


def ticking_clock() -> itertools.count[float]:
    return itertools.count(1.0)


def scheduler_with(requests: int, prompt: int = 16, new: int = 4) -> Scheduler:
    clock = ticking_clock()
    scheduler = Scheduler(SHAPE, lambda: float(next(clock)))
    for index in range(requests):
        scheduler.submit(Request(f"p1-{index}", prompt, new, submitted_at=0.0))
    return scheduler


def test_admission_stops_at_the_cap_and_the_token_budget() -> None:
    scheduler = scheduler_with(10, prompt=16)
    plan = scheduler.plan_step()
    assert [r.request_id for r in plan.admit] == ["p1-0", "p1-1", "p1-2", "p1-3"]  # 4 x 16 = the budget
    plan = scheduler.plan_step()
    assert len(plan.admit) == 4 and len(scheduler.running) == 8
    assert scheduler.plan_step().admit == []  # at max_num_seqs


def test_lowering_the_cap_preempts_the_newest_and_requeues_them_first() -> None:
    scheduler = scheduler_with(10)
    scheduler.plan_step()
    scheduler.plan_step()
    scheduler.max_num_running_reqs = 5
    plan = scheduler.plan_step()
    assert sorted(r.request_id for r in plan.preempt) == ["p1-5", "p1-6", "p1-7"]
    assert [r.request_id for r in scheduler.waiting][:3] == ["p1-5", "p1-6", "p1-7"]
    assert len(scheduler.running) == 5 and scheduler.preemptions == 3
    assert all(not r.lost for r in plan.preempt)


def test_every_request_completes_under_a_lowered_cap() -> None:
    scheduler = scheduler_with(12, new=3)
    for step in range(200):
        if step == 2:
            scheduler.max_num_running_reqs = 2
        plan = scheduler.plan_step()
        scheduler.tokens_generated([r for r in scheduler.running if r not in plan.admit] + plan.admit)
        if not scheduler.running and not scheduler.waiting:
            break
    assert len(scheduler.finished) == 12
    assert all(r.generated == 3 and r.completed_at is not None for r in scheduler.finished)


def test_an_oom_loses_the_running_batch() -> None:
    scheduler = scheduler_with(10)
    scheduler.plan_step()
    lost = scheduler.lose_running()
    assert len(lost) == 4 and scheduler.lost == lost and all(r.lost for r in lost)
    assert scheduler.running == [] and len(scheduler.waiting) == 6


def test_paused_admission_admits_nothing() -> None:
    scheduler = scheduler_with(3)
    scheduler.admission_paused = True
    assert scheduler.plan_step().admit == []


def test_limits_are_applied_at_the_next_step_and_range_checked() -> None:
    scheduler = scheduler_with(4)
    control = EngineControl(scheduler)
    control.stepping = False
    state = control.set_limits({"max_num_running_reqs": 3})
    assert state["applied"] and state["limits"]["max_num_running_reqs"] == 3
    with pytest.raises(ScenarioLimitError):
        control.set_limits({"max_num_running_reqs": 9})
    with pytest.raises(ScenarioLimitError):
        control.set_limits({"max_prefill_chunk_tokens": 256})
    with pytest.raises(ScenarioLimitError):
        control.set_limits({"no_such_limit": 1})
    control.stepping = True
    with control.locked():
        control._pending = {"max_num_running_reqs": 2}
        control._pending_seq += 1
    assert scheduler.max_num_running_reqs == 3
    assert control.apply_pending() == {"max_num_running_reqs": 2}
    assert scheduler.max_num_running_reqs == 2 and control.changes[-1].limits == {"max_num_running_reqs": 2}


async def test_the_executor_client_drives_the_engine_through_the_plugin_control_server() -> None:
    scheduler = scheduler_with(4)
    control = EngineControl(scheduler)
    address = f"127.0.0.1:{free_port()}"
    server = start_engine_control(control, address)
    try:
        async with EngineControlClient(address) as client:
            before = await client.state()
            assert before.limits.max_num_running_reqs == 8 and before.info.max_num_seqs == 8
            after = await client.set_limits(
                Limits(
                    max_num_running_reqs=6,
                    max_num_scheduled_tokens=64,
                    max_prefill_chunk_tokens=0,
                    admission_paused=False,
                )
            )
            assert after.applied and after.limits.max_num_running_reqs == 6
            assert scheduler.max_num_running_reqs == 6
            with pytest.raises(EngineRejected):
                await client.set_limits({"max_num_running_reqs": 99})
            assert [r.request_id for r in await client.in_flight()] == [f"p1-{i}" for i in range(4)]
    finally:
        server.stop(grace=None)


def test_chunked_decode_matches_a_full_recompute_across_a_slot_resize() -> None:
    torch.manual_seed(0)
    model = LlamaModel(TINY, torch.device("cpu"), torch.float32, seed=3)
    cache = KvCache(TINY, slots=4, chunk_tokens=4, device=torch.device("cpu"), dtype=torch.float32)
    cache.ensure_positions(6)
    prompts = torch.randint(0, TINY.vocab, (2, 6))
    slot_of = [1, 3]
    sequences = [row.tolist() for row in prompts]
    first = model.prefill(prompts, cache, slot_of).argmax(-1).tolist()
    for seq, token in zip(sequences, first, strict=True):
        seq.append(token)
    for step in range(7):
        if step == 3:
            cache.resize_slots([slot_of[1], slot_of[0]], 2)
            slot_of = [1, 0]
        lengths = [0] * cache.slots
        tokens = torch.zeros(cache.slots, dtype=torch.long)
        for seq, slot in zip(sequences, slot_of, strict=True):
            lengths[slot] = len(seq) - 1
            tokens[slot] = seq[-1]
        cache.ensure_positions(max(lengths) + 1)
        logits = model.decode(tokens, cache, lengths)
        for seq, slot in zip(sequences, slot_of, strict=True):
            scratch = KvCache(TINY, 1, 4, torch.device("cpu"), torch.float32)
            scratch.ensure_positions(len(seq))
            reference = model.prefill(torch.tensor([seq]), scratch, [0])[0]
            assert torch.allclose(logits[slot], reference, rtol=1e-4, atol=1e-4)
            seq.append(int(logits[slot].argmax()))
    assert cache.trim_positions(4) and cache.num_chunks == 1


def engine_args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "shape": "tiny",
        "slots": 6,
        "chunk_tokens": 8,
        "max_model_len": 64,
        "max_batched_tokens": 48,
        "prompt_tokens": 8,
        "min_new_tokens": 4,
        "max_new_tokens": 12,
        "requests": 20,
        "seed": 0,
        "sample_every_s": 0.0,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


def test_the_engine_serves_every_request_when_its_batch_is_cut_mid_run() -> None:
    engine = Engine(engine_args(), torch.device("cpu"))
    engine.submit_all(t0=0.0)
    for _ in range(3):
        engine.step()
    running_before = len(engine.scheduler.running)
    assert running_before == 6
    engine.control.set_limits({"max_num_running_reqs": 2})  # not stepping: applied at once
    assert engine.run(t0=engine.clock(), deadline_s=60) == "completed"
    sched = engine.scheduler
    assert len(sched.finished) == 20 and not sched.lost
    assert sched.preemptions == running_before - 2 and engine.cache.slots == 2
    assert engine.resizes and engine.resizes[0]["kv_bytes_after"] < engine.resizes[0]["kv_bytes_before"]
    assert all(r.generated == r.max_new_tokens for r in sched.finished)
