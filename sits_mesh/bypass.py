"""When Generate requests may skip the admission processor: pure logic, an injected clock.

Inspecting a request costs it a gRPC stream to the processor: most of the time
the mesh adds to a first token (bench/envoy_overhead). Yet the processor can
only refuse when free KV is short of what one request may need, or when GPU
pressure sheds a priority. So the processor probes the decision service with
the largest request the engine accepts, at the lowest priority. While that
probe fits `bypass_headroom` times over and pressure is below every shed
threshold, no verdict could be a refusal, and Envoy routes Generate past the
processor (runtime key `sits.admission.bypass` = 100).

The gate closes (every request inspected) on the first probe that says
otherwise or gets no answer, and opens again only once the condition has held
for `bypass_open_after_s`. Envoy's default for the key is 0, so a restarted
Envoy inspects until told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from sits.runtime.clock import Clock
from sits_mesh.admission import AdmissionQuery, Verdict, format_bytes
from sits_mesh.policy import PRIORITY_NAMES, Admission, Priorities


@dataclass(frozen=True)
class Probe:
    """One look at the engine: the decision service's verdict on the probe (None: no answer) and pressure."""

    verdict: Verdict | None
    pressure: float | None


class BypassGate:
    def __init__(self, admission: Admission, priorities: Priorities, clock: Clock) -> None:
        self._tokens = admission.bypass_max_request_tokens
        self._headroom = admission.bypass_headroom
        self._open_after_s = admission.bypass_open_after_s
        # Pressure at which the first priority is shed (1.0: none ever is).
        self._shed_at = min(c.shed_at_pressure for c in priorities.classes.values())
        self._clock = clock
        self._clear_since: float | None = None
        self.is_open = False
        self.reason = "not probed yet"

    @property
    def enabled(self) -> bool:
        return self._tokens > 0

    def probe_query(self) -> AdmissionQuery:
        """The largest request the engine accepts, at the priority refused first."""
        # prompt_logprobs: a bypassed request may ask for them, and their logits are the largest transient.
        return AdmissionQuery(prompt_tokens=self._tokens, max_tokens=0, priority=PRIORITY_NAMES[-1], prompt_logprobs=1)

    def why_inspect(self, probe: Probe) -> str | None:
        """Why every request must still be inspected after this probe, or None when none can be refused."""
        if not self.enabled:
            return "bypass is off in the policy"
        if probe.pressure is not None and self._shed_at < 1.0 and probe.pressure >= self._shed_at:
            return f"GPU pressure {probe.pressure:.2f} is at or above {self._shed_at:.2f}, where shedding starts"
        verdict = probe.verdict
        if verdict is None:
            return "the decision service did not answer the probe"
        if not verdict.admitted:
            return f"the probe was refused: {verdict.reason}"
        if verdict.kv_bytes_needed <= 0 or verdict.kv_bytes_free <= 0:
            return "the decision service has no KV figures for the engine"
        if verdict.kv_bytes_free < self._headroom * verdict.kv_bytes_needed:
            return (
                f"{format_bytes(verdict.kv_bytes_free)} of KV is free, under {self._headroom:g} x the "
                f"{format_bytes(verdict.kv_bytes_needed)} one {self._tokens}-token request may need"
            )
        return None

    def observe(self, probe: Probe) -> bool:
        """Whether requests may bypass the processor now."""
        reason = self.why_inspect(probe)
        now = self._clock.monotonic()
        if reason is not None:
            self._clear_since = None
            self.is_open = False
            self.reason = reason
            return False
        if self._clear_since is None:
            self._clear_since = now
        if now - self._clear_since >= self._open_after_s:
            self.is_open = True
            self.reason = f"a {self._tokens}-token request fits {self._headroom:g} times over and no priority is shed"
        return self.is_open
