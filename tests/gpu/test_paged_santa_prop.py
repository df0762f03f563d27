"""S²ANTA-prop and the Bernoulli score stage on paged KV caches read in place (issue 30
items 2 and 3), and their serving arguments (out=, workspace=).

- Paged vs contiguous, same tokens and the same N (= the cache's token_bound): the same
  chunk and tile split, so the outputs and the drawn indices are equal bit for bit, for
  page sizes 1, 3, 16 and 128, NHD and HND, pages in shuffled order with unused (NaN)
  pages, combined and separate pools, odd lengths and an empty sequence, fp16 (CuPy) and
  bf16 (torch); pass 1 on the tensor cores and on the CUDA cores, Bernoulli scores.
- out= and a kept workspace: a warmed plan's call allocates nothing; a too-small
  workspace is a ValueError naming it; a paged call with out= and a device offset that
  advances is captured in a torch CUDA graph and its replays draw what eager calls do.
- Bad input: int64 tables, page size 129, k_feature_major with pages.
- The flash schedule through SantaPlan (paged and out=) needs the paged santa_flash of
  the flash helper's work: marked `needs_paged_flash`, skipped until santa_flash takes
  `out` and `workspace`.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import stochattn
from stochattn.paged import from_contiguous, paged_kv
from gpu_helpers import peaked_inputs

pytestmark = pytest.mark.gpu

HKV, G, N, D = 2, 4, 700, 128
LENS = np.array([N, 333, 0, 1, 129], dtype=np.int64)  # odd, empty, one token, a page + 1
B = len(LENS)
PAGE_SIZES = (1, 3, 16, 128)
LAYOUTS = ("NHD", "HND")
# (framework, dtype): fp16 through CuPy, bf16 through torch.
FRAMEWORKS = (("cupy", "float16"), ("torch", "bfloat16"))
# santa_prop options: pass 1 on the tensor cores (default), on the CUDA cores, Bernoulli.
VARIANTS = (dict(budget=64), dict(budget=48, sampler="iid", kernel="simt", tile_size=32),
            dict(budget=64, sampler="stratified", scores="bernoulli", bernoulli_draws=2,
                 tile_size=128))


def _host_inputs(seed=3):
    q, k, v = peaked_inputs(B, HKV, G, N, D, seed=seed)
    # Values past each length are random here and NaN in the paged pool: neither is read.
    return q, k, v


def _framework(fw, dtype):
    """(array maker from NumPy, index maker) for the framework."""
    if fw == "cupy":
        cupy = pytest.importorskip("cupy")
        return (lambda a: cupy.asarray(np.asarray(a, dtype=np.float16)),
                lambda a: cupy.asarray(a))
    torch = pytest.importorskip("torch")
    return (lambda a: torch.tensor(np.asarray(a, dtype=np.float32), device="cuda").to(
        torch.bfloat16), lambda a: torch.as_tensor(a, device="cuda"))


def gpu_paged(host, arr, idx, *, combined, index_dtype=None):
    """The host PagedKV ``host`` on the GPU: pools through ``arr``, tables through ``idx``
    (int32 unless ``index_dtype``), max_tokens N (the contiguous call's N)."""
    tables = {n: idx(getattr(host, n) if index_dtype is None
                     else getattr(host, n).astype(index_dtype))
              for n in ("kv_indptr", "kv_indices", "kv_last_page_len")}
    if combined:
        pool = arr(np.stack([host.k_pages, host.v_pages], axis=1))
        return paged_kv(pool, layout=host.layout, max_tokens=N, **tables)
    return paged_kv(arr(host.k_pages), arr(host.v_pages), layout=host.layout, max_tokens=N,
                    **tables)


def _both(fw, dtype, page_size, layout, combined, seed=3):
    """(q, k, v, lens) contiguous on the GPU and the same tokens paged."""
    arr, idx = _framework(fw, dtype)
    q, k, v = _host_inputs(seed)
    # The pool holds the values the device arrays hold (fp16, or float32 rounded to bf16
    # by the same conversion).
    kh, vh = (np.asarray(a, dtype=np.float16 if dtype == "float16" else np.float32)
              for a in (k, v))
    host = from_contiguous(kh, vh, LENS, page_size=page_size, layout=layout,
                           shuffle_seed=page_size, extra_pages=2, combined=combined)
    cache = gpu_paged(host, arr, idx, combined=combined)
    return arr(q), arr(k), arr(v), idx(LENS.astype(np.int32)), cache


def _equal(a, b) -> bool:
    if type(a).__module__.split(".")[0] == "torch":
        import torch

        return bool(torch.equal(a, b))
    import cupy

    return bool(cupy.array_equal(a, b))


@pytest.mark.parametrize("fw, dtype", FRAMEWORKS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_equals_contiguous_bitwise(fw, dtype, layout, page_size):
    from stochattn.cuda import santa_prop

    combined = page_size in (3, 128)
    q, k, v, lens, cache = _both(fw, dtype, page_size, layout, combined)
    for opts in VARIANTS:
        want, want_idx = santa_prop(q, k, v, lens, seed=5, offset=11, return_indices=True,
                                    **opts)
        got, got_idx = santa_prop(q, cache, None, seed=5, offset=11, return_indices=True,
                                  **opts)
        assert _equal(got, want), opts
        assert _equal(got_idx, want_idx), opts
    # The public plan (default options) reads the same pages.
    plan = stochattn.SantaPlan(budget=64, device="cuda")
    assert _equal(plan.run(q, cache, seed=2, offset=3), plan.run(q, k, v, lens, seed=2,
                                                                offset=3))


@pytest.mark.parametrize("fw, dtype", FRAMEWORKS)
@pytest.mark.parametrize("page_size", (1, 16))
def test_bernoulli_scores_paged_equal_contiguous(fw, dtype, page_size):
    q, k, v, lens, cache = _both(fw, dtype, page_size, "HND", page_size == 1)
    plan = stochattn.BernoulliPlan(bernoulli_draws=3, device="cuda")
    want = plan.run(q, k, lens, seed=4, offset=1)
    got = plan.run(q, cache, seed=4, offset=1)
    assert _equal(got, want)
    out = got * 0
    assert plan.run(q, cache, seed=4, offset=1, out=out) is out
    assert _equal(out, want)
    _, diag = plan.diagnose(q, cache, seed=4, offset=1)
    np.testing.assert_array_equal(diag.seq_lens, LENS)


def test_paged_diagnostics_use_the_page_table_lengths():
    q, k, v, lens, cache = _both("torch", "bfloat16", 16, "NHD", False)
    plan = stochattn.SantaPlan(budget=32, device="cuda")
    (out_p, dp), (out_c, dc) = (plan.diagnose(q, cache, seed=1), plan.diagnose(q, k, v, lens,
                                                                                seed=1))
    assert _equal(out_p, out_c)
    np.testing.assert_array_equal(dp.seq_lens, dc.seq_lens)
    np.testing.assert_array_equal(dp.v_rows_read, dc.v_rows_read)


# ---- out= and workspace= --------------------------------------------------------------

def _allocations(torch) -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


@pytest.mark.parametrize("opts", VARIANTS[:2] + (dict(budget=64, scores="bernoulli"),))
def test_warm_plan_with_out_allocates_nothing_torch(opts):
    torch = pytest.importorskip("torch")
    q, k, v, lens, cache = _both("torch", "bfloat16", 16, "HND", True)
    kw = {k_: v_ for k_, v_ in opts.items() if k_ != "kernel"}
    plan = stochattn.SantaPlan(device="cuda", **kw)
    out = torch.empty_like(q)
    offset = torch.tensor(0, dtype=torch.int64, device="cuda")
    plan.run(q, cache, seed=1, offset=offset, out=out)  # warm-up: plan, compile, workspace
    torch.cuda.synchronize()
    before = _allocations(torch)
    for _ in range(3):
        assert plan.run(q, cache, seed=1, offset=offset, out=out) is out
    assert _allocations(torch) == before
    assert plan.workspace.nbytes() > 0
    torch.cuda.synchronize()
    assert _equal(out, plan.run(q, k, v, lens, seed=1, offset=0))


def test_warm_plan_with_out_allocates_nothing_cupy():
    cupy = pytest.importorskip("cupy")
    q, k, v, lens, cache = _both("cupy", "float16", 3, "NHD", False)
    plan = stochattn.SantaPlan(budget=64, device="cuda")
    out = cupy.empty_like(q)
    plan.run(q, cache, seed=1, offset=2, out=out)
    pool = cupy.get_default_memory_pool()
    calls = []

    def counting(nbytes):
        calls.append(nbytes)
        return pool.malloc(nbytes)

    cupy.cuda.set_allocator(counting)
    try:
        for _ in range(3):
            plan.run(q, cache, seed=1, offset=2, out=out)
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    assert calls == []


def test_caller_workspace_and_its_checks():
    torch = pytest.importorskip("torch")
    from stochattn.cuda import santa as cuda_santa

    q, k, v, lens, cache = _both("torch", "bfloat16", 16, "NHD", False)
    plan = stochattn.SantaPlan(budget=64, device="cuda")
    need = cuda_santa.workspace_bytes(B, HKV * G, HKV, N, D, 64)
    ws = torch.empty(need, dtype=torch.uint8, device="cuda")
    want = plan.run(q, k, v, lens, seed=3)
    assert _equal(plan.run(q, cache, seed=3, workspace=ws), want)
    with pytest.raises(ValueError, match="`workspace`"):
        plan.run(q, cache, seed=3, workspace=ws[:need - 256])
    with pytest.raises(TypeError, match="`workspace`"):
        plan.run(q, cache, seed=3, workspace=torch.empty(need // 4, dtype=torch.int32,
                                                         device="cuda"))
    with pytest.raises(ValueError, match="`out`"):
        plan.run(q, cache, seed=3, out=torch.empty((B, HKV * G, D + 8), dtype=q.dtype,
                                                   device="cuda"))


def test_graph_capture_of_a_paged_call_with_out_and_device_offset():
    torch = pytest.importorskip("torch")
    q, k, v, lens, cache = _both("torch", "bfloat16", 16, "HND", True)
    fixed = stochattn.SantaPlan(budget=64, device="cuda")
    want = [fixed.run(q, k, v, lens, seed=7, offset=o) for o in range(20, 25)]
    assert not _equal(want[0], want[1])
    plan = stochattn.SantaPlan(budget=64, device="cuda", advance_offset=True)
    offset = torch.tensor(20, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)
    s = torch.cuda.Stream()  # warm-up (plan, compile, workspace) outside the capture
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan.run(q, cache, seed=7, offset=offset, out=out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert _equal(out, want[0]) and int(offset) == 21
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q, cache, seed=7, offset=offset, out=out)
    assert int(offset) == 21  # capturing runs nothing
    for i in (1, 2, 3, 4):
        g.replay()
        torch.cuda.synchronize()
        assert _equal(out, want[i]), i
    assert int(offset) == 25


# ---- bad input ---------------------------------------------------------------------------

def test_bad_paged_input():
    torch = pytest.importorskip("torch")
    from stochattn.cuda import santa_prop

    arr, idx = _framework("torch", "bfloat16")
    q, k, v = _host_inputs()
    kh, vh = (np.asarray(a, dtype=np.float32) for a in (k, v))
    host = from_contiguous(kh, vh, LENS, page_size=16, layout="NHD")
    wide = gpu_paged(host, arr, idx, combined=False, index_dtype=np.int64)
    with pytest.raises(TypeError, match="kv_indptr"):
        stochattn.SantaPlan(budget=8, device="cuda").run(arr(q), wide)
    big = gpu_paged(from_contiguous(kh, vh, LENS, page_size=129, layout="HND"), arr, idx,
                    combined=True)
    with pytest.raises(ValueError, match="page_size"):
        stochattn.SantaPlan(budget=8, device="cuda").run(arr(q), big)
    cache = gpu_paged(host, arr, idx, combined=False)
    kfm = torch.zeros((B, HKV, D, N), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="no paged form"):
        santa_prop(arr(q), cache, None, budget=8, scores="bernoulli", k_feature_major=kfm)
    with pytest.raises(TypeError, match="seq_lens"):
        stochattn.SantaPlan(budget=8, device="cuda").run(arr(q), cache, None, idx(LENS))
    with pytest.raises(TypeError, match="`v`"):
        stochattn.SantaPlan(budget=8, device="cuda").run(arr(q), cache, arr(v))


# ---- the flash schedule through SantaPlan (needs the flash helper's paged santa_flash) ----

def _flash_takes_pages() -> bool:
    from stochattn.cuda import santa_flash

    params = inspect.signature(santa_flash).parameters
    return "out" in params and "workspace" in params


needs_paged_flash = pytest.mark.skipif(
    not _flash_takes_pages(), reason="needs santa_flash(..., out=, workspace=) reading pages "
    "(the flash helper's part of issue 30)")


@needs_paged_flash
@pytest.mark.parametrize("page_size, layout", [(3, "NHD"), (16, "HND")])
def test_flash_schedule_paged_through_santa_plan(page_size, layout):
    torch = pytest.importorskip("torch")
    q, k, v, lens, cache = _both("torch", "bfloat16", page_size, layout, page_size == 3)
    plan = stochattn.SantaPlan(budget=256, schedule="flash", sampler="iid", device="cuda")
    want = plan.run(q, k, v, lens, seed=9, offset=2)
    assert _equal(plan.run(q, cache, seed=9, offset=2), want)
    out = torch.empty_like(q)
    plan.run(q, cache, seed=9, offset=2, out=out)  # warm
    torch.cuda.synchronize()
    before = _allocations(torch)
    assert plan.run(q, cache, seed=9, offset=2, out=out) is out
    assert _allocations(torch) == before
    assert _equal(out, want)
