"""SitsScheduler: vLLM's scheduler with SITS tiers and limits the executor can move while the engine serves.

Loaded by vLLM inside the EngineCore process with
`--scheduler-cls sits_engine.vllm_plugin.scheduler.SitsScheduler`.
When `SITS_ENGINE_CONTROL_ADDR` (host:port) is set, it serves the
engine-control endpoint (see `sits.runtime.engine_control`)
from a background thread. `SITS_ENGINE_EMPTY_CACHE_AT_START=1` gives the
caching allocator's unused blocks back to the device once the engine is built
(after vLLM's warm-up): the H200 scenarios use it so that a step larger than
any before it asks the device, as after a sleep/wake cycle.

Scheduling mode. vLLM picks `AsyncScheduler` when async scheduling is on (the
default where the executor supports it) and plain `Scheduler` otherwise; a
custom class that subclasses only `Scheduler` keeps the engine in its async
loop with a synchronous scheduler, which vLLM answers by disabling async
scheduling: 38% of decode throughput lost on the H200 (FACTS.md). So
`SitsScheduler(...)` builds a `SitsAsyncScheduler` (SITS on top of
`AsyncScheduler`) whenever the engine's config has async scheduling on: the
engine keeps the mode it would run without SITS.

Tiers. Every request's tier (P0 highest .. P2) is read from its request id,
whose prefix the SITS gRPC launcher writes from the tier Envoy routed it by
(`engine_control.retag_request_id`). Before vLLM queues a request the
plugin sets vLLM's own `priority` to the tier, so with
`--scheduling-policy priority` the waiting queue is ordered by tier, then
arrival, and vLLM's KV-exhaustion preemption takes the lowest tier first.
vLLM never preempts because the running set is at its cap; the plugin does:
when a P0 request heads the waiting queue and the running set is full, the
newest request of the lowest tier below P0 is preempted (one per step) so the
P0 is scheduled in this step. Per tier, the plugin keeps the controller's
signals (`tier_stats`): queue wait p50/p90, waiting count, oldest waiting age,
preemptions, KV blocks held.

Live limits, applied at the start of the next `schedule()` (one engine step):
- running cap: `max_num_running_reqs` (and `max_num_active_reqs` where vLLM
  has it, 0.32). vLLM asserts `len(running) <= max_num_running_reqs` at the
  end of every step, so lowering the cap below the running count first
  preempts the excess the way vLLM preempts under KV pressure (blocks freed,
  request back to waiting, resumed by recomputation later): no stream is
  dropped. Victims are the lowest SITS tier, newest first. The cap never
  exceeds `max_num_seqs`, the model runner's slot count.
- token budget: `max_num_scheduled_tokens`, at most `max_num_batched_tokens`
  (the runner's input buffers are sized for it).
- prefill chunk cap: vLLM's `long_prefill_token_threshold` (0 = off). vLLM
  ignores it while a single request is eligible; then the step's token budget
  is lowered to the cap for that step, which cuts the lone prefill the same way.
- admission pause: for the step, vLLM's PAUSED_NEW state (no request enters
  RUNNING, so KV use stops growing) while running requests keep decoding.
  Outside `schedule()` the state reads as unpaused, so the engine loop keeps
  stepping and resumes the queue as soon as admission resumes.

Changes are made under a lock that `schedule()` holds while it runs, so the
control thread never mutates the scheduler mid-step.

Abort (AbortRequests): the executor's drain and ABORT_LOW_PRIORITY end
requests through the plugin, so they work behind the OpenAI server too (it has
no abort call; vLLM's gRPC server has one). At the next `schedule()` the
requests are finished as FINISHED_ABORTED (`finish_requests`, as vLLM does for
a client's abort), and the next `update_from_output` adds an output with
finish reason ABORT for each, the output vLLM's own engine-side aborts send
(`EngineCoreProc._send_abort_outputs`, at shutdown and pause; the same
`EngineCoreOutput(request_id, [], finish_reason=...)` in 0.26 and 0.32): the
front end ends the stream with finish reason "abort" instead of waiting for
tokens that never come.

GetState also carries the engine's PyTorch caching allocator (reserved, allocated,
the least allocated seen: what stays between steps; `AllocatorReading`), read on
the control thread, so the decision can size a step's activations against what the
engine already holds (services/decision/domain/step_budget.py).

vLLM 0.26 (the H200 build) and 0.32 (the CPU build in tests) differ in what
this touches: 0.32 has `max_num_active_reqs`, `get_kv_cache_usage()`,
`kv_holding_waiting` and `_request_blocks_can_be_freed`; 0.26 has
`skipped_waiting` and none of the others. Each is read through a fallback below.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from sits.runtime import engine_control as protocol
from sits.runtime.contract import ALL_TIERS
from sits.runtime.engine_control import LimitError
from sits_engine.vllm_plugin.environment import ENGINE_CONTROL_ADDR, ENGINE_EMPTY_CACHE_AT_START
from sits_engine.vllm_plugin.tier_stats import TierStats

# Under vLLM's logger: vLLM configures only "vllm" (handler, format, VLLM_LOGGING_LEVEL), and a logger outside
# it wrote nothing to the engine's log below WARNING.
logger = logging.getLogger("vllm.sits.scheduler")

_PAUSED_IDLE_WAIT_S = 0.01
_APPLY_WAIT_S = 2.0


def _tier(request: Request) -> int:
    return protocol.priority_tier_of_request_id(request.request_id)


def _async_scheduling(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    config = kwargs.get("vllm_config", args[0] if args else None)
    return bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", False))


class SitsScheduler(Scheduler):
    def __new__(cls, *args: Any, **kwargs: Any) -> SitsScheduler:
        if cls is SitsScheduler and _async_scheduling(args, kwargs):
            cls = SitsAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._control_lock = threading.Lock()
        self._applied = threading.Condition(self._control_lock)
        self._pending: dict[str, Any] = {}
        self._pending_seq = 0
        self._applied_seq = 0
        self._applied_at_step = 0
        # Prefix-cache resets asked by the executor, done by the engine's own thread between steps.
        self._reset_asked_seq = 0
        self._reset_done_seq = 0
        self._reset_ok = False
        # Aborts asked by the executor (client ids), done by the engine's thread at the next step; the
        # streams they end, as (engine request id, front-end client index), until the next output.
        self._abort_asked: set[str] = set()
        self._abort_asked_seq = 0
        self._abort_done_seq = 0
        self._aborted: list[str] = []
        self._abort_outputs: list[tuple[str, int]] = []
        self._admission_paused = False
        self._resume_signal = threading.Event()
        self._prefill_chunk_cap = int(self.scheduler_config.long_prefill_token_threshold or 0)
        self._running_ceiling = int(self.scheduler_config.max_num_seqs)
        self._running_cap = self._running_ceiling
        self._token_ceiling = int(self.scheduler_config.max_num_batched_tokens)
        self._cap_preemptions = 0
        self._p0_preemptions = 0
        self._tier_stats = TierStats()
        self._allocator = AllocatorReading()
        if os.environ.get(ENGINE_EMPTY_CACHE_AT_START, "") in ("1", "true"):
            # The scheduler is built after vLLM's warm-up; what the warm-up left cached would let a
            # squeeze scenario's big step run from the cache instead of the device.
            self._allocator.release_cache()
        logger.info("SITS allocator at start: %s", self._allocator.read() or "no CUDA")
        # Tiers order the queue only under vLLM's priority policy; under FCFS a P0 could not overtake
        # the queue even after a preemption, so the plugin does not preempt for it there.
        self._by_priority = str(getattr(self.scheduler_config, "policy", "fcfs")) == "priority"
        self._control_server: Any = None
        address = os.environ.get(ENGINE_CONTROL_ADDR)
        if address:
            from sits_engine.vllm_plugin.control_server import start_control_server

            self._control_server = start_control_server(self, address)
            logger.info("SITS engine-control endpoint on %s", address)
        logger.info(
            "%s: async scheduling %s, %s policy",
            type(self).__name__,
            "on" if isinstance(self, AsyncScheduler) else "off",
            "priority" if self._by_priority else "fcfs",
        )

    # ------------------------------------------------------------ engine step

    def add_request(self, request: Request) -> None:
        # vLLM's heap orders by (priority, arrival): the tier Envoy routed by, never a client's number.
        request.priority = _tier(request)
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        if self._admission_paused and not self.running:
            # Paused with nothing running: the loop would spin on empty steps.
            self._resume_signal.wait(_PAUSED_IDLE_WAIT_S)
        with self._control_lock:
            self._apply_pending_locked()
            if self._abort_asked_seq > self._abort_done_seq:
                self._abort_locked()
            if self._reset_asked_seq > self._reset_done_seq and not self.running:
                self._reset_prefix_cache_locked()
            if self._by_priority:
                self._make_room_for_p0()
            saved_budget = self.max_num_scheduled_tokens
            pause_for_step = self._admission_paused and self._pause_state == PauseState.UNPAUSED
            if pause_for_step:
                self._pause_state = PauseState.PAUSED_NEW
            if 0 < self._prefill_chunk_cap < saved_budget and self._eligible_count() <= 1:
                self.max_num_scheduled_tokens = self._prefill_chunk_cap
            try:
                output = super().schedule(*args, **kwargs)
            finally:
                self.max_num_scheduled_tokens = saved_budget
                if pause_for_step:
                    self._pause_state = PauseState.UNPAUSED
            self._record_first_scheduled(output)
            return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._abort_outputs:
            ended, self._abort_outputs = self._abort_outputs, []
            for request_id, client_index in ended:
                batch = outputs.get(client_index)
                if batch is None:
                    batch = outputs[client_index] = EngineCoreOutputs(outputs=[])
                batch.outputs.append(EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT))
            logger.info("SITS abort: ended %s", ", ".join(f"{r} (client {c})" for r, c in ended))
        return outputs

    def _abort_locked(self) -> None:
        asked, self._abort_asked = self._abort_asked, set()
        ids = [r.request_id for r in self.requests.values() if external_request_id(r.request_id) in asked]
        finished = self.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for request in finished:
            self._abort_outputs.append((request.request_id, int(request.client_index)))
            self._aborted.append(external_request_id(request.request_id))
        self._abort_done_seq = self._abort_asked_seq
        logger.info("SITS abort: %d asked, %d finished as aborted", len(asked), len(finished))
        self._applied.notify_all()

    def _record_first_scheduled(self, output: SchedulerOutput) -> None:
        if not output.scheduled_new_reqs:
            return
        now = time.time()
        for new in output.scheduled_new_reqs:
            request = self.requests.get(new.req_id)
            # Resumed preemptions come back as new requests on some versions: their wait was counted.
            if request is not None and request.num_preemptions == 0:
                self._tier_stats.first_scheduled(_tier(request), now, float(request.arrival_time))

    def _make_room_for_p0(self) -> None:
        """Preempt the newest lowest-tier running request when a P0 heads the queue and cannot start.

        It cannot start when the running set is at its cap, or when the free KV blocks (cached
        ones included: vLLM evicts them on demand) do not hold its first chunk. vLLM would leave it
        waiting for a finish in both cases; one victim a step frees a slot and its blocks.
        """
        if not self.running or not self.waiting:
            return
        head = self.waiting.peek_request()
        if _tier(head) != 0:
            return
        block = max(1, int(self.block_size))
        first_chunk = min(int(head.num_tokens) - int(head.num_computed_tokens), int(self.max_num_scheduled_tokens))
        blocks_to_start = -(-max(1, first_chunk) // block) + 1
        at_cap = len(self.running) >= self.max_num_running_reqs
        if not at_cap and self.kv_cache_manager.block_pool.get_num_free_blocks() >= blocks_to_start:
            return
        victims = [r for r in self.running if _tier(r) > 0 and self._can_free(r)]
        if not victims:
            return
        victim = max(victims, key=_preemption_order)
        self.running.remove(victim)
        self._preempt_request(victim, time.monotonic())
        self.prev_step_scheduled_req_ids.discard(victim.request_id)
        self._p0_preemptions += 1

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        self._tier_stats.preempted(_tier(request))
        super()._preempt_request(request, *args, **kwargs)

    def _can_free(self, request: Request) -> bool:
        check = getattr(self, "_request_blocks_can_be_freed", None)
        return True if check is None else bool(check(request))

    def _waiting_requests(self) -> Iterable[Request]:
        for name in ("waiting", "skipped_waiting", "kv_holding_waiting"):
            queue = getattr(self, name, None)
            if queue:
                yield from queue

    def _eligible_count(self) -> int:
        num_running, num_waiting = self.get_request_counts()
        return num_running + num_waiting

    def _set_running_cap(self, cap: int) -> None:
        self._running_cap = cap
        self.max_num_running_reqs = cap
        if hasattr(self, "max_num_active_reqs"):
            self.max_num_active_reqs = cap

    def _apply_pending_locked(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        cap = pending.get(protocol.MAX_NUM_RUNNING_REQS)
        if cap is not None:
            self._set_running_cap(cap)
            self._preempt_down_to(cap)
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
            candidates = [r for r in self.running if self._can_free(r)]
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

    def abort_requests(self, request_ids: Any) -> dict[str, Any]:
        """Queue the requests' abort for the next step and wait until it is done (`_APPLY_WAIT_S` at most).

        Answers the ids it ended (ones already finished or unknown are not in it) and whether the step
        came in time; an abort not done in time still happens at the next step.
        """
        if not isinstance(request_ids, list) or not all(isinstance(i, str) and i for i in request_ids):
            raise LimitError("request_ids must be a list of request ids")
        with self._control_lock:
            if not request_ids or not self.has_requests():
                return {"aborted": [], "applied": True}
            self._abort_asked.update(request_ids)
            self._abort_asked_seq += 1
            wanted = self._abort_asked_seq
            done = self._applied.wait_for(lambda: self._abort_done_seq >= wanted, timeout=_APPLY_WAIT_S)
            aborted, self._aborted = [i for i in self._aborted if i in request_ids], []
            return {"aborted": aborted, "applied": bool(done)}

    def control_state(self) -> dict[str, Any]:
        with self._control_lock:
            return self._state_locked()

    def reset_prefix_cache_when_idle(self, wait_idle_s: float) -> dict[str, Any]:
        """Reset the prefix cache at the first step start with nothing running, waiting up to `wait_idle_s`.

        vLLM resets the cache only while no request holds blocks (what its own FlushCache waits for),
        and the reset must run on the engine's thread, between steps: it is queued for `schedule()`,
        or done at once when the engine has no request at all (no step would come).
        """
        with self._control_lock:
            self._reset_asked_seq += 1
            wanted = self._reset_asked_seq
            if not self.has_requests():
                self._reset_prefix_cache_locked()
            else:
                self._applied.wait_for(lambda: self._reset_done_seq >= wanted, timeout=max(0.0, wait_idle_s))
            if self._reset_done_seq >= wanted:
                reason = "" if self._reset_ok else "vLLM refused: blocks were still in use"
                return {"reset": self._reset_ok, "reason": reason}
            # Not done in time: withdraw it, so that no later step resets a cache nobody is waiting on.
            self._reset_asked_seq = self._reset_done_seq
            return {"reset": False, "reason": f"requests kept running for {wait_idle_s:g} s"}

    def _reset_prefix_cache_locked(self) -> None:
        # No arguments: vLLM 0.26 takes none, 0.32 defaults to leaving running requests alone.
        self._reset_ok = bool(self.reset_prefix_cache())
        self._reset_done_seq = self._reset_asked_seq
        self._applied.notify_all()

    def _state_locked(self) -> dict[str, Any]:
        num_running, num_waiting = self.get_request_counts()
        block_pool = self.kv_cache_manager.block_pool
        return {
            "limits": {
                protocol.MAX_NUM_RUNNING_REQS: int(self._running_cap),
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
                "policy": "priority" if self._by_priority else "fcfs",
                "async_scheduling": isinstance(self, AsyncScheduler),
            },
            "step": int(self.current_step),
            "applied_at_step": int(self._applied_at_step),
            "running": num_running,
            "waiting": num_waiting,
            "cap_preemptions": self._cap_preemptions,
            "p0_preemptions": self._p0_preemptions,
            "kv_cache_usage": float(self._kv_usage()),
            "kv_blocks_total": int(block_pool.num_gpu_blocks),
            "kv_blocks_free": int(block_pool.get_num_free_blocks()),
            "tiers": self._tiers_locked(),
            "allocator": self._allocator.read(),
        }

    def _kv_usage(self) -> float:
        # 0.32 has get_kv_cache_usage(); 0.26 only the manager's `usage` property.
        usage = getattr(self, "get_kv_cache_usage", None)
        return float(usage()) if callable(usage) else float(self.kv_cache_manager.usage)

    def _tiers_locked(self) -> dict[str, dict[str, float]]:
        now = time.time()
        tiers = {tier: {**stats} for tier, stats in self._tier_stats.snapshot(now).items()}
        for tier in ALL_TIERS:
            tiers[tier].update(running=0.0, waiting=0.0, oldest_wait_s=0.0, kv_blocks=0.0)
        block = max(1, int(self.block_size))
        for request in self.running:
            entry = tiers[_tier(request)]
            entry["running"] += 1
            entry["kv_blocks"] += -(-int(request.num_computed_tokens) // block)
        for request in self._waiting_requests():
            entry = tiers[_tier(request)]
            entry["waiting"] += 1
            entry["oldest_wait_s"] = max(entry["oldest_wait_s"], now - float(request.arrival_time))
        return {str(tier): entry for tier, entry in tiers.items()}

    def list_requests(self) -> list[dict[str, Any]]:
        with self._control_lock:
            running = [(r, "running") for r in self.running]
            waiting = [(r, "waiting") for r in self._waiting_requests()]
            return [
                {
                    "request_id": external_request_id(request.request_id),
                    "priority": _tier(request),
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


class SitsAsyncScheduler(SitsScheduler, AsyncScheduler):
    """SitsScheduler over vLLM's AsyncScheduler; `SitsScheduler(...)` picks it when async scheduling is on."""


