"""The reliability scenarios of issue 7, each returning its figures; the tests assert on them, the bench records them.

- crash: a burst of samples, OOM events and garbage while every service is killed -9 in turn and restarted.
- broker outage: the broker stopped for 30 s under capture's load; the spool takes it and drains in order.
- Redis outage: the executor refuses while Redis is down and applies (within the deadline) once it is back.
- load: 10x the normal metric rate for 60 s; memory stays under each service's limit and lag recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc

from bench import reliability_harness as h
from sits.runtime.bus import EventProducer, ensure_topics
from sits.runtime.events import Topics
from sits.runtime.grpcserver import bearer_metadata
from sits.runtime.procs import ManagedProcess, free_port, port_open
from sits.v1 import events_pb2, executor_pb2_grpc
from sits_app.stack.embedded import SERVICES, EmbeddedStack

Figures = dict[str, Any]


# ---------------------------------------------------------------------------- crash


OOM_TARGETS = 4


@dataclass(frozen=True)
class CrashPlan:
    samples: int = 10_000
    targets: int = 8
    ooms: int = 100
    garbage: int = 24
    chunks: int = 40
    chunk_interval_s: float = 0.4
    first_kill_after_s: float = 2.0
    kill_every_s: float = 3.0
    settle_timeout_s: float = 120.0


async def crash_scenario(run_dir: Path, redis_url: str, topic_prefix: str, plan: CrashPlan = CrashPlan()) -> Figures:
    # OOMs go to targets of their own: a sample-caused command on the same target would put the OOM inside
    # the target's command cooldown (samples and OOMs travel on different topics, so their order is not kept).
    engines = h.engine_names(topic_prefix, plan.targets + OOM_TARGETS)
    host = "reliability-host"
    trace = h.calm_trace(run_dir / "calm.jsonl", host, f"{topic_prefix}capture")
    config = h.stack_config(
        run_dir,
        redis_url,
        topic_prefix,
        engines,
        replay_trace=trace,
        replay_speed=2.0,
        extra_env={"SITS_HOST_NAME": host},
    )
    topics = Topics(topic_prefix)
    figures: Figures = {}
    async with EmbeddedStack(config) as stack:
        rs = h.ReliabilityStack(stack, engines, host, topics)
        sent_ooms: list[str] = []
        started = time.monotonic()
        sender = asyncio.create_task(_burst(rs, plan, sent_ooms))
        restarts: dict[str, float] = {}
        await asyncio.sleep(plan.first_kill_after_s)
        for name in SERVICES:
            killed = time.monotonic()
            rs.process(name).kill_hard()
            await stack.start_service(name)
            restarts[name] = round(time.monotonic() - killed, 2)
            await asyncio.sleep(plan.kill_every_s)
        sent_by_test = await sender
        burst_s = time.monotonic() - started
        # Capture replays its trace in a loop: stopped (gracefully: what it queued goes out first), so that a
        # backlog measured after the settle is one the groups left, not a sample published a moment before.
        await rs.process("capture").astop()
        settle_started = time.monotonic()
        caught = await h.wait_groups_caught_up(rs, ("decision", "executor", "validator"), plan.settle_timeout_s)
        records, account = await _settled_actions(rs, timeout_s=30.0)
        settle_s = time.monotonic() - settle_started
        figures = {
            **await _accounted(rs, ("decision", "executor", "validator"), records, account, sent_ooms),
            "sent_by_test": sent_by_test,
            "garbage_sent": plan.garbage,
            "ooms_without_command": sum(1 for e in sent_ooms if not account.causes.get(e)),
            "command_records": account.command_records,
            "skipped_stale": account.count(events_pb2.ACTION_STATUS_SKIPPED_STALE),
            "redis_applied": len(account.redis_effects),
            "restart_s": restarts,
            "burst_s": round(burst_s, 1),
            "catch_up_s": {k: (round(v, 1) if v is not None else None) for k, v in caught.items()},
            "settle_s": round(settle_s, 1),
        }
        await h.forget_executor_keys(redis_url, engines, account.commands)
    return figures


async def _burst(rs: h.ReliabilityStack, plan: CrashPlan, sent_ooms: list[str]) -> int:
    """Samples crossing 90% memory back and forth per target, OOM events and garbage, acknowledged by the broker."""
    per_chunk = plan.samples // plan.chunks
    oom_every = max(1, plan.samples // max(1, plan.ooms))
    garbage_every = max(1, plan.samples // max(1, plan.garbage))
    sent = 0
    garbage = _garbage_records(plan.garbage)
    async with EventProducer(rs.settings) as producer:
        for chunk in range(plan.chunks):
            futures = []
            for n in range(chunk * per_chunk, (chunk + 1) * per_chunk):
                index = n % plan.targets
                per_target = n // plan.targets
                fraction = 0.95 if (per_target // 25) % 2 else 0.5
                # Sample and OOM times both follow the wall clock: a sample stamped ahead of an OOM would put
                # the OOM inside the target's command cooldown.
                at = time.time()
                futures.append(
                    await producer.enqueue(
                        rs.topics.metrics, h.metric_sample(rs.target(index), fraction, at, per_target + 1), traced=False
                    )
                )
                if n % oom_every == 0 and len(sent_ooms) < plan.ooms:
                    oom = h.oom_event(rs.target(plan.targets + n % OOM_TARGETS), time.time())
                    sent_ooms.append(oom.meta.event_id)
                    futures.append(await producer.enqueue(rs.topics.oom, oom))
                if n % garbage_every == 0 and garbage:
                    value, headers = garbage.pop()
                    await producer.forward_raw(rs.topics.metrics, b"garbage", value, headers)
                    sent += 1
            await asyncio.gather(*futures)
            sent += len(futures)
            await asyncio.sleep(plan.chunk_interval_s)
    return sent


def _garbage_records(count: int) -> list[tuple[bytes | None, list[tuple[str, bytes]]]]:
    """Records no consumer can decode: no headers, an unknown type, bytes that are not the type they claim."""
    typed = [
        ("ce_specversion", b"1.0"),
        ("ce_type", events_pb2.MetricSample.DESCRIPTOR.full_name.encode()),
        ("content-type", b"application/protobuf"),
        ("ce_id", b"x"),
    ]
    kinds = [
        (b"not a protobuf", []),
        (b"\x08\x01", [*typed[:1], ("ce_type", b"sits.v1.NoSuchEvent"), *typed[2:]]),
        (b"\xff\xff\xff\xff", typed),
    ]
    return [kinds[i % len(kinds)] for i in range(count)]


async def _settled_actions(
    rs: h.ReliabilityStack, timeout_s: float
) -> tuple[dict[str, list[h.Record]], h.ActionAccount]:
    """Read until every command has a result and the topics stopped growing (validator rollbacks come late)."""
    deadline = time.monotonic() + timeout_s
    previous = -1
    while True:
        records = await h.read_topics(rs.settings.kafka_bootstrap, rs.topics.all())
        account = await h.account_actions(rs, records)
        size = len(records[rs.topics.commands]) + len(records[rs.topics.results])
        if (not account.without_result and size == previous) or time.monotonic() > deadline:
            return records, account
        previous = size
        await asyncio.sleep(2.0)


async def _accounted(
    rs: h.ReliabilityStack,
    services: tuple[str, ...],
    records: dict[str, list[h.Record]],
    account: h.ActionAccount,
    sent_ooms: list[str],
) -> Figures:
    """What the fault scenarios account for alike: sent, handled, dead-lettered, lost, and the backlog each group
    left behind (lost counts the decision's backlog, OOMs without exactly one command, commands without result)."""
    backlog = {
        s: sum((await h.group_backlog(rs.settings.kafka_bootstrap, rs.group(s), rs.group_topics(s))).values())
        for s in services
    }
    inputs = [*rs.topics.samples, rs.topics.oom]
    sent = sum(len(records[t]) for t in inputs)
    dead = h.dead_letters_of(records[rs.topics.deadletter], rs.group("decision"), inputs)
    oom_without_command = [e for e in sent_ooms if len(account.causes.get(e, ())) != 1]
    return {
        "sent": sent,
        "handled": sent - len(dead) - backlog["decision"],
        "dead_lettered": len(dead),
        "lost": backlog["decision"] + len(oom_without_command) + len(account.without_result),
        "duplicates_applied": account.duplicates_applied,
        "ooms_sent": len(sent_ooms),
        "ooms_without_exactly_one_command": len(oom_without_command),
        "commands": len(account.commands),
        "commands_without_result": len(account.without_result),
        "applied": len(account.applied_in_topic),
        "skipped_duplicate": account.count(events_pb2.ACTION_STATUS_SKIPPED_DUPLICATE),
        "redis_agrees": set(account.redis_effects) == account.applied_in_topic,
        "backlog_after": backlog,
        # Where a group stopped short of the end, if it did: what a failure needs to be understood.
        "backlog_partitions": await h.partitions_behind(rs, backlog, records),
    }


# ---------------------------------------------------------------------------- broker outage


async def broker_outage_scenario(
    run_dir: Path, redis_url: str, topic_prefix: str, outage_s: float = 30.0, replay_speed: float = 10.0
) -> Figures:
    engines = h.engine_names(topic_prefix, 2)
    host = "reliability-host"
    trace = h.calm_trace(run_dir / "calm.jsonl", host, engines[1])
    config = h.stack_config(
        run_dir,
        redis_url,
        topic_prefix,
        engines,
        replay_trace=trace,
        replay_speed=replay_speed,
        extra_env={"SITS_HOST_NAME": host},
    )
    topics = Topics(topic_prefix)
    async with EmbeddedStack(config) as stack:
        rs = h.ReliabilityStack(stack, engines, host, topics)
        bootstrap = stack.settings.kafka_bootstrap
        capture = stack.services["capture"]
        await asyncio.sleep(3.0)
        # A consistent cut: with capture frozen, everything the broker acknowledged is read before it stops.
        with h.frozen(capture.process):
            before = _capture_sequences((await h.read_topics(bootstrap, [topics.metrics]))[topics.metrics])
            await asyncio.to_thread(stack.broker.stop)
        down_at = time.monotonic()
        spool_peak = 0.0
        while time.monotonic() - down_at < outage_s:
            await asyncio.sleep(2.0)
            spool_peak = max(spool_peak, await h.metric_value(capture.metrics_port, "sits_capture_spool_pending"))
        spool_files = sum(1 for p in (run_dir / "spool").rglob("*") if p.is_file())
        # Production Kafka comes back with its topics; Tansu's memory storage does not, so they are created
        # again while the services are frozen (two clients creating one topic at once confuse Tansu).
        with contextlib.ExitStack() as freeze:
            for service in stack.services.values():
                freeze.enter_context(h.frozen(service.process))
            await asyncio.to_thread(stack.broker.start)
            await ensure_topics(stack.settings)
        back_at = time.monotonic()
        drained = await _until(lambda: _spool_empty(capture.metrics_port), 60.0)
        drain_s = time.monotonic() - back_at
        # The services found the broker again by themselves: an OOM now goes all the way to an action.
        oom = h.oom_event(rs.target(0), time.time())
        async with EventProducer(stack.settings) as producer:
            await producer.publish(topics.oom, oom)
        reconnect_s = await _until_applied(rs, oom.meta.event_id, 60.0)
        reconnect_after_back_s = None if reconnect_s is None else round(time.monotonic() - back_at, 1)
        after = _capture_sequences((await h.read_topics(bootstrap, [topics.metrics]))[topics.metrics])
        seen = set(before) | set(after)
        top = max(seen) if seen else 0
        missing = [s for s in range(1, top + 1) if s not in seen]
        out_of_order = sum(1 for a, b in itertools.pairwise(after) if b <= a)
        pids = {n: s.process.pid for n, s in stack.services.items()}
        alive = all(s.process.alive() for s in stack.services.values())
        figures: Figures = {
            "sent": top,
            "handled": len(seen),
            "dead_lettered": 0,
            "duplicates_applied": 0,
            "lost": len(missing),
            "before_outage": len(before),
            "after_outage": len(after),
            "spool_peak_pending": int(spool_peak),
            "spool_files_during_outage": spool_files,
            "spool_drained": drained,
            "drain_s": round(drain_s, 1),
            "out_of_order": out_of_order,
            "redelivered": len(before) + len(after) - len(seen),
            "pipeline_recovered_s": reconnect_after_back_s,
            "services_alive_without_restart": alive and pids == {n: s.process.pid for n, s in stack.services.items()},
            "outage_s": outage_s,
        }
        await h.forget_executor_keys(redis_url, engines, [])
    return figures


def _capture_sequences(records: list[h.Record]) -> list[int]:
    """Sequences of capture's own samples in topic order (one target: one partition, so this is its order)."""
    out = []
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        for message in record.events():
            if isinstance(message, events_pb2.MetricSample) and message.meta.source.startswith("capture/"):
                out.append(message.sequence)
    return out


async def _spool_empty(port: int) -> bool:
    return await h.metric_value(port, "sits_capture_spool_pending") == 0


async def _until(check: Any, timeout_s: float, interval_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / interval_s) + 1):
        with contextlib.suppress(OSError, TimeoutError):
            if await check():
                return True
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(interval_s)
    return False


