# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped arguments; the launchers below are fully typed.)
"""Block-usage and fragmentation statistics of a paged KV pool, computed on the GPU.

One launch (``StatsLaunchConfig.fused``, the default) with three kinds of program, told
apart by program id:

- *row programs* stream the block table (the bulk of the bytes): they count the valid
  entries of each sequence and mark every referenced block id in a ``used`` map. By
  default there are only as many as fit on the GPU at once, each looping over rows
  (``StatsLaunchConfig.one_wave``);
- *free programs* mark the ids of the free list in a ``free`` map;
- *scan programs* (the highest ids) each summarise one chunk of the maps: the free runs
  as soon as the free programs are done (while the table still streams), the used
  counts once every row program is done, clearing the chunk for the next call; the last
  one to finish folds the chunk summaries into the pool's totals and resets the counters.

Nothing is passed from the host per call (no epoch, no memset): a call, or a CUDA graph
of calls, can be replayed as is. A :class:`BlockStatsWorkspace` therefore belongs to one
caller (one stream) at a time.

Why waiting inside one launch cannot hang: a scan program only waits for programs with
lower ids, and the hardware hands out a launch's programs in increasing id order, so by
the time a scan program runs every marking program has started, and marking programs
wait for nothing. (CUDA does not promise that order; if it were ever broken, a hang would
still need fewer free slots on the whole GPU than there are scan programs, at most
``ceil(num_blocks / chunk)``: 27 for a 140 GB pool.) Triton's interpreter runs programs
one after another in id order, so the CPU tests take the same path. ``fused=False``
keeps the two-launch form (marking, then scanning), which needs no such argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, interpreting, normalize_device

# Layout of the int64 result vector written by the last scan program.
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
# The int32 counters of a workspace: row programs finished, free programs finished, scan
# programs finished.
_SYNC_ROWS = tl.constexpr(0)
_SYNC_FREE = tl.constexpr(1)
_SYNC_SCANNED = tl.constexpr(2)
_SYNC_LEN = 3


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
def _mark_rows(
    table_ptr,
    row_stride,
    lens_ptr,
    num_rows,
    num_cols,
    num_blocks,
    used_mark_ptr,
    blocks_per_seq_ptr,
    group,
    HAS_LENS: tl.constexpr,
    EVEN: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    rows = group * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    row_base = table_ptr + rows.to(tl.int64)[:, None] * row_stride
    if HAS_LENS:
        lens = tl.load(lens_ptr + rows, mask=row_ok, other=0)
        lens = tl.minimum(tl.maximum(lens, 0), num_cols)
        # Reading up to the next multiple of 4 keeps the loads 16 bytes wide; the extra
        # entries are masked out of the counts below.
        lens_load = tl.multiple_of(tl.minimum((lens + 3) // 4 * 4, num_cols), 4)
        cols_needed = tl.max(lens_load, axis=0)
    else:
        cols_needed = num_cols
    # Counts stay per element until the loop ends: no cross-thread reduction per step.
    counts = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for c0 in range(0, cols_needed, COLS):
        # Declared non-contiguous on purpose: the loads then take the one-element-per-
        # thread layout of the scattered atomics below (still coalesced: a warp reads 128
        # bytes at once), and no step reshuffles the ids through shared memory.
        cols = tl.max_contiguous(c0 + tl.arange(0, COLS), 1)
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
        counts += valid.to(tl.int32)
        # An atomic, not a store: Triton lays a scattered store out one element per
        # thread and would shuffle the loaded ids through shared memory every step; the
        # atomic keeps the load's 16-byte layout (and is fire-and-forget: result unused).
        tl.atomic_max(used_mark_ptr + ids, 1, mask=valid, sem="relaxed")
    tl.store(blocks_per_seq_ptr + rows, tl.sum(counts, axis=1), mask=row_ok)


@triton.jit
def _mark_row_groups(
    table_ptr,
    row_stride,
    lens_ptr,
    num_rows,
    num_cols,
    num_blocks,
    used_mark_ptr,
    blocks_per_seq_ptr,
    pid,
    num_row_groups,
    num_row_programs,
    HAS_LENS: tl.constexpr,
    EVEN: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """The mark phase of one row program (the fused and the two-launch kernels share it): row groups
    pid, pid + programs, ... (inlined by Triton, so both kernels compile as before)."""
    for group in range(pid, num_row_groups, num_row_programs):
        _mark_rows(
            table_ptr,
            row_stride,
            lens_ptr,
            num_rows,
            num_cols,
            num_blocks,
            used_mark_ptr,
            blocks_per_seq_ptr,
            group,
            HAS_LENS,
            EVEN,
            ROWS,
            COLS,
        )


@triton.jit
def _mark_free(free_ptr, num_free, num_blocks, free_mark_ptr, group, FREE_BLOCK: tl.constexpr):
    offs = group * FREE_BLOCK + tl.arange(0, FREE_BLOCK)
    in_list = offs < num_free
    ids = tl.load(free_ptr + offs, mask=in_list, other=-1)
    ok = in_list & (ids >= 0) & (ids < num_blocks)
    tl.atomic_max(free_mark_ptr + ids, 1, mask=ok, sem="relaxed")


@triton.jit
def _scan_free(free_mark_ptr, num_blocks, summary_ptr, chunk, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """The free runs of one chunk: needs the free list marked, not the table."""
    idx = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + idx
    inside = offs < num_blocks
    # .cg: read at L2, where other programs' marks landed, never a stale L1 line.
    free = (tl.load(free_mark_ptr + offs, mask=inside, other=0, cache_modifier=".cg") != 0) & inside
    last_busy = tl.associative_scan(tl.where(free, -1, idx), 0, _max_combine)
    run_end = idx - last_busy  # length of the free run that ends at idx; 0 where busy
    suffix = tl.sum(tl.where(idx == CHUNK - 1, run_end, 0), axis=0)
    prefix = tl.min(tl.where(free, CHUNK, idx), axis=0)
    row = summary_ptr + chunk
    tl.store(row + _SUM_FREE * MAX_CHUNKS, tl.sum(free.to(tl.int32), axis=0))
    tl.store(row + _SUM_PRE * MAX_CHUNKS, prefix)
    tl.store(row + _SUM_SUF * MAX_CHUNKS, suffix)
    tl.store(row + _SUM_BEST * MAX_CHUNKS, tl.max(run_end, axis=0))
    tl.store(row + _SUM_STARTS * MAX_CHUNKS, tl.sum((run_end == 1).to(tl.int32), axis=0))


@triton.jit
def _scan_used(
    used_mark_ptr, free_mark_ptr, num_blocks, summary_ptr, chunk, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr
):
    """The rest of one chunk once the table is marked; clears both maps for the next call."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < num_blocks
    used = (tl.load(used_mark_ptr + offs, mask=inside, other=0, cache_modifier=".cg") != 0) & inside
    free = (tl.load(free_mark_ptr + offs, mask=inside, other=0, cache_modifier=".cg") != 0) & inside
    # Cleared as read, so the next call starts from empty maps with no memset launch.
    cleared = tl.zeros([CHUNK], dtype=tl.int32)
    tl.store(used_mark_ptr + offs, cleared, mask=inside)
    tl.store(free_mark_ptr + offs, cleared, mask=inside)
    row = summary_ptr + chunk
    tl.store(row + _SUM_USED * MAX_CHUNKS, tl.sum(used.to(tl.int32), axis=0))
    tl.store(row + _SUM_BOTH * MAX_CHUNKS, tl.sum((used & free).to(tl.int32), axis=0))
    tl.store(row + _SUM_NEITHER * MAX_CHUNKS, tl.sum((inside & ~used & ~free).to(tl.int32), axis=0))


