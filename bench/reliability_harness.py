"""What the reliability scenarios share: the stack they run, the events they send, and the accounting.

Everything is measured from outside the services: records in the Kafka topics
(read with explicit partition assignment, no group), the consumer groups'
committed offsets, the executor's action log in Redis, /proc for memory and
the services' gRPC APIs. Nothing here is a fake: the stack is the embedded one
(Tansu, the four services as child processes, real Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from google.protobuf.message import Message

from services.executor.adapters.redis_state import lease_overlaps as overlaps_in
from sits.runtime.bus import EventProducer
from sits.runtime.events import EnvelopeError, Topics, decode_event, decode_events, header_value, new_meta
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.procs import ManagedProcess
from sits.runtime.redis import connect
from sits.runtime.settings import Settings
from sits.runtime.traces import write_trace
from sits.v1 import common_pb2, events_pb2
from sits_app.stack.embedded import EmbeddedStack, StackConfig

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
EXECUTOR_REDIS_PREFIX = "sits:executor:"
# What the executor writes for an action that took effect (a rollback's own effect is ROLLED_BACK).
EFFECT_STATUSES = frozenset({events_pb2.ACTION_STATUS_APPLIED, events_pb2.ACTION_STATUS_ROLLED_BACK})

# Every rule acts through SET_PRESSURE, which needs only the pressure file: no engine, no Envoy.
# No cooldowns and a long deadline: each OOM and each crossing of 90% memory gives one command,
# and a command redelivered after a crash is still inside its deadline.
POLICY_YAML = """
forecast: {limit_fraction: 0.99, horizon_s: 60, bucket_s: 0.5, window_s: 10, min_history_s: 5}
defaults:
  cooldown_s: 0
  target_cooldown_s: 0
  deadline_s: 300
  hysteresis: 0.03
  hysteresis_s: 0
  target_memory_fraction: 0.9
  root_cause_interval_s: 600
tiers: {default: P1, engines: {}}
rules:
  - name: oom-pressure
    when: {on_oom: true}
    then: [{kind: SET_PRESSURE, pressure: 0.95}]
    cooldown_s: 0
  - name: memory-high-pressure
    when: {memory_fraction_above: 0.9}
    then: [{kind: SET_PRESSURE, pressure: 0.8}]
    on_clear: [{kind: SET_PRESSURE, pressure: 0.1}]
    cooldown_s: 0
"""


# ---------------------------------------------------------------------------- the stack


@dataclass
class ReliabilityStack:
    """An embedded stack set up for the scenarios, and the names the accounting needs."""

    stack: EmbeddedStack
    engines: list[str]
    host: str
    topics: Topics

    @property
    def settings(self) -> Settings:
        return self.stack.settings

    @property
    def token(self) -> str:
        return self.stack.token_file.read_text().strip()

    def group(self, service: str) -> str:
        suffix = {"decision": "sits-decision", "executor": "sits-executor", "validator": "sits-validator"}[service]
        return f"{self.topics.prefix}{suffix}"

    def group_topics(self, service: str) -> list[str]:
        t = self.topics
        return {
            "decision": [*t.samples, t.oom],
            "executor": [t.commands],
            "validator": [t.results, *t.samples, t.oom],
        }[service]

    def target(self, index: int) -> common_pb2.Target:
        return common_pb2.Target(host=self.host, gpu_uuid=f"GPU-rel-{index}", engine=self.engines[index])

    def process(self, service: str) -> ManagedProcess:
        return self.stack.services[service].process


def stack_config(
    run_dir: Path,
    redis_url: str,
    topic_prefix: str,
    engines: Iterable[str],
    *,
    services: tuple[str, ...] = ("capture", "decision", "executor", "validator"),
    replay_trace: Path | None = None,
    replay_speed: float = 1.0,
    extra_env: dict[str, str] | None = None,
) -> StackConfig:
    """The stack every scenario runs: fake engine endpoints (only SET_PRESSURE is used), a pressure file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    policy = run_dir / "policy.yaml"
    policy.write_text(POLICY_YAML)
    # SET_PRESSURE never calls the engine; the channels to this closed port are never used.
    targets = {e: {"engine_addr": "127.0.0.1:9", "control_addr": "127.0.0.1:9"} for e in engines}
    env = {
        "SITS_EXECUTOR_TARGETS": json.dumps(targets),
        "SITS_ENVOY_PRESSURE_FILE": str(run_dir / "pressure"),
        "SITS_DECISION_POLICY_FILE": str(policy),
        "SITS_EXECUTOR_LEASE_TTL_MS": "2000",
        "SITS_VALIDATOR_SETTLE_S": json.dumps({"SET_PRESSURE": 1.0}),
        "SITS_NVML_ENABLED": "false",
        "SITS_LOG_LEVEL": "WARNING",
        "SITS_CAPTURE_SPOOL_FSYNC": "never",
    }
    if replay_trace is not None:
        env.update(
            {"SITS_REPLAY_TRACE": str(replay_trace), "SITS_REPLAY_SPEED": str(replay_speed), "SITS_REPLAY_LOOP": "true"}
        )
    env.update(extra_env or {})
    return StackConfig(
        run_dir=run_dir,
        redis_url=redis_url,
        topic_prefix=topic_prefix,
        services=services,
        start_budget_s=60.0,
        extra_env=env,
    )


