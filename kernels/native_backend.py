"""`native` backend: our own CPU embedding-bag kernels (numba), TBE layout and math.

Why it exists: the embedding step is memory-bound row gathers/scatters, and FBGEMM's CPU TBE
(most of its time in the backward) neither scales with threads here nor uses huge pages. Here:

* forward: one parallel pass over balanced (table, bag range) items, rows prefetched ahead;
* backward fused with the optimizer: per table the (row, bag) pairs are radix-sorted, each run
  of equal rows sums its gradient once and updates the row-wise AdaGrad state and the row in
  place (or SGD); no gradient tensor is materialised. With per-sample weights the pairs hold the
  id's position instead of its bag, which maps to its bag and its weight.

Threads follow `torch.get_num_threads()` (the harness sets it per rank); with more than one the
kernels run on torch's own OpenMP team (`cubic_kernels._native_omp`), falling back to a Python thread
pool where torch has no GNU OpenMP. CPU tensors only.
Weights fp32 / fp16 / bf16 (reduced precision stored round-to-nearest-even, math in fp32).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from cubic_kernels import _native_kernels as nk
from cubic_kernels import _native_omp as omp
from cubic_kernels.base import DTYPES, EmbeddingBagKernel, OptimSpec, check_weights

_ITEMS_PER_THREAD = 4  # work items per thread: balance (pooling differs by table) at low overhead

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0  # a forked child inherits the pool object but not its threads: rebuild it there
_pool_lock = threading.Lock()


def _team(nthreads: int) -> bool:
    """Run on torch's OpenMP team (see `cubic_kernels._native_omp`) rather than Python threads?
    CUBIC_NATIVE_THREADS=pool forces the thread pool (for comparison)."""
    return nthreads > 1 and os.environ.get("CUBIC_NATIVE_THREADS", "omp") != "pool" and omp.gomp() is not None


def _parallel(fn: Callable[[int, int], None], n_work: int, nthreads: int) -> None:
    """Run fn(k0, k1) over [0, n_work) split into `nthreads` contiguous slices: the caller takes
    the first, a persistent pool the rest. The kernels release the GIL, so slices truly overlap."""
    global _pool, _pool_pid
    n = max(1, min(nthreads, n_work))
    if n == 1:
        fn(0, n_work)
        return
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < n - 1:
            _pool = ThreadPoolExecutor(n - 1, thread_name_prefix="cubic-native")
            _pool_pid = os.getpid()
        pool = _pool
    bounds = [n_work * i // n for i in range(n + 1)]
    futs = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, n)]
    fn(bounds[0], bounds[1])
    for f in futs:
        f.result()


_HUGE = 2 << 20


def _zeros_hugepages(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed flat tensor on 2 MiB-aligned memory advised as transparent huge pages: every row
    lookup into hundreds of MB is otherwise a TLB miss (measured ~10% of the forward here)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    nbytes = n * elem
    buf = np.zeros(nbytes + _HUGE, np.uint8)  # calloc: pages untouched until first write
    off = (-buf.ctypes.data) % _HUGE
    if sys.platform.startswith("linux") and nbytes >= _HUGE:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(buf.ctypes.data + off), ctypes.c_size_t(nbytes - nbytes % _HUGE),
                         ctypes.c_int(14))  # MADV_HUGEPAGE; a refusal only costs speed
        except (OSError, AttributeError):
            pass
    return torch.from_numpy(buf[off: off + nbytes]).view(dtype)


def _np_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view; 16-bit floats as raw bits (int16 = fp16, uint16 = bf16)."""
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _check_cpu(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"native kernel: {name} is on {t.device}; the native backend runs on CPU only "
                         "(use kernel=fbgemm, torch or triton on GPUs)")


