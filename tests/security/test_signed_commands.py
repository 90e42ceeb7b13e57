"""Only commands SITS signed steer an engine: the executor service on the real broker and Redis.

The executor runs as it does in production (`services.executor.main.serve`), with a key
ring file, acting through SET_PRESSURE (the Envoy overload file it owns; no engine
process is needed for that action). Forged records go to the dead-letter topic with
their reason, and neither the pressure file, nor the executor's action log, nor the
results topic moves; a properly signed command applies as before; keys rotate while
commands flow and none is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from services.executor.main import serve
from services.executor.settings import EngineEndpoints, ExecutorSettings
from sits.runtime.bus import EventProducer, ensure_topics
from sits.runtime.contract import format_target_key
from sits.runtime.events import Topics, cloudevent_headers, new_meta
from sits.runtime.kafka_security import kafka_client_options
from sits.runtime.redis import connect
from sits.runtime.settings import Settings
from sits.runtime.signing import KeyFile, Signer, SigningKey, new_key, write_key_file
from sits.v1 import common_pb2, events_pb2
from sits_app.stack.tansu import TansuBroker
from sits_mesh.pressure import read_pressure
from tests.security.records import Collector
from tests.waiting import eventually

APPLIED = events_pb2.ACTION_STATUS_APPLIED
EXECUTOR_PREFIX = "sits:executor:"


@dataclass
class RunningExecutor:
    settings: ExecutorSettings
    topics: Topics
    engine: str
    ring: Path
    pressure_file: Path
    collector: Collector
    commands: list[str] = field(default_factory=list)

    def target(self) -> common_pb2.Target:
        return common_pb2.Target(host="test-host", gpu_uuid="GPU-sec-0", engine=self.engine)

    def command(
        self, pressure: float, *, deadline_s: float | None = 60.0, command_id: str | None = None
    ) -> events_pb2.HealingCommand:
        now = time.time()
        command = events_pb2.HealingCommand(
            meta=new_meta("decision", self.target(), now),
            command_id=command_id or f"{self.topics.prefix}{uuid.uuid4().hex}",
            kind=events_pb2.ACTION_KIND_SET_PRESSURE,
            reason="security test",
            pressure=pressure,
        )
        if deadline_s is not None:
            command.deadline.FromNanoseconds(int((now + deadline_s) * 1e9))
        self.commands.append(command.command_id)
        return command

    def statuses(self, command_id: str) -> list[int]:
        return [r.status for r in self.collector.results(self.topics.results) if r.command_id == command_id]

    def dead_letters(self) -> list[tuple[str, str]]:
        """(command_id, reason) of every dead-lettered record."""
        out = []
        for record in self.collector.of(self.topics.deadletter):
            message = record.message()
            command_id = message.command_id if isinstance(message, events_pb2.HealingCommand) else ""
            out.append((command_id, record.reason))
        return out

    async def action_count(self) -> int:
        client = connect(self.settings.redis_url)
        try:
            return int(await client.zcard(f"{EXECUTOR_PREFIX}actions:{self.engine}"))
        finally:
            await client.aclose()

    async def applied(self, command_id: str, timeout_s: float = 20.0) -> bool:
        return await eventually(lambda: APPLIED in self.statuses(command_id), timeout_s)


async def forget(settings: Settings, engine: str, commands: list[str]) -> None:
    client = connect(settings.redis_url)
    try:
        ids = await client.zrange(f"{EXECUTOR_PREFIX}actions:{engine}", 0, -1)
        keys = [f"{EXECUTOR_PREFIX}action:{i.decode()}" for i in ids]
        keys += [f"{EXECUTOR_PREFIX}{kind}:{engine}" for kind in ("actions", "lease", "fence", "pressure")]
        keys += [f"{EXECUTOR_PREFIX}{kind}:{c}" for c in commands for kind in ("applied", "digest")]
        await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
async def executor(
    broker: TansuBroker, redis_url: str, topic_prefix: str, tmp_path: Path
) -> AsyncIterator[RunningExecutor]:
    engine = f"{topic_prefix}sec"
    ring = tmp_path / "executor-keys"
    write_key_file(ring, [SIGNING_KEY])
    settings = ExecutorSettings(
        kafka_bootstrap=broker.bootstrap,
        redis_url=redis_url,
        topic_prefix=topic_prefix,
        kafka_partitions=1,  # one partition: records are handled in the order they were sent
        host_name="test-host",
        executor_addr="127.0.0.1:0",
        metrics_port=0,
        executor_targets={engine: EngineEndpoints(engine_addr="127.0.0.1:9", control_addr="127.0.0.1:9")},
        envoy_pressure_file=tmp_path / "pressure",
        executor_verify_keys_file=ring,
        executor_lease_ttl_ms=2000,
    )
    topics = Topics(topic_prefix)
    await ensure_topics(settings)  # before the collector assigns their partitions
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop))
    running: RunningExecutor | None = None
    try:
        async with Collector(kafka_client_options(settings), [topics.results, topics.deadletter]) as collector:
            running = RunningExecutor(settings, topics, engine, ring, tmp_path / "pressure", collector)
            yield running
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(service, 30)
        await forget(settings, engine, running.commands if running else [])


SIGNING_KEY = new_key("k1")


async def raw_send(settings: Settings, topic: str, key: str, value: bytes, headers: list[tuple[str, bytes]]) -> None:
    producer = AIOKafkaProducer(**kafka_client_options(settings), linger_ms=0)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value=value, key=key.encode(), headers=headers)
    finally:
        await producer.stop()


@pytest.mark.timeout(120)
async def test_forged_records_are_dead_lettered_with_their_reason_and_change_nothing(
    executor: RunningExecutor,
) -> None:
    x = executor
    async with EventProducer(x.settings, signer=Signer([SIGNING_KEY])) as signed:
        warm = x.command(0.3)
        await signed.publish(x.topics.commands, warm)
        assert await x.applied(warm.command_id, 30), "the executor applies a properly signed command"
        assert read_pressure(x.pressure_file) == pytest.approx(0.3)
        actions_before = await x.action_count()

        forged: dict[str, events_pb2.HealingCommand] = {}
        async with EventProducer(x.settings) as unsigned:
            forged["unsigned"] = x.command(0.01)
            await unsigned.publish(x.topics.commands, forged["unsigned"])
        wrong_secret = SigningKey("k1", b"not-the-executors-secret-0123456789")
        async with EventProducer(x.settings, signer=Signer([wrong_secret])) as wrong:
            forged["bad_signature"] = x.command(0.02)
            await wrong.publish(x.topics.commands, forged["bad_signature"])
        async with EventProducer(x.settings, signer=Signer([new_key("k-stolen")])) as unknown:
            forged["unknown_key"] = x.command(0.03)
            await unknown.publish(x.topics.commands, forged["unknown_key"])
        # Signed, then changed on the way: the value no longer matches the signature.
        original = x.command(0.35)
        key = format_target_key(original.meta.target)
        headers = cloudevent_headers(original, key) + Signer([SIGNING_KEY]).headers(
            key.encode(), original.SerializeToString()
        )
        tampered = events_pb2.HealingCommand()
        tampered.CopyFrom(original)
        tampered.pressure = 0.04
        forged["tampered (bad_signature)"] = tampered
        await raw_send(x.settings, x.topics.commands, key, tampered.SerializeToString(), headers)
        # Signed with the real key, but replays: past its deadline, or a seen command_id asking something else.
        forged["expired"] = x.command(0.05, deadline_s=-1.0)
        await signed.publish(x.topics.commands, forged["expired"])
        forged["replayed"] = x.command(0.06, command_id=warm.command_id)
        await signed.publish(x.topics.commands, forged["replayed"])
        forged["bad_deadline"] = x.command(0.07, deadline_s=None)
        await signed.publish(x.topics.commands, forged["bad_deadline"])
        # The warm command again, byte for byte (still in time): the executor answers it as a duplicate.
        await signed.publish(x.topics.commands, warm)

        sentinel = x.command(0.4)
        await signed.publish(x.topics.commands, sentinel)
        assert await x.applied(sentinel.command_id), "a signed command after the forged ones still applies"

    # One partition: everything sent before the sentinel was handled before it.
    dead = x.dead_letters()
    assert len(dead) == len(forged), dead
    for case, command in forged.items():
        category = case.split("(")[-1].rstrip(")")  # "tampered (bad_signature)" is refused as bad_signature
        found = [reason for command_id, reason in dead if command_id == command.command_id]
        assert len(found) == 1, (case, dead)
        assert found[0].startswith(f"{category}:"), (case, found)
        if case != "replayed":  # the replay reused the warm command's id: its results are checked below
            assert x.statuses(command.command_id) == [], f"{case}: no result, nothing applied"
    assert x.statuses(warm.command_id) == [APPLIED, events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE]
    assert x.statuses(sentinel.command_id) == [APPLIED]
    assert read_pressure(x.pressure_file) == pytest.approx(0.4)
    assert await x.action_count() == actions_before + 1, "only the sentinel was recorded as an action"


@pytest.mark.timeout(120)
async def test_keys_rotate_while_commands_flow_and_none_is_lost(executor: RunningExecutor, tmp_path: Path) -> None:
    x = executor
    old, new = SIGNING_KEY, new_key("k2")
    signing_file = tmp_path / "signing-key"
    write_key_file(signing_file, [old])
    # The decision's signer re-reads its file; checking at every command makes the switch exact here.
    signer = Signer(KeyFile(signing_file, recheck_s=0.0))
    sent: list[str] = []
    async with EventProducer(x.settings, signer=signer) as producer:

        async def send(count: int) -> None:
            for i in range(count):
                command = x.command(round(0.1 + 0.01 * (len(sent) % 50), 2))
                await producer.publish(x.topics.commands, command)
                sent.append(command.command_id)
                assert i < count

        await send(10)
        write_key_file(x.ring, [old, new])  # 1. executors accept the new key too
        await send(10)  # still signed with the old key, in flight
        write_key_file(signing_file, [new])  # 2. signers switch to the new key
        await send(10)
        assert signer.key_id == "k2"
        assert await eventually(lambda: all(APPLIED in x.statuses(c) for c in sent), 60), [
            c for c in sent if APPLIED not in x.statuses(c)
        ]
        assert x.dead_letters() == [], "nothing was refused during the rotation"

        write_key_file(x.ring, [new])  # 3. the old key is retired
        late = x.command(0.5)
        async with EventProducer(x.settings, signer=Signer([old])) as old_signer:
            await old_signer.publish(x.topics.commands, late)
        fresh = x.command(0.6)
        await producer.publish(x.topics.commands, fresh)
        assert await x.applied(fresh.command_id)
    dead = x.dead_letters()
    assert len(dead) == 1 and dead[0][0] == late.command_id, dead
    assert dead[0][1].startswith("unknown_key:"), "a command signed with the retired key is refused"
    assert x.statuses(late.command_id) == []
    assert sum(1 for c in sent if x.statuses(c) == [APPLIED]) == 30
    assert read_pressure(x.pressure_file) == pytest.approx(0.6)
