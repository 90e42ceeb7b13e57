"""fleet_scale: the simulated fleet (sits_app/fleet) through capture's publisher → Kafka → decision replicas.

    .venv/bin/python -m bench.fleet_scale [--targets 500 2000 5000] [--replicas 1 2 4] [--measure-s 30]

Real parts: Tansu, the decision service as 1, 2 or 4 processes of one consumer group (started as `sits up
--decision-replicas N` starts them) over 8 partitions, one executor, Redis. The simulator (this process)
replays the recorded H200 traces, shifted and mixed, at 10 Hz per target through CapturePublisher.

Per run (a fresh stack for each targets x replicas):
- samples_per_s: samples published during the measured window that the decision group committed by the end of
  the run, per second of window (what the pipeline carried; the lag says whether it kept up).
- decision_lag_p99_ms: a calm sample's record handed to the producer → the decision group's committed offset
  past it (committed offsets polled every 50 ms; a record not committed when the run ends counts as
  lagging until then). urgent_lag_p99_ms: the same for samples under pressure, which travel on their own
  topic (sits.metrics.urgent.v1) that the decision handles first (and commits with the batch in hand).
- decision_cpu_cores / cpu_us_per_sample: CPU seconds of all decision processes over the window (from
  /proc), per second and per sample committed.
- reaction_p99_ms: probe targets (served by the executor; PROBES_PER_S a second of window) jump from 50% to
  99.9% of memory once each during the window; the sample's production time → the executor's APPLIED result
  (`applied_at`) for the command it caused: heads to OOM → action live, through the loaded partitions. The
  probes' host is a process of its own with its own capture publisher, as a real host is (the simulator's
  one publisher stands in for hundreds). Its parts: probe_acked (→ the broker's acknowledgement),
  probe_decided (→ the decision's command) and probe_applied_after_command (that command → applied).
- The baseline: the largest fleet again with every sample on one topic (`--one-lane-targets`), as before the
  urgent lane.
Writes bench/results/fleet_scale.json; per-run figures under `runs`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import yaml
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from google.protobuf.message import Message

from bench import reliability_harness as h
from bench.common import quantile, write_result
from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.spool import Spool
from services.decision.settings import DEFAULT_POLICY_FILE
from sits.runtime.events import Topics, new_meta, seconds
from sits.runtime.kafka_security import kafka_options_for
from sits.v1 import common_pb2, events_pb2
from sits_app.fleet.sim import Fleet, TraceFrames, load_frames, trace_paths
from sits_app.stack.embedded import EmbeddedStack, StackConfig

REDIS_URL = "redis://127.0.0.1:6379/0"
COMMAND = ".venv/bin/python -m bench.fleet_scale"
PARTITIONS = 8
HZ = 10.0
GIB = 1 << 30
# The default policy (forecast, fragmentation, co-tenant and OOM rules: what the fleet's traces should meet), plus
# one rule for the probes, above every recorded trace's peak (99.5%): its SET_PRESSURE needs only the pressure
# file, so the probes' actions go live without an engine or Envoy.
PROBE_RULE = {
    "name": "probe-pressure",
    "when": {"memory_fraction_above": 0.997},
    "then": [{"kind": "SET_PRESSURE", "pressure": 0.8}],
}
PROBE_FRACTION = 0.999
PROBE_HOST = "probe-host"
# The probe sample at PROBE_FRACTION comes after 20 calm ones.
PROBE_SEQUENCE = 100
# Probes per second of window: 300 in the default 30 s window, so that a run's reaction p99 is not its one or
# two worst probes (with 100, the p99 moved by ±50 ms from run to run).
PROBES_PER_S = 10
# The simulated fleet's hosts are other machines: on a cluster the simulator would not share a core with the
# broker, the decision or the executor. Here it runs at a lower CPU priority and takes what they leave (its
# achieved rate is reported) instead of delaying their turn on the two cores.
SIMULATOR_NICE = 10


def fleet_policy() -> str:
    policy = yaml.safe_load(DEFAULT_POLICY_FILE.read_text())
    # First: on a probe it claims the target before the forecast rule (which would need a real engine) can.
    policy["rules"].insert(0, PROBE_RULE)
    return str(yaml.safe_dump(policy, sort_keys=False))


async def handled_and_coalesced(metrics_ports: list[int]) -> tuple[float, float]:
    """Samples and OOMs the decision replicas' domain has decided on, and samples folded into a newer one, so far."""
    handled = coalesced = 0.0
    for port in metrics_ports:
        # One read per replica: both counters from the same instant.
        decided, folded = await h.metric_values(port, ["sits_decision_seconds_count", "sits_events_coalesced_total"])
        handled += decided
        coalesced += folded
    return handled, coalesced


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / 100.0