class NativeEmbeddingBags(EmbeddingBagKernel):
    name = "native"

    def __init__(self, rows, dims, **kw) -> None:
        super().__init__(rows, dims, **kw)
        if self.device.type != "cpu":
            raise ValueError(f"native kernel: device {self.device} unsupported; it runs on CPU only "
                             "(use kernel=fbgemm, torch or triton on GPUs)")
        if max(self.rows) >= 2**31:
            raise ValueError("native kernel: tables of 2^31 rows or more unsupported (row ids are packed "
                             "into 32 bits for the backward's sort); shard the table")
        dt = DTYPES[self.weight_dtype]
        w_off = np.zeros(self.num_tables + 1, np.int64)
        np.cumsum([r * d for r, d in zip(self.rows, self.dims, strict=True)], out=w_off[1:])
        self._flat_w = _zeros_hugepages(int(w_off[-1]), dt)
        self._adagrad = self.optim.kind == "rowwise_adagrad"
        s_off = np.zeros(self.num_tables + 1, np.int64)
        if self._adagrad:
            np.cumsum(self.rows, out=s_off[1:])
        self._flat_s = _zeros_hugepages(int(s_off[-1]), torch.float32)
        self._w = [self._flat_w[w_off[t]: w_off[t + 1]].view(r, d)
                   for t, (r, d) in enumerate(zip(self.rows, self.dims, strict=True))]
        self._s = [self._flat_s[s_off[t]: s_off[t + 1]] for t in range(self.num_tables)]
        self._w_np = _np_view(self._flat_w)
        self._s_np = self._flat_s.numpy()
        self._w_off = w_off[:-1].copy()
        self._s_off = s_off[:-1].copy()
        self._rows = np.asarray(self.rows, np.int64)
        self._dims = np.asarray(self.dims, np.int64)
        self._d_off = np.asarray(self.dim_offsets[:-1], np.int64)
        self._keys = np.empty(0, np.int64)  # sort buffers, grown on demand and reused
        self._tmp = np.empty(0, np.int64)

    def weights(self) -> list[torch.Tensor]:
        return self._w

    def states(self) -> list[torch.Tensor]:
        return self._s

    # -- helpers -------------------------------------------------------------------------------------
    def _inputs(self, ids: torch.Tensor, offsets: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int]:
        _check_cpu("ids", ids)
        _check_cpu("offsets", offsets)
        T = self.num_tables
        if ids.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1 or (offsets.numel() - 1) % T:
            raise ValueError(f"native kernel: need 1-D ids and T*B+1 offsets (T={T}); got ids "
                             f"{tuple(ids.shape)}, offsets {tuple(offsets.shape)}")
        ids_np = ids.detach().to(torch.int64).contiguous().numpy()
        off_np = offsets.detach().to(torch.int64).contiguous().numpy()
        if not nk.check_offsets(off_np, ids_np.shape[0]):
            raise ValueError(f"native kernel: offsets must be non-decreasing within [0, {ids_np.shape[0]}] "
                             "(the number of ids)")
        return ids_np, off_np, (offsets.numel() - 1) // T

    def _weights(self, ids: torch.Tensor, per_sample_weights: torch.Tensor | None) -> np.ndarray | None:
        psw = check_weights(self.name, ids, per_sample_weights)
        if psw is None:
            return None
        _check_cpu("per_sample_weights", psw)
        return psw.contiguous().numpy()

    def _raise_bad_ids(self, err: np.ndarray) -> None:
        bad = [t for t in range(self.num_tables) if err[t]]
        if bad:
            raise ValueError(f"native kernel: ids out of range [0, rows) in tables {bad} "
                             f"(rows {[self.rows[t] for t in bad]})")

    # -- the two hot operations ---------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        ids_np, off_np, B = self._inputs(ids, offsets)
        psw = self._weights(ids, per_sample_weights)
        out = torch.empty(B, self.total_dim, dtype=torch.float32)
        if B == 0:
            return out
        nthreads = max(1, torch.get_num_threads())
        target = max(1, ids_np.shape[0] // (nthreads * _ITEMS_PER_THREAD))
        items = nk.plan_forward(off_np, self.num_tables, B, target)
        err = np.zeros(self.num_tables, np.uint8)
        out_np = out.numpy().reshape(-1)
        w, w_off, rows, dims, d_off = self._w_np, self._w_off, self._rows, self._dims, self._d_off
        if _team(nthreads):
            omp.forward(ids_np, off_np, psw, w, w_off, rows, dims, d_off, B, items, out_np, err, nthreads)
        else:
            _parallel(lambda k0, k1: nk.forward(ids_np, off_np, psw, w, w_off, rows, dims, d_off, B, items, k0, k1,
                                                out_np, err), items.shape[0], nthreads)
        self._raise_bad_ids(err)
        return out

    @torch.no_grad()
    def backward_update(self, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
                        per_sample_weights: torch.Tensor | None = None) -> None:
        ids_np, off_np, B = self._inputs(ids, offsets)
        psw = self._weights(ids, per_sample_weights)
        _check_cpu("grad", grad)
        if tuple(grad.shape) != (B, self.total_dim):
            raise ValueError(f"native kernel: grad shape {tuple(grad.shape)}, expected {(B, self.total_dim)}")
        n = ids_np.shape[0]
        if B == 0 or n == 0:
            return
        T = self.num_tables
        nthreads = max(1, torch.get_num_threads())
        by_pos = psw is not None
        if by_pos and n >= 2**32:
            raise ValueError(f"native kernel: {n} ids with per-sample weights; under 2^32 per call (positions are "
                             "packed into 32 bits for the backward's sort)")
        bag_of = None
        if by_pos:  # each id position's bag row
            bag_of = np.zeros(n, np.int64)
            bag_of[off_np[0]: off_np[-1]] = np.repeat(np.arange(off_np.shape[0] - 1, dtype=np.int64) % B,
                                                       np.diff(off_np))
        if self._keys.shape[0] < n:
            self._keys = np.empty(n, np.int64)
            self._tmp = np.empty(n, np.int64)
        keys, tmp = self._keys[:n], self._tmp[:n]
        err = np.zeros(T, np.uint8)
        rows = self._rows
        team = _team(nthreads)
        if team:  # one table per work item, claimed dynamically
            omp.sort_pairs(ids_np, off_np, rows, B, T, keys, tmp, err, by_pos, nthreads)
        else:  # tables split into contiguous groups of about equal id counts
            per_table = np.diff(off_np[::B])
            cum = np.concatenate([[0], np.cumsum(per_table)])
            nt = min(nthreads, T)
            cuts = [0] + [int(np.searchsorted(cum, n * i / nt)) for i in range(1, nt)] + [T]
            _parallel(lambda g0, g1: nk.sort_pairs(ids_np, off_np, rows, B, cuts[g0], cuts[g1], keys, tmp,
                                                   err, by_pos), nt, nt)
        self._raise_bad_ids(err)
        chunks = nk.plan_backward(keys, off_np, T, B, max(1, n // (nthreads * _ITEMS_PER_THREAD)))
        g_np = grad.detach().to(torch.float32).contiguous().numpy().reshape(-1)
        w, s, w_off, s_off = self._w_np, self._s_np, self._w_off, self._s_off
        dims, d_off = self._dims, self._d_off
        lr, eps, adagrad = float(self.optim.lr), float(self.optim.eps), self._adagrad
        if team:
            omp.update(keys, g_np, bag_of, psw, B, w, s, w_off, s_off, dims, d_off, chunks, lr, eps, adagrad, nthreads)
        else:
            _parallel(lambda k0, k1: nk.update(keys, g_np, bag_of, psw, B, w, s, w_off, s_off, dims, d_off, chunks,
                                               k0, k1, lr, eps, adagrad), chunks.shape[0], nthreads)


def warm_cache() -> None:
    """Compile every kernel specialisation (weight dtypes x optimizers x 1 and 2 threads) into
    numba's on-disk cache, so no trial pays the ~8 s first compile (`make` runs this at install)."""
    old = torch.get_num_threads()
    ids, offsets = torch.tensor([0, 1, 1, 3]), torch.tensor([0, 1, 3, 4, 4])
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for dtype in DTYPES:
                for kind in ("rowwise_adagrad", "sgd"):
                    k = NativeEmbeddingBags([4, 5], [4, 8], weight_dtype=dtype, optim=OptimSpec(kind, lr=0.1))
                    for psw in (None, torch.ones(ids.numel())):
                        k.forward(ids, offsets, psw)
                        k.backward_update(ids, offsets, torch.ones(2, 12), psw)
    finally:
        torch.set_num_threads(old)


if __name__ == "__main__":
    warm_cache()
