"""`sits fleet`: a simulated fleet of GPUs publishing recorded H200 traces into a running stack's Kafka."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import tempfile
import time
from pathlib import Path

from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.settings import CaptureSettings
from services.capture.spool import Spool
from sits.runtime.events import Topics
from sits.runtime.settings import load_settings
from sits_app.fleet.sim import Fleet, load_frames, trace_paths


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--targets", type=int, default=500, help="simulated GPUs (one engine each; default 500)")
    parser.add_argument("--hz", type=float, default=10.0, help="samples per second per target (default 10)")
    parser.add_argument("--for", dest="duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument(
        "--stack",
        type=Path,
        default=None,
        help="a running `sits up`'s run dir: its stack.json gives the broker and topic prefix "
        "(default: SITS_KAFKA_BOOTSTRAP and SITS_TOPIC_PREFIX)",
    )
    parser.add_argument("--traces", type=Path, nargs="*", default=None, help="trace files (default: traces/)")
    parser.add_argument(
        "--linger-ms",
        type=float,
        default=None,
        help="how long calm samples wait to share a record with more of their target's "
        "(default: SITS_CAPTURE_LINGER_MS, else 0)",
    )
    parser.add_argument(
        "--incidents",
        type=float,
        default=0.1,
        help="fraction of targets replaying an incident trace (near the limit, most running out; default 0.1)",
    )


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    overrides = {}
    if args.stack is not None:
        import json

        stack = json.loads((args.stack / "stack.json").read_text())
        overrides = {"kafka_bootstrap": stack["kafka_bootstrap"], "topic_prefix": stack["topic_prefix"]}
    settings = load_settings(CaptureSettings, **overrides)
    frames = [load_frames(p, args.hz) for p in (args.traces or trace_paths())]
    fleet = Fleet(frames, args.targets, hz=args.hz, incident_fraction=args.incidents)
    print(
        f"{args.targets} targets at {args.hz:g} Hz over {len(frames)} traces "
        f"({fleet.in_incident()} in an incident, {fleet.heading_to_oom()} running out of memory) "
        f"-> {settings.kafka_bootstrap}"
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with tempfile.TemporaryDirectory(prefix="sits-fleet-spool-") as spool_dir:
        linger_ms = args.linger_ms if args.linger_ms is not None else settings.capture_linger_ms
        publisher = CapturePublisher(
            lambda: TopicEnsuringProducer(settings),
            Spool(spool_dir, fsync="never"),
            Topics(settings.topic_prefix),
            trace_samples_above=settings.capture_trace_samples_above,
            linger_s=linger_ms / 1000,
            urgent_lane=settings.capture_urgent_lane,
        )
        pub = asyncio.create_task(publisher.run(stop))
        sim = asyncio.create_task(fleet.run(publisher, stop))
        started = time.monotonic()
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 5.0)
                now = time.monotonic()
                print(
                    f"{now - started:6.1f} s: {fleet.stats.submitted} samples, {fleet.stats.rate(now):.0f}/s, "
                    f"published {publisher.stats.published}, spooled {publisher.stats.spooled}"
                )
                if args.duration is not None and now - started >= args.duration:
                    stop.set()
        finally:
            stop.set()
            await asyncio.gather(sim, pub)
    return 0
