"""The planner: placement validation, minimal change, step order, refusals that explain themselves."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.executor.mig.planner import (
    MigInstance,
    MigLayout,
    MigPlan,
    MigRefusal,
    layout_after_steps,
    parse_layout_spec,
    parse_size,
    plan_rebalance,
    smallest_fitting_profile,
    validate_layout,
)
from services.executor.mig.profiles import GPU_MODELS, gpu_model

GIB = 1 << 30
H200 = "h200-141gb"


def layout(spec: str, gpu: str = H200) -> MigLayout:
    return parse_layout_spec(gpu, spec)


def plan(spec: str, needs: dict[str, int], **kwargs: bool) -> MigPlan:
    result = plan_rebalance(layout(spec), needs, **kwargs)
    assert isinstance(result, MigPlan), result
    return result


def refusal(spec: str, needs: dict[str, int], **kwargs: bool) -> MigRefusal:
    result = plan_rebalance(layout(spec), needs, **kwargs)
    assert isinstance(result, MigRefusal), result
    return result


def actions(result: MigPlan) -> list[str]:
    return [f"{s.action} {s.instance.label()}" for s in result.steps]


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        # Slice counts add up (2+2+2+1 compute, 8 memory) but 2g.35gb may not start at slice 1.
        ("2g.35gb@1:a,2g.35gb@4:b,1g.18gb@0:c,1g.35gb@6:d", "may start only at memory slice {0,2,4}, not 1"),
        ("3g.71gb@2:a", "may start only at memory slice {0,4}, not 2"),
        ("1g.18gb@7:a", "not 7"),
        ("4g.71gb@4:a", "may start only at memory slice {0}, not 4"),
        ("3g.71gb@0:a,1g.18gb@3:b", "overlaps 3g.71gb@0:a on memory slice 3"),
        ("1g.18gb+me@0:a,1g.18gb+me@1:b", "2 instances of 1g.18gb+me; h200-141gb allows at most 1"),
        ("2g.35gb@0:a,2g.35gb@2:b,2g.35gb@4:c,1g.18gb@6:d,1g.18gb+me@5:e", "overlaps"),
        ("1g.18gb@0:a,1g.18gb@1:a", "tenant 'a' owns 2 instances"),
        ("5g.99gb@0:a", "has no profile '5g.99gb'"),
    ],
)
def test_invalid_layouts_are_rejected_with_the_rule_they_break(spec: str, problem: str) -> None:
    problems = validate_layout(layout(spec))
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    "spec",
    [
        "7g.141gb@0:a",
        "4g.71gb@0:a,3g.71gb@4:b",
        "3g.71gb@0:a,3g.71gb@4:b",
        "2g.35gb@0:a,2g.35gb@2:b,2g.35gb@4:c,1g.18gb@6:d",
        "3g.71gb@4:a,2g.35gb@0:b,1g.18gb@2:c,1g.18gb@3:d",
        ",".join(f"1g.18gb@{s}:t{s}" for s in range(7)),
        "1g.35gb@0:a,1g.35gb@2:b,1g.35gb@4:c,1g.35gb@6:d",
        "",
    ],
)
def test_valid_layouts_pass(spec: str) -> None:
    assert validate_layout(layout(spec)) == []


def test_placement_rules_hold_even_when_slice_counts_fit() -> None:
    # 3g + 2g + 1g + 1g = 7 compute and 8 memory slices, yet with the 3g at slot 0 the second 1g
    # would need slot 7, which no 1g profile has.
    assert validate_layout(layout("3g.71gb@0:a,2g.35gb@4:b,1g.18gb@6:c,1g.18gb@7:d"))
    assert validate_layout(layout("3g.71gb@4:a,2g.35gb@0:b,1g.18gb@2:c,1g.18gb@3:d")) == []


def test_refuses_to_plan_from_an_invalid_current_layout() -> None:
    result = refusal("2g.35gb@1:a", {"a": GIB})
    assert result.reasons[0].startswith("current layout is invalid")


# ------------------------------------------------------------------ minimal change


def test_nothing_changes_when_every_tenant_still_fits() -> None:
    result = plan("3g.71gb@0:a,1g.18gb@4:b,1g.18gb@5:c", {"a": 60 * GIB, "b": 10 * GIB, "c": 1 * GIB})
    assert result.steps == ()
    assert result.target == result.current.sorted()


def test_a_shrinking_tenant_is_left_alone() -> None:
    assert plan("7g.141gb@0:a", {"a": 1 * GIB}).steps == ()


def test_a_new_tenant_gets_free_slices_and_nobody_else_is_touched() -> None:
    result = plan("3g.71gb@0:a,1g.18gb@4:b,1g.18gb@5:c", {"d": 30 * GIB})
    assert actions(result) == ["create 1g.35gb@6:d"]
    assert {i.label() for i in result.kept} == {"3g.71gb@0:a", "1g.18gb@4:b", "1g.18gb@5:c"}


def test_a_growing_tenant_moves_alone_drain_destroy_create() -> None:
    result = plan("3g.71gb@0:a,1g.18gb@4:b,1g.18gb@5:c", {"a": 60 * GIB, "b": 20 * GIB, "c": 10 * GIB})
    assert actions(result) == ["drain 1g.18gb@4:b", "destroy 1g.18gb@4:b", "create 1g.35gb@6:b"]
    assert "needs 20.00 GiB; 1g.18gb gives 16.00 GiB" in result.steps[0].reason


def test_an_idle_instance_is_adopted_without_nvml_calls() -> None:
    result = plan("3g.71gb@4,1g.18gb@0:b", {"d": 60 * GIB})
    assert actions(result) == ["assign 3g.71gb@4:d"]


def test_an_idle_instance_in_the_way_is_destroyed_without_a_drain() -> None:
    result = plan("1g.18gb@4,1g.18gb@0:b", {"d": 60 * GIB})
    assert actions(result) == ["destroy 1g.18gb@4:idle", "create 3g.71gb@4:d"]


def test_a_released_tenant_is_drained_and_destroyed() -> None:
    result = plan("3g.71gb@0:a,1g.18gb@4:b", {"b": 0})
    assert actions(result) == ["drain 1g.18gb@4:b", "destroy 1g.18gb@4:b"]
    assert [i.label() for i in result.target.instances] == ["3g.71gb@0:a"]


def test_a_listed_tenant_is_moved_instead_of_an_unlisted_one() -> None:
    # d needs a 3g at slot 0 or 4; b (listed, tiny) is moved, c (unlisted) stays.
    result = plan("1g.18gb@0:b,1g.18gb@4:c", {"d": 60 * GIB, "b": 1 * GIB})
    assert actions(result) == ["drain 1g.18gb@0:b", "destroy 1g.18gb@0:b", "create 3g.71gb@0:d", "create 1g.18gb@5:b"]
    assert "moves to make room" in result.steps[0].reason


def test_growth_that_needs_a_neighbour_moved_moves_exactly_one() -> None:
    full = ",".join(f"1g.18gb@{s}:t{s}" for s in range(7))
    needs = {f"t{s}": 10 * GIB for s in range(6)} | {"t3": 20 * GIB}
    result = plan(full, needs, move_unlisted=True)
    drained = [s.instance.tenant for s in result.steps if s.action == "drain"]
    assert len(drained) == 2 and "t3" in drained
    assert len(result.kept) == 5


# ------------------------------------------------------------------ refusals


def test_refuses_memory_that_no_profile_gives() -> None:
    result = refusal("", {"big": 150 * GIB})
    assert result.reasons == (
        "tenant 'big' needs 150.00 GiB, more than any h200-141gb profile gives (largest: 7g.141gb with 140.00 GiB)",
    )


def test_refuses_too_many_slices() -> None:
    result = refusal("", {"a": 60 * GIB, "b": 60 * GIB, "c": 10 * GIB})
    assert any("too many slices" in r and "9 of 8 memory slices" in r for r in result.reasons)


def test_refuses_too_many_instances() -> None:
    result = refusal("", {f"t{i}": GIB for i in range(8)})
    assert any("too many instances: 8 tenants" in r for r in result.reasons)


def test_refuses_when_no_placement_fits_around_unlisted_tenants() -> None:
    result = refusal("1g.18gb@0:b,1g.18gb@4:c", {"d": 60 * GIB})
    (reason,) = result.reasons
    assert reason.startswith("no valid placement")
    assert "d on 3g.71gb (starts {0,4})" in reason
    assert "1g.18gb@0:b, 1g.18gb@4:c" in reason
    # The same request succeeds once the planner may move the unlisted tenants.
    assert isinstance(plan_rebalance(layout("1g.18gb@0:b,1g.18gb@4:c"), {"d": 60 * GIB}, move_unlisted=True), MigPlan)


def test_refuses_negative_needs() -> None:
    assert "cannot be negative" in refusal("", {"a": -1}).reasons[0]


# ------------------------------------------------------------------ parsing and JSON


def test_sizes_and_layout_specs_parse() -> None:
    assert parse_size("60GiB") == 60 * GIB
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("20GB") == 20 * 10**9
    assert parse_size("1.5GiB") == 3 * GIB // 2
    assert parse_size("123") == 123
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="not an instance"):
        parse_layout_spec(H200, "3g.71gb:tenantA")
    assert layout("3g.71gb@0:a, 1g.18gb@4").instances == (
        MigInstance("3g.71gb", 0, "a"),
        MigInstance("1g.18gb", 4, None),
    )


def test_layout_json_round_trips() -> None:
    original = MigLayout(H200, (MigInstance("3g.71gb", 4, "a", gi_id=2), MigInstance("1g.18gb", 0, None)))
    data = original.to_json()
    assert data["instances"][0] == {"profile": "1g.18gb", "start": 0, "size": 1, "tenant": None}
    assert MigLayout.from_json(data) == original.sorted()


# ------------------------------------------------------------------ properties

SIZES_GIB = [0.5, 1, 10, 16, 17, 20, 30, 33, 40, 60, 70, 71, 100, 140, 150]


@st.composite
def layouts_and_needs(draw: st.DrawFn) -> tuple[MigLayout, dict[str, int]]:
    gpu = draw(st.sampled_from(sorted(GPU_MODELS)))
    model = gpu_model(gpu)
    instances: list[MigInstance] = []
    for n in range(draw(st.integers(0, 10))):
        profile = draw(st.sampled_from(model.profiles))
        start = draw(st.sampled_from(profile.starts))
        tenant = draw(st.one_of(st.none(), st.just(f"t{n}")))
        candidate = MigLayout(gpu, (*instances, MigInstance(profile.name, start, tenant)))
        if not validate_layout(candidate):
            instances = list(candidate.instances)
    current = MigLayout(gpu, tuple(instances))
    tenants = [i.tenant for i in instances if i.tenant is not None] + ["new1", "new2", "new3"]
    listed = draw(st.lists(st.sampled_from(tenants), unique=True, max_size=len(tenants)))
    scale = model.largest.memory_bytes / (140 * GIB)
    needs = {t: int(draw(st.sampled_from(SIZES_GIB)) * GIB * scale) for t in listed}
    release_first: bool = draw(st.booleans())
    if listed and release_first:
        needs[listed[0]] = 0
    return current, needs


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts_and_needs(), st.booleans())
def test_every_plan_is_valid_complete_and_minimal_where_it_can_be(
    case: tuple[MigLayout, dict[str, int]], move_unlisted: bool
) -> None:
    current, needs = case
    result = plan_rebalance(current, needs, move_unlisted=move_unlisted)
    if isinstance(result, MigRefusal):
        assert result.reasons and all(len(r) > 20 for r in result.reasons)
        return
    model = current.model
    assert validate_layout(result.target) == []
    # The steps really lead to the target, and every layout on the way is valid.
    assert layout_after_steps(current, result.steps) == result.target
    # Order: every drain before every destroy, before every create, before every assign.
    order = {"drain": 0, "destroy": 1, "create": 2, "assign": 3}
    ranks = [order[s.action] for s in result.steps]
    assert ranks == sorted(ranks)
    drained = {s.instance.label() for s in result.steps if s.action == "drain"}
    for step in result.steps:
        if step.action == "destroy" and step.instance.tenant is not None:
            assert step.instance.label() in drained
    # Every listed tenant with a need holds enough memory; released tenants hold nothing.
    for tenant, need in needs.items():
        instance = result.target.tenant_instance(tenant)
        if need == 0:
            assert instance is None
        else:
            assert instance is not None and model.profile(instance.profile).memory_bytes >= need
    for instance in current.instances:
        if instance.tenant is None or instance.tenant in needs:
            continue
        after = result.target.tenant_instance(instance.tenant)
        assert after is not None and after.profile == instance.profile
        if not move_unlisted:
            assert after.start == instance.start
    # Simple case: when every listed tenant already fits where it is, nothing is touched.
    if all(need > 0 for need in needs.values()) and all(
        (inst := current.tenant_instance(t)) is not None and model.profile(inst.profile).memory_bytes >= n
        for t, n in needs.items()
    ):
        assert result.steps == ()


@settings(max_examples=100, deadline=None)
@given(layouts_and_needs())
def test_a_plan_never_drains_more_tenants_than_it_changes(case: tuple[MigLayout, dict[str, int]]) -> None:
    current, needs = case
    result = plan_rebalance(current, needs)
    if isinstance(result, MigRefusal):
        return
    kept_tenants = {i.tenant for i in result.kept if i.tenant is not None}
    drained = {s.instance.tenant for s in result.steps if s.action == "drain"}
    assert not kept_tenants & drained
    # Each drained tenant either no longer fits, was released, or was moved for someone else's room.
    for step in result.steps:
        if step.action == "drain":
            assert step.reason


@settings(max_examples=150, deadline=None)
@given(layouts_and_needs(), st.sampled_from(SIZES_GIB[:-1]))
def test_a_new_tenant_with_a_free_slot_costs_exactly_one_step(
    case: tuple[MigLayout, dict[str, int]], size_gib: float
) -> None:
    current, _ = case
    model = current.model
    need = int(size_gib * GIB * model.largest.memory_bytes / (140 * GIB))
    profile = smallest_fitting_profile(model, need)
    assert profile is not None
    free = [
        s
        for s in profile.starts
        if not validate_layout(MigLayout(current.gpu, (*current.instances, MigInstance(profile.name, s, "x"))))
    ]
    result = plan_rebalance(current, {"newcomer": need})
    if not free:
        return
    assert isinstance(result, MigPlan)
    assert len(result.steps) == 1
    assert result.steps[0].action in ("create", "assign")
    assert len(result.kept) == len(current.instances) - (1 if result.steps[0].action == "assign" else 0)
