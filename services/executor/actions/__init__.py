"""The executor's actions, one module per kind or family: validate, record before, apply, restore."""

from __future__ import annotations

from services.executor.actions.base import Action
from services.executor.actions.effects import AbortAction, FlushAction
from services.executor.actions.engine_limits import EngineLimitsAction
from services.executor.actions.pressure_mig import MigAction, PressureAction
from services.executor.actions.tier_limits import ShedAction, TierBudgetAction

ACTIONS: dict[int, Action] = {
    kind: action
    for action in (
        EngineLimitsAction(),
        ShedAction(),
        TierBudgetAction(),
        PressureAction(),
        FlushAction(),
        AbortAction(),
        MigAction(),
    )
    for kind in action.kinds
}
