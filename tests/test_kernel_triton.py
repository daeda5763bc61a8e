"""The `triton` embedding-bag backend against the `torch` reference.

On CPU the kernels run under Triton's interpreter, which must be selected before `triton.language` is
first imported in the process (its stdlib functions are decorated at import). Without CUDA we set
TRITON_INTERPRET=1 at the top of this module; with CUDA the in-process tests run the compiled kernels
on the GPU. Whenever the interpreter is not active in this process (a GPU machine, or an earlier test
module imported triton first), one test re-runs the CPU cases of this file in a fresh subprocess with
TRITON_INTERPRET=1, so they are never silently skipped. Shapes are tiny: the interpreter runs every
program in Python.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import (see module docstring)

from tests.helpers import require  # noqa: E402

require("triton")

from cubic_kernels import OptimSpec, make_kernel  # noqa: E402
from cubic_kernels import triton_backend as tb  # noqa: E402

DEVICES = (["cpu"] if tb.INTERPRETED else []) + (["cuda"] if torch.cuda.is_available() else [])
ROWS, DIMS = [40, 6, 25, 12], [8, 4, 12, 16]  # non-power-of-two dim 12: exercises the column mask
SPLIT = 4  # small split length so Zipf hot rows form runs longer than it


def _zipf_ids(n: int, rows: int, gen: torch.Generator, alpha: float = 1.3) -> torch.Tensor:
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** alpha
    return torch.multinomial(p, n, replacement=True, generator=gen) if n else torch.empty(0, dtype=torch.long)


def _batch(B: int, gen: torch.Generator, max_len: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Table-major jagged batch with Zipf ids, some empty bags and one fully empty table."""
    T = len(ROWS)
    lens = torch.randint(0, max_len + 1, (T * B,), generator=gen)
    lens[::5] = 0  # scattered empty bags
    lens[B: 2 * B] = 0  # table 1 has no ids at all in this batch
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    ids = torch.cat([_zipf_ids(int(lens[t * B:(t + 1) * B].sum()), ROWS[t], gen) for t in range(T)])
    return ids, offsets


def _pair(dtype: str, kind: str, device: str, lr: float = 0.05, dims: list[int] = DIMS, **kw):
    ref = make_kernel("torch", ROWS, dims, weight_dtype=dtype, optim=OptimSpec(kind, lr=lr), device="cpu")
    tri = make_kernel("triton", ROWS, dims, weight_dtype=dtype, optim=OptimSpec(kind, lr=lr), device=device,
                      split_len=SPLIT, **kw)
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(r, d, generator=gen) * 0.5 for r, d in zip(ROWS, dims, strict=True)]
    ref.load(init)
    tri.load(init)
    return ref, tri


TOL = {"fp32": dict(rtol=1e-5, atol=1e-5), "fp16": dict(rtol=2e-3, atol=2e-3),
       "bf16": dict(rtol=1e-2, atol=1e-2)}


def _close(a: torch.Tensor, b: torch.Tensor, **tol) -> None:
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), **tol)


needs_interp = pytest.mark.skipif(not DEVICES, reason="triton was imported without the interpreter: "
                                  "see test_cpu_cases_in_fresh_interpreter_process")


@needs_interp
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,kind", [("fp32", "rowwise_adagrad"), ("fp32", "sgd"),
                                        ("fp16", "rowwise_adagrad"), ("fp16", "sgd"),
                                        ("bf16", "rowwise_adagrad")])
def test_matches_torch_reference(dtype: str, kind: str, device: str) -> None:
    _three_steps_match(*_pair(dtype, kind, device), device, dtype)


@needs_interp
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,kind,singles", [("fp32", "rowwise_adagrad", False), ("fp32", "rowwise_adagrad", True),
                                                ("fp16", "sgd", False), ("bf16", "rowwise_adagrad", True)])
def test_per_sample_weights_match_torch_reference(dtype: str, kind: str, singles: bool, device: str) -> None:
    """Weighted bags (TorchRec's weighted features): the forward scales each row by its id's score, and every
    backward path (rows hit once, short runs, long runs split in chunks) scales each id's gradient row."""
    _three_steps_match(*_pair(dtype, kind, device, singles=singles), device, dtype, weighted=True)


