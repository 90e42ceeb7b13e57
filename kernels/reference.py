"""PyTorch references for the kernels: plain, obviously correct, and slow."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.block_stats import BlockStats
from kernels.snapshot import SnapshotPlan


def block_stats_reference(
    block_table: torch.Tensor,
    free_block_ids: torch.Tensor,
    num_blocks: int,
    num_blocks_per_seq: torch.Tensor | None = None,
) -> BlockStats:
    table = block_table.to("cpu", torch.int64)
    cols = torch.arange(table.shape[1])
    valid = (table >= 0) & (table < num_blocks)
    if num_blocks_per_seq is not None:
        valid &= cols[None, :] < num_blocks_per_seq.to("cpu", torch.int64)[:, None]
    used = torch.zeros(num_blocks, dtype=torch.bool)
    used[table[valid]] = True
    ids = free_block_ids.to("cpu", torch.int64)
    ids = ids[(ids >= 0) & (ids < num_blocks)]
    free = torch.zeros(num_blocks, dtype=torch.bool)
    free[ids] = True
    runs: list[int] = []
    current = 0
    for is_free in free.tolist():
        if is_free:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    per_seq = tuple(int(n) for n in valid.sum(dim=1).tolist())
    n_free = int(free.sum())
    largest = max(runs, default=0)
    return BlockStats(
        num_blocks=num_blocks,
        used_blocks=int(used.sum()),
        free_blocks=n_free,
        largest_free_run=largest,
        free_runs=len(runs),
        blocks_per_seq=per_seq,
        table_entries=sum(per_seq),
        unaccounted_blocks=int((~used & ~free).sum()),
        conflicting_blocks=int((used & free).sum()),
        fragmentation=0.0 if n_free == 0 else 1.0 - largest / n_free,
    )


def snapshot_reference(kv_caches: Sequence[torch.Tensor], plan: SnapshotPlan, block_dim: int = 1) -> torch.Tensor:
    """The planned tiles, ``[num_tiles, *tile_shape]``, gathered by indexing."""
    if plan.num_tiles == 0:
        return torch.empty((0, *plan.tile_shape), dtype=plan.dtype)
    tiles = [kv_caches[layer].select(block_dim, block) for _, layer, _, block in plan.tiles.tolist()]
    return torch.stack(tiles).cpu()
