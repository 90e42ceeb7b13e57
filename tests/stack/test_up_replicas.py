"""`sits up --replicas 2`: two processes of each replicated service, one consumer group per service, the
partitions split between them (each replica logs what it was assigned), and Ctrl-C stops them all."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.stack.test_up import alive, descendants

PARTITIONS = 4
ASSIGNED = re.compile(r"assigned partition\(s\) \[([0-9, ]*)\]")


def last_assignment(log: Path) -> set[int] | None:
    if not log.exists():
        return None
    found = ASSIGNED.findall(log.read_text(errors="replace"))
    return {int(p) for p in found[-1].split(",") if p.strip()} if found else None


@pytest.mark.timeout(150)
def test_sits_up_with_replicas_splits_the_partitions_between_them(tmp_path: Path) -> None:
    run = tmp_path / "run"
    log = tmp_path / "up.log"
    prefix = f"t{uuid.uuid4().hex[:10]}."
    flags = ["--replicas", "2", "--executor-replicas", "3", "--partitions", str(PARTITIONS), "--topic-prefix", prefix]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sits_app.cli", "up", "--run-dir", str(run), *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            # INFO: the replicas log their assignments, which is what this test reads.
            env={**os.environ, "COLUMNS": "200", "SITS_LOG_LEVEL": "INFO", "SITS_NVML_ENABLED": "false"},
        )
    try:
        deadline = time.monotonic() + 100
        while "Ctrl-C stops everything" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert "Ctrl-C stops everything" in log.read_text(), log.read_text()
        manifest = json.loads((run / "stack.json").read_text())["services"]
        expected = {"capture", "decision", "decision-2", "executor", "executor-2", "executor-3"}
        assert expected | {"validator", "validator-2"} == set(manifest), manifest
        assert len({s["address"] for s in manifest.values()}) == len(manifest), "each process has its own port"
        assert all(alive(s["pid"]) for s in manifest.values())

        # The group settles on a split: every partition owned by exactly one replica of each service.
        logs = run / "logs"
        splits: dict[str, list[set[int] | None]] = {}
        while time.monotonic() < deadline + 40:
            splits = {
                svc: [last_assignment(logs / f"{n}.log") for n in manifest if n.split("-")[0] == svc]
                for svc in ("decision", "validator")
            }
            settled = all(
                all(s is not None for s in parts)
                and sum(len(s) for s in parts if s) == PARTITIONS
                and set().union(*(s for s in parts if s)) == set(range(PARTITIONS))
                for parts in splits.values()
            )
            if settled:
                break
            time.sleep(1.0)
        for svc, parts in splits.items():
            owned = [s for s in parts if s is not None]
            assert len(owned) == 2 and all(owned), f"{svc}: both replicas own partitions: {splits}"
            assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(range(PARTITIONS)), splits

        children = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
        assert [pid for pid in children if alive(pid)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
