"""Run the `native` kernels on torch's own OpenMP thread team.

Why: a torch op (FBGEMM's backward, a dense GEMM, ...) leaves libgomp's workers spinning for
milliseconds after its parallel region. Kernels run from Python threads then share the cores
with those spinners and lose the second thread entirely (measured: the 2-thread step went from
5.6 ms alone to 8-9 ms when interleaved with FBGEMM). Entering a parallel region of the *same*
libgomp instead hands the work to the spinning workers at once, as torch's own ops do.

How: `GOMP_parallel(fn, data, nthreads, 0)` (the entry point GCC emits for `#pragma omp
parallel`) is looked up in the process (torch loads libgomp globally) and called through ctypes,
which releases the GIL. `fn` is a numba `cfunc` trampoline per kernel (in `_native_kernels`); `data` points to an int64
argument block: slot 0 is a shared work counter that every thread atomically increments to claim
the next work item (dynamic scheduling, so a slow thread never holds up the others), slot 1 the
number of items, then (address, length) of every array and the scalars. Numba's own OpenMP layer
cannot do this: it links a second libgomp (`libgomp.so.1.0.0`) whose team competes with torch's.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernels import _native_kernels as nk

# -- the driver ----------------------------------------------------------------------------------------


def _find_gomp() -> ctypes._CFuncPtr | None:
    """torch's GOMP_parallel, or None (torch built without GNU OpenMP: use the thread pool)."""
    try:
        fn = ctypes.CDLL(None).GOMP_parallel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    fn.restype = None
    return fn


_GOMP = None
_GOMP_LOOKED = False


def gomp() -> ctypes._CFuncPtr | None:
    global _GOMP, _GOMP_LOOKED
    if not _GOMP_LOOKED:
        import torch  # noqa: F401 - loads the libgomp whose team we want to share

        _GOMP, _GOMP_LOOKED = _find_gomp(), True
    return _GOMP


def _block(n: int, size: int, wkind: int = 0) -> np.ndarray:
    a = np.zeros(size, np.int64)
    a[1], a[2] = n, wkind
    return a


def _put(a: np.ndarray, k: int, arr: np.ndarray) -> None:
    assert arr.flags.c_contiguous, "argument arrays must be contiguous"
    a[k], a[k + 1] = arr.ctypes.data, arr.size


def _run(task, a: np.ndarray, nthreads: int, keep: tuple) -> None:
    """Run `task` on `nthreads` threads of the OpenMP team (the caller is thread 0). `keep` holds
    the arrays whose addresses are in `a` alive until the region ends."""
    gomp()(task.address, a.ctypes.data, nthreads, 0)
    del keep


def forward(ids, offs, w, w_off, rows, dims, d_off, B, items, out, err, nthreads: int) -> None:
    a = _block(items.shape[0], 26, nk._WKIND[w.dtype])
    for k, arr in zip(range(3, 23, 2), (ids, offs, w, w_off, rows, dims, d_off, items, out, err), strict=True):
        _put(a, k, arr)
    a[23] = B
    _run(nk._forward_task, a, nthreads, (ids, offs, w, items, out, err))


def sort_pairs(ids, offs, rows, B, T, keys, tmp, err, nthreads: int) -> None:
    a = _block(T, 20)
    for k, arr in zip(range(3, 15, 2), (ids, offs, rows, keys, tmp, err), strict=True):
        _put(a, k, arr)
    a[15] = B
    _run(nk._sort_task, a, nthreads, (ids, offs, keys, tmp, err))


def update(keys, grad, B, w, state, w_off, s_off, dims, d_off, chunks, lr, eps, adagrad, nthreads: int) -> None:
    a = _block(chunks.shape[0], 30, nk._WKIND[w.dtype])
    for k, arr in zip(range(3, 21, 2), (keys, grad, w, state, w_off, s_off, dims, d_off, chunks), strict=True):
        _put(a, k, arr)
    a[21], a[22] = B, int(adagrad)
    f = np.array([lr, eps], np.float64)
    a[23] = f.ctypes.data
    _run(nk._update_task, a, nthreads, (keys, grad, w, state, chunks, f))