@dataclass
class Sent:
    topic: str
    partition: int
    offset: int
    at: float
    samples: int


@dataclass
class Recorder:
    """Capture's producer, recording where each record of samples (either lane) landed and when it was handed over."""

    settings: Any
    sample_topics: list[str]
    sent: list[Sent] = field(default_factory=list)
    # A probe's sample: when the broker acknowledged it, by the probe's engine.
    probe_acked: dict[str, float] = field(default_factory=dict)

    def factory(self) -> Any:
        recorder = self

        class Recording(TopicEnsuringProducer):
            async def enqueue(self, topic: str, message: Message, *, traced: bool = True) -> asyncio.Future[Any]:
                at = time.time()
                future = await super().enqueue(topic, message, traced=traced)
                if topic in recorder.sample_topics:
                    samples = list(message.samples) if isinstance(message, events_pb2.MetricBatch) else [message]
                    n, last = len(samples), samples[-1]
                    assert isinstance(last, events_pb2.MetricSample)

                    def done(f: asyncio.Future[Any]) -> None:
                        if not f.cancelled() and f.exception() is None:
                            meta = f.result()
                            recorder.sent.append(Sent(topic, meta.partition, meta.offset, at, n))
                            if last.meta.target.host == PROBE_HOST and last.sequence == PROBE_SEQUENCE:
                                recorder.probe_acked.setdefault(last.meta.target.engine, time.time())

                    future.add_done_callback(done)
                return future

        return Recording(self.settings)


Committed = dict[tuple[str, int], int]


async def poll_commits(
    bootstrap: str, group: str, topics: list[str], stop: asyncio.Event
) -> list[tuple[float, Committed]]:
    admin = AIOKafkaAdminClient(**kafka_options_for(bootstrap))
    await admin.start()
    parts = [TopicPartition(topic, p) for topic in topics for p in range(PARTITIONS)]
    out: list[tuple[float, Committed]] = []
    try:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                offsets = await admin.list_consumer_group_offsets(group, partitions=parts)
                committed = {(tp.topic, tp.partition): (m.offset if m else -1) for tp, m in offsets.items()}
                out.append((time.time(), committed))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)
    finally:
        await admin.close()
    return out


def committed_at(sent: Sent, polls: list[tuple[float, Committed]]) -> float | None:
    lo, hi = 0, len(polls)
    key = (sent.topic, sent.partition)
    while lo < hi:  # first poll whose committed offset is past the record (offsets only grow)
        mid = (lo + hi) // 2
        if polls[mid][1].get(key, -1) > sent.offset:
            hi = mid
        else:
            lo = mid + 1
    return polls[lo][0] if lo < len(polls) else None


def probe_sample(target: common_pb2.Target, fraction: float, sequence: int) -> events_pb2.MetricSample:
    sample = events_pb2.MetricSample(meta=new_meta("capture/probe", target, time.time()), sequence=sequence)
    sample.gpu.total_bytes = 80 * GIB
    sample.gpu.used_bytes = int(fraction * 80 * GIB)
    return sample