async def _until_applied(rs: h.ReliabilityStack, cause_event_id: str, timeout_s: float) -> float | None:
    """Seconds until the command caused by `cause_event_id` has an APPLIED result (None: not in time)."""
    started = time.monotonic()

    async def applied() -> bool:
        records = await h.read_topics(rs.settings.kafka_bootstrap, [rs.topics.commands, rs.topics.results])
        commands = set()
        for r in records[rs.topics.commands]:
            m = r.message()
            if isinstance(m, events_pb2.HealingCommand) and m.cause_event_id == cause_event_id:
                commands.add(m.command_id)
        for r in records[rs.topics.results]:
            m = r.message()
            if (
                isinstance(m, events_pb2.ActionResult)
                and m.command_id in commands
                and m.status == events_pb2.ACTION_STATUS_APPLIED
            ):
                return True
        return False

    return time.monotonic() - started if await _until(applied, timeout_s) else None


# ---------------------------------------------------------------------------- Redis outage


class PrivateRedis:
    """A redis-server of this scenario's own on a free port, so stopping it disturbs no one else."""

    def __init__(self, run_dir: Path) -> None:
        self.port = free_port()
        self._run_dir = run_dir
        self._proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self._proc = ManagedProcess(
            "redis",
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            self._run_dir / "logs" / "redis.log",
            cwd=self._run_dir,
        )
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while not port_open("127.0.0.1", self.port):
            if time.monotonic() > deadline or not self._proc.alive():
                raise RuntimeError(f"redis-server did not start:\n{self._proc.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop(grace_s=3.0)
            self._proc = None


async def redis_outage_scenario(run_dir: Path, topic_prefix: str, outage_s: float = 4.0) -> Figures:
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    redis = PrivateRedis(run_dir)
    await asyncio.to_thread(redis.start)
    engines = h.engine_names(topic_prefix, 1)
    config = h.stack_config(run_dir, redis.url, topic_prefix, engines, services=("executor",))
    topics = Topics(topic_prefix)
    try:
        async with EmbeddedStack(config) as stack:
            rs = h.ReliabilityStack(stack, engines, "reliability-host", topics)
            executor = rs.process("executor")
            pid = executor.pid
            async with EventProducer(stack.settings, signer=stack.command_signer()) as producer:
                warm = h.pressure_command(rs.target(0), 0.2, deadline_s=60)
                await producer.publish(topics.commands, warm)
                warm_ok = await _until(lambda: _status_is(rs, warm.command_id, events_pb2.ACTION_STATUS_APPLIED), 30)
                await asyncio.to_thread(redis.stop)
                down_at = time.monotonic()
                async with grpc.aio.insecure_channel(stack.address_of("executor")) as channel:
                    stub = executor_pb2_grpc.ExecutorStub(channel)
                    refused_code, refused_detail = await _apply_status(
                        stub, rs, h.pressure_command(rs.target(0), 0.3, 60)
                    )
                    in_time = h.pressure_command(rs.target(0), 0.4, deadline_s=120)
                    too_late = h.pressure_command(rs.target(0), 0.5, deadline_s=outage_s / 2)
                    await producer.publish(topics.commands, in_time)
                    await producer.publish(topics.commands, too_late)
                    await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - down_at)))
                    results_while_down = await _statuses(rs)
                    await asyncio.to_thread(redis.start)
                    up_at = time.monotonic()
                    applied = await _until(
                        lambda: _status_is(rs, in_time.command_id, events_pb2.ACTION_STATUS_APPLIED), 60, 0.2
                    )
                    recovery_s = time.monotonic() - up_at
                    # Past its deadline when Redis returned: refused at the executor's entry, never applied late.
                    stale = await _until(lambda: _dead_lettered_as(rs, too_late.command_id, "expired"), 10)
                    after_code, _ = await _apply_status(stub, rs, h.pressure_command(rs.target(0), 0.6, 60))
            statuses = await _statuses(rs)
            dead = {too_late.command_id} if stale else set()
            # A command is handled when it has a result, or was dead-lettered (the late one: expired).
            handled = [c for c in (warm, in_time, too_late) if statuses.get(c.command_id) or c.command_id in dead]
            figures: Figures = {
                "sent": 3,
                "handled": len(handled),
                "dead_lettered": len(dead),
                "duplicates_applied": sum(
                    max(0, [*v].count(events_pb2.ACTION_STATUS_APPLIED) - 1) for v in statuses.values()
                ),
                "lost": 3 - len(handled),
                "warm_applied": warm_ok,
                "grpc_while_down": refused_code.name,
                "grpc_while_down_detail": refused_detail,
                "results_while_down": sum(len(results_while_down.get(c.command_id, [])) for c in (in_time, too_late)),
                "applied_after_recovery": applied,
                "stale_skipped": stale,
                "grpc_after_recovery": after_code.name,
                "recovery_s": round(recovery_s, 2),
                "executor_restarted": executor.pid != pid or not executor.alive(),
                "outage_s": outage_s,
            }
    finally:
        await asyncio.to_thread(redis.stop)
    return figures


