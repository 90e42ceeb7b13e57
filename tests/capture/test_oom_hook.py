"""The in-process hook: light to import, never raises into the host, loads as a vLLM plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sits_engine.oom_hook.hook import HookConfig, OomHook
from sits_engine.oom_hook.spool import spooled_events

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_plugin_imports_nothing_heavy() -> None:
    code = (
        "import sys, json; import sits_engine.oom_hook.plugin, sits_engine.oom_hook;"
        "print(json.dumps(sorted(m for m in ('torch','grpc','google.protobuf','sits.v1') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_plugin_is_registered_for_vllm_and_register_never_raises() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("sits_oom_hook") == "sits_engine.oom_hook.plugin:register"
    # On this CPU-only torch the hook reports itself unavailable and the host goes on.
    code = "from sits_engine.oom_hook import plugin, hook; plugin.register();print(hook._installed.status)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "SITS_OOM_HOOK_SPOOL_DIR": "/tmp/x"},
    )
    assert out.stdout.strip().startswith("unavailable: this torch has no CUDA OOM observer")


def test_observer_swallows_every_failure(tmp_path: Path) -> None:
    def broken_stats(_device: int) -> dict[str, int]:
        raise RuntimeError("allocator stats exploded")

    def broken_reporter(_event: dict[str, object]) -> None:
        raise ConnectionError("capture down")

    hook = OomHook(
        HookConfig(spool_dir=str(tmp_path)),
        stats_reader=broken_stats,
        reporter=broken_reporter,
        gpu_uuid_of=lambda _d: "GPU-1",
    )
    hook.on_oom(0, 1 << 30, 80 << 30, 1 << 20)  # must not raise
    assert hook.wait_idle(5)
    events = [e for _p, e in spooled_events(tmp_path)]
    assert len(events) == 1 and events[0] is not None
    assert events[0]["requested_bytes"] == 1 << 30 and events[0]["allocator"] == {}
    assert events[0]["traceparent"].startswith("00-")

    unwritable = OomHook(
        HookConfig(spool_dir="/proc/no-such-dir"),
        stats_reader=broken_stats,
        reporter=broken_reporter,
        gpu_uuid_of=lambda _d: "",
    )
    unwritable.on_oom(0, 1, 2, 1)
    assert unwritable.wait_idle(5)
    assert unwritable.failures == 1 and unwritable.spooled == []


def test_config_from_environment() -> None:
    config = HookConfig.from_env(
        {
            "SITS_OOM_HOOK_CAPTURE_ADDR": "10.0.0.1:50061",
            "SITS_OOM_HOOK_TIMEOUT_S": "0.25",
            "SITS_OOM_HOOK_ENGINE": "vllm-3",
            "SITS_OOM_HOOK_HOST": "node-7",
        }
    )
    assert (config.capture_addr, config.report_timeout_s, config.engine, config.host) == (
        "10.0.0.1:50061",
        0.25,
        "vllm-3",
        "node-7",
    )
