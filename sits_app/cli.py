"""`sits`: run the SITS services, the embedded stack and the tools.

Each subcommand lives beside the code it drives; this file only wires them,
and imports each lazily so `sits --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

SERVICES = ("capture", "decision", "executor", "validator")


@dataclass(frozen=True)
class Tool:
    """A subcommand implemented by a module with `configure_parser(parser)` and `run(args) -> int`."""

    name: str
    module: str
    help: str


TOOLS = (
    Tool("up", "sits_app.stack.up_cli", "start the embedded stack (Tansu, Redis, the four services); Ctrl-C stops it"),
    Tool(
        "demo", "sits_app.demo.cli", "the main job: real vLLM behind Envoy under rising load, healed live, and a report"
    ),
    Tool("watch", "sits_app.demo.watch_cli", "live view of a running stack: memory, forecast, actions, verdicts"),
    Tool("estimate", "services.decision.estimator_cli", "model memory on a GPU: weights, KV cache, what fits"),
    Tool("mig", "services.executor.mig.cli", "plan a MIG re-partition that touches only what must change"),
    Tool("mesh", "sits_mesh.cli", "render Envoy and Istio configs from a mesh policy"),
    Tool(
        "fleet", "sits_app.fleet.cli", "simulate a fleet of GPUs: recorded H200 traces, shifted and mixed, into Kafka"
    ),
    Tool("settings", "sits_app.settings_cli", "list every SITS_ setting, its default and meaning"),
    Tool("keys", "sits_app.keys_cli", "make and rotate the keys that sign healing commands"),
    Tool("tls", "sits_app.stack.devcerts", "development certificates (a CA, server and client certificates)"),
)


def _service_runner(name: str) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        return int(importlib.import_module(f"services.{name}.main").main())

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sits",
        description=(
            "SITS sees GPU memory pressure coming in vLLM inference fleets and heals the engine before a "
            "CUDA out-of-memory kills it: capture -> decide -> execute -> validate."
        ),
        epilog="Settings come from SITS_* environment variables: `sits settings` lists them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SERVICES:
        service = sub.add_parser(name, help=f"run the {name} service (settings from SITS_* variables)")
        service.set_defaults(func=_service_runner(name))
    for tool in TOOLS:
        tool_parser = sub.add_parser(tool.name, help=tool.help, description=tool.help, add_help=False)
        # A tool's own options are configured only when that tool runs (lazy import).
        tool_parser.set_defaults(tool=tool)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    tool: Tool | None = getattr(args, "tool", None)
    if tool is None:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return int(args.func(args))
    module = importlib.import_module(tool.module)
    tool_parser = argparse.ArgumentParser(prog=f"sits {tool.name}", description=tool.help)
    module.configure_parser(tool_parser)
    return int(module.run(tool_parser.parse_args(rest)))


if __name__ == "__main__":
    sys.exit(main())
