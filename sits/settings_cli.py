"""`sits settings`: every SITS_* setting, its default and what it means."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from pydantic_settings import BaseSettings
from rich.console import Console
from rich.table import Table

from sits.runtime.settings import ENV_PREFIX, Settings

REPO = Path(__file__).resolve().parents[1]
SERVICE_SETTINGS = {
    "capture": "services.capture.main",
    "decision": "services.decision.main",
    "executor": "services.executor.main",
    "validator": "services.validator.main",
}


def all_settings() -> list[tuple[str, str, str, str]]:
    """(variable, scope, default, description) for every setting, shared ones first."""
    rows: list[tuple[str, str, str, str]] = []
    seen: set[str] = set()
    classes: list[tuple[str, type[BaseSettings]]] = [("all services", Settings)]
    for scope, module_name in SERVICE_SETTINGS.items():
        try:
            classes.append((scope, importlib.import_module(module_name).SETTINGS))
        except (ImportError, AttributeError):
            continue
    for scope, cls in classes:
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            variable = alias if isinstance(alias, str) else f"{ENV_PREFIX}{name.upper()}"
            if variable in seen:
                continue
            seen.add(variable)
            default = "" if field.default_factory is not None else _shown(field.default)
            rows.append((variable, scope, default, field.description or ""))
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
