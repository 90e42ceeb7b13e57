"""Benchmarks of the capture kernels on the H200: snapshot, block statistics, interference.

Writes kernels_snapshot.json, kernels_stats.json and kernels_interference.json (format of
BENCHMARKS.md) into --out, each with the ceiling or baseline measured in the same run.
Run through scripts/gpu/kernels.sh on the H200; needs a CUDA device.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

from kernels import (
    BlockStatsDevice,
    BlockStatsWorkspace,
    KvSnapshotter,
    SnapshotConfig,
    SnapshotPlan,
    StatsLaunchConfig,
    block_stats_async,
    plan_block_sample,
    plan_snapshot,
    stats_bytes_moved,
)
from kernels.reference import block_stats_reference

COMMAND = "scripts/gpu/kernels.sh (on the H200, through the device tool's run)"
GIB = 1 << 30
log_lines: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    log_lines.append(msg)


def median_time(fn: Callable[[], None], reps: int) -> float:
    """Median wall seconds of fn, each run from an idle device to its completion."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def d2h_ceiling(nbytes: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)

    copy()
    t = median_time(copy, 7)
    return nbytes / t


def d2d_ceiling(nbytes: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = float(do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median"))
    return 2 * nbytes / (ms * 1e-3)


# --- snapshot -------------------------------------------------------------------------


def llama8b_cache(num_blocks: int, layers: int) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]


def reference_tiles(caches: list[torch.Tensor], plan: SnapshotPlan) -> torch.Tensor:
    tiles = plan.tiles.cuda()
    ref = torch.empty((plan.num_tiles, *plan.tile_shape), dtype=plan.dtype, device="cuda")
    for layer in range(len(caches)):
        rows = (tiles[:, 1] == layer).nonzero().squeeze(1)
        if rows.numel():
            ref[rows] = caches[layer][:, tiles[rows, 3]].transpose(0, 1)
    return ref.cpu()


def snapshot_and_wait(
    snapshotter: KvSnapshotter, caches: list[torch.Tensor], plan: SnapshotPlan, host: torch.Tensor
) -> None:
    snapshotter.snapshot(caches, plan, host).wait()


def bench_snapshot(out: dict[str, Any]) -> dict[str, Any]:
    layers, num_blocks, seqs, per_seq = 32, 2048, 128, 16
    caches = llama8b_cache(num_blocks, layers)
    order = torch.randperm(num_blocks).to(torch.int32)
    table = order.view(seqs, per_seq)
    # Two selections of 1 GiB each: every 4th block of each sequence (block ids random in
    # memory), and every 4th physical block of the pool (evenly spaced in memory).
    plans = {
        "seq": plan_snapshot(caches, table, range(seqs), range(layers), stride=4),
        "pool": plan_block_sample(caches, range(layers), stride=4, block_table=table),
    }
    for key, plan in plans.items():
        log(
            f"snapshot {key}: {plan.num_tiles} tiles of {plan.tile_bytes} B = {plan.nbytes / GIB:.2f} GiB, "
            f"{len(plan.strided_runs)} evenly spaced runs"
        )
    nbytes = plans["seq"].nbytes
    ceiling = d2h_ceiling(nbytes)
    log(f"D2H pinned ceiling ({nbytes / GIB:.2f} GiB memcpy): {ceiling / 1e9:.1f} GB/s")
    refs = {key: reference_tiles(caches, plan) for key, plan in plans.items()}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    variants: dict[str, tuple[str, SnapshotConfig]] = {
        "seq_staged_32MiB_fullgrid": ("seq", SnapshotConfig("staged", 32 << 20, None)),
        "seq_staged_32MiB_fullgrid_w8": ("seq", SnapshotConfig("staged", 32 << 20, None, 16384, 8)),
        "seq_staged_32MiB_16prog": ("seq", SnapshotConfig("staged", 32 << 20, 16)),
        "seq_zero_copy_fullgrid": ("seq", SnapshotConfig("zero_copy", 0, None)),
        "seq_copy_engine": ("seq", SnapshotConfig("copy_engine")),
        "seq_dma_batch": ("seq", SnapshotConfig("dma_batch", 0)),
        "pool_staged_32MiB_fullgrid_w8": ("pool", SnapshotConfig("staged", 32 << 20, None, 16384, 8)),
        "pool_copy_engine": ("pool", SnapshotConfig("copy_engine")),
    }
    results: dict[str, float] = {}
    figures: dict[str, Any] = {}
    for name, (key, config) in variants.items():
        plan = plans[key]
        try:
            snapshotter = KvSnapshotter("cuda", config)
            dma = snapshotter.uses_copy_engine(plan)
            if config.mode == "copy_engine":
                figures[f"pitched_copies_{name}"] = len(plan.strided_runs) * plan.parts if dma else None
            snapshotter.snapshot(caches, plan, host).wait()  # compile and warm
            host.fill_(0xA5)
            got = snapshotter.snapshot(caches, plan, host).wait()
            ok = torch.equal(got.view(torch.int16), refs[key].view(torch.int16))
            t0 = time.perf_counter()
            snap = snapshotter.snapshot(caches, plan, host)
            issue_s = time.perf_counter() - t0
            snap.wait()
            t = median_time(functools.partial(snapshot_and_wait, snapshotter, caches, plan, host), 5)
            if snapshotter.row_copy_fallbacks:
                log(f"  {name}: {snapshotter.row_copy_fallbacks} pitched copies refused, done row by row")
                figures[f"row_copy_fallbacks_{name}"] = snapshotter.row_copy_fallbacks
            results[name] = plan.nbytes / t
            figures[f"issue_ms_{name}"] = round(issue_s * 1e3, 3)
            log(
                f"  {name:30s} {plan.nbytes / t / 1e9:6.1f} GB/s  {plan.nbytes / t / ceiling:6.1%}  "
                f"copy_engine={dma}  issue {issue_s * 1e3:6.2f} ms  correct={ok}"
            )
            if not ok:
                results[name] = 0.0
                out.setdefault("errors", []).append(f"snapshot {name}: output differs from reference")
        except Exception as exc:  # one variant failing must not lose the others
            log(f"  {name}: FAILED {exc!r:.400}")
            out.setdefault("errors", []).append(f"snapshot {name}: {exc!r:.400}")
    best = max(results, key=results.__getitem__)
    out.update(
        figures={
            "gbps": round(results[best] / 1e9, 2),
            "fraction_of_d2h": round(results[best] / ceiling, 4),
            "best_variant": best,
            "snapshot_bytes": nbytes,
            "tile_bytes": plans["seq"].tile_bytes,
            **{f"gbps_{k}": round(v / 1e9, 2) for k, v in results.items()},
            **{f"fraction_of_d2h_{k}": round(v / ceiling, 4) for k, v in results.items()},
            **figures,
        },
        baseline={"d2h_pinned_memcpy_gbps": round(ceiling / 1e9, 2), "d2h_memcpy_bytes": nbytes},
        goal={"fraction_of_d2h": 0.85},
    )
    return {
        "caches": caches,
        "plans": plans,
        "host": host,
        "variants": variants,
        "results": results,
        "ceiling": ceiling,
    }


# --- interference ---------------------------------------------------------------------


def bench_interference(out: dict[str, Any], snap: dict[str, Any]) -> None:
    caches, plans, host = snap["caches"], snap["plans"], snap["host"]
    work_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    # Attention-sized products: 64 heads, 512 queries against 2048 keys, head_dim 128.
    q = torch.randn(64, 512, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 128, 2048, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(64, 2048, 128, device="cuda", dtype=torch.bfloat16)
    # Decode attention: 2048 (sequence, kv-head) pairs, 8 grouped queries, 1024 keys.
    dq = torch.randn(2048, 8, 128, device="cuda", dtype=torch.bfloat16)
    dk = torch.randn(2048, 128, 1024, device="cuda", dtype=torch.bfloat16)

    def gemm_work() -> None:
        for _ in range(200):
            torch.bmm(torch.bmm(q, k), v)

    def decode_work() -> None:
        for _ in range(100):
            torch.bmm(dq, dk)

    def timed(work: Callable[[], None]) -> float:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(work_stream):
            start.record()
            work()
            end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    results = snap["results"]
    ceiling = snap["ceiling"]
    # Zero-copy is left out: its resident programs triple the work's time (NOTES.md).
    candidates = [n for n in results if "zero_copy" not in n and results[n] > 0]
    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    works = {"attention_gemm": gemm_work, "decode_attention": decode_work}

    def slowdown_pct(work_name: str, variant: str) -> float:
        work = works[work_name]
        key, config = snap["variants"][variant]
        plan = plans[key]
        alone_ms = statistics.median(timed(work) for _ in range(3))
        snapshot_ms = plan.nbytes / results[variant] * 1e3
        repeats = int(alone_ms / snapshot_ms) + 2  # snapshots outlast the work
        snapshotter = KvSnapshotter("cuda", config)
        alone, shared, issue = [], [], []
        for _ in range(5):
            torch.cuda.synchronize()
            alone.append(timed(work))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            snaps = [snapshotter.snapshot(caches, plan, host) for _ in range(repeats)]
            issue.append(time.perf_counter() - t0)
            # Overlap checks at both ends: a host blocked while queueing the snapshots would
            # start the work late, and the figure would then time the work partly alone.
            first_done_early = snaps[0].ready()
            shared.append(timed(work))
            still_running = not snaps[-1].ready()
            for s in snaps:
                s.wait()
            if not still_running:
                out.setdefault("warnings", []).append(f"{work_name}/{variant}: snapshots ended before the work")
            if first_done_early:
                out.setdefault("warnings", []).append(f"{work_name}/{variant}: a snapshot ended before the work began")
        figures[f"issue_ms_{work_name}_{variant}"] = round(statistics.median(issue) * 1e3, 2)
        slowdown = (statistics.median(shared) / statistics.median(alone) - 1) * 100
        baseline[f"{work_name}_alone_ms"] = round(statistics.median(alone), 3)
        log(
            f"  {work_name:16s} {variant:30s} alone {statistics.median(alone):7.3f} ms  "
            f"with {statistics.median(shared):7.3f} ms  slowdown {slowdown:6.2f}%"
        )
        return round(slowdown, 2)

    for work_name in works:
        for _ in range(3):
            timed(works[work_name])
        for variant in candidates:
            try:
                figures[f"slowdown_pct_{work_name}_{variant}"] = slowdown_pct(work_name, variant)
            except Exception as exc:
                log(f"  {work_name} {variant}: FAILED {exc!r:.400}")
                out.setdefault("errors", []).append(f"interference {work_name}/{variant}: {exc!r:.400}")

    # The configuration to ship: the least slowdown of the attention products among the
    # variants that keep the snapshot at >= 85% of the D2H ceiling, measured again on its
    # own so that picking the minimum of noisy figures does not flatter it. Once over all
    # variants, once over the per-sequence selection alone (block ids random in memory).
    def pick(names: list[str]) -> str | None:
        fast = [n for n in names if results[n] / ceiling >= 0.85 and f"slowdown_pct_attention_gemm_{n}" in figures]
        return min(fast, key=lambda n: figures[f"slowdown_pct_attention_gemm_{n}"], default=None)

    chosen = pick(candidates)
    chosen_seq = pick([n for n in candidates if n.startswith("seq_")])
    again: dict[str, dict[str, float]] = {}
    for label, variant in (("any", chosen), ("seq", chosen_seq)):
        if variant is not None and variant not in again:
            log(f"  chosen ({label} selection): {variant}; measured again:")
            again[variant] = {w: slowdown_pct(w, variant) for w in works}
    figures = {
        "slowdown_pct": again[chosen]["attention_gemm"] if chosen else None,
        "slowdown_pct_decode_attention": again[chosen]["decode_attention"] if chosen else None,
        "snapshot_variant": chosen,
        "snapshot_fraction_of_d2h": round(results[chosen] / ceiling, 4) if chosen else None,
        "per_sequence_selection_variant": chosen_seq,
        "per_sequence_selection_slowdown_pct": again[chosen_seq]["attention_gemm"] if chosen_seq else None,
        "per_sequence_selection_slowdown_pct_decode_attention": again[chosen_seq]["decode_attention"]
        if chosen_seq
        else None,
        **figures,
    }
    baseline["d2h_pinned_memcpy_gbps"] = round(ceiling / 1e9, 2)
    out.update(figures=figures, baseline=baseline, goal={"slowdown_pct": 3.0})


# --- block statistics -----------------------------------------------------------------


def llama70b_pool_blocks(pool_bytes: float = 140e9) -> int:
    # 80 layers x 8 KV heads x head_dim 128 x bf16 x (K and V) x 16 tokens per block.
    return int(pool_bytes // (80 * 8 * 128 * 2 * 2 * 16))


def make_tables(
    num_blocks: int, rows: int, cols: int, used_fraction: float, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    used = int(num_blocks * used_fraction)
    weights = torch.rand(rows, device=device) + 0.05
    lens = (weights / weights.sum() * used).floor().to(torch.int32).clamp(max=cols)
    starts = torch.cumsum(lens, 0) - lens
    col = torch.arange(cols, device=device, dtype=torch.int32)
    valid = col[None, :] < lens[:, None]
    index = (starts[:, None] + col[None, :]).clamp(max=num_blocks - 1).long()
    table = torch.where(valid, order[index], torch.full_like(index, -1, dtype=torch.int32)).to(torch.int32)
    taken = int(lens.sum())
    rest = order[taken:]
    free = rest[torch.randperm(rest.numel(), device=device)][: int(rest.numel() * 0.98)]
    return table.contiguous(), lens, free.contiguous()


StatsCase = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]  # table, free, lengths, reference


def stats_cases(num_blocks: int, rows: int, count: int, with_lens: bool = False) -> list[StatsCase]:
    """``count`` independent pools of the same shape: fresh random contents for each."""
    cases: list[StatsCase] = []
    for _ in range(count):
        table, lens, free = make_tables(num_blocks, rows, 8192, used_fraction=0.9)
        if with_lens:
            table = table.clamp(min=0)  # vLLM's zero-padded table, lengths kept aside
        use_lens = lens if with_lens else None
        cases.append((table, free, use_lens, block_stats_reference(table, free, num_blocks, use_lens)))
    return cases


def graph_us_per_call(cases: list[StatsCase], ws: BlockStatsWorkspace, replays: int = 20) -> tuple[float, bool]:
    """GPU time of one call: a CUDA graph of one call per case (several cases, so each call
    reads a table that is not in L2), replayed back to back behind a sleep kernel so that no
    launch gap is timed. Checks every case's result after a replay into poisoned outputs."""
    outs = [BlockStatsDevice.empty(ws.num_blocks, c[0].shape[0], "cuda") for c in cases]
    calls = [
        functools.partial(block_stats_async, t, f, ws, lens, out=o)
        for (t, f, lens, _), o in zip(cases, outs, strict=True)
    ]
    graph = capture_graph(calls)
    for o in outs:
        o.totals.fill_(-1)
        o.blocks_per_seq.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    ok = all(o.to_host() == ref for o, (*_, ref) in zip(outs, cases, strict=True))
    us = replay_us(graph, len(calls), replays)
    ok = ok and all(o.to_host() == ref for o, (*_, ref) in zip(outs, cases, strict=True))
    return us, ok


def eager_us_per_call(case: StatsCase, ws: BlockStatsWorkspace) -> tuple[float, bool]:
    """One call as a Python caller makes it (launch overhead included), L2 flushed between calls."""
    table, free, lens, ref = case
    out = BlockStatsDevice.empty(ws.num_blocks, table.shape[0], "cuda")
    out.totals.fill_(-1)
    out.blocks_per_seq.fill_(-1)
    ok = block_stats_async(table, free, ws, lens, out=out).to_host() == ref
    ms = do_bench(
        functools.partial(block_stats_async, table, free, ws, lens, out=out), warmup=25, rep=100, return_mode="median"
    )
    return float(ms) * 1e3, ok and out.to_host() == ref


def capture_graph(calls: Sequence[Callable[[], Any]]) -> torch.cuda.CUDAGraph:
    for call in calls:
        call()  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, calls: int, replays: int = 20) -> float:
    """GPU time per call of a graph of ``calls`` calls: replayed back to back behind a sleep
    kernel so that no launch gap is timed, median of 7."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    per_call = []
    for _ in range(7):
        torch.cuda._sleep(2_000_000)  # type: ignore[no-untyped-call]  # ~1 ms of GPU time: replays queue meanwhile
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / (replays * calls))
    return float(statistics.median(per_call)) * 1e3


def graph_us_of(calls: Sequence[Callable[[], Any]]) -> float:
    """GPU time of one of ``calls``, timed like the statistics calls (each call on its own
    buffers, so L2-cold)."""
    return replay_us(capture_graph(calls), len(calls))


def graph_copy_us(half_bytes: int, copies: int) -> float:
    """One device-to-device copy of ``half_bytes`` (read + write = twice that)."""
    pairs = [
        (
            torch.empty(half_bytes, dtype=torch.uint8, device="cuda"),
            torch.empty(half_bytes, dtype=torch.uint8, device="cuda"),
        )
        for _ in range(copies)
    ]
    return graph_us_of([functools.partial(dst.copy_, src) for dst, src in pairs])


def bench_stats(out: dict[str, Any]) -> None:
    num_blocks = llama70b_pool_blocks()
    ceiling = d2d_ceiling(GIB)
    log(f"D2D ceiling (1 GiB copy, read+write): {ceiling / 1e12:.2f} TB/s; pool of {num_blocks} blocks")
    # Round 3 (one wave): 1024 row programs of 64-72 registers x 8 warps are 2-3 waves on
    # 132 SMs; the one-wave launches loop instead, or cap the registers so that all fit.
    configs = {
        "fused_r1_c2048_w4": StatsLaunchConfig(rows=1, cols=2048, mark_warps=4, one_wave=False),
        "fused_r1_c4096_w8": StatsLaunchConfig(rows=1, cols=4096, mark_warps=8, one_wave=False),
        "fused_r2_c1024_w4": StatsLaunchConfig(rows=2, cols=1024, mark_warps=4, one_wave=False),
        "fused_r1_c4096_w8_poll_load": StatsLaunchConfig(
            rows=1, cols=4096, mark_warps=8, poll_with_load=True, one_wave=False
        ),
        "two_launches_r1_c4096_w8": StatsLaunchConfig(rows=1, cols=4096, mark_warps=8, fused=False, one_wave=False),
        "fused_r1_c2048_w8_reg32": StatsLaunchConfig(cols=2048, maxnreg=32, one_wave=False),
        "one_wave_r1_c4096_w8": StatsLaunchConfig(cols=4096, one_wave=True),
        "one_wave_r1_c2048_w8": StatsLaunchConfig(cols=2048, one_wave=True),
        "one_wave_r1_c2048_w8_reg32": StatsLaunchConfig(cols=2048, one_wave=True, maxnreg=32),
        "one_wave_r1_c1024_w8_reg32": StatsLaunchConfig(cols=1024, one_wave=True, maxnreg=32),
        "one_wave_r1_c2048_w4": StatsLaunchConfig(cols=2048, mark_warps=4, one_wave=True),
        "one_wave_two_launches_r1_c2048_w8_reg32": StatsLaunchConfig(cols=2048, one_wave=True, maxnreg=32, fused=False),
    }
    figures: dict[str, Any] = {}
    # vLLM's table for max_num_seqs=1024, max_model_len=131072, block_size=16: 8192 columns.
    # 8 pools x 32 MiB = 256 MiB per graph replay, over 4x the L2.
    vllm = stats_cases(num_blocks, 1024, 8)
    nbytes = statistics.mean(stats_bytes_moved(t, f, num_blocks, lens) for t, f, lens, _ in vllm)
    graph_us: dict[str, float] = {}
    for cname, config in configs.items():
        try:
            ws = BlockStatsWorkspace(num_blocks, "cuda", config)
            g_us, g_ok = graph_us_per_call(vllm, ws)
            e_us, e_ok = eager_us_per_call(vllm[0], ws)
            tbps = nbytes / (g_us * 1e-6)
            log(
                f"  vllm_1024x8192 {cname:28s} graph {g_us:7.2f} us  {tbps / 1e12:5.2f} TB/s  {tbps / ceiling:6.1%}"
                f"   eager {e_us:7.2f} us  correct={g_ok and e_ok}"
            )
            figures[f"us_graph_vllm_1024x8192_{cname}"] = round(g_us, 2)
            figures[f"us_eager_vllm_1024x8192_{cname}"] = round(e_us, 2)
            if g_ok and e_ok:
                graph_us[cname] = g_us
            else:
                out.setdefault("errors", []).append(f"stats {cname}: differs from reference")
        except Exception as exc:
            log(f"  {cname}: FAILED {exc!r:.400}")
            out.setdefault("errors", []).append(f"stats {cname}: {exc!r:.400}")
    # The headline is the shipped default; the fastest configuration is reported beside it.
    best = min(graph_us, key=graph_us.__getitem__)
    chosen = next(name for name, config in configs.items() if config == StatsLaunchConfig())
    chosen_config = configs[chosen]
    chosen_tbps = nbytes / (graph_us[chosen] * 1e-6)
    figures["table_bytes_vllm_1024x8192"] = 1024 * 8192 * 4
    figures["bytes_moved_vllm_1024x8192"] = round(nbytes)
    del vllm
    # vLLM's zero-padded table with lengths: only the valid entries are read (0.3 MB). Also
    # for round 2's default, the baseline of the one-wave change.
    lens_cases = stats_cases(num_blocks, 1024, 4, with_lens=True)
    fastest = sorted(graph_us, key=graph_us.__getitem__)[:3]
    for cname in dict.fromkeys([chosen, *fastest, "fused_r1_c4096_w8"]):
        suffix = "" if cname == chosen else f"_{cname}"
        try:
            ws = BlockStatsWorkspace(num_blocks, "cuda", configs[cname])
            g_us, g_ok = graph_us_per_call(lens_cases, ws)
            e_us, e_ok = eager_us_per_call(lens_cases[0], ws)
            figures[f"us_graph_vllm_with_lengths{suffix}"] = round(g_us, 2)
            figures[f"us_eager_vllm_with_lengths{suffix}"] = round(e_us, 2)
            log(
                f"  with lengths (valid entries only) {cname}: graph {g_us:.2f} us  eager {e_us:.2f} us  "
                f"correct={g_ok and e_ok}"
            )
            if not (g_ok and e_ok):
                out.setdefault("errors", []).append(f"stats with lengths {cname}: differs from reference")
        except Exception as exc:
            log(f"  with lengths {cname}: FAILED {exc!r:.400}")
            out.setdefault("errors", []).append(f"stats with lengths {cname}: {exc!r:.400}")
    del lens_cases
    # A plain copy of the same byte count, timed the same way: what "of D2D" can be at this
    # size, where the 1 GiB ceiling hides launch and ramp-up costs.
    same_size_us = graph_copy_us(int(nbytes) // 2, copies=8)
    figures["us_graph_d2d_copy_same_bytes"] = round(same_size_us, 2)
    figures["fraction_of_d2d_same_size_copy"] = round(same_size_us / graph_us[chosen], 4)
    log(
        f"  D2D copy of the same bytes (graph): {same_size_us:.2f} us; "
        f"stats at {same_size_us / graph_us[chosen]:.1%} of its speed"
    )
    # Larger tables, default configuration: how the fraction grows once fixed costs amortise.
    for rows, count in ((4096, 2), (16384, 2)):
        label = f"{rows}x8192"
        try:
            cases = stats_cases(num_blocks, rows, count)
            big_bytes = statistics.mean(stats_bytes_moved(t, f, num_blocks) for t, f, _, _ in cases)
            ws = BlockStatsWorkspace(num_blocks, "cuda", chosen_config)
            g_us, g_ok = graph_us_per_call(cases, ws, replays=10)
            tbps = big_bytes / (g_us * 1e-6)
            log(
                f"  {label:14s} {chosen:28s} graph {g_us:7.2f} us  {tbps / 1e12:5.2f} TB/s  {tbps / ceiling:6.1%}"
                f"  correct={g_ok}"
            )
            figures[f"us_graph_{label}"] = round(g_us, 2)
            figures[f"tbps_graph_{label}"] = round(tbps / 1e12, 3)
            figures[f"fraction_of_d2d_{label}"] = round(tbps / ceiling, 4)
            if not g_ok:
                out.setdefault("errors", []).append(f"stats {label}: differs from reference")
            del cases
        except Exception as exc:
            log(f"  {label}: FAILED {exc!r:.400}")
            out.setdefault("errors", []).append(f"stats {label}: {exc!r:.400}")
    out.update(
        figures={
            "tbps": round(chosen_tbps / 1e12, 3),
            "fraction_of_d2d": round(chosen_tbps / ceiling, 4),
            "timing": "GPU time per call: CUDA-graph replay of 8 calls on 8 different tables (L2-cold), "
            "median of 7 x 20 replays; us_eager_* is one Python call, launch overhead included",
            "config": chosen,
            "fastest_config": best,
            "fraction_of_d2d_fastest": round(nbytes / (graph_us[best] * 1e-6) / ceiling, 4),
            "us_graph_per_call": round(graph_us[chosen], 2),
            "us_eager_per_call": figures[f"us_eager_vllm_1024x8192_{chosen}"],
            "fraction_of_d2d_eager": round(nbytes / (figures[f"us_eager_vllm_1024x8192_{chosen}"] * 1e-6) / ceiling, 4),
            "num_blocks": num_blocks,
            "table_shape": [1024, 8192],
            **figures,
        },
        baseline={"d2d_copy_tbps": round(ceiling / 1e12, 3), "d2d_copy_bytes": GIB},
        goal={"fraction_of_d2d": 0.70},
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--only", choices=["snapshot", "stats", "interference"], action="append")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        # `make bench` on a CPU machine: keep the committed H200 results untouched.
        print("kernels_h200: needs the H200; run scripts/gpu/kernels.sh there (device tool)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(time.time()))
    machine = torch.cuda.get_device_name()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    log(f"{machine}; torch {torch.__version__}; triton {triton.__version__}")
    only = set(args.only or ["snapshot", "stats", "interference"])

    def record(name: str, body: Callable[[dict[str, Any]], Any]) -> Any:
        out: dict[str, Any] = {"name": name, "measured_at": stamp, "machine": machine, "command": COMMAND}
        result = None
        try:
            result = body(out)
        except Exception:
            out.setdefault("errors", []).append(traceback.format_exc())
            log(traceback.format_exc())
        out["software"] = {"torch": torch.__version__, "triton": triton.__version__}
        (args.out / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
        return result

    if "stats" in only:
        record("kernels_stats", bench_stats)
    snap = None
    if only & {"snapshot", "interference"}:
        snap = record("kernels_snapshot", bench_snapshot)
    if "interference" in only and snap is not None:
        record("kernels_interference", lambda out: bench_interference(out, snap))
    (args.out / "kernels_bench.log").write_text("\n".join(log_lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
