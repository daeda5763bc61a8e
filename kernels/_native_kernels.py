"""Numba kernels of the `native` backend (see `cubic_kernels.native_backend`).

Why numba and not a C++ extension: numba is already a dependency, needs no compiler on the
machine, and `cache=True` makes every process after the first load machine code in well under a
second (each trial is a fresh process group, so this matters more than peak speed).

Storage: all tables live in one flat buffer (as FBGEMM's TBE does), table `t` at element offset
`w_off[t]`, row-major `[rows[t], dims[t]]`. Reduced precision is passed as raw 16-bit views:
`int16` = IEEE fp16 bits, `uint16` = bfloat16 bits; the loads widen to fp32 and the stores round
to nearest even, so every kernel is written once for all three storage types.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from cubic_kernels.jit import cached_jit

# -- LLVM intrinsics: prefetch and the 16-bit float conversions ------------------------------------


def _item_ptr(context, builder, sig, args):
    """LLVM pointer to `arr[idx]` for an intrinsic called as (arr, idx)."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    i = context.cast(builder, args[1], sig.args[1], types.intp)
    return cgutils.get_item_pointer(context, builder, sig.args[0], ary, [i])


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Read prefetch (into all cache levels) of the element `arr[idx]` of a 1-D array."""
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        name = "llvm.prefetch.p0" if getattr(ptr.type, "is_opaque", False) else "llvm.prefetch.p0i8"
        if name.endswith("i8"):
            ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


@intrinsic
def _h2f(typingctx, x):
    """fp16 bits (int16) -> fp32 (exact; vcvtph2ps with F16C)."""
    if x != types.int16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def _f2h(typingctx, x):
    """fp32 -> fp16 bits (int16), IEEE round to nearest even (LLVM fptrunc)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(types.float32), codegen


