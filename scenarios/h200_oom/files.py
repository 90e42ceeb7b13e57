"""The file handshake between the scenario's processes (ready report, start signal, results)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def wait_for_file(path: Path, timeout_s: float) -> dict[str, Any]:
    """The JSON object in `path` once it appears (written by `write_json`, so never half-read)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            try:
                loaded: dict[str, Any] = json.loads(path.read_text())
                return loaded
            except json.JSONDecodeError:
                pass
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not appear in {timeout_s} s")


def write_json(path: Path, value: Any) -> None:
    """Write through a temporary file and rename, so a reader never sees a partial file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)