@needs_interp
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims,programs", [([3, 5, 7, 9], 0), ([6, 2, 10, 14], 3)],
                         ids=["vec1-program-per-tile", "vec2-3-programs-stride"])
def test_narrow_loads_and_strided_grid(dims: list[int], programs: int, device: str) -> None:
    """Dims not all multiples of 4 take 1- or 2-wide loads; 3 backward programs stride over all tiles."""
    ref, tri = _pair("fp32", "rowwise_adagrad", device, dims=dims, max_programs=programs)
    assert tri._vec == (1 if 3 in dims else 2)
    _three_steps_match(ref, tri, device, "fp32")


def _three_steps_match(ref, tri, device: str, dtype: str, weighted: bool = False) -> None:
    """Three jagged Zipf batches: forward, updated weights and state match the reference each step (`weighted`:
    with per-sample weights in [-0.5, 1.5))."""
    gen = torch.Generator().manual_seed(2)
    B = 8
    saw_long_run = False
    for _ in range(3):
        ids, offsets = _batch(B, gen)
        psw = torch.rand(ids.numel(), generator=gen) * 2 - 0.5 if weighted else None
        psw_dev = psw.to(device) if weighted else None
        plan = tri._plan(ids.to(device), offsets.to(device), B)
        saw_long_run |= int(plan["pend"][-1]) > 0  # some run has chunks
        out_ref = ref.forward(ids, offsets, psw)
        out_tri = tri.forward(ids.to(device), offsets.to(device), psw_dev)
        assert out_tri.shape == (B, sum(tri.dims)) and out_tri.dtype == torch.float32
        _close(out_tri, out_ref, rtol=1e-5, atol=1e-5)  # same stored weights, fp32 accumulate
        grad = torch.randn(out_ref.shape, generator=gen)
        ref.backward_update(ids, offsets, grad, psw)
        tri.backward_update(ids.to(device), offsets.to(device), grad.to(device), psw_dev)
        for w_ref, w_tri in zip(ref.weights(), tri.weights(), strict=True):
            assert w_tri.dtype == w_ref.dtype
            _close(w_tri, w_ref, **TOL[dtype])
        for s_ref, s_tri in zip(ref.states(), tri.states(), strict=True):
            assert s_tri.shape == s_ref.shape
            _close(s_tri, s_ref, rtol=1e-5, atol=1e-6)
    assert saw_long_run, "the batches must contain runs longer than split_len (hot-row path)"


@needs_interp
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx64", [False, True], ids=["idx32", "idx64"])
def test_hot_row_split_is_exact(device: str, idx64: bool) -> None:
    """One row hit 50 times (13 chunks of 4): the two-pass reduction equals one update of the sum
    (with int32 index arithmetic, the default for buffers under 2**31 elements, and with int64)."""
    ref, tri = _pair("fp32", "rowwise_adagrad", device, lr=0.1, force_idx64=idx64)
    B = 10
    lens = torch.zeros(len(ROWS) * B, dtype=torch.long)
    lens[:B] = 5  # table 0: 10 bags x 5 ids, all row 3
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    ids = torch.full((50,), 3, dtype=torch.long)
    plan = tri._plan(ids.to(device), offsets.to(device), B)
    assert int(plan["pend"][-1]) == 13 and plan["n_runs"].item() == 1  # chunks of the one run
    assert plan["run_start"][:2].tolist() == [0, 50] and set(plan["run_start"][2:].tolist()) == {50}
    assert plan["sorted_key"][0].item() == 3  # table 0, row 3
    grad = torch.randn(B, sum(DIMS), generator=torch.Generator().manual_seed(3))
    ref.backward_update(ids, offsets, grad)
    tri.backward_update(ids.to(device), offsets.to(device), grad.to(device))
    _close(tri.weights()[0], ref.weights()[0], rtol=1e-5, atol=1e-6)
    _close(tri.states()[0], ref.states()[0], rtol=1e-5, atol=1e-7)
    untouched = torch.ones(ROWS[0], dtype=torch.bool)
    untouched[3] = False
    assert torch.equal(tri.states()[0][untouched].cpu(), torch.zeros(ROWS[0] - 1))