@dataclass(frozen=True)
class ProbeHost:
    """The probes' host, run as a process of its own (`probe_host_main`)."""

    settings: Any
    prefix: str
    engines: list[str]
    warm_s: float
    measure_s: float
    urgent_lane: bool
    run_dir: Path

    async def run(self, conn: Connection) -> None:
        """20 calm samples per probe over `warm_s`, then "warm" to the parent, then each probe's jump to
        PROBE_FRACTION spread over `measure_s`; sends back when each was made and acknowledged."""
        # A host of its own: not at the simulator's lower priority (it inherits it).
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        topics = Topics(self.prefix)
        recorder = Recorder(self.settings, topics.samples)
        publisher = CapturePublisher(
            recorder.factory, Spool(self.run_dir / "probe-spool", fsync="never"), topics, urgent_lane=self.urgent_lane
        )
        probes = [common_pb2.Target(host=PROBE_HOST, gpu_uuid=f"GPU-{e}", engine=e) for e in self.engines]
        stop = asyncio.Event()
        pub = asyncio.create_task(publisher.run(stop))
        for seq in range(1, 21):  # calm history for every probe, then the fleet settles in (group joins)
            for p in probes:
                publisher.submit(probe_sample(p, 0.5, seq))
            await asyncio.sleep(self.warm_s / 20)
        conn.send("warm")
        start = time.time()
        probe_at: dict[str, float] = {}
        for i, p in enumerate(probes):
            sample = probe_sample(p, PROBE_FRACTION, PROBE_SEQUENCE)
            probe_at[p.engine] = seconds(sample.meta.produced_at)
            publisher.submit(sample)
            await asyncio.sleep(max(0.0, start + (i + 1) * self.measure_s / len(probes) - time.time()))
        await asyncio.sleep(1.0)  # the last one's acknowledgement
        stop.set()
        await pub
        conn.send((probe_at, recorder.probe_acked))


def probe_host_main(host: ProbeHost, conn: Connection) -> None:
    asyncio.run(host.run(conn))


