"""Where a P0 request's time goes on the SITS path: each hop against the engine reached directly, same moment.

    python -m bench.p0_path [--rounds 3] [--seconds 20] [--variants full,half_cpu]

`bench/overload.py` measures P0's time to first token end to end. This bench splits it: in each phase three
P0 clients go through Envoy and the admission processor (the SITS path) while three more P0 clients call
the same engine directly with the same tier (the baseline: no hop but the engine's own), a probe times the
decision service's `Admit` (the processor's per-request question) 20 times a second, and every process's
CPU time is read over the phase. Phases without other load and with the overload bench's P1/P2 clients
(through Envoy), in rounds. The whole loop runs (default policy), as in the overload bench.

Writes bench/results/p0_path.json. On two cores the figures say how much of P0's tail is the host's CPU
(vLLM's CPU build keeps its worker and EngineCore spinning on both cores while a request is in flight)
rather than queueing the controller could remove.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import quantile, write_result
from bench.overload import (
    CAPACITY,
    CLIENTS,
    POLICY,
    VARIANTS,
    LoadProcess,
    clients_at,
    close_channels,
    variant_machine,
    variant_suffix,
)
from sits.v1 import common_pb2
from sits_app.demo.paths import EngineShape, start_engines, start_sits
from sits_app.stack.vllm_engine import make_random_llama
from sits_mesh.admission import AdmissionQuery, AdmitterUnavailable
from sits_mesh.ext_proc import DecisionAdmitter

P0_CLIENTS = CLIENTS["p0"]
ADMIT_EVERY_S = 0.05
# Process groups by command line, first match wins.
GROUPS = (
    ("engine", ("VLLM::", "grpc_launcher", "vllm.entrypoints")),
    ("admission processor", ("mesh ext-proc",)),
    ("envoy", ("bin/envoy",)),
    ("sits services", tuple(f"sits_app.cli {name}" for name in ("capture", "decision", "executor", "validator"))),
    ("tansu", ("tansu",)),
    ("load clients", ("--load-child",)),
    ("this bench (P0 clients, probe)", ("bench.p0_path",)),
)


def cpu_by_group() -> dict[str, float]:
    seconds: dict[str, float] = {name: 0.0 for name, _ in GROUPS}
    for process in psutil.process_iter(["cmdline", "cpu_times"]):
        line = " ".join(process.info["cmdline"] or [])
        times = process.info["cpu_times"]
        if times is None:
            continue
        for name, needles in GROUPS:
            if any(needle in line for needle in needles):
                seconds[name] += times.user + times.system
                break
    return seconds


async def admit_probe(address: str, stop_at: float, out: list[float]) -> None:
    admitter = DecisionAdmitter(address, common_pb2.Target(engine="vllm-0"), timeout_s=5.0)
    try:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            with contextlib.suppress(AdmitterUnavailable):
                await admitter.admit(AdmissionQuery(32, 32, "p0"))
                out.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(ADMIT_EVERY_S)
    finally:
        await admitter.close()


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "p50_ms": round(quantile(values, 0.5), 1),
        "p90_ms": round(quantile(values, 0.9), 1),
        "p99_ms": round(quantile(values, 0.99), 1),
        "samples": len(values),
    }


async def run_variant(rounds: int, seconds: float, variant: str) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-p0-path-"))
    shape = EngineShape(
        max_num_seqs=CAPACITY, kv_blocks=64, max_model_len=512, max_num_batched_tokens=512, **VARIANTS[variant]
    )
    samples: dict[str, list[float]] = {}
    cpu: dict[str, dict[str, float]] = {"unloaded": {}, "loaded": {}}
    elapsed = {"unloaded": 0.0, "loaded": 0.0}
    async with contextlib.AsyncExitStack() as stack:
        print(f"starting the engine and the SITS path ({variant_machine(variant)}; logs in {workdir})")
        engines = await start_engines(stack, make_random_llama(), shape, workdir, baseline=False, sits=True)
        path = await start_sits(stack, engines["sits"], workdir, POLICY, progress=lambda m: print(m, flush=True))
        assert path.stack is not None
        load = await stack.enter_async_context(LoadProcess())
        sits_path, direct = path.address, engines["sits"].address
        for address in (sits_path, direct):  # warm-up: the channels (kept for the run) and every hop's set-up
            await clients_at(address, {"p0": P0_CLIENTS}, 2.0)
        lower = {p: n for p, n in CLIENTS.items() if p != "p0"}
        for index in range(rounds):
            for phase in ("unloaded", "loaded"):
                before, began = cpu_by_group(), time.monotonic()
                probe: list[float] = []
                work = [
                    clients_at(sits_path, {"p0": P0_CLIENTS}, seconds),
                    clients_at(direct, {"p0": P0_CLIENTS}, seconds, first_seed=50),
                    admit_probe(path.stack.settings.decision_addr, began + seconds, probe),
                ]
                if phase == "loaded":
                    work.append(load.run(sits_path, lower, seconds))
                outcomes = await asyncio.gather(*work)
                through, straight = outcomes[0] or {}, outcomes[1] or {}
                after = cpu_by_group()
                elapsed[phase] += time.monotonic() - began
                for name in after:
                    cpu[phase][name] = cpu[phase].get(name, 0.0) + after[name] - before.get(name, 0.0)
                samples.setdefault(f"sits_path_{phase}", []).extend(through["p0"])
                samples.setdefault(f"direct_{phase}", []).extend(straight["p0"])
                samples.setdefault(f"admit_{phase}", []).extend(probe)
            print(f"round {index + 1}/{rounds}: P0 via SITS {len(samples['sits_path_loaded'])} loaded", flush=True)
        # The processor's own wait for Admit (the mesh policy it runs): beyond it, it fails open.
        wait_s = path.envoy.policy.admission.decision_timeout_s
        await close_channels()
    spreads = {name: spread(values) for name, values in samples.items()}
    over = {
        phase: round(
            sum(1 for v in samples[f"admit_{phase}"] if v > wait_s * 1000) / max(1, len(samples[f"admit_{phase}"])),
            3,
        )
        for phase in ("unloaded", "loaded")
    }
    cores = psutil.cpu_count() or 1
    shares = {
        phase: {name: round(value / (elapsed[phase] * cores), 3) for name, value in cpu[phase].items()} for phase in cpu
    }
    return {
        "p0_ttft": spreads,
        "processor_admit_wait_s": wait_s,
        "admit_over_processor_timeout": over,
        "cpu_share_of_host": shares,
        "cores": cores,
    }


async def run(args: argparse.Namespace) -> None:
    results = {}
    for variant in args.variants.split(","):
        print(f"== variant {variant}", flush=True)
        results[variant] = await run_variant(args.rounds, args.seconds, variant)
    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    for variant, result in results.items():
        suffix = variant_suffix(variant)
        ttft = result["p0_ttft"]
        for phase in ("unloaded", "loaded"):
            through, straight = ttft[f"sits_path_{phase}"], ttft[f"direct_{phase}"]
            for q in ("p50", "p99"):
                figures[f"p0_ttft_{q}_ms_sits_path_{phase}{suffix}"] = through[f"{q}_ms"]
                baseline[f"p0_ttft_{q}_ms_direct_{phase}{suffix}"] = straight[f"{q}_ms"]
                figures[f"p0_hops_{q}_ms_{phase}{suffix}"] = round(through[f"{q}_ms"] - straight[f"{q}_ms"], 1)
            figures[f"admit_p99_ms_{phase}{suffix}"] = ttft[f"admit_{phase}"]["p99_ms"]
            figures[f"admit_over_processor_timeout_{phase}{suffix}"] = result["admit_over_processor_timeout"][phase]
            figures[f"engine_cpu_share_{phase}{suffix}"] = result["cpu_share_of_host"][phase]["engine"]
    waits = "/".join(sorted({f"{r['processor_admit_wait_s']:g}" for r in results.values()}))
    path = write_result(
        "p0_path",
        command=f"python -m bench.p0_path --rounds {args.rounds} --seconds {args.seconds} --variants {args.variants}",
        figures=figures,
        baseline=baseline,
        goal={},  # a breakdown of the overload bench's P0 figures, which carry the goals
        notes=(
            f"{P0_CLIENTS} P0 clients through Envoy and the admission processor and {P0_CLIENTS} straight to the same "
            f"engine (same tier header) at the same time; loaded phases add the overload bench's P1/P2 clients "
            f"{ {p: n for p, n in CLIENTS.items() if p != 'p0'} } through Envoy; the whole loop runs (default "
            f"policy). hops = SITS path minus direct, per quantile. Admit: the decision service timed from this "
            f"process every {ADMIT_EVERY_S} s; over_processor_timeout: the share slower than the processor's "
            f"{waits} s wait (it fails open there). CPU shares: of all cores, over the phases. "
            "half_cpu: the engine confined to one CPU with taskset."
        ),
        extra={"detail": results},
    )
    print(f"recorded {path}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of an unloaded and a loaded phase (3)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of one phase (default 20)")
    parser.add_argument("--variants", default="full,half_cpu", help="full, half_cpu, or both (default)")
    asyncio.run(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
