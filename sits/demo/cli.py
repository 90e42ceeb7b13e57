"""`sits demo`: the main job, end to end, on the embedded stack.

A real vLLM engine (CPU build, a random-weight Llama made on the spot, the SITS
scheduler plugin, a KV cache small enough to come under pressure) behind a real
Envoy with the SITS admission processor, the four services, and gRPC clients
of mixed priority driven from normal load to about three times what the engine
serves. A live view shows what SITS sees and does; at the end a report (HTML
and a PNG timeline) is written and a summary printed. Everything started is
stopped, whatever happens.

`--replay FILE` runs the same loop with memory from a recorded H200 trace
instead of client load: capture replays it as the local engine, and the
actions land on the live engine and Envoy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from smg_grpc_proto import vllm_engine_pb2_grpc

from sits.demo.live import render
from sits.demo.load import LoadDriver, LoadShape, one_request, ramp
from sits.demo.report import summarize, write_report
from sits.demo.timeline import Timeline
from sits.demo.watch_cli import poll_forecasts
from sits.runtime.events import Topics
from sits.runtime.redis import RedisUnavailable
from sits.runtime.tap import TopicTap
from sits.stack.embedded import EmbeddedStack, StackConfig
from sits.stack.vllm_engine import VllmServer, make_random_llama
from sits.v1 import common_pb2
from sits_mesh.envoy_process import EnvoyProcess
from sits_mesh.ext_proc import AdmissionProcessor, BypassController, DecisionAdmitter, ExtProcServer, FilePressure
from sits_mesh.policy import MeshPolicy

ENGINE = "vllm-0"
MESH_POLICY = Path(__file__).resolve().parents[2] / "mesh" / "policy.yaml"
DEMO_POLICY = Path(__file__).resolve().parent / "demo_policy.yaml"
# Request sizes of the demo's clients (tokens): prompts and generations of a chat-like mix.
PROMPT_TOKENS = (48, 160)
MAX_TOKENS = (48, 128)


@dataclass(frozen=True)
class DemoConfig:
    out_dir: Path
    load_s: float = 120.0
    peak_factor: float = 3.0
    # KV blocks of 128 tokens: 24 blocks hold ~3k tokens, which 16 streams of a few hundred fill.
    kv_blocks: int = 24
    max_num_seqs: int = 16
    replay: Path | None = None
    replay_speed: float = 1.0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default: reports/demo-<time>)")
    parser.add_argument("--load-seconds", type=float, default=120.0, help="how long clients drive load (default 120)")
    parser.add_argument("--peak", type=float, default=3.0, help="peak load as a multiple of engine capacity (3)")
    parser.add_argument("--replay", type=Path, default=None, help="replay a recorded trace (traces/h200/*.jsonl.gz)")
    parser.add_argument("--replay-speed", type=float, default=1.0, help="replay speed factor (default 1)")


def run(args: argparse.Namespace) -> int:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    config = DemoConfig(
        out_dir=(args.out or Path("reports") / f"demo-{stamp}").resolve(),
        load_s=args.load_seconds,
        peak_factor=args.peak,
        replay=args.replay.resolve() if args.replay else None,
        replay_speed=args.replay_speed,
    )
    console = Console()
    try:
        return asyncio.run(Demo(config, console).run())
    except RedisUnavailable as err:
        console.print(f"[red]error:[/] {err}")
        return 2


class Demo:
    def __init__(self, config: DemoConfig, console: Console) -> None:
        self.config = config
        self.console = console
        self.timeline = Timeline()
        self.stop = asyncio.Event()
        self.phase = "starting"
        self.offered_rps = 0.0
        self.driver: LoadDriver | None = None
        self.notes: list[str] = []

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
        async with contextlib.AsyncExitStack() as stack:
            self.step("[1/6] making a random-weight Llama-shaped model (cached after the first run)")
            model = await asyncio.to_thread(make_random_llama)
            self.step(f"[2/6] starting vLLM (CPU) with the SITS scheduler and {self.config.kv_blocks} KV blocks")
            engine = await stack.enter_async_context(
                VllmServer(
                    model,
                    max_num_seqs=self.config.max_num_seqs,
                    max_model_len=1024,
                    max_num_batched_tokens=1024,
                    extra_args=("--num-gpu-blocks-override", str(self.config.kv_blocks)),
                    log_path=logs / "vllm.log",
                )
            )
            assert engine.control_address is not None
            embedded = EmbeddedStack(StackConfig(run_dir=out / "stack", topic_prefix=""), progress=self.step)
            self.step("[3/6] starting the SITS admission processor and Envoy in front of the engine")
            envoy = await self._start_mesh(stack, engine, embedded, out)
            self.step("[4/6] starting Tansu, checking Redis, starting capture, decision, executor, validator")
            embedded.config.extra_env.update(self._service_env(engine, envoy))
            await stack.enter_async_context(embedded)
            stack.push_async_callback(self._say_stopping)
            topics = Topics(embedded.settings.topic_prefix)
            tap = TopicTap(
                embedded.broker.bootstrap,
                [topics.metrics, topics.commands, topics.results, topics.validation],
                self.timeline.on_event,
            )
            await stack.enter_async_context(tap)
            poller = asyncio.create_task(
                poll_forecasts(self.timeline, embedded.settings.decision_addr, self.stop, every_s=1.0)
            )
            stack.push_async_callback(_cancel, poller)
            self.notes.append(f"set-up took {time.monotonic() - started:.0f} s")
            if self.config.replay is None:
                await self._drive_load(engine.address, envoy.address)
            else:
                await self._watch_replay()
            self.stop.set()
        self.step("[6/6] writing the report")
        return self._finish(out, time.monotonic() - started)

    async def _say_stopping(self) -> None:
        self.step("stopping everything that was started")

    async def _start_mesh(
        self, stack: contextlib.AsyncExitStack, engine: VllmServer, embedded: EmbeddedStack, out: Path
    ) -> EnvoyProcess:
        pressure_file = out / "envoy" / "gpu_pressure"
        base = MeshPolicy.model_validate(
            {
                **_yaml(MESH_POLICY),
                "listener": {"address": "127.0.0.1", "port": 0},
                "admin": {"address": "127.0.0.1", "port": 0},
                "upstream": {"address": "127.0.0.1", "port": engine.port},
                "overload": {**_yaml(MESH_POLICY)["overload"], "pressure_file": str(pressure_file)},  # type: ignore[dict-item]
            }
        )
        admitter = DecisionAdmitter(
            embedded.settings.decision_addr, common_pb2.Target(host=embedded.settings.host_name, engine=ENGINE)
        )
        stack.push_async_callback(admitter.close)
        # The bypass probe asks about the largest request this engine accepts.
        admission = base.admission.model_copy(update={"bypass_max_request_tokens": engine.max_model_len})
        base = base.model_copy(update={"admission": admission})
        processor = AdmissionProcessor(base, admitter, FilePressure(pressure_file))
        ext_proc = await stack.enter_async_context(ExtProcServer(processor))
        policy = base.model_copy(update={"admission": admission.model_copy(update={"port": ext_proc.port})})
        envoy = await stack.enter_async_context(EnvoyProcess(policy, workdir=out / "envoy"))
        stop_probing = asyncio.Event()
        probing = asyncio.create_task(BypassController(processor, envoy).run(stop_probing))

        async def stop_probe() -> None:
            stop_probing.set()
            await probing

        stack.push_async_callback(stop_probe)
        return envoy

    def _service_env(self, engine: VllmServer, envoy: EnvoyProcess) -> dict[str, str]:
        targets = {ENGINE: {"engine_addr": engine.address, "control_addr": engine.control_address}}
        env = {
            "SITS_NVML_ENABLED": "false",
            "SITS_ENGINE_NAME": ENGINE,
            "SITS_VLLM_GRPC_ADDR": engine.address,
            "SITS_VLLM_LOADS_INTERVAL_S": "0.25",
            "SITS_EXECUTOR_TARGETS": json.dumps(targets),
            "SITS_ENVOY_ADMIN_URL": envoy.admin_url,
            "SITS_ENVOY_PRESSURE_FILE": str(envoy.pressure_file),
            "SITS_DECISION_POLICY_FILE": str(DEMO_POLICY),
            # A CPU engine's queue takes seconds to drain after shedding: judge after it has.
            "SITS_VALIDATOR_SETTLE_S": json.dumps({"SHED_PRIORITY": 12, "SET_ENGINE_LIMITS": 12}),
        }
        if self.config.replay is not None:
            env.update(
                {
                    "SITS_REPLAY_TRACE": str(self.config.replay),
                    "SITS_REPLAY_SPEED": str(self.config.replay_speed),
                    "SITS_REPLAY_AS_ENGINE": "true",
                    # The engine's own KV samples would mix with the replayed memory in one window.
                    "SITS_VLLM_GRPC_ADDR": "",
                }
            )
        return env

    async def _capacity(self, engine_addr: str, seconds: float = 6.0) -> float:
        """Requests per second the engine completes when kept full (closed loop, straight to vLLM)."""
        done = 0
        deadline = time.monotonic() + seconds
        async with grpc.aio.insecure_channel(engine_addr) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

            async def worker() -> None:
                nonlocal done
                while time.monotonic() < deadline:
                    outcome = await one_request(stub, "P0", sum(PROMPT_TOKENS) // 2, sum(MAX_TOKENS) // 2)
                    done += outcome.ok

            began = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(self.config.max_num_seqs // 2)))
            return max(1.0, done / (time.monotonic() - began))

    async def _drive_load(self, engine_addr: str, envoy_addr: str) -> None:
        self.phase = "measuring engine capacity"
        capacity = await self._capacity(engine_addr)
        self.notes.append(f"engine capacity, measured at the start: {capacity:.1f} requests/s (closed loop)")
        base = capacity * 0.5
        rate = ramp(base, self.config.peak_factor * capacity / base, self.config.load_s * 0.6, self.config.load_s)
        self.step(
            f"[5/6] driving P0/P1/P2 clients through Envoy: {base:.1f} req/s rising to "
            f"{self.config.peak_factor:.0f}x capacity ({self.config.peak_factor * capacity:.1f} req/s)"
        )
        shape = LoadShape(rate=rate, prompt_tokens=PROMPT_TOKENS, max_tokens=MAX_TOKENS)
        driver = self.driver = LoadDriver(envoy_addr, shape, max_in_flight=96)
        driver.on_outcome = self.timeline.on_request
        self.timeline.restart_clock()
        began = time.monotonic()

        def phase() -> str:
            elapsed = time.monotonic() - began
            self.offered_rps = rate(elapsed)
            return f"load {elapsed:4.0f}/{self.config.load_s:.0f} s ({self.offered_rps / capacity:.1f}x capacity)"

        await self._with_live_view(driver.run(self.config.load_s, self.stop), phase)
        self.notes.append(
            f"load: {base:.1f} req/s rising to {self.config.peak_factor:.0f}x capacity over "
            f"{self.config.load_s * 0.6:.0f} s, held to {self.config.load_s:.0f} s; {driver.refused_locally} "
            "arrivals not sent because 96 were already in flight"
        )

    async def _watch_replay(self) -> None:
        assert self.config.replay is not None
        self.step(f"[5/6] replaying {self.config.replay} at {self.config.replay_speed}x as the local engine")
        from services.capture.traces import read_trace

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
            return render(self.timeline, phase(), self.offered_rps, in_flight)

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
            title = f"SITS demo: vLLM on the CPU under {self.config.peak_factor:g}x load"
        else:
            title = f"SITS demo: memory replayed from {self.config.replay.name} onto a live engine"
        page = write_report(self.timeline, out, title, self.notes)
        table = Table(title="requests by priority", title_justify="left")
        for column in ("priority", "submitted", "served", "shed", "failed", "TTFT p50", "TTFT p99"):
            table.add_column(column)
        for row in summarize(self.timeline):
            table.add_row(
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
        verdicts = {
            v: sum(1 for x in self.timeline.verdicts if x.verdict == v)
            for v in ("CONFIRMED", "ROLLED_BACK", "INCONCLUSIVE")
        }
        self.console.print(
            f"actions applied: {applied}; verdicts: " + ", ".join(f"{k.lower()} {n}" for k, n in verdicts.items())
        )
        self.console.print(f"report: [bold]{page}[/] (timeline: {out / 'timeline.png'})")
        return 0


def _yaml(path: Path) -> dict[str, object]:
    import yaml

    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


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


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
