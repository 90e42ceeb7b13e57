# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped arguments; the launchers below are fully typed.)
"""Block-usage and fragmentation statistics of a paged KV pool, computed on the GPU.

Two launches. The first streams the block tables (the bulk of the bytes): it counts the
valid entries of each sequence and stamps every referenced block id into a ``used`` map,
while its last programs stamp the ids of the free list into a ``free`` map. The second
reads both maps in chunks, summarises each chunk (counts, free runs), and its last
program to finish folds the chunk summaries into the pool's totals.

Maps are stamped with a per-call epoch instead of being cleared, so no memset launch is
needed between calls; a :class:`BlockStatsWorkspace` therefore belongs to one caller
(one stream) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, normalize_device

# Layout of the int64 result vector written by the last program of the scan launch.
_RES_USED, _RES_FREE, _RES_BOTH, _RES_NEITHER, _RES_LARGEST_RUN, _RES_FREE_RUNS = range(6)
_RESULT_LEN = 8
# Rows of the per-chunk summary matrix (constexpr: the kernels index with them).
_SUM_USED = tl.constexpr(0)
_SUM_FREE = tl.constexpr(1)
_SUM_BOTH = tl.constexpr(2)
_SUM_NEITHER = tl.constexpr(3)
_SUM_PRE = tl.constexpr(4)
_SUM_SUF = tl.constexpr(5)
_SUM_BEST = tl.constexpr(6)
_SUM_STARTS = tl.constexpr(7)
_SUMMARY_ROWS = 8
_EPOCH_LIMIT = 2**31 - 2


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _carry_combine(full_a, carry_a, full_b, carry_b):
    # Composition of x -> full * x + carry: the length of the free run that reaches the
    # end of a span, given the run that reaches its start.
    return full_a & full_b, tl.where(full_b != 0, carry_a + carry_b, carry_b)


@triton.jit
def _summary_row(s, k, mask, MAX_CHUNKS: tl.constexpr):
    return tl.load(s + k * MAX_CHUNKS, mask=mask, other=0, volatile=True)


@triton.jit
def _mark_kernel(
    table_ptr, row_stride, lens_ptr, num_rows, num_cols,
    free_ptr, num_free, num_blocks,
    used_mark_ptr, free_mark_ptr, blocks_per_seq_ptr,
    epoch, num_row_programs,
    HAS_LENS: tl.constexpr, EVEN: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr, FREE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_row_programs:
        rows = pid * ROWS + tl.arange(0, ROWS)
        row_ok = rows < num_rows
        row_base = table_ptr + rows.to(tl.int64)[:, None] * row_stride
        if HAS_LENS:
            lens = tl.load(lens_ptr + rows, mask=row_ok, other=0)
            lens = tl.minimum(tl.maximum(lens, 0), num_cols)
            # Reading up to the next multiple of 4 keeps the loads 16 bytes wide; the
            # extra entries are masked out of the counts below.
            lens_load = tl.multiple_of(tl.minimum((lens + 3) // 4 * 4, num_cols), 4)
            cols_needed = tl.max(lens_load, axis=0)
        else:
            cols_needed = num_cols
        counts = tl.zeros([ROWS], dtype=tl.int32)
        stamp = tl.full([ROWS, COLS], 0, tl.int32) + epoch
        for c0 in range(0, cols_needed, COLS):
            cols = c0 + tl.arange(0, COLS)
            if HAS_LENS:
                load_mask = row_ok[:, None] & (cols[None, :] < lens_load[:, None])
                ids = tl.load(row_base + cols[None, :], mask=load_mask, other=-1)
                valid = (cols[None, :] < lens[:, None]) & (ids >= 0) & (ids < num_blocks)
            elif EVEN:
                ids = tl.load(row_base + cols[None, :])
                valid = (ids >= 0) & (ids < num_blocks)
            else:
                load_mask = row_ok[:, None] & (cols[None, :] < num_cols)
                ids = tl.load(row_base + cols[None, :], mask=load_mask, other=-1)
                valid = (ids >= 0) & (ids < num_blocks)
            counts += tl.sum(valid.to(tl.int32), axis=1)
            tl.store(used_mark_ptr + ids, stamp, mask=valid)
        tl.store(blocks_per_seq_ptr + rows, counts, mask=row_ok)
    else:
        # Names differ from the other branch: Triton needs one type per name across an if.
        free_offs = (pid - num_row_programs) * FREE_BLOCK + tl.arange(0, FREE_BLOCK)
        in_list = free_offs < num_free
        free_ids = tl.load(free_ptr + free_offs, mask=in_list, other=-1)
        free_ok = in_list & (free_ids >= 0) & (free_ids < num_blocks)
        free_stamp = tl.full([FREE_BLOCK], 0, tl.int32) + epoch
        tl.store(free_mark_ptr + free_ids, free_stamp, mask=free_ok)


@triton.jit
def _scan_kernel(
    used_mark_ptr, free_mark_ptr, num_blocks, epoch,
    summary_ptr, ticket_ptr, result_ptr, num_chunks,
    CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
):
    pid = tl.program_id(0)
    idx = tl.arange(0, CHUNK)
    offs = pid * CHUNK + idx
    inside = offs < num_blocks
    used = (tl.load(used_mark_ptr + offs, mask=inside, other=0) == epoch) & inside
    free = (tl.load(free_mark_ptr + offs, mask=inside, other=0) == epoch) & inside
    last_busy = tl.associative_scan(tl.where(free, -1, idx), 0, _max_combine)
    run_end = idx - last_busy  # length of the free run that ends at idx; 0 where busy
    suffix = tl.sum(tl.where(idx == CHUNK - 1, run_end, 0), axis=0)
    prefix = tl.min(tl.where(free, CHUNK, idx), axis=0)
    row = summary_ptr + pid
    tl.store(row + _SUM_USED * MAX_CHUNKS, tl.sum(used.to(tl.int32), axis=0))
    tl.store(row + _SUM_FREE * MAX_CHUNKS, tl.sum(free.to(tl.int32), axis=0))
    tl.store(row + _SUM_BOTH * MAX_CHUNKS, tl.sum((used & free).to(tl.int32), axis=0))
    tl.store(row + _SUM_NEITHER * MAX_CHUNKS, tl.sum((inside & ~used & ~free).to(tl.int32), axis=0))
    tl.store(row + _SUM_PRE * MAX_CHUNKS, prefix)
    tl.store(row + _SUM_SUF * MAX_CHUNKS, suffix)
    tl.store(row + _SUM_BEST * MAX_CHUNKS, tl.max(run_end, axis=0))
    tl.store(row + _SUM_STARTS * MAX_CHUNKS, tl.sum((run_end == 1).to(tl.int32), axis=0))
    # Last-program-done: every program publishes its summary, then takes a ticket; the
    # barrier orders all of this program's stores before the release of the ticket.
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == num_chunks - 1:
        c = tl.arange(0, MAX_CHUNKS)
        live = c < num_chunks
        prev = live & (c >= 1)
        s = summary_ptr + c
        pre = _summary_row(s, _SUM_PRE, live, MAX_CHUNKS)
        best = _summary_row(s, _SUM_BEST, live, MAX_CHUNKS)
        suf_prev = tl.load(s - 1 + _SUM_SUF * MAX_CHUNKS, mask=prev, other=0, volatile=True)
        pre_prev = tl.load(s - 1 + _SUM_PRE * MAX_CHUNKS, mask=prev, other=0, volatile=True)
        full_prev = (pre_prev == CHUNK).to(tl.int32)
        # carry_in[c]: free run reaching the start of chunk c from the chunks before it.
        _, carry_in = tl.associative_scan((full_prev, suf_prev), 0, _carry_combine)
        largest = tl.maximum(tl.max(best, axis=0), tl.max(tl.where(live, carry_in + pre, 0), axis=0))
        joins = tl.sum((prev & (suf_prev > 0) & (pre > 0)).to(tl.int32), axis=0)
        tl.store(result_ptr + 0, tl.sum(_summary_row(s, _SUM_USED, live, MAX_CHUNKS), axis=0).to(tl.int64))
        tl.store(result_ptr + 1, tl.sum(_summary_row(s, _SUM_FREE, live, MAX_CHUNKS), axis=0).to(tl.int64))
        tl.store(result_ptr + 2, tl.sum(_summary_row(s, _SUM_BOTH, live, MAX_CHUNKS), axis=0).to(tl.int64))
        tl.store(result_ptr + 3, tl.sum(_summary_row(s, _SUM_NEITHER, live, MAX_CHUNKS), axis=0).to(tl.int64))
        tl.store(result_ptr + 4, largest.to(tl.int64))
        starts = tl.sum(_summary_row(s, _SUM_STARTS, live, MAX_CHUNKS), axis=0)
        tl.store(result_ptr + 5, (starts - joins).to(tl.int64))
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class BlockStats:
    """Occupancy of one engine's KV block pool.

    ``used_blocks`` counts distinct block ids referenced by some sequence;
    ``table_entries`` (the sum of ``blocks_per_seq``) exceeds it when blocks are shared
    (prefix caching). ``unaccounted_blocks`` are neither referenced nor free (vLLM's null
    block, cached blocks held outside the free list, or a leak); ``conflicting_blocks``
    are referenced yet on the free list, which a healthy engine never shows.
    ``fragmentation`` is 1 - largest_free_run / free_blocks: 0 when the free blocks form
    one contiguous run, towards 1 when they are scattered (0 when nothing is free).
    """

    num_blocks: int
    used_blocks: int
    free_blocks: int
    largest_free_run: int
    free_runs: int
    blocks_per_seq: tuple[int, ...]
    table_entries: int
    unaccounted_blocks: int
    conflicting_blocks: int
    fragmentation: float


@dataclass(frozen=True)
class BlockStatsDevice:
    """Device-side result of :func:`block_stats_async`; read it after the stream syncs."""

    num_blocks: int
    blocks_per_seq: torch.Tensor  # int32 [num_seqs]
    totals: torch.Tensor  # int64 [8], see the _RES_* layout

    @classmethod
    def empty(cls, num_blocks: int, num_seqs: int, device: torch.device | str) -> BlockStatsDevice:
        return cls(num_blocks, torch.empty(num_seqs, dtype=torch.int32, device=device),
                   torch.empty(_RESULT_LEN, dtype=torch.int64, device=device))

    def to_host(self) -> BlockStats:
        totals = self.totals.tolist()
        per_seq = tuple(int(n) for n in self.blocks_per_seq.tolist())
        free = int(totals[_RES_FREE])
        largest = int(totals[_RES_LARGEST_RUN])
        return BlockStats(
            num_blocks=self.num_blocks,
            used_blocks=int(totals[_RES_USED]),
            free_blocks=free,
            largest_free_run=largest,
            free_runs=int(totals[_RES_FREE_RUNS]),
            blocks_per_seq=per_seq,
            table_entries=sum(per_seq),
            unaccounted_blocks=int(totals[_RES_NEITHER]),
            conflicting_blocks=int(totals[_RES_BOTH]),
            fragmentation=0.0 if free == 0 else 1.0 - largest / free,
        )


@dataclass(frozen=True)
class StatsLaunchConfig:
    rows: int = 4
    cols: int = 1024
    free_block: int = 1024
    chunk: int = 1024
    mark_warps: int = 4
    scan_warps: int = 4


class BlockStatsWorkspace:
    """Scratch memory of the statistics kernels for one pool; reuse it across calls."""

    def __init__(self, num_blocks: int, device: torch.device | str,
                 config: StatsLaunchConfig | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.config = config or StatsLaunchConfig()
        self.num_blocks = num_blocks
        self.device = normalize_device(device)
        self.num_chunks = triton.cdiv(num_blocks, self.config.chunk)
        self.max_chunks = max(16, triton.next_power_of_2(self.num_chunks))
        self.used_mark = torch.zeros(num_blocks, dtype=torch.int32, device=self.device)
        self.free_mark = torch.zeros(num_blocks, dtype=torch.int32, device=self.device)
        self.summary = torch.zeros(_SUMMARY_ROWS * self.max_chunks, dtype=torch.int32, device=self.device)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._epoch = 0

    def next_epoch(self) -> int:
        self._epoch += 1
        if self._epoch > _EPOCH_LIMIT:
            self.used_mark.zero_()
            self.free_mark.zero_()
            self._epoch = 1
        return self._epoch


def _check_int32(name: str, tensor: torch.Tensor, ndim: int, device: torch.device) -> None:
    if tensor.dtype != torch.int32 or tensor.dim() != ndim:
        raise ValueError(f"{name} must be an int32 tensor of {ndim} dims, got {tensor.dtype} {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the workspace on {device}")


def block_stats_async(
    block_table: torch.Tensor,
    free_block_ids: torch.Tensor,
    workspace: BlockStatsWorkspace,
    num_blocks_per_seq: torch.Tensor | None = None,
    out: BlockStatsDevice | None = None,
) -> BlockStatsDevice:
    """Launch the statistics kernels on the current stream; nothing waits for them.

    ``block_table``: int32 [num_seqs, max_blocks_per_seq], entries < 0 unused (vLLM's
    zero-padded table needs ``num_blocks_per_seq``, int32 [num_seqs], instead).
    ``free_block_ids``: int32 [num_free], the pool's free-block list in any order.
    ``out``: tensors to write into (reused across calls, or poisoned by tests).
    """
    device = workspace.device
    check_device(device)
    _check_int32("block_table", block_table, 2, device)
    _check_int32("free_block_ids", free_block_ids, 1, device)
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    free_block_ids = free_block_ids.contiguous()
    if num_blocks_per_seq is not None:
        _check_int32("num_blocks_per_seq", num_blocks_per_seq, 1, device)
        if num_blocks_per_seq.shape[0] != block_table.shape[0]:
            raise ValueError("num_blocks_per_seq needs one entry per block-table row")
        num_blocks_per_seq = num_blocks_per_seq.contiguous()
    cfg = workspace.config
    num_rows, num_cols = block_table.shape
    if out is None:
        out = BlockStatsDevice(
            workspace.num_blocks,
            torch.empty(num_rows, dtype=torch.int32, device=device),
            torch.empty(_RESULT_LEN, dtype=torch.int64, device=device),
        )
    elif out.blocks_per_seq.shape != (num_rows,) or out.totals.shape != (_RESULT_LEN,):
        raise ValueError("out tensors do not match the block table")
    blocks_per_seq, totals = out.blocks_per_seq, out.totals
    epoch = workspace.next_epoch()
    row_programs = triton.cdiv(num_rows, cfg.rows)
    free_programs = triton.cdiv(free_block_ids.shape[0], cfg.free_block)
    grid_mark = row_programs + free_programs
    if grid_mark > 0:
        _mark_kernel[(grid_mark,)](
            block_table, block_table.stride(0),
            num_blocks_per_seq if num_blocks_per_seq is not None else blocks_per_seq,
            num_rows, num_cols,
            free_block_ids, free_block_ids.shape[0], workspace.num_blocks,
            workspace.used_mark, workspace.free_mark, blocks_per_seq,
            epoch, row_programs,
            HAS_LENS=num_blocks_per_seq is not None,
            EVEN=num_rows % cfg.rows == 0 and num_cols % cfg.cols == 0,
            ROWS=cfg.rows, COLS=cfg.cols, FREE_BLOCK=cfg.free_block,
            num_warps=cfg.mark_warps,
        )
    _scan_kernel[(workspace.num_chunks,)](
        workspace.used_mark, workspace.free_mark, workspace.num_blocks, epoch,
        workspace.summary, workspace.ticket, totals, workspace.num_chunks,
        CHUNK=cfg.chunk, MAX_CHUNKS=workspace.max_chunks,
        num_warps=cfg.scan_warps,
    )
    return out


def block_stats(
    block_table: torch.Tensor,
    free_block_ids: torch.Tensor,
    num_blocks: int,
    num_blocks_per_seq: torch.Tensor | None = None,
    workspace: BlockStatsWorkspace | None = None,
) -> BlockStats:
    """Statistics of one engine's block pool, read back to the host (synchronises)."""
    if workspace is None:
        workspace = BlockStatsWorkspace(num_blocks, block_table.device)
    elif workspace.num_blocks != num_blocks:
        raise ValueError(f"workspace is for {workspace.num_blocks} blocks, not {num_blocks}")
    return block_stats_async(block_table, free_block_ids, workspace, num_blocks_per_seq).to_host()


def stats_bytes_moved(block_table: torch.Tensor, free_block_ids: torch.Tensor, num_blocks: int,
                      num_blocks_per_seq: torch.Tensor | None = None) -> int:
    """Bytes the two launches must read and write at the least (int32 everywhere)."""
    num_rows, num_cols = block_table.shape
    if num_blocks_per_seq is None:
        table_read = num_rows * num_cols
        valid = int(((block_table >= 0) & (block_table < num_blocks)).sum())
    else:
        lens = num_blocks_per_seq.clamp(0, num_cols)
        table_read = int(lens.sum()) + num_rows
        valid = table_read - num_rows
    free = free_block_ids.shape[0]
    mark_launch = 4 * (table_read + free + valid + free + num_rows)
    scan_launch = 4 * (2 * num_blocks)
    return mark_launch + scan_launch