async def one_run(
    frames: list[TraceFrames],
    targets: int,
    replicas: int,
    measure_s: float,
    warm_s: float,
    work: Path,
    linger_ms: float,
    urgent_lane: bool = True,
    max_batch: int = 5000,
) -> dict[str, Any]:
    prefix = f"f{uuid.uuid4().hex[:10]}."
    topics = Topics(prefix)
    probes = [
        common_pb2.Target(host=PROBE_HOST, gpu_uuid=f"GPU-probe-{i}", engine=f"{prefix}probe-{i}")
        for i in range(int(measure_s * PROBES_PER_S))
    ]
    run_dir = work / f"t{targets}-r{replicas}{'' if urgent_lane else '-one-lane'}"
    run_dir.mkdir(parents=True)
    (run_dir / "policy.yaml").write_text(fleet_policy())
    env = {
        "SITS_DECISION_POLICY_FILE": str(run_dir / "policy.yaml"),
        "SITS_EXECUTOR_TARGETS": json.dumps(
            {p.engine: {"engine_addr": "127.0.0.1:9", "control_addr": "127.0.0.1:9"} for p in probes}
        ),
        "SITS_ENVOY_PRESSURE_FILE": str(run_dir / "pressure"),
        "SITS_LOG_LEVEL": "WARNING",
        "SITS_NVML_ENABLED": "false",
        # A capture publishes ~1 sample per record at 10 Hz, so a consumer's records per poll bound its rate:
        # the sizing rule in docs/fleet.md (500, the default, caps a replica near 10k samples/s here).
        "SITS_CONSUMER_MAX_BATCH": str(max_batch),
    }
    config = StackConfig(
        run_dir=run_dir,
        redis_url=REDIS_URL,
        topic_prefix=prefix,
        services=("decision", "executor"),
        replicas={"decision": replicas},
        partitions=PARTITIONS,
        extra_env=env,
    )
    fleet = Fleet(frames, targets, hz=HZ)
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    async with EmbeddedStack(config) as stack:
        # After the stack's services started (they keep the normal priority); the probes' host sets its own.
        os.setpriority(os.PRIO_PROCESS, 0, SIMULATOR_NICE)
        recorder = Recorder(stack.settings, topics.samples)
        publisher = CapturePublisher(
            recorder.factory,
            Spool(run_dir / "spool", fsync="never"),
            topics,
            linger_s=linger_ms / 1000,
            urgent_lane=urgent_lane,
        )
        stop = asyncio.Event()
        pub = asyncio.create_task(publisher.run(stop))
        sim = asyncio.create_task(fleet.run(publisher, stop))
        # The probes' host is a process of its own with its own capture publisher, as every host is: the
        # simulator's one publisher and event loop stand in for the fleet's hundreds, and a probe's sample queued
        # behind the whole fleet's would time that stand-in, not SITS.
        parent_end, child_end = multiprocessing.get_context("spawn").Pipe()
        probe_host = multiprocessing.get_context("spawn").Process(
            target=probe_host_main,
            args=(
                ProbeHost(stack.settings, prefix, [p.engine for p in probes], warm_s, measure_s, urgent_lane, run_dir),
                child_end,
            ),
        )
        probe_host.start()
        await asyncio.to_thread(parent_end.recv)  # its warm-up is over: the window starts
        poll_stop = asyncio.Event()
        poller = asyncio.create_task(
            poll_commits(stack.settings.kafka_bootstrap, f"{prefix}sits-decision", topics.samples, poll_stop)
        )
        replicas_now = [stack.services[n] for n in stack.replicas_of("decision")]
        pids = [s.process.pid for s in replicas_now]
        handled0 = await handled_and_coalesced([s.metrics_port for s in replicas_now])
        cpu0 = sum(cpu_seconds(p) for p in pids)
        sim_cpu0 = time.process_time()
        window_start = time.time()
        probe_at, probe_acked = await asyncio.to_thread(parent_end.recv)
        window_end = time.time()
        cpu1 = sum(cpu_seconds(p) for p in pids)
        sim_cpu = time.process_time() - sim_cpu0
        handled1 = await handled_and_coalesced([s.metrics_port for s in replicas_now])
        stop.set()
        await asyncio.gather(sim, pub)
        await asyncio.to_thread(probe_host.join, 30)
        await asyncio.sleep(10.0)  # let the group commit what it has, and the last probes' actions land
        poll_stop.set()
        polls = await poller
        records = await h.read_topics(stack.settings.kafka_bootstrap, [topics.results, topics.commands])
    with contextlib.suppress(PermissionError):  # the next run's services start at the normal priority again
        os.setpriority(os.PRIO_PROCESS, 0, priority)
    lags: dict[str, list[float]] = {t: [] for t in topics.samples}
    committed_in_window = 0
    end = polls[-1][0] if polls else window_end
    for s in recorder.sent:
        done = committed_at(s, polls)
        if window_start <= s.at < window_end:
            lags[s.topic].extend([(done if done is not None else end) - s.at] * s.samples)
        if done is not None and window_start <= s.at < window_end:
            committed_in_window += s.samples
    calm_lags, urgent_lags = lags[topics.metrics], lags[topics.metrics_urgent]
    # The probes' APPLIED results: the probe's engine, and its sample's production → applied_at.
    applied = [
        (m.meta.target.engine, seconds(m.applied_at) - t0)
        for r in records[topics.results]
        if isinstance(m := r.message(), events_pb2.ActionResult)
        and m.status == events_pb2.ACTION_STATUS_APPLIED
        and (t0 := probe_at.get(m.meta.target.engine)) is not None
    ]
    reactions = [reaction for _, reaction in applied]
    window = window_end - window_start
    decision_cpu = cpu1 - cpu0
    handled, coalesced = (after - before for after, before in zip(handled1, handled0, strict=True))
    commands = [m for r in records[topics.commands] if isinstance(m := r.message(), events_pb2.HealingCommand)]
    # Where a probe's reaction went: to the broker's acknowledgement of its sample, to the decision's command
    # (its produced_at), and from that command to the executor's applied_at.
    acked = [probe_acked[e] - t0 for e, t0 in probe_at.items() if e in probe_acked]
    decided: dict[str, float] = {}
    for c in commands:
        t0 = probe_at.get(c.meta.target.engine)
        if t0 is not None and c.HasField("pressure"):
            decided.setdefault(c.meta.target.engine, seconds(c.meta.produced_at) - t0)
    applied_after_command = [reaction - decided[engine] for engine, reaction in applied if engine in decided]

    def ms(values: list[float], q: float) -> float | None:
        return round(quantile(values, q) * 1000, 1) if values else None

    figures = {
        "targets": targets,
        "replicas": replicas,
        "urgent_lane": urgent_lane,
        "offered_samples_per_s": targets * HZ,
        "simulated_samples_per_s": round(fleet.stats.rate(time.monotonic()), 1),
        "samples_per_s": round(committed_in_window / window, 1),
        "decision_lag_p50_ms": round(quantile(calm_lags, 0.5) * 1000, 1),
        "decision_lag_p99_ms": round(quantile(calm_lags, 0.99) * 1000, 1),
        # Samples under pressure on their own lane (none without it).
        "urgent_samples": len(urgent_lags),
        "urgent_lag_p50_ms": ms(urgent_lags, 0.5),
        "urgent_lag_p99_ms": ms(urgent_lags, 0.99),
        "decision_cpu_cores": round(decision_cpu / window, 3),
        "cpu_us_per_sample": round(decision_cpu / max(1, committed_in_window) * 1e6, 2),
        "cpu_core_pct_per_1000_targets": round(decision_cpu / window * 100 / (targets / 1000), 2),
        # A replica that lags folds a target's samples of one poll into the newest (latest wins): those cost it
        # next to nothing, so CPU per committed sample falls as lag grows. Per handled sample it does not.
        "handled_samples_per_s": round(handled / window, 1),
        "coalesced_fraction": round(coalesced / max(1.0, handled + coalesced), 3),
        "cpu_us_per_handled_sample": round(decision_cpu / max(1.0, handled) * 1e6, 2),
        "simulator_cpu_cores": round(sim_cpu / window, 3),
        # Events the simulator's one publisher (a real capture serves 8 GPUs) could not hand to Kafka as fast as
        # the fleet made them: they went through its disk spool, in order, behind the rest.
        "publisher_spooled": publisher.stats.spooled,
        "probes": len(probes),
        "probes_applied": len(reactions),
        # None: no probe's action went live before the run ended.
        "reaction_p50_ms": ms(reactions, 0.5),
        "reaction_p99_ms": ms(reactions, 0.99),
        # The reaction's parts: probe sample → broker ack, → the decision's command, command → executor applied.
        "probe_acked_p50_ms": ms(acked, 0.5),
        "probe_acked_p99_ms": ms(acked, 0.99),
        "probe_decided_p50_ms": ms(list(decided.values()), 0.5),
        "probe_decided_p99_ms": ms(list(decided.values()), 0.99),
        "probe_applied_after_command_p50_ms": ms(applied_after_command, 0.5),
        "probe_applied_after_command_p99_ms": ms(applied_after_command, 0.99),
        # Commands the fleet's own traces caused (those heading to OOM cross the rule), over the whole run.
        "commands": len(commands),
        "late_ticks": fleet.stats.late_ticks,
        "in_incident": fleet.in_incident(),
        "heading_to_oom": fleet.heading_to_oom(),
        "window_s": round(window, 1),
        # This machine is shared: its load during the run says how far the figures are its own.
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(figures), flush=True)
    await h.forget_executor_keys(REDIS_URL, [p.engine for p in probes], [])
    return figures


