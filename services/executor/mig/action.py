"""The executor's MigRebalance action: plan, drain, apply, and report the layout before and after.

The executor maps a HealingCommand with MigRebalanceParams onto `rebalance(...)` and records
`before_json` / `after_json` in ActionState.mig_layout_json. A refusal (impossible request, MIG mode
off, apply not enabled) raises MigRebalanceRefused, which the executor reports as
ACTION_STATUS_REFUSED with the reasons as detail; a failure part-way raises MigApplyFailed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from services.executor.mig.nvml_applier import APPLY_SETTING, MigApplier, MigApplyRefused
from services.executor.mig.planner import (
    MigInstance,
    MigLayout,
    MigPlan,
    MigRefusal,
    plan_rebalance,
    plan_to_layout,
)

Drainer = Callable[[MigInstance], None]


class MigRebalanceRefused(Exception):
    def __init__(self, reasons: tuple[str, ...] | list[str], before_json: str) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = tuple(reasons)
        self.before_json = before_json


def rebalance(
    current_layout: MigLayout,
    tenant_bytes: Mapping[str, int],
    applier: MigApplier,
    dry_run: bool,
    *,
    drain: Drainer | None = None,
    move_unlisted: bool = False,
) -> tuple[str, str, list[dict[str, Any]]]:
    """Plan the smallest change for `tenant_bytes`; apply it unless `dry_run`.

    Returns (before_json, after_json, steps): the layouts as compact JSON text and one JSON-ready dict
    per step with its `outcome` ("planned" in a dry run, else "done"). In a dry run nothing changes,
    so after_json equals before_json. `drain` is called for each instance the plan drains, before
    anything is destroyed; it returns once traffic to that instance has stopped.
    """
    result = plan_rebalance(current_layout, tenant_bytes, move_unlisted=move_unlisted)
    return _carry_out(current_layout, result, applier, dry_run, drain)


def restore(
    current_layout: MigLayout, before_json: str, applier: MigApplier, dry_run: bool, *, drain: Drainer | None = None
) -> tuple[str, str, list[dict[str, Any]]]:
    """Roll a MigRebalance back: return to the layout recorded in ActionState.mig_layout_json."""
    target = MigLayout.from_json(json.loads(before_json))
    return _carry_out(current_layout, plan_to_layout(current_layout, target), applier, dry_run, drain)


def _carry_out(
    current_layout: MigLayout, result: MigPlan | MigRefusal, applier: MigApplier, dry_run: bool, drain: Drainer | None
) -> tuple[str, str, list[dict[str, Any]]]:
    before_json = current_layout.to_json_text()
    model = current_layout.model
    if isinstance(result, MigRefusal):
        raise MigRebalanceRefused(result.reasons, before_json)
    plan = result

    if dry_run or not plan.steps:
        steps = [{**s.to_json(model), "outcome": "planned"} for s in plan.steps]
        return before_json, before_json, steps
    if not applier.applies:
        raise MigRebalanceRefused(
            (f"the command asks to apply a MIG change but {APPLY_SETTING} is off on this executor",), before_json
        )

    drains = [s for s in plan.steps if s.action == "drain"]
    if drains and drain is None:
        raise MigRebalanceRefused(("the plan drains instances but the executor gave no drainer",), before_json)
    try:
        applier.preflight(plan)  # refuse before draining anyone for nothing
    except MigApplyRefused as exc:
        raise MigRebalanceRefused((str(exc),), before_json) from exc
    drained: list[str] = []
    for step in drains:
        assert drain is not None
        drain(step.instance)
        if step.instance.tenant is not None:
            drained.append(step.instance.tenant)
    try:
        report = applier.execute(plan, drained_tenants=drained)
    except MigApplyRefused as exc:
        raise MigRebalanceRefused((str(exc),), before_json) from exc
    after = report.layout_after if report.layout_after is not None else plan.target
    return before_json, after.to_json_text(), [s.to_json(model) for s in report.steps]
