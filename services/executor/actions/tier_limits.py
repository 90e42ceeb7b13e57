"""Who gets into the engine: the priority breakers (SHED_PRIORITY) and the controller's budget (SET_TIER_BUDGET).

Both end up as Envoy circuit-breaker limits on the per-tier clusters; a tier is
held to the tighter of the two (`domain.envoy_limits`), pushed by the executor's
`push_tier_limits`. The breaker board opens, half-opens and closes by TTL; the
budget holds under a lease that each controller tick renews.
"""

from __future__ import annotations

from typing import ClassVar

from services.executor import domain
from services.executor.actions.base import Action, ActionContext, EngineTarget, Renewal, abort_streams
from services.executor.adapters.engine import EngineUnavailable
from sits.runtime.contract import ActionKind, Tier
from sits.v1 import events_pb2


class ShedAction(Action):
    kinds: ClassVar[tuple[int, ...]] = (ActionKind.SHED_PRIORITY,)

    async def record(self, ctx: ActionContext, target: EngineTarget) -> events_pb2.ActionState:
        board = await ctx.state.breakers(target.name)
        return events_pb2.ActionState(breakers=board.to_proto(ctx.clock.now(), ctx.policy))

    async def apply(
        self,
        ctx: ActionContext,
        target: EngineTarget,
        command: events_pb2.HealingCommand,
        before: events_pb2.ActionState,
    ) -> str:
        now = ctx.clock.now()
        board = domain.apply_breaker_setting(await ctx.state.breakers(target.name), command.breaker, now, ctx.policy)
        await ctx.state.save_breakers(target.name, board, _expiries(board, ctx.policy), now, command.command_id)
        await ctx.push_tier_limits(target)
        return ""

    async def restore(
        self, ctx: ActionContext, target: EngineTarget, before: events_pb2.ActionState, after: events_pb2.ActionState
    ) -> domain.Restore:
        now = ctx.clock.now()
        current = await ctx.state.breakers(target.name)
        board, restore = domain.restore_breakers(current, before.breakers, after.breakers, now, ctx.policy)
        if restore.restored:
            await ctx.state.save_breakers(target.name, board, _expiries(board, ctx.policy), now, "")
            await ctx.push_tier_limits(target)
        return restore


def _expiries(board: domain.BreakerBoard, policy: domain.BreakerPolicy) -> dict[Tier, float | None]:
    return {t: board.get(t, policy).expires_at(policy) for t in Tier}


class TierBudgetAction(Action):
    kinds: ClassVar[tuple[int, ...]] = (ActionKind.SET_TIER_BUDGET,)

    async def record(self, ctx: ActionContext, target: EngineTarget) -> events_pb2.ActionState:
        return budget_state(await ctx.state.budget(target.name), ctx.clock.now())

    async def apply(
        self,
        ctx: ActionContext,
        target: EngineTarget,
        command: events_pb2.HealingCommand,
        before: events_pb2.ActionState,
    ) -> str:
        now = ctx.clock.now()
        wanted = domain.budget_limits(command.tier_budget)
        current = await ctx.state.budget(target.name)
        in_force = dict(current.limits) if current is not None and current.active(now) else {}
        if not wanted:
            await ctx.state.save_budget(target.name, None)
            await ctx.push_tier_limits(target)
            return "tier budget released: Envoy's defaults"
        lease = command.tier_budget.lease_seconds
        record = domain.TierBudgetRecord(wanted, now + lease, command.command_id, lease)
        await ctx.state.save_budget(target.name, record)
        if wanted == in_force:
            raise Renewal(f"tier budget held for {lease:g} s more")
        await ctx.push_tier_limits(target)
        detail = "; ".join(domain.state_diff(before, budget_state(record, now))) + f" (lease {lease:g} s)"
        if command.tier_budget.drain_backlog:
            try:
                drained = await _drain(target, wanted)
            except EngineUnavailable as error:
                # The budget holds at Envoy either way; only the backlog already in the engine stays.
                return f"{detail}; the backlog was not drained ({error})"
            if drained:
                detail += f"; aborted {len(drained)} waiting beyond it: {', '.join(drained)}"
        return detail

    async def restore(
        self, ctx: ActionContext, target: EngineTarget, before: events_pb2.ActionState, after: events_pb2.ActionState
    ) -> domain.Restore:
        now = ctx.clock.now()
        current = await ctx.state.budget(target.name)
        limits, restore = domain.restore_budget(current, before, after, now)
        if restore.restored:
            lease = current.lease_s if current is not None else 0.0
            record = domain.TierBudgetRecord(limits, now + lease, "", lease) if limits else None
            await ctx.state.save_budget(target.name, record)
            await ctx.push_tier_limits(target)
        return restore


def budget_state(record: domain.TierBudgetRecord | None, now: float) -> events_pb2.ActionState:
    state = events_pb2.ActionState()
    if record is not None and record.active(now):
        state.budget.extend(record.to_proto())
        state.lease_expires_at.FromNanoseconds(int(record.until * 1e9))
    return state


async def _drain(target: EngineTarget, limits: dict[Tier, int]) -> list[str]:
    """Abort requests of the limited tiers that wait in the engine beyond their new limit, newest first.

    Only waiting ones: a running stream has had its prefill and costs less to finish than to redo.
    """
    in_flight = await target.control.in_flight()
    victims: list[str] = []
    for tier, limit in limits.items():
        mine = [r for r in in_flight if r.tier == int(tier)]
        excess = len(mine) - limit
        waiting = sorted((r for r in mine if not r.running), key=lambda r: r.arrival_time, reverse=True)
        victims += [r.request_id for r in waiting[: max(0, excess)]]
    await abort_streams(target, victims)
    return victims