@needs_interp
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,kind", [("fp32", "rowwise_adagrad"), ("bf16", "sgd")])
def test_singles_path_gives_the_sorted_paths_bits(dtype: str, kind: str, device: str) -> None:
    """`singles=True` updates rows hit once without sorting and sends the rest down the sorted path:
    the same weights and state, bit for bit, as sorting everything (and the torch reference's values),
    on batches with both kinds of rows, with only singles, and with one hot row only."""
    ref, tri = _pair(dtype, kind, device)
    _, one = _pair(dtype, kind, device, singles=True)
    gen = torch.Generator().manual_seed(6)
    B, T = 8, len(ROWS)
    unique = torch.tensor([0, 5, 9, 1, 2, 3, 30, 7, 11, 4], dtype=torch.long)  # table 0, every row once
    lens = torch.zeros(T * B, dtype=torch.long)
    lens[:5] = 2
    batches = [_batch(B, gen) for _ in range(2)] + [
        (unique, torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])),
        (torch.full((10,), 3, dtype=torch.long), torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]))]
    for ids, offsets in batches:
        grad = torch.randn(B, sum(DIMS), generator=gen)
        ref.backward_update(ids, offsets, grad)
        tri.backward_update(ids.to(device), offsets.to(device), grad.to(device))
        one.backward_update(ids.to(device), offsets.to(device), grad.to(device))
        for a, b in zip(tri.weights() + tri.states(), one.weights() + one.states(), strict=True):
            assert torch.equal(a, b)
        for w_ref, w_one in zip(ref.weights(), one.weights(), strict=True):
            _close(w_one, w_ref, **TOL[dtype])
    table = torch.repeat_interleave(torch.arange(T), batches[0][1][B::B] - batches[0][1][:-1:B])
    hits = torch.unique(table * 100 + batches[0][0], return_counts=True)[1]
    assert (hits == 1).any() and (hits > 1).any(), "the Zipf batch must hold rows hit once and rows hit more"


@needs_interp
@pytest.mark.parametrize("device", DEVICES)
def test_int32_indices_empty_batch_and_live_views(device: str) -> None:
    ref, tri = _pair("fp32", "sgd", device)
    gen = torch.Generator().manual_seed(4)
    ids, offsets = _batch(4, gen)
    _close(tri.forward(ids.int().to(device), offsets.int().to(device)), ref.forward(ids, offsets))
    # all bags empty: zeros out, backward is a no-op
    B = 3
    empty_off = torch.zeros(len(ROWS) * B + 1, dtype=torch.long, device=device)
    empty_ids = torch.empty(0, dtype=torch.long, device=device)
    before = [w.clone() for w in tri.weights()]
    assert torch.count_nonzero(tri.forward(empty_ids, empty_off)) == 0
    tri.backward_update(empty_ids, empty_off, torch.ones(B, sum(DIMS), device=device))
    assert all(torch.equal(a, b) for a, b in zip(before, tri.weights(), strict=True))
    # weights() are live views of the flat buffer: writes go through to the kernel
    tri.weights()[2][5].fill_(1.0)
    one = tri.forward(torch.tensor([5], device=device),
                      torch.tensor([0, 0, 0, 1, 1], device=device))  # B=1: table 2 bag holds row 5
    assert torch.equal(one[0, 12:24].cpu(), torch.ones(12))
    assert tri.memory_bytes() == ref.memory_bytes()


