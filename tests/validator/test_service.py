"""The validator service on real Kafka, Redis and gRPC: verdicts, rollbacks, the audit trail."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.validator.audit import AuditStore
from services.validator.domain import Validator
from services.validator.grpc_api import ValidatorApi
from services.validator.service import ValidatorService
from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent, ensure_topics
from sits.runtime.clock import ManualClock
from sits.runtime.events import Topics, new_meta
from sits.runtime.grpcserver import GrpcServer, ServiceBinding
from sits.runtime.settings import Settings
from sits.v1 import common_pb2, events_pb2, validator_pb2, validator_pb2_grpc
from tests.runtime.test_bus import read_all
from tests.waiting import eventually

TARGET = common_pb2.Target(host="h", gpu_uuid="GPU-1", engine="vllm-0")


def result(
    action_id: str, applied_at: float, watermark: float, direction: int = events_pb2.CHANGE_DIRECTION_LOOSEN
) -> events_pb2.ActionResult:
    r = events_pb2.ActionResult(
        meta=new_meta("executor", TARGET, applied_at),
        action_id=action_id,
        command_id=f"cmd-{action_id}",
        kind=events_pb2.ACTION_KIND_SHED_PRIORITY,
        status=events_pb2.ACTION_STATUS_APPLIED,
        direction=direction,  # type: ignore[arg-type]
        promise=events_pb2.Promise(gpu_memory_fraction_below=watermark, no_oom=True),
    )
    r.applied_at.FromNanoseconds(int(applied_at * 1e9))
    return r


def sample(at: float, fraction: float) -> events_pb2.MetricSample:
    s = events_pb2.MetricSample(meta=new_meta("capture", TARGET, at))
    s.gpu.total_bytes = 100 << 30
    s.gpu.used_bytes = int(fraction * (100 << 30))
    # The engine holds 30 GiB of it; a co-tenant the rest.
    s.processes.add(pid=7, used_bytes=30 << 30, name="VLLM::EngineCore", is_target_engine=True)
    s.processes.add(pid=8, used_bytes=s.gpu.used_bytes - (30 << 30), name="co-tenant")
    return s


@pytest.mark.timeout(90)
async def test_failed_promise_is_rolled_back_and_audited(settings: Settings, topics: Topics, redis_client) -> None:
    await ensure_topics(settings)
    clock = ManualClock(start=time.time())
    t0 = clock.now()
    async with EventProducer(settings) as producer:
        service = ValidatorService(
            validator=Validator(),
            audit=AuditStore(redis_client, settings.topic_prefix),
            producer=producer,
            topics=topics,
            clock=clock,
        )
        api = ValidatorApi(AuditStore(redis_client, settings.topic_prefix), service.live)
        binding = ServiceBinding(validator_pb2_grpc.add_ValidatorServicer_to_server, api, "sits.v1.Validator")
        async with GrpcServer([binding]) as server, grpc.aio.insecure_channel(server.address) as channel:
            stub = validator_pb2_grpc.ValidatorStub(channel)
            live = stub.StreamVerdicts(validator_pb2.StreamVerdictsRequest(target=TARGET))

            # "good" brings memory under its watermark; "bad" (an un-shed: it loosened) does not, and is
            # undone; "cut" (it tightened) does not either, and is not undone: rolling it back would loosen.
            await producer.publish(topics.results, result("good", t0, watermark=0.9))
            await producer.publish(topics.results, result("bad", t0, watermark=0.5))
            await producer.publish(
                topics.results, result("cut", t0, watermark=0.5, direction=events_pb2.CHANGE_DIRECTION_TIGHTEN)
            )
            # A step-budget cut promises the engine's own memory: kept, whatever the co-tenant holds.
            step_cut = result("step-cut", t0, watermark=0.5, direction=events_pb2.CHANGE_DIRECTION_TIGHTEN)
            step_cut.promise.ClearField("gpu_memory_fraction_below")
            step_cut.promise.engine_memory_bytes_below = 31 << 30
            await producer.publish(topics.results, step_cut)
            for i in range(6):
                await producer.publish(topics.metrics, sample(t0 + i, 0.8))
            consumer = EventConsumer(
                settings,
                group_id=f"{topics.prefix}v",
                topics=[topics.results, topics.metrics],
                handler=service.handle,
                dead_letters=producer,
            )
            stop = asyncio.Event()
            async with consumer:
                task = asyncio.create_task(consumer.run(stop))
                assert await eventually(lambda: len(service.validator.pending) == 4)
                # Let the samples arrive too, then move past the settle window.
                assert await eventually(lambda: consumer.stats.handled + consumer.stats.coalesced >= 10)
                assert await service.judge_due() == 0, "nothing is judged before its settle window ends"
                clock.advance(5.0)
                assert await service.judge_due() == 4
                stop.set()
                await task

            streamed = [await asyncio.wait_for(live.read(), 5) for _ in range(4)]
            live.cancel()
            assert {v.action_id for v in streamed} == {"good", "bad", "cut", "step-cut"}

            bad = await stub.GetVerdict(validator_pb2.GetVerdictRequest(action_id="bad"))
            good = await stub.GetVerdict(validator_pb2.GetVerdictRequest(action_id="good"))
            assert bad.verdict == events_pb2.VERDICT_ROLLED_BACK
            assert bad.rollback_command_id == "rollback-bad"
            assert good.verdict == events_pb2.VERDICT_CONFIRMED
            assert good.command_id == "cmd-good"
            memory = next(c for c in bad.checks if c.name == "gpu_memory_below")
            assert memory.observed == pytest.approx(0.8) and memory.threshold == 0.5
            cut = await stub.GetVerdict(validator_pb2.GetVerdictRequest(action_id="cut"))
            assert cut.verdict == events_pb2.VERDICT_NOT_KEPT and not cut.rollback_command_id
            assert cut.direction == events_pb2.CHANGE_DIRECTION_TIGHTEN
            step = await stub.GetVerdict(validator_pb2.GetVerdictRequest(action_id="step-cut"))
            assert step.verdict == events_pb2.VERDICT_CONFIRMED
            held = next(c for c in step.checks if c.name == "engine_memory_below")
            assert held.observed == 30 << 30 and held.threshold == 31 << 30

            listed = await stub.ListVerdicts(
                validator_pb2.ListVerdictsRequest(target=TARGET, verdict=events_pb2.VERDICT_ROLLED_BACK)
            )
            assert [v.action_id for v in listed.verdicts] == ["bad"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListVerdicts(validator_pb2.ListVerdictsRequest(limit=-1))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetVerdict(validator_pb2.GetVerdictRequest())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # A redelivered result does not produce a second verdict or rollback.
        redelivered = result("bad", t0, watermark=0.5)
        await service.handle(ReceivedEvent(topics.results, 0, 0, "h/GPU-1//vllm-0", redelivered, ()))
        clock.advance(10)
        assert await service.judge_due() == 0

    commands = await read_all(settings, topics.commands, 2, timeout_s=3)
    rollbacks = [events_pb2.HealingCommand.FromString(r.value) for r in commands]
    assert [c.command_id for c in rollbacks] == ["rollback-bad"]
    assert rollbacks[0].kind == events_pb2.ACTION_KIND_ROLLBACK
    assert rollbacks[0].rollback.action_id == "bad"
    verdicts = await read_all(settings, topics.validation, 5, timeout_s=3)
    ids = [events_pb2.ValidationVerdict.FromString(r.value).verdict_id for r in verdicts]
    assert sorted(ids) == ["verdict-bad", "verdict-cut", "verdict-good", "verdict-step-cut"]