def engine_names(topic_prefix: str, count: int) -> list[str]:
    # The topic prefix in the name keeps this run's executor keys in Redis apart from any other run's.
    return [f"{topic_prefix}rel{i}" for i in range(count)]


def calm_trace(path: Path, host: str, engine: str, records: int = 200, period_s: float = 0.1) -> Path:
    """A replay trace of one target at 40% memory, `records` samples `period_s` apart."""
    header = {
        "name": "reliability-calm",
        "target": {"host": host, "gpu_uuid": "GPU-rel-capture", "mig_instance": "", "engine": engine},
        "total_bytes": 80 * GIB,
    }
    used = int(0.4 * 80 * GIB)
    samples = [
        {
            "t": round(i * period_s, 6),
            "kind": "sample",
            "gpu": {"used_bytes": used + i, "total_bytes": 80 * GIB, "reserved_bytes": used, "free_bytes": 0},
        }
        for i in range(records)
    ]
    write_trace(path, header, samples)
    return path


# ---------------------------------------------------------------------------- events


def metric_sample(target: common_pb2.Target, fraction: float, at: float, sequence: int) -> events_pb2.MetricSample:
    total = 80 * GIB
    sample = events_pb2.MetricSample(meta=new_meta("reliability/load", target, at), sequence=sequence)
    sample.gpu.used_bytes = int(fraction * total)
    sample.gpu.total_bytes = total
    sample.gpu.free_bytes = total - sample.gpu.used_bytes
    return sample


def oom_event(target: common_pb2.Target, at: float) -> events_pb2.OomEvent:
    event = events_pb2.OomEvent(
        meta=new_meta("reliability/oom", target, at),
        requested_bytes=2 * GIB,
        device_free_bytes=GIB // 4,
        device_total_bytes=80 * GIB,
        message="CUDA out of memory. Tried to allocate 2.00 GiB",
    )
    return event


def pressure_command(target: common_pb2.Target, pressure: float, deadline_s: float) -> events_pb2.HealingCommand:
    now = time.time()
    command = events_pb2.HealingCommand(
        meta=new_meta("reliability/test", target, now),
        command_id=f"rel-{uuid.uuid4().hex}",
        kind=events_pb2.ACTION_KIND_SET_PRESSURE,
        reason="reliability suite",
        pressure=pressure,
        target_memory_fraction=0.9,
    )
    command.deadline.FromNanoseconds(int((now + deadline_s) * 1e9))
    return command


async def send_raw(settings: Settings, topic: str, records: list[tuple[bytes | None, list[tuple[str, bytes]]]]) -> None:
    """Records that are not valid SITS events (for the dead-letter accounting)."""
    producer = EventProducer(settings)
    async with producer:
        for value, headers in records:
            await producer.forward_raw(topic, b"garbage", value, headers)


