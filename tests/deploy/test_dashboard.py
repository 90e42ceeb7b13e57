"""The Grafana dashboard, checked structurally, and the metric-name contract it shares
with the alert rules (deploy/METRICS.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from sits.runtime import metrics as runtime_metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy/grafana/dashboards/sits-oom.json"
RULES = REPO / "deploy/prometheus/rules/sits.rules.yml"
CONTRACT = REPO / "deploy/METRICS.md"
PANEL_TYPES = {"row", "heatmap", "timeseries", "stat", "state-timeline", "bargauge", "table", "text"}
_METRIC = re.compile(r"\b(sits(?::[a-z0-9_]+)+|sits_[a-z0-9_]+)\b")
_HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    document = json.loads(DASHBOARD.read_text())
    assert isinstance(document, dict)
    return document


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exprs(dashboard: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    found += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    found += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return found


def contract_names() -> set[str]:
    return set(re.findall(r"`(sits_[a-z0-9_]+)", CONTRACT.read_text()))


def recorded_names() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def metric_names(expr: str) -> set[str]:
    return {_HISTOGRAM_SUFFIX.sub("", name) for name in _METRIC.findall(expr)}


def test_dashboard_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "sits-oom"
    assert dashboard["title"] and dashboard["schemaVersion"] >= 36
    assert dashboard.get("id") is None, "provisioned dashboards carry no database id"


def test_panels_have_unique_ids_and_fit_the_grid_without_overlap(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert grid["h"] > 0 and grid["y"] >= 0
        mine = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_targets_are_complete_and_use_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in variables
    for panel in panels(dashboard):
        assert panel["targets"], f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in [panel, *panel["targets"]]:
            assert target["datasource"]["uid"] == "${datasource}"
    for expr in exprs(dashboard):
        for used in re.findall(r"\$(\w+)", expr):
            assert used.startswith("__") or used in variables, f"${used} in {expr!r} is not a dashboard variable"


def test_required_views_are_there(dashboard: dict[str, Any]) -> None:
    def panels_of(kind: str, metric: str) -> list[dict[str, Any]]:
        return [p for p in panels(dashboard) if p["type"] == kind and any(metric in t["expr"] for t in p["targets"])]

    heatmaps = panels_of("heatmap", "sits_memory_fraction")
    assert heatmaps and "gpu" in heatmaps[0]["targets"][0]["expr"] and "tenant" in heatmaps[0]["targets"][0]["expr"]
    assert panels_of("timeseries", "sits_forecast_predicted_fraction")
    assert panels_of("timeseries", "sits_forecast_time_to_oom_seconds")
    assert panels_of("timeseries", "sits_actions_total") and panels_of("timeseries", "sits_verdicts_total")
    shed = panels_of("timeseries", "sits:shed_requests:rate1m")
    assert shed and "by (priority)" in shed[0]["targets"][0]["expr"]
    annotations = {a["name"]: a for a in dashboard["annotations"]["list"]}
    assert "sits_actions_total" in annotations["Actions"]["expr"]
    assert "sits_verdicts_total" in annotations["Verdicts"]["expr"]


def test_every_metric_the_dashboard_and_rules_use_is_in_the_contract(dashboard: dict[str, Any]) -> None:
    known = contract_names() | recorded_names()
    used = set().union(*(metric_names(e) for e in exprs(dashboard)))
    rules = yaml.safe_load(RULES.read_text())["groups"]
    for group in rules:
        for rule in group["rules"]:
            used |= metric_names(rule["expr"])
    assert used, "no metric names found: the pattern is broken"
    assert sorted(used - known) == []
    assert metric_names("rate(sits_nope_seconds_bucket[1m])") == {"sits_nope_seconds"}


def test_the_contract_lists_the_shared_runtime_metrics() -> None:
    shared = {
        family.name + ("_total" if family.type == "counter" else "")
        for value in vars(runtime_metrics).values()
        if isinstance(value, MetricWrapperBase)
        for family in value.describe()
    }
    assert {"sits_events_in_total", "sits_consumer_lag", "sits_handler_seconds"} <= shared
    assert sorted(shared - contract_names()) == []
