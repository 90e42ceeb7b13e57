"""MIG layouts, their validation, and a planner that changes only what it must.

Pure domain code: no NVML, no I/O. NVIDIA's mig-parted clears a GPU and recreates the whole layout,
which cannot run under load; this planner keeps every instance whose tenant still fits where it is and
drains, destroys and creates only the instances that must change.

Rules a layout must follow (see profiles.py for where they come from):
- every instance starts at one of its profile's valid start slots;
- instances' memory slices never overlap (NVML refuses an overlapping GPU instance);
- a profile never has more instances than its maximum (e.g. one +me, two 3g);
- the compute slices in use never exceed the GPU's (7).
The slice counts adding up is not enough: 2g.35gb at slot 1 fits the totals but is not a placement.

Planning semantics:
- `needs` maps tenant -> bytes of GPU memory it needs (the decision service's forecast). A tenant
  fits an instance when need <= the profile's memory. A need of 0 releases the tenant's instance.
- Tenants in the current layout but absent from `needs` are left where they are, unless
  `move_unlisted` allows the planner to relocate them (same profile) to make room.
- Idle instances (no tenant) may be adopted by a tenant they fit, or destroyed to make room.
- A tenant that needs a new instance gets the smallest profile that holds its memory (fewest memory
  slices, then fewest compute slices); when it already has an instance that fits but must move, it
  keeps that profile.
- Among all valid targets the planner picks the one that drains the fewest tenants, then makes the
  fewest NVML changes, then uses the fewest slices. Steps are ordered drain -> destroy -> create ->
  assign, so nothing is destroyed while traffic still reaches it and nothing is created on slices that
  are still occupied.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from services.executor.mig.profiles import MIB, GpuModel, MigProfile, gpu_model

StepAction = Literal["drain", "destroy", "create", "assign"]


@dataclass(frozen=True)
class MigInstance:
    """One GPU instance: its profile, first memory slice, the tenant it serves, its NVML id if known."""

    profile: str
    start: int
    tenant: str | None = None
    gi_id: int | None = None

    def label(self) -> str:
        owner = self.tenant if self.tenant is not None else "idle"
        return f"{self.profile}@{self.start}:{owner}"

    def to_json(self, model: GpuModel | None = None) -> dict[str, Any]:
        row: dict[str, Any] = {"profile": self.profile, "start": self.start, "tenant": self.tenant}
        if model is not None and model.has_profile(self.profile):
            row["size"] = model.profile(self.profile).memory_slices
        if self.gi_id is not None:
            row["gi_id"] = self.gi_id
        return row

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> MigInstance:
        tenant = row.get("tenant")
        gi_id = row.get("gi_id")
        return cls(
            profile=str(row["profile"]),
            start=int(row["start"]),
            tenant=None if tenant in (None, "") else str(tenant),
            gi_id=None if gi_id is None else int(gi_id),
        )


@dataclass(frozen=True)
class MigLayout:
    """The GPU instances of one GPU."""

    gpu: str
    instances: tuple[MigInstance, ...] = ()

    @property
    def model(self) -> GpuModel:
        return gpu_model(self.gpu)

    def sorted(self) -> MigLayout:
        return replace(self, instances=tuple(sorted(self.instances, key=lambda i: (i.start, i.profile))))

    def tenant_instance(self, tenant: str) -> MigInstance | None:
        for instance in self.instances:
            if instance.tenant == tenant:
                return instance
        return None

    def to_json(self) -> dict[str, Any]:
        model = self.model
        return {"gpu": self.gpu, "instances": [i.to_json(model) for i in self.sorted().instances]}

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MigLayout:
        return cls(
            gpu=str(data["gpu"]), instances=tuple(MigInstance.from_json(row) for row in data.get("instances", ()))
        )


@dataclass(frozen=True)
class PlanStep:
    action: StepAction
    instance: MigInstance
    reason: str

    def to_json(self, model: GpuModel | None = None) -> dict[str, Any]:
        return {"action": self.action, **self.instance.to_json(model), "reason": self.reason}


@dataclass(frozen=True)
class MigPlan:
    current: MigLayout
    target: MigLayout
    steps: tuple[PlanStep, ...]
    kept: tuple[MigInstance, ...]

    @property
    def changes(self) -> bool:
        return bool(self.steps)

    def drained_tenants(self) -> tuple[str, ...]:
        return tuple(s.instance.tenant for s in self.steps if s.action == "drain" and s.instance.tenant)

    def to_json(self) -> dict[str, Any]:
        model = self.current.model
        return {
            "ok": True,
            "gpu": self.current.gpu,
            "current": self.current.to_json(),
            "target": self.target.to_json(),
            "kept": [i.to_json(model) for i in self.kept],
            "steps": [s.to_json(model) for s in self.steps],
        }


@dataclass(frozen=True)
class MigRefusal:
    """Why no layout can satisfy the request; every reason is a sentence an operator can act on."""

    gpu: str
    reasons: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"ok": False, "gpu": self.gpu, "reasons": list(self.reasons)}


def validate_layout(layout: MigLayout) -> list[str]:
    """Every placement rule the layout breaks, as sentences; empty when the layout is valid."""
    try:
        model = layout.model
    except KeyError as exc:
        return [str(exc.args[0])]
    problems: list[str] = []
    owner_of_slice: dict[int, MigInstance] = {}
    compute_used = 0
    per_profile: Counter[str] = Counter()
    tenants: Counter[str] = Counter()
    for instance in layout.instances:
        if not model.has_profile(instance.profile):
            problems.append(f"{instance.label()}: {model.key} has no profile {instance.profile!r}")
            continue
        profile = model.profile(instance.profile)
        per_profile[profile.name] += 1
        compute_used += profile.compute_slices
        if instance.tenant is not None:
            tenants[instance.tenant] += 1
        if instance.start not in profile.starts:
            problems.append(
                f"{instance.label()}: {profile.name} may start only at memory slice "
                f"{_slots(profile.starts)}, not {instance.start}"
            )
            continue
        for memory_slice in profile.slices_at(instance.start):
            other = owner_of_slice.get(memory_slice)
            if other is not None:
                problems.append(f"{instance.label()} overlaps {other.label()} on memory slice {memory_slice}")
                break
            owner_of_slice[memory_slice] = instance
    for name, count in sorted(per_profile.items()):
        limit = model.profile(name).max_instances
        if count > limit:
            problems.append(f"{count} instances of {name}; {model.key} allows at most {limit}")
    if compute_used > model.compute_slices:
        problems.append(f"{compute_used} compute slices in use; {model.key} has {model.compute_slices}")
    for tenant, count in sorted(tenants.items()):
        if count > 1:
            problems.append(f"tenant {tenant!r} owns {count} instances; a tenant owns at most one")
    return problems


def _slots(starts: Iterable[int]) -> str:
    return "{" + ",".join(str(s) for s in starts) + "}"


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / (1 << 30):.2f} GiB"


def smallest_fitting_profile(model: GpuModel, need_bytes: int) -> MigProfile | None:
    """The profile a new instance for this need gets: fewest memory slices, then fewest compute slices.

    Media-extension profiles are left for explicit requests: there is one per GPU.
    """
    fitting = [p for p in model.profiles if p.memory_bytes >= need_bytes and not p.media_extensions]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.memory_slices, p.compute_slices, p.memory_mib))


# ------------------------------------------------------------------ search


@dataclass(frozen=True)
class _Option:
    """One way to serve one tenant in the target layout."""

    profile: MigProfile
    start: int
    kind: Literal["keep", "adopt", "create"]
    adopted: MigInstance | None = None  # the idle instance taken over, for kind == "adopt"

    @property
    def mask(self) -> int:
        return sum(1 << s for s in self.profile.slices_at(self.start))


@dataclass
class _Tenant:
    name: str
    need: int | None  # None: unlisted, keeps its profile
    current: MigInstance | None
    options: list[_Option] = field(default_factory=list)


@dataclass
class _Best:
    cost: tuple[int, int, int, int, int] | None = None
    choice: dict[str, _Option] | None = None
    destroyed_idle: tuple[MigInstance, ...] = ()


def plan_rebalance(
    current: MigLayout, needs: Mapping[str, int], *, move_unlisted: bool = False
) -> MigPlan | MigRefusal:
    """The smallest change that gives every tenant in `needs` an instance holding its memory."""
    try:
        model = current.model
    except KeyError as exc:
        return MigRefusal(current.gpu, (str(exc.args[0]),))
    problems = validate_layout(current)
    if problems:
        return MigRefusal(current.gpu, tuple(f"current layout is invalid: {p}" for p in problems))
    for tenant, need in needs.items():
        if need < 0:
            return MigRefusal(current.gpu, (f"tenant {tenant!r}: a memory need cannot be negative ({need})",))

    refusals = _impossible_needs(model, needs)
    if refusals:
        return MigRefusal(current.gpu, tuple(refusals))

    tenants, released, idle = _build_tenants(model, current, needs, move_unlisted)
    refusals = _slice_budget_refusals(model, tenants, idle)
    if refusals:
        return MigRefusal(current.gpu, tuple(refusals))

    best = _search(model, tenants, idle)
    if best.choice is None:
        return MigRefusal(current.gpu, tuple(_placement_refusal(model, tenants, move_unlisted)))
    return _assemble_plan(model, current, tenants, released, best)


def _impossible_needs(model: GpuModel, needs: Mapping[str, int]) -> list[str]:
    reasons = []
    largest = model.largest
    for tenant, need in sorted(needs.items()):
        if need > largest.memory_bytes:
            reasons.append(
                f"tenant {tenant!r} needs {_gib(need)}, more than any {model.key} profile gives "
                f"(largest: {largest.name} with {_gib(largest.memory_bytes)})"
            )
    return reasons


def _build_tenants(
    model: GpuModel, current: MigLayout, needs: Mapping[str, int], move_unlisted: bool
) -> tuple[list[_Tenant], list[MigInstance], list[MigInstance]]:
    idle = [i for i in current.instances if i.tenant is None]
    released = [i for i in current.instances if i.tenant is not None and needs.get(i.tenant) == 0]
    tenants: list[_Tenant] = []
    names = sorted({i.tenant for i in current.instances if i.tenant is not None} | set(needs))
    for name in names:
        need = needs.get(name)
        instance = current.tenant_instance(name)
        if need == 0:
            continue
        tenant = _Tenant(name=name, need=need, current=instance)
        if instance is not None:
            profile = model.profile(instance.profile)
            fits = need is None or need <= profile.memory_bytes
            if fits:
                tenant.options.append(_Option(profile, instance.start, "keep"))
            movable = need is not None or move_unlisted
            if movable:
                candidates: list[MigProfile] = []
                if fits:
                    candidates.append(profile)  # moving keeps the profile the tenant runs on
                if need is not None:
                    smallest = smallest_fitting_profile(model, need)
                    if smallest is not None and smallest not in candidates:
                        candidates.append(smallest)
                tenant.options.extend(_new_options(candidates, exclude=instance))
        else:
            assert need is not None
            smallest = smallest_fitting_profile(model, need)
            tenant.options.extend(_new_options([smallest] if smallest else [], exclude=None))
        tenants.append(tenant)
    return tenants, released, idle


def _new_options(candidates: list[MigProfile], exclude: MigInstance | None) -> list[_Option]:
    options: list[_Option] = []
    for profile in candidates:
        for start in profile.starts:
            if exclude is not None and exclude.profile == profile.name and exclude.start == start:
                continue
            options.append(_Option(profile, start, "create"))
    return options


def _slice_budget_refusals(model: GpuModel, tenants: list[_Tenant], idle: list[MigInstance]) -> list[str]:
    """Totals that no placement can meet: too many instances, memory or compute slices."""
    del idle  # idle instances can always be destroyed, so they never make a request impossible
    least_memory = 0
    least_compute = 0
    parts = []
    for tenant in tenants:
        if not tenant.options:
            continue
        cheapest = min(tenant.options, key=lambda o: (o.profile.memory_slices, o.profile.compute_slices))
        least_memory += cheapest.profile.memory_slices
        least_compute += cheapest.profile.compute_slices
        parts.append(f"{tenant.name} {cheapest.profile.name}")
    reasons = []
    if len(tenants) > model.compute_slices:
        reasons.append(
            f"too many instances: {len(tenants)} tenants need one each; "
            f"{model.key} holds at most {model.compute_slices}"
        )
    if least_memory > model.memory_slices:
        reasons.append(
            f"too many slices: the tenants need at least {least_memory} of {model.memory_slices} "
            f"memory slices ({', '.join(parts)})"
        )
    if least_compute > model.compute_slices:
        reasons.append(
            f"too many slices: the tenants need at least {least_compute} of "
            f"{model.compute_slices} compute slices ({', '.join(parts)})"
        )
    return reasons


def _instance_mask(model: GpuModel, instance: MigInstance) -> int:
    profile = model.profile(instance.profile)
    return sum(1 << s for s in profile.slices_at(instance.start))


_Cost = tuple[int, int, int, int, int]


def _option_cost(option: _Option, tenant: _Tenant) -> _Cost:
    """What choosing this option adds: (tenants drained, NVML changes, profile changes, memory and
    compute slices of new instances). Every part only grows, so partial sums bound the search."""
    moved = tenant.current is not None and option.kind != "keep"
    changed_profile = moved and tenant.current is not None and option.profile.name != tenant.current.profile
    created = option.kind == "create"
    return (
        int(moved),
        int(moved) + int(created),
        int(changed_profile),
        option.profile.memory_slices if created else 0,
        option.profile.compute_slices if created else 0,
    )


def _add(a: _Cost, b: _Cost) -> _Cost:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4])


def _search(model: GpuModel, tenants: list[_Tenant], idle: list[MigInstance]) -> _Best:
    """Branch and bound over each tenant's options; the grid is 8 slices, so the tree stays small.

    Among targets of equal cost the first found wins; the option and tenant orders are fixed, so the
    result is deterministic.
    """
    # Adopting an idle instance that fits costs no NVML call, so each one is offered.
    for tenant in tenants:
        if tenant.need is None:
            continue
        for instance in idle:
            profile = model.profile(instance.profile)
            if profile.memory_bytes >= tenant.need:
                tenant.options.append(_Option(profile, instance.start, "adopt", adopted=instance))
    for tenant in tenants:
        tenant.options.sort(key=lambda o, t=tenant: (_option_cost(o, t), o.start))  # type: ignore[misc]
    # Most constrained first: fewer options and bigger instances prune the tree sooner.
    order = sorted(
        tenants, key=lambda t: (len(t.options), -max((o.profile.memory_slices for o in t.options), default=0), t.name)
    )
    # rest_bound[i]: the least the tenants order[i:] can add, part by part.
    rest_bound: list[_Cost] = [(0, 0, 0, 0, 0)] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        costs = [_option_cost(o, order[i]) for o in order[i].options] or [(0, 0, 0, 0, 0)]
        least = tuple(min(c[k] for c in costs) for k in range(5))
        rest_bound[i] = _add(rest_bound[i + 1], least)  # type: ignore[arg-type]

    best = _Best()
    chosen: dict[str, _Option] = {}
    idle_masks = [(_instance_mask(model, i), i) for i in idle]

    def leaf(partial: _Cost) -> None:
        used = 0
        adopted = {id(o.adopted) for o in chosen.values() if o.adopted is not None}
        for option in chosen.values():
            used |= option.mask
        destroyed_idle: list[MigInstance] = []
        kept_idle: list[MigInstance] = []
        for mask, instance in idle_masks:
            if id(instance) in adopted:
                continue
            (destroyed_idle if mask & used else kept_idle).append(instance)
        target = [MigInstance(o.profile.name, o.start, name) for name, o in chosen.items()] + kept_idle
        if validate_layout(MigLayout(model.key, tuple(target))):
            return
        cost = (partial[0], partial[1] + len(destroyed_idle), *partial[2:])
        if best.cost is None or cost < best.cost:
            best.cost = cost
            best.choice = dict(chosen)
            best.destroyed_idle = tuple(destroyed_idle)

    def descend(index: int, used: int, partial: _Cost, adopted: frozenset[int]) -> None:
        if best.cost is not None and _add(partial, rest_bound[index]) >= best.cost:
            return
        if index == len(order):
            leaf(partial)
            return
        tenant = order[index]
        for option in tenant.options:
            if option.mask & used:
                continue
            if option.adopted is not None and id(option.adopted) in adopted:
                continue
            chosen[tenant.name] = option
            taken = adopted | {id(option.adopted)} if option.adopted is not None else adopted
            descend(index + 1, used | option.mask, _add(partial, _option_cost(option, tenant)), taken)
            del chosen[tenant.name]

    descend(0, 0, (0, 0, 0, 0, 0), frozenset())
    return best


def _placement_refusal(model: GpuModel, tenants: list[_Tenant], move_unlisted: bool) -> list[str]:
    pinned = [t.current for t in tenants if t.need is None and t.current is not None and not move_unlisted]
    wanted = []
    for tenant in tenants:
        if tenant.need is None:
            continue
        created = sorted({o.profile.name for o in tenant.options if o.kind == "create"})
        for name in created:
            wanted.append(f"{tenant.name} on {name} (starts {_slots(model.profile(name).starts)})")
    reason = "no valid placement: no combination of valid start slots fits " + "; ".join(wanted)
    if pinned:
        reason += (
            " around the instances of tenants not in the request, which stay where they are: "
            + ", ".join(i.label() for i in pinned if i is not None)
            + " (allow moving them to search further)"
        )
    return [reason]


def _assemble_plan(
    model: GpuModel, current: MigLayout, tenants: list[_Tenant], released: list[MigInstance], best: _Best
) -> MigPlan:
    assert best.choice is not None
    drains: list[PlanStep] = []
    destroys: list[PlanStep] = []
    creates: list[PlanStep] = []
    assigns: list[PlanStep] = []
    kept: list[MigInstance] = []
    target: list[MigInstance] = []

    for instance in released:
        drains.append(PlanStep("drain", instance, f"tenant {instance.tenant} released its instance"))
        destroys.append(PlanStep("destroy", instance, f"tenant {instance.tenant} released its instance"))
    for tenant in tenants:
        option = best.choice[tenant.name]
        old = tenant.current
        need_text = _gib(tenant.need) if tenant.need is not None else "its current size"
        if option.kind == "keep":
            assert old is not None
            kept.append(old)
            target.append(old)
            continue
        if old is not None:
            old_profile = model.profile(old.profile)
            if tenant.need is not None and tenant.need > old_profile.memory_bytes:
                why = f"needs {need_text}; {old.profile} gives {_gib(old_profile.memory_bytes)}"
            else:
                why = "moves to make room for other tenants"
            drains.append(PlanStep("drain", old, f"tenant {tenant.name} {why}"))
            destroys.append(PlanStep("destroy", old, f"tenant {tenant.name} {why}"))
        if option.kind == "adopt":
            assert option.adopted is not None
            new = replace(option.adopted, tenant=tenant.name)
            assigns.append(
                PlanStep("assign", new, f"idle {option.adopted.label()} holds {need_text} for {tenant.name}")
            )
        else:
            new = MigInstance(option.profile.name, option.start, tenant.name)
            creates.append(
                PlanStep(
                    "create",
                    new,
                    f"{option.profile.name} ({_gib(option.profile.memory_bytes)}) holds {need_text} for {tenant.name}",
                )
            )
        target.append(new)
    destroyed_idle = {id(i) for i in best.destroyed_idle}
    adopted = {id(o.adopted) for o in best.choice.values() if o.adopted is not None}
    for instance in current.instances:
        if instance.tenant is not None:
            continue
        if id(instance) in destroyed_idle:
            destroys.append(PlanStep("destroy", instance, "idle instance frees its slices"))
        elif id(instance) not in adopted:
            kept.append(instance)
            target.append(instance)

    by_start = lambda s: (s.instance.start, s.instance.profile)  # noqa: E731
    steps = (
        sorted(drains, key=by_start)
        + sorted(destroys, key=by_start)
        + sorted(creates, key=by_start)
        + sorted(assigns, key=by_start)
    )
    return MigPlan(
        current=current,
        target=MigLayout(current.gpu, tuple(target)).sorted(),
        steps=tuple(steps),
        kept=tuple(sorted(kept, key=lambda i: (i.start, i.profile))),
    )


def plan_to_layout(current: MigLayout, target: MigLayout) -> MigPlan | MigRefusal:
    """The steps from `current` to a given layout (rollback to a recorded `before` layout).

    Instances already in place with the same tenant are kept; an instance whose place survives but
    whose tenant differs is drained and relabelled; the rest is drained, destroyed and created.
    """
    if target.gpu != current.gpu:
        return MigRefusal(current.gpu, (f"the layout to restore is for {target.gpu}, this GPU is {current.gpu}",))
    problems = validate_layout(target)
    if problems:
        return MigRefusal(current.gpu, tuple(f"layout to restore is invalid: {p}" for p in problems))
    wanted = {(i.profile, i.start): i for i in target.instances}
    present = {(i.profile, i.start): i for i in current.instances}
    drains, destroys, creates, assigns, kept = [], [], [], [], []
    for place, instance in sorted(present.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        goal = wanted.get(place)
        if goal is None:
            if instance.tenant is not None:
                drains.append(PlanStep("drain", instance, "not in the layout being restored"))
            destroys.append(PlanStep("destroy", instance, "not in the layout being restored"))
        elif goal.tenant != instance.tenant:
            if instance.tenant is not None:
                drains.append(PlanStep("drain", instance, f"goes back to {goal.tenant or 'idle'}"))
            assigns.append(PlanStep("assign", replace(instance, tenant=goal.tenant), "restored owner"))
        else:
            kept.append(instance)
    for place, goal in sorted(wanted.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if place not in present:
            creates.append(PlanStep("create", replace(goal, gi_id=None), "in the layout being restored"))
    target_instances = [*kept, *(s.instance for s in assigns), *(s.instance for s in creates)]
    return MigPlan(
        current=current,
        target=MigLayout(current.gpu, tuple(target_instances)).sorted(),
        steps=(*drains, *destroys, *creates, *assigns),
        kept=tuple(kept),
    )


def plan_to_json(result: MigPlan | MigRefusal) -> dict[str, Any]:
    return result.to_json()


def layout_after_steps(current: MigLayout, steps: Iterable[PlanStep]) -> MigLayout:
    """Replay steps on a layout (destroy removes, create adds, assign relabels): the check that a
    plan's steps really lead to its target, and that every intermediate layout is valid."""
    instances = list(current.instances)
    for step in steps:
        inst = step.instance
        same_place = [i for i in instances if i.profile == inst.profile and i.start == inst.start]
        if step.action == "destroy":
            if not same_place:
                raise ValueError(f"destroy of {inst.label()}: no such instance")
            instances.remove(same_place[0])
        elif step.action == "create":
            instances.append(inst)
            problems = validate_layout(MigLayout(current.gpu, tuple(instances)))
            if problems:
                raise ValueError(f"create of {inst.label()} breaks the layout: {'; '.join(problems)}")
        elif step.action == "assign":
            if not same_place:
                raise ValueError(f"assign of {inst.label()}: no such instance")
            instances[instances.index(same_place[0])] = replace(same_place[0], tenant=inst.tenant)
    return MigLayout(current.gpu, tuple(instances)).sorted()