@pytest.mark.skipif("cpu" in DEVICES, reason="interpreter active in this process; CPU cases ran in-process")
def test_cpu_cases_in_fresh_interpreter_process() -> None:
    """On a CUDA machine this process runs the cases on the GPU; the interpreter's CPU cases run in a fresh
    process with TRITON_INTERPRET set before triton loads. Every CPU case it collects must pass, none
    skipped (the count is collected, so a new case cannot go unrun)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cpu and not fresh",
           __file__]
    listed = subprocess.run([*cmd, "--collect-only"], env=env, capture_output=True, text=True, timeout=300)
    n = sum("[" in ln and "cpu" in ln for ln in listed.stdout.splitlines() if ln.startswith("tests/"))
    assert n > 0, listed.stdout[-2000:]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert re.search(rf"\b{n} passed\b", r.stdout) and "skipped" not in r.stdout, r.stdout[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the claim is about host syncs")
def test_backward_never_waits_for_the_gpu() -> None:
    """The plan sizes its grids by upper bounds, so the fused backward queues without a sync; a grid
    of 2 programs striding over every tile gives the same bits."""
    gen = torch.Generator().manual_seed(5)
    ids, offsets = (x.cuda() for x in _batch(8, gen))
    grad = torch.randn(8, sum(DIMS), generator=gen).cuda()
    lazy, strided = (_pair("fp32", "rowwise_adagrad", "cuda", max_programs=p)[1] for p in (0, 2))
    lazy.backward_update(ids, offsets, grad)  # compiles outside the checked call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lazy.backward_update(ids, offsets, grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for _ in range(2):
        strided.backward_update(ids, offsets, grad)
    for a, b in zip(lazy.weights() + lazy.states(), strided.weights() + strided.states(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(__import__("triton").__version__ not in ("3.8.0", "3.9.0"),
                    reason="offline compile (ASTSource attrs) written against Triton 3.8 and 3.9")
def test_update_and_forward_compile_to_16_byte_loads() -> None:
    """Compiled offline for an H100 (sm_90, Triton's bundled ptxas; no GPU needed): with dims that are
    multiples of 4 the weight and gradient rows move in 16-byte `v4` loads and stores, with and without
    per-sample weights (HAS_W: the weighted variants compile for the GPU too). A per-column
    mask (`cols < D`) compiles to 4-byte loads only: the kernel measured 1.4x slower for it."""
    code = r'''
import os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cubic_kernels import triton_backend as tb

def ptx(fn, sig, consts, nw):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=nw, enable_fp_fusion=False)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

i32, f32 = "*i32", "*fp32"
for has_w in (False, True):
    upd = ptx(tb._BWD_UPDATE, dict(sorted_b_ptr=i32, sorted_sc_ptr=f32, grad_ptr=f32, grad_stride="i32",
              run_key_ptr=i32, first_b_ptr=i32, first_sc_ptr=f32, run_start_ptr="*i64", pend_ptr=i32, part_ptr=f32,
              dims_ptr=i32, col_off_ptr=i32, w_off_ptr="*i64", s_off_ptr="*i64", w_ptr=f32, s_ptr=f32,
              n_runs_ptr=i32, lr="fp32", eps="fp32"),
              dict(ADAGRAD=True, BF16=False, IDX=tl.int32, ROW_BITS=20, SPLIT=32, VEC=4, EVICT=True, BLOCK_R=4,
                   BLOCK_D=128, HAS_W=has_w), 2)
    one = ptx(tb._BWD_SINGLES, dict(key_ptr=i32, b_ptr=i32, sc_ptr=f32, count_ptr=i32, multi_ptr="*i8",
              grad_ptr=f32, grad_stride="i32", dims_ptr=i32, col_off_ptr=i32, w_off_ptr="*i64", s_off_ptr="*i64",
              w_ptr=f32, s_ptr=f32, n="i32", lr="fp32", eps="fp32"),
              dict(ADAGRAD=True, BF16=False, IDX=tl.int32, ROW_BITS=20, VEC=4, EVICT=True, BLOCK_R=4,
                   BLOCK_D=128, HAS_W=has_w), 2)
    fwd = ptx(tb._FWD, dict(ids_ptr="*i64", offsets_ptr="*i64", w_ptr=f32, out_ptr=f32, w_off_ptr="*i64",
              dims_ptr=i32, col_off_ptr=i32, sc_ptr=f32, B="i32", out_stride="i32"),
              dict(VEC=4, BLOCK_N=32, BLOCK_D=128, HAS_W=has_w), 4)
    print(len(re.findall(r"ld\.global\S*\.v4", upd)), len(re.findall(r"st\.global\S*\.v4", upd)),
          len(re.findall(r"ld\.global\S*\.v4", one)), len(re.findall(r"st\.global\S*\.v4", one)),
          len(re.findall(r"ld\.global\S*\.v4", fwd)))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("this Triton build has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    counts = [list(map(int, line.split())) for line in r.stdout.strip().splitlines()[-2:]]
    assert len(counts) == 2, r.stdout
    # update: weight row, first gradient row, looped gradient rows, chunk partials (2 per thread each at
    # 4 rows x 128 cols over 64 threads); store: the weight row. singles: weight and gradient row, weight
    # store. forward: the gathered rows.
    for upd_ld, upd_st, one_ld, one_st, fwd_ld in counts:
        assert upd_ld >= 8 and upd_st >= 2 and one_ld >= 4 and one_st >= 2 and fwd_ld >= 8, r.stdout
