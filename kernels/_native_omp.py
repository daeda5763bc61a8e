"""Run the `native` kernels on torch's own OpenMP thread team.

Why: a torch op (FBGEMM's backward, a dense GEMM, ...) leaves libgomp's workers spinning for
milliseconds after its parallel region. Kernels run from Python threads then share the cores
with those spinners and lose the second thread entirely (measured: the 2-thread step went from
5.6 ms alone to 8-9 ms when interleaved with FBGEMM). Entering a parallel region of the *same*
libgomp instead hands the work to the spinning workers at once, as torch's own ops do.

How: `GOMP_parallel(fn, data, nthreads, 0)` (the entry point GCC emits for `#pragma omp
parallel`) is looked up in the process (torch loads libgomp globally) and called through ctypes,
which releases the GIL. `fn` is a numba `cfunc` trampoline per kernel; `data` points to an int64
argument block: slot 0 is a shared work counter that every thread atomically increments to claim
the next work item (dynamic scheduling, so a slow thread never holds up the others), slot 1 the
number of items, then (address, length) of every array and the scalars. Numba's own OpenMP layer
cannot do this: it links a second libgomp (`libgomp.so.1.0.0`) whose team competes with torch's.
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import _native_kernels as nk

# -- intrinsics: an atomic counter and raw addresses -------------------------------------------------


@intrinsic
def _fetch_add(typingctx, arr, idx):
    """Atomically `arr[idx] += 1` on an int64 array; returns the old value."""
    if not isinstance(arr, types.Array) or arr.dtype != types.int64:
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [i])
        return builder.atomic_rmw("add", ptr, ir.IntType(64)(1), "monotonic")

    return types.int64(arr, idx), codegen


@intrinsic
def _voidptr(typingctx, addr):
    """int64 address -> void* (for `carray`)."""
    if addr != types.int64:
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


@nk._jit(inline="always")
def _i64(a, k):
    return carray(_voidptr(a[k]), (a[k + 1],), np.int64)


# -- argument block layout ---------------------------------------------------------------------------
# Every block starts [counter, n_items, wkind]; wkind: 0 fp32, 1 fp16 bits, 2 bf16 bits.
_F32, _F16, _BF16 = 0, 1, 2
_WKIND = {np.dtype(np.float32): _F32, np.dtype(np.int16): _F16, np.dtype(np.uint16): _BF16}

_SIG = types.void(types.voidptr)


@cfunc(_SIG, cache=True, nopython=True)
def _forward_task(data):
    # [ctr, n, wkind, ids, offsets, w, w_off, rows, dims, d_off, items, out, err] as (addr, len), B
    a = carray(data, (26,), np.int64)
    ids, offs = _i64(a, 3), _i64(a, 5)
    w_off, rows, dims, d_off = _i64(a, 9), _i64(a, 11), _i64(a, 13), _i64(a, 15)
    items = carray(_voidptr(a[17]), (a[18] // 3, 3), np.int64)
    out = carray(_voidptr(a[19]), (a[20],), np.float32)
    err = carray(_voidptr(a[21]), (a[22],), np.uint8)
    B = a[23]
    wk = a[2]
    while True:
        k = _fetch_add(a, 0)
        if k >= a[1]:
            break
        if wk == _F32:
            nk.forward(ids, offs, carray(_voidptr(a[7]), (a[8],), np.float32), w_off, rows, dims, d_off, B,
                       items, k, k + 1, out, err)
        elif wk == _F16:
            nk.forward(ids, offs, carray(_voidptr(a[7]), (a[8],), np.int16), w_off, rows, dims, d_off, B,
                       items, k, k + 1, out, err)
        else:
            nk.forward(ids, offs, carray(_voidptr(a[7]), (a[8],), np.uint16), w_off, rows, dims, d_off, B,
                       items, k, k + 1, out, err)


@cfunc(_SIG, cache=True, nopython=True)
def _sort_task(data):
    # [ctr, n_tables, -, ids, offsets, rows, keys, tmp, err] as (addr, len), B
    a = carray(data, (20,), np.int64)
    ids, offs, rows, keys, tmp = _i64(a, 3), _i64(a, 5), _i64(a, 7), _i64(a, 9), _i64(a, 11)
    err = carray(_voidptr(a[13]), (a[14],), np.uint8)
    B = a[15]
    while True:
        t = _fetch_add(a, 0)
        if t >= a[1]:
            break
        nk.sort_pairs(ids, offs, rows, B, t, t + 1, keys, tmp, err)


@cfunc(_SIG, cache=True, nopython=True)
def _update_task(data):
    # [ctr, n, wkind, keys, grad, w, state, w_off, s_off, dims, d_off, chunks] as (addr, len),
    # B, adagrad, address of float64 [lr, eps]
    a = carray(data, (30,), np.int64)
    keys = _i64(a, 3)
    grad = carray(_voidptr(a[5]), (a[6],), np.float32)
    state = carray(_voidptr(a[9]), (a[10],), np.float32)
    w_off, s_off, dims, d_off = _i64(a, 11), _i64(a, 13), _i64(a, 15), _i64(a, 17)
    chunks = carray(_voidptr(a[19]), (a[20] // 3, 3), np.int64)
    B, adagrad = a[21], a[22] != 0
    f = carray(_voidptr(a[23]), (2,), np.float64)
    lr, eps = f[0], f[1]
    wk = a[2]
    while True:
        k = _fetch_add(a, 0)
        if k >= a[1]:
            break
        if wk == _F32:
            nk.update(keys, grad, B, carray(_voidptr(a[7]), (a[8],), np.float32), state, w_off, s_off, dims,
                      d_off, chunks, k, k + 1, lr, eps, adagrad)
        elif wk == _F16:
            nk.update(keys, grad, B, carray(_voidptr(a[7]), (a[8],), np.int16), state, w_off, s_off, dims,
                      d_off, chunks, k, k + 1, lr, eps, adagrad)
        else:
            nk.update(keys, grad, B, carray(_voidptr(a[7]), (a[8],), np.uint16), state, w_off, s_off, dims,
                      d_off, chunks, k, k + 1, lr, eps, adagrad)


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
    a = _block(items.shape[0], 26, _WKIND[w.dtype])
    for k, arr in zip(range(3, 23, 2), (ids, offs, w, w_off, rows, dims, d_off, items, out, err), strict=True):
        _put(a, k, arr)
    a[23] = B
    _run(_forward_task, a, nthreads, (ids, offs, w, items, out, err))


def sort_pairs(ids, offs, rows, B, T, keys, tmp, err, nthreads: int) -> None:
    a = _block(T, 20)
    for k, arr in zip(range(3, 15, 2), (ids, offs, rows, keys, tmp, err), strict=True):
        _put(a, k, arr)
    a[15] = B
    _run(_sort_task, a, nthreads, (ids, offs, keys, tmp, err))


def update(keys, grad, B, w, state, w_off, s_off, dims, d_off, chunks, lr, eps, adagrad, nthreads: int) -> None:
    a = _block(chunks.shape[0], 30, _WKIND[w.dtype])
    for k, arr in zip(range(3, 21, 2), (keys, grad, w, state, w_off, s_off, dims, d_off, chunks), strict=True):
        _put(a, k, arr)
    a[21], a[22] = B, int(adagrad)
    f = np.array([lr, eps], np.float64)
    a[23] = f.ctypes.data
    _run(_update_task, a, nthreads, (keys, grad, w, state, chunks, f))