async def _apply_status(
    stub: executor_pb2_grpc.ExecutorStub, rs: h.ReliabilityStack, command: events_pb2.HealingCommand
) -> tuple[grpc.StatusCode, str]:
    try:
        await cast(Awaitable[Any], stub.Apply(command, metadata=bearer_metadata(rs.token), timeout=10))
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


async def _statuses(rs: h.ReliabilityStack) -> dict[str, list[int]]:
    records = await h.read_topics(rs.settings.kafka_bootstrap, [rs.topics.results])
    out: dict[str, list[int]] = {}
    for r in records[rs.topics.results]:
        m = r.message()
        if isinstance(m, events_pb2.ActionResult):
            out.setdefault(m.command_id, []).append(int(m.status))
    return out


async def _status_is(rs: h.ReliabilityStack, command_id: str, status: int) -> bool:
    return status in (await _statuses(rs)).get(command_id, [])


async def _dead_lettered_as(rs: h.ReliabilityStack, command_id: str, category: str) -> bool:
    """The command is on the dead-letter topic with `category` as its reason, and has no result."""
    records = await h.read_topics(rs.settings.kafka_bootstrap, [rs.topics.deadletter])
    refused = any(
        isinstance(m := r.message(), events_pb2.HealingCommand)
        and m.command_id == command_id
        and (r.header("sits_dlq_reason") or "").startswith(f"{category}:")
        for r in records[rs.topics.deadletter]
    )
    return refused and not (await _statuses(rs)).get(command_id)


