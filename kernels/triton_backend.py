"""`triton` backend: our own Triton TBE-style kernels (GPU; CPU through Triton's interpreter).

Layout. All tables live in ONE flat weight buffer (one dtype for all tables) with a per-table element
offset, and the row-wise AdaGrad state in one flat fp32 buffer; `weights()`/`states()` are live
per-table views into them. One flat buffer is what lets a single launch serve every table.

Forward: one launch, grid `(B, T)`; program `(b, t)` gathers `BLOCK_N` ids x `BLOCK_D` columns at a
time (masked: tables may have different dims, `BLOCK_D` = next power of two >= max dim) and sums in
fp32. Column masks are constant over groups of `VEC` (4 when every dim is a multiple of 4) columns,
so the compiler issues 16-byte loads; a per-column mask made every load 4 bytes wide.

Backward fused with the optimizer (exact: one update per unique row, as FBGEMM's EXACT_* modes):
device-side preparation sorts the keys `table << row_bits | row` and cuts them into runs of equal
rows, with no host sync (arrays sized by upper bounds, counts read on the device); each program
reduces and updates a tile of `block_rows` runs (4 by default) of at most `split_len` ids. Longer
runs (hot rows of a Zipf distribution) are cut into `split_len` chunks whose partial sums are
computed in parallel by a first kernel, so a hot row does not serialise the batch on one program;
the update kernel then adds the run's partials. Both branches are expressed as (possibly empty)
loop ranges, so the update kernel has no data-dependent `if`.
Measured numbers: benchmarks/data/gpu_h100/NOTES.md, benchmarks/data/gpu_h200/NOTES.md.

`singles=True` (opt-in; measured slower, so not the default): the keys kernel also counts each row's hits with
atomics; rows hit once (72% of the ids of the H100 benchmark: 2.6M uniform ids over 8 x 1M rows) are
updated straight from their one gradient row by an unsorted kernel, and only the other ids are
sorted. The same bits as the all-sorted path (a row hit once has nothing to sum; the rest keep batch
order), for a smaller sort and run preparation, at the cost of one host sync queued behind the
singles kernel. On an H200 it lost on both id sets (backward 1.25x the sorted path's time on uniform ids,
1.6x on hot ones, 3 runs each): the hit counts' memset and atomics and the host sync cost more than the
shorter sort saves. `bash benchmarks/gpu_suite.sh bench` times both side by side.

CPU: Triton compiles for GPUs only; on CPU the kernels run under Triton's interpreter, which must be
chosen before `triton.language` is first imported (its own `tl.sum`/`tl.zeros` are jit functions
decorated at import). So on a machine without CUDA, importing this module first sets
TRITON_INTERPRET=1 unless the variable is already set or triton is already imported. `INTERPRETED`
says which mode this process got; a CPU-device kernel without it raises a clear error.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from cubic_kernels.base import DTYPES, EmbeddingBagKernel, check_weights  # noqa: E402

#: True when Triton's stdlib (and so our kernels) run under the interpreter in this process.
INTERPRETED: bool = isinstance(tl.sum, InterpretedFunction)


def _fwd_kernel(ids_ptr, offsets_ptr, w_ptr, out_ptr, w_off_ptr, dims_ptr, col_off_ptr, sc_ptr, B, out_stride,
                VEC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    bag = t.to(tl.int64) * B + b
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    D = tl.load(dims_ptr + t).to(tl.int64)
    w_base = tl.load(w_off_ptr + t)
    cols = tl.arange(0, BLOCK_D)
    cmask = (cols // VEC) < (D // VEC)  # constant over VEC columns: lets the loads be VEC wide
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(start, end, BLOCK_N):
        pos = i + tl.arange(0, BLOCK_N)
        m = pos < end
        rows = tl.load(ids_ptr + pos, mask=m, other=0).to(tl.int64)
        addr = tl.multiple_of(w_base + rows * D, VEC)
        vals = tl.load(w_ptr + addr[:, None] + cols[None, :], mask=m[:, None] & cmask[None, :], other=0.0)
        vals = vals.to(tl.float32)
        if HAS_W:  # per-sample weights: each row scaled by its id's score
            vals = vals * tl.load(sc_ptr + pos, mask=m, other=0.0)[:, None]
        acc += tl.sum(vals, axis=0)
    o = tl.multiple_of(b * out_stride + tl.load(col_off_ptr + t).to(tl.int64), VEC)
    tl.store(out_ptr + o + cols, acc, mask=cmask)


def _keys_kernel(ids_ptr, offsets_ptr, key_ptr, b_ptr, count_ptr, row_base_ptr, B, ROW_BITS: tl.constexpr,
                 COUNT: tl.constexpr, BAGS: tl.constexpr, BLOCK: tl.constexpr):
    """Sort keys `table << ROW_BITS | row` and each id's bag row `b`; one program per `BAGS` bags.
    With COUNT, also how many ids hit each row (`count`, indexed by `row_base[table] + row`).

    The bags' ids are contiguous, so the program streams them in `BLOCK`s and finds each id's bag by
    counting the bag ends at or before it (one program per bag was latency-bound: 4x slower).
    """
    b0 = tl.program_id(0) * BAGS
    t = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, BAGS)
    ends = tl.load(offsets_ptr + t * B + b0 + 1 + k, mask=b0 + k < B, other=0).to(tl.int64)
    ends = tl.where(b0 + k < B, ends, 2**62)  # bags past B: never counted
    lo = tl.load(offsets_ptr + t * B + b0).to(tl.int64)
    hi = tl.load(offsets_ptr + t * B + tl.minimum(b0 + BAGS, B)).to(tl.int64)
    table = t << ROW_BITS
    for i in range(lo, hi, BLOCK):
        pos = i + tl.arange(0, BLOCK)
        m = pos < hi
        row = tl.load(ids_ptr + pos, mask=m, other=0).to(tl.int64)
        tl.store(key_ptr + pos, (table | row).to(key_ptr.dtype.element_ty), mask=m)
        bag = b0 + tl.sum((pos[:, None] >= ends[None, :]).to(tl.int32), axis=1)
        tl.store(b_ptr + pos, bag, mask=m)
        if COUNT:
            tl.atomic_add(count_ptr + tl.load(row_base_ptr + t) + row, 1, mask=m)


def _slots_kernel(run_start_ptr, sorted_key_ptr, sorted_b_ptr, run_key_ptr, first_b_ptr, nch_ptr, n_runs_ptr,
                  sorted_sc_ptr, first_sc_ptr, n, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr):
    """Per run slot: its key, its first id's bag row (and score, with HAS_W), its chunk count (ceil(len / SPLIT)
    for runs longer than SPLIT, else 0); and the number of runs. Slot-indexed copies let the update kernel start
    every row's weight, state and first-gradient loads at once instead of after a dependent load."""
    u = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = u < n
    s = tl.load(run_start_ptr + u, mask=m, other=n)
    e = tl.load(run_start_ptr + u + 1, mask=m, other=n)
    live = m & (e > s)
    tl.store(run_key_ptr + u, tl.load(sorted_key_ptr + s, mask=live, other=0), mask=m)
    tl.store(first_b_ptr + u, tl.load(sorted_b_ptr + s, mask=live, other=0), mask=m)
    if HAS_W:
        tl.store(first_sc_ptr + u, tl.load(sorted_sc_ptr + s, mask=live, other=0.0), mask=m)
    ln = e - s
    tl.store(nch_ptr + u, tl.where(ln > SPLIT, (ln + SPLIT - 1) // SPLIT, 0).to(nch_ptr.dtype.element_ty), mask=m)
    tl.store(n_runs_ptr + 0 * u, (u + 1).to(n_runs_ptr.dtype.element_ty), mask=live & (e == n))  # the last run


def _add_grad_rows(acc, sorted_b_ptr, sorted_sc_ptr, grad_ptr, grad_stride, c0, cols, m2, start, stop, first_j,
                   IDX: tl.constexpr, VEC: tl.constexpr, EVICT: tl.constexpr, HAS_W: tl.constexpr):
    """`acc` plus the gradient rows of sorted ids `start + j` for `first_j <= j`, `start + j < stop`
    (per tile row), each scaled by the id's score with HAS_W. With EVICT they ask L2 to keep them: each is
    re-read by every id of its bag."""
    for j in range(first_j, tl.max(stop - start, axis=0)):
        pos = start + j
        m = pos < stop
        bb = tl.load(sorted_b_ptr + pos, mask=m, other=0).to(IDX)
        g_row = tl.multiple_of(bb * grad_stride + c0, VEC)
        g = tl.load(grad_ptr + g_row[:, None] + cols[None, :], mask=m[:, None] & m2, other=0.0,
                    eviction_policy="evict_last" if EVICT else "")
        if HAS_W:
            g = g * tl.load(sorted_sc_ptr + pos, mask=m, other=0.0)[:, None]
        acc += g
    return acc


def _locate_rows(key, um, cols, dims_ptr, col_off_ptr, w_off_ptr, s_off_ptr, w_ptr, s_ptr,
                 IDX: tl.constexpr, ROW_BITS: tl.constexpr, VEC: tl.constexpr):
    """For a tile of keys `table << ROW_BITS | row` (live where `um`): the table's dim and gradient
    column offset, the tile's column mask, and pointers to each row's weights and AdaGrad state."""
    t = (key >> ROW_BITS).to(tl.int32)
    row = (key & ((1 << ROW_BITS) - 1)).to(IDX)
    D = tl.load(dims_ptr + t, mask=um, other=1).to(IDX)
    c0 = tl.load(col_off_ptr + t, mask=um, other=0).to(IDX)
    m2 = um[:, None] & ((cols // VEC)[None, :] < (D // VEC)[:, None])
    w_row = tl.multiple_of(tl.load(w_off_ptr + t, mask=um, other=0).to(IDX) + row * D, VEC)
    s_p = s_ptr + tl.load(s_off_ptr + t, mask=um, other=0).to(IDX) + row
    return D, c0, m2, w_ptr + w_row[:, None] + cols[None, :], s_p


def _store_update(w, st, g, w_ptrs, s_p, D, m2, um, lr, eps, ADAGRAD: tl.constexpr, BF16: tl.constexpr,
                  EVICT: tl.constexpr):
    """Exact row-wise AdaGrad (`st += mean(g*g)`, `w -= lr g / (sqrt(st) + eps)`) or SGD on a tile of
    rows given their fp32 weights `w`, state `st` and summed gradient `g`; stores weights and state."""
    if ADAGRAD:
        st = st + tl.div_rn(tl.sum(g * g, axis=1), D.to(tl.float32))
        tl.store(s_p, st, mask=um)
        w = w - tl.div_rn(lr * g, tl.sqrt_rn(st)[:, None] + eps)
    else:
        w = w - lr * g
    if BF16:
        # explicit round-to-nearest-even on the bits: the interpreter's fp32->bf16 cast truncates,
        # the GPU's rounds; doing it by hand gives torch's `.to(bfloat16)` on both
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        w_new = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        w_new = w.to(w_ptrs.dtype.element_ty)
    tl.store(w_ptrs, w_new, mask=m2, eviction_policy="evict_first" if EVICT else "")


def _bwd_singles_kernel(key_ptr, b_ptr, sc_ptr, count_ptr, multi_ptr, grad_ptr, grad_stride, dims_ptr, col_off_ptr,
                        w_off_ptr, s_off_ptr, w_ptr, s_ptr, n, lr, eps, ADAGRAD: tl.constexpr, BF16: tl.constexpr,
                        IDX: tl.constexpr, ROW_BITS: tl.constexpr, VEC: tl.constexpr, EVICT: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr):
    """`BLOCK_R` ids per program, unsorted: an id whose row no other id of the batch hits (`count` 1;
    most rows for uniform ids) updates that row from its one gradient row, with no sort and nothing to
    reduce; the ids of rows hit more than once are flagged in `multi` for the sorted path."""
    i = tl.program_id(0).to(IDX) * BLOCK_R + tl.arange(0, BLOCK_R)
    im = i < n
    key = tl.load(key_ptr + i, mask=im, other=0)
    b = tl.load(b_ptr + i, mask=im, other=0).to(IDX)
    t = (key >> ROW_BITS).to(tl.int32)
    row = (key & ((1 << ROW_BITS) - 1)).to(IDX)
    hits = tl.load(count_ptr + tl.load(s_off_ptr + t, mask=im, other=0).to(IDX) + row, mask=im, other=0)
    tl.store(multi_ptr + i, (hits > 1).to(tl.int8), mask=im)
    um = im & (hits == 1)
    cols = tl.arange(0, BLOCK_D)
    D, c0, m2, w_ptrs, s_p = _locate_rows(key, um, cols, dims_ptr, col_off_ptr, w_off_ptr, s_off_ptr, w_ptr,
                                          s_ptr, IDX, ROW_BITS, VEC)
    w = tl.load(w_ptrs, mask=m2, other=0.0, eviction_policy="evict_first" if EVICT else "").to(tl.float32)
    st = tl.load(s_p, mask=um, other=0.0) if ADAGRAD else tl.zeros([BLOCK_R], tl.float32)
    g_row = tl.multiple_of(b * grad_stride + c0, VEC)
    g = tl.load(grad_ptr + g_row[:, None] + cols[None, :], mask=m2, other=0.0,
                eviction_policy="evict_last" if EVICT else "")
    if HAS_W:
        g = g * tl.load(sc_ptr + i, mask=um, other=0.0)[:, None]
    _store_update(w, st, g, w_ptrs, s_p, D, m2, um, lr, eps, ADAGRAD, BF16, EVICT)


def _bwd_partial_kernel(sorted_b_ptr, sorted_sc_ptr, grad_ptr, grad_stride, run_key_ptr, run_start_ptr, pend_ptr,
                        chunk_run_ptr, dims_ptr, col_off_ptr, part_ptr, n_slots, cap,
                        IDX: tl.constexpr, ROW_BITS: tl.constexpr, SPLIT: tl.constexpr, VEC: tl.constexpr,
                        EVICT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr):
    """Partial gradient sums of chunks of long runs -> `part[c, :BLOCK_D]` (fp32), `BLOCK_R` at a time.

    Chunk `c` belongs to run `chunk_run[c]`. The number of chunks is read on the device (the last
    `pend`): programs stride over the chunk tiles up to it, so a batch without long runs costs one
    wave of programs that find nothing to do, and no host sync sizes the grid.
    """
    total = tl.minimum(tl.load(pend_ptr + n_slots - 1).to(IDX), cap)
    cols = tl.arange(0, BLOCK_D)
    for tile in range(tl.program_id(0), tl.cdiv(total, BLOCK_R), tl.num_programs(0)):
        c = (tl.zeros([BLOCK_R], IDX) + tile) * BLOCK_R + tl.arange(0, BLOCK_R)  # tile: int in the interpreter
        cm = c < total
        u = tl.load(chunk_run_ptr + c, mask=cm, other=0).to(IDX)
        s = tl.load(run_start_ptr + u, mask=cm, other=0).to(IDX)
        e = tl.load(run_start_ptr + u + 1, mask=cm, other=0).to(IDX)
        first = tl.load(pend_ptr + u, mask=cm, other=0).to(IDX) - (e - s + SPLIT - 1) // SPLIT
        cs = s + (c - first) * SPLIT
        ce = tl.where(cm, tl.minimum(cs + SPLIT, e), cs)
        t = (tl.load(run_key_ptr + u, mask=cm, other=0) >> ROW_BITS).to(tl.int32)
        D = tl.load(dims_ptr + t, mask=cm, other=1).to(IDX)
        c0 = tl.load(col_off_ptr + t, mask=cm, other=0).to(IDX)
        m2 = cm[:, None] & ((cols // VEC)[None, :] < (D // VEC)[:, None])
        acc = _add_grad_rows(tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32), sorted_b_ptr, sorted_sc_ptr, grad_ptr,
                             grad_stride, c0, cols, m2, cs, ce, 0, IDX, VEC, EVICT, HAS_W)
        tl.store(part_ptr + c[:, None] * BLOCK_D + cols[None, :], acc, mask=cm[:, None])


def _bwd_update_kernel(sorted_b_ptr, sorted_sc_ptr, grad_ptr, grad_stride, run_key_ptr, first_b_ptr, first_sc_ptr,
                       run_start_ptr, pend_ptr, part_ptr, dims_ptr, col_off_ptr, w_off_ptr, s_off_ptr, w_ptr, s_ptr,
                       n_runs_ptr, lr, eps, ADAGRAD: tl.constexpr, BF16: tl.constexpr, IDX: tl.constexpr,
                       ROW_BITS: tl.constexpr, SPLIT: tl.constexpr, VEC: tl.constexpr, EVICT: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr):
    """`BLOCK_R` unique rows per tile: reduce each one's gradient (ids, or chunk partials), update.

    Run `u` is `[run_start[u], run_start[u+1])` of the sorted ids; programs stride over the tiles up
    to the device-side run count, so the grid may be an upper bound. A row's weights, state and
    first gradient row are all loaded at once from slot-indexed arrays (for uniform ids most runs
    have one id, so that is the whole reduction); only longer runs walk `sorted_b`. Index
    arithmetic runs in `IDX` (int32 when every buffer has fewer than 2**31 elements: fewer
    registers per row, more rows in flight). With EVICT, gradient reads ask L2 to keep them (each
    is re-read by every id of its bag) and weight traffic to go first (each row is touched once).
    """
    n_runs = tl.load(n_runs_ptr).to(IDX)
    cols = tl.arange(0, BLOCK_D)
    for tile in range(tl.program_id(0), tl.cdiv(n_runs, BLOCK_R), tl.num_programs(0)):
        u = (tl.zeros([BLOCK_R], IDX) + tile) * BLOCK_R + tl.arange(0, BLOCK_R)
        um = u < n_runs
        key = tl.load(run_key_ptr + u, mask=um, other=0)
        b0 = tl.load(first_b_ptr + u, mask=um, other=0).to(IDX)
        s = tl.load(run_start_ptr + u, mask=um, other=0).to(IDX)
        e = tl.load(run_start_ptr + u + 1, mask=um, other=0).to(IDX)
        D, c0, m2, w_ptrs, s_p = _locate_rows(key, um, cols, dims_ptr, col_off_ptr, w_off_ptr, s_off_ptr, w_ptr,
                                              s_ptr, IDX, ROW_BITS, VEC)
        w = tl.load(w_ptrs, mask=m2, other=0.0, eviction_policy="evict_first" if EVICT else "").to(tl.float32)
        st = tl.load(s_p, mask=um, other=0.0) if ADAGRAD else tl.zeros([BLOCK_R], tl.float32)
        ln = e - s
        long = ln > SPLIT
        g_row = tl.multiple_of(b0 * grad_stride + c0, VEC)
        g = tl.load(grad_ptr + g_row[:, None] + cols[None, :], mask=(~long)[:, None] & m2, other=0.0,
                    eviction_policy="evict_last" if EVICT else "")
        if HAS_W:  # the first id's score
            g = g * tl.load(first_sc_ptr + u, mask=um, other=0.0)[:, None]
        # short runs: their other ids (none for long runs)
        g = _add_grad_rows(g, sorted_b_ptr, sorted_sc_ptr, grad_ptr, grad_stride, c0, cols, m2, s,
                           tl.where(long, s, e), 1, IDX, VEC, EVICT, HAS_W)
        nch = tl.where(long, (ln + SPLIT - 1) // SPLIT, 0)
        first = tl.load(pend_ptr + u, mask=um & long, other=0).to(IDX) - nch
        for j in range(0, tl.max(nch, axis=0)):  # long runs: their chunk partials (none for short runs)
            g += tl.load(part_ptr + (first + j)[:, None] * BLOCK_D + cols[None, :],
                         mask=(j < nch)[:, None] & m2, other=0.0)
        _store_update(w, st, g, w_ptrs, s_p, D, m2, um, lr, eps, ADAGRAD, BF16, EVICT)


_add_grad_rows = triton.jit(_add_grad_rows)
_locate_rows = triton.jit(_locate_rows)
_store_update = triton.jit(_store_update)
_FWD = triton.jit(_fwd_kernel)
_KEYS = triton.jit(_keys_kernel)
_SLOTS = triton.jit(_slots_kernel)
_BWD_SINGLES = triton.jit(_bwd_singles_kernel)
_BWD_PARTIAL = triton.jit(_bwd_partial_kernel)
_BWD_UPDATE = triton.jit(_bwd_update_kernel)


MAX_BLOCK_ROWS = 16


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _vec_width(dims: list[int]) -> int:
    """Widest power of two (<= 4: 16-byte fp32 loads) dividing every dim."""
    v = 4
    while any(d % v for d in dims):
        v //= 2
    return v


class TritonEmbeddingBags(EmbeddingBagKernel):
    """All tables in one flat buffer; one forward launch; sorted, split-run fused backward."""

    name = "triton"

    def __init__(self, rows, dims, *, split_len: int = 32, block_rows: int = 4, num_warps: int = 0,
                 force_idx64: bool = False, evict: bool = True, max_programs: int = 0, singles: bool = False,
                 **kw) -> None:
        super().__init__(rows, dims, **kw)
        if self.device.type != "cuda" and not INTERPRETED:
            raise RuntimeError("triton backend on a non-CUDA device needs Triton's interpreter: set "
                               "TRITON_INTERPRET=1 before triton is first imported in this process")
        if split_len < 1:
            raise ValueError("split_len must be >= 1")
        self.split_len = int(split_len)
        self.evict = bool(evict)
        self.max_programs = int(max_programs)  # 0: one backward program per tile of rows
        # singles: rows hit once skip the sort (one host sync per backward); slower where measured (above)
        self.singles = bool(singles)
        dt = DTYPES[self.weight_dtype]
        sizes = [r * d for r, d in zip(self.rows, self.dims, strict=True)]
        w_off = [0]
        for s in sizes:
            w_off.append(w_off[-1] + s)
        row_base = [0]
        for r in self.rows:
            row_base.append(row_base[-1] + r)
        self._flat_w = torch.zeros(w_off[-1], dtype=dt, device=self.device)
        adagrad = self.optim.kind == "rowwise_adagrad"
        self._flat_s = torch.zeros(row_base[-1] if adagrad else 0, dtype=torch.float32, device=self.device)
        self._w = [self._flat_w[w_off[t]: w_off[t + 1]].view(r, d)
                   for t, (r, d) in enumerate(zip(self.rows, self.dims, strict=True))]
        self._s = ([self._flat_s[row_base[t]: row_base[t + 1]] for t in range(self.num_tables)]
                   if adagrad else [self._flat_s[:0] for _ in self.rows])
        i64 = dict(dtype=torch.int64, device=self.device)
        self._w_off = torch.tensor(w_off[:-1], **i64)
        self._s_off = torch.tensor(row_base[:-1], **i64)  # also the row base of the hit counts
        self._flat_s_rows = row_base[-1]
        self._no_state = torch.zeros(1, dtype=torch.float32, device=self.device)  # state pointer for SGD
        self._dims_t = torch.tensor(self.dims, dtype=torch.int32, device=self.device)
        self._col_off = torch.tensor(self.dim_offsets[:-1], dtype=torch.int32, device=self.device)
        self._block_d = _pow2_at_least(max(self.dims))
        self._vec = _vec_width(self.dims)
        # sort key = table << row_bits | row: the kernels read the table and row back with a shift
        self._row_bits = max(1, (max(self.rows) - 1).bit_length())
        key_max = ((self.num_tables - 1) << self._row_bits) | ((1 << self._row_bits) - 1)
        self._key_dtype = torch.int32 if key_max < 2**31 else torch.int64
        # int32 index arithmetic in the backward when every offset fits (weights, and the gradient
        # and partial buffers checked per call)
        self._idx32 = w_off[-1] < 2**31 and not force_idx64
        # Unique rows per backward program, and warps: measured on an H100 (benchmarks/data/gpu_h100/
        # NOTES.md). The kernel is latency-bound and a tile walks to its longest run, so small tiles
        # with few registers keep the most rows in flight. Triton 3.6 fails to compile the tile at 32+
        # rows (TritonGPURemoveLayoutConversions: "mask type matches ptr type"), hence the cap.
        if not 1 <= block_rows <= MAX_BLOCK_ROWS:
            raise ValueError(f"block_rows={block_rows}: choose 1..{MAX_BLOCK_ROWS} (Triton 3.6 cannot compile more)")
        self.block_rows = _pow2_at_least(block_rows)
        self.num_warps = int(num_warps) if num_warps else max(1, min(4, self.block_rows * self._block_d // 256))

    def weights(self) -> list[torch.Tensor]:
        return self._w

    def states(self) -> list[torch.Tensor]:
        return self._s

    def _batch(self, offsets: torch.Tensor) -> int:
        return (offsets.numel() - 1) // self.num_tables

    @staticmethod
    def _block_n(n_ids: int, n_bags: int) -> int:
        """Ids per gather step from the mean bag length (few distinct values -> few compilations)."""
        return min(32, max(4, _pow2_at_least(-(-n_ids // n_bags))))

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        sc = check_weights(self.name, ids, per_sample_weights)
        T, B = self.num_tables, self._batch(offsets)
        out = torch.empty(B, self.total_dim, dtype=torch.float32, device=self.device)
        if B == 0:
            return out
        _FWD[(B, T)](
            ids.contiguous(), offsets.contiguous(), self._flat_w, out, self._w_off, self._dims_t,
            self._col_off, self._no_state if sc is None else sc.contiguous(), B, out.stride(0), VEC=self._vec,
            BLOCK_N=self._block_n(ids.numel(), T * B), BLOCK_D=self._block_d, HAS_W=sc is not None,
            enable_fp_fusion=False)
        return out

    def _keys(self, ids: torch.Tensor, offsets: torch.Tensor, B: int,
              count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each id's sort key `table << row_bits | row` and bag row; with `count`, per-row hit counts."""
        n, T = ids.numel(), self.num_tables
        key = torch.empty(n, dtype=self._key_dtype, device=ids.device)
        b_of = torch.empty(n, dtype=torch.int32, device=ids.device)  # int32: the update kernels' reads halve
        _KEYS[(triton.cdiv(B, 32), T)](ids, offsets, key, b_of, key if count is None else count, self._s_off, B,
                                       ROW_BITS=self._row_bits, COUNT=count is not None, BAGS=32, BLOCK=128)
        return key, b_of

    def _plan(self, ids: torch.Tensor, offsets: torch.Tensor, B: int) -> dict:
        """The sorted plan of every id of a batch (see `_runs`)."""
        return self._runs(*self._keys(ids, offsets, B))

    def _runs(self, key: torch.Tensor, b_of: torch.Tensor, sc: torch.Tensor | None = None) -> dict:
        """Device-side preparation: sort the keys (the ids' bag rows and scores with them), cut them into runs,
        count long-run chunks.

        No host sync: arrays are sized by upper bounds (`n` run slots, `run_start` padded with `n`;
        `2n / split_len` chunk slots) and the kernels read the actual counts on the device. (v1 read
        them back: two syncs, and the GPU idled while the host queued what followed each; on an H100
        the sync-free plan measured 1.62 vs 1.69 ms per backward with the same kernels.) The sort is
        stable, so a run's ids keep bag order and the summation order is deterministic.
        """
        n, L = key.numel(), self.split_len
        dev = key.device
        sorted_key, perm = torch.sort(key, stable=True)
        sorted_b = b_of[perm]
        sorted_sc = sc[perm] if sc is not None else self._no_state
        first_sc = torch.empty(n if sc is not None else 1, dtype=torch.float32, device=dev)
        new = torch.ones(n, dtype=torch.bool, device=dev)
        torch.ne(sorted_key[1:], sorted_key[:-1], out=new[1:])
        run_start = torch.nonzero_static(new, size=n + 1, fill_value=n).view(-1)
        idx_dt = torch.int32 if self._idx32 else torch.int64
        run_key, first_b = torch.empty_like(sorted_key), torch.empty_like(sorted_b)
        nch = torch.empty(n, dtype=idx_dt, device=dev)
        n_runs = torch.empty(1, dtype=idx_dt, device=dev)
        _SLOTS[(triton.cdiv(n, 1024),)](run_start, sorted_key, sorted_b, run_key, first_b, nch, n_runs, sorted_sc,
                                        first_sc, n, SPLIT=L, BLOCK=1024, HAS_W=sc is not None)
        pend = torch.cumsum(nch, 0, dtype=idx_dt)
        cap = triton.cdiv(2 * n, L)  # a long run (len > L) has ceil(len / L) < 2 len / L chunks
        chunk_run = torch.searchsorted(pend, torch.arange(cap, dtype=idx_dt, device=dev), right=True,
                                       out_int32=self._idx32)
        return dict(sorted_key=sorted_key, sorted_b=sorted_b, run_start=run_start, run_key=run_key,
                    first_b=first_b, pend=pend, n_runs=n_runs, chunk_run=chunk_run, cap=cap, sorted_sc=sorted_sc,
                    first_sc=first_sc, weighted=sc is not None)

    def _common(self, grad: torch.Tensor, n_part: int, n: int) -> dict:
        """Constexprs and launch options shared by the backward kernels."""
        idx32 = self._idx32 and max(grad.numel(), n_part, n + 1) < 2**31
        return dict(IDX=tl.int32 if idx32 else tl.int64, ROW_BITS=self._row_bits, VEC=self._vec, EVICT=self.evict,
                    BLOCK_R=self.block_rows, BLOCK_D=self._block_d, num_warps=self.num_warps,
                    enable_fp_fusion=False)  # no FMA: the reference's roundings

    def _update_args(self) -> tuple:
        """Table geometry and the buffers every row update reads and writes."""
        return (self._dims_t, self._col_off, self._w_off, self._s_off, self._flat_w,
                self._flat_s if self._flat_s.numel() else self._no_state)

    def _optim_args(self) -> tuple[dict, tuple]:
        """(constexpr flags, (lr, eps)) of the optimizer."""
        return (dict(ADAGRAD=self.optim.kind == "rowwise_adagrad", BF16=self._flat_w.dtype == torch.bfloat16),
                (float(self.optim.lr), float(self.optim.eps)))

    def _singles(self, ids: torch.Tensor, offsets: torch.Tensor, B: int, grad: torch.Tensor,
                 sc: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Update every row hit by one id of the batch straight from its (scored) gradient row; return the keys,
        bag rows and scores of the other ids (rows hit more than once), in batch order, for the sorted path.

        Costs one host sync (the number of ids left), queued behind the singles kernel so the GPU
        stays busy while the host waits."""
        n = ids.numel()
        count = torch.zeros(self._flat_s_rows, dtype=torch.int32, device=ids.device)
        key, b_of = self._keys(ids, offsets, B, count)
        multi = torch.empty(n, dtype=torch.int8, device=ids.device)
        flags, (lr, eps) = self._optim_args()
        _BWD_SINGLES[(triton.cdiv(n, self.block_rows),)](
            key, b_of, self._no_state if sc is None else sc, count, multi, grad, grad.stride(0), *self._update_args(),
            n, lr, eps, **flags, **self._common(grad, 0, n), HAS_W=sc is not None)
        rest = torch.nonzero(multi).view(-1)
        return key[rest], b_of[rest], None if sc is None else sc[rest]

    @torch.no_grad()
    def backward_update(self, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
                        per_sample_weights: torch.Tensor | None = None) -> None:
        sc = check_weights(self.name, ids, per_sample_weights)
        B = self._batch(offsets)
        if B == 0 or ids.numel() == 0:
            return
        grad = grad.contiguous()
        ids, offsets = ids.contiguous(), offsets.contiguous()
        sc = sc.contiguous() if sc is not None else None
        if self.singles:
            key, b_of, sc = self._singles(ids, offsets, B, grad, sc)
            if key.numel() == 0:
                return
        else:
            key, b_of = self._keys(ids, offsets, B)
        p = self._runs(key, b_of, sc)
        n, BD, BR, L, cap = key.numel(), self._block_d, self.block_rows, self.split_len, p["cap"]
        part = torch.empty(cap, BD, dtype=torch.float32, device=self.device)
        common = dict(self._common(grad, part.numel(), n), SPLIT=L, HAS_W=p["weighted"])
        # a wave of programs is plenty: long runs are few (hot rows)
        _BWD_PARTIAL[(min(triton.cdiv(cap, BR), 2048),)](
            p["sorted_b"], p["sorted_sc"], grad, grad.stride(0), p["run_key"], p["run_start"], p["pend"],
            p["chunk_run"], self._dims_t, self._col_off, part, n, cap, **common)
        tiles = triton.cdiv(n, BR)
        flags, (lr, eps) = self._optim_args()
        _BWD_UPDATE[(min(tiles, self.max_programs) if self.max_programs else tiles,)](
            p["sorted_b"], p["sorted_sc"], grad, grad.stride(0), p["run_key"], p["first_b"], p["first_sc"],
            p["run_start"], p["pend"], part, *self._update_args(), p["n_runs"], lr, eps, **flags, **common)
