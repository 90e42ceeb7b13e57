"""`sits mig plan` / `sits mig profiles`: plan a MIG rebalance without touching any GPU.

    sits mig plan --gpu h200-141gb --current '3g.71gb@0:tenantA,1g.18gb@4:tenantB' \\
        --need tenantA=60GiB --need tenantB=20GiB [--move-unlisted] [--json]
    sits mig plan --gpu h200-141gb --current-file layout.yaml --need tenantC=30GiB
    sits mig profiles --gpu h200-141gb [--json]

Exit status: 0 a plan (possibly with no steps), 3 refused (the reasons are printed), 2 bad input.
Also runnable as `python -m services.executor.mig.cli ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from services.executor.mig.planner import (
    MigLayout,
    MigPlan,
    MigRefusal,
    parse_layout_spec,
    parse_size,
    plan_rebalance,
)
from services.executor.mig.profiles import GPU_MODELS, gpu_model, profile_table

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_REFUSED = 3


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the `plan` and `profiles` subcommands to the `mig` parser."""
    commands = parser.add_subparsers(dest="mig_command", required=True, metavar="{plan,profiles}")
    plan = commands.add_parser("plan", help="plan the smallest MIG change that fits every tenant's memory")
    plan.add_argument(
        "--gpu",
        default="h200-141gb",
        choices=sorted(GPU_MODELS),
        help="GPU model whose profile table applies (default: h200-141gb)",
    )
    source = plan.add_mutually_exclusive_group()
    source.add_argument(
        "--current", default="", help="current layout as PROFILE@START[:TENANT],... e.g. '3g.71gb@0:tenantA,1g.18gb@4'"
    )
    source.add_argument(
        "--current-file",
        type=Path,
        help="current layout as a JSON or YAML file: {gpu, instances: [{profile, start, tenant}]}",
    )
    plan.add_argument(
        "--need",
        action="append",
        default=[],
        metavar="TENANT=SIZE",
        help="memory a tenant needs, e.g. tenantA=60GiB (repeatable; 0 releases the tenant)",
    )
    plan.add_argument(
        "--move-unlisted",
        action="store_true",
        help="allow moving tenants that have no --need (same profile) to make room",
    )
    plan.add_argument("--json", action="store_true", help="print the plan or refusal as JSON")
    profiles = commands.add_parser("profiles", help="show the built-in MIG profile table of a GPU model")
    profiles.add_argument("--gpu", default="h200-141gb", choices=sorted(GPU_MODELS))
    profiles.add_argument("--json", action="store_true")


def _load_layout_file(gpu: str, path: Path) -> MigLayout:
    text = path.read_text()
    data: Any
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if isinstance(data, list):
        data = {"instances": data}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with 'instances'")
    data.setdefault("gpu", gpu)
    layout = MigLayout.from_json(data)
    gpu_model(layout.gpu)
    return layout


def _parse_needs(items: list[str]) -> dict[str, int]:
    needs: dict[str, int] = {}
    for item in items:
        tenant, eq, size = item.partition("=")
        if not eq or not tenant.strip():
            raise ValueError(f"not a need: {item!r} (use TENANT=SIZE, e.g. tenantA=60GiB)")
        needs[tenant.strip()] = parse_size(size)
    return needs


def run(args: argparse.Namespace) -> int:
    if args.mig_command == "profiles":
        return _run_profiles(args)
    try:
        if args.current_file is not None:
            current = _load_layout_file(args.gpu, args.current_file)
        else:
            current = parse_layout_spec(args.gpu, args.current)
        needs = _parse_needs(args.need)
    except (ValueError, KeyError, OSError) as exc:
        print(f"sits mig plan: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result = plan_rebalance(current, needs, move_unlisted=args.move_unlisted)
    if args.json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    else:
        _print_human(result)
    return EXIT_OK if isinstance(result, MigPlan) else EXIT_REFUSED


def _print_human(result: MigPlan | MigRefusal) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if isinstance(result, MigRefusal):
        console.print(f"[bold red]refused[/] on {result.gpu}:")
        for reason in result.reasons:
            console.print(f"  - {reason}")
        return
    layouts = Table(title=f"MIG layout on {result.current.gpu}")
    layouts.add_column("current")
    layouts.add_column("target")
    current = [i.label() for i in result.current.sorted().instances]
    target = [i.label() for i in result.target.instances]
    for row in range(max(len(current), len(target))):
        layouts.add_row(current[row] if row < len(current) else "", target[row] if row < len(target) else "")
    console.print(layouts)
    if not result.steps:
        console.print("no change needed: every tenant fits where it is")
        return
    steps = Table(title="steps (drain -> destroy -> create -> assign)")
    for column in ("#", "action", "instance", "tenant", "reason"):
        steps.add_column(column)
    for number, step in enumerate(result.steps, start=1):
        instance = step.instance
        steps.add_row(
            str(number), step.action, f"{instance.profile}@{instance.start}", instance.tenant or "", step.reason
        )
    console.print(steps)
    kept = ", ".join(i.label() for i in result.kept) or "none"
    console.print(f"untouched: {kept}")


def _run_profiles(args: argparse.Namespace) -> int:
    model = gpu_model(args.gpu)
    rows = profile_table(model)
    if args.json:
        print(json.dumps({"gpu": model.key, "profiles": rows}, indent=2, sort_keys=True))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"MIG profiles on {model.key} (memory slices {model.memory_slices}, "
        f"compute slices {model.compute_slices})"
    )
    for column in ("profile", "id", "compute", "memory slices", "MiB", "max", "starts"):
        table.add_column(column)
    for row in rows:
        starts = "{" + ",".join(str(p["start"]) for p in row["placements"]) + "}"
        table.add_row(
            row["name"],
            str(row["profile_id"]),
            str(row["compute_slices"]),
            str(row["memory_slices"]),
            str(row["memory_mib"]),
            str(row["max_instances"]),
            starts,
        )
    Console().print(table)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sits mig", description="MIG rebalancing (planning only)")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
