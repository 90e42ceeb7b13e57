"""`sits mig plan` / `sits mig profiles`, through run() and as a subprocess."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.executor.mig import cli

REPO = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sits mig")
    cli.configure_parser(parser)
    return cli.run(parser.parse_args(argv))


def test_plan_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(
        [
            "plan",
            "--gpu",
            "h200-141gb",
            "--current",
            "3g.71gb@0:tenantA,1g.18gb@4:tenantB",
            "--need",
            "tenantA=60GiB",
            "--need",
            "tenantB=20GiB",
            "--json",
        ]
    )
    assert code == cli.EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True
    assert [(s["action"], s["profile"], s["start"], s["tenant"]) for s in data["steps"]] == [
        ("drain", "1g.18gb", 4, "tenantB"),
        ("destroy", "1g.18gb", 4, "tenantB"),
        ("create", "1g.35gb", 4, "tenantB"),
    ]
    assert [k["tenant"] for k in data["kept"]] == ["tenantA"]


def test_plan_human_output_shows_a_step_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(["plan", "--current", "3g.71gb@0:tenantA,1g.18gb@4:tenantB", "--need", "tenantB=20GiB"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    assert "destroy" in out and "1g.35gb@4" in out and "untouched: 3g.71gb@0:tenantA" in out


def test_refusal_exits_3_with_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(["plan", "--current", "1g.18gb@0:b,1g.18gb@4:c", "--need", "d=60GiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_REFUSED
    assert data["ok"] is False and data["reasons"][0].startswith("no valid placement")


def test_layout_file_in_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = tmp_path / "layout.yaml"
    layout.write_text("gpu: a100-80gb\ninstances:\n  - {profile: 3g.40gb, start: 4, tenant: a}\n")
    code = run_cli(["plan", "--gpu", "a100-80gb", "--current-file", str(layout), "--need", "b=30GiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_OK
    assert [(s["action"], s["profile"], s["start"]) for s in data["steps"]] == [("create", "3g.40gb", 0)]


def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["plan", "--need", "nobody"]) == cli.EXIT_BAD_INPUT
    assert "TENANT=SIZE" in capsys.readouterr().err
    assert run_cli(["plan", "--current", "9g.1gb@0:a", "--need", "a=1GiB"]) == cli.EXIT_REFUSED


def test_module_runs_as_a_subprocess() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.executor.mig.cli",
            "plan",
            "--current",
            "1g.18gb@0:b",
            "--need",
            "d=60GiB",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["target"]["instances"][-1] == {
        "profile": "3g.71gb",
        "start": 4,
        "size": 4,
        "tenant": "d",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "services.executor.mig.cli", "profiles", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert [p["name"] for p in json.loads(proc.stdout)["profiles"]][-1] == "7g.141gb"
