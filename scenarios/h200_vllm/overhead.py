"""What SITS costs a healthy engine on real decode steps: vLLM as it ships vs vLLM with SITS, one run.

    python -m scenarios.h200_vllm.overhead --out DIR [--shape llama-3-8b] [--reps 3]

Two engines of the same shape, started one after the other in the same call, each with vLLM's
default scheduling mode (async scheduling on; both logs are checked for it):
- "default": vLLM's own gRPC server, its own scheduler, nothing of SITS;
- "sits": the SITS launcher and `SitsScheduler` (which runs as `SitsAsyncScheduler`), the
  priority policy, the engine-control endpoint, and capture polling it 4 times a second with
  NVML at 10 Hz, as in production. Capture's samples of this run are a trace of a healthy,
  busy engine (no OOM) for the forecast benchmark.

The load: `--requests` streams of `--prompt` random tokens and `--new-tokens` new tokens each,
all sent at once, after a warm-up; repeated `--reps` times. Figures per variant: output
tokens/s over the batch (best and median of the reps) and the decode step time (median over
streams of the time between their tokens). `plugin_decode_overhead_pct` = the relative loss
of best tokens/s with SITS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scenarios.h200_oom.files import write_json
from scenarios.h200_vllm.engine import Engine, EngineConfig, parse_engine_log
from scenarios.h200_vllm.load import drive, health
from scenarios.h200_vllm.plan import Arrival
from scenarios.h200_vllm.run import CPU_GPU_UUID, ENGINE_NAME, HOST, Refusal, gpu_facts
from scenarios.h200_vllm.shapes import shape
from scenarios.h200_vllm.stack import Services, TansuBroker, new_token, read_records_sync, services_env
from sits.runtime import engine_control as protocol
from sits.runtime.procs import free_port
from sits_app.stack.vllm_engine import vllm_version

log = logging.getLogger("h200_vllm.overhead")


async def _batch(address: str, args: argparse.Namespace, vocab: int, seed: int) -> dict[str, float]:
    arrivals = tuple(Arrival(0.0, "p1", args.prompt, args.new_tokens, "decode") for _ in range(args.requests))
    t0 = time.time() + 0.2
    outcomes = await drive(address, arrivals, t0, scenario=f"overhead{seed}", vocab=vocab, seed=seed, timeout_s=300)
    done = [o for o in outcomes if o.completed and o.t_first is not None and o.t_done is not None]
    if len(done) < len(outcomes):
        raise RuntimeError(f"{len(outcomes) - len(done)} of {len(outcomes)} streams failed: {outcomes[0].error}")
    start = min(o.t_sent for o in done)
    end = max(o.t_done for o in done if o.t_done is not None)
    tokens = sum(o.tokens for o in done)
    steps = [((o.t_done or 0) - (o.t_first or 0)) / max(1, o.tokens - 1) for o in done]
    return {
        "tokens": tokens,
        "seconds": round(end - start, 4),
        "tokens_per_s": round(tokens / (end - start), 1),
        "step_ms_median": round(1000 * statistics.median(steps), 3),
    }


async def _poll_state(address: str, stop: asyncio.Event) -> dict[str, Any]:
    import grpc

    last: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        get_state = channel.unary_unary(
            protocol.GET_STATE, request_serializer=protocol.encode, response_deserializer=protocol.decode
        )
        while not stop.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError):
                last = await get_state({}, timeout=2.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    return last


async def verify_plugin(engine: Engine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The plugin on this vLLM: its state, a live token budget applied at the next step, every tier served."""
    from services.executor.adapters.engine import EngineControlClient

    out: dict[str, Any] = {}
    async with EngineControlClient(engine.control_address, timeout_s=10.0) as control:
        before = await control.state()
        out["engine_info"] = {
            "max_num_seqs": before.info.max_num_seqs,
            "max_num_batched_tokens": before.info.max_num_batched_tokens,
            "block_size": before.info.block_size,
        }
        started = time.perf_counter()
        lowered = await control.set_limits({protocol.MAX_NUM_SCHEDULED_TOKENS: 2048})
        out["set_limits_ms"] = round(1000 * (time.perf_counter() - started), 2)
        out["applied"] = lowered.applied
        out["budget_after"] = lowered.limits.max_num_scheduled_tokens
        prompt = min(3000, args.max_model_len // 2)
        arrivals = tuple(Arrival(0.0, tier, prompt, 16, "verify") for tier in ("p0", "p1", "p2") for _ in range(2))
        outcomes = await drive(engine.address, arrivals, time.time(), scenario="verify", vocab=vocab, timeout_s=120)
        out["tiers_completed"] = {
            t: sum(1 for o in outcomes if o.tier == t and o.completed) for t in ("p0", "p1", "p2")
        }
        out["errors"] = [o.error for o in outcomes if o.error][:3]
        restored = await control.set_limits({protocol.MAX_NUM_SCHEDULED_TOKENS: args.budget})
        out["budget_restored"] = restored.limits.max_num_scheduled_tokens
    return out


def measure(variant: str, args: argparse.Namespace, work: Path, logs: Path, broker: TansuBroker) -> dict[str, Any]:
    model = shape(args.shape)
    cpu = args.device == "cpu"
    if cpu:
        from sits_app.stack.vllm_engine import make_random_llama

        model_dir = make_random_llama()
    else:
        model_dir = model.write(work / "models" / model.name)
    engine = Engine(
        EngineConfig(
            model_dir=model_dir,
            port=free_port(),
            control_port=free_port(),
            sits=variant == "sits",
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.budget,
            gpu_memory_utilization=None if cpu else args.gpu_memory_utilization,
            dummy_weights=not cpu,
            enforce_eager=args.eager or cpu,
            priority=True,
            extra_args=tuple(args.engine_arg),
            env={"VLLM_CPU_KVCACHE_SPACE": "1"} if cpu else {},
        ),
        logs / f"overhead-{variant}-engine.log",
        work,
    )
    prefix = f"overhead-{variant}-{int(time.time())}."
    result: dict[str, Any] = {"variant": variant, "prefix": prefix}
    services: Services | None = None
    engine.start()
    started = time.monotonic()
    try:
        while not asyncio.run(health(engine.address, timeout_s=2.0)):
            if not engine.alive() or time.monotonic() - started > args.engine_timeout_s:
                raise RuntimeError(f"vLLM did not start:\n{engine.log_tail()}")
            time.sleep(0.5)
        result["engine_ready_s"] = round(time.monotonic() - started, 1)
        if variant == "sits":
            facts = gpu_facts() if args.device == "cuda" else {"uuid": CPU_GPU_UUID}
            env = services_env(
                bootstrap=broker.bootstrap,
                redis_url="redis://127.0.0.1:1/0",
                prefix=prefix,
                host=HOST,
                engine_name=ENGINE_NAME,
                gpu_uuid=facts["uuid"],
                engine_pids=engine.pids(),
                engine_addr=engine.address,
                control_addr=engine.control_address,
                policy_file=Path(__file__).with_name("gpu_policy.yaml"),
                decision_model=model.decision_model,
                token_file=new_token(work / "token"),
                work=work,
                nvml=args.device == "cuda",
            )
            services = Services(["capture"], env, logs, f"overhead-{variant}")
            services.start()
            services.wait_serving()
        vocab = 512 if cpu else model.vocab_size
        asyncio.run(_batch(engine.address, argparse.Namespace(**{**vars(args), "requests": 8}), vocab, 99))

        async def reps() -> tuple[list[dict[str, float]], dict[str, Any]]:
            stop = asyncio.Event()
            poller = asyncio.create_task(_poll_state(engine.control_address, stop)) if variant == "sits" else None
            out = []
            try:
                for rep in range(args.reps):
                    out.append(await _batch(engine.address, args, vocab, rep))
            finally:
                stop.set()
                state = await poller if poller is not None else {}
            return out, state

        runs, state = asyncio.run(reps())
        result["reps"] = runs
        result["tokens_per_s_best"] = max(r["tokens_per_s"] for r in runs)
        result["tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in runs)
        result["step_ms_median"] = statistics.median(r["step_ms_median"] for r in runs)
        result["plugin_state"] = state
        if variant == "sits":
            result["verify"] = asyncio.run(verify_plugin(engine, args, vocab))
    finally:
        if services is not None:
            services.stop()
        engine.stop()
    result["engine_log"] = parse_engine_log(engine.log_path.read_text(errors="replace"))
    if services is not None:
        result["records"] = read_records_sync(broker.bootstrap, prefix)
    return result


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", default="/tmp/sits-h200-vllm")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a rehearsal on the CPU build")
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--variants", nargs="+", default=["default", "sits"], choices=["default", "sits"])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (vLLM's default captures them)")
    p.add_argument("--engine-arg", action="append", default=[], help="one more vLLM flag (repeatable)")
    p.add_argument("--engine-timeout-s", type=float, default=400.0)
    args = p.parse_args(argv)
    try:
        if args.device == "cuda":
            gpu_facts()
    except Refusal as refusal:
        print(f"overhead: cannot run here: {refusal}", file=sys.stderr)
        return 2
    work = Path(args.work_dir)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    broker = TansuBroker(logs)
    broker.start()
    results: dict[str, dict[str, Any]] = {}
    try:
        for variant in args.variants:
            try:
                results[variant] = measure(variant, args, work, logs, broker)
            except Exception as error:
                log.exception("%s failed", variant)
                results[variant] = {"variant": variant, "error": f"{type(error).__name__}: {error}"}
            brief = {k: v for k, v in results[variant].items() if k not in ("records", "plugin_state")}
            print(json.dumps(brief), flush=True)
            write_json(args.out / "overhead.json", _summary(args, results))
    finally:
        broker.stop()
    summary = _summary(args, results)
    if "sits" in results:
        write_json(args.out / "overhead-sits-records.json", results["sits"].get("records", {}))
    print(json.dumps({k: v for k, v in summary.items() if "pct" in k}), flush=True)
    return 0


def _summary(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    load = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    summary: dict[str, Any] = {"engine": vllm_version(), "shape": args.shape, "load": load}
    for name, r in results.items():
        summary[name] = {k: v for k, v in r.items() if k != "records"}
    base, sits = results.get("default", {}), results.get("sits", {})
    if "tokens_per_s_best" in base and "tokens_per_s_best" in sits:
        summary["plugin_decode_overhead_pct"] = round(
            100 * (base["tokens_per_s_best"] - sits["tokens_per_s_best"]) / base["tokens_per_s_best"], 2
        )
        summary["plugin_decode_overhead_pct_median"] = round(
            100 * (base["tokens_per_s_median"] - sits["tokens_per_s_median"]) / base["tokens_per_s_median"], 2
        )
        summary["step_time_added_pct"] = round(
            100 * (sits["step_ms_median"] - base["step_ms_median"]) / base["step_ms_median"], 2
        )
    return summary


if __name__ == "__main__":
    sys.exit(main())
