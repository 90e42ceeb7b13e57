"""The executor's command handling against real Redis, the real vLLM engine and a real Envoy."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from services.executor.adapters.engine import EngineControlClient, VllmEngineClient
from services.executor.adapters.envoy import EnvoyAdmin
from services.executor.adapters.redis_state import RedisState, StateUnavailable
from services.executor.domain import Limits
from services.executor.grpc_api import MUTATING_METHODS, SERVICE_NAME, ExecutorServicer
from services.executor.runner import build_executor, close_engine_clients
from services.executor.service import InvalidCommand
from services.executor.settings import EngineEndpoints, ExecutorSettings
from sits.runtime.bus import EventProducer, ensure_topics
from sits.runtime.contract import Tier
from sits.runtime.events import Topics
from sits.runtime.grpcserver import GrpcServer, ServiceBinding, bearer_metadata
from sits.runtime.procs import free_port
from sits.runtime.redis import connect
from sits.runtime.settings import Settings
from sits.v1 import common_pb2, events_pb2, executor_pb2, executor_pb2_grpc
from sits_app.stack.vllm_engine import VllmServer
from sits_mesh.envoy_config import breaker_key
from sits_mesh.envoy_process import EnvoyProcess
from sits_mesh.policy import Overload
from sits_mesh.pressure import read_pressure
from tests.executor.conftest import ENGINE, Published, healing_command, make_executor, policy_in_front_of
from tests.executor.engine_streams import start_streams
from tests.runtime.test_bus import read_all
from tests.waiting import polled_until

pytestmark = pytest.mark.vllm

APPLIED = events_pb2.ACTION_STATUS_APPLIED


async def engine_limits(engine: VllmServer) -> Limits:
    assert engine.control_address
    async with EngineControlClient(engine.control_address) as control:
        return (await control.state()).limits


async def test_apply_is_idempotent_records_before_after_and_rolls_back(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str
) -> None:
    engine = engine_limits_restored
    published = Published()
    executor = make_executor(engine, redis_url, redis_prefix, published)
    original = await engine_limits(engine)
    command = healing_command(
        events_pb2.ACTION_KIND_SET_ENGINE_LIMITS,
        engine_limits=events_pb2.EngineLimits(max_num_running_reqs=3, max_num_scheduled_tokens=256),
    )
    result = await executor.handle(command)
    assert result.status == APPLIED, result.detail
    assert result.fencing_token > 0
    assert result.before.engine_limits.max_num_running_reqs == original.max_num_running_reqs
    assert result.after.engine_limits.max_num_running_reqs == 3
    assert result.after.engine_limits.max_num_scheduled_tokens == 256
    live = await engine_limits(engine)
    assert (live.max_num_running_reqs, live.max_num_scheduled_tokens) == (3, 256)

    again = await executor.handle(command)
    assert again.status == events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE
    assert result.action_id in again.detail

    undone = await executor.rollback(result.action_id, reason="validator said no")
    assert undone.status == events_pb2.ACTION_STATUS_ROLLED_BACK
    assert undone.rolled_back_action_id == result.action_id
    assert await engine_limits(engine) == original
    twice = await executor.rollback(result.action_id)
    assert twice.status == events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE
    assert [r.status for r in published.results] == [
        APPLIED,
        events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE,
        events_pb2.ACTION_STATUS_ROLLED_BACK,
        events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE,
    ]
    listed = await executor.state.actions(ENGINE, 10)
    assert {a.action_id for a in listed} >= {result.action_id, undone.action_id}


async def test_stale_command_is_recorded_and_skipped(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str
) -> None:
    engine = engine_limits_restored
    published = Published()
    executor = make_executor(engine, redis_url, redis_prefix, published)
    before = await engine_limits(engine)
    command = healing_command(
        events_pb2.ACTION_KIND_SET_ENGINE_LIMITS, engine_limits=events_pb2.EngineLimits(max_num_running_reqs=1)
    )
    command.deadline.FromNanoseconds(int((time.time() - 1) * 1e9))
    result = await executor.handle(command)
    assert result.status == events_pb2.ACTION_STATUS_SKIPPED_STALE
    assert await engine_limits(engine) == before
    assert (await executor.state.action(result.action_id)) is not None


async def test_redis_unreachable_refuses_mutation_and_changes_nothing(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str
) -> None:
    engine = engine_limits_restored
    published = Published()
    executor = make_executor(engine, redis_url, redis_prefix, published)
    executor.state = RedisState(connect("redis://127.0.0.1:1/0"), prefix=redis_prefix)
    before = await engine_limits(engine)
    command = healing_command(
        events_pb2.ACTION_KIND_SET_ENGINE_LIMITS, engine_limits=events_pb2.EngineLimits(max_num_running_reqs=1)
    )
    with pytest.raises(StateUnavailable, match="Redis unreachable"):
        await executor.handle(command)
    assert await engine_limits(engine) == before
    assert published.results == []


async def test_grpc_api_authenticates_and_answers_invalid_argument_with_reasons(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str
) -> None:
    engine = engine_limits_restored
    executor = make_executor(engine, redis_url, redis_prefix, Published())
    binding = ServiceBinding(executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorServicer(executor), SERVICE_NAME)
    before = await engine_limits(engine)
    async with (
        GrpcServer([binding], token="s3cret", mutating_methods=MUTATING_METHODS) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        stub = executor_pb2_grpc.ExecutorStub(channel)
        auth = bearer_metadata("s3cret")
        good = healing_command(
            events_pb2.ACTION_KIND_SET_ENGINE_LIMITS, engine_limits=events_pb2.EngineLimits(max_num_running_reqs=2)
        )
        with pytest.raises(grpc.aio.AioRpcError) as unauthenticated:
            await stub.Apply(good)
        assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED

        bad_cases = {
            "max_num_running_reqs must be >= 1": healing_command(
                events_pb2.ACTION_KIND_SET_ENGINE_LIMITS, engine_limits=events_pb2.EngineLimits(max_num_running_reqs=0)
            ),
            "at least one KV block": healing_command(
                events_pb2.ACTION_KIND_SET_ENGINE_LIMITS,
                engine_limits=events_pb2.EngineLimits(max_num_scheduled_tokens=8),
            ),
            "unknown action kind": healing_command(77),
        }
        unknown_target = healing_command(events_pb2.ACTION_KIND_FLUSH_CACHE)
        unknown_target.meta.target.engine = "vllm-9"
        bad_cases["unknown target engine 'vllm-9'"] = unknown_target
        for reason, command in bad_cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                await stub.Apply(command, metadata=auth)
            assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert reason in (invalid.value.details() or ""), invalid.value.details()
        assert await engine_limits(engine) == before

        applied = await stub.Apply(good, metadata=auth)
        assert applied.status == APPLIED
        limits = await stub.GetLimits(executor_pb2.GetLimitsRequest(target=good.meta.target))
        assert limits.state.engine_limits.max_num_running_reqs == 2
        listed = await stub.ListActions(executor_pb2.ListActionsRequest(target=good.meta.target, limit=5))
        assert applied.action_id in [a.action_id for a in listed.actions]
        with pytest.raises(grpc.aio.AioRpcError) as no_token_rollback:
            await stub.Rollback(executor_pb2.RollbackRequest(action_id=applied.action_id))
        assert no_token_rollback.value.code() == grpc.StatusCode.UNAUTHENTICATED
        rolled = await stub.Rollback(executor_pb2.RollbackRequest(action_id=applied.action_id), metadata=auth)
        assert rolled.status == events_pb2.ACTION_STATUS_ROLLED_BACK
        assert await engine_limits(engine) == before


async def test_a_cap_factor_is_resolved_and_applied_on_the_live_engine(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str
) -> None:
    engine = engine_limits_restored
    executor = make_executor(engine, redis_url, redis_prefix, Published())
    assert engine.control_address
    async with EngineControlClient(engine.control_address) as control:
        deadline = time.monotonic() + 30
        while (state := await control.state()).running or state.waiting:
            assert time.monotonic() < deadline, f"the engine never went idle: {state}"
            await asyncio.sleep(0.05)
    # Idle, the factor applies to the current cap (with streams running, to their count:
    # tests/executor/test_domain.py); how many run at a moment is not something a test here can pin.
    command = healing_command(
        events_pb2.ACTION_KIND_SET_ENGINE_LIMITS,
        engine_limits=events_pb2.EngineLimits(max_num_running_reqs_factor=0.5),
    )
    result = await executor.handle(command)
    assert result.status == APPLIED, result.detail
    expected = state.limits.max_num_running_reqs // 2
    assert result.before.engine_limits.max_num_running_reqs == state.limits.max_num_running_reqs
    assert result.after.engine_limits.max_num_running_reqs == expected
    assert (await engine_limits(engine)).max_num_running_reqs == expected


async def test_breakers_and_pressure_drive_a_real_envoy(
    vllm_engine: VllmServer, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    # Relative: inside the Envoy workdir, not the system default under /var/run.
    policy = policy_in_front_of(vllm_engine, overload=Overload(pressure_file="gpu_pressure"))
    async with EnvoyProcess(policy, workdir=tmp_path / "envoy") as envoy:
        executor = make_executor(
            vllm_engine,
            redis_url,
            redis_prefix,
            Published(),
            envoy_admin_url=envoy.admin_url,
            pressure_file=envoy.pressure_file,
        )
        admin = EnvoyAdmin(envoy.admin_url)
        shed = healing_command(
            events_pb2.ACTION_KIND_SHED_PRIORITY,
            breaker=events_pb2.BreakerSetting(
                priority=common_pb2.PRIORITY_P1, state=events_pb2.BREAKER_STATE_OPEN, max_requests=0, ttl_seconds=60
            ),
        )
        result = await executor.handle(shed)
        assert result.status == APPLIED, result.detail
        limits = await admin.breaker_limits("vllm")
        assert limits[Tier.P1] == 0 and limits[Tier.P2] == 0
        assert limits[Tier.P0] == 1000
        board = await executor.state.breakers(ENGINE)
        assert set(board.records) == {Tier.P1, Tier.P2}
        undone = await executor.rollback(result.action_id)
        assert undone.status == events_pb2.ACTION_STATUS_ROLLED_BACK
        restored = await admin.breaker_limits("vllm")
        assert restored[Tier.P1] == 1000 and restored[Tier.P2] == 1000

        pressure = await executor.handle(healing_command(events_pb2.ACTION_KIND_SET_PRESSURE, pressure=0.85))
        assert pressure.status == APPLIED
        assert read_pressure(envoy.pressure_file) == pytest.approx(0.85)
        assert pressure.after.pressure == pytest.approx(0.85)
        runtime = await admin.runtime()
        assert breaker_key("vllm", "p1") in runtime


async def test_abort_takes_the_lowest_priority_streams_and_spares_p0(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str
) -> None:
    engine = engine_limits_restored
    executor = make_executor(engine, redis_url, redis_prefix, Published())
    assert engine.control_address
    async with EngineControlClient(engine.control_address) as control:
        # Held in the queue, the streams cannot finish before the abort lands, however fast the engine is.
        await control.set_limits({"admission_paused": True})
        ch0, p0_tasks = await start_streams(engine.address, 2, prompt_len=16, max_tokens=64, prefix="p0-keep")
        ch2, p2_tasks = await start_streams(engine.address, 3, prompt_len=16, max_tokens=64, prefix="p2-drop")
        try:
            held = await polled_until(control.in_flight, lambda requests: len(requests) >= 5, 30.0, 0.01)
            in_flight = {r.request_id: r.tier for r in held}
            assert in_flight["p2-drop-0"] == 2 and in_flight["p0-keep-0"] == 0
            command = healing_command(
                events_pb2.ACTION_KIND_ABORT_LOW_PRIORITY,
                abort=events_pb2.AbortParams(at_or_below=common_pb2.PRIORITY_P1, max_streams=10),
            )
            result = await executor.handle(command)
            assert result.status == APPLIED, result.detail
            assert "aborted 3 stream(s)" in result.detail
            dropped = await asyncio.wait_for(asyncio.gather(*p2_tasks, return_exceptions=True), timeout=60)
            await control.set_limits({"admission_paused": False})
            kept = await asyncio.wait_for(asyncio.gather(*p0_tasks), timeout=120)
        finally:
            await ch0.close(grace=None)
            await ch2.close(grace=None)
    assert [len(o.tokens) for o in kept] == [64, 64]
    for outcome in dropped:
        assert isinstance(outcome, BaseException) or len(outcome.tokens) < 64, outcome


async def test_a_tier_budget_drains_its_backlog_through_the_plugin_without_vllms_abort(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    # An engine serving the OpenAI API has no gRPC Abort: here the executor's vLLM address answers nothing,
    # and the drain goes through the plugin. A demo on that path (2026-12-07) saw each budget cut with a
    # backlog fail whole on vLLM's Abort, then (after 80a4a19) hold at Envoy with the backlog left in place.
    engine = engine_limits_restored
    assert engine.control_address
    async with (
        EnvoyProcess(policy_in_front_of(engine), workdir=tmp_path / "envoy") as envoy,
        EngineControlClient(engine.control_address) as control,
    ):
        executor = make_executor(engine, redis_url, redis_prefix, Published(), envoy_admin_url=envoy.admin_url)
        executor.targets[ENGINE].engine = VllmEngineClient(f"127.0.0.1:{free_port()}", timeout_s=2.0)
        await control.set_limits({"admission_paused": True})
        channel, tasks = await start_streams(engine.address, 2, prompt_len=16, max_tokens=8, prefix="p2-wait")
        try:
            await polled_until(control.in_flight, lambda requests: len(requests) >= 2, 30.0, 0.01)
            cut = events_pb2.TierBudget(
                limits=[
                    events_pb2.TierLimit(priority=common_pb2.PRIORITY_P1, max_requests=1),
                    events_pb2.TierLimit(priority=common_pb2.PRIORITY_P2, max_requests=0),
                ],
                lease_seconds=30,
                drain_backlog=True,
            )
            result = await executor.handle(healing_command(events_pb2.ACTION_KIND_SET_TIER_BUDGET, tier_budget=cut))
            assert result.status == APPLIED, result.detail
            assert "aborted 2 waiting beyond it: p2-wait-" in result.detail
            limits = await EnvoyAdmin(envoy.admin_url).breaker_limits("vllm")
            assert (limits[Tier.P1], limits[Tier.P2]) == (1, 0)
            # The streams end at once, with vLLM's finish reason for an abort, while admission is still paused.
            ended = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            assert [(o.finish_reason, o.tokens) for o in ended] == [("abort", []), ("abort", [])]
            assert await control.in_flight() == []
            # The plugin says so in the engine's log.
            ended_in_log = lambda log: "SITS abort: ended p2-wait-" in log  # noqa: E731
            await polled_until(lambda: asyncio.to_thread(engine.log_path.read_text), ended_in_log, 10, 0.2)
        finally:
            await control.set_limits({"admission_paused": False})
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
            await channel.close(grace=None)
            await close_engine_clients(executor)


async def test_flush_cache_applies(engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str) -> None:
    executor = make_executor(engine_limits_restored, redis_url, redis_prefix, Published())
    result = await executor.handle(healing_command(events_pb2.ACTION_KIND_FLUSH_CACHE))
    assert result.status == APPLIED, result.detail
    assert "flushed" in result.detail
    with pytest.raises(InvalidCommand):
        await executor.handle(healing_command(events_pb2.ACTION_KIND_FLUSH_CACHE, pressure=0.5))


class Killed(BaseException):
    """kill -9 at that line: nothing after it runs."""


async def test_a_result_lost_to_a_kill_goes_out_when_the_command_comes_again(
    engine_limits_restored: VllmServer, redis_url: str, redis_prefix: str, settings: Settings, topics: Topics
) -> None:
    engine = engine_limits_restored
    assert engine.control_address
    await ensure_topics(settings)
    executor_settings = ExecutorSettings(
        **settings.model_dump(include={"kafka_bootstrap", "topic_prefix", "kafka_partitions", "redis_url"}),
        executor_targets={ENGINE: EngineEndpoints(engine_addr=engine.address, control_addr=engine.control_address)},
    )
    command = healing_command(
        events_pb2.ACTION_KIND_SET_ENGINE_LIMITS, engine_limits=events_pb2.EngineLimits(max_num_running_reqs=3)
    )
    async with EventProducer(executor_settings) as producer:
        # The first replica applies and records the action, and is killed before it publishes the result.
        first = build_executor(executor_settings, producer, connect(redis_url), redis_prefix=redis_prefix)

        async def killed(_result: events_pb2.ActionResult) -> None:
            raise Killed

        first.publish = killed
        with pytest.raises(Killed):
            await first.handle(command)
        await close_engine_clients(first)
        # The command comes again, to the next owner: it applies nothing twice, and the lost result goes out.
        second = build_executor(executor_settings, producer, connect(redis_url), redis_prefix=redis_prefix)
        topic_reads: list[str] = []
        assert second.result_published is not None
        read_topic = second.result_published

        async def counted(key: str, action_id: str, written_at: float) -> bool:
            topic_reads.append(action_id)
            return await read_topic(key, action_id, written_at)

        second.result_published = counted
        again = await second.handle(command)
        assert again.status == events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE
        assert len(topic_reads) == 1
        # A third delivery does not publish it twice, nor look for it on the topic again: it is noted as published.
        assert (await second.handle(command)).status == events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE
        assert len(topic_reads) == 1
        # The same for a rollback: undone and recorded, its result lost to a kill, sent when it comes again.
        undo = healing_command(
            events_pb2.ACTION_KIND_ROLLBACK, rollback=events_pb2.RollbackParams(action_id=again.detail.split()[-1])
        )
        second.publish, publish = killed, second.publish
        with pytest.raises(Killed):
            await second.handle(undo)
        second.publish = publish
        assert (await second.handle(undo)).status == events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE
        assert len(topic_reads) == 2
        # A result published as usual is a duplicate's answer with no topic read.
        limits = healing_command(
            events_pb2.ACTION_KIND_SET_ENGINE_LIMITS, engine_limits=events_pb2.EngineLimits(max_num_running_reqs=2)
        )
        assert (await second.handle(limits)).status == APPLIED
        assert (await second.handle(limits)).status == events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE
        assert len(topic_reads) == 2
        await close_engine_clients(second)
    results = [events_pb2.ActionResult.FromString(r.value) for r in await read_all(settings, topics.results, 8, 3.0)]
    assert [r.status for r in results] == [
        APPLIED,
        events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE,
        events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE,
        events_pb2.ACTION_STATUS_ROLLED_BACK,
        events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE,
        APPLIED,
        events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE,
    ]
    assert results[0].command_id == command.command_id and results[0].action_id in again.detail
    assert results[3].rolled_back_action_id == results[0].action_id
