"""`sits settings`: every SITS_* setting, its default and what it means."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from pydantic_settings import BaseSettings
from rich.console import Console
from rich.table import Table

from sits.runtime.settings import Settings, former_names, variable_of

REPO = Path(__file__).resolve().parents[1]
# Per service: the module and class of its settings (`sits mesh ext-proc` reads only the shared ones).
SERVICE_SETTINGS = {
    "capture": ("services.capture.settings", "CaptureSettings"),
    "decision": ("services.decision.settings", "DecisionSettings"),
    "executor": ("services.executor.settings", "ExecutorSettings"),
    "validator": ("services.validator.settings", "ValidatorSettings"),
}
# Variables read inside vLLM's processes (no settings class there): module of their ENVIRONMENT rows.
ENGINE_VARIABLES = {
    "vLLM (OOM hook)": "sits_engine.oom_hook.hook",
    "vLLM (scheduler plugin)": "sits_engine.vllm_plugin.environment",
}


def all_settings() -> list[tuple[str, str, str, str]]:
    """(variable, scope, default, description) for every setting, shared ones first, then the engine's."""
    rows: list[tuple[str, str, str, str]] = []
    seen: set[str] = set()
    classes: list[tuple[str, type[BaseSettings]]] = [("all services", Settings)]
    for scope, (module_name, class_name) in SERVICE_SETTINGS.items():
        classes.append((scope, getattr(importlib.import_module(module_name), class_name)))
    for scope, cls in classes:
        for name, field in cls.model_fields.items():
            variable = variable_of(name, field.validation_alias)
            if variable in seen:
                continue
            seen.add(variable)
            default = "" if field.default_factory is not None else _shown(field.default)
            description = field.description or ""
            former = former_names(field.validation_alias)
            if former:
                description += f" (Formerly {', '.join(former)}, still read.)"
            rows.append((variable, scope, default, description))
    for scope, module_name in ENGINE_VARIABLES.items():
        for variable, default, description in importlib.import_module(module_name).ENVIRONMENT:
            if variable in seen:  # one variable for both sides (the engine-control address, the hook spool)
                rows = [(v, f"{s}, {scope}" if v == variable else s, d, m) for v, s, d, m in rows]
                continue
            seen.add(variable)
            rows.append((variable, scope, repr(default), description))
    return rows


def _shown(default: object) -> str:
    """A default as Python writes it; a path inside the checkout relative to it (the same in every checkout)."""
    if isinstance(default, Path) and default.is_absolute() and default.is_relative_to(REPO):
        return repr(default.relative_to(REPO))
    return repr(default)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for the README)")


def run(args: argparse.Namespace) -> int:
    rows = all_settings()
    if args.markdown:
        print("| variable | used by | default | meaning |")
        print("|---|---|---|---|")
        for variable, scope, default, description in rows:
            print(f"| `{variable}` | {scope} | `{default}` | {description} |")
        return 0
    table = Table(title="SITS settings (environment variables)")
    table.add_column("variable", no_wrap=True, style="bold")
    table.add_column("used by", no_wrap=True)
    table.add_column("default")
    table.add_column("meaning")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return 0