class AllocatorReading:
    """The PyTorch caching allocator of this process, as the decision needs it to size a step.

    With one GPU, vLLM's worker runs inside the EngineCore process (the uniprocess executor), so
    this is the allocator that holds the weights, the KV cache and every step's activations.
    Read on the control thread when GetState asks (a few times a second), never in `schedule()`.
    `allocated_floor_bytes` is the least allocated seen since the engine started serving: the
    weights, KV cache and buffers that stay between steps; `reserved - floor` is what the
    allocator holds that the next step can reuse without asking the device. Empty without CUDA
    (the CPU build).
    """

    def __init__(self) -> None:
        self._floor: int | None = None
        self._cuda: Any = None
        self._available: bool | None = None

    def read(self) -> dict[str, int]:
        if self._available is None:
            self._available = self._probe()
        if not self._available:
            return {}
        try:
            stats = self._cuda.memory_stats()
            free, _total = self._cuda.mem_get_info()
        except Exception:
            return {}
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        self._floor = allocated if self._floor is None else min(self._floor, allocated)
        return {
            "allocated_bytes": allocated,
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "allocated_floor_bytes": self._floor,
            "peak_allocated_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
            "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "num_ooms": int(stats.get("num_ooms", 0)),
            # The device's free memory at the same moment, so that free + reusable is one snapshot.
            "device_free_bytes": int(free),
        }

    def release_cache(self) -> None:
        """Give the allocator's unused cached blocks back to the device (`torch.cuda.empty_cache`)."""
        if self._available is None:
            self._available = self._probe()
        if self._available:
            before = self.read()
            self._cuda.empty_cache()
            logger.info(
                "SITS released the allocator's cache: reserved %s -> %s bytes",
                before.get("reserved_bytes"),
                self.read().get("reserved_bytes"),
            )

    def _probe(self) -> bool:
        try:
            import torch

            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
                return False
        except Exception:
            return False
        self._cuda = torch.cuda
        return True


def external_request_id(engine_request_id: str) -> str:
    """The client's id: vLLM appends "-<8 hex>" to make engine-side ids unique."""
    head, sep, tail = engine_request_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return head
    return engine_request_id


def _preemption_order(request: Request) -> tuple[int, float]:
    """Larger means preempted first: lowest SITS tier, then newest."""
    return (_tier(request), float(request.arrival_time))