# ---------------------------------------------------------------------------- reading topics


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    headers: tuple[tuple[str, bytes], ...]
    value: bytes | None

    def message(self) -> Message | None:
        try:
            return decode_event(self.headers, self.value)
        except EnvelopeError:
            return None

    def events(self) -> list[Message]:
        """The record's events: its message, or a MetricBatch's samples (none when undecodable)."""
        try:
            return decode_events(self.headers, self.value)
        except EnvelopeError:
            return []

    def header(self, name: str) -> str | None:
        try:
            return header_value(self.headers, name)
        except EnvelopeError:
            return None


async def read_topics(bootstrap: str, topics: Iterable[str], timeout_s: float = 30.0) -> dict[str, list[Record]]:
    """Every record now in `topics`, from the start to the end offsets taken when reading began."""
    consumer = AIOKafkaConsumer(
        **kafka_options_for(bootstrap), enable_auto_commit=False, max_partition_fetch_bytes=4 << 20
    )
    await consumer.start()
    out: dict[str, list[Record]] = {t: [] for t in topics}
    try:
        partitions = await _partitions(consumer, list(out))
        if not partitions:
            return out
        consumer.assign(partitions)
        ends = await consumer.end_offsets(partitions)
        deadline = time.monotonic() + timeout_s
        # One partition at a time: Tansu fills a fetch from the first partitions asked for, so a
        # fetch of many partitions can starve the last ones for as long as the first have data.
        for tp in partitions:
            if ends[tp] == 0:
                continue
            consumer.assign([tp])
            consumer.seek(tp, 0)
            position = 0
            # Tansu 0.6 reports the end of a partition one past the first record of its last batch, not past
            # its last record, when a producer sent several records in one batch: past `ends`, read on until
            # a poll comes back empty.
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not read {tp} to its end ({ends[tp]}) in {timeout_s} s")
                batches = await consumer.getmany(tp, timeout_ms=200, max_records=5000)
                got = batches.get(tp, [])
                for r in got:
                    out[tp.topic].append(Record(r.topic, r.partition, r.offset, tuple(r.headers), r.value))
                    position = r.offset + 1
                if not got and position >= ends[tp]:
                    break
    finally:
        await consumer.stop()
    return out


async def _partitions(consumer: AIOKafkaConsumer, topics: list[str]) -> list[TopicPartition]:
    await consumer._client.force_metadata_update()
    found = []
    for topic in topics:
        for p in sorted(consumer.partitions_for_topic(topic) or ()):
            found.append(TopicPartition(topic, p))
    return found


async def group_offsets(bootstrap: str, group: str, topics: Iterable[str]) -> dict[TopicPartition, tuple[int, int]]:
    """Per partition: its end offset, and the offset `group` committed (0: none)."""
    consumer = AIOKafkaConsumer(**kafka_options_for(bootstrap), enable_auto_commit=False)
    admin = AIOKafkaAdminClient(**kafka_options_for(bootstrap))
    await consumer.start()
    await admin.start()
    try:
        partitions = await _partitions(consumer, list(topics))
        ends = await consumer.end_offsets(partitions) if partitions else {}
        committed = await admin.list_consumer_group_offsets(group, partitions=partitions)
        offsets = {}
        for tp in partitions:
            meta = committed.get(tp)
            offsets[tp] = (ends[tp], meta.offset if meta is not None and meta.offset >= 0 else 0)
        return offsets
    finally:
        await admin.close()
        await consumer.stop()


async def group_backlog(bootstrap: str, group: str, topics: Iterable[str]) -> dict[TopicPartition, int]:
    """Records not yet committed by `group`, per partition (end offset minus committed offset)."""
    return {tp: max(0, end - done) for tp, (end, done) in (await group_offsets(bootstrap, group, topics)).items()}


