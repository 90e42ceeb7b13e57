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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from kernels import (
    BlockStatsDevice,
    BlockStatsWorkspace,
    KvSnapshotter,
    SnapshotConfig,
    SnapshotPlan,
    StatsLaunchConfig,
    block_stats_async,
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


def snapshot_and_wait(snapshotter: KvSnapshotter, caches: list[torch.Tensor], plan: SnapshotPlan,
                      host: torch.Tensor) -> None:
    snapshotter.snapshot(caches, plan, host).wait()


def bench_snapshot(out: dict[str, Any]) -> dict[str, Any]:
    layers, num_blocks, seqs, per_seq = 32, 2048, 128, 16
    caches = llama8b_cache(num_blocks, layers)
    order = torch.randperm(num_blocks).to(torch.int32)
    table = order.view(seqs, per_seq)
    plan = plan_snapshot(caches, table, range(seqs), range(layers), stride=4)
    log(f"snapshot: {plan.num_tiles} tiles of {plan.tile_bytes} B = {plan.nbytes / GIB:.2f} GiB")
    ceiling = d2h_ceiling(plan.nbytes)
    log(f"D2H pinned ceiling ({plan.nbytes / GIB:.2f} GiB memcpy): {ceiling / 1e9:.1f} GB/s")
    ref = reference_tiles(caches, plan)
    host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
    variants = {
        "staged_32MiB_fullgrid": SnapshotConfig("staged", 32 << 20, None),
        "staged_32MiB_16prog": SnapshotConfig("staged", 32 << 20, 16),
        "staged_32MiB_64prog": SnapshotConfig("staged", 32 << 20, 64),
        "staged_32MiB_132prog": SnapshotConfig("staged", 32 << 20, 132),
        "staged_32MiB_fullgrid_w8": SnapshotConfig("staged", 32 << 20, None, 16384, 8),
        "staged_8MiB_fullgrid": SnapshotConfig("staged", 8 << 20, None),
        "staged_128MiB_16prog": SnapshotConfig("staged", 128 << 20, 16),
        "zero_copy_32prog": SnapshotConfig("zero_copy", 0, 32),
        "zero_copy_132prog": SnapshotConfig("zero_copy", 0, 132),
        "zero_copy_fullgrid": SnapshotConfig("zero_copy", 0, None),
    }
    results: dict[str, float] = {}
    for name, config in variants.items():
        try:
            snapshotter = KvSnapshotter("cuda", config)
            snapshotter.snapshot(caches, plan, host).wait()  # compile and warm
            host.fill_(0xA5)
            got = snapshotter.snapshot(caches, plan, host).wait()
            ok = torch.equal(got.view(torch.int16), ref.view(torch.int16))
            t = median_time(functools.partial(snapshot_and_wait, snapshotter, caches, plan, host), 5)
            results[name] = plan.nbytes / t
            log(f"  {name:24s} {plan.nbytes / t / 1e9:6.1f} GB/s  {plan.nbytes / t / ceiling:6.1%}  correct={ok}")
            if not ok:
                results[name] = 0.0
                out.setdefault("errors", []).append(f"snapshot {name}: output differs from reference")
        except Exception as exc:  # one variant failing must not lose the others
            log(f"  {name}: FAILED {exc!r:.400}")
            out.setdefault("errors", []).append(f"snapshot {name}: {exc!r:.400}")
    best = max(results, key=results.__getitem__)
    staged = {k: v for k, v in results.items() if k.startswith("staged")}
    zero = {k: v for k, v in results.items() if k.startswith("zero")}
    out.update(
        figures={
            "gbps": round(results[best] / 1e9, 2),
            "fraction_of_d2h": round(results[best] / ceiling, 4),
            "best_variant": best,
            "snapshot_bytes": plan.nbytes,
            "tile_bytes": plan.tile_bytes,
            **{f"gbps_{k}": round(v / 1e9, 2) for k, v in results.items()},
            "best_staged_fraction": round(max(staged.values(), default=0) / ceiling, 4),
            "best_zero_copy_fraction": round(max(zero.values(), default=0) / ceiling, 4),
        },
        baseline={"d2h_pinned_memcpy_gbps": round(ceiling / 1e9, 2), "d2h_memcpy_bytes": plan.nbytes},
        goal={"fraction_of_d2h": 0.85},
    )
    return {"caches": caches, "plan": plan, "host": host, "variants": variants, "results": results,
            "ceiling": ceiling}


# --- interference ---------------------------------------------------------------------

def bench_interference(out: dict[str, Any], snap: dict[str, Any]) -> None:
    caches, plan, host = snap["caches"], snap["plan"], snap["host"]
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
    staged_best = max((n for n in results if n.startswith("staged")), key=results.__getitem__, default=None)
    zero_best = max((n for n in results if n.startswith("zero")), key=results.__getitem__, default=None)
    candidates = [n for n in results if n.startswith("staged")] + ([zero_best] if zero_best else [])
    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    works = {"attention_gemm": gemm_work, "decode_attention": decode_work}

    def slowdown_pct(work_name: str, variant: str) -> float:
        work = works[work_name]
        alone_ms = statistics.median(timed(work) for _ in range(3))
        snapshot_ms = plan.nbytes / results[variant] * 1e3
        repeats = int(alone_ms / snapshot_ms) + 2  # snapshots outlast the work
        snapshotter = KvSnapshotter("cuda", snap["variants"][variant])
        alone, shared = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            alone.append(timed(work))
            torch.cuda.synchronize()
            snaps = [snapshotter.snapshot(caches, plan, host) for _ in range(repeats)]
            shared.append(timed(work))
            still_running = not snaps[-1].ready()
            for s in snaps:
                s.wait()
            if not still_running:
                out.setdefault("warnings", []).append(f"{work_name}/{variant}: snapshots ended before the work")
        slowdown = (statistics.median(shared) / statistics.median(alone) - 1) * 100
        baseline[f"{work_name}_alone_ms"] = round(statistics.median(alone), 3)
        log(f"  {work_name:16s} {variant:26s} alone {statistics.median(alone):7.3f} ms  "
            f"with {statistics.median(shared):7.3f} ms  slowdown {slowdown:6.2f}%")
        return round(slowdown, 2)

    for work_name in works:
        for _ in range(3):
            timed(works[work_name])
        for variant in candidates:
            figures[f"slowdown_pct_{work_name}_{variant}"] = slowdown_pct(work_name, variant)
    # The configuration to ship: the least slowdown of the attention products among the
    # variants that keep the snapshot at >= 85% of the D2H ceiling, measured again on its
    # own so that picking the minimum of noisy figures does not flatter it.
    fast = [n for n in candidates if results[n] / ceiling >= 0.85]
    chosen = min(fast, key=lambda n: figures[f"slowdown_pct_attention_gemm_{n}"], default=staged_best)
    log(f"  chosen: {chosen}; measured again:")
    again = {w: slowdown_pct(w, chosen) for w in works} if chosen else {}
    figures = {
        "slowdown_pct": again.get("attention_gemm"),
        "slowdown_pct_decode_attention": again.get("decode_attention"),
        "snapshot_variant": chosen,
        "snapshot_fraction_of_d2h": round(results[chosen] / ceiling, 4) if chosen else None,
        **figures,
    }
    baseline["d2h_pinned_memcpy_gbps"] = round(ceiling / 1e9, 2)
    out.update(figures=figures, baseline=baseline, goal={"slowdown_pct": 3.0})


# --- block statistics -----------------------------------------------------------------

def llama70b_pool_blocks(pool_bytes: float = 140e9) -> int:
    # 80 layers x 8 KV heads x head_dim 128 x bf16 x (K and V) x 16 tokens per block.
    return int(pool_bytes // (80 * 8 * 128 * 2 * 2 * 16))


def make_tables(num_blocks: int, rows: int, cols: int, used_fraction: float,
                device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def bench_stats(out: dict[str, Any]) -> None:
    num_blocks = llama70b_pool_blocks()
    ceiling = d2d_ceiling(GIB)
    log(f"D2D ceiling (1 GiB copy, read+write): {ceiling / 1e12:.2f} TB/s; pool of {num_blocks} blocks")
    configs = {
        "r4_c1024_w4": StatsLaunchConfig(rows=4, cols=1024, mark_warps=4),
        "r8_c1024_w8": StatsLaunchConfig(rows=8, cols=1024, mark_warps=8),
        "r2_c2048_w4": StatsLaunchConfig(rows=2, cols=2048, mark_warps=4),
        "r1_c4096_w8": StatsLaunchConfig(rows=1, cols=4096, mark_warps=8),
        "r16_c512_w8": StatsLaunchConfig(rows=16, cols=512, mark_warps=8),
    }
    figures: dict[str, Any] = {}
    best: tuple[float, str] = (0.0, "")
    # vLLM's table for max_num_seqs=1024, max_model_len=131072, block_size=16: 8192 columns.
    for rows, label in ((1024, "vllm_1024x8192"), (4096, "4096x8192"), (16384, "16384x8192")):
        table, lens, free = make_tables(num_blocks, rows, 8192, used_fraction=0.9)
        nbytes = stats_bytes_moved(table, free, num_blocks)
        ref = block_stats_reference(table, free, num_blocks)
        for cname, config in configs.items():
            if label != "vllm_1024x8192" and cname != best[1]:
                continue
            try:
                ws = BlockStatsWorkspace(num_blocks, "cuda", config)
                result = BlockStatsDevice.empty(num_blocks, rows, "cuda")
                result.totals.fill_(-1)
                result.blocks_per_seq.fill_(-1)
                ok = block_stats_async(table, free, ws, out=result).to_host() == ref
                ms = do_bench(functools.partial(block_stats_async, table, free, ws, out=result),
                              warmup=25, rep=200, return_mode="median")
                ok = ok and result.to_host() == ref  # still right after hundreds of reuses
                tbps = nbytes / (ms * 1e-3)
                log(f"  {label:16s} {cname:12s} {ms * 1e3:8.2f} us  {tbps / 1e12:5.2f} TB/s  "
                    f"{tbps / ceiling:6.1%}  correct={ok}")
                figures[f"tbps_{label}_{cname}"] = round(tbps / 1e12, 3)
                figures[f"us_{label}_{cname}"] = round(ms * 1e3, 2)
                if not ok:
                    out.setdefault("errors", []).append(f"stats {label}/{cname}: differs from reference")
                elif label == "vllm_1024x8192" and tbps > best[0]:
                    best = (tbps, cname)
            except Exception as exc:
                log(f"  {label} {cname}: FAILED {exc!r:.400}")
                out.setdefault("errors", []).append(f"stats {label}/{cname}: {exc!r:.400}")
        if label == "vllm_1024x8192":
            figures["table_bytes_vllm_1024x8192"] = table.numel() * 4
            figures["bytes_moved_vllm_1024x8192"] = nbytes
            # vLLM's zero-padded table with lengths: only the valid entries are read.
            zero_padded = table.clamp(min=0)
            ws = BlockStatsWorkspace(num_blocks, "cuda", configs[best[1]] if best[1] else None)
            ok = block_stats_async(zero_padded, free, ws, lens).to_host() == block_stats_reference(
                zero_padded, free, num_blocks, lens)
            ms = do_bench(functools.partial(block_stats_async, zero_padded, free, ws, lens), warmup=25,
                          rep=200, return_mode="median")
            figures["us_vllm_with_lengths"] = round(ms * 1e3, 2)
            log(f"  with lengths (reads valid entries only): {ms * 1e3:.2f} us correct={ok}")
    out.update(
        figures={
            "tbps": round(best[0] / 1e12, 3),
            "fraction_of_d2d": round(best[0] / ceiling, 4),
            "best_config": best[1],
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