async def run_all(
    targets: list[int],
    replicas: list[int],
    measure_s: float,
    warm_s: float,
    linger_ms: float,
    one_lane_targets: list[int],
) -> list[dict[str, Any]]:
    frames = [load_frames(p, HZ) for p in trace_paths()]
    plan = [(n, r, True) for n in targets for r in replicas]
    plan += [(n, r, False) for n in one_lane_targets for r in replicas]
    out = []
    with tempfile.TemporaryDirectory(prefix="sits-fleet-") as tmp:
        for n, r, lane in plan:
            out.append(await one_run(frames, n, r, measure_s, warm_s, Path(tmp), linger_ms, urgent_lane=lane))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, nargs="+", default=[500, 2000, 5000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--measure-s", type=float, default=30.0)
    parser.add_argument("--warm-s", type=float, default=15.0)
    parser.add_argument(
        "--linger-ms",
        type=float,
        default=0.0,
        help="capture's linger (SITS_CAPTURE_LINGER_MS) for the simulated fleet (default 0: none)",
    )
    parser.add_argument(
        "--one-lane-targets",
        type=int,
        nargs="*",
        default=None,
        help="also run these fleet sizes with every sample on one topic (SITS_CAPTURE_URGENT_LANE=false), "
        "the baseline of the urgent lane (default: the largest of --targets; none: no baseline)",
    )
    args = parser.parse_args()
    top = max(args.targets)
    one_lane = [top] if args.one_lane_targets is None else args.one_lane_targets
    runs = asyncio.run(run_all(args.targets, args.replicas, args.measure_s, args.warm_s, args.linger_ms, one_lane))

    def at(n: int, r: int) -> dict[str, Any] | None:
        return next((x for x in runs if x["targets"] == n and x["replicas"] == r and x["urgent_lane"]), None)

    def worst_reaction(of: list[dict[str, Any]]) -> float | None:
        # None when some run had no probe's action live before it ended.
        if not of or any(x["reaction_p99_ms"] is None for x in of):
            return None
        return float(max(x["reaction_p99_ms"] for x in of))

    one, four = at(top, min(args.replicas)), at(top, max(args.replicas))
    biggest = [x for x in runs if x["targets"] == top and x["urgent_lane"]]
    biggest_one_lane = [x for x in runs if x["targets"] == top and not x["urgent_lane"]]
    figures = {
        "targets_max": top,
        "replicas_max": max(args.replicas),
        "samples_per_s_max": max(x["samples_per_s"] for x in runs),
        "cpu_per_sample_ratio_4_over_1": round(four["cpu_us_per_sample"] / one["cpu_us_per_sample"], 3)
        if one and four
        else None,
        # The same over the samples the replicas handled, not folded into a newer one (see the runs'
        # coalesced_fraction): coordination's cost apart from how far each replica lags.
        "cpu_per_handled_sample_ratio_4_over_1": round(
            four["cpu_us_per_handled_sample"] / one["cpu_us_per_handled_sample"], 3
        )
        if one and four
        else None,
        f"decision_lag_p99_ms_{top}_targets": max(x["decision_lag_p99_ms"] for x in biggest),
        f"urgent_lag_p99_ms_{top}_targets": max((x["urgent_lag_p99_ms"] or 0.0) for x in biggest),
        f"reaction_p99_ms_{top}_targets": worst_reaction(biggest),
        "cpu_core_pct_per_1000_targets": one["cpu_core_pct_per_1000_targets"] if one else None,
    }
    path = write_result(
        "fleet_scale",
        command=f"{COMMAND} --targets {' '.join(map(str, args.targets))} "
        f"--replicas {' '.join(map(str, args.replicas))} --measure-s {args.measure_s:g}"
        + (f" --one-lane-targets {' '.join(map(str, one_lane))}" if args.one_lane_targets is not None else ""),
        figures=figures,
        baseline={
            "offered_samples_per_s_max": top * HZ,
            "partitions": PARTITIONS,
            "hz_per_target": HZ,
            "capture_linger_ms": args.linger_ms,
            # The same fleet with every sample on one topic, as before the urgent lane.
            f"reaction_p99_ms_{top}_targets_one_lane": worst_reaction(biggest_one_lane),
            f"probes_applied_{top}_targets_one_lane": [x["probes_applied"] for x in biggest_one_lane],
        },
        goal={"cpu_per_sample_ratio_4_over_1": 1.3, f"reaction_p99_ms_{top}_targets": 150},
        notes="One run per targets x replicas, each on a fresh stack; the simulator, Tansu, every decision replica "
        "and the executor share this machine's cores with other work. Lag and reaction figures are the worst "
        f"over the replica counts at {top} targets; CPU per 1,000 targets is the single replica's at {top}. "
        "Samples under pressure travel on their own topic (the urgent lane), which the decision handles first; "
        "the baseline runs put every sample on one topic. The simulator runs at nice 10 (its hosts would be other "
        "machines); the probes' host is a process of its own at the normal priority.",
        extra={"runs": runs},
    )
    print(f"wrote {path}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