async def backlog_partitions(
    bootstrap: str, group: str, topics: Iterable[str], records: Mapping[str, list[Record]]
) -> list[dict[str, object]]:
    """The partitions `group` has not committed to their end: offsets, and the records read at or past the commit."""
    out: list[dict[str, object]] = []
    for tp, (end, done) in (await group_offsets(bootstrap, group, topics)).items():
        if end > done:
            offsets = [r.offset for r in records.get(tp.topic, []) if r.partition == tp.partition]
            out.append(
                {
                    "topic": tp.topic,
                    "partition": tp.partition,
                    "end": end,
                    "committed": done,
                    "last_offset_read": max(offsets, default=-1),
                    "offsets_read_from_commit": sorted(o for o in offsets if o >= done)[:10],
                }
            )
    return out


async def partitions_behind(
    rs: ReliabilityStack, backlog: Mapping[str, int], records: Mapping[str, list[Record]]
) -> dict[str, list[dict[str, object]]]:
    """Per service whose group was left behind (`backlog`): where (`backlog_partitions`)."""
    return {
        s: await backlog_partitions(rs.settings.kafka_bootstrap, rs.group(s), rs.group_topics(s), records)
        for s, n in backlog.items()
        if n
    }


async def wait_groups_caught_up(
    rs: ReliabilityStack, services: Iterable[str], timeout_s: float
) -> dict[str, float | None]:
    """Seconds until each service's group had committed everything in its topics (None: never, in time)."""
    started = time.monotonic()
    caught: dict[str, float | None] = dict.fromkeys(services)
    deadline = started + timeout_s
    while time.monotonic() < deadline and any(v is None for v in caught.values()):
        for service in [s for s, v in caught.items() if v is None]:
            with contextlib.suppress(KafkaError, OSError):
                backlog = await group_backlog(rs.settings.kafka_bootstrap, rs.group(service), rs.group_topics(service))
                if backlog and sum(backlog.values()) == 0:
                    caught[service] = time.monotonic() - started
        await asyncio.sleep(0.5)
    return caught


# ---------------------------------------------------------------------------- accounting


@dataclass
class ActionAccount:
    """Commands and their results, by command_id, from the topics and the executor's Redis log."""

    commands: set[str] = field(default_factory=set)
    command_records: int = 0
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    redis_effects: Counter[str] = field(default_factory=Counter)
    causes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    @property
    def without_result(self) -> set[str]:
        return {c for c in self.commands if not self.statuses.get(c)}

    @property
    def duplicates_applied(self) -> int:
        """Effects beyond the first, per command id, in the results topic or in Redis, whichever has more."""
        topic = sum(max(0, sum(n for s, n in st.items() if s in EFFECT_STATUSES) - 1) for st in self.statuses.values())
        redis = sum(max(0, n - 1) for n in self.redis_effects.values())
        return max(topic, redis)

    def count(self, status: int) -> int:
        return sum(st.get(status, 0) for st in self.statuses.values())

    @property
    def applied_in_topic(self) -> set[str]:
        return {c for c, st in self.statuses.items() if any(s in EFFECT_STATUSES for s in st)}


async def account_actions(rs: ReliabilityStack, records: dict[str, list[Record]]) -> ActionAccount:
    account = ActionAccount()
    for record in records[rs.topics.commands]:
        message = record.message()
        if isinstance(message, events_pb2.HealingCommand):
            account.command_records += 1
            account.commands.add(message.command_id)
            account.causes[message.cause_event_id].add(message.command_id)
    for record in records[rs.topics.results]:
        message = record.message()
        if isinstance(message, events_pb2.ActionResult):
            account.statuses[message.command_id][int(message.status)] += 1
    client = connect(rs.settings.redis_url)
    try:
        for engine in rs.engines:
            ids = await client.zrange(f"{EXECUTOR_REDIS_PREFIX}actions:{engine}", 0, -1)
            raws = await client.mget([f"{EXECUTOR_REDIS_PREFIX}action:{_text(i)}" for i in ids]) if ids else []
            for raw in raws:
                if raw is None:
                    continue
                result = events_pb2.ActionResult.FromString(raw if isinstance(raw, bytes) else str(raw).encode())
                if result.status in EFFECT_STATUSES:
                    account.redis_effects[result.command_id] += 1
    finally:
        await client.aclose()
    return account


