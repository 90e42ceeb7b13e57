"""The inference workload: batched generation on a Llama-shaped model, with vLLM's control surfaces.

One process, as a vLLM engine would be:
- the generation loop (`Engine.run`): every step applies pending limits, preempts
  down to the batch cap, admits queued prompts, prefills them, decodes one
  token for every running request and completes the finished ones;
- the SITS engine-control endpoint, served by the executor's own
  `sits_engine/vllm_plugin/control_server.py` around this engine's
  `EngineControl` (the "max running sequences" cap is this engine's batch limit),
  so the unmodified executor drives it exactly as it drives vLLM;
- vLLM's `GetLoads` (smg `VllmEngine` service), which capture's vLLM source polls
  for running/waiting counts and KV usage;
- capture's in-process OOM hook (`sits_engine/oom_hook`).

A CUDA OOM inside a step kills the engine, as it kills vLLM (EngineDeadError):
every request in the batch at that moment is lost, the rest of the queue is
never served, and the process ends. The results (per request, per limit change,
a memory timeline) go to one JSON file.

Start-up handshake with the orchestrator (`run.py`): after loading and warming
up, the engine writes `--ready-file` (JSON: pid, memory figures) and waits for
`--go-file` (JSON: t0, the wall time the scenario starts); all requests are
submitted at t0.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import torch

from scenarios.h200_oom.batching import EngineControl, EngineShape, Request, Scheduler
from scenarios.h200_oom.files import wait_for_file, write_json
from scenarios.h200_oom.model import LLAMA_8B, TINY, KvCache, LlamaModel, release

log = logging.getLogger("h200_oom.workload")

SHAPES = {"llama8b": LLAMA_8B, "tiny": TINY}


# ---------------------------------------------------------------------------- control surfaces


def start_engine_control(control: EngineControl, address: str) -> Any:
    """The executor's engine-control server (the one inside vLLM) around this engine."""
    from sits_engine.vllm_plugin.control_server import start_control_server

    return start_control_server(control, address)  # type: ignore[arg-type]