@triton.jit
def _wait_for(counter_ptr, target, POLL_WITH_LOAD: tl.constexpr):
    # Only ever waits for programs of lower ids (module docstring). Polling with plain
    # volatile loads leaves the counter's atomic unit to the programs that increment it;
    # one acquire at the end orders what follows.
    if POLL_WITH_LOAD:
        while tl.load(counter_ptr, volatile=True) < target:
            pass
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    else:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _fold_if_last(summary_ptr, sync_ptr, result_ptr, num_chunks, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    # Last-program-done: every scan program has published its summary, then takes a
    # ticket; the barrier orders all of this program's stores before the release.
    tl.debug_barrier()
    ticket = tl.atomic_add(sync_ptr + _SYNC_SCANNED, 1, sem="acq_rel", scope="gpu")
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
        # Every program of this call is past every counter: ready for the next call.
        tl.atomic_xchg(sync_ptr + _SYNC_ROWS, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + _SYNC_FREE, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + _SYNC_SCANNED, 0, sem="relaxed", scope="gpu")


@triton.jit
def _stats_kernel(
    table_ptr,
    row_stride,
    lens_ptr,
    num_rows,
    num_cols,
    free_ptr,
    num_free,
    num_blocks,
    used_mark_ptr,
    free_mark_ptr,
    blocks_per_seq_ptr,
    summary_ptr,
    sync_ptr,
    result_ptr,
    num_row_groups,
    num_row_programs,
    num_mark_programs,
    num_chunks,
    HAS_LENS: tl.constexpr,
    EVEN: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    FREE_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    POLL_WITH_LOAD: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_row_programs:
        _mark_row_groups(
            table_ptr,
            row_stride,
            lens_ptr,
            num_rows,
            num_cols,
            num_blocks,
            used_mark_ptr,
            blocks_per_seq_ptr,
            pid,
            num_row_groups,
            num_row_programs,
            HAS_LENS,
            EVEN,
            ROWS,
            COLS,
        )
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + _SYNC_ROWS, 1, sem="release", scope="gpu")
    elif pid < num_mark_programs:
        _mark_free(free_ptr, num_free, num_blocks, free_mark_ptr, pid - num_row_programs, FREE_BLOCK)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + _SYNC_FREE, 1, sem="release", scope="gpu")
    else:
        chunk = pid - num_mark_programs
        # The free runs while the table still streams; then what needs the used map.
        _wait_for(sync_ptr + _SYNC_FREE, num_mark_programs - num_row_programs, POLL_WITH_LOAD)
        _scan_free(free_mark_ptr, num_blocks, summary_ptr, chunk, CHUNK, MAX_CHUNKS)
        _wait_for(sync_ptr + _SYNC_ROWS, num_row_programs, POLL_WITH_LOAD)
        _scan_used(used_mark_ptr, free_mark_ptr, num_blocks, summary_ptr, chunk, CHUNK, MAX_CHUNKS)
        _fold_if_last(summary_ptr, sync_ptr, result_ptr, num_chunks, CHUNK, MAX_CHUNKS)


