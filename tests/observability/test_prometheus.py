"""Alert rules pass their promtool unit tests, and each service's live /metrics passes
`promtool check metrics`. promtool missing is a failure: scripts/ensure_promtool.sh installs it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from sits_app.stack.embedded import SERVICES, EmbeddedStack, StackConfig

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: run scripts/ensure_promtool.sh (Debian package prometheus)"
    return subprocess.run(
        [binary, *args], input=stdin, capture_output=True, text=True, timeout=120, check=False, cwd=PROMETHEUS
    )


def test_rules_are_valid() -> None:
    result = promtool("check", "rules", "rules/sits.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", "tests/sits.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_compose_prometheus_config_is_valid_with_its_rules(tmp_path: Path) -> None:
    # In the container the rules are mounted at /etc/prometheus/rules; here they are in the repo.
    config = (PROMETHEUS / "prometheus.yml").read_text().replace("/etc/prometheus/rules", str(PROMETHEUS / "rules"))
    (tmp_path / "prometheus.yml").write_text(config)
    result = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout + result.stderr


def test_promtool_check_metrics_rejects_bad_exposition() -> None:
    bad = "# HELP sits_bad Bad.\n# TYPE sits_bad counter\nsits_bad 1\n"  # a counter without _total
    assert promtool("check", "metrics", stdin=bad).returncode != 0


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
        return body.decode()


@pytest.mark.parametrize("service", SERVICES)
async def test_live_metrics_pass_promtool(service: str, tmp_path: Path, redis_url: str, topic_prefix: str) -> None:
    config = StackConfig(run_dir=tmp_path, redis_url=redis_url, topic_prefix=topic_prefix, services=(service,))
    async with EmbeddedStack(config, progress=None) as stack:
        exposition = await asyncio.to_thread(scrape, stack.services[service].metrics_port)
    result = promtool("check", "metrics", stdin=exposition)
    assert result.returncode == 0, result.stdout + result.stderr
    # The shared metrics every service exports (sits/runtime/metrics.py).
    for name in ("sits_events_in_total", "sits_consumer_lag", "sits_handler_seconds"):
        assert f"# TYPE {name.removesuffix('_total')}" in exposition, f"{service} does not export {name}"