# ---------------------------------------------------------------------------- load


@dataclass(frozen=True)
class LoadPlan:
    # "Normal": one capture per 8-GPU host at NVML's default 10 Hz, four hosts.
    targets: int = 32
    normal_hz: float = 10.0
    factor: float = 10.0
    duration_s: float = 60.0
    tick_s: float = 0.1
    recover_timeout_s: float = 90.0


async def load_scenario(run_dir: Path, redis_url: str, topic_prefix: str, plan: LoadPlan = LoadPlan()) -> Figures:
    engines = h.engine_names(topic_prefix, plan.targets)
    host = "reliability-host"
    config = h.stack_config(run_dir, redis_url, topic_prefix, engines, extra_env={"SITS_HOST_NAME": host})
    topics = Topics(topic_prefix)
    async with EmbeddedStack(config) as stack:
        rs = h.ReliabilityStack(stack, engines, host, topics)
        bounds = {name: h.k8s_memory_limit(name) for name in SERVICES}
        idle = {name: h.rss_bytes(rs.process(name).pid) for name in SERVICES}
        peak = dict(idle)
        peak_lag = 0
        per_tick = int(plan.targets * plan.normal_hz * plan.factor * plan.tick_s)
        sent = 0
        failed = 0
        started = time.monotonic()
        t0 = time.time()
        next_probe = started
        async with EventProducer(rs.settings, linger_ms=5) as producer:
            tick = 0
            while time.monotonic() - started < plan.duration_s:
                futures = []
                for n in range(per_tick):
                    index = n % plan.targets
                    at = t0 + tick * plan.tick_s + (n // plan.targets) * 0.001
                    sample = h.metric_sample(rs.target(index), 0.4, at, tick * per_tick + n + 1)
                    futures.append(await producer.enqueue(topics.metrics, sample, traced=False))
                # The shared machine's broker may time out a batch under this load: counted, not sent.
                outcomes = await asyncio.gather(*futures, return_exceptions=True)
                refused = sum(1 for o in outcomes if isinstance(o, BaseException))
                failed += refused
                sent += per_tick - refused
                tick += 1
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + 2.0
                    for name in SERVICES:
                        peak[name] = max(peak[name], h.rss_bytes(rs.process(name).pid))
                    backlog = await h.group_backlog(
                        stack.settings.kafka_bootstrap, rs.group("decision"), [topics.metrics]
                    )
                    peak_lag = max(peak_lag, sum(backlog.values()))
                pause = started + tick * plan.tick_s - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
        load_s = time.monotonic() - started
        caught = await h.wait_groups_caught_up(rs, ("decision", "validator"), plan.recover_timeout_s)
        for name in SERVICES:
            peak[name] = max(peak[name], h.rss_bytes(rs.process(name).pid))
        coalesced = await h.metric_value(stack.services["decision"].metrics_port, "sits_events_coalesced_total")
        left = sum(
            (await h.group_backlog(stack.settings.kafka_bootstrap, rs.group("decision"), [topics.metrics])).values()
        )
        mib = 1 << 20
        figures: Figures = {
            "sent": sent,
            "handled": sent - left,
            "dead_lettered": 0,
            "duplicates_applied": 0,
            "lost": left,
            "send_timeouts": failed,
            "target_rate_per_s": plan.targets * plan.normal_hz * plan.factor,
            "achieved_rate_per_s": round(sent / load_s, 1),
            "load_s": round(load_s, 1),
            "decision_coalesced": int(coalesced),
            "peak_lag": peak_lag,
            "lag_recovered_s": {k: (round(v, 1) if v is not None else None) for k, v in caught.items()},
            "idle_rss_mib": {k: round(v / mib, 1) for k, v in idle.items()},
            "peak_rss_mib": {k: round(v / mib, 1) for k, v in peak.items()},
            "bound_mib": {k: round(v / mib) for k, v in bounds.items()},
            "under_bound": all(peak[k] < bounds[k] for k in SERVICES),
        }
        await h.forget_executor_keys(redis_url, engines, [])
    return figures


# ---------------------------------------------------------------------------- replicas


@dataclass(frozen=True)
class ReplicaPlan:
    """Two replicas of each of decision, executor and validator under a burst; one of each killed -9 and one of
    each added while the burst runs."""

    replicas: int = 2
    partitions: int = 4
    samples: int = 4000
    targets: int = 8
    ooms: int = 40
    garbage: int = 12
    chunks: int = 20
    chunk_interval_s: float = 0.5
    first_kill_after_s: float = 2.0
    kill_every_s: float = 1.5
    settle_timeout_s: float = 150.0
    # A killed replica's partitions wait this long for the group to notice; short, so the test is too.
    session_timeout_ms: int = 6000


REPLICATED_SERVICES = ("decision", "executor", "validator")


async def replicas_scenario(
    run_dir: Path, redis_url: str, topic_prefix: str, plan: ReplicaPlan = ReplicaPlan()
) -> Figures:
    engines = h.engine_names(topic_prefix, plan.targets + OOM_TARGETS)
    host = "reliability-host"
    trace = h.calm_trace(run_dir / "calm.jsonl", host, f"{topic_prefix}capture")
    config = h.stack_config(
        run_dir,
        redis_url,
        topic_prefix,
        engines,
        replay_trace=trace,
        replay_speed=2.0,
        extra_env={
            "SITS_HOST_NAME": host,
            "SITS_CONSUMER_SESSION_TIMEOUT_MS": str(plan.session_timeout_ms),
            # INFO: the replicas log their assignments and handovers (read when a figure looks wrong).
            "SITS_LOG_LEVEL": "INFO",
        },
    )
    config.replicas = dict.fromkeys(REPLICATED_SERVICES, plan.replicas)
    config.partitions = plan.partitions
    topics = Topics(topic_prefix)
    figures: Figures = {}
    async with EmbeddedStack(config) as stack:
        rs = h.ReliabilityStack(stack, engines, host, topics)
        burst_plan = CrashPlan(
            samples=plan.samples,
            targets=plan.targets,
            ooms=plan.ooms,
            garbage=plan.garbage,
            chunks=plan.chunks,
            chunk_interval_s=plan.chunk_interval_s,
        )
        sent_ooms: list[str] = []
        started = time.monotonic()
        sender = asyncio.create_task(_burst(rs, burst_plan, sent_ooms))
        await asyncio.sleep(plan.first_kill_after_s)
        killed: list[str] = []
        for service in REPLICATED_SERVICES:
            # The second replica: it owns partitions (the group split them) and holds work in flight.
            name = stack.replicas_of(service)[-1]
            stack.services[name].process.kill_hard()
            killed.append(name)
            await asyncio.sleep(plan.kill_every_s)
        added = [s.name for s in await asyncio.gather(*(stack.add_replica(s) for s in REPLICATED_SERVICES))]
        sent_by_test = await sender
        burst_s = time.monotonic() - started
        await rs.process("capture").astop()  # its looping replay would leave a record in flight (see crash)
        settle_started = time.monotonic()
        caught = await h.wait_groups_caught_up(rs, REPLICATED_SERVICES, plan.settle_timeout_s)
        records, account = await _settled_actions(rs, timeout_s=30.0)
        verdicts = await _verdicts_settled(rs, account, timeout_s=60.0)
        records = verdicts.records
        settle_s = time.monotonic() - settle_started
        oom_not_applied = [e for e in sent_ooms if not (account.causes.get(e, set()) & account.applied_in_topic)]
        overlaps = await h.lease_overlaps(redis_url, engines)
        figures = {
            **await _accounted(rs, REPLICATED_SERVICES, records, account, sent_ooms),
            "sent_by_test": sent_by_test,
            "double_leases": len(overlaps),
            "lease_grants": await h.lease_grants(redis_url, engines),
            "replicas_killed": len(killed),
            "replicas_added": len(added),
            "killed": killed,
            "added": added,
            "ooms_not_applied": len(oom_not_applied),
            "actions_to_judge": verdicts.expected,
            "verdicts": verdicts.total,
            "actions_without_verdict": verdicts.missing,
            "actions_with_several_verdicts": verdicts.repeated,
            "burst_s": round(burst_s, 1),
            "catch_up_s": {k: (round(v, 1) if v is not None else None) for k, v in caught.items()},
            "settle_s": round(settle_s, 1),
        }
        await h.forget_executor_keys(redis_url, engines, account.commands)
    return figures


@dataclass
class VerdictCount:
    records: dict[str, list[h.Record]]
    expected: int
    total: int
    missing: int
    repeated: int


async def _verdicts_settled(rs: h.ReliabilityStack, account: h.ActionAccount, timeout_s: float) -> VerdictCount:
    """Read until every applied action the validator judges has a verdict (or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = await h.read_topics(rs.settings.kafka_bootstrap, rs.topics.all())
        judged: dict[str, int] = {}
        for r in records[rs.topics.validation]:
            m = r.message()
            if isinstance(m, events_pb2.ValidationVerdict):
                judged[m.action_id] = judged.get(m.action_id, 0) + 1
        expected: set[str] = set()
        for r in records[rs.topics.results]:
            m = r.message()
            if (
                isinstance(m, events_pb2.ActionResult)
                and m.status == events_pb2.ACTION_STATUS_APPLIED
                and m.kind != events_pb2.ACTION_KIND_ROLLBACK
            ):
                expected.add(m.action_id)
        missing = len(expected - set(judged))
        if missing == 0 or time.monotonic() > deadline:
            repeated = sum(1 for n in judged.values() if n > 1)
            return VerdictCount(records, len(expected), sum(judged.values()), missing, repeated)
        await asyncio.sleep(2.0)