@triton.jit
def _mark_kernel(
    table_ptr,
    row_stride,
    lens_ptr,
    num_rows,
    num_cols,
    free_ptr,
    num_free,
    num_blocks,
    used_mark_ptr,
    free_mark_ptr,
    blocks_per_seq_ptr,
    num_row_groups,
    num_row_programs,
    HAS_LENS: tl.constexpr,
    EVEN: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    FREE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_row_programs:
        _mark_row_groups(
            table_ptr,
            row_stride,
            lens_ptr,
            num_rows,
            num_cols,
            num_blocks,
            used_mark_ptr,
            blocks_per_seq_ptr,
            pid,
            num_row_groups,
            num_row_programs,
            HAS_LENS,
            EVEN,
            ROWS,
            COLS,
        )
    else:
        _mark_free(free_ptr, num_free, num_blocks, free_mark_ptr, pid - num_row_programs, FREE_BLOCK)


@triton.jit
def _scan_kernel(
    used_mark_ptr,
    free_mark_ptr,
    num_blocks,
    summary_ptr,
    sync_ptr,
    result_ptr,
    num_chunks,
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
):
    _scan_free(free_mark_ptr, num_blocks, summary_ptr, tl.program_id(0), CHUNK, MAX_CHUNKS)
    _scan_used(used_mark_ptr, free_mark_ptr, num_blocks, summary_ptr, tl.program_id(0), CHUNK, MAX_CHUNKS)
    _fold_if_last(summary_ptr, sync_ptr, result_ptr, num_chunks, CHUNK, MAX_CHUNKS)


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
        return cls(
            num_blocks,
            torch.empty(num_seqs, dtype=torch.int32, device=device),
            torch.empty(_RESULT_LEN, dtype=torch.int64, device=device),
        )

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
    rows: int = 1  # table rows per row program
    cols: int = 2048  # columns per loop step
    free_block: int = 1024
    chunk: int = 1024
    mark_warps: int = 8  # the fused launch's warps too
    scan_warps: int = 4  # two-launch form only
    fused: bool = True
    poll_with_load: bool = False  # fused: scan programs poll the counters with loads, not atomics
    one_wave: bool = True  # row programs loop over row groups, as many as fit on the GPU at once
    max_row_programs: int | None = None  # at most this many row programs (CPU tests use it for the loop)
    maxnreg: int | None = None  # registers per thread at most: more programs fit on an SM


class BlockStatsWorkspace:
    """Scratch memory of the statistics kernels for one pool; reuse it across calls."""

    def __init__(self, num_blocks: int, device: torch.device | str, config: StatsLaunchConfig | None = None) -> None:
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
        self.sync = torch.zeros(_SYNC_LEN, dtype=torch.int32, device=self.device)

    def reset(self) -> None:
        """Back to a clean state after a launch was interrupted (a kernel error, say)."""
        for buffer in (self.used_mark, self.free_mark, self.summary, self.sync):
            buffer.zero_()


# Programs of one compiled statistics kernel that fit on one SM at once, by device and
# compile options: the register count is known only once the kernel is compiled.
_resident_per_sm: dict[tuple[Any, ...], int] = {}


def _row_programs(
    cfg: StatsLaunchConfig,
    row_groups: int,
    other_programs: int,
    device: torch.device,
    kernel: Any,
    args: list[Any],
    options: dict[str, Any],
) -> int:
    """How many row programs to launch: one per row group, or (``cfg.one_wave``) as many as
    fit on the GPU at once beside the launch's other programs, each looping over groups.

    One wave matters because each row program ends with a dependent chain (reduce, store,
    fence, signal) of a few microseconds; a launch of more programs than fit pays that
    chain once per wave, which dominated a 1024-row table."""
    programs = row_groups
    if cfg.max_row_programs is not None:
        programs = min(programs, cfg.max_row_programs)
    if not cfg.one_wave or interpreting():
        return max(1, programs)
    key = (device, kernel.fn.__name__, tuple(sorted((k, str(v)) for k, v in options.items())))
    per_sm = _resident_per_sm.get(key)
    if per_sm is None:
        compiled = kernel.warmup(*args, grid=(1,), **options)
        compiled._init_handles()
        per_sm = _programs_per_sm(compiled.n_regs, int(options["num_warps"]))
        _resident_per_sm[key] = per_sm
    slots = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(programs, slots - other_programs))