def start_get_loads(control: EngineControl, address: str) -> Any:
    """vLLM's gRPC `GetLoads` for this engine (the other VllmEngine methods answer UNIMPLEMENTED)."""
    import grpc
    from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

    class Loads(vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
        def GetLoads(self, request: Any, context: Any) -> Any:
            figures = control.loads()
            reply = vllm_engine_pb2.GetLoadsResponse(dp_rank_count=1)
            reply.loads.add(dp_rank=0, **figures)
            return reply

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-loads"))
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(Loads(), server)
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot bind GetLoads on {address}")
    server.start()
    return server


# ---------------------------------------------------------------------------- the engine


class Engine:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.shape = SHAPES[args.shape]
        self.model = LlamaModel(self.shape, device, self.dtype, seed=args.seed)
        self.cache = KvCache(self.shape, args.slots, args.chunk_tokens, device, self.dtype)
        self.engine_shape = EngineShape(
            max_num_seqs=args.slots,
            max_num_batched_tokens=args.max_batched_tokens,
            max_model_len=args.max_model_len,
        )
        self.clock = time.time
        self.scheduler = Scheduler(self.engine_shape, self.clock)
        self.control = EngineControl(self.scheduler)
        self.slot_of: dict[str, int] = {}
        self.tokens = torch.zeros(args.slots, dtype=torch.long, device=device)
        self.timeline: list[dict[str, Any]] = []
        self.ooms: list[dict[str, Any]] = []
        self.resizes: list[dict[str, Any]] = []
        self.step_seconds: list[float] = []

    # ------------------------------------------------------------------ memory

    def memory(self) -> dict[str, int]:
        if self.device.type != "cuda":
            return {"kv_bytes": self.cache.nbytes}
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "kv_bytes": self.cache.nbytes,
            "torch_allocated": int(torch.cuda.memory_allocated(self.device)),
            "torch_reserved": int(torch.cuda.memory_reserved(self.device)),
            "device_free": int(free),
            "device_total": int(total),
        }

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_up(self) -> None:
        """One full prefill and decode at the largest sizes, then the cache is dropped again."""
        a = self.args
        n = min(a.slots, max(1, a.max_batched_tokens // a.prompt_tokens))
        self.cache.ensure_positions(a.prompt_tokens + 1)
        prompts = torch.randint(0, self.shape.vocab, (n, a.prompt_tokens), device=self.device)
        self.model.prefill(prompts, self.cache, list(range(n)))
        self.model.decode(self.tokens, self.cache, [a.prompt_tokens] * a.slots)
        self.sync()
        self.cache.drop_all()
        self.sync()

    # ------------------------------------------------------------------ one step

    def _resize_slots(self, cap: int) -> None:
        """The cache follows the batch cap: fewer slots free memory at once; more slots make room."""
        if cap == self.cache.slots:
            return
        started = time.monotonic()
        before = self.cache.nbytes
        order = sorted(self.slot_of.items(), key=lambda item: item[1])
        keep = [slot for _, slot in order]
        self.cache.resize_slots(keep, cap)
        tokens = torch.zeros(cap, dtype=torch.long, device=self.device)
        if keep:
            tokens[: len(keep)] = self.tokens[torch.tensor(keep, device=self.device)]
        self.tokens = tokens
        self.slot_of = {request_id: index for index, (request_id, _) in enumerate(order)}
        self.resizes.append(
            {
                "t": self.clock(),
                "slots": cap,
                "kv_bytes_before": before,
                "kv_bytes_after": self.cache.nbytes,
                "seconds": round(time.monotonic() - started, 4),
            }
        )

    def step(self) -> None:
        sched = self.scheduler
        self.control.apply_pending()
        with self.control.locked():
            plan = sched.plan_step()
        for request in plan.preempt:
            self.slot_of.pop(request.request_id, None)
        self._resize_slots(plan.cap)
        decoding = [r for r in sched.running if r.request_id in self.slot_of]
        free_slots = sorted(set(range(self.cache.slots)) - set(self.slot_of.values()))
        for request in plan.admit:
            self.slot_of[request.request_id] = free_slots.pop(0)
        # A request's last generated token is not in the cache yet: the decode writes it, at position
        # context_tokens - 1; a prefill writes positions [0, context_tokens).
        self.cache.ensure_positions(max([r.context_tokens for r in sched.running] or [1]))
        # Decode first: it writes every slot's next position, the new slots' too (position 0),
        # which their prefill below then overwrites.
        if decoding:
            lengths = [0] * self.cache.slots
            for request in decoding:
                lengths[self.slot_of[request.request_id]] = request.context_tokens - 1
            logits = self.model.decode(self.tokens, self.cache, lengths)
            self.tokens = logits.argmax(dim=-1)
        # Prefill the admitted prompts, one batch per length (resumed requests recompute prompt + output).
        by_length: dict[int, list[Request]] = {}
        for request in plan.admit:
            by_length.setdefault(request.context_tokens, []).append(request)
        for length, group in by_length.items():
            slots = [self.slot_of[r.request_id] for r in group]
            prompts = torch.randint(0, self.shape.vocab, (len(group), length), device=self.device)
            logits = self.model.prefill(prompts, self.cache, slots)
            self.tokens[torch.tensor(slots, device=self.device)] = logits.argmax(dim=-1)
        self.sync()
        with self.control.locked():
            completed = sched.tokens_generated(decoding + plan.admit)
        for request in completed:
            self.slot_of.pop(request.request_id, None)
        remaining = max([r.context_tokens for r in sched.running] or [0])
        self.cache.trim_positions(remaining)

    # ------------------------------------------------------------------ the run

    def submit_all(self, t0: float) -> None:
        a = self.args
        rng = random.Random(a.seed)
        for index in range(a.requests):
            tier = ("p0", "p1", "p2")[index % 3]
            self.scheduler.submit(
                Request(
                    request_id=f"{tier}-{index:05d}",
                    prompt_tokens=a.prompt_tokens,
                    max_new_tokens=rng.randint(a.min_new_tokens, a.max_new_tokens),
                    submitted_at=t0,
                )
            )

    def run(self, t0: float, deadline_s: float) -> str:
        sched = self.scheduler
        self.control.stepping = True
        last_sample = 0.0
        outcome = "completed"
        try:
            while sched.running or sched.waiting:
                now = self.clock()
                if now - t0 > deadline_s:
                    outcome = "deadline"
                    break
                started = time.monotonic()
                try:
                    self.step()
                except torch.OutOfMemoryError as error:
                    self.on_oom(error)
                    outcome = "oom"
                    break
                self.step_seconds.append(time.monotonic() - started)
                if now - last_sample >= self.args.sample_every_s:
                    last_sample = now
                    self.timeline.append(
                        {
                            "t": round(now - t0, 4),
                            "step": sched.step,
                            "running": len(sched.running),
                            "waiting": len(sched.waiting),
                            "cap": sched.max_num_running_reqs,
                            "finished": len(sched.finished),
                            **self.memory(),
                        }
                    )
        finally:
            self.control.stepping = False
        return outcome

    def on_oom(self, error: torch.OutOfMemoryError) -> None:
        with self.control.locked():
            lost = self.scheduler.lose_running()
        self.ooms.append(
            {
                "t": self.clock(),
                "step": self.scheduler.step,
                "message": str(error).split("\n")[0][:400],
                "lost_requests": len(lost),
                "kv_bytes": self.cache.nbytes,
            }
        )
        log.error("CUDA OOM at step %d: engine dead, %d requests lost", self.scheduler.step, len(lost))
        self.slot_of.clear()
        self.cache.drop_all()


def relative(record: dict[str, Any], t0: float) -> dict[str, Any]:
    """Times as seconds since the scenario's start."""
    for key in ("submitted", "admitted", "first_token", "completed"):
        if record[key] is not None:
            record[key] = round(record[key] - t0, 4)
    return record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    p.add_argument("--slots", type=int, default=160, help="max_num_seqs: the most running requests")
    p.add_argument("--chunk-tokens", type=int, default=512, help="KV cache growth granularity (positions)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-batched-tokens", type=int, default=16384, help="prompt tokens admitted per step")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--min-new-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=1536)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--deadline-s", type=float, default=150.0)
    p.add_argument("--sample-every-s", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-name", default="h200-engine")
    p.add_argument("--control-addr", default="", help="serve the SITS engine-control endpoint here")
    p.add_argument("--loads-addr", default="", help="serve vLLM's GetLoads here")
    p.add_argument("--capture-addr", default="", help="the OOM hook reports to capture here")
    p.add_argument("--hook-spool-dir", default="/tmp/h200-oom-hook-spool")
    p.add_argument("--ready-file", type=Path, required=True)
    p.add_argument("--go-file", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.prompt_tokens + args.max_new_tokens > args.max_model_len:
        raise SystemExit("prompt + max new tokens exceed max_model_len")
    hook = None
    if args.device == "cuda":
        from sits_engine.oom_hook.hook import HookConfig, install

        hook = install(
            HookConfig(
                capture_addr=args.capture_addr,
                engine=args.engine_name,
                spool_dir=args.hook_spool_dir,
                host=os.environ.get("SITS_HOST_NAME", "") or HookConfig().host,
            )
        )
    device = torch.device(args.device)
    started = time.monotonic()
    engine = Engine(args, device)
    engine.sync()
    load_s = time.monotonic() - started
    engine.warm_up()
    servers = []
    if args.control_addr:
        servers.append(start_engine_control(engine.control, args.control_addr))
    if args.loads_addr:
        servers.append(start_get_loads(engine.control, args.loads_addr))
    kv_full = engine.cache.bytes_for(args.slots, -(-args.max_model_len // args.chunk_tokens))
    ready = {
        "pid": os.getpid(),
        "load_s": round(load_s, 2),
        "params": engine.shape.params,
        "kv_bytes_per_token": engine.shape.kv_bytes_per_token,
        "kv_full_bytes": kv_full,
        "chunk_bytes": engine.cache.bytes_for(args.slots, 1),
        "hook": hook.status if hook else "cpu: not installed",
        **engine.memory(),
    }
    if device.type == "cuda":
        ready["gpu_uuid"] = str(torch.cuda.get_device_properties(device).uuid)
    write_json(args.ready_file, ready)
    log.info("ready: %s", ready)
    go = wait_for_file(args.go_file, timeout_s=600)
    t0 = float(go["t0"])
    time.sleep(max(0.0, t0 - time.time()))
    engine.submit_all(t0)
    outcome = engine.run(t0, args.deadline_s)
    ended = time.time()
    if hook is not None:
        hook.wait_idle(3.0)
    sched = engine.scheduler
    requests = [*sched.finished, *sched.lost, *sched.running, *sched.waiting]
    lost_ids = {r.request_id for r in sched.lost}
    result = {
        "outcome": outcome,
        "t0": t0,
        "ended": ended,
        "args": {k: str(v) for k, v in vars(args).items()},
        "ready": ready,
        "submitted": args.requests,
        "completed": len(sched.finished),
        "lost": len(lost_ids),
        "unfinished": args.requests - len(sched.finished) - len(lost_ids),
        "steps": sched.step,
        "preemptions": sched.preemptions,
        "ooms": engine.ooms,
        "oom_hook": {"status": hook.status, "reported": len(hook.reported), "spooled": len(hook.spooled)}
        if hook
        else None,
        "step_s_median": sorted(engine.step_seconds)[len(engine.step_seconds) // 2] if engine.step_seconds else None,
        "limit_changes": [{"t": c.at - t0, "step": c.step, "limits": c.limits} for c in engine.control.changes],
        "resizes": [{**r, "t": r["t"] - t0} for r in engine.resizes],
        "timeline": engine.timeline,
        "requests": [relative(r.record(), t0) for r in requests],
    }
    write_json(args.result, result)
    for server in servers:
        server.stop(grace=None)
    release()
    log.info(
        "%s: %d/%d completed, %d lost, %d OOM",
        outcome,
        len(sched.finished),
        args.requests,
        len(lost_ids),
        len(engine.ooms),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
