"""The scenario engine's scheduling, without a GPU: requests, the live limits, admission and preemption.

Pure logic (no torch, no gRPC): the GPU side (`engine.py`) asks `plan_step()` what
to preempt and what to admit before each step, runs the model, and reports
tokens back. `EngineControl` is the object the executor's engine-control
endpoint (`sits_engine/vllm_plugin/control_server.py`) drives, with the
same methods and the same semantics as the vLLM scheduler plugin:
- `max_num_running_reqs` caps the batch; lowering it below the running count
  preempts the newest requests first (their KV cache is freed; they go back to
  the head of the queue and resume by recomputation): slower, never lost;
- `max_num_scheduled_tokens` caps the prompt tokens admitted in one step;
- `admission_paused` admits nothing new while running requests keep decoding;
- changes are queued and applied at the start of the next step; `set_limits`
  waits (bounded) until a step applied them, as the plugin does.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sits.runtime import engine_control as protocol

_APPLY_WAIT_S = 2.0


class ScenarioLimitError(protocol.LimitError):
    """A limit outside what this engine can take (answered INVALID_ARGUMENT)."""


@dataclass
class Request:
    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    submitted_at: float
    generated: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    completed_at: float | None = None
    preemptions: int = 0
    lost: bool = False

    @property
    def context_tokens(self) -> int:
        """Prompt plus generated tokens: what a (re)admission prefills; the cache holds all but the newest."""
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new_tokens

    def record(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "prompt": self.prompt_tokens,
            "max_new": self.max_new_tokens,
            "generated": self.generated,
            "submitted": self.submitted_at,
            "admitted": self.admitted_at,
            "first_token": self.first_token_at,
            "completed": self.completed_at,
            "preemptions": self.preemptions,
            "lost": self.lost,
        }


@dataclass(frozen=True)
class EngineShape:
    """What the engine was built for; the limits move inside these bounds."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int = 16


@dataclass(frozen=True)
class StepPlan:
    preempt: list[Request]
    admit: list[Request]
    cap: int


@dataclass
class LimitChange:
    step: int
    at: float
    limits: dict[str, Any]


@dataclass
class Scheduler:
    shape: EngineShape
    clock: Callable[[], float]
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    lost: list[Request] = field(default_factory=list)
    max_num_running_reqs: int = 0
    max_num_scheduled_tokens: int = 0
    admission_paused: bool = False
    step: int = 0
    preemptions: int = 0

    def __post_init__(self) -> None:
        if self.max_num_running_reqs <= 0:
            self.max_num_running_reqs = self.shape.max_num_seqs
        if self.max_num_scheduled_tokens <= 0:
            self.max_num_scheduled_tokens = self.shape.max_num_batched_tokens

    def submit(self, request: Request) -> None:
        if request.prompt_tokens + request.max_new_tokens > self.shape.max_model_len:
            raise ValueError(f"request {request.request_id} is longer than max_model_len {self.shape.max_model_len}")
        self.waiting.append(request)

    def plan_step(self) -> StepPlan:
        """Preempt down to the cap (newest first), then admit from the queue's head within the budgets."""
        cap = self.max_num_running_reqs
        preempt: list[Request] = []
        while len(self.running) > cap:
            victim = max(self.running, key=lambda r: (r.admitted_at or 0.0, r.request_id))
            self.running.remove(victim)
            victim.preemptions += 1
            self.preemptions += 1
            preempt.append(victim)
        # Preempted requests go back to the head of the queue, oldest first.
        for victim in sorted(preempt, key=lambda r: (r.admitted_at or 0.0, r.request_id), reverse=True):
            self.waiting.appendleft(victim)
        admit: list[Request] = []
        if not self.admission_paused:
            budget = self.max_num_scheduled_tokens
            while self.waiting and len(self.running) + len(admit) < cap:
                head = self.waiting[0]
                # One prompt is always admitted alone, even over the budget (as vLLM does without chunking).
                if admit and head.context_tokens > budget:
                    break
                budget -= head.context_tokens
                admit.append(self.waiting.popleft())
        now = self.clock()
        for request in admit:
            request.admitted_at = now
        self.running.extend(admit)
        return StepPlan(preempt=preempt, admit=admit, cap=cap)

    def tokens_generated(self, requests: list[Request]) -> list[Request]:
        """One token for each; returns the ones that completed (already moved out of `running`)."""
        now = self.clock()
        completed = []
        for request in requests:
            request.generated += 1
            if request.first_token_at is None:
                request.first_token_at = now
            if request.done:
                request.completed_at = now
                completed.append(request)
        if completed:
            done_ids = {id(r) for r in completed}
            self.running = [r for r in self.running if id(r) not in done_ids]
            self.finished.extend(completed)
        self.step += 1
        return completed

    def lose_running(self) -> list[Request]:
        """The engine died (CUDA OOM): every request in the batch is lost, as with vLLM's EngineDeadError."""
        lost = list(self.running)
        for request in lost:
            request.lost = True
        self.running = []
        self.lost.extend(lost)
        return lost

    def tokens_in_cache(self) -> int:
        return sum(r.context_tokens for r in self.running)