@intrinsic
def _b2f(typingctx, x):
    """bfloat16 bits (uint16) -> fp32 (exact: the high half of the fp32 pattern)."""
    if x != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        u = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.IntType(32)(16))
        return builder.bitcast(u, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f2b(typingctx, x):
    """fp32 -> bfloat16 bits (uint16), round to nearest even; NaN -> 0x7FC0 (as torch)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(u, i32(16)), i32(1))
        r = builder.lshr(builder.add(u, builder.add(lsb, i32(0x7FFF))), i32(16))
        r16 = builder.trunc(r, ir.IntType(16))
        isnan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.select(isnan, ir.IntType(16)(0x7FC0), r16)

    return types.uint16(types.float32), codegen


def _ld(w, i):
    """Element `i` of a storage buffer, widened to fp32 (implemented per dtype below)."""


def _st(w, i, v):
    """Store fp32 `v` into element `i` of a storage buffer, rounding to nearest even."""


@overload(_ld, inline="always")
def _ld_impl(w, i):
    if w.dtype == types.float32:
        return lambda w, i: w[i]
    if w.dtype == types.int16:
        return lambda w, i: _h2f(w[i])
    if w.dtype == types.uint16:
        return lambda w, i: _b2f(w[i])
    return None


@overload(_st, inline="always")
def _st_impl(w, i, v):
    if w.dtype == types.float32:
        def st32(w, i, v):
            w[i] = v
        return st32
    if w.dtype == types.int16:
        def st16(w, i, v):
            w[i] = _f2h(v)
        return st16
    if w.dtype == types.uint16:
        def stbf(w, i, v):
            w[i] = _f2b(v)
        return stbf
    return None


_PF_IDS = 48  # forward: rows prefetched this many ids ahead (tuned: 16 -> 48 was 2.5 -> 1.9 ms)
_PF_PAIRS = 24  # backward: rows (and their state) prefetched this many sorted pairs ahead

# Every kernel below is serial over a range of work items and releases the GIL (nogil=True);
# `cubic_kernels._native_omp` runs them on torch's OpenMP team (`cubic_kernels.native_backend` falls back to
# a few Python threads). (numba's own prange runtime was
# tried first: its OpenMP layer next to torch's OpenMP took milliseconds per launch here, and
# parallel=True triples the compile time of a fresh machine's first trial.)

# -- planning (serial, cheap): bounds checks and balanced work items -------------------------------


@cached_jit()
def check_offsets(offsets, n_ids):
    """True when offsets are non-decreasing within [0, n_ids] (the kernels rely on it to stay in
    bounds: numba does not check indices)."""
    if offsets.shape[0] == 0 or offsets[0] < 0 or offsets[offsets.shape[0] - 1] > n_ids:
        return False
    for i in range(1, offsets.shape[0]):
        if offsets[i] < offsets[i - 1]:
            return False
    return True


@cached_jit()
def plan_forward(offsets, T, B, target):
    """Items [table, first bag, end bag) of about `target` ids each; never spanning tables."""
    items = np.empty((offsets[T * B] // max(target, 1) + 2 * T + 1, 3), np.int64)
    n = 0
    for t in range(T):
        b = 0
        while b < B:
            start = offsets[t * B + b]
            e = b + 1
            while e < B and offsets[t * B + e] - start < target:
                e += 1
            items[n, 0] = t
            items[n, 1] = b
            items[n, 2] = e
            n += 1
            b = e
    return items[:n]


@cached_jit()
def plan_backward(keys, offsets, T, B, target):
    """Chunks [table, first pair, end pair) of about `target` sorted pairs, cut at row-run
    boundaries: every row is updated by exactly one chunk, so chunks run without locks."""
    chunks = np.empty((offsets[T * B] // max(target, 1) + 2 * T + 1, 3), np.int64)
    n = 0
    for t in range(T):
        lo = offsets[t * B]
        hi = offsets[(t + 1) * B]
        s = lo
        while s < hi:
            e = min(s + target, hi)
            while e < hi and (keys[e] >> 32) == (keys[e - 1] >> 32):
                e += 1
            chunks[n, 0] = t
            chunks[n, 1] = s
            chunks[n, 2] = e
            n += 1
            s = e
    return chunks[:n]


# -- forward ---------------------------------------------------------------------------------------


@cached_jit()
def forward(ids, offsets, psw, w, w_off, rows, dims, d_off, B, items, k0, k1, out, err):
    """Pooled sums of items[k0:k1]: out[b, d_off[t]:+dims[t]] = sum of table t's rows in bag (t, b),
    each scaled by its id's weight `psw[j]` when `psw` is not None (per-sample weights; None compiles a
    specialisation without the branch, so unweighted bags cost what they did before weights existed).

    Every cache line of the row `_PF_IDS` ids ahead is prefetched, so the gather is limited by
    memory parallelism rather than latency. Out-of-range ids are skipped and flagged in err[t]."""
    TD = out.shape[0] // B
    step = max(1, 64 // w.itemsize)
    for k in range(k0, k1):
        t = items[k, 0]
        D = dims[t]
        R = rows[t]
        base = w_off[t]
        o0 = d_off[t]
        jend = offsets[t * B + items[k, 2]]
        for b in range(items[k, 1], items[k, 2]):
            orow = out[b * TD + o0: b * TD + o0 + D]  # row slices + range index: vectorised loops
            for c in range(D):
                orow[c] = np.float32(0.0)
            for j in range(offsets[t * B + b], offsets[t * B + b + 1]):
                jp = j + _PF_IDS
                if jp < jend:
                    rp = ids[jp]
                    if rp >= 0 and rp < R:
                        for c in range(0, D, step):
                            _prefetch(w, base + rp * D + c)
                r = ids[j]
                if r < 0 or r >= R:
                    err[t] = 1
                    continue
                wr = w[base + r * D: base + r * D + D]
                if psw is not None:
                    sc = psw[j]
                    for c in range(D):
                        orow[c] += sc * _ld(wr, c)
                else:
                    for c in range(D):
                        orow[c] += _ld(wr, c)


# -- backward + optimizer --------------------------------------------------------------------------


@cached_jit()
def sort_pairs(ids, offsets, rows, B, t0, t1, keys, tmp, err, by_pos):
    """For tables t0..t1-1: the (row << 32 | bag) pairs of their ids, LSD-radix-sorted by row.
    `by_pos`: (row << 32 | the id's position) instead, for per-sample weights, which belong to an id,
    not its bag (positions ascend with bags, so the order within a row is the same).

    Digits are sized from the table's row count (e.g. 2 passes of 9 bits for 200k rows), all
    digit histograms come from the one pass that builds the keys, and the sort is stable, so bags
    stay ascending within a row. Result in keys[lo:hi], the table's id range. Out-of-range ids
    are flagged in err[t] (and sorted as row 0; the caller raises before any update)."""
    for t in range(t0, t1):
        lo = offsets[t * B]
        hi = offsets[(t + 1) * B]
        if hi <= lo:
            continue
        R = rows[t]
        bits = 1
        while (np.int64(1) << bits) < R:
            bits += 1
        npass = (bits + 10) // 11
        dbits = (bits + npass - 1) // npass
        nb = np.int64(1) << dbits
        mask = nb - 1
        hist = np.zeros((npass, nb), np.int64)
        for b in range(B):
            for j in range(offsets[t * B + b], offsets[t * B + b + 1]):
                r = ids[j]
                if r < 0 or r >= R:
                    err[t] = 1
                    r = 0
                keys[j] = (r << 32) | (j if by_pos else b)
                for p in range(npass):
                    hist[p, (r >> (p * dbits)) & mask] += 1
        src = keys
        dst = tmp
        for p in range(npass):
            pos = lo
            for d in range(nb):
                c = hist[p, d]
                hist[p, d] = pos
                pos += c
            sh = 32 + p * dbits
            for j in range(lo, hi):
                kk = src[j]
                d = (kk >> sh) & mask
                dst[hist[p, d]] = kk
                hist[p, d] += 1
            src, dst = dst, src
        if npass % 2 == 1:
            keys[lo:hi] = tmp[lo:hi]


@cached_jit(fastmath={"reassoc"})
def update(keys, grad, bag_of, psw, B, w, state, w_off, s_off, dims, d_off, chunks, k0, k1, lr, eps, adagrad):
    """For chunks[k0:k1], walk runs of equal rows in the sorted pairs: sum the row's gradient
    once (fp32, in bag order), then the optimizer step in place, as FBGEMM's CPU TBE does:
    (with per-sample weights `psw` not None, the pairs hold id positions (`sort_pairs(by_pos)`): the
    gradient of position j is psw[j] * grad[bag_of[j]]; None, as in `forward`, compiles without the branch)
      rowwise AdaGrad: s += sum(g*g)/D;  w -= (lr / (sqrt(s) + eps)) * g
      SGD:             w -= lr * g
    (`reassoc` only lets the sum(g*g) reduction use vector lanes.) The weight row and state of
    the pair `_PF_PAIRS` ahead are prefetched."""
    TD = grad.shape[0] // B
    lr32 = np.float32(lr)
    eps32 = np.float32(eps)
    step = max(1, 64 // w.itemsize)
    Dmax = 1
    for t in range(dims.shape[0]):
        Dmax = max(Dmax, dims[t])
    g = np.empty(Dmax, np.float32)
    for k in range(k0, k1):
        t = chunks[k, 0]
        D = dims[t]
        Df = np.float32(D)
        base = w_off[t]
        sb = s_off[t]
        o0 = d_off[t]
        hi = chunks[k, 2]
        i = chunks[k, 1]
        while i < hi:
            r = keys[i] >> 32
            for c in range(D):
                g[c] = np.float32(0.0)
            while i < hi and (keys[i] >> 32) == r:
                ip = i + _PF_PAIRS
                if ip < hi:
                    rp = keys[ip] >> 32
                    for c in range(0, D, step):
                        _prefetch(w, base + rp * D + c)
                    if adagrad:
                        _prefetch(state, sb + rp)
                    bq = keys[ip] & 0xFFFFFFFF
                    if psw is not None:
                        bq = bag_of[bq]
                    gq = bq * TD + o0
                    for c in range(0, D, 16):
                        _prefetch(grad, gq + c)
                low = keys[i] & 0xFFFFFFFF
                if psw is not None:
                    gp = bag_of[low] * TD + o0
                    gr = grad[gp: gp + D]
                    sc = psw[low]
                    for c in range(D):
                        g[c] += sc * gr[c]
                else:
                    gp = low * TD + o0
                    gr = grad[gp: gp + D]
                    for c in range(D):
                        g[c] += gr[c]
                i += 1
            wr = w[base + r * D: base + r * D + D]
            if adagrad:
                ss = np.float32(0.0)
                for c in range(D):
                    ss += g[c] * g[c]
                sv = state[sb + r] + ss / Df
                state[sb + r] = sv
                mult = lr32 / (np.sqrt(sv) + eps32)
                for c in range(D):
                    _st(wr, c, _ld(wr, c) - mult * g[c])
            else:
                for c in range(D):
                    _st(wr, c, _ld(wr, c) - lr32 * g[c])


# == trampolines for torch's OpenMP team (driven by `cubic_kernels._native_omp`) ==========================
# They live in this file so that numba's cache, which only watches a function's own source file,
# recompiles them whenever a kernel they inline changes.

# -- intrinsics: an atomic counter and raw addresses -------------------------------------------------


@intrinsic
def _fetch_add(typingctx, arr, idx):
    """Atomically `arr[idx] += 1` on an int64 array; returns the old value."""
    if not isinstance(arr, types.Array) or arr.dtype != types.int64:
        return None

    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _item_ptr(context, builder, sig, args), ir.IntType(64)(1), "monotonic")

    return types.int64(arr, idx), codegen


@intrinsic
def _voidptr(typingctx, addr):
    """int64 address -> void* (for `carray`)."""
    if addr != types.int64:
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


@cached_jit(inline="always")
def _i64(a, k):
    return carray(_voidptr(a[k]), (a[k + 1],), np.int64)


# -- argument block layout ---------------------------------------------------------------------------
# Every block starts [counter, n_items, wkind]; wkind: 0 fp32, 1 fp16 bits, 2 bf16 bits.
_F32, _F16, _BF16 = 0, 1, 2
_WKIND = {np.dtype(np.float32): _F32, np.dtype(np.int16): _F16, np.dtype(np.uint16): _BF16}

_SIG = types.void(types.voidptr)


@cached_jit(inline="always")
def _forward_any(ids, offs, psw, a, wk, w_off, rows, dims, d_off, B, items, k, out, err):
    """`forward` of item k on the block's weights, viewed as their storage type `wk`."""
    if wk == _F32:
        forward(ids, offs, psw, carray(_voidptr(a[7]), (a[8],), np.float32), w_off, rows, dims, d_off, B,
                items, k, k + 1, out, err)
    elif wk == _F16:
        forward(ids, offs, psw, carray(_voidptr(a[7]), (a[8],), np.int16), w_off, rows, dims, d_off, B,
                items, k, k + 1, out, err)
    else:
        forward(ids, offs, psw, carray(_voidptr(a[7]), (a[8],), np.uint16), w_off, rows, dims, d_off, B,
                items, k, k + 1, out, err)


@cached_jit(inline="always")
def _update_any(keys, grad, bag_of, psw, B, a, wk, state, w_off, s_off, dims, d_off, chunks, k, lr, eps, adagrad):
    """`update` of chunk k on the block's weights, viewed as their storage type `wk`."""
    if wk == _F32:
        update(keys, grad, bag_of, psw, B, carray(_voidptr(a[7]), (a[8],), np.float32), state, w_off, s_off, dims,
               d_off, chunks, k, k + 1, lr, eps, adagrad)
    elif wk == _F16:
        update(keys, grad, bag_of, psw, B, carray(_voidptr(a[7]), (a[8],), np.int16), state, w_off, s_off, dims,
               d_off, chunks, k, k + 1, lr, eps, adagrad)
    else:
        update(keys, grad, bag_of, psw, B, carray(_voidptr(a[7]), (a[8],), np.uint16), state, w_off, s_off, dims,
               d_off, chunks, k, k + 1, lr, eps, adagrad)



@cfunc(_SIG, cache=True, nopython=True)
def _forward_task(data):
    # [ctr, n, wkind, ids, offsets, w, w_off, rows, dims, d_off, items, out, err, psw] as (addr, len), B
    a = carray(data, (28,), np.int64)
    ids, offs = _i64(a, 3), _i64(a, 5)
    w_off, rows, dims, d_off = _i64(a, 9), _i64(a, 11), _i64(a, 13), _i64(a, 15)
    items = carray(_voidptr(a[17]), (a[18] // 3, 3), np.int64)
    out = carray(_voidptr(a[19]), (a[20],), np.float32)
    err = carray(_voidptr(a[21]), (a[22],), np.uint8)
    psw = carray(_voidptr(a[23]), (a[24],), np.float32)
    B = a[25]
    wk = a[2]
    while True:
        k = _fetch_add(a, 0)
        if k >= a[1]:
            break
        if a[24] == 0:
            _forward_any(ids, offs, None, a, wk, w_off, rows, dims, d_off, B, items, k, out, err)
        else:
            _forward_any(ids, offs, psw, a, wk, w_off, rows, dims, d_off, B, items, k, out, err)



@cfunc(_SIG, cache=True, nopython=True)
def _sort_task(data):
    # [ctr, n_tables, -, ids, offsets, rows, keys, tmp, err] as (addr, len), B, by_pos
    a = carray(data, (21,), np.int64)
    ids, offs, rows, keys, tmp = _i64(a, 3), _i64(a, 5), _i64(a, 7), _i64(a, 9), _i64(a, 11)
    err = carray(_voidptr(a[13]), (a[14],), np.uint8)
    B, by_pos = a[15], a[16] != 0
    while True:
        t = _fetch_add(a, 0)
        if t >= a[1]:
            break
        sort_pairs(ids, offs, rows, B, t, t + 1, keys, tmp, err, by_pos)


@cfunc(_SIG, cache=True, nopython=True)
def _update_task(data):
    # [ctr, n, wkind, keys, grad, w, state, w_off, s_off, dims, d_off, chunks, bag_of, psw] as
    # (addr, len), B, adagrad, address of float64 [lr, eps]
    a = carray(data, (34,), np.int64)
    keys = _i64(a, 3)
    grad = carray(_voidptr(a[5]), (a[6],), np.float32)
    state = carray(_voidptr(a[9]), (a[10],), np.float32)
    w_off, s_off, dims, d_off = _i64(a, 11), _i64(a, 13), _i64(a, 15), _i64(a, 17)
    chunks = carray(_voidptr(a[19]), (a[20] // 3, 3), np.int64)
    bag_of = _i64(a, 21)
    psw = carray(_voidptr(a[23]), (a[24],), np.float32)
    B, adagrad = a[25], a[26] != 0
    f = carray(_voidptr(a[27]), (2,), np.float64)
    lr, eps = f[0], f[1]
    wk = a[2]
    while True:
        k = _fetch_add(a, 0)
        if k >= a[1]:
            break
        if a[24] == 0:
            _update_any(keys, grad, None, None, B, a, wk, state, w_off, s_off, dims, d_off, chunks, k, lr, eps,
                        adagrad)
        else:
            _update_any(keys, grad, bag_of, psw, B, a, wk, state, w_off, s_off, dims, d_off, chunks, k, lr, eps,
                        adagrad)
