"""The hook's fallback spool: one small JSON file per OOM event.

One file per event (written to a temporary name, fsynced, then renamed) means
several processes can spool into one folder at once, a crash mid-write leaves
no half record under a real name, and the capture service can ingest and delete
files without racing a writer. OOMs are rare, so a file each is cheap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SUFFIX = ".oom.json"


def spool_event(spool_dir: str | Path, event: dict[str, Any]) -> Path:
    folder = Path(spool_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{event['produced_at']:.6f}-{event['pid']}-{event['event_id']}{SUFFIX}"
    temporary = final.with_name("." + final.name + ".tmp")
    data = json.dumps(event, separators=(",", ":")).encode()
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, final)
    return final


def spooled_events(spool_dir: str | Path) -> Iterator[tuple[Path, dict[str, Any] | None]]:
    """Spooled events oldest first; the dict is None for a file that cannot be parsed."""
    folder = Path(spool_dir)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*" + SUFFIX)):
        try:
            event = json.loads(path.read_bytes())
        except (OSError, ValueError):
            yield path, None
            continue
        yield path, event if isinstance(event, dict) else None
