"""`sits up`: the embedded stack in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sits.runtime.redis import RedisUnavailable
from sits.runtime.secret_files import mask_url
from sits.runtime.settings import Settings, load_settings
from sits_app.stack.embedded import REPLICATED, EmbeddedStack, ServiceExited, StackConfig


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=Path(".run"), help="logs, token and spool (default: .run)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis to use (default: %(default)s)")
    parser.add_argument(
        "--redis-password-file", type=Path, default=None, help="file holding the Redis password (AUTH), if it has one"
    )
    parser.add_argument("--for", dest="duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument(
        "--replicas",
        type=_positive,
        default=1,
        help="processes of each of decision, executor and validator (one consumer group each; default 1)",
    )
    for service in REPLICATED:
        parser.add_argument(
            f"--{service}-replicas", type=_positive, default=None, help=f"processes of {service} (over --replicas)"
        )
    parser.add_argument(
        "--topic-prefix",
        default="",
        help="prefix of topic names, consumer groups and Redis keys (keeps stacks that share a Redis apart)",
    )
    parser.add_argument(
        "--partitions",
        type=_positive,
        default=None,
        help="partitions of the topics the stack creates: the most replicas of one service that get work "
        "(default: SITS_KAFKA_PARTITIONS, 4)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def replicas_from(args: argparse.Namespace) -> dict[str, int]:
    out = {}
    for service in REPLICATED:
        own = getattr(args, f"{service}_replicas", None)
        out[service] = own if own is not None else args.replicas
    return out


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        return asyncio.run(_up(args, console))
    except (RedisUnavailable, TimeoutError, ServiceExited) as err:
        console.print(f"[red]error:[/] {err}")
        return 2


async def _up(args: argparse.Namespace, console: Console) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    config = StackConfig(
        run_dir=args.run_dir.resolve(),
        redis_url=args.redis_url,
        redis_password_file=args.redis_password_file,
        topic_prefix=args.topic_prefix,
        replicas=replicas_from(args),
        partitions=args.partitions,
    )
    most = max(config.replicas.values())
    partitions = config.partitions or load_settings(Settings).kafka_partitions
    if most > partitions:
        console.print(f"[yellow]warning:[/] {most} replicas of a service but {partitions} partitions: some stay idle")
    stack = EmbeddedStack(config, progress=lambda msg: console.log(msg))
    with console.status("starting the embedded stack"):
        try:
            await stack.start()
        except BaseException:
            await stack.stop()
            raise
    try:
        table = Table(title="SITS embedded stack", title_justify="left")
        for column in ("component", "listens on", "metrics", "ready after", "log"):
            table.add_column(column)
        table.add_row("kafka (tansu)", stack.broker.bootstrap, "", "", str(config.run_dir / "logs" / "tansu.log"))
        table.add_row("redis", mask_url(config.redis_url), "", "", "")
        for s in stack.services.values():
            table.add_row(
                s.name, s.address, f"127.0.0.1:{s.metrics_port}", f"{s.ready_after_s:.2f} s", str(s.process.log_path)
            )
        console.print(table)
        console.print(f"bearer token for mutating calls: {stack.token_file}")
        console.print(f"command signing keys (decision, validator sign; executor verifies): {stack.command_keys_file}")
        console.print("Ctrl-C stops everything.")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.duration)
    finally:
        with console.status("stopping"):
            await stack.stop()
        console.print("stopped; no process left behind.")
    return 0
