"""KV snapshot kernel against PyTorch indexing, in Triton's interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import KvSnapshotter, SnapshotConfig, plan_block_sample, plan_snapshot
from kernels._launch import is_interpreted
from kernels.reference import snapshot_reference
from kernels.snapshot import _gather_tiles_kernel


@pytest.fixture
def seed() -> int:
    """A fresh seed per run: the kernels must be right on any valid input, not on one."""
    return random.SystemRandom().randrange(2**31)


def random_cache(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, layers: int) -> list[torch.Tensor]:
    caches = []
    for _ in range(layers):
        if dtype == torch.uint8:  # an fp8-sized element: one byte
            caches.append(torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8))
        else:
            caches.append(torch.randn(shape, generator=gen).to(dtype))
    return caches[::-1]  # layers no longer in address order


def random_table(gen: torch.Generator, num_blocks: int, num_seqs: int, cols: int) -> torch.Tensor:
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((num_seqs, cols), -1, dtype=torch.int32)
    taken = 0
    for row in range(num_seqs):
        n = min(int(torch.randint(2, cols + 1, (1,), generator=gen)), num_blocks - taken)
        table[row, :n] = order[taken : taken + n]
        taken += n
    return table


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_kernel_runs_in_triton_interpreter() -> None:
    assert is_interpreted(_gather_tiles_kernel)


# (layout shape with NB standing for num_blocks, block_dim, dtype)
LAYOUTS = [
    ((2, "NB", 4, 2, 8), 1, torch.bfloat16),  # vLLM: [2, num_blocks, block_size, kv_heads, head_dim]
    ((2, "NB", 2, 3, 5), 1, torch.float32),  # odd sizes: masked loop, narrow alignment
    (("NB", 2, 4, 2, 8), 0, torch.bfloat16),  # block-major: one segment per tile
    ((2, "NB", 4, 1, 3), 1, torch.uint8),  # one-byte elements, byte words
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["vllm-bf16", "odd-f32", "block-major", "bytes"])
@pytest.mark.parametrize("mode", ["staged", "zero_copy", "copy_engine", "dma_batch"])
def test_snapshot_matches_indexing(layout: tuple[tuple[object, ...], int, torch.dtype], mode: str, seed: int) -> None:
    shape_spec, block_dim, dtype = layout
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 24
    shape = tuple(num_blocks if d == "NB" else int(d) for d in shape_spec)  # type: ignore[call-overload]
    caches = random_cache(gen, shape, dtype, layers=3)
    table = random_table(gen, num_blocks, num_seqs=4, cols=7)
    plan = plan_snapshot(caches, table, seq_rows=[3, 0, 2], layers=[2, 0], stride=2, phase=1, block_dim=block_dim)
    assert plan.num_tiles > 0
    # Staging slots of 3 tiles force several chunks; 2 programs force the persistent loop.
    config = SnapshotConfig(mode=mode, staging_bytes=6 * plan.tile_bytes, max_programs=2, block_bytes=64)  # type: ignore[arg-type]
    snapshotter = KvSnapshotter("cpu", config)
    host = snapshotter.allocate_host(plan)
    host.fill_(0xA5)
    got = snapshotter.snapshot(caches, plan, host).wait()
    assert same_bits(got, snapshot_reference(caches, plan, block_dim)), f"seed {seed}"


def one_allocation(gen: torch.Generator, layers: int, num_blocks: int) -> list[torch.Tensor]:
    """Layers as views of one tensor, evenly spaced in memory (as one big KV allocation gives)."""
    whole = torch.randn((layers, 2, num_blocks, 4, 2, 8), generator=gen).to(torch.bfloat16)
    return list(whole.unbind(0))


@pytest.mark.parametrize("mode", ["copy_engine", "staged"])
def test_block_sample_is_one_pitched_copy_per_layer_and_part(mode: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    caches = one_allocation(gen, layers=4, num_blocks=30)
    plan = plan_block_sample(caches, layers=[1, 2, 3], stride=4, phase=3)
    assert plan.tiles[:, 3].tolist() == [3, 7, 11, 15, 19, 23, 27] * 3
    assert plan.tiles[:, 1].tolist() == [1] * 7 + [2] * 7 + [3] * 7
    # Gap: 4 blocks of 128 bytes, in 16-byte units; a new run where the next layer starts.
    assert plan.strided_runs.tolist() == [[0, 7, 32], [7, 7, 32], [14, 7, 32]]
    snapshotter = KvSnapshotter("cpu", SnapshotConfig(mode=mode, staging_bytes=4 * plan.tile_bytes))  # type: ignore[arg-type]
    assert snapshotter.uses_copy_engine(plan) == (mode == "copy_engine")
    host = snapshotter.allocate_host(plan)
    host.fill_(0xA5)
    got = snapshotter.snapshot(caches, plan, host).wait()
    assert same_bits(got, snapshot_reference(caches, plan)), f"seed {seed}"


def test_one_block_across_evenly_spaced_layers_is_one_run(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    caches = one_allocation(gen, layers=5, num_blocks=12)
    table = random_table(gen, 12, num_seqs=2, cols=6)
    plan = plan_snapshot(caches, table, [0, 1], range(5), stride=2)
    # Tiles go (row, position, layer): the five layers of a block are one pitched run.
    assert plan.strided_runs[:, 1].tolist() == [5] * (plan.num_tiles // 5)
    host = torch.full((plan.nbytes,), 0xA5, dtype=torch.uint8)
    got = KvSnapshotter("cpu", SnapshotConfig(mode="copy_engine")).snapshot(caches, plan, host).wait()
    assert same_bits(got, snapshot_reference(caches, plan)), f"seed {seed}"


def test_runs_stay_inside_one_allocation(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    caches = random_cache(gen, (2, 30, 4, 2, 8), torch.bfloat16, layers=4)  # four allocations
    table = random_table(gen, 30, num_seqs=3, cols=8)
    plan = plan_snapshot(caches, table, [0, 1, 2], range(4), stride=1)
    for first, count, _ in plan.strided_runs.tolist():
        assert len(set(plan.tiles[first : first + count, 1].tolist())) == 1  # one layer, one allocation


def test_irregular_plan_falls_back_to_the_gather_kernel(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    caches = random_cache(gen, (2, 40, 4, 2, 8), torch.bfloat16, layers=2)
    table = random_table(gen, 40, num_seqs=3, cols=10)
    plan = plan_snapshot(caches, table, [0, 1, 2], [1], stride=1)
    config = SnapshotConfig(mode="copy_engine", staging_bytes=4 * plan.tile_bytes, max_dma_copies=3)
    snapshotter = KvSnapshotter("cpu", config)
    assert len(plan.strided_runs) * plan.parts > 3 and not snapshotter.uses_copy_engine(plan)
    host = torch.full((plan.nbytes,), 0xA5, dtype=torch.uint8)
    got = snapshotter.snapshot(caches, plan, host).wait()
    assert same_bits(got, snapshot_reference(caches, plan)), f"seed {seed}"


def test_block_sample_names_each_blocks_owner() -> None:
    caches = [torch.zeros(2, 10, 2, 1, 4)]
    table = torch.tensor([[4, 5, 6, 0], [9, 4, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    plan = plan_block_sample(caches, [0], stride=2, block_table=table, num_blocks_per_seq=lens)
    # Blocks 0, 2, 4, 6, 8: 0 is padding (beyond the lengths), 4 is held first by row 0.
    assert plan.tiles.tolist() == [[-1, 0, -1, 0], [-1, 0, -1, 2], [0, 0, 0, 4], [0, 0, 2, 6], [-1, 0, -1, 8]]


def test_plan_follows_lengths_and_stride() -> None:
    caches = [torch.zeros(2, 10, 2, 1, 4) for _ in range(2)]
    table = torch.tensor([[4, 5, 6, 7, 0, 0], [9, 8, 0, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([4, 2], dtype=torch.int32)
    plan = plan_snapshot(caches, table, [0, 1], [1], stride=2, num_blocks_per_seq=lens)
    assert plan.tiles.tolist() == [[0, 1, 0, 4], [0, 1, 2, 6], [1, 1, 0, 9]]
    assert plan.nbytes == 3 * 2 * 2 * 1 * 4 * 4


def test_empty_selection_copies_nothing() -> None:
    caches = [torch.zeros(2, 4, 2, 1, 4)]
    plan = plan_snapshot(caches, torch.full((2, 3), -1, dtype=torch.int32), [0, 1], [0])
    snap = KvSnapshotter("cpu").snapshot(caches, plan)
    assert snap.ready() and snap.wait().shape == (0, 2, 2, 1, 4)


@pytest.mark.parametrize("kwargs", [{"stride": 0}, {"stride": 2, "phase": 2}, {"layers": [5]}])
def test_plan_rejects_bad_selection(kwargs: dict[str, object]) -> None:
    caches = [torch.zeros(2, 4, 2, 1, 4)]
    args: dict[str, object] = {"seq_rows": [0], "layers": [0], **kwargs}
    with pytest.raises(ValueError):
        plan_snapshot(caches, torch.zeros((1, 2), dtype=torch.int32), **args)  # type: ignore[arg-type]
