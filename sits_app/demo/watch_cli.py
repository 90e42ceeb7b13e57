"""`sits watch`: the live view of a running stack (`sits up` or `sits demo`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from pathlib import Path

import grpc
from rich.console import Console
from rich.live import Live

from sits.runtime.events import Topics
from sits.runtime.tap import TopicTap
from sits.v1 import common_pb2, decision_pb2, decision_pb2_grpc
from sits_app.demo.live import render
from sits_app.demo.timeline import Timeline


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=Path(".run"), help="the stack's run folder (default: .run)")
    parser.add_argument("--for", dest="duration", type=float, default=None, help="stop after this many seconds")


async def poll_forecasts(timeline: Timeline, decision_addr: str, stop: asyncio.Event, every_s: float = 0.5) -> None:
    """Ask the decision service to explain each target it has seen; feed the answers to the timeline."""
    async with grpc.aio.insecure_channel(decision_addr) as channel:
        stub = decision_pb2_grpc.DecisionStub(channel)
        while not stop.is_set():
            for name in sorted({s.target for s in timeline.samples}):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    answer = await stub.Explain(
                        decision_pb2.ExplainRequest(target=_target_for(timeline, name)), timeout=0.5
                    )
                    forecast = answer.forecast
                    tto = forecast.time_to_oom_seconds if forecast.HasField("time_to_oom_seconds") else None
                    cause = decision_pb2.RootCauseKind.Name(answer.root_cause.kind).removeprefix("ROOT_CAUSE_KIND_")
                    timeline.on_forecast(name, tto, forecast.predicted_fraction, cause)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


def _target_for(timeline: Timeline, name: str) -> common_pb2.Target:
    target = timeline.targets.get(name)
    return target if target is not None else common_pb2.Target(engine=name)


def run(args: argparse.Namespace) -> int:
    manifest_path = args.run_dir / "stack.json"
    if not manifest_path.exists():
        Console(stderr=True).print(f"[red]error:[/] no running stack at {args.run_dir} (start one with `sits up`)")
        return 2
    manifest = json.loads(manifest_path.read_text())
    return asyncio.run(_watch(manifest, args.duration))


async def _watch(manifest: dict[str, object], duration: float | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    topics = Topics(str(manifest.get("topic_prefix", "")))
    services = manifest["services"]
    assert isinstance(services, dict)
    timeline = Timeline()
    tap = TopicTap(
        str(manifest["kafka_bootstrap"]),
        [*topics.samples, topics.commands, topics.results, topics.validation],
        timeline.on_event,
    )
    async with tap:
        poller = asyncio.create_task(poll_forecasts(timeline, services["decision"]["address"], stop))
        with Live(render(timeline, "watching", 0.0, 0), refresh_per_second=2, screen=False) as live:
            deadline = None if duration is None else loop.time() + duration
            while not stop.is_set() and (deadline is None or loop.time() < deadline):
                live.update(render(timeline, "watching", 0.0, 0))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
        stop.set()
        await poller
    return 0
