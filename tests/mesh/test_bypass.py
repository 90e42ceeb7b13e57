"""The admission bypass: when Generate may skip the processor (pure gate) and how Envoy is told."""

from __future__ import annotations

import asyncio

from sits.runtime.clock import ManualClock
from sits_mesh.admission import AdmissionQuery, AdmitterUnavailable, Verdict
from sits_mesh.bypass import BypassGate, Probe
from sits_mesh.envoy_config import ADMISSION_BYPASS_KEY
from sits_mesh.envoy_process import EnvoyError
from sits_mesh.ext_proc import AdmissionProcessor, BypassController
from sits_mesh.policy import Admission, MeshPolicy, Priorities

MIB = 1 << 20
PLENTY = Verdict(admitted=True, reason="fits", kv_bytes_needed=1 * MIB, kv_bytes_free=10 * MIB)


def gate(clock: ManualClock, **admission: object) -> BypassGate:
    settings = {"bypass_max_request_tokens": 1024, "bypass_headroom": 2.0, "bypass_open_after_s": 1.0, **admission}
    return BypassGate(Admission.model_validate(settings), Priorities(), clock)


def test_the_probe_is_the_largest_request_at_the_lowest_priority() -> None:
    probe = AdmissionQuery(prompt_tokens=1024, max_tokens=0, priority="p2", prompt_logprobs=1)
    assert gate(ManualClock()).probe_query() == probe


def test_opens_only_after_clear_probes_held_and_closes_at_the_first_that_is_not() -> None:
    clock = ManualClock()
    bypass = gate(clock)
    assert not bypass.observe(Probe(PLENTY, 0.1))
    clock.advance(0.6)
    assert not bypass.observe(Probe(PLENTY, 0.1))
    clock.advance(0.5)
    assert bypass.observe(Probe(PLENTY, 0.1))
    tight = Verdict(admitted=True, reason="fits", kv_bytes_needed=1 * MIB, kv_bytes_free=int(1.5 * MIB))
    assert not bypass.observe(Probe(tight, 0.1))
    assert "under 2 x" in bypass.reason
    clock.advance(0.5)
    assert not bypass.observe(Probe(PLENTY, 0.1))  # the clock restarts after a closing probe
    clock.advance(1.0)
    assert bypass.observe(Probe(PLENTY, 0.1))


def test_every_doubt_means_inspect() -> None:
    bypass = gate(ManualClock(), bypass_open_after_s=0.0)
    doubts = {
        "shedding starts": Probe(PLENTY, 0.7),  # p2 is shed from 0.7 in the default priorities
        "did not answer": Probe(None, 0.0),
        "probe was refused": Probe(Verdict(admitted=False, reason="only P0 is admitted"), 0.0),
        "no KV figures": Probe(Verdict(admitted=True, reason="no figures yet"), None),
    }
    for words, probe in doubts.items():
        assert not bypass.observe(probe)
        assert words in bypass.reason
    assert bypass.observe(Probe(PLENTY, None))
    off = gate(ManualClock(), bypass_max_request_tokens=0, bypass_open_after_s=0.0)
    assert not off.enabled
    assert not off.observe(Probe(PLENTY, 0.0))


class ScriptedAdmitter:
    def __init__(self, answers: list[Verdict | None]) -> None:
        self.answers = answers
        self.queries: list[AdmissionQuery] = []

    async def admit(self, query: AdmissionQuery) -> Verdict:
        self.queries.append(query)
        answer = self.answers.pop(0)
        if answer is None:
            raise AdmitterUnavailable("down")
        return answer


class RecordingEnvoy:
    def __init__(self, failures: int = 0) -> None:
        self.writes: list[dict[str, int | float | str]] = []
        self.failures = failures

    async def runtime_modify(self, values: dict[str, int | float | str]) -> None:
        if self.failures:
            self.failures -= 1
            raise EnvoyError("runtime_modify answered 503")
        self.writes.append(values)


def test_the_controller_tells_envoy_on_changes_retries_and_reasserts_an_open_bypass() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        policy = MeshPolicy.model_validate(
            {"admission": {"bypass_max_request_tokens": 1024, "bypass_open_after_s": 0, "kv_bytes_per_token": 1024}}
        )
        admitter = ScriptedAdmitter([PLENTY, PLENTY, PLENTY, PLENTY, None])
        processor = AdmissionProcessor(policy, admitter, clock=clock)
        envoy = RecordingEnvoy(failures=1)
        controller = BypassController(processor, envoy, clock, reassert_s=2.0)
        assert await controller.probe_once()  # open, but Envoy refused the write
        assert envoy.writes == []
        assert await controller.probe_once()  # so it is sent again
        assert envoy.writes == [{ADMISSION_BYPASS_KEY: 100}]
        # The probe's answer also feeds the processor's local admission.
        assert processor.recent_free_kv.admits_locally(AdmissionQuery(8, 2, "p1"))
        clock.advance(0.5)
        await controller.probe_once()
        assert len(envoy.writes) == 1  # unchanged and recently said: nothing sent
        clock.advance(2.0)
        await controller.probe_once()
        assert envoy.writes[-1] == {ADMISSION_BYPASS_KEY: 100} and len(envoy.writes) == 2
        assert not await controller.probe_once()  # the decision service stopped answering
        assert envoy.writes[-1] == {ADMISSION_BYPASS_KEY: 0}
        assert controller.transitions == 2
        assert all(q.prompt_tokens == 1024 and q.priority == "p2" for q in admitter.queries)

    asyncio.run(scenario())