async def forget_executor_keys(redis_url: str, engines: Iterable[str], commands: Iterable[str]) -> None:
    """Remove what this run left in the executor's Redis namespace (its action ids, command ids, targets)."""
    client = connect(redis_url)
    try:
        keys: list[str] = []
        for engine in engines:
            ids = await client.zrange(f"{EXECUTOR_REDIS_PREFIX}actions:{engine}", 0, -1)
            keys += [f"{EXECUTOR_REDIS_PREFIX}action:{_text(i)}" for i in ids]
            kinds = ("actions", "lease", "fence", "pressure", "lease-audit", "target-key")
            keys += [f"{EXECUTOR_REDIS_PREFIX}{kind}:{engine}" for kind in kinds]
        keys += [f"{EXECUTOR_REDIS_PREFIX}{kind}:{c}" for c in commands for kind in ("applied", "digest")]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
    finally:
        await client.aclose()


async def lease_overlaps(redis_url: str, engines: Iterable[str]) -> list[tuple[str, str, str]]:
    """(engine, holder, holder) for every two holds of one engine's lease that overlapped (Redis's audit)."""
    client = connect(redis_url)
    found = []
    try:
        for engine in engines:
            raw = await client.lrange(f"{EXECUTOR_REDIS_PREFIX}lease-audit:{engine}", 0, -1)
            found += [(engine, a, b) for a, b in overlaps_in([_text(e) for e in raw])]
    finally:
        await client.aclose()
    return found


async def lease_grants(redis_url: str, engines: Iterable[str]) -> int:
    client = connect(redis_url)
    try:
        total = 0
        for engine in engines:
            raw = await client.lrange(f"{EXECUTOR_REDIS_PREFIX}lease-audit:{engine}", 0, -1)
            total += sum(1 for e in raw if _text(e).startswith("acquire "))
        return total
    finally:
        await client.aclose()


def dead_letters_of(records: list[Record], group: str, topics: Iterable[str]) -> set[tuple[str, int, int]]:
    """Distinct (topic, partition, offset) that `group` dead-lettered from `topics` (a redelivery counts once)."""
    wanted = set(topics)
    found = set()
    for r in records:
        topic = r.header("sits_dlq_topic")
        if r.header("sits_dlq_group") == group and topic in wanted:
            found.add((topic, int(r.header("sits_dlq_partition") or -1), int(r.header("sits_dlq_offset") or -1)))
    return found


# ---------------------------------------------------------------------------- processes


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and the processes of its group (0 when it is gone)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pid:
                continue
            status = (entry / "status").read_text()
        except (OSError, ProcessLookupError):
            continue
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        if match:
            total += int(match.group(1)) * 1024
    return total


def k8s_memory_limit(service: str) -> int:
    """The memory limit deploy/k8s gives `service`: the bound the load scenario holds it to."""
    text = (REPO / "deploy" / "k8s" / f"{service}.yaml").read_text()
    match = re.search(r"limits:\s*\n(?:\s+\w+: .*\n)*?\s+memory:\s*(\d+)(Mi|Gi)", text)
    if match is None:
        raise ValueError(f"deploy/k8s/{service}.yaml has no memory limit")
    return int(match.group(1)) << (20 if match.group(2) == "Mi" else 30)


@contextlib.contextmanager
def frozen(process: ManagedProcess) -> Iterator[None]:
    """SIGSTOP a service for a consistent cut of what it has published; SIGCONT on leaving."""
    os.killpg(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(process.pid, signal.SIGCONT)


async def metric_value(port: int, name: str) -> float:
    """Sum of one metric's series on a service's /metrics endpoint."""
    return (await metric_values(port, [name]))[0]


async def metric_values(port: int, names: list[str]) -> list[float]:
    """Sum of each metric's series, in the order named, from one read of a service's /metrics endpoint."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout=2)
    try:
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        body = (await asyncio.wait_for(reader.read(), timeout=5)).decode(errors="replace")
    finally:
        writer.close()
    totals = dict.fromkeys(names, 0.0)
    for line in body.splitlines():
        for name in names:
            if line.startswith(name) and (line[len(name)] in " {"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return [totals[name] for name in names]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
