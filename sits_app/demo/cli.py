"""`sits demo`: the main job, end to end, on the embedded stack, beside the same load without SITS.

Two vLLM engines (CPU build, a random-weight Llama made on the spot, a KV cache
small enough to come under pressure), the same size:
- without SITS: vLLM as it ships (FCFS) behind Envoy alone;
- with SITS: the engine with the SITS scheduler plugin behind Envoy with the
  admission processor, and the four services (capture, decision with the tier
  controller, executor, validator) on Tansu and Redis.
gRPC clients of mixed priority drive each from normal load to about three
times what the engine serves: a short phase without SITS, then the SITS phase.
A live view shows what SITS sees and does; at the end a report (HTML and a PNG
timeline) puts the two phases side by side, draws P0's objective, and lists each
verdict with the promise it checked; `bench/results/demo_run.json` records the
run. Everything started is stopped, whatever happens.

`--replay FILE` runs the loop with memory from a recorded H200 trace instead of
client load: capture replays it as the local engine, and the actions land on
the live engine and Envoy.

`--protocol http` runs the same demo on the OpenAI-compatible HTTP path: vLLM's
OpenAI server (the SITS launcher on the SITS side), Envoy's HTTP routes with the
JSON admission, and streaming chat completions as the load.

`--gpu` runs the GPU demo instead (scenarios/h200_vllm, also `make demo-gpu`): on
a machine with one NVIDIA GPU and vLLM installed, real vLLM dies of a CUDA OOM
without SITS and lives with it, and a report with a plot per scenario is written.
It refuses, saying why, where there is no GPU, no vLLM or too little free memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from smg_grpc_proto import vllm_engine_pb2_grpc

from sits.runtime.events import Topics
from sits.runtime.redis import RedisUnavailable
from sits.runtime.tap import TopicTap
from sits_app.demo.live import render
from sits_app.demo.load import DEFAULT_MIX, MAX_LAG_S, RequestOutcome, one_http_request, one_request
from sits_app.demo.load_processes import LoadPlan, LoadProcesses
from sits_app.demo.paths import EngineShape, Served, start_baseline, start_engines, start_sits
from sits_app.demo.report import PhaseWindow, summarize, write_report
from sits_app.demo.timeline import Timeline, oscillations
from sits_app.demo.watch_cli import poll_forecasts
from sits_app.results import write_result
from sits_app.stack.embedded import ServiceExited
from sits_app.stack.vllm_engine import SERVED_MODEL_NAME, make_random_llama

DEMO_POLICY = Path(__file__).resolve().parent / "demo_policy.yaml"
# Request sizes of the demo's clients (tokens): prompts and generations of a chat-like mix.
PROMPT_TOKENS = (48, 160)
MAX_TOKENS = (48, 128)
# Share of a phase spent ramping from half of capacity to the peak; the rest holds the peak.
RAMP_SHARE = 0.6
# CPUs each engine computes on by default. A GPU node's engine computes on its GPU, apart from the
# cores that Envoy, SITS and the clients use; on this CPU build the same takes giving it cores of its own,
# and the rest the other cores (`_leave_engine_cpus`).
# With every CPU its own on a 2-core machine, the engine's processes take most of the host and every
# client waits for a core (docs/control.md, "Where P0's time goes on two cores").
ENGINE_CPUS = 1
# Requests the load keeps in flight at most (a client's connection pool; the rest are not sent).
MAX_IN_FLIGHT = 96


@dataclass(frozen=True)
class DemoConfig:
    out_dir: Path
    load_s: float = 120.0
    # The phase without SITS before it (0: none).
    baseline_s: float = 45.0
    peak_factor: float = 3.0
    # KV blocks of 128 tokens: 24 blocks hold ~3k tokens, which 16 streams of a few hundred fill.
    kv_blocks: int = 24
    max_num_seqs: int = 16
    replay: Path | None = None
    replay_speed: float = 1.0
    record: bool = True
    # "grpc": vLLM's gRPC Generate; "http": its OpenAI-compatible server (chat completions).
    protocol: str = "grpc"
    # CPUs each engine may run on (taskset); 0: all of them.
    engine_cpus: int = ENGINE_CPUS


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default: reports/demo-<time>)")
    parser.add_argument("--load-seconds", type=float, default=120.0, help="the SITS phase's length (default 120)")
    parser.add_argument(
        "--baseline-seconds", type=float, default=45.0, help="the phase without SITS before it (default 45; 0: none)"
    )
    parser.add_argument("--peak", type=float, default=3.0, help="peak load as a multiple of engine capacity (3)")
    parser.add_argument(
        "--engine-cpus",
        type=int,
        default=ENGINE_CPUS,
        help=f"CPUs each engine runs on (default {ENGINE_CPUS}: the engine computes apart from Envoy, SITS and the "
        "clients, which run on the other CPUs, as on a GPU node; 0: all CPUs, where on a small machine they all "
        "wait for one another)",
    )
    parser.add_argument("--replay", type=Path, default=None, help="replay a recorded trace (traces/h200/*.jsonl.gz)")
    parser.add_argument("--replay-speed", type=float, default=1.0, help="replay speed factor (default 1)")
    parser.add_argument(
        "--no-record", action="store_true", help="do not write bench/results/demo_run.json for this run"
    )
    parser.add_argument(
        "--protocol",
        choices=("grpc", "http"),
        default="grpc",
        help="the engine API the clients use: vLLM's gRPC Generate (default) or its OpenAI HTTP API",
    )
    parser.add_argument(
        "--gpu",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="ARGS",
        help="run the GPU demo (real vLLM on this machine's GPU) instead; the rest of the line goes to it "
        "(see `python -m scenarios.h200_vllm.run --help`)",
    )


def run(args: argparse.Namespace) -> int:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.gpu is not None:
        return run_gpu(args.out or Path("reports") / f"demo-gpu-{stamp}", args.gpu)
    config = DemoConfig(
        out_dir=(args.out or Path("reports") / f"demo-{stamp}").resolve(),
        load_s=args.load_seconds,
        baseline_s=0.0 if args.replay else args.baseline_seconds,
        peak_factor=args.peak,
        replay=args.replay.resolve() if args.replay else None,
        replay_speed=args.replay_speed,
        # demo_run.json records the gRPC demo; an HTTP run reports without replacing it.
        record=not args.no_record and args.replay is None and args.protocol == "grpc",
        protocol=args.protocol,
        engine_cpus=args.engine_cpus,
    )
    console = Console()
    try:
        return asyncio.run(Demo(config, console).run())
    except (RedisUnavailable, ServiceExited, TimeoutError) as err:
        console.print(f"[red]error:[/] {err}")
        return 2


class Demo:
    def __init__(self, config: DemoConfig, console: Console) -> None:
        self.config = config
        self.console = console
        self.timeline = Timeline()
        self.stop = asyncio.Event()
        self.offered_rps = 0.0
        self.driver: LoadProcesses | None = None
        # Per phase: the load sent at its peak, as a multiple of the engine's measured capacity.
        self.peak_sent_x: dict[str, float] = {}
        self.notes: list[str] = []
        self.windows: list[PhaseWindow] = []
        self.objective_s = _objective(DEMO_POLICY)

    @property
    def _api(self) -> str:
        return "openai" if self.config.protocol == "http" else "grpc"

    def _leave_engine_cpus(self, engine_cpus: int) -> None:
        """Everything started from here on (Envoy, SITS, the clients, this process) runs on the CPUs the engines
        do not: left free to move, they took turns on the engines' CPU and P0's queue in the engine grew in
        bursts while P0 alone was under the engine's capacity (make demo, 2026-12-07)."""
        others = set(range(engine_cpus, os.cpu_count() or 1)) & os.sched_getaffinity(0)
        if others:
            os.sched_setaffinity(0, others)
            self.notes.append(f"Envoy, SITS and the clients on CPU(s) {', '.join(map(str, sorted(others)))}")

    def step(self, message: str) -> None:
        self.console.log(message)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        out = self.config.out_dir
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        _log_to_file(logs / "demo.log")
        started = time.monotonic()
        with_baseline = self.config.baseline_s > 0
        async with contextlib.AsyncExitStack() as stack:
            self.step("[1/7] making a random-weight Llama-shaped model (cached after the first run)")
            model = await asyncio.to_thread(make_random_llama)
            shape = EngineShape(
                max_num_seqs=self.config.max_num_seqs,
                kv_blocks=self.config.kv_blocks,
                api=self._api,
                cpus=self.config.engine_cpus,
            )
            if shape.cpus:
                self.notes.append(f"each engine on {shape.cpus} CPU(s) of {os.cpu_count()} (taskset)")
            what = "two vLLM engines (CPU): one as it ships, one" if with_baseline else "vLLM (CPU)"
            self.step(f"[2/7] starting {what} with the SITS scheduler, each {shape.kv_blocks} KV blocks")
            engines = await start_engines(stack, model, shape, logs, baseline=with_baseline, sits=True)
            if shape.cpus:
                self._leave_engine_cpus(shape.cpus)
            self.step("[3/7] starting Envoy in front of each, SITS admission and the SITS services for one")
            baseline = await start_baseline(stack, engines["baseline"], out / "baseline") if with_baseline else None
            sits = await start_sits(stack, engines["sits"], out, DEMO_POLICY, progress=self.step)
            assert sits.stack is not None
            topics = Topics(sits.stack.settings.topic_prefix)
            tap = TopicTap(
                sits.stack.broker.bootstrap,
                [*topics.samples, topics.commands, topics.results, topics.validation],
                self.timeline.on_event,
            )
            await stack.enter_async_context(tap)
            poller = asyncio.create_task(
                poll_forecasts(self.timeline, sits.stack.settings.decision_addr, self.stop, every_s=1.0)
            )
            stack.push_async_callback(_cancel, poller)
            stack.push_async_callback(self._say_stopping)
            self.notes.append(f"set-up took {time.monotonic() - started:.0f} s")
            if self.config.replay is None:
                # Probed on the engine as it ships where there is one: the probe keeps an engine full of P0,
                # and on the SITS engine the loop acted on it (a cap, a cut) before the load began, its
                # verdicts landing in the SITS phase (a run of 2026-12-06: "not kept", P0 waiting behind P0).
                probed = baseline or sits
                capacity = await self._capacity(probed.engine.address)
                if probed is not sits:
                    await self._warm(sits.engine.address)
                self.notes.append(f"engine capacity, measured at the start: {capacity:.1f} requests/s (closed loop)")
                self.timeline.restart_clock()
                if baseline is not None:
                    self.step(
                        f"[5/7] {self.config.baseline_s:.0f} s of load without SITS: vLLM FCFS behind Envoy alone"
                    )
                    await self._drive_load(baseline, capacity, self.config.baseline_s)
                    await baseline.envoy.stop()
                    await baseline.engine.stop()
                self.step(f"[6/7] {self.config.load_s:.0f} s of the same load with SITS")
                await self._drive_load(sits, capacity, self.config.load_s)
                await self._settle_verdicts()
            else:
                await self._watch_replay()
            self.stop.set()
        self.step("[7/7] writing the report")
        return self._finish(out, time.monotonic() - started)

    async def _say_stopping(self) -> None:
        self.step("stopping everything that was started")

    async def _requester(
        self, resources: contextlib.AsyncExitStack, engine_addr: str
    ) -> Callable[[], Awaitable[RequestOutcome]]:
        """One mid-sized P0 request straight to the engine, on the demo's protocol."""
        prompt, new_tokens = sum(PROMPT_TOKENS) // 2, sum(MAX_TOKENS) // 2
        if self._api == "openai":
            http = await resources.enter_async_context(httpx.AsyncClient(base_url=f"http://{engine_addr}"))

            async def one_http() -> RequestOutcome:
                return await one_http_request(http, SERVED_MODEL_NAME, "P0", prompt, new_tokens)

            return one_http
        channel = await resources.enter_async_context(grpc.aio.insecure_channel(engine_addr))
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def one_grpc() -> RequestOutcome:
            return await one_request(stub, "P0", prompt, new_tokens)

        return one_grpc

    async def _warm(self, engine_addr: str, requests: int = 3) -> None:
        """A few requests, one at a time, so the SITS engine's first ones in its phase are not its first ever."""
        async with contextlib.AsyncExitStack() as resources:
            one = await self._requester(resources, engine_addr)
            for _ in range(requests):
                await one()

    async def _capacity(self, engine_addr: str, seconds: float = 8.0) -> float:
        """Requests per second the engine completes when kept full (closed loop, straight to vLLM).

        As many clients as the engine runs requests, each sending its next as the last ends.
        Completions count only once every client has finished one request: a fresh engine's first
        requests are slow (warm-up): counting them in a short window with half as many clients
        measured 1.7 requests/s in a demo of 2026-12-06, where a warm engine of the same shape
        served 14 in a closed loop on the same machine, so the demo's "3x" never pressed the
        engine. Warm-up is bounded by four times `seconds`.
        """
        self.step("[4/7] measuring what the engine serves (closed loop, straight to vLLM)")
        clients = self.config.max_num_seqs
        warmed: set[int] = set()
        window: list[float] = []  # [start, end] once every client has finished one request
        counted = completed = 0
        began = time.monotonic()
        async with contextlib.AsyncExitStack() as resources:
            one = await self._requester(resources, engine_addr)

            def running() -> bool:
                now = time.monotonic()
                if self.stop.is_set():
                    return False
                return now < window[1] if window else now - began < 4 * seconds

            async def client(index: int) -> None:
                nonlocal counted, completed
                while running():
                    outcome = await one()
                    if not outcome.ok:
                        continue
                    completed += 1
                    if window and window[0] <= outcome.finished < window[1]:
                        counted += 1
                    warmed.add(index)
                    if len(warmed) == clients and not window:
                        now = time.monotonic()
                        window.extend([now, now + seconds])

            await asyncio.gather(*(client(i) for i in range(clients)))
        if not window:
            # Never warm within the bound: what completed over the whole probe.
            return max(1.0, completed / (time.monotonic() - began))
        return max(1.0, counted / seconds)

    async def _drive_load(self, path: Served, capacity: float, seconds: float) -> None:
        base = capacity * 0.5
        plan = LoadPlan(
            address=path.address,
            seconds=seconds,
            base_rps=base,
            peak_factor=self.config.peak_factor * capacity / base,
            ramp_s=seconds * RAMP_SHARE,
            mix=dict(DEFAULT_MIX),
            prompt_tokens=PROMPT_TOKENS,
            max_tokens=MAX_TOKENS,
            max_in_flight=MAX_IN_FLIGHT,
            api=self._api,
            model=SERVED_MODEL_NAME,
        )
        rate = plan.rate()
        logs = self.config.out_dir / "logs"
        driver = self.driver = LoadProcesses(plan, log_path=logs / f"load-{path.name.replace(' ', '-')}.log")
        driver.on_outcome = lambda outcome: self.timeline.on_request(outcome, path.name)
        began = time.monotonic()
        start_t = began - self.timeline.started_mono
        self.windows.append(PhaseWindow(path.name, start_t, start_t + seconds * RAMP_SHARE, start_t + seconds))

        def phase() -> str:
            elapsed = time.monotonic() - began
            self.offered_rps = rate(elapsed)
            sent = driver.sent_rate(max(0.0, elapsed - 3.0), elapsed)
            return (
                f"{path.name}: load {elapsed:4.0f}/{seconds:.0f} s ({self.offered_rps / capacity:.1f}x capacity asked, "
                f"{sent / capacity:.1f}x sent over the last 3 s)"
            )

        await self._with_live_view(driver.run(seconds, self.stop), phase)
        peak_sent = driver.sent_rate(seconds * RAMP_SHARE, seconds)
        self.peak_sent_x[path.name] = round(peak_sent / capacity, 2)
        self.notes.append(
            f"{path.name}: {base:.1f} req/s rising to {self.config.peak_factor:g}x capacity over "
            f"{seconds * RAMP_SHARE:.0f} s, held to {seconds:.0f} s; at the peak {peak_sent:.1f} req/s sent "
            f"({peak_sent / capacity:.1f}x capacity); not sent: {driver.refused_locally} arrivals because "
            f"{MAX_IN_FLIGHT} were already in flight, {driver.behind} because the load generator was over "
            f"{MAX_LAG_S:g} s behind them"
        )

    async def _settle_verdicts(self, wait_s: float = 20.0) -> None:
        """Give the last actions' settle windows time to end, so their verdicts are in the report."""
        deadline = time.monotonic() + wait_s
        applied = {a.action_id for a in self.timeline.actions if a.status == "APPLIED"}
        while time.monotonic() < deadline and not self.stop.is_set():
            judged = {v.action_id for v in self.timeline.verdicts}
            if applied <= judged:
                return
            await asyncio.sleep(0.5)

    async def _watch_replay(self) -> None:
        assert self.config.replay is not None
        self.step(f"[5/7] replaying {self.config.replay} at {self.config.replay_speed}x as the local engine")
        from sits.runtime.traces import read_trace

        trace = read_trace(self.config.replay)
        duration = trace.duration_s / self.config.replay_speed + 12.0
        self.notes.append(
            f"replayed {self.config.replay} ({len(trace.records)} records) at {self.config.replay_speed}x"
        )
        self.timeline.restart_clock()
        began = time.monotonic()
        await self._with_live_view(
            asyncio.wait_for(self.stop.wait(), duration),
            lambda: f"replay {time.monotonic() - began:4.0f}/{duration:.0f} s",
        )

    async def _with_live_view(self, work: Awaitable[object], phase: Callable[[], str]) -> None:
        task = asyncio.ensure_future(work)

        def view() -> Group:
            in_flight = self.driver.in_flight if self.driver else 0
            return render(self.timeline, phase(), self.offered_rps, in_flight, self.objective_s)

        with Live(view(), console=self.console, refresh_per_second=2) as live:
            while not task.done():
                live.update(view())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(task), 0.5)
        with contextlib.suppress(TimeoutError):
            task.result()

    def _finish(self, out: Path, took_s: float) -> int:
        self.notes.append(
            f"the whole demo took {took_s:.0f} s; logs are in {out / 'logs'} and {out / 'stack' / 'logs'}"
        )
        if self.config.replay is None:
            over = "its OpenAI HTTP API" if self._api == "openai" else "gRPC"
            title = (
                f"SITS demo: vLLM on the CPU ({over}) under {self.config.peak_factor:g}x load, without and with SITS"
            )
        else:
            title = f"SITS demo: memory replayed from {self.config.replay.name} onto a live engine"
        page = write_report(self.timeline, out, title, self.notes, self.windows, self.objective_s)
        table = Table(title="requests by priority, at the peak", title_justify="left")
        for column in ("path", "priority", "submitted", "served", "refused", "failed", "TTFT p50", "TTFT p99"):
            table.add_column(column)
        peaks = {w.name: w for w in self.windows}
        for name, window in peaks.items():
            for row in summarize(self.timeline, window.peak_start, window.end, path=name):
                table.add_row(
                    name,
                    row.priority,
                    str(row.submitted),
                    str(row.served),
                    str(row.shed),
                    str(row.failed),
                    "–" if row.ttft_p50_ms is None else f"{row.ttft_p50_ms:.0f} ms",
                    "–" if row.ttft_p99_ms is None else f"{row.ttft_p99_ms:.0f} ms",
                )
        self.console.print(table)
        applied = sum(1 for a in self.timeline.actions if a.status == "APPLIED")
        verdicts = Counter(v.verdict for v in self.timeline.verdicts)
        self.console.print(
            f"actions applied: {applied}; verdicts: "
            + ", ".join(
                f"{k.lower().replace('_', ' ')} {verdicts[k]}"
                for k in ("CONFIRMED", "NOT_KEPT", "ROLLED_BACK", "INCONCLUSIVE")
            )
        )
        self.console.print(f"report: [bold]{page}[/] (timeline: {out / 'timeline.png'})")
        if self.config.record and "with SITS" in peaks:
            path = self._record(peaks, verdicts)
            self.console.print(f"recorded: {path}")
        return 0

    def _record(self, peaks: dict[str, PhaseWindow], verdicts: Counter[str]) -> Path:
        sits_window = peaks["with SITS"]
        whole = {r.priority: r for r in summarize(self.timeline, sits_window.start, sits_window.end, path="with SITS")}
        at_peak = {
            r.priority: r for r in summarize(self.timeline, sits_window.peak_start, sits_window.end, path="with SITS")
        }
        figures: dict[str, object] = {
            "p0_served_ratio": round(whole["P0"].served / max(1, whole["P0"].submitted), 4),
            "p0_ttft_p99_ms": at_peak["P0"].ttft_p99_ms,
            "p0_ttft_p50_ms": at_peak["P0"].ttft_p50_ms,
            "verdicts": sum(verdicts.values()),
            "verdicts_confirmed_fraction": round(verdicts["CONFIRMED"] / max(1, sum(verdicts.values())), 3),
            "oscillations": len(oscillations(self.timeline.actions)),
            "peak_load_sent_x_capacity": self.peak_sent_x.get("with SITS"),
        }
        baseline: dict[str, object] = {}
        if "without SITS" in peaks:
            window = peaks["without SITS"]
            without = {
                r.priority: r for r in summarize(self.timeline, window.peak_start, window.end, path="without SITS")
            }
            figures["p0_ttft_p99_ms_without_sits"] = without["P0"].ttft_p99_ms
            baseline = {
                "p0_ttft_p99_ms_without_sits": without["P0"].ttft_p99_ms,
                "p0_ttft_p50_ms_without_sits": without["P0"].ttft_p50_ms,
                "p0_served_without_sits": f"{without['P0'].served}/{without['P0'].submitted}",
                "peak_load_sent_x_capacity_without_sits": self.peak_sent_x.get("without SITS"),
            }
        return write_result(
            "demo_run",
            command="make demo",
            figures=figures,
            baseline=baseline,
            goal={"verdicts_confirmed_fraction": 0.9, "p0_served_ratio": 1.0, "oscillations": 0},
            notes="; ".join(self.notes),
            extra={"verdict_mix": dict(verdicts)},
        )


def _log_to_file(path: Path) -> None:
    """Library and service-client logs go to a file: the terminal belongs to the live view."""
    import logging

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def run_gpu(out: Path, argv: list[str]) -> int:
    """The GPU demo: without and with SITS on this machine's GPU, then its report."""
    from scenarios.h200_vllm import report
    from scenarios.h200_vllm import run as gpu_run

    code = gpu_run.main(["--out", str(out), *argv])
    if code != 0:
        return code
    code = report.main([str(out), str(out / "report")])
    if code == 0:
        Console().print(f"report: [bold]{out / 'report'}[/]")
    return code


def _objective(policy_file: Path) -> float:
    from services.decision.domain.policy import parse_policy

    return parse_policy(policy_file.read_text()).spec.controller.p0_queue_wait_p90_s


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
