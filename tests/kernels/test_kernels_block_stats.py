"""Block statistics kernels against the PyTorch reference, in Triton's interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import BlockStatsDevice, BlockStatsWorkspace, StatsLaunchConfig, block_stats, block_stats_async
from kernels._launch import is_interpreted
from kernels.block_stats import _mark_kernel, _programs_per_sm, _scan_kernel, _stats_kernel
from kernels.reference import block_stats_reference

POISON = -123_456_789
# Small chunks so that a few hundred blocks already span many chunks of the scan.
SMALL = StatsLaunchConfig(rows=2, cols=16, free_block=32, chunk=32, one_wave=False)
TWO_LAUNCHES = StatsLaunchConfig(rows=2, cols=16, free_block=32, chunk=32, fused=False, one_wave=False)
POLL_WITH_LOAD = StatsLaunchConfig(rows=2, cols=16, free_block=32, chunk=32, poll_with_load=True)
# Fewer row programs than row groups: each program loops over several groups.
LOOPING = StatsLaunchConfig(rows=2, cols=16, free_block=32, chunk=32, max_row_programs=2)
LOOPING_TWO_LAUNCHES = StatsLaunchConfig(rows=2, cols=16, free_block=32, chunk=32, max_row_programs=2, fused=False)


@pytest.fixture
def seed() -> int:
    """A fresh seed per run: the kernels must be right on any valid input, not on one."""
    return random.SystemRandom().randrange(2**31)


def make_pool(
    gen: torch.Generator, num_blocks: int, num_seqs: int, max_cols: int, share: bool, free_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A -1 padded table, its lengths, and a shuffled free list over the rest of the pool."""
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    lens = torch.randint(0, max_cols + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    table = torch.full((num_seqs, max_cols), -1, dtype=torch.int32)
    taken = 0
    for row, n in enumerate(lens.tolist()):
        n = min(n, num_blocks - taken)
        lens[row] = n
        table[row, :n] = order[taken : taken + n]
        taken += n
    if share and num_seqs > 1 and int(lens[0]) > 0:
        shared = min(int(lens[0]), int(lens[1]))
        table[1, :shared] = table[0, :shared]  # a prefix-cache hit: the same blocks twice
    rest = order[taken:]
    keep = int(rest.numel() * free_fraction)
    free = rest[torch.randperm(rest.numel(), generator=gen)[:keep]]
    return table, lens, free


def poisoned(num_blocks: int, num_seqs: int) -> BlockStatsDevice:
    out = BlockStatsDevice.empty(num_blocks, num_seqs, "cpu")
    out.blocks_per_seq.fill_(POISON)
    out.totals.fill_(POISON)
    return out


def test_kernels_run_in_triton_interpreter() -> None:
    assert all(is_interpreted(k) for k in (_mark_kernel, _scan_kernel, _stats_kernel))


@pytest.mark.parametrize(
    "config",
    [SMALL, TWO_LAUNCHES, LOOPING, LOOPING_TWO_LAUNCHES],
    ids=["fused", "two-launches", "looping", "looping-two-launches"],
)
@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("with_lens", [False, True])
def test_block_stats_match_reference(case: int, with_lens: bool, config: StatsLaunchConfig, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = int(torch.randint(200, 700, (1,), generator=gen))
    num_seqs = int(torch.randint(1, 12, (1,), generator=gen))
    table, lens, free = make_pool(
        gen, num_blocks, num_seqs, max_cols=40, share=case % 2 == 0, free_fraction=[1.0, 0.9, 0.5, 0.97][case]
    )
    if with_lens:
        table = table.clamp(min=0)  # vLLM pads with 0 and keeps the lengths aside
    workspace = BlockStatsWorkspace(num_blocks, "cpu", config)
    out = poisoned(num_blocks, num_seqs)
    got = block_stats_async(table, free, workspace, lens if with_lens else None, out=out).to_host()
    assert got == block_stats_reference(table, free, num_blocks, lens if with_lens else None), f"seed {seed}"
    assert POISON not in out.blocks_per_seq.tolist()


def test_free_run_spanning_whole_chunks() -> None:
    num_blocks = 32 * 6  # chunks 1..4 entirely free: the run crosses chunk boundaries
    table = torch.tensor([[5, 7, 31, -1], [170, 171, -1, -1]], dtype=torch.int32)
    busy = {5, 7, 31, 170, 171, 180}
    free = torch.tensor([b for b in range(num_blocks) if b not in busy], dtype=torch.int32)
    got = block_stats(table, free, num_blocks, workspace=BlockStatsWorkspace(num_blocks, "cpu", SMALL))
    assert got.largest_free_run == 170 - 32 and got.free_runs == 6
    assert got == block_stats_reference(table, free, num_blocks)


def test_all_free_pool_is_one_run() -> None:
    num_blocks = 32 * 4  # an exact number of chunks, every chunk full
    free = torch.randperm(num_blocks).to(torch.int32)
    table = torch.full((3, 8), -1, dtype=torch.int32)
    got = block_stats(table, free, num_blocks, workspace=BlockStatsWorkspace(num_blocks, "cpu", SMALL))
    assert (got.largest_free_run, got.free_runs, got.fragmentation) == (num_blocks, 1, 0.0)
    assert got.blocks_per_seq == (0, 0, 0)


@pytest.mark.parametrize(
    "config", [SMALL, TWO_LAUNCHES, POLL_WITH_LOAD, LOOPING], ids=["fused", "two-launches", "poll-load", "looping"]
)
def test_workspace_reuse_forgets_previous_call(config: StatsLaunchConfig, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    workspace = BlockStatsWorkspace(300, "cpu", config)
    for share in (True, False, True):
        table, _, free = make_pool(gen, 300, 5, 30, share, free_fraction=0.8)
        got = block_stats_async(table, free, workspace, out=poisoned(300, 5)).to_host()
        assert got == block_stats_reference(table, free, 300), f"seed {seed}"
        # Nothing carried to the next call: maps cleared by the scan, counters reset.
        assert not workspace.used_mark.any() and not workspace.free_mark.any()
        assert workspace.sync.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("regs", "warps", "programs"), [(64, 8, 4), (72, 8, 3), (35, 8, 6), (32, 8, 8), (16, 4, 16), (255, 8, 1)]
)
def test_programs_per_sm_follows_register_allocation(regs: int, warps: int, programs: int) -> None:
    # 64K registers per SM, allocated per warp in units of 256; at most 64 warps per SM.
    assert _programs_per_sm(regs, warps) == programs


def test_out_of_range_ids_and_duplicates_are_ignored() -> None:
    table = torch.tensor([[3, 99, -7, 4]], dtype=torch.int32)
    free = torch.tensor([0, 0, 1, 2, 50, -1, 1], dtype=torch.int32)
    got = block_stats(table, free, 10, workspace=BlockStatsWorkspace(10, "cpu", SMALL))
    assert (got.used_blocks, got.free_blocks, got.largest_free_run) == (2, 3, 3)
    assert got.blocks_per_seq == (2,) and got.unaccounted_blocks == 5
    assert got == block_stats_reference(table, free, 10)


def test_rejects_wrong_dtype() -> None:
    with pytest.raises(ValueError, match="int32"):
        block_stats(torch.zeros((2, 2), dtype=torch.int64), torch.zeros(1, dtype=torch.int32), 4)
