"""The GPU-pressure file that Envoy's `injected_resource` monitor reads.

Envoy watches the file and re-reads it when it is replaced, so a writer must
rename a complete file into place: a reader never sees a half-written number.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def format_pressure(value: float) -> str:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"pressure must be within [0, 1], got {value}")
    return f"{value:.4f}"


def write_pressure(path: Path, value: float) -> None:
    """Atomically replace `path` with `value` (a fraction in [0, 1])."""
    text = format_pressure(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise


def read_pressure(path: Path) -> float | None:
    """The pressure in the file, or None when it is missing or not a number in [0, 1]."""
    try:
        value = float(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return value if 0.0 <= value <= 1.0 else None
