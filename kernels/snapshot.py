# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped arguments; the launchers below are fully typed.)
"""Tile-sampled snapshots of a live paged KV cache into pinned host memory.

A *tile* is the data of one KV block of one layer. In vLLM's layout a layer's cache is
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K and V planes, ``block_dim=1``),
so a tile is two contiguous segments, one per plane; block-major layouts
(``[num_blocks, ...]``, ``block_dim=0``) give one segment. :func:`plan_snapshot` turns a
selection (block-table rows, layers, a stride over each sequence's blocks) into a list of
tiles and their source offsets; :class:`KvSnapshotter` copies them on its own streams,
so the engine's stream is never blocked:

- ``staged``: a Triton kernel gathers a chunk of tiles into a small device staging slot,
  and the copy engine moves the slot to the pinned buffer (``cudaMemcpyAsync``) while
  the next chunk is gathered into the other slot. Two slots, fixed size: a snapshot
  never asks the allocator of a GPU under memory pressure for more.
- ``zero_copy``: the same kernel writes straight into the pinned buffer through its
  mapped device address; no staging memory, but its programs stay resident on the SMs
  for the whole transfer.
- ``copy_engine``: no kernel at all. Where the plan's tiles fall into a few evenly
  spaced runs in memory (:attr:`SnapshotPlan.strided_runs`: a physical-block sample from
  :func:`plan_block_sample`, or one block across layers spaced evenly), each run and part
  is one pitched copy (``cudaMemcpy2DAsync``) done by the copy engines, so the engine's
  kernels keep every SM. Irregular plans fall back to ``staged``.
- ``dma_batch``: one ``cudaMemcpyBatchAsync`` of every tile segment, any selection;
  also no SM work (an experiment: CUDA 12.8+ and cuda-bindings).

The source is read while the engine may be writing: the tiles are as of some moment
after :meth:`KvSnapshotter.snapshot` is called (the snapshot streams first wait for the
work the caller's stream had queued), and a block that the engine rewrites meanwhile can
come back torn. A snapshot is evidence, not a checkpoint.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
import triton
import triton.language as tl

from kernels import _dma
from kernels._launch import check_device, normalize_device

SnapshotMode = Literal["staged", "zero_copy", "copy_engine", "dma_batch"]
_MODES = ("staged", "zero_copy", "copy_engine", "dma_batch")
_MAX_UNIT_BYTES = 16  # one 16-byte vector per thread and access
_MAX_PITCH = 2**31 - 1  # cudaDevAttrMaxPitch of current NVIDIA GPUs


@triton.jit
def _gather_tiles_kernel(
    src_ptr,
    dst_ptr,
    src_unit_off_ptr,
    first_tile,
    num_tiles,
    part_stride_units,
    PARTS: tl.constexpr,
    PART_WORDS: tl.constexpr,
    UNIT_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
):
    # Persistent loop: the grid may be smaller than the number of tiles, which bounds
    # how many SMs a snapshot occupies at once.
    offs = tl.arange(0, BLOCK)
    part_stride = tl.cast(part_stride_units, tl.int64) * UNIT_WORDS
    for t in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        # Offsets are kept in 16-byte units so the compiler can prove alignment and use
        # vector loads and stores.
        src_tile = src_ptr + tl.load(src_unit_off_ptr + first_tile + t) * UNIT_WORDS
        dst_tile = dst_ptr + tl.cast(t, tl.int64) * (PARTS * PART_WORDS)
        for p in tl.static_range(PARTS):
            for start in tl.range(0, PART_WORDS, BLOCK):
                src = src_tile + p * part_stride + start + offs
                dst = dst_tile + p * PART_WORDS + start + offs
                if EVEN:
                    tl.store(dst, tl.load(src))
                else:
                    inside = start + offs < PART_WORDS
                    tl.store(dst, tl.load(src, mask=inside), mask=inside)


@dataclass(frozen=True)
class SnapshotPlan:
    """Which tiles a snapshot copies, and where each one lies in the source tensors.

    ``tiles`` (int64 [n, 4], host) names each tile: block-table row, layer, position of
    the block in its sequence, physical block id; the snapshot holds them in this order.
    """

    tiles: torch.Tensor
    src_unit_offsets: torch.Tensor  # int64 [n] on the cache's device
    src_units_host: torch.Tensor  # the same offsets on the host
    src_groups_host: torch.Tensor  # int64 [n]: tiles of one group lie in one allocation
    base_layer: int
    part_stride_units: int
    parts: int
    part_words: int
    unit_words: int
    word_dtype: torch.dtype
    tile_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[0])

    @property
    def tile_bytes(self) -> int:
        return self.parts * self.part_words * _itemsize(self.word_dtype)

    @property
    def nbytes(self) -> int:
        return self.num_tiles * self.tile_bytes

    @property
    def unit_bytes(self) -> int:
        return self.unit_words * _itemsize(self.word_dtype)

    @property
    def part_bytes(self) -> int:
        return self.part_words * _itemsize(self.word_dtype)

    @cached_property
    def strided_runs(self) -> torch.Tensor:
        """int64 [runs, 3]: first tile, tile count, source spacing in units.

        Consecutive tiles whose sources lie the same distance apart (at least one part,
        at most the largest copy pitch) in one allocation form a run: one pitched copy
        per part moves it. (The driver refuses a pitched copy whose rows span two
        allocations: seen on the H200 with layers allocated one by one.) Greedy from the
        first tile; a lone tile is a run of one.
        """
        src = self.src_units_host.tolist()
        group = self.src_groups_host.tolist()
        min_gap = self.part_bytes // self.unit_bytes
        max_gap = _MAX_PITCH // self.unit_bytes
        runs: list[tuple[int, int, int]] = []
        first = 0
        while first < len(src):
            end = first + 1
            gap = src[end] - src[first] if end < len(src) else 0
            if min_gap <= gap <= max_gap:
                while end < len(src) and src[end] - src[end - 1] == gap and group[end] == group[first]:
                    end += 1
            else:
                gap = 0
            runs.append((first, end - first, gap))
            first = end
        return torch.tensor(runs, dtype=torch.int64).view(-1, 3)


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _new_event() -> torch.cuda.Event:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_layers(kv_caches: Sequence[torch.Tensor], block_dim: int) -> None:
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    if block_dim not in (0, 1):
        raise ValueError(f"block_dim must be 0 or 1, got {block_dim}")
    first = kv_caches[0]
    for i, layer in enumerate(kv_caches):
        if (layer.shape, layer.stride(), layer.dtype, layer.device) != (
            first.shape,
            first.stride(),
            first.dtype,
            first.device,
        ):
            raise ValueError(f"layer {i} differs from layer 0 in shape, strides, dtype or device")
    if first.dim() <= block_dim + 1:
        raise ValueError(f"a layer of shape {tuple(first.shape)} has nothing inside its blocks")
    inner = first[(0,) * (block_dim + 1)] if block_dim == 1 else first[0]
    if not inner.is_contiguous():
        raise ValueError("the data of one block must be contiguous (dims after block_dim)")


def _check_selection(
    kv_caches: Sequence[torch.Tensor], layers: Sequence[int], stride: int, phase: int, block_dim: int
) -> None:
    _check_layers(kv_caches, block_dim)
    if stride < 1 or not 0 <= phase < stride:
        raise ValueError(f"need stride >= 1 and 0 <= phase < stride, got {stride}, {phase}")
    for layer in layers:
        if not 0 <= layer < len(kv_caches):
            raise ValueError(f"layer {layer} is outside 0..{len(kv_caches) - 1}")


def plan_snapshot(
    kv_caches: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    seq_rows: Sequence[int],
    layers: Sequence[int],
    stride: int = 1,
    phase: int = 0,
    num_blocks_per_seq: torch.Tensor | None = None,
    block_dim: int = 1,
) -> SnapshotPlan:
    """Select every ``stride``-th block (from ``phase``) of the given rows, in the given layers.

    Entries < 0 in ``block_table`` are unused; with ``num_blocks_per_seq`` only the first
    that many entries of a row count (vLLM's zero-padded table).
    """
    _check_selection(kv_caches, layers, stride, phase, block_dim)
    num_blocks = kv_caches[0].shape[block_dim]
    table = block_table.to("cpu", torch.int64)
    rows = torch.as_tensor(list(seq_rows), dtype=torch.int64)
    if rows.numel() and (rows.min() < 0 or rows.max() >= table.shape[0]):
        raise ValueError("a selected row is outside the block table")
    positions = torch.arange(phase, table.shape[1], stride, dtype=torch.int64)
    ids = table[rows][:, positions]  # [rows, sampled positions]
    valid = (ids >= 0) & (ids < num_blocks)
    if num_blocks_per_seq is not None:
        lens = num_blocks_per_seq.to("cpu", torch.int64)[rows]
        valid &= positions[None, :] < lens[:, None]
    sel_row, sel_pos = valid.nonzero(as_tuple=True)
    block_ids = ids[sel_row, sel_pos]
    layer_ids = torch.as_tensor(list(layers), dtype=torch.int64)
    n_blocks, n_layers = block_ids.numel(), layer_ids.numel()
    # Tiles ordered by (row, position, layer): one sequence's tiles stay together.
    tiles = (
        torch.stack(
            [
                rows[sel_row].repeat_interleave(n_layers),
                layer_ids.repeat(n_blocks),
                positions[sel_pos].repeat_interleave(n_layers),
                block_ids.repeat_interleave(n_layers),
            ],
            dim=1,
        )
        if n_blocks and n_layers
        else torch.empty((0, 4), dtype=torch.int64)
    )
    return _plan_tiles(kv_caches, tiles, block_dim)


def plan_block_sample(
    kv_caches: Sequence[torch.Tensor],
    layers: Sequence[int],
    stride: int = 1,
    phase: int = 0,
    block_table: torch.Tensor | None = None,
    num_blocks_per_seq: torch.Tensor | None = None,
    block_dim: int = 1,
) -> SnapshotPlan:
    """Every ``stride``-th physical block of the pool (from ``phase``), in the given layers.

    Tiles are ordered by (layer, block id), so each layer's sample lies evenly spaced in
    memory and a ``copy_engine`` snapshot moves it with one pitched copy per part. The
    sample does not follow sequences: free blocks are copied too. With ``block_table``
    (and, for vLLM's zero-padded table, ``num_blocks_per_seq``) each tile names the row and
    position of the first table entry that holds its block, else -1 and -1.
    """
    _check_selection(kv_caches, layers, stride, phase, block_dim)
    num_blocks = kv_caches[0].shape[block_dim]
    block_ids = torch.arange(phase, num_blocks, stride, dtype=torch.int64)
    owner = torch.full((num_blocks,), -1, dtype=torch.int64)
    if block_table is not None:
        table = block_table.to("cpu", torch.int64)
        cols = table.shape[1]
        valid = (table >= 0) & (table < num_blocks)
        if num_blocks_per_seq is not None:
            valid &= torch.arange(cols)[None, :] < num_blocks_per_seq.to("cpu", torch.int64)[:, None]
        row, pos = valid.nonzero(as_tuple=True)
        first_entry = torch.full((num_blocks,), table.numel(), dtype=torch.int64)
        first_entry.scatter_reduce_(0, table[row, pos], row * cols + pos, reduce="amin")
        held = first_entry < table.numel()
        owner[held] = first_entry[held]
        cols_of = max(cols, 1)
    else:
        cols_of = 1
    sampled_owner = owner[block_ids]
    held = sampled_owner >= 0
    owner_row = torch.where(held, sampled_owner // cols_of, -1)
    owner_pos = torch.where(held, sampled_owner % cols_of, -1)
    layer_ids = torch.as_tensor(list(layers), dtype=torch.int64)
    n_blocks, n_layers = block_ids.numel(), layer_ids.numel()
    tiles = (
        torch.stack(
            [
                owner_row.repeat(n_layers),
                layer_ids.repeat_interleave(n_blocks),
                owner_pos.repeat(n_layers),
                block_ids.repeat(n_layers),
            ],
            dim=1,
        )
        if n_blocks and n_layers
        else torch.empty((0, 4), dtype=torch.int64)
    )
    return _plan_tiles(kv_caches, tiles, block_dim)


def _plan_tiles(kv_caches: Sequence[torch.Tensor], tiles: torch.Tensor, block_dim: int) -> SnapshotPlan:
    first = kv_caches[0]
    num_layers = len(kv_caches)
    esize = first.element_size()
    parts = math.prod(first.shape[:block_dim])
    part_elems = math.prod(first.shape[block_dim + 1 :])
    block_stride_bytes = first.stride(block_dim) * esize
    part_stride_bytes = first.stride(0) * esize if block_dim == 1 else 0
    ptrs = [layer.data_ptr() for layer in kv_caches]
    base_layer = min(range(num_layers), key=ptrs.__getitem__)
    unit = _MAX_UNIT_BYTES
    for quantity in (
        *(p - ptrs[base_layer] for p in ptrs),
        block_stride_bytes,
        part_stride_bytes,
        part_elems * esize,
        ptrs[base_layer],
    ):
        unit = math.gcd(unit, quantity)
    word_dtype = torch.int32 if unit % 4 == 0 else torch.uint8
    word_bytes = _itemsize(word_dtype)
    layer_units = torch.as_tensor([(p - ptrs[base_layer]) // unit for p in ptrs], dtype=torch.int64)
    src = layer_units[tiles[:, 1]] + tiles[:, 3] * (block_stride_bytes // unit)
    # Layers that are views of one tensor share an allocation; separate tensors may not.
    storages = [layer.untyped_storage().data_ptr() for layer in kv_caches]
    layer_groups = torch.as_tensor([storages.index(p) for p in storages], dtype=torch.int64)
    tile_shape = (*first.shape[:block_dim], *first.shape[block_dim + 1 :])
    return SnapshotPlan(
        tiles=tiles,
        src_unit_offsets=src.to(first.device),
        src_units_host=src,
        src_groups_host=layer_groups[tiles[:, 1]],
        base_layer=base_layer,
        part_stride_units=part_stride_bytes // unit,
        parts=parts,
        part_words=part_elems * esize // word_bytes,
        unit_words=unit // word_bytes,
        word_dtype=word_dtype,
        tile_shape=tile_shape,
        dtype=first.dtype,
    )


@dataclass
class Snapshot:
    """A snapshot in flight; ``host`` is valid once :meth:`wait` returns (or :meth:`ready`)."""

    plan: SnapshotPlan
    host_bytes: torch.Tensor  # uint8 [nbytes], pinned on a CUDA machine
    done: torch.cuda.Event | None

    def ready(self) -> bool:
        return self.done is None or bool(self.done.query())  # type: ignore[no-untyped-call]

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host

    @property
    def host(self) -> torch.Tensor:
        """The tiles as ``[num_tiles, *tile_shape]`` in the cache's dtype."""
        return self.host_bytes.view(self.plan.dtype).view(self.plan.num_tiles, *self.plan.tile_shape)


@dataclass(frozen=True)
class SnapshotConfig:
    mode: SnapshotMode = "staged"
    staging_bytes: int = 32 << 20  # both slots together (copy_engine: for irregular plans)
    max_programs: int | None = None  # None: one program per tile of a chunk
    block_bytes: int = 8192  # bytes each program moves per loop step
    num_warps: int = 4
    max_dma_copies: int = 4096  # copy_engine: more pitched copies than this -> staged


_PitchedCopy = tuple[int, int, int, int, int, int]  # dst, dst pitch, src, src pitch, width, height


def _pitched_copies(plan: SnapshotPlan, base: int, host: int) -> list[_PitchedCopy]:
    tb, pb, ub = plan.tile_bytes, plan.part_bytes, plan.unit_bytes
    src = plan.src_units_host.tolist()
    copies = []
    for first, count, gap in plan.strided_runs.tolist():
        for p in range(plan.parts):
            copies.append(
                (
                    host + first * tb + p * pb,
                    tb,
                    base + (src[first] + p * plan.part_stride_units) * ub,
                    gap * ub if count > 1 else pb,
                    pb,
                    count,
                )
            )
    return copies


def _segments(plan: SnapshotPlan, base: int, host: int) -> tuple[list[int], list[int], list[int]]:
    """Every part of every tile as its own copy: destinations, sources, sizes."""
    tiles = torch.arange(plan.num_tiles, dtype=torch.int64)[:, None]
    parts = torch.arange(plan.parts, dtype=torch.int64)[None, :]
    dsts = host + tiles * plan.tile_bytes + parts * plan.part_bytes
    srcs = base + (plan.src_units_host[:, None] + parts * plan.part_stride_units) * plan.unit_bytes
    return dsts.flatten().tolist(), srcs.flatten().tolist(), [plan.part_bytes] * dsts.numel()


class _CpuCopyEngine:
    """The copy engine's job done by memmove on the CPU, with the bounds the device would fault on."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], host_bytes: torch.Tensor) -> None:
        storages = [layer.untyped_storage() for layer in kv_caches]
        self._sources = [(st.data_ptr(), st.data_ptr() + st.nbytes()) for st in storages]
        self._host = (host_bytes.data_ptr(), host_bytes.data_ptr() + host_bytes.numel())

    def copy(self, dst: int, src: int, size: int) -> None:
        if not any(lo <= src and src + size <= hi for lo, hi in self._sources):
            raise ValueError(f"copy source {src:#x}+{size} lies outside every layer")
        if not (self._host[0] <= dst and dst + size <= self._host[1]):
            raise ValueError(f"copy destination {dst:#x}+{size} lies outside the host buffer")
        ctypes.memmove(dst, src, size)

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
        if width > dst_pitch or width > src_pitch or max(dst_pitch, src_pitch) > _MAX_PITCH:
            raise ValueError(f"pitched copy of width {width} with pitches {dst_pitch}, {src_pitch}")
        last = src + (height - 1) * src_pitch
        if not any(lo <= src and last + width <= hi for lo, hi in self._sources):
            raise ValueError(f"pitched copy from {src:#x} spans more than one allocation")
        for row in range(height):
            self.copy(dst + row * dst_pitch, src + row * src_pitch, width)


class KvSnapshotter:
    """Copies planned tiles to pinned host memory on its own streams; one per device."""

    def __init__(self, device: torch.device | str, config: SnapshotConfig | None = None) -> None:
        self.device = normalize_device(device)
        check_device(self.device)
        self.config = config or SnapshotConfig()
        if self.config.mode not in _MODES:
            raise ValueError(f"unknown snapshot mode {self.config.mode!r}")
        self._cuda = self.device.type == "cuda"
        self.row_copy_fallbacks = 0  # pitched copies the driver refused, done row by row
        slot_bytes = max(self.config.staging_bytes // 2, _MAX_UNIT_BYTES)
        self._slots: list[torch.Tensor] = []
        if self.config.mode in ("staged", "copy_engine"):
            self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        if self._cuda:
            self._gather_stream = _new_stream(self.device)
            self._copy_stream = _new_stream(self.device)
            self._gathered = [_new_event() for _ in range(2)]
            self._copied = [_new_event() for _ in range(2)]

    def allocate_host(self, plan: SnapshotPlan) -> torch.Tensor:
        return torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=self._cuda)

    def uses_copy_engine(self, plan: SnapshotPlan) -> bool:
        """Whether :meth:`snapshot` moves ``plan`` without any kernel."""
        if self.config.mode == "dma_batch":
            return True
        return self.config.mode == "copy_engine" and len(plan.strided_runs) * plan.parts <= self.config.max_dma_copies

    def _launch(self, plan: SnapshotPlan, source: torch.Tensor, dst: torch.Tensor, first: int, count: int) -> None:
        word_bytes = _itemsize(plan.word_dtype)
        block = min(triton.next_power_of_2(plan.part_words), max(1, self.config.block_bytes // word_bytes))
        programs = count if self.config.max_programs is None else min(count, self.config.max_programs)
        _gather_tiles_kernel[(programs,)](
            source,
            dst,
            plan.src_unit_offsets,
            first,
            count,
            plan.part_stride_units,
            PARTS=plan.parts,
            PART_WORDS=plan.part_words,
            UNIT_WORDS=plan.unit_words,
            BLOCK=block,
            EVEN=plan.part_words % block == 0,
            num_warps=self.config.num_warps,
        )

    def snapshot(
        self, kv_caches: Sequence[torch.Tensor], plan: SnapshotPlan, host_bytes: torch.Tensor | None = None
    ) -> Snapshot:
        """Queue the copy of ``plan``'s tiles and return at once."""
        if kv_caches[0].device != self.device:
            raise ValueError(f"cache on {kv_caches[0].device}, snapshotter on {self.device}")
        if host_bytes is None:
            host_bytes = self.allocate_host(plan)
        if host_bytes.dtype != torch.uint8 or host_bytes.numel() < plan.nbytes or not host_bytes.is_contiguous():
            raise ValueError(f"host buffer must be contiguous uint8 of at least {plan.nbytes} bytes")
        if self._cuda and not host_bytes.is_pinned():
            raise ValueError("host buffer must be pinned (torch.empty(..., pin_memory=True))")
        # The kernel sees all layers through the lowest-addressed one, as 32-bit or byte words.
        base = kv_caches[plan.base_layer]
        source = base.view(torch.uint8).as_strided((_MAX_UNIT_BYTES,), (1,)).view(plan.word_dtype)
        words = host_bytes[: plan.nbytes].view(plan.word_dtype)
        if plan.num_tiles == 0:
            return Snapshot(plan, host_bytes[: plan.nbytes], None)
        if not self._cuda:
            self._run_on_cpu(plan, kv_caches, source, host_bytes)
            return Snapshot(plan, host_bytes[: plan.nbytes], None)
        caller = torch.cuda.current_stream(self.device)
        done = _new_event()
        if self.uses_copy_engine(plan):
            self._copy_stream.wait_stream(caller)
            self._dma(plan, base.data_ptr(), host_bytes.data_ptr())
            done.record(self._copy_stream)
            return Snapshot(plan, host_bytes[: plan.nbytes], done)
        self._gather_stream.wait_stream(caller)
        plan.src_unit_offsets.record_stream(self._gather_stream)
        if self.config.mode == "zero_copy":
            with torch.cuda.stream(self._gather_stream):
                self._launch(plan, source, words, 0, plan.num_tiles)
            done.record(self._gather_stream)
        else:
            self._copy_stream.wait_stream(caller)
            self._staged(plan, source, host_bytes)
            done.record(self._copy_stream)
        return Snapshot(plan, host_bytes[: plan.nbytes], done)

    def _dma(self, plan: SnapshotPlan, base: int, host: int) -> None:
        stream = self._copy_stream.cuda_stream
        if self.config.mode == "dma_batch":
            _dma.copy_batch_to_host(*_segments(plan, base, host), stream)
            return
        for copy in _pitched_copies(plan, base, host):
            if not _dma.copy_2d_to_host(*copy, stream):
                self.row_copy_fallbacks += 1

    def _chunks(self, plan: SnapshotPlan) -> list[tuple[int, int]]:
        per_chunk = max(1, self._slots[0].numel() // plan.tile_bytes)
        return [(t, min(per_chunk, plan.num_tiles - t)) for t in range(0, plan.num_tiles, per_chunk)]

    def _staged(self, plan: SnapshotPlan, source: torch.Tensor, host_bytes: torch.Tensor) -> None:
        if plan.tile_bytes > self._slots[0].numel():
            raise ValueError(f"a tile of {plan.tile_bytes} bytes exceeds a staging slot of {self._slots[0].numel()}")
        tb = plan.tile_bytes
        for c, (first, count) in enumerate(self._chunks(plan)):
            k = c % 2
            slot = self._slots[k]
            self._gather_stream.wait_event(self._copied[k])  # the slot's last copy is out
            with torch.cuda.stream(self._gather_stream):
                self._launch(plan, source, slot.view(plan.word_dtype), first, count)
            self._gathered[k].record(self._gather_stream)
            self._copy_stream.wait_event(self._gathered[k])
            with torch.cuda.stream(self._copy_stream):
                host_bytes[first * tb : (first + count) * tb].copy_(slot[: count * tb], non_blocking=True)
            self._copied[k].record(self._copy_stream)

    def _run_on_cpu(
        self, plan: SnapshotPlan, kv_caches: Sequence[torch.Tensor], source: torch.Tensor, host_bytes: torch.Tensor
    ) -> None:
        # Triton's interpreter and memmove: same kernel, chunking and copy list, no streams.
        words = host_bytes[: plan.nbytes].view(plan.word_dtype)
        if self.uses_copy_engine(plan):
            engine = _CpuCopyEngine(kv_caches, host_bytes[: plan.nbytes])
            base, host = kv_caches[plan.base_layer].data_ptr(), host_bytes.data_ptr()
            if self.config.mode == "dma_batch":
                for dst, src, size in zip(*_segments(plan, base, host), strict=True):
                    engine.copy(dst, src, size)
            else:
                for copy in _pitched_copies(plan, base, host):
                    engine.copy_2d(*copy)
            return
        if self.config.mode == "zero_copy":
            self._launch(plan, source, words, 0, plan.num_tiles)
            return
        tb = plan.tile_bytes
        out = words.view(torch.uint8)
        for first, count in self._chunks(plan):
            slot = self._slots[0]
            self._launch(plan, source, slot.view(plan.word_dtype), first, count)
            out[first * tb : (first + count) * tb].copy_(slot[: count * tb])


_default_snapshotters: dict[torch.device, KvSnapshotter] = {}


def snapshot_kv(
    kv_caches: Sequence[torch.Tensor], plan: SnapshotPlan, host_bytes: torch.Tensor | None = None
) -> Snapshot:
    """Snapshot with the device's default :class:`KvSnapshotter` (staged mode)."""
    device = kv_caches[0].device
    snapshotter = _default_snapshotters.get(device)
    if snapshotter is None:
        snapshotter = _default_snapshotters[device] = KvSnapshotter(device)
    return snapshotter.snapshot(kv_caches, plan, host_bytes)