class EngineControl:
    """The control object behind the engine-control endpoint; thread-safe, applied at step boundaries."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._lock = threading.Lock()
        self._applied = threading.Condition(self._lock)
        self._pending: dict[str, Any] = {}
        self._pending_seq = 0
        self._applied_seq = 0
        self._applied_at_step = 0
        self.changes: list[LimitChange] = []
        self.stepping = False

    # ---------------------------------------------------------------- engine thread

    def apply_pending(self) -> dict[str, Any] | None:
        """Called by the engine at the start of each step; returns the limits it applied, if any."""
        with self._lock:
            if not self._pending:
                return None
            applied, self._pending = self._pending, {}
            sched = self._scheduler
            if protocol.MAX_NUM_RUNNING_REQS in applied:
                sched.max_num_running_reqs = applied[protocol.MAX_NUM_RUNNING_REQS]
            if protocol.MAX_NUM_SCHEDULED_TOKENS in applied:
                sched.max_num_scheduled_tokens = applied[protocol.MAX_NUM_SCHEDULED_TOKENS]
            if protocol.ADMISSION_PAUSED in applied:
                sched.admission_paused = applied[protocol.ADMISSION_PAUSED]
            self._applied_seq = self._pending_seq
            self._applied_at_step = sched.step + 1
            self.changes.append(LimitChange(sched.step, sched.clock(), dict(applied)))
            self._applied.notify_all()
            return applied

    # ---------------------------------------------------------------- control thread

    def set_limits(self, limits: dict[str, Any]) -> dict[str, Any]:
        checked = self._check(limits)
        with self._lock:
            self._pending.update(checked)
            self._pending_seq += 1
            wanted = self._pending_seq
        if not self.stepping:
            # No step will come to apply them (idle or stopped): apply now, as the plugin does when idle.
            self.apply_pending()
        with self._lock:
            self._applied.wait_for(lambda: self._applied_seq >= wanted, timeout=_APPLY_WAIT_S)
            state = self._state_locked()
            state["applied"] = self._applied_seq >= wanted
            return state

    def _check(self, limits: dict[str, Any]) -> dict[str, Any]:
        shape = self._scheduler.shape
        checked: dict[str, Any] = {}
        for key, value in limits.items():
            if key not in protocol.LIMIT_KEYS:
                raise ScenarioLimitError(f"unknown limit {key!r}")
            if value is None:
                continue
            if key == protocol.ADMISSION_PAUSED:
                if not isinstance(value, bool):
                    raise ScenarioLimitError("admission_paused must be true or false")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ScenarioLimitError(f"{key} must be an integer")
            checked[key] = value
        cap = checked.get(protocol.MAX_NUM_RUNNING_REQS)
        if cap is not None and not 1 <= cap <= shape.max_num_seqs:
            raise ScenarioLimitError(f"max_num_running_reqs must be in [1, {shape.max_num_seqs}], got {cap}")
        budget = checked.get(protocol.MAX_NUM_SCHEDULED_TOKENS)
        if budget is not None and not shape.block_size <= budget <= shape.max_num_batched_tokens:
            bounds = f"[{shape.block_size}, {shape.max_num_batched_tokens}]"
            raise ScenarioLimitError(f"max_num_scheduled_tokens must be in {bounds}, got {budget}")
        chunk = checked.get(protocol.MAX_PREFILL_CHUNK_TOKENS)
        if chunk:
            raise ScenarioLimitError("the engine runs without chunked prefill; a prefill chunk cap needs it")
        checked.pop(protocol.MAX_PREFILL_CHUNK_TOKENS, None)
        return checked

    def control_state(self) -> dict[str, Any]:
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> dict[str, Any]:
        sched = self._scheduler
        shape = sched.shape
        return {
            "limits": {
                protocol.MAX_NUM_RUNNING_REQS: int(sched.max_num_running_reqs),
                protocol.MAX_NUM_SCHEDULED_TOKENS: int(sched.max_num_scheduled_tokens),
                protocol.MAX_PREFILL_CHUNK_TOKENS: 0,
                protocol.ADMISSION_PAUSED: bool(sched.admission_paused),
            },
            "engine": {
                "max_num_seqs": shape.max_num_seqs,
                "max_num_batched_tokens": shape.max_num_batched_tokens,
                "block_size": shape.block_size,
                "max_model_len": shape.max_model_len,
                "enable_chunked_prefill": False,
            },
            "step": int(sched.step),
            "applied_at_step": int(self._applied_at_step),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "cap_preemptions": int(sched.preemptions),
            "kv_cache_usage": self.kv_usage_locked(),
        }

    def kv_usage_locked(self) -> float:
        sched = self._scheduler
        capacity = sched.max_num_running_reqs * sched.shape.max_model_len
        return min(1.0, sched.tokens_in_cache() / capacity) if capacity else 0.0

    def list_requests(self) -> list[dict[str, Any]]:
        with self._lock:
            sched = self._scheduler
            items = [(r, "running") for r in sched.running] + [(r, "waiting") for r in sched.waiting]
            return [
                {
                    "request_id": r.request_id,
                    "priority": protocol.priority_tier_of_request_id(r.request_id),
                    "status": status,
                    "arrival_time": r.submitted_at,
                    "num_tokens": r.context_tokens,
                }
                for r, status in items
            ]

    def loads(self) -> dict[str, int | float]:
        """What vLLM's GetLoads reports for one data-parallel rank."""
        with self._lock:
            sched = self._scheduler
            used = sched.tokens_in_cache()
            return {
                "num_running_reqs": len(sched.running),
                "num_waiting_reqs": len(sched.waiting),
                "num_total_reqs": len(sched.running) + len(sched.waiting),
                "num_used_tokens": used,
                "max_total_num_tokens": sched.max_num_running_reqs * sched.shape.max_model_len,
                "token_usage": self.kv_usage_locked(),
                "max_running_requests": sched.max_num_running_reqs,
            }

    def locked(self) -> threading.Lock:
        """The engine holds this while it changes the scheduler's lists, so readers see whole steps."""
        return self._lock
