import math
import random
import re

import pytest

from services.decision.convert import command_to_pb
from services.decision.domain.admission import EngineProfile
from services.decision.domain.engine import DecisionEngine
from services.decision.domain.kv_model import known_model
from services.decision.domain.policy import Policy, PolicyError, parse_policy
from services.decision.domain.types import (
    EngineLoad,
    OomEvent,
    PlannedCommand,
    RootCauseKind,
    Target,
    TierLoad,
)
from sits.runtime.clock import ManualClock
from sits.runtime.contract import ActionKind, Tier
from tests.decision.decision_builders import DEFAULT_POLICY, GIB, TARGET, TOTAL, make_sample, rules_policy_text


def _run(
    engine: DecisionEngine, clock: ManualClock, series: list[float], start: float = 0.0, hz: float = 10.0
) -> list[tuple[float, PlannedCommand]]:
    """Feed (t, fraction) pairs; return (t, command) for every command."""
    out = []
    for i, frac in enumerate(series):
        t = start + i / hz
        clock.set(1_000_000.0 + t)
        for command in engine.observe(make_sample(t, frac)):
            out.append((t, command))
    return out


def test_a_ramp_to_oom_is_warned_well_before_it(engine: DecisionEngine, clock: ManualClock) -> None:
    # 30 s steady, then +1%/s from 60%: memory would reach 96% at t = 66 s and 100% at t = 70 s.
    series = [0.6] * 300 + [0.6 + 0.01 * i / 10 for i in range(400)]
    commands = _run(engine, clock, series)
    assert commands, "no warning on a ramp"
    t, first = commands[0]
    assert first.kind is ActionKind.SET_ENGINE_LIMITS
    assert first.rule == "forecast-oom-within-5min"
    assert 70.0 - t >= 2.0
    assert any(e.name == "time_to_limit_s" for e in first.evidence)
    assert first.deadline - first.issued_at == 5.0 and first.policy_version == 1
    # No engine load was seen: the executor resolves the policy's 0.75 against the live engine.
    assert first.params == {"max_num_running_reqs_factor": 0.75}
    limits = command_to_pb(first).engine_limits
    assert limits.max_num_running_reqs_factor == 0.75 and not limits.HasField("max_num_running_reqs")


def test_noisy_plateau_and_sawtooth_below_the_limit_stay_quiet(policy: Policy) -> None:
    rng = random.Random(7)
    plateau = [0.8 + rng.gauss(0, 0.01) for _ in range(3000)]
    sawtooth = [0.5 + 0.3 * ((i / 10) % 3.0) / 3.0 for i in range(3000)]
    for series in (plateau, sawtooth):
        clock = ManualClock(1_000_000.0)
        engine = DecisionEngine(policy, clock)
        assert _run(engine, clock, series) == []


def test_a_fresh_target_warns_on_a_ramp_but_not_on_its_first_sawtooth_tooth(policy: Policy) -> None:
    # Seen from the start, both climb alike for 12 s; only the ramp goes on to the limit.
    tooth = [0.56 + 0.3 * ((i / 10) % 12.5) / 12.5 for i in range(3000)]
    ramp = [min(1.0, 0.5 + 0.04 * i / 10) for i in range(130)]  # 100% at t = 12.5 s
    clock = ManualClock(1_000_000.0)
    assert _run(DecisionEngine(policy, clock), clock, tooth) == []
    clock = ManualClock(1_000_000.0)
    commands = _run(DecisionEngine(policy, clock), clock, ramp)
    assert commands, "no warning on a fresh ramp to OOM"
    assert 12.5 - commands[0][0] >= 2.0, commands[0]


