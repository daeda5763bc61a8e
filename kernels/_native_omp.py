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
import functools

import numpy as np

from cubic_kernels import _native_kernels as nk

# -- the driver ----------------------------------------------------------------------------------------


@functools.cache
def gomp() -> ctypes._CFuncPtr | None:
    """torch's GOMP_parallel, or None (torch built without GNU OpenMP: use the thread pool)."""
    import torch  # noqa: F401 - loads the libgomp whose team we want to share

    try:
        fn = ctypes.CDLL(None).GOMP_parallel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    fn.restype = None
    return fn


def _block(size: int, n_items: int, arrays: tuple, scalars: tuple = (), wkind: int = 0) -> np.ndarray:
    """The argument block [counter, n_items, wkind, (address, length) of each array, scalars] of
    `size` slots (the length its trampoline reads)."""
    a = np.zeros(size, np.int64)
    a[1], a[2] = n_items, wkind
    for k, arr in enumerate(arrays):
        assert arr.flags.c_contiguous, "argument arrays must be contiguous"
        a[3 + 2 * k], a[4 + 2 * k] = arr.ctypes.data, arr.size
    a[3 + 2 * len(arrays): 3 + 2 * len(arrays) + len(scalars)] = scalars
    return a


def _run(task, nthreads: int, size: int, n_items: int, arrays: tuple, scalars: tuple = (), wkind: int = 0) -> None:
    """Run `task` on `nthreads` threads of the OpenMP team (the caller is thread 0). The arrays
    whose addresses are in the block stay alive: the caller holds them for the whole call."""
    a = _block(size, n_items, arrays, scalars, wkind)
    gomp()(task.address, a.ctypes.data, nthreads, 0)


# an argument block's "no per-sample weights": empty arrays (the trampolines pass None to the kernels for them)
_NO_F32, _NO_I64 = np.empty(0, np.float32), np.empty(0, np.int64)


def forward(ids, offs, psw, w, w_off, rows, dims, d_off, B, items, out, err, nthreads: int) -> None:
    _run(nk._forward_task, nthreads, 28, items.shape[0],
         (ids, offs, w, w_off, rows, dims, d_off, items, out, err, _NO_F32 if psw is None else psw), (B,),
         nk._WKIND[w.dtype])


def sort_pairs(ids, offs, rows, B, T, keys, tmp, err, by_pos: bool, nthreads: int) -> None:
    _run(nk._sort_task, nthreads, 21, T, (ids, offs, rows, keys, tmp, err), (B, int(by_pos)))


def update(keys, grad, bag_of, psw, B, w, state, w_off, s_off, dims, d_off, chunks, lr, eps, adagrad,
           nthreads: int) -> None:
    f = np.array([lr, eps], np.float64)
    _run(nk._update_task, nthreads, 34, chunks.shape[0],
         (keys, grad, w, state, w_off, s_off, dims, d_off, chunks, _NO_I64 if bag_of is None else bag_of,
          _NO_F32 if psw is None else psw), (B, int(adagrad), f.ctypes.data), nk._WKIND[w.dtype])
