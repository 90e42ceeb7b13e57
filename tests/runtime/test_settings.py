"""Settings named SITS_<SERVICE>_...: renamed ones still read under their old names, and `sits settings` lists
every variable SITS reads, the ones read inside vLLM's processes included."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from services.capture.settings import CaptureSettings
from services.executor.settings import ExecutorSettings
from sits.runtime.settings import SettingsError, load_settings
from sits_app.settings_cli import all_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("cls", "field", "new", "old", "value", "expected"),
    [
        (CaptureSettings, "capture_spool_dir", "SITS_CAPTURE_SPOOL_DIR", "SITS_SPOOL_DIR", "/tmp/s", Path("/tmp/s")),
        (CaptureSettings, "capture_engine_name", "SITS_CAPTURE_ENGINE_NAME", "SITS_ENGINE_NAME", "vllm-9", "vllm-9"),
        (ExecutorSettings, "executor_group", "SITS_EXECUTOR_GROUP", "SITS_EXECUTOR_GROUP_ID", "g", "g"),
        (
            ExecutorSettings,
            "executor_breaker_default_ttl_s",
            "SITS_EXECUTOR_BREAKER_DEFAULT_TTL_S",
            "SITS_BREAKER_DEFAULT_TTL_S",
            "7",
            7,
        ),
        (ExecutorSettings, "executor_mig_apply", "SITS_EXECUTOR_MIG_APPLY", "SITS_MIG_APPLY", "1", True),
    ],
)
def test_a_renamed_setting_reads_its_old_name_and_the_new_one_wins(
    monkeypatch: pytest.MonkeyPatch, cls: type, field: str, new: str, old: str, value: str, expected: object
) -> None:
    monkeypatch.setenv(old, value)
    assert getattr(load_settings(cls), field) == expected
    default = cls.model_fields[field].default
    monkeypatch.setenv(new, str(default))
    assert getattr(load_settings(cls), field) == default


def test_a_bad_value_under_an_old_name_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SITS_BREAKER_DEFAULT_TTL_S", "0")
    with pytest.raises(SettingsError, match=r"SITS_EXECUTOR_BREAKER_DEFAULT_TTL_S \(or SITS_BREAKER_DEFAULT_TTL_S\)"):
        load_settings(ExecutorSettings)


def test_settings_are_listed_under_their_new_names_with_the_old_ones_mentioned() -> None:
    rows = {variable: (scope, meaning) for variable, scope, _default, meaning in all_settings()}
    assert "SITS_SPOOL_DIR" not in rows and "SITS_MIG_APPLY" not in rows
    assert "Formerly SITS_MIG_APPLY" in rows["SITS_EXECUTOR_MIG_APPLY"][1]
    assert {"SITS_CAPTURE_GROUP", "SITS_EXECUTOR_GROUP_ID"}.isdisjoint(rows)
    assert {"SITS_DECISION_GROUP", "SITS_EXECUTOR_GROUP", "SITS_VALIDATOR_GROUP"} <= set(rows)


def test_every_variable_read_inside_vllm_is_listed() -> None:
    """The OOM hook and the scheduler plugin read os.environ in vLLM's processes; their names are listed too."""
    listed = {variable for variable, *_ in all_settings()}
    hook = (REPO / "sits_engine/oom_hook/hook.py").read_text()
    read = {f"SITS_OOM_HOOK_{name}" for name in re.findall(r'get\("([A-Z_]+)"', hook)}
    plugin = (REPO / "sits_engine/oom_hook/plugin.py").read_text()
    read |= set(re.findall(r'"(SITS_[A-Z_]+)"', plugin))
    environment = (REPO / "sits_engine/vllm_plugin/environment.py").read_text()
    read |= set(re.findall(r'= "(SITS_[A-Z_]+)"', environment))
    assert len(read) > 10
    assert read - listed == set()
    assert {"SITS_OOM_HOOK_DISABLED", "SITS_ENGINE_CONTROL_ADDR", "SITS_ENGINE_EMPTY_CACHE_AT_START"} <= listed


def test_the_readme_table_is_what_sits_settings_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from sits_app import settings_cli

    parser = argparse.ArgumentParser()
    settings_cli.configure_parser(parser)
    assert settings_cli.run(parser.parse_args(["--markdown"])) == 0
    table = capsys.readouterr().out
    assert table in (REPO / "README.md").read_text(), "regenerate the README table with sits settings --markdown"
