"""The kernels compiled for the H200, against PyTorch on fresh random inputs.

Marked ``gpu``: scripts/gpu/kernels.sh runs them on the H200 (SITS_KERNELS_GPU=1);
elsewhere they are deselected with ``-m "not gpu"``.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import (
    BlockStatsDevice,
    BlockStatsWorkspace,
    KvSnapshotter,
    SnapshotConfig,
    StatsLaunchConfig,
    block_stats_async,
    plan_block_sample,
    plan_snapshot,
)
from kernels._launch import interpreting
from kernels.reference import block_stats_reference, snapshot_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(interpreting() or not torch.cuda.is_available(), reason="needs the H200 (compiled Triton)"),
]
LLAMA_70B_140GB_BLOCKS = 26_702


@pytest.fixture
def seed() -> int:
    """A fresh seed per run: the kernels must be right on any valid input, not on one."""
    return random.SystemRandom().randrange(2**31)


@pytest.mark.parametrize("mode", ["staged", "zero_copy", "copy_engine"])
@pytest.mark.parametrize("max_programs", [None, 7])
@pytest.mark.parametrize("block_dim", [1, 0])
def test_snapshot_on_gpu(mode: str, max_programs: int | None, block_dim: int, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks, layers = 300, 4
    shape = (2, num_blocks, 16, 8, 128) if block_dim == 1 else (num_blocks, 8, 16, 256)
    caches = [torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(layers)]
    order = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.cat([order[:240].view(12, 20), torch.full((12, 4), -1, device="cuda", dtype=torch.int32)], 1)
    plan = plan_snapshot(caches, table, [0, 3, 5, 11], [3, 1, 2], stride=3, phase=2, block_dim=block_dim)
    config = SnapshotConfig(mode=mode, staging_bytes=5 * plan.tile_bytes, max_programs=max_programs)  # type: ignore[arg-type]
    snapshotter = KvSnapshotter("cuda", config)
    host = snapshotter.allocate_host(plan)
    assert host.is_pinned()
    host.fill_(0xA5)
    got = snapshotter.snapshot(caches, plan, host).wait()
    ref = snapshot_reference(caches, plan, block_dim)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"seed {seed}"


@pytest.mark.parametrize("mode", ["copy_engine", "staged"])
def test_block_sample_on_gpu(mode: str, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    whole = torch.randn((6, 2, 200, 16, 8, 128), device="cuda", generator=gen).to(torch.bfloat16)
    caches = list(whole.unbind(0))
    plan = plan_block_sample(caches, [5, 0, 2], stride=7, phase=4)
    snapshotter = KvSnapshotter("cuda", SnapshotConfig(mode=mode, staging_bytes=6 * plan.tile_bytes))  # type: ignore[arg-type]
    assert snapshotter.uses_copy_engine(plan) == (mode == "copy_engine")
    host = snapshotter.allocate_host(plan)
    host.fill_(0xA5)
    got = snapshotter.snapshot(caches, plan, host).wait()
    assert torch.equal(got.view(torch.int16), snapshot_reference(caches, plan).view(torch.int16)), f"seed {seed}"


def test_snapshot_of_odd_layout_on_gpu(seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    caches = [torch.randn((2, 50, 3, 5, 7), device="cuda", generator=gen) for _ in range(3)]
    table = torch.randperm(50, device="cuda", generator=gen).to(torch.int32)[:40].view(4, 10)
    plan = plan_snapshot(caches, table, [1, 2], [0, 2], stride=2)
    snapshotter = KvSnapshotter("cuda", SnapshotConfig(staging_bytes=4 * plan.tile_bytes))
    host = snapshotter.allocate_host(plan)
    host.fill_(0xFF)
    got = snapshotter.snapshot(caches, plan, host).wait()
    assert torch.equal(got, snapshot_reference(caches, plan)), f"seed {seed}"


def random_pool(
    gen: torch.Generator, num_blocks: int, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    order = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    lens = torch.randint(0, 90, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    starts = torch.cumsum(lens, 0) - lens
    col = torch.arange(cols, device="cuda", dtype=torch.int32)
    valid = (col[None, :] < lens[:, None]) & (starts[:, None] + col[None, :] < num_blocks)
    lens = valid.sum(1).to(torch.int32)
    index = (starts[:, None] + col[None, :]).clamp(max=num_blocks - 1).long()
    table = torch.where(valid, order[index], -1).to(torch.int32)
    table[1, :5] = table[0, :5]  # shared prefix blocks
    taken = int(lens.sum())
    free = order[taken:][torch.randperm(num_blocks - taken, device="cuda", generator=gen)][: (num_blocks - taken) // 2]
    return table, lens, free


# The default (one wave), the two-launch form, one program per row, a register cap, and
# launches capped at 100 row programs so that each loops over several rows.
STATS_CONFIGS = {
    "default": StatsLaunchConfig(),
    "two-launches": StatsLaunchConfig(fused=False),
    "program-per-row-c4096": StatsLaunchConfig(one_wave=False, cols=4096),
    "one-wave-c1024-reg32": StatsLaunchConfig(cols=1024, maxnreg=32),
    "looping-100": StatsLaunchConfig(max_row_programs=100),
    "looping-100-two-launches": StatsLaunchConfig(max_row_programs=100, fused=False),
}


@pytest.mark.parametrize("config", STATS_CONFIGS.values(), ids=STATS_CONFIGS.keys())
def test_block_stats_graph_replays_on_new_contents(config: StatsLaunchConfig, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks, rows, cols = LLAMA_70B_140GB_BLOCKS, 512, 2048
    table, _, first_free = random_pool(gen, num_blocks, rows, cols)
    free = torch.full((num_blocks,), -1, device="cuda", dtype=torch.int32)  # -1: no entry
    free[: first_free.numel()] = first_free
    ws = BlockStatsWorkspace(num_blocks, "cuda", config)
    out = BlockStatsDevice.empty(num_blocks, rows, "cuda")
    block_stats_async(table, free, ws, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block_stats_async(table, free, ws, out=out)
    for _ in range(3):  # new contents in the captured buffers: nothing of the host is frozen in
        new_table, _, new_free = random_pool(gen, num_blocks, rows, cols)
        table.copy_(new_table)
        free.fill_(-1)
        free[: new_free.numel()] = new_free
        out.totals.fill_(-99)
        out.blocks_per_seq.fill_(-99)
        graph.replay()
        torch.cuda.synchronize()
        assert out.to_host() == block_stats_reference(table, free, num_blocks), f"seed {seed}"


@pytest.mark.parametrize("config", STATS_CONFIGS.values(), ids=STATS_CONFIGS.keys())
@pytest.mark.parametrize("with_lens", [False, True])
def test_block_stats_on_gpu_at_pool_size(with_lens: bool, config: StatsLaunchConfig, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks, rows, cols = LLAMA_70B_140GB_BLOCKS, 512, 2048
    table, lens, free = random_pool(gen, num_blocks, rows, cols)
    if with_lens:
        table = table.clamp(min=0)
    ws = BlockStatsWorkspace(num_blocks, "cuda", config)
    for _ in range(3):  # reuse: the maps must be cleared, the counters reset
        out = BlockStatsDevice.empty(num_blocks, rows, "cuda")
        out.totals.fill_(-99)
        out.blocks_per_seq.fill_(-99)
        got = block_stats_async(table, free, ws, lens if with_lens else None, out=out).to_host()
        assert got == block_stats_reference(table, free, num_blocks, lens if with_lens else None), f"seed {seed}"
