"""SITS on real vLLM: the engine that dies of a GPU OOM without SITS lives with it.

    python -m scenarios.h200_vllm.run --out DIR [--shape llama-3-8b] [--scenarios ...] [--modes without with]

On one NVIDIA GPU with vLLM installed (or `--device cpu`: a rehearsal of the wiring on the CPU
build, where nothing can run out of memory). Per scenario (`plan.py`) and mode:

1. a real vLLM gRPC server starts with the SITS scheduler plugin and the OOM hook
   (`engine.py`; weights drawn at random from a config.json of a real shape: `shapes.py`);
2. the SITS services start as their own processes against one Tansu broker and one Redis:
   "without": capture and decision only: they watch and warn, nothing acts, and the plugin is
   a passive observer (FCFS, no limit ever set), so the engine runs as vLLM ships; the run
   measures the death and how long before it the first warning came; "with": capture,
   decision, executor and validator: the whole loop;
3. after a short history, the clients send the plan's requests and the co-tenant
   (`cotenant.py`) takes free memory until the engine has only the plan's headroom left, and holds it;
4. the run ends when every request has ended; the engine's death (its OOM, its health check)
   and everything SITS said and did (Kafka topics) are recorded.

The squeeze is sized from the GPU found and the engine's shape (`plan.leave_bytes`); the run
refuses, with the reason, when there is no GPU, no vLLM, MIG is on, or too little is free.
It never changes MIG, clocks or other processes' memory: the co-tenant only takes free memory,
and gives it back when the run ends. Results: OUT/<shape>/<scenario>-<mode>.json, a trace of
each run (SITS trace v1), the logs, and OUT/summary.json (`report.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from scenarios.h200_oom.files import write_json
from scenarios.h200_vllm import plan as plans
from scenarios.h200_vllm.engine import Engine, EngineConfig, parse_engine_log
from scenarios.h200_vllm.load import Outcome, drive, health
from scenarios.h200_vllm.shapes import Shape, shape
from scenarios.h200_vllm.stack import Redis, Services, TansuBroker, new_token, read_records_sync, services_env
from sits.runtime import engine_control as protocol
from sits.runtime.procs import ManagedProcess, free_port
from sits_app.stack.vllm_engine import vllm_version

log = logging.getLogger("h200_vllm")
GIB = 1 << 30
HOST = "gpu-host"
ENGINE_NAME = "vllm-0"
REPO = Path(__file__).resolve().parents[2]
POLICY = Path(__file__).with_name("gpu_policy.yaml")
CPU_GPU_UUID = "GPU-cpu-rehearsal"
CPU_TOTAL = 80 * GIB
CPU_PRETEND_SHAPE = "llama-3-8b"


class Refusal(SystemExit):
    """The scenario cannot run here; the message says why and what to do."""


# ------------------------------------------------------------------ preflight


def gpu_facts() -> dict[str, Any]:
    """GPU 0 as NVML reports it, read only; Refusal when there is none."""
    try:
        import pynvml
    except ImportError:
        raise Refusal("no NVML here (pip install nvidia-ml-py): an NVIDIA GPU and its driver are needed") from None
    try:
        pynvml.nvmlInit()
    except Exception as error:
        raise Refusal(f"no NVIDIA GPU found (NVML: {error}); try --device cpu for a rehearsal") from None
    if pynvml.nvmlDeviceGetCount() < 1:
        raise Refusal("NVML sees no GPU")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with contextlib.suppress(Exception):
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        if current:
            raise Refusal("MIG is enabled on GPU 0; run on a GPU without MIG (this scenario never changes MIG mode)")
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    name = pynvml.nvmlDeviceGetName(handle)
    return {
        "uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid),
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "total": int(memory.total),
        "free": int(memory.free),
        "driver": str(pynvml.nvmlSystemGetDriverVersion()),
    }


def preflight(args: argparse.Namespace, model: Shape | None) -> dict[str, Any]:
    if not args.redis_url and not (shutil.which(args.redis_server) or Path(args.redis_server).is_file()):
        raise Refusal(f"no {args.redis_server!r} here: install Redis (redis-server) or pass --redis-url")
    if args.device == "cpu":
        return {"uuid": CPU_GPU_UUID, "name": "CPU rehearsal (virtual GPU)", "total": CPU_TOTAL, "free": CPU_TOTAL}
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise Refusal("vLLM is not installed in this Python: pip install vllm (CUDA build)")
    facts = gpu_facts()
    assert model is not None
    from services.decision.domain.kv_model import shape_from_hf_config

    weights = shape_from_hf_config(model.config).weight_bytes_per_rank(2)
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = plans.choose_utilization(facts["total"], weights)
    reason = plans.check_device(facts["total"], facts["free"], args.gpu_memory_utilization, weights)
    if reason:
        raise Refusal(reason)
    return facts


# ------------------------------------------------------------------ one run


class Monitor:
    """Engine health (vLLM HealthCheck) and the plugin's state, polled during the run."""

    def __init__(self, engine: Engine, t0: float) -> None:
        self.engine = engine
        self.t0 = t0
        self.health: list[tuple[float, bool]] = []
        self.states: list[dict[str, Any]] = []
        self.first_unhealthy: float | None = None
        self.last_state: dict[str, Any] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        import grpc

        async with grpc.aio.insecure_channel(self.engine.control_address) as channel:
            get_state = channel.unary_unary(
                protocol.GET_STATE, request_serializer=protocol.encode, response_deserializer=protocol.decode
            )
            tick = 0
            while not stop.is_set():
                now = time.time() - self.t0
                if tick % 2 == 0:
                    ok = await health(self.engine.address, timeout_s=1.0)
                    self.health.append((round(now, 3), ok))
                    if not ok and self.first_unhealthy is None:
                        self.first_unhealthy = now
                try:
                    state = await get_state({}, timeout=1.0)
                    self.last_state = state
                    limits = state.get("limits", {})
                    allocator = state.get("allocator", {})
                    self.states.append(
                        {
                            "t": round(now, 3),
                            "budget": limits.get(protocol.MAX_NUM_SCHEDULED_TOKENS),
                            "cap": limits.get(protocol.MAX_NUM_RUNNING_REQS),
                            "running": state.get("running"),
                            "waiting": state.get("waiting"),
                            "step": state.get("step"),
                            "reserved": allocator.get("reserved_bytes"),
                            "allocated": allocator.get("allocated_bytes"),
                            "floor": allocator.get("allocated_floor_bytes"),
                            "peak": allocator.get("peak_allocated_bytes"),
                        }
                    )
                except grpc.aio.AioRpcError:
                    pass
                tick += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)


