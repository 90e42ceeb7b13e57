"""How every benchmark (and `sits demo`) records its result (see BENCHMARKS.md in the project's shared notes).

One JSON file per benchmark under bench/results/, with what was measured
(`figures`), what it was compared against in the same run (`baseline`) and the
target from the issue (`goal`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def machine() -> str:
    return f"{os.cpu_count()}-core CPU machine ({platform.machine()}, Python {platform.python_version()})"


def utc_stamp() -> str:
    """Now, as every result file's `measured_at` is written."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_result(
    name: str,
    *,
    command: str,
    figures: dict[str, Any],
    baseline: dict[str, Any],
    goal: dict[str, Any],
    machine_text: str | None = None,
    notes: str = "",
    extra: dict[str, Any] | None = None,
) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "name": name,
        "measured_at": utc_stamp(),
        "machine": machine_text or machine(),
        "command": command,
        "figures": figures,
        "baseline": baseline,
        "goal": goal,
    }
    if notes:
        data["notes"] = notes
    if extra:
        data.update(extra)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
