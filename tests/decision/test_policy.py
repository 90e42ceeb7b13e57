from typing import get_args

import pytest

from services.decision.domain.policy import PolicyError, TierName, parse_policy
from sits.runtime.contract import ALL_TIERS
from tests.decision.decision_builders import DEFAULT_POLICY

GOOD_RULE = """\
rules:
  - name: kv
    when:
      kv_usage_above: 0.9
    then:
      kind: SHED_PRIORITY
      priority: P2
"""


def test_default_policy_covers_the_required_rules() -> None:
    policy = parse_policy(DEFAULT_POLICY.read_text())
    rules = {r.name: r for r in policy.spec.rules}
    # Lower tiers are steered by the controller on P0's queue wait, not shed on KV usage (full by design).
    assert not any(r.when.kv_usage_above is not None for r in rules.values())
    assert policy.spec.controller.enabled and policy.spec.controller.p0_queue_wait_p90_s == 0.1
    assert policy.spec.controller.lease_s >= 2 * policy.spec.controller.tick_s
    forecast_rule = rules["forecast-oom-within-5min"]
    assert forecast_rule.when.time_to_limit_below_s == 300 and policy.spec.forecast.limit_fraction == 0.96
    assert forecast_rule.on_clear[0].kind == "SET_ENGINE_LIMITS" and forecast_rule.on_clear[0].restore_defaults
    assert rules["fragmentation-cap-prefill"].when.fragmentation_above == 0.35
    cotenant = rules["co-tenant-protect-p0"]
    assert cotenant.when.root_cause_in == ("MULTI_TENANT_CONTENTION",)
    assert {a.kind for a in cotenant.then} == {"SHED_PRIORITY", "MIG_REBALANCE"}


def test_a_minimal_policy_parses_with_a_single_action_mapping() -> None:
    policy = parse_policy(GOOD_RULE, version=7)
    assert policy.version == 7 and policy.spec.rules[0].then[0].kind == "SHED_PRIORITY"


def _problems(text: str) -> list[tuple[str, int | None, str]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    return [(p.field, p.line, p.message) for p in info.value.problems]


def test_an_out_of_range_threshold_names_the_field_and_its_line() -> None:
    text = GOOD_RULE.replace("kv_usage_above: 0.9", "kv_usage_above: 1.7")
    [(field, line, message)] = _problems(text)
    assert field == "rules.0.when.kv_usage_above"
    assert line == 4
    assert "less than or equal to 1" in message


def test_an_unknown_action_kind_points_at_the_action() -> None:
    text = GOOD_RULE.replace("kind: SHED_PRIORITY", "kind: REBOOT_GPU")
    [(field, line, _)] = _problems(text)
    assert field.startswith("rules.0.then.0")
    assert line == 6


def test_an_unknown_root_cause_and_a_misspelled_key_are_both_reported() -> None:
    text = """\
rules:
  - name: r1
    when:
      root_cause_in: [COSMIC_RAYS]
    then:
      kind: FLUSH_CACHE
  - name: r2
    when:
      kv_usage_abov: 0.5
    then:
      kind: FLUSH_CACHE
"""
    problems = _problems(text)
    by_field = {f: (line, msg) for f, line, msg in problems}
    assert by_field["rules.0.when.root_cause_in"][0] == 4
    assert "COSMIC_RAYS" in by_field["rules.0.when.root_cause_in"][1]
    assert by_field["rules.1.when.kv_usage_abov"][0] == 9


def test_two_actions_for_one_scope_are_refused() -> None:
    text = GOOD_RULE.replace(
        "    then:\n      kind: SHED_PRIORITY\n      priority: P2\n",
        "    then:\n      - kind: FLUSH_CACHE\n      - kind: PAUSE_ADMISSION\n",
    )
    [(field, line, message)] = _problems(text)
    assert field == "rules.0.then" and line == 6 and "scope" in message


def test_yaml_syntax_errors_carry_the_line() -> None:
    [(field, line, message)] = _problems("rules:\n  - name: x\n    when: {kv_usage_above: 0.5\n")
    assert field == "" and line is not None and line >= 3 and "YAML" in message


def test_a_document_that_is_not_a_mapping_is_refused() -> None:
    [(_, line, message)] = _problems("- just\n- a list\n")
    assert line == 1 and "mapping" in message


def test_duplicate_rule_names_are_refused() -> None:
    text = GOOD_RULE + GOOD_RULE.removeprefix("rules:\n")
    [(field, _, message)] = _problems(text)
    assert field == "rules" and "two rules" in message


def test_controller_settings_are_validated_with_a_reason() -> None:
    text = "controller:\n  tick_s: 1\n  lease_s: 1\n" + GOOD_RULE
    [(field, line, message)] = _problems(text)
    assert field == "controller" and line == 2 and "lease_s must be at least two ticks" in message
    [(field, _, message)] = _problems("controller:\n  p1_share: 1.5\n" + GOOD_RULE)
    assert field == "controller.p1_share" and "less than or equal to 1" in message
    [(field, _, _)] = _problems("controller:\n  tick: 1\n" + GOOD_RULE)
    assert field == "controller.tick"


def test_policy_tier_names_are_the_contract_tiers() -> None:
    assert get_args(TierName) == tuple(tier.name for tier in ALL_TIERS)
