"""Fixtures for decision-service tests: the default policy and an engine on a manual clock."""

from __future__ import annotations

import pytest

from services.decision.domain.engine import DecisionEngine
from services.decision.domain.policy import Policy, parse_policy
from sits.runtime.clock import ManualClock
from tests.decision.decision_builders import DEFAULT_POLICY, rules_policy_text


@pytest.fixture
def policy() -> Policy:
    return parse_policy(DEFAULT_POLICY.read_text())


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000.0)


@pytest.fixture
def engine(policy: Policy, clock: ManualClock) -> DecisionEngine:
    return DecisionEngine(policy, clock)


@pytest.fixture
def rules_policy() -> Policy:
    """The default policy plus a latching KV shed rule, for tests of the rule machinery."""
    return parse_policy(rules_policy_text())


@pytest.fixture
def rules_engine(rules_policy: Policy, clock: ManualClock) -> DecisionEngine:
    return DecisionEngine(rules_policy, clock)