async def _load_and_watch(
    engine: Engine, scenario: plans.ScenarioPlan, t0: float, vocab: int, timeout_s: float
) -> tuple[list[Outcome], Monitor]:
    monitor = Monitor(engine, t0)
    stop = asyncio.Event()
    watcher = asyncio.create_task(monitor.run(stop))
    try:
        outcomes = await drive(
            engine.address, scenario.arrivals, t0, scenario=scenario.name, vocab=vocab, timeout_s=timeout_s
        )
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await watcher
    return outcomes, monitor


class Run:
    def __init__(self, args: argparse.Namespace, facts: dict[str, Any], model: Shape | None) -> None:
        self.args = args
        self.facts = facts
        self.model = model
        self.out: Path = args.out
        self.logs = self.out / "logs"
        self.work = Path(args.work_dir)
        for folder in (self.logs, self.work):
            folder.mkdir(parents=True, exist_ok=True)
        self.broker = TansuBroker(self.logs)
        self.redis = Redis(args.redis_server, self.logs, url=args.redis_url)
        self.token = new_token(self.work / "token")
        self.model_dir = self._model_dir()

    # -------------------------------------------------------------- model and sizes

    def _model_dir(self) -> Path:
        if self.args.device == "cpu":
            from sits_app.stack.vllm_engine import make_random_llama

            return make_random_llama()
        assert self.model is not None
        return self.model.write(self.work / "models" / self.model.name)

    @property
    def vocab(self) -> int:
        return 512 if self.args.device == "cpu" else (self.model.vocab_size if self.model else 512)

    def decision_model(self) -> str:
        # The rehearsal's tiny model needs next to nothing per token: the decision is told it is an
        # 8B shape, so the virtual squeeze and the step rules meet at sizes it can see.
        return CPU_PRETEND_SHAPE if self.model is None else self.model.decision_model

    def leave_bytes(self) -> int:
        from services.decision.domain.kv_model import known_model

        model = known_model(self.decision_model())
        floor = 0 if self.args.device == "cpu" else GIB
        return plans.leave_bytes(model, self.args.budget, self.args.max_num_seqs, floor=floor)

    def scenario(self, name: str) -> plans.ScenarioPlan:
        long = self.args.long_prompt_tokens or None
        return plans.PLANS[name](self.args.budget, self.leave_bytes(), long_tokens=long)

    # -------------------------------------------------------------- one mode

    def run_mode(self, name: str, mode: str) -> dict[str, Any]:
        a = self.args
        scenario = self.scenario(name)
        tag = f"{name}-{mode}"
        prefix = f"{tag}-{int(time.time())}."
        ports = {"engine": free_port(), "control": free_port()}
        engine = Engine(
            EngineConfig(
                model_dir=self.model_dir,
                port=ports["engine"],
                control_port=ports["control"],
                sits=True,
                max_model_len=a.max_model_len,
                max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.budget,
                gpu_memory_utilization=None if a.device == "cpu" else a.gpu_memory_utilization,
                dummy_weights=a.device != "cpu",
                enforce_eager=True,
                # Without SITS the plugin only observes: vLLM's own FCFS order, no limit ever set.
                priority=mode == "with",
                # vLLM's warm-up can leave GiBs cached in the allocator; the step that should die then
                # runs from that cache (the re-run of 2026-12-04). Both modes start with it emptied.
                env={} if a.keep_warmup_cache else {"SITS_ENGINE_EMPTY_CACHE_AT_START": "1"},
            ),
            self.logs / f"{tag}-engine.log",
            self.work,
        )
        # The services' ports first: the OOM hook inside the engine reports to capture's.
        env = services_env(
            bootstrap=self.broker.bootstrap,
            redis_url=self.redis.url,
            prefix=prefix,
            host=HOST,
            engine_name=ENGINE_NAME,
            gpu_uuid=self.facts["uuid"],
            engine_pids=[],
            engine_addr=engine.address,
            control_addr=engine.control_address,
            policy_file=Path(a.policy_file),
            decision_model=self.decision_model(),
            token_file=self.token,
            work=self.work,
            nvml=a.device == "cuda",
        )
        engine.config.env.update(
            {
                "SITS_OOM_HOOK_CAPTURE_ADDR": env["SITS_CAPTURE_ADDR"],
                "SITS_OOM_HOOK_ENGINE": ENGINE_NAME,
                "SITS_OOM_HOOK_HOST": HOST,
                "SITS_OOM_HOOK_TOKEN": self.token.read_text().strip(),
                "SITS_OOM_HOOK_SPOOL_DIR": env["SITS_OOM_HOOK_SPOOL_DIR"],
            }
        )
        if a.device == "cpu":
            engine.config.env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        names = ["capture", "decision"] + (["executor", "validator"] if mode == "with" else [])
        files = {k: self.work / f"{tag}-{k}.json" for k in ("go", "cotenant", "cotenant-state")}
        for path in files.values():
            path.unlink(missing_ok=True)
        procs: list[ManagedProcess] = []
        services: Services | None = None
        result: dict[str, Any] = {"scenario": name, "mode": mode, "cause": scenario.cause, "prefix": prefix}
        t0 = 0.0
        outcomes: list[Outcome] = []
        monitor: Monitor | None = None
        log.info("== %s: starting vLLM (%s)", tag, self.model.name if self.model else "tiny CPU model")
        engine.start()
        try:
            ready_s = asyncio.run(self._wait_engine(engine, a.engine_timeout_s))
            result["engine_ready_s"] = round(ready_s, 1)
            result["engine_pids"] = engine.pids()
            env["SITS_CAPTURE_ENGINE_PIDS"] = json.dumps(result["engine_pids"])
            services = Services(names, env, self.logs, tag)
            services.start()
            result["services_ready_s"] = services.wait_serving()
            if a.device == "cpu":
                procs.append(self._cpu_gpu(env, prefix, files["cotenant-state"], tag))
            log.info("== %s: services up; %.0f s of history before t0", tag, a.history_s)
            time.sleep(a.history_s)
            t0 = time.time() + 1.0
            procs.append(self._cotenant(scenario, files, tag, engine.control_address))
            write_json(files["go"], {"t0": t0})
            timeout = scenario.load_s + a.drain_s
            outcomes, monitor = asyncio.run(_load_and_watch(engine, scenario, t0, self.vocab, timeout))
            time.sleep(a.tail_s)
            result["engine_alive_at_end"] = bool(engine.alive() and asyncio.run(health(engine.address)))
        except Exception as error:
            log.exception("%s failed", tag)
            result["error"] = f"{type(error).__name__}: {error}"
            result["engine_log_tail"] = engine.log_tail()
        finally:
            for proc in reversed(procs):
                proc.stop(grace_s=5)
            if services is not None:
                services.stop()
            engine.stop()
        records = read_records_sync(self.broker.bootstrap, prefix) if services is not None else {}
        cotenant = json.loads(files["cotenant"].read_text()) if files["cotenant"].exists() else None
        result.update(
            {
                "t0": t0,
                "shape": self.model.name if self.model else "tiny-cpu",
                "device": self.facts,
                "engine": vllm_version(),
                "services": names,
                "plan": {
                    "load_s": scenario.load_s,
                    "trigger_s": scenario.trigger_s,
                    "squeeze": vars(scenario.squeeze),
                    "notes": scenario.notes,
                    "submitted": scenario.submitted,
                },
                "engine_args": {
                    "max_num_batched_tokens": a.budget,
                    "max_num_seqs": a.max_num_seqs,
                    "max_model_len": a.max_model_len,
                    "gpu_memory_utilization": a.gpu_memory_utilization,
                },
                "engine_log": parse_engine_log(_read(engine.log_path)),
                "outcomes": [o.as_dict() for o in outcomes],
                "health": monitor.health if monitor else [],
                "first_unhealthy_s": monitor.first_unhealthy if monitor else None,
                "plugin_states": monitor.states if monitor else [],
                "plugin_last_state": monitor.last_state if monitor else None,
                "cotenant": cotenant,
                "records": records,
            }
        )
        write_json(self.out / f"{tag}.json", result)
        return result

    async def _wait_engine(self, engine: Engine, timeout_s: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if not engine.alive():
                raise RuntimeError(f"vLLM exited during start-up:\n{engine.log_tail()}")
            if await health(engine.address, timeout_s=2.0):
                return time.monotonic() - started
            await asyncio.sleep(0.5)
        raise TimeoutError(f"vLLM not healthy after {timeout_s} s:\n{engine.log_tail()}")

    def _cotenant(
        self, scenario: plans.ScenarioPlan, files: dict[str, Path], tag: str, control_address: str
    ) -> ManagedProcess:
        s = scenario.squeeze
        argv = [
            sys.executable,
            "-m",
            "scenarios.h200_vllm.cotenant",
            "--device",
            self.args.device,
            "--go-file",
            str(files["go"]),
            "--result",
            str(files["cotenant"]),
            "--start-s",
            str(s.start_s),
            "--period-s",
            str(s.period_s),
            "--steps",
            str(s.steps),
            "--leave-bytes",
            str(s.leave_bytes),
            "--engine-control",
            control_address,
        ]
        if self.args.device == "cpu":
            argv += ["--cpu-free-bytes", str(CPU_TOTAL // 2), "--state-file", str(files["cotenant-state"])]
        proc = ManagedProcess("cotenant", argv, self.logs / f"{tag}-cotenant.log", env=_env(), cwd=REPO)
        proc.start()
        return proc

    def _cpu_gpu(self, env: dict[str, str], prefix: str, state: Path, tag: str) -> ManagedProcess:
        argv = [
            sys.executable,
            "-m",
            "scenarios.h200_vllm.gpu_standin",
            "--bootstrap",
            self.broker.bootstrap,
            "--topic-prefix",
            prefix,
            "--host",
            HOST,
            "--gpu-uuid",
            CPU_GPU_UUID,
            "--engine",
            ENGINE_NAME,
            "--total-bytes",
            str(CPU_TOTAL),
            "--engine-bytes",
            str(CPU_TOTAL // 2),
            "--state-file",
            str(state),
        ]
        proc = ManagedProcess("cpu-gpu", argv, self.logs / f"{tag}-cpu-gpu.log", env=_env(), cwd=REPO)
        proc.start()
        return proc

    # -------------------------------------------------------------- all of it

    def run(self) -> int:
        self.broker.start()
        self.redis.start()
        ran: list[dict[str, Any]] = []
        try:
            for name in self.args.scenarios:
                for mode in self.args.modes:
                    result = self.run_mode(name, mode)
                    ran.append(result)
                    print(json.dumps(brief(result)), flush=True)
        finally:
            self.redis.stop()
            self.broker.stop()
        from scenarios.h200_vllm.report import summarize

        summary = summarize(ran)
        write_json(self.out / "summary.json", summary)
        print(json.dumps(summary.get("totals", {}), indent=1), flush=True)
        return 0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def brief(result: dict[str, Any]) -> dict[str, Any]:
    outcomes = result.get("outcomes", [])
    return {
        "run": f"{result['scenario']}-{result['mode']}",
        "error": result.get("error"),
        "engine_ready_s": result.get("engine_ready_s"),
        "submitted": len(outcomes),
        "completed": sum(1 for o in outcomes if o["completed"]),
        "first_unhealthy_s": result.get("first_unhealthy_s"),
        "commands": len(result.get("records", {}).get("commands", [])),
        "verdicts": len(result.get("records", {}).get("verdicts", [])),
        "ooms": len(result.get("records", {}).get("oom", [])),
        "oom_in_log": result.get("engine_log", {}).get("oom_in_log"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", default="/tmp/sits-h200-vllm")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--shape", default="llama-3-8b", help="model shape (weights drawn at random): llama-3-8b, qwen2.5-14b"
    )
    p.add_argument("--scenarios", nargs="+", default=list(plans.PLANS), choices=list(plans.PLANS))
    p.add_argument("--modes", nargs="+", default=["without", "with"], choices=["without", "with"])
    p.add_argument("--budget", type=int, default=32768, help="the engine's max_num_batched_tokens (its step budget)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="default: 0.45 on a GPU of 100 GiB or more, else sized",
    )
    p.add_argument("--long-prompt-tokens", type=int, default=0, help="long prompts' length (0: from the budget)")
    p.add_argument("--policy-file", default=str(POLICY))
    p.add_argument("--history-s", type=float, default=8.0, help="engine and memory history before t0")
    p.add_argument("--drain-s", type=float, default=90.0, help="how long requests may take after the load ends")
    p.add_argument("--tail-s", type=float, default=2.0)
    p.add_argument("--engine-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--keep-warmup-cache",
        action="store_true",
        help="leave what vLLM's warm-up cached in the allocator (default: emptied once the engine is built)",
    )
    p.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    p.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    model = None if args.device == "cpu" else shape(args.shape)
    if args.device == "cpu":
        # The CPU build's tiny model: a small budget and short prompts, same plan otherwise.
        args.budget = min(args.budget, 2048)
        args.max_model_len = min(args.max_model_len, 2048)
        args.max_num_seqs = min(args.max_num_seqs, 32)
        args.long_prompt_tokens = args.long_prompt_tokens or 384
    try:
        facts = preflight(args, model)
    except Refusal as refusal:
        print(f"sits demo --gpu: cannot run here: {refusal}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return Run(args, facts, model).run()
    return 130


if __name__ == "__main__":
    sys.exit(main())
