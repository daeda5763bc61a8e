"""`triton` backend: our own Triton TBE-style kernels (GPU; CPU through Triton's interpreter).

Layout. All tables live in ONE flat weight buffer (one dtype for all tables) with a per-table element
offset, and the row-wise AdaGrad state in one flat fp32 buffer; `weights()`/`states()` are live
per-table views into them. One flat buffer is what lets a single launch serve every table.

Forward: one launch, grid `(B, T)`; program `(b, t)` gathers `BLOCK_N` ids x `BLOCK_D` columns at a
time (masked: tables may have different dims, `BLOCK_D` = next power of two >= max dim) and sums in
fp32.

Backward fused with the optimizer (exact: one update per unique row, as FBGEMM's EXACT_* modes):
device-side preparation sorts the `(table, row)` keys and cuts them into runs of equal rows; each
program reduces and updates a tile of `block_rows` runs (4 by default: measured fastest on an H100)
of at most `split_len` ids. Longer runs (hot rows of a Zipf distribution) are cut into `split_len`
chunks whose partial sums are computed in parallel by a first kernel, so a hot row does not
serialise the batch on one program; the update kernel then adds the run's partials. Both branches
are expressed as (possibly empty) loop ranges, so the update kernel has no data-dependent `if`.
Measured numbers: benchmarks/data/gpu_h100/NOTES.md.

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

from kernels.base import DTYPES, EmbeddingBagKernel, bag_ids  # noqa: E402

#: True when Triton's stdlib (and so our kernels) run under the interpreter in this process.
INTERPRETED: bool = isinstance(tl.sum, InterpretedFunction)


def _fwd_kernel(ids_ptr, offsets_ptr, w_ptr, out_ptr, w_off_ptr, dims_ptr, col_off_ptr, B, out_stride,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    bag = t.to(tl.int64) * B + b
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    D = tl.load(dims_ptr + t).to(tl.int64)
    w_base = tl.load(w_off_ptr + t)
    c0 = tl.load(col_off_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(start, end, BLOCK_N):
        pos = i + tl.arange(0, BLOCK_N)
        m = pos < end
        rows = tl.load(ids_ptr + pos, mask=m, other=0).to(tl.int64)
        ptrs = w_ptr + w_base + rows[:, None] * D + cols[None, :]
        vals = tl.load(ptrs, mask=m[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(vals, axis=0)
    tl.store(out_ptr + b * out_stride + c0 + cols, acc, mask=cmask)


def _bwd_partial_kernel(sorted_b_ptr, grad_ptr, grad_stride, chunk_start_ptr, chunk_end_ptr,
                        chunk_table_ptr, dims_ptr, col_off_ptr, part_ptr, n_chunks,
                        IDX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Partial gradient sums of `BLOCK_R` chunks of long runs -> `part[c, :BLOCK_D]` (fp32)."""
    c = tl.program_id(0).to(IDX) * BLOCK_R + tl.arange(0, BLOCK_R)
    cm = c < n_chunks
    s = tl.load(chunk_start_ptr + c, mask=cm, other=0)
    e = tl.load(chunk_end_ptr + c, mask=cm, other=0)
    t = tl.load(chunk_table_ptr + c, mask=cm, other=0)
    D = tl.load(dims_ptr + t, mask=cm, other=0).to(IDX)
    c0 = tl.load(col_off_ptr + t, mask=cm, other=0).to(IDX)
    cols = tl.arange(0, BLOCK_D)
    m2 = cm[:, None] & (cols[None, :] < D[:, None])
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for j in range(0, tl.max(e - s, axis=0)):
        pos = s + j
        m = pos < e
        bb = tl.load(sorted_b_ptr + pos, mask=m, other=0).to(IDX)
        acc += tl.load(grad_ptr + bb[:, None] * grad_stride + c0[:, None] + cols[None, :],
                       mask=m[:, None] & m2, other=0.0).to(tl.float32)
    tl.store(part_ptr + c[:, None] * BLOCK_D + cols[None, :], acc, mask=cm[:, None])