def parse_size(text: str) -> int:
    """Bytes from '60GiB', '512MiB', '20GB', '1.5TiB' or a plain integer."""
    units = {
        "": 1,
        "b": 1,
        "kib": 1 << 10,
        "mib": MIB,
        "gib": 1 << 30,
        "tib": 1 << 40,
        "k": 1 << 10,
        "m": MIB,
        "g": 1 << 30,
        "t": 1 << 40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
    }
    raw = text.strip().replace("_", "")
    number_end = len(raw)
    while number_end > 0 and not (raw[number_end - 1].isdigit() or raw[number_end - 1] == "."):
        number_end -= 1
    number, unit = raw[:number_end], raw[number_end:].strip().lower()
    if not number or unit not in units:
        raise ValueError(f"not a size: {text!r} (use e.g. 60GiB, 512MiB, 20GB or bytes)")
    value = float(number) * units[unit]
    if value < 0:
        raise ValueError(f"not a size: {text!r}")
    return int(value)


def parse_layout_spec(gpu: str, spec: str) -> MigLayout:
    """A layout from 'PROFILE@START[:TENANT],...', e.g. '3g.71gb@0:tenantA,1g.18gb@4'."""
    instances = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        placement, _, tenant = part.partition(":")
        profile, at, start = placement.partition("@")
        if not at or not start.strip().isdigit():
            raise ValueError(f"not an instance: {part!r} (use PROFILE@START[:TENANT], e.g. 3g.71gb@0:tenantA)")
        instances.append(MigInstance(profile.strip(), int(start), tenant.strip() or None))
    return MigLayout(gpu_model(gpu).key, tuple(instances))
