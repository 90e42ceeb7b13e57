"""SitsScheduler: vLLM's scheduler with limits the executor can move while the engine serves.

Loaded by vLLM inside the EngineCore process with
`--scheduler-cls services.executor.vllm_plugin.scheduler.SitsScheduler`.
When `SITS_ENGINE_CONTROL_ADDR` (host:port) is set, it serves the
engine-control endpoint (see `services.executor.engine_control_protocol`)
from a background thread.

Live limits, applied at the start of the next `schedule()` (one engine step):
- running cap: `max_num_running_reqs` and `max_num_active_reqs`. vLLM asserts
  `len(running) <= max_num_running_reqs` at the end of every step, so lowering
  the cap below the running count first preempts the excess the way vLLM
  preempts under KV pressure (blocks freed, request back to waiting, resumed
  by recomputation later): no stream is dropped. Victims are the lowest SITS
  tier, newest first. The cap never exceeds `max_num_seqs`, the model runner's
  slot count.
- token budget: `max_num_scheduled_tokens`, at most `max_num_batched_tokens`
  (the runner's input buffers are sized for it).
- prefill chunk cap: vLLM's `long_prefill_token_threshold` (0 = off). vLLM
  ignores it while a single request is eligible; then the step's token budget
  is lowered to the cap for that step, which cuts the lone prefill the same way.
- admission pause: for the step, vLLM's PAUSED_NEW state (only requests that
  still hold KV blocks may enter RUNNING: new and preempted requests wait, so
  KV use stops growing) while running requests keep decoding. Outside
  `schedule()` the state reads as unpaused, so the engine loop keeps stepping
  and resumes the queue as soon as admission resumes.

Changes are made under a lock that `schedule()` holds while it runs, so the
control thread never mutates the scheduler mid-step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from services.executor import engine_control_protocol as protocol
from services.executor.engine_control_protocol import LimitError

logger = logging.getLogger("sits.scheduler")

_PAUSED_IDLE_WAIT_S = 0.01
_APPLY_WAIT_S = 2.0


class SitsScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._control_lock = threading.Lock()
        self._applied = threading.Condition(self._control_lock)
        self._pending: dict[str, Any] = {}
        self._pending_seq = 0
        self._applied_seq = 0
        self._applied_at_step = 0
        self._admission_paused = False
        self._resume_signal = threading.Event()
        self._prefill_chunk_cap = int(self.scheduler_config.long_prefill_token_threshold or 0)
        self._running_ceiling = int(self.scheduler_config.max_num_seqs)
        self._token_ceiling = int(self.scheduler_config.max_num_batched_tokens)
        self._cap_preemptions = 0
        self._control_server: Any = None
        address = os.environ.get("SITS_ENGINE_CONTROL_ADDR")
        if address:
            from services.executor.vllm_plugin.control_server import start_control_server

            self._control_server = start_control_server(self, address)
            logger.info("SITS engine-control endpoint on %s", address)

    # ------------------------------------------------------------ engine step

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self._admission_paused and not self.running:
            # Paused with nothing running: the loop would spin on empty steps.
            self._resume_signal.wait(_PAUSED_IDLE_WAIT_S)
        with self._control_lock:
            self._apply_pending_locked()
            saved_budget = self.max_num_scheduled_tokens
            pause_for_step = self._admission_paused and self._pause_state == PauseState.UNPAUSED
            if pause_for_step:
                self._pause_state = PauseState.PAUSED_NEW
            if 0 < self._prefill_chunk_cap < saved_budget and self._eligible_count() <= 1:
                self.max_num_scheduled_tokens = self._prefill_chunk_cap
            try:
                return super().schedule(throttle_prefills)
            finally:
                self.max_num_scheduled_tokens = saved_budget
                if pause_for_step:
                    self._pause_state = PauseState.UNPAUSED

    def _eligible_count(self) -> int:
        num_running, num_waiting = self.get_request_counts()
        return num_running + num_waiting

    def _apply_pending_locked(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        cap = pending.get(protocol.MAX_NUM_RUNNING_REQS)
        if cap is not None:
            self.max_num_active_reqs = cap
            self._preempt_down_to(cap)
            self.max_num_running_reqs = cap
        budget = pending.get(protocol.MAX_NUM_SCHEDULED_TOKENS)
        if budget is not None:
            self.max_num_scheduled_tokens = budget
        chunk = pending.get(protocol.MAX_PREFILL_CHUNK_TOKENS)
        if chunk is not None:
            self._prefill_chunk_cap = chunk
            self.scheduler_config.long_prefill_token_threshold = chunk
        paused = pending.get(protocol.ADMISSION_PAUSED)
        if paused is not None:
            self._admission_paused = paused
            if paused:
                self._resume_signal.clear()
            else:
                self._resume_signal.set()
        self._applied_seq = self._pending_seq
        self._applied_at_step = self.current_step + 1
        self._applied.notify_all()

    def _preempt_down_to(self, cap: int) -> None:
        timestamp = time.monotonic()
        while len(self.running) > cap:
            candidates = [r for r in self.running if self._request_blocks_can_be_freed(r)]
            if not candidates:
                # Only connector-held requests are left; admission is already
                # capped, so they drain as they finish.
                break
            victim = max(candidates, key=_preemption_order)
            self.running.remove(victim)
            self._preempt_request(victim, timestamp)
            # As vLLM's own forced preemption does: the runner must not treat the
            # victim as scheduled in the previous step.
            self.prev_step_scheduled_req_ids.discard(victim.request_id)
            self._cap_preemptions += 1
        if len(self.running) > cap:
            # Keep vLLM's end-of-step invariant (running <= max_num_running_reqs).
            self.max_num_running_reqs = len(self.running)

    # ------------------------------------------------------- control thread

    def set_limits(self, limits: dict[str, Any]) -> dict[str, Any]:
        """Validate, queue for the next step, and wait until the step applied them."""
        checked = self._check_limits(limits)
        with self._control_lock:
            self._pending.update(checked)
            self._pending_seq += 1
            wanted = self._pending_seq
            if not self.has_requests():
                # Idle: no step will come to apply them, and nothing runs to preempt.
                self._apply_pending_locked()
            else:
                self._applied.wait_for(lambda: self._applied_seq >= wanted, timeout=_APPLY_WAIT_S)
            state = self._state_locked()
            state["applied"] = self._applied_seq >= wanted
            return state

    def _check_limits(self, limits: dict[str, Any]) -> dict[str, Any]:
        checked: dict[str, Any] = {}
        for key, value in limits.items():
            if key not in protocol.LIMIT_KEYS:
                raise LimitError(f"unknown limit {key!r}")
            if value is None:
                continue
            if key == protocol.ADMISSION_PAUSED:
                if not isinstance(value, bool):
                    raise LimitError("admission_paused must be true or false")
                checked[key] = value
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise LimitError(f"{key} must be an integer")
            checked[key] = value
        cap = checked.get(protocol.MAX_NUM_RUNNING_REQS)
        if cap is not None and not 1 <= cap <= self._running_ceiling:
            raise LimitError(f"max_num_running_reqs must be in [1, {self._running_ceiling}], got {cap}")
        budget = checked.get(protocol.MAX_NUM_SCHEDULED_TOKENS)
        if budget is not None and not self.block_size <= budget <= self._token_ceiling:
            raise LimitError(
                f"max_num_scheduled_tokens must be in [{self.block_size}, {self._token_ceiling}], got {budget}"
            )
        chunk = checked.get(protocol.MAX_PREFILL_CHUNK_TOKENS)
        if chunk is not None:
            if chunk != 0 and chunk < self.block_size:
                raise LimitError(f"max_prefill_chunk_tokens must be 0 (off) or >= {self.block_size}")
            if chunk != 0 and not self.scheduler_config.enable_chunked_prefill:
                raise LimitError("the engine runs without chunked prefill; a prefill chunk cap needs it")
        return checked

    def control_state(self) -> dict[str, Any]:
        with self._control_lock:
            return self._state_locked()

    def _state_locked(self) -> dict[str, Any]:
        num_running, num_waiting = self.get_request_counts()
        return {
            "limits": {
                protocol.MAX_NUM_RUNNING_REQS: int(self.max_num_active_reqs),
                protocol.MAX_NUM_SCHEDULED_TOKENS: int(self.max_num_scheduled_tokens),
                protocol.MAX_PREFILL_CHUNK_TOKENS: int(self._prefill_chunk_cap),
                protocol.ADMISSION_PAUSED: bool(self._admission_paused),
            },
            "engine": {
                "max_num_seqs": self._running_ceiling,
                "max_num_batched_tokens": self._token_ceiling,
                "block_size": int(self.block_size),
                "max_model_len": int(self.max_model_len),
                "enable_chunked_prefill": bool(self.scheduler_config.enable_chunked_prefill),
            },
            "step": int(self.current_step),
            "applied_at_step": int(self._applied_at_step),
            "running": num_running,
            "waiting": num_waiting,
            "cap_preemptions": self._cap_preemptions,
            "kv_cache_usage": float(self.get_kv_cache_usage()),
        }

    def list_requests(self) -> list[dict[str, Any]]:
        with self._control_lock:
            running = [(r, "running") for r in self.running]
            waiting = [(r, "waiting") for r in list(self.waiting) + list(self.kv_holding_waiting)]
            return [
                {
                    "request_id": external_request_id(request.request_id),
                    "priority": protocol.priority_tier_of_request_id(external_request_id(request.request_id)),
                    "status": status,
                    "arrival_time": float(request.arrival_time),
                    "num_tokens": int(request.num_tokens),
                }
                for request, status in running + waiting
            ]

    def shutdown(self) -> None:
        if self._control_server is not None:
            self._control_server.stop(grace=None)
            self._control_server = None
        super().shutdown()


def external_request_id(engine_request_id: str) -> str:
    """The client's id: vLLM appends "-<8 hex>" to make engine-side ids unique."""
    head, sep, tail = engine_request_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return head
    return engine_request_id


def _preemption_order(request: Request) -> tuple[int, int, float]:
    """Larger means preempted first: lowest SITS tier, then vLLM priority, then newest."""
    tier = protocol.priority_tier_of_request_id(external_request_id(request.request_id))
    return (tier, int(request.priority), float(request.arrival_time))