def _bwd_update_kernel(sorted_b_ptr, grad_ptr, grad_stride, run_row_ptr, run_table_ptr,
                       dstart_ptr, dend_ptr, pstart_ptr, pend_ptr, part_ptr,
                       dims_ptr, col_off_ptr, w_off_ptr, s_off_ptr, w_ptr, s_ptr, n_runs, lr, eps,
                       ADAGRAD: tl.constexpr, BF16: tl.constexpr, IDX: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """`BLOCK_R` unique rows per program: reduce each one's gradient (ids, or chunk partials), update.

    Index arithmetic runs in `IDX` (int32 when every buffer has fewer than 2**31 elements, which
    halves the registers the tile's offsets take; int64 otherwise).

    Rows of a tile are independent; each walks its own ids, the loop runs to the tile's longest
    (masked beyond each row's end). Long runs come as chunk partials, so that loop stays short.
    """
    u = tl.program_id(0).to(IDX) * BLOCK_R + tl.arange(0, BLOCK_R)
    um = u < n_runs
    row = tl.load(run_row_ptr + u, mask=um, other=0).to(IDX)
    t = tl.load(run_table_ptr + u, mask=um, other=0)
    D = tl.load(dims_ptr + t, mask=um, other=1).to(IDX)
    c0 = tl.load(col_off_ptr + t, mask=um, other=0).to(IDX)
    ds = tl.load(dstart_ptr + u, mask=um, other=0)
    de = tl.load(dend_ptr + u, mask=um, other=0)
    ps = tl.load(pstart_ptr + u, mask=um, other=0)
    pe = tl.load(pend_ptr + u, mask=um, other=0)
    cols = tl.arange(0, BLOCK_D)
    m2 = um[:, None] & (cols[None, :] < D[:, None])
    g = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for j in range(0, tl.max(de - ds, axis=0)):  # short runs: their ids (empty for long runs)
        pos = ds + j
        m = pos < de
        bb = tl.load(sorted_b_ptr + pos, mask=m, other=0).to(IDX)
        g += tl.load(grad_ptr + bb[:, None] * grad_stride + c0[:, None] + cols[None, :],
                     mask=m[:, None] & m2, other=0.0).to(tl.float32)
    for j in range(0, tl.max(pe - ps, axis=0)):  # long runs: their chunk partials (empty for short)
        p = ps + j
        m = p < pe
        g += tl.load(part_ptr + p[:, None] * BLOCK_D + cols[None, :], mask=m[:, None] & m2, other=0.0)
    w_base = tl.load(w_off_ptr + t, mask=um, other=0)
    w_ptrs = w_ptr + (w_base + row * D)[:, None] + cols[None, :]
    w = tl.load(w_ptrs, mask=m2, other=0.0).to(tl.float32)
    if ADAGRAD:
        s_p = s_ptr + tl.load(s_off_ptr + t, mask=um, other=0) + row
        st = tl.load(s_p, mask=um, other=0.0) + tl.div_rn(tl.sum(g * g, axis=1), D.to(tl.float32))
        tl.store(s_p, st, mask=um)
        w = w - tl.div_rn(lr * g, tl.sqrt_rn(st)[:, None] + eps)
    else:
        w = w - lr * g
    if BF16:
        # explicit round-to-nearest-even on the bits: the interpreter's fp32->bf16 cast truncates,
        # the GPU's rounds; doing it by hand gives torch's `.to(bfloat16)` on both
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(w_ptrs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m2)
    else:
        tl.store(w_ptrs, w.to(w_ptr.dtype.element_ty), mask=m2)


_FWD = triton.jit(_fwd_kernel)
_BWD_PARTIAL = triton.jit(_bwd_partial_kernel)
_BWD_UPDATE = triton.jit(_bwd_update_kernel)


MAX_BLOCK_ROWS = 16


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class TritonEmbeddingBags(EmbeddingBagKernel):
    """All tables in one flat buffer; one forward launch; sorted, split-run fused backward."""

    name = "triton"

    def __init__(self, rows, dims, *, split_len: int = 32, block_rows: int = 4, num_warps: int = 0,
                 force_idx64: bool = False, **kw) -> None:
        super().__init__(rows, dims, **kw)
        if self.device.type != "cuda" and not INTERPRETED:
            raise RuntimeError("triton backend on a non-CUDA device needs Triton's interpreter: set "
                               "TRITON_INTERPRET=1 before triton is first imported in this process")
        if split_len < 1:
            raise ValueError("split_len must be >= 1")
        self.split_len = int(split_len)
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
        self._s_off = torch.tensor(row_base[:-1], **i64)
        self._row_base = torch.tensor(row_base, **i64)
        self._dims_t = torch.tensor(self.dims, dtype=torch.int32, device=self.device)
        self._col_off = torch.tensor(self.dim_offsets[:-1], dtype=torch.int32, device=self.device)
        self._block_d = _pow2_at_least(max(self.dims))
        self._key32 = row_base[-1] < 2**31
        # int32 index arithmetic in the backward when every offset fits (weights, and the gradient
        # and partial buffers checked per call)
        self._idx32 = w_off[-1] < 2**31 and not force_idx64
        if self._idx32:
            self._w_off32, self._s_off32 = self._w_off.int(), self._s_off.int()
        # Unique rows per backward program, and warps. Measured on an H100 (8 x 1M x 128 fp32, B=16384,
        # uniform ids, int32 indices, one run): 4 rows x 2 warps 2.27 ms, 8x4 2.54, 16x4 2.72, 8x8
        # 3.32 ms per fused backward. The kernel is latency-bound, and a tile walks to its longest
        # run, so small tiles with few registers keep the most rows in flight. Triton 3.6 fails to
        # compile the tile at 32+ rows (TritonGPURemoveLayoutConversions: "mask type matches ptr
        # type"), hence the cap.
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

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        T, B = self.num_tables, self._batch(offsets)
        out = torch.empty(B, self.total_dim, dtype=torch.float32, device=self.device)
        if B == 0:
            return out
        # ids per bag on average picks the gather width; few distinct values -> few compilations
        mean_len = -(-ids.numel() // (T * B))
        block_n = min(32, max(4, _pow2_at_least(mean_len)))
        _FWD[(B, T)](
            ids.contiguous(), offsets.contiguous(), self._flat_w, out, self._w_off, self._dims_t,
            self._col_off, B, out.stride(0), BLOCK_N=block_n, BLOCK_D=self._block_d,
            enable_fp_fusion=False)
        return out

    def _plan(self, ids: torch.Tensor, offsets: torch.Tensor, B: int) -> dict[str, torch.Tensor]:
        """Host-side preparation: sort `(table, row)` keys, find runs, split long runs into chunks.

        Two host syncs (the number of runs and of chunks size the grids); everything else stays on
        the device. A sync-free variant (arrays sized by upper bounds, counts read on the device,
        runs found by scatter_reduce) measured slower on an H100: 3.15 vs 2.91 ms per backward, its
        extra programs and passes cost more than the idle time the syncs leave. Keys are int32 when
        all tables' rows fit (half the sort's traffic); the sort is stable, so a run's ids keep bag
        order and the summation order is deterministic.
        """
        n = ids.numel()
        L = self.split_len
        bag = bag_ids(offsets, n)
        t_of = torch.div(bag, B, rounding_mode="floor")
        key = self._row_base[t_of] + ids.long()
        if self._key32:
            key = key.int()
        sorted_key, perm = torch.sort(key, stable=True)
        sorted_b = (bag - t_of * B)[perm].int()  # int32: the update kernels' id reads halve
        new = torch.ones(n, dtype=torch.bool, device=ids.device)
        torch.ne(sorted_key[1:], sorted_key[:-1], out=new[1:])
        run_start = new.nonzero().squeeze(1)  # host sync 1: the number of unique rows
        run_end = torch.empty_like(run_start)
        run_end[:-1] = run_start[1:]
        run_end[-1:] = n
        counts = run_end - run_start
        run_key = sorted_key[run_start].long()
        run_table = torch.searchsorted(self._row_base, run_key, right=True) - 1
        run_row = run_key - self._row_base[run_table]
        long = counts > L
        n_chunks = torch.where(long, (counts + L - 1) // L, torch.zeros_like(counts))
        pend = torch.cumsum(n_chunks, 0)
        pstart = pend - n_chunks
        total = int(pend[-1].item())  # host sync 2: the number of chunks of long runs
        plan = dict(sorted_b=sorted_b, run_row=run_row, run_table=run_table, dstart=run_start,
                    dend=torch.where(long, run_start, run_end), pstart=pstart, pend=pend)
        if total:
            chunk_run = torch.repeat_interleave(torch.arange(run_start.numel(), device=ids.device), n_chunks,
                                                output_size=total)
            k = torch.arange(total, device=ids.device) - pstart[chunk_run]
            cs = run_start[chunk_run] + k * L
            plan.update(chunk_start=cs, chunk_end=torch.minimum(cs + L, run_end[chunk_run]),
                        chunk_table=run_table[chunk_run])
        return plan

    @torch.no_grad()
    def backward_update(self, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> None:
        B = self._batch(offsets)
        if B == 0 or ids.numel() == 0:
            return
        grad = grad.contiguous()
        p = self._plan(ids, offsets, B)
        BD, BR, NW = self._block_d, self.block_rows, self.num_warps
        n_chunks = p["chunk_start"].numel() if "chunk_start" in p else 0
        part = torch.empty(max(n_chunks, 1), BD, dtype=torch.float32, device=self.device)
        w_off, s_off, idx = self._w_off, self._s_off, tl.int64
        if self._idx32 and max(grad.numel(), part.numel(), ids.numel()) < 2**31:  # ids: run positions
            p = {k: v.int() if v.dtype == torch.int64 else v for k, v in p.items()}
            w_off, s_off, idx = self._w_off32, self._s_off32, tl.int32
        if n_chunks:
            _BWD_PARTIAL[(triton.cdiv(n_chunks, BR),)](
                p["sorted_b"], grad, grad.stride(0), p["chunk_start"], p["chunk_end"], p["chunk_table"],
                self._dims_t, self._col_off, part, n_chunks, IDX=idx, BLOCK_R=BR, BLOCK_D=BD, num_warps=NW,
                enable_fp_fusion=False)
        n_runs = p["run_row"].numel()
        _BWD_UPDATE[(triton.cdiv(n_runs, BR),)](
            p["sorted_b"], grad, grad.stride(0), p["run_row"], p["run_table"], p["dstart"], p["dend"],
            p["pstart"], p["pend"], part, self._dims_t, self._col_off, w_off, s_off,
            self._flat_w, self._flat_s if self._flat_s.numel() else part, n_runs, float(self.optim.lr),
            float(self.optim.eps), ADAGRAD=self.optim.kind == "rowwise_adagrad",
            BF16=self._flat_w.dtype == torch.bfloat16, IDX=idx, BLOCK_R=BR, BLOCK_D=BD, num_warps=NW,
            enable_fp_fusion=False)  # no FMA contraction: same roundings as the reference
