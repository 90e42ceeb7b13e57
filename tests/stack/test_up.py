"""`sits up` for real: every service SERVING within 5 s of its start, and Ctrl-C leaves no process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_sits_up_serves_every_service_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sits.cli", "up", "--run-dir", str(tmp_path / "run")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
        )
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        text = log.read_text()
        assert "Ctrl-C stops everything" in text, text
        for name in ("capture", "decision", "executor", "validator"):
            line = next(x for x in text.splitlines() if f"{name} SERVING" in x)
            ready_s = float(line.split(" after ")[1].split(" s")[0])
            assert ready_s < 5.0, line
        children = descendants(proc.pid)
        assert len(children) >= 5, "tansu and the four services run as children"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=40) == 0
        time.sleep(0.2)
        left = [pid for pid in children if alive(pid)]
        assert left == [], f"processes left behind: {left}"
        assert "no process left behind" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