def _programs_per_sm(regs_per_thread: int, warps: int) -> int:
    """Resident programs per SM of a Hopper-class GPU, limited by registers and threads."""
    regs_per_warp = -(-regs_per_thread * 32 // 256) * 256  # allocated 256 registers at a time
    warps_by_regs = 65536 // regs_per_warp
    return max(1, min(warps_by_regs // warps, 64 // warps, 32))


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
    """Launch the statistics kernel(s) on the current stream; nothing waits for them.

    ``block_table``: int32 [num_seqs, max_blocks_per_seq], entries < 0 unused (vLLM's
    zero-padded table needs ``num_blocks_per_seq``, int32 [num_seqs], instead).
    ``free_block_ids``: int32 [num_free], the pool's free-block list in any order.
    ``out``: tensors to write into (reused across calls, or poisoned by tests).
    With ``out`` given and contiguous inputs, the call allocates nothing and passes no
    per-call value, so it can be captured in a CUDA graph and replayed on new contents.
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
    row_groups = triton.cdiv(num_rows, cfg.rows)
    free_programs = triton.cdiv(free_block_ids.shape[0], cfg.free_block)
    lens = num_blocks_per_seq if num_blocks_per_seq is not None else blocks_per_seq
    has_lens = num_blocks_per_seq is not None
    even = num_rows % cfg.rows == 0 and num_cols % cfg.cols == 0
    marking_args = [
        block_table,
        block_table.stride(0),
        lens,
        num_rows,
        num_cols,
        free_block_ids,
        free_block_ids.shape[0],
        workspace.num_blocks,
        workspace.used_mark,
        workspace.free_mark,
        blocks_per_seq,
    ]
    marking_options: dict[str, Any] = dict(
        HAS_LENS=has_lens, EVEN=even, ROWS=cfg.rows, COLS=cfg.cols, FREE_BLOCK=cfg.free_block, num_warps=cfg.mark_warps
    )
    if cfg.maxnreg is not None and not interpreting():
        marking_options["maxnreg"] = cfg.maxnreg
    if cfg.fused:
        fused_args = [workspace.summary, workspace.sync, totals, row_groups]
        fused_options = dict(
            marking_options, CHUNK=cfg.chunk, MAX_CHUNKS=workspace.max_chunks, POLL_WITH_LOAD=cfg.poll_with_load
        )
        row_programs = _row_programs(
            cfg,
            row_groups,
            free_programs + workspace.num_chunks,
            device,
            _stats_kernel,
            [*marking_args, *fused_args, row_groups, row_groups + free_programs, workspace.num_chunks],
            fused_options,
        )
        mark_programs = row_programs + free_programs
        _stats_kernel[(mark_programs + workspace.num_chunks,)](
            *marking_args, *fused_args, row_programs, mark_programs, workspace.num_chunks, **fused_options
        )
        return out
    row_programs = _row_programs(
        cfg, row_groups, free_programs, device, _mark_kernel, [*marking_args, row_groups, row_groups], marking_options
    )
    if row_programs + free_programs > 0:
        _mark_kernel[(row_programs + free_programs,)](*marking_args, row_groups, row_programs, **marking_options)
    _scan_kernel[(workspace.num_chunks,)](
        workspace.used_mark,
        workspace.free_mark,
        workspace.num_blocks,
        workspace.summary,
        workspace.sync,
        totals,
        workspace.num_chunks,
        CHUNK=cfg.chunk,
        MAX_CHUNKS=workspace.max_chunks,
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


def stats_bytes_moved(
    block_table: torch.Tensor,
    free_block_ids: torch.Tensor,
    num_blocks: int,
    num_blocks_per_seq: torch.Tensor | None = None,
) -> int:
    """Bytes a call must read and write at the least (int32 everywhere)."""
    num_rows, num_cols = block_table.shape
    if num_blocks_per_seq is None:
        table_read = num_rows * num_cols
        valid = int(((block_table >= 0) & (block_table < num_blocks)).sum())
    else:
        lens = num_blocks_per_seq.clamp(0, num_cols)
        table_read = int(lens.sum()) + num_rows
        valid = table_read - num_rows
    free = free_block_ids.shape[0]
    marking = 4 * (table_read + free + num_rows + valid + free)
    scanning = 4 * 2 * 2 * num_blocks  # both maps read, then cleared
    return marking + scanning