def test_a_few_big_steps_to_oom_are_warned_before_the_last_one(policy: Policy) -> None:
    # 30 s calm at 59%, then +8.8% every 6 s: 94.6% after the fourth step, OOM at the fifth (t = 60 s).
    # Too few steps for a straight line to pass for a trend.
    rng = random.Random(5)
    series = [0.59 + 0.088 * (0 if i < 300 else 1 + (i - 300) // 60) + rng.gauss(0, 0.002) for i in range(600)]
    clock = ManualClock(1_000_000.0)
    commands = _run(DecisionEngine(policy, clock), clock, series)
    assert commands, "no warning on a staircase to OOM"
    assert 60.0 - commands[0][0] >= 2.0, commands[0]


def test_a_fresh_target_waits_out_a_slow_first_tooth_but_not_a_real_climb(policy: Policy) -> None:
    # From the first sample: a tooth of +3.8%/s up to 85% that then falls back, over and over.
    tooth = [0.585 + 0.038 * ((i / 10) % 7.0) for i in range(3000)]
    clock = ManualClock(1_000_000.0)
    assert _run(DecisionEngine(policy, clock), clock, tooth) == []
    # Calm at 33% for 6 s, then a climb that speeds up from 10%/s: 100% near t = 11.3 s.
    climb = [
        0.33 if i < 60 else min(1.0, 0.33 + 0.1 * (i - 60) / 10 + 0.004 * ((i - 60) / 10) ** 2) for i in range(120)
    ]
    full = next(i / 10 for i, v in enumerate(climb) if v >= 1.0)
    clock = ManualClock(1_000_000.0)
    commands = _run(DecisionEngine(policy, clock), clock, climb)
    assert commands, "no warning on a fresh climb to OOM"
    assert full - commands[0][0] >= 2.0, (full, commands[0])


def test_cooldown_and_hysteresis_stop_flapping(rules_engine: DecisionEngine, clock: ManualClock) -> None:
    engine = rules_engine
    kv = [0.95, 0.91, 0.95, 0.91] * 50  # hovers around the 92% threshold, inside the 3% hysteresis
    fired = []
    for i, usage in enumerate(kv):
        t = i * 0.5
        clock.set(1_000_000.0 + t)
        fired += engine.observe(make_sample(t, 0.5, engine=EngineLoad(kv_cache_usage=usage)))
    assert [c.kind for c in fired] == [ActionKind.SHED_PRIORITY]
    assert fired[0].params["priority"] == "P2"
    # Falling well below the threshold clears the latch and, once it stayed clear for the policy's
    # hold (60 s), closes the breaker, once.
    cleared = []
    for i in range(140):
        t = 200 + i * 0.5
        clock.set(1_000_000.0 + t)
        cleared += [(t, c) for c in engine.observe(make_sample(t, 0.5, engine=EngineLoad(kv_cache_usage=0.5)))]
    assert [(c.kind, c.params["state"]) for _, c in cleared] == [(ActionKind.SHED_PRIORITY, "CLOSED")]
    assert cleared[0][0] >= 260.0


class _KvFeed:
    """One sample every 0.5 s at a KV usage (memory calm); keeps (t, command) for every command."""

    def __init__(self, engine: DecisionEngine, clock: ManualClock) -> None:
        self.engine, self.clock, self.t = engine, clock, 0.0
        self.moves: list[tuple[float, PlannedCommand]] = []

    def __call__(self, seconds: float, usage: float) -> None:
        for _ in range(int(seconds * 2)):
            self.clock.set(1_000_000.0 + self.t)
            sample = make_sample(self.t, 0.5, engine=EngineLoad(kv_cache_usage=usage))
            self.moves.extend((self.t, c) for c in self.engine.observe(sample))
            self.t += 0.5

    @property
    def states(self) -> list[object]:
        return [c.params["state"] for _, c in self.moves]


def test_an_undo_waits_out_its_hold_and_a_rule_that_flaps_holds_twice_as_long(clock: ManualClock) -> None:
    # The demo's cycle: a limit makes its own condition clear (the cap stops the KV cache filling), the
    # undo lets it fill again, the rule fires again. With a hold, the undo waits until the condition has
    # stayed clear for clear_hold_s; a rule that fires again soon after its undo holds twice as long.
    text = re.sub(r"  clear_hold_s: \d+", "  clear_hold_s: 20", rules_policy_text())
    assert "clear_hold_s: 20" in text
    feed = _KvFeed(DecisionEngine(parse_policy(text), clock), clock)
    feed(5, 0.95)  # shed
    feed(10, 0.5)  # clear for 10 s: still held
    feed(3, 0.95)  # the pressure comes back inside the hold: the latch stays, no second shed
    feed(19, 0.5)  # 19 s clear: not yet
    assert feed.states == ["OPEN"]
    feed(2, 0.5)  # 20 s clear: undone
    assert feed.states == ["OPEN", "CLOSED"]
    undone = feed.moves[-1][0]
    feed(31, 0.95)  # fires again (its cooldown is 30 s): a flap
    assert feed.states == ["OPEN", "CLOSED", "OPEN"]
    fired = feed.moves[-1][0]
    feed(45, 0.5)
    assert feed.states[-1] == "CLOSED"
    # The second hold is 40 s, not 20.
    assert feed.moves[-1][0] - fired >= 40.0 and fired - undone < 300.0


def test_an_undo_rolled_back_latches_its_rule_again_and_doubles_its_hold(clock: ManualClock) -> None:
    text = re.sub(r"  clear_hold_s: \d+", "  clear_hold_s: 20", rules_policy_text())
    engine = DecisionEngine(parse_policy(text), clock)
    feed = _KvFeed(engine, clock)
    feed(5, 0.95)
    feed(21, 0.5)
    assert feed.states == ["OPEN", "CLOSED"]
    engine.observe_verdict(feed.moves[-1][1].command_id, "ROLLED_BACK", feed.t)  # the validator put the shed back
    rolled_back = feed.t
    feed(30, 0.5)
    assert len(feed.moves) == 2, "undone again within the doubled hold"
    feed(15, 0.5)
    assert feed.states == ["OPEN", "CLOSED", "CLOSED"]
    assert feed.moves[-1][0] - rolled_back >= 40.0


def default_policy_with(rule: str) -> str:
    """The default policy's text with `rule` (a YAML list item) among its rules."""
    marker = "  - name: fragmentation-cap-prefill"
    return DEFAULT_POLICY.read_text().replace(marker, rule.lstrip("\n") + "\n" + marker)


KV_CAP_RULE = """
  - name: kv-usage-cap-running
    description: The KV cache is more than 92% used; cap the running requests.
    when:
      kv_usage_above: 0.92
    then:
      - kind: SET_ENGINE_LIMITS
        max_num_running_reqs_factor: 0.75
    on_clear:
      - kind: SET_ENGINE_LIMITS
        restore_defaults: true
"""


def test_an_undo_lifts_a_running_cap_only_as_far_as_the_kv_cache_has_room(clock: ManualClock) -> None:
    # The demo's cycle: the cap keeps the cache from filling, its condition clears, and an undo to the start-up
    # cap under the same load refills the cache (a preemption storm, rolled back). The undo waits while the
    # cache has no room for more requests of the recent size, lifts the cap part way when requests shrink,
    # and restores in full once the cap holds nothing back.
    text = default_policy_with(KV_CAP_RULE)
    engine = DecisionEngine(parse_policy(re.sub(r"  clear_hold_s: \d+", "  clear_hold_s: 20", text)), clock)
    moves: list[tuple[float, dict[str, object]]] = []
    t = 0.0
    cap = 16

    preempted = 0

    def feed(seconds: float, usage: float, running: int, waiting: int, preempting: bool = False) -> None:
        nonlocal t, cap, preempted
        for _ in range(int(seconds * 2)):
            clock.set(1_000_000.0 + t)
            preempted += preempting
            load = EngineLoad(
                kv_cache_usage=usage,
                num_requests_running=min(running, cap),
                num_requests_waiting=waiting,
                num_preemptions=preempted,
                tiers=(TierLoad(tier=1, running=min(running, cap), waiting=waiting),),
                running_cap=cap,
                max_num_seqs=16,
            )
            for c in engine.observe(make_sample(t, 0.5, engine=load)):
                moves.append((t, dict(c.params)))
                cap = int(c.params.get("max_num_running_reqs", 16))  # type: ignore[call-overload]
            t += 0.5

    feed(3, 0.95, 16, 4)
    assert [m for _, m in moves] == [{"max_num_running_reqs": 12}]
    # Clear under the cap (85% < 92% less the hysteresis), but 12 requests fill 85% of the cache: no room for
    # more, so no undo however long it stays clear.
    feed(60, 0.85, 12, 5)
    assert len(moves) == 1
    # Shorter requests: 12 take 70%, room for 15 within 90% of the cache, but the engine preempts at its
    # cap: the cache is at its edge whatever its mean says.
    feed(25, 0.70, 12, 5, preempting=True)
    assert len(moves) == 1
    # Room for 15 once the hold has seen only them, and no preemption.
    feed(25, 0.70, 12, 5)
    assert [m for _, m in moves][1:] == [{"max_num_running_reqs": 15}]
    lifted = moves[-1][0]
    assert "room for 15 running requests" in engine._states[TARGET.key].last_command.reason  # type: ignore[union-attr]
    feed(40, 0.875, 15, 3)  # at the new cap the cache is as full as it may be: it stays
    assert len(moves) == 2
    # The load falls: for a whole hold nothing waits and fewer run than the cap; the undo restores in full.
    feed(25, 0.30, 5, 0)
    assert [m for _, m in moves][2:] == [{"restore_defaults": True}]
    assert moves[-1][0] - lifted >= 30.0  # the rule's undo keeps its cooldown between steps


KV_ROOM_RULE = """
  - name: kv-room-cap-running
    description: The KV cache holds fewer running requests than the cap; cap them at what it holds.
    when:
      kv_room_below_running_cap: true
    then:
      - kind: SET_ENGINE_LIMITS
        fit_kv_room: true
"""


def test_a_kv_room_rule_caps_at_what_the_cache_holds_not_at_a_share_of_what_runs(clock: ManualClock) -> None:
    # Seen in make demo (2026-12-07): a cap of 0.75 x running, fired early in the ramp with 3 running, set 2 of
    # 16, and P0's own load was more than the engine served at 2. Sized from the cache, a cap comes only when
    # the cache cannot hold the live cap's requests, and holds as many as it can.
    policy = parse_policy(default_policy_with(KV_ROOM_RULE))

    def feed(engine: DecisionEngine, seconds: float, usage: float, running: int, plugin: bool = True) -> list[object]:
        moves: list[object] = []
        for _ in range(int(seconds * 2)):
            t = clock.now() - 1_000_000.0
            load = EngineLoad(
                kv_cache_usage=usage,
                num_requests_running=running,
                num_requests_waiting=4,
                tiers=(TierLoad(tier=1, running=running, waiting=4),) if plugin else (),
                running_cap=16 if plugin else 0,
                max_num_seqs=16 if plugin else 0,
            )
            moves.extend(dict(c.params) for c in engine.observe(make_sample(t, 0.5, engine=load)))
            clock.set(clock.now() + 0.5)
        return moves

    clock.set(1_000_000.0)
    # Full, but without the plugin the engine's live cap is not known: nothing to size a cap against.
    assert feed(DecisionEngine(policy, clock), 5, 0.97, 16, plugin=False) == []
    assert feed(DecisionEngine(policy, clock), 1, 0.97, 16) == [{"max_num_running_reqs": 14}]  # 14 fit in 90%
    engine = DecisionEngine(policy, clock)
    assert feed(engine, 5, 0.15, 3) == []  # early in a ramp: 3 take 15%, room for 18 within 90% of the cache
    # A sample of 6 large requests (a long prompt's prefill, say): 92% of the cache. The largest share would
    # leave room for 5; at the mean share over the window (2.42 over 36 requests) the cache holds 13.
    assert feed(engine, 0.5, 0.92, 6) == [{"max_num_running_reqs": 13}]


def test_fit_kv_room_needs_its_condition() -> None:
    rule = KV_ROOM_RULE.replace("kv_room_below_running_cap: true", "kv_usage_above: 0.9")
    with pytest.raises(PolicyError, match="fit_kv_room"):
        parse_policy(default_policy_with(rule))


def test_a_hold_above_its_bound_is_refused() -> None:
    text = re.sub(r"  clear_hold_s: \d+", "  clear_hold_s: 700", rules_policy_text())
    with pytest.raises(PolicyError, match="clear_hold_s"):
        parse_policy(text)


def test_never_two_commands_for_one_target_inside_its_cooldown(rules_policy: Policy, clock: ManualClock) -> None:
    policy = rules_policy
    engine = DecisionEngine(policy, clock)
    from services.decision.domain.types import AllocatorStats

    frag = AllocatorStats(allocated_bytes=40 * GIB, reserved_bytes=80 * GIB, inactive_split_bytes=20 * GIB)
    times = []
    for i in range(100):
        t = i * 0.1
        # KV high and fragmentation high at once: two rules want the engine.
        for c in engine.observe(make_sample(t, 0.6, engine=EngineLoad(kv_cache_usage=0.97), allocator=frag)):
            times.append((t, c.target.key, c.rule))
    assert len(times) == 2
    assert times[1][0] - times[0][0] >= policy.spec.defaults.target_cooldown_s


def test_an_oom_is_acted_on_with_its_root_cause(engine: DecisionEngine, clock: ManualClock) -> None:
    for i in range(50):
        engine.observe(make_sample(i * 0.1, 0.7))
    commands = engine.observe_oom(
        OomEvent(
            TARGET,
            5.0,
            "oom-1",
            requested_bytes=2 * GIB,
            device_free_bytes=GIB,
            device_total_bytes=TOTAL,
            message="CUDA out of memory",
        )
    )
    assert [c.kind for c in commands] == [ActionKind.ABORT_LOW_PRIORITY]
    assert commands[0].cause_event_id == "oom-1"
    assert any(e.name == "oom_requested_bytes" and e.value == 2 * GIB for e in commands[0].evidence)
    # The same OOM delivered twice (at-least-once) is acted on once.
    assert engine.observe_oom(OomEvent(TARGET, 5.0, "oom-1", requested_bytes=2 * GIB)) == []


def test_admit_refuses_what_does_not_fit_and_says_why(policy: Policy, clock: ManualClock) -> None:
    profile = EngineProfile(known_model("llama-3-8b"), max_model_len=32768)
    engine = DecisionEngine(policy, clock, profiles={"vllm-0": profile})
    # 200 free blocks of 16 tokens; the default policy reserves 10% of the cache (100 blocks) for P0.
    load = EngineLoad(kv_cache_usage=0.8, kv_blocks_total=1000, kv_blocks_used=800, block_size=16)
    engine.observe(make_sample(1.0, 0.7, engine=load))
    fits = engine.admit(TARGET, prompt_tokens=1000, max_tokens=200, priority=Tier.P1)
    assert fits.admitted and fits.kv_bytes_needed == 1200 * 131072
    refused = engine.admit(TARGET, prompt_tokens=1500, max_tokens=200)
    assert not refused.admitted
    assert "GiB of KV" in refused.reason and "reserved for P0" in refused.reason
    assert refused.kv_bytes_free == 200 * 16 * 131072
    # The same request at P0 may use the reserve: it fits.
    assert engine.admit(TARGET, prompt_tokens=1500, max_tokens=200, priority=Tier.P0).admitted
    too_long = engine.admit(TARGET, prompt_tokens=40000, max_tokens=1)
    assert not too_long.admitted and "max model length" in too_long.reason


def test_an_admission_query_naming_no_gpu_is_answered_from_that_engines_samples(
    policy: Policy, clock: ManualClock
) -> None:
    profile = EngineProfile(known_model("llama-3-8b"), max_model_len=32768)
    engine = DecisionEngine(policy, clock, profiles={"vllm-0": profile})
    load = EngineLoad(kv_cache_usage=0.8, kv_blocks_total=1000, kv_blocks_used=800, block_size=16)
    engine.observe(make_sample(1.0, 0.7, engine=load))
    # The admission processor knows its host and engine, not the GPU capture read from NVML.
    query = Target(TARGET.host, "", "", TARGET.engine)
    assert engine.admit(query, prompt_tokens=1500, max_tokens=200).kv_bytes_free == 200 * 16 * 131072
    assert not engine.admit(query, prompt_tokens=1500, max_tokens=200).admitted
    # Another host's engine of the same name, or a query naming another GPU, is not this one.
    elsewhere = engine.admit(Target("host-b", "", "", TARGET.engine), prompt_tokens=1500, max_tokens=200)
    assert elsewhere.admitted and elsewhere.kv_bytes_free == 0 and "no KV block figures" in elsewhere.reason
    other_gpu = engine.admit(Target(TARGET.host, "GPU-9", "", TARGET.engine), prompt_tokens=1500, max_tokens=200)
    assert other_gpu.kv_bytes_free == 0
    # Handed over to another replica: the index no longer leads to it.
    engine.hand_over(lambda key: key == TARGET.key)
    assert engine.admit(query, prompt_tokens=1500, max_tokens=200).kv_bytes_free == 0


def test_prompt_logprobs_are_refused_when_one_chunks_logits_would_not_fit_the_device(
    policy: Policy, clock: ManualClock
) -> None:
    from services.decision.domain.types import AllocatorStats

    shape = known_model("llama-3-8b")
    v2_runner = EngineProfile(shape, max_model_len=32768)
    v1_runner = EngineProfile(shape, max_model_len=32768, prompt_logprobs_chunk_tokens=0)
    engine = DecisionEngine(policy, clock, profiles={"vllm-0": v2_runner})
    # 0.5 GiB free on the device and 0.5 GiB cached beyond the floor; the step budget is 2048 tokens.
    allocator = AllocatorStats(
        allocated_bytes=60 * GIB,
        reserved_bytes=61 * GIB,
        allocated_floor_bytes=GIB * 121 // 2,
        device_free_bytes=GIB // 2,
    )
    load = EngineLoad(kv_blocks_total=10_000, kv_blocks_used=0, block_size=16, token_budget=2048)
    engine.observe(make_sample(1.0, 0.9, engine=load, allocator=allocator))
    per_token = shape.vocab_size * (2 + 4 + 4)
    # 1024-token chunks of a 128k vocabulary: 1.22 GiB of logits against 1 GiB of headroom. Refused at any tier.
    refused = engine.admit(TARGET, prompt_tokens=8000, max_tokens=10, priority=Tier.P0, prompt_logprobs=5)
    assert not refused.admitted
    assert "prompt_logprobs over a 1024-token prefill chunk" in refused.reason and "1.00 GiB left" in refused.reason
    # The same prompt without prompt_logprobs fits, and a prompt short enough for its logits to fit passes too.
    assert engine.admit(TARGET, prompt_tokens=8000, max_tokens=10, priority=Tier.P0).admitted
    short = GIB // per_token
    assert engine.admit(TARGET, prompt_tokens=short, max_tokens=10, priority=Tier.P0, prompt_logprobs=-1).admitted
    assert not engine.admit(TARGET, prompt_tokens=short + 1, max_tokens=10, prompt_logprobs=1).admitted
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.admit(TARGET, prompt_tokens=10, max_tokens=10, prompt_logprobs=-2)
    # A runner that computes them over the whole step is bounded by the step budget instead.
    engine = DecisionEngine(policy, clock, profiles={"vllm-0": v1_runner})
    engine.observe(make_sample(1.0, 0.9, engine=load, allocator=allocator))
    whole_step = engine.admit(TARGET, prompt_tokens=8000, max_tokens=10, prompt_logprobs=1)
    assert not whole_step.admitted and "2048-token prefill chunk" in whole_step.reason


def test_prompt_logprobs_without_device_figures_fall_back_to_nvml_or_pass(policy: Policy, clock: ManualClock) -> None:
    engine = DecisionEngine(policy, clock, profiles={"vllm-0": EngineProfile(known_model("llama-3-8b"))})
    # No sample yet: nothing says the device is short, so admission goes by KV alone.
    assert engine.admit(TARGET, prompt_tokens=30_000, max_tokens=1, prompt_logprobs=1).admitted
    # NVML's free memory only (no allocator figures): 0.5% of 140 GiB (0.7 GiB) free, short of 1.22 GiB of logits.
    engine.observe(make_sample(1.0, 0.995))
    refused = engine.admit(TARGET, prompt_tokens=30_000, max_tokens=1, priority=Tier.P0, prompt_logprobs=1)
    assert not refused.admitted and "1024-token prefill chunk" in refused.reason
    assert engine.admit(TARGET, prompt_tokens=30_000, max_tokens=1, priority=Tier.P0).admitted


def test_explain_and_evaluate(engine: DecisionEngine, clock: ManualClock) -> None:
    assert engine.explain(TARGET) is None
    samples = [make_sample(i * 0.1, 0.5 + 0.004 * max(0, i - 300), event_id=f"e{i}") for i in range(500)]
    result = engine.evaluate(samples)
    assert result.commands and result.forecast.time_to_limit_s is not None
    # What-if leaves the live engine untouched.
    assert engine.explain(TARGET) is None
    for s in samples[:10]:
        engine.observe(s)
    explanation = engine.explain(TARGET)
    assert explanation is not None and len(explanation.window) == 10
    assert explanation.root_cause.kind is RootCauseKind.NONE or explanation.root_cause.confidence >= 0


def test_put_policy_keeps_latches_only_for_rules_that_remain(rules_engine: DecisionEngine, clock: ManualClock) -> None:
    engine = rules_engine
    engine.observe(make_sample(1.0, 0.5, engine=EngineLoad(kv_cache_usage=0.99)))
    explanation = engine.explain(TARGET)
    assert explanation is not None and explanation.latched_rules == ("kv-usage-shed-p2",)
    engine.set_policy(
        parse_policy(
            "rules:\n  - name: other\n    when: {memory_fraction_above: 0.99}\n    then: {kind: FLUSH_CACHE}\n",
            version=2,
        )
    )
    explanation = engine.explain(TARGET)
    assert explanation is not None and explanation.latched_rules == ()
    assert math.isfinite(explanation.forecast.memory_fraction)


def test_the_controller_ticks_on_plugin_samples_and_a_policy_change_applies_at_the_next_tick(
    policy: Policy, clock: ManualClock
) -> None:
    from services.decision.domain.types import TierLoad

    engine = DecisionEngine(policy, clock)
    waiting = (
        TierLoad(0, running=1, waiting=2, oldest_wait_s=0.4, queue_wait_p90_s=0.4, queue_wait_samples=5),
        TierLoad(1, running=3, waiting=3),
        TierLoad(2, running=4, waiting=5),
    )
    load = EngineLoad(tiers=waiting, running_cap=8, max_num_seqs=8)
    sent = []
    for i in range(6):
        t = 100.0 + i * 0.5
        engine.observe(make_sample(t, engine=load))
        sent += engine.tick(t)
    [engaged] = [c for c in sent if c.kind is ActionKind.SET_TIER_BUDGET and "renew" not in c.reason]
    assert engaged.rule == "controller" and "engage" in engaged.reason
    # P0 already misses its 100 ms objective: half of the 7 lower-tier streams running.
    assert engaged.params["budget"] == 3 and engaged.params["limits"] == {1: 3, 2: 0}
    assert engaged.params["lease_s"] == policy.spec.controller.lease_s
    assert engaged.promise.p0_queue_wait_p90_s == 0.1 and engaged.promise.no_p0_refused
    pb = command_to_pb(engaged)
    assert pb.kind == 10 and [(lim.priority, lim.max_requests) for lim in pb.tier_budget.limits] == [(2, 3), (3, 0)]
    # A looser objective, put live: at the next tick 400 ms is no longer a miss, so nothing is cut further.
    relaxed = policy.yaml_text.replace("p0_queue_wait_p90_s: 0.1", "p0_queue_wait_p90_s: 1.0")
    engine.set_policy(parse_policy(relaxed, version=2))
    later = []
    for i in range(40):
        t = 103.0 + i * 0.5
        engine.observe(make_sample(t, engine=load))
        later += engine.tick(t)
    assert later and all("renew" in c.reason for c in later), [c.reason for c in later]
