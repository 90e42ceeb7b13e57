"""A library of Triton kernels that read a live engine's paged KV cache without stopping it.

Used by the benchmarks (`bench/kernels_h200.py`) and their tests; no service imports it, capture included.

- :func:`plan_snapshot` (sampled per sequence) or :func:`plan_block_sample` (sampled
  over the physical pool) + :func:`snapshot_kv` (or a :class:`KvSnapshotter`): copy KV
  tiles into pinned host memory on their own streams, by a Triton gather kernel or, for
  evenly spaced tiles, by the copy engines alone.
- :func:`block_stats` (or :func:`block_stats_async` with a :class:`BlockStatsWorkspace`):
  used/free blocks, largest free run, blocks per sequence, fragmentation.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before ``triton`` is first
imported and pass CPU tensors: the same kernels then run in Triton's interpreter.
"""

from kernels.block_stats import (
    BlockStats,
    BlockStatsDevice,
    BlockStatsWorkspace,
    StatsLaunchConfig,
    block_stats,
    block_stats_async,
    stats_bytes_moved,
)
from kernels.snapshot import (
    KvSnapshotter,
    Snapshot,
    SnapshotConfig,
    SnapshotPlan,
    plan_block_sample,
    plan_snapshot,
    snapshot_kv,
)

__all__ = [
    "BlockStats",
    "BlockStatsDevice",
    "BlockStatsWorkspace",
    "KvSnapshotter",
    "Snapshot",
    "SnapshotConfig",
    "SnapshotPlan",
    "StatsLaunchConfig",
    "block_stats",
    "block_stats_async",
    "plan_block_sample",
    "plan_snapshot",
    "snapshot_kv",
    "stats_bytes_moved",
]
