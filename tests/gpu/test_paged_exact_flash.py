"""Paged KV caches on the GPU for the split-KV families: exact decode (exact_decode.cu,
exact_decode_tc.cu) and S²ANTA-flash (santa_flash.cu, santa_flash_tc.cu), read in place
through FlashInfer's page table (kernels/kv_rows.cuh).

- Paged vs contiguous on the same tokens with the same N (the cache's ``max_tokens``): the
  chunk split is the same, so outputs (and flash's draws and tile statistics, same seed and
  offset) are equal bit for bit; page sizes 1, 3, 16, 128, NHD and HND, pages in shuffled
  physical order with unused NaN pages (a read of a wrong page or slot shows), NaN slots
  past each sequence's end, odd lengths, a zero-length sequence, combined and separate
  pools, float16 (CuPy) and bfloat16 (torch), the default chunking and a forced merge.
- ``out=`` and ``workspace=``: a warmed plan (ExactPlan's kept workspace, a caller's
  Workspace or uint8 array) called with ``out`` allocates nothing; a too-small workspace
  and a bad ``out`` are errors naming them.
- Bad paged input: int64 page tables (TypeError naming ``kv_indptr``), page size 129,
  ``seq_lens`` or ``v`` with a paged cache.
- torch CUDA graphs: a captured paged exact call with ``out=`` follows the page table's
  values at replay (an engine appends tokens between steps); a captured paged flash call
  with a device offset advanced inside the graph draws at replay i what the eager call
  with offset o + i draws.
- Exact paged decode against FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on the
  same cache (skipped when flashinfer is not importable).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn.cuda import exact as exact_mod  # noqa: E402
from stochattn.cuda import flash as flash_mod  # noqa: E402
from stochattn.cuda.exact import exact_decode  # noqa: E402
from stochattn.cuda.flash import santa_flash  # noqa: E402
from stochattn.cuda.runtime.workspace import Workspace  # noqa: E402
from stochattn.paged import from_contiguous, paged_kv  # noqa: E402
from stochattn.reference.exact import exact_attention as ref_exact  # noqa: E402

from paged_helpers import CountingAllocator, assert_bitwise, gpu_paged, host, warm  # noqa: E402
from gpu_helpers import naive_attention, peaked_inputs, to_device, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu

B, HKV, G, N = 4, 2, 4, 701
LENS = np.array([N, 0, 1, 389], dtype=np.int32)  # full, empty, one token, odd
PAGE_SIZES = (1, 3, 16, 128)
LAYOUTS = ("NHD", "HND")


# ---- helpers ------------------------------------------------------------------------------------

def make_inputs(dtype, *, D=128, page_size=16, layout="NHD", combined=False, seed=0,
                lens=LENS, shuffle_seed=1):
    """``(q, k, v, lens, cache)``: contiguous GPU q, k, v of ``dtype`` and a GPU paged cache
    holding the same tokens (the rounded values: fp16 and bf16 are exact in float32)."""
    q, k, v = peaked_inputs(len(lens), HKV, G, N, D, seed=seed)
    qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
    k32, v32 = to_host64(kd).astype(np.float32), to_host64(vd).astype(np.float32)
    host = from_contiguous(k32, v32, lens, page_size=page_size, layout=layout,
                           shuffle_seed=shuffle_seed, extra_pages=2)
    return qd, kd, vd, np.asarray(lens, dtype=np.int32), gpu_paged(host, dtype, combined)


def empty_like_out(q, D=128):
    shape = (int(q.shape[0]), int(q.shape[1]), D)
    if type(q).__module__.split(".")[0] == "torch":
        import torch

        return torch.empty(shape, dtype=q.dtype, device=q.device)
    return cupy.empty(shape, dtype=q.dtype)


cases = pytest.mark.parametrize(
    "dtype, page_size, layout, combined",
    [(d, p, l, c) for d in ("float16", "bfloat16") for p in PAGE_SIZES for l in LAYOUTS
     for c in (False, True)],
    ids=lambda x: str(x))


# ---- paged vs contiguous, bit for bit --------------------------------------------------------------

@cases
@pytest.mark.parametrize("kernel", exact_mod.KERNELS)
@pytest.mark.parametrize("num_chunks", [None, 3])
def test_exact_paged_equals_contiguous(dtype, page_size, layout, combined, kernel, num_chunks):
    q, k, v, lens, cache = make_inputs(dtype, page_size=page_size, layout=layout,
                                       combined=combined, seed=page_size)
    want = exact_decode(q, k, v, lens, kernel=kernel, num_chunks=num_chunks)
    got = exact_decode(q, cache, kernel=kernel, num_chunks=num_chunks)
    assert_bitwise(got, want, (dtype, page_size, layout, combined, kernel))
    assert np.all(host(got)[LENS == 0] == 0)  # the empty sequence: a zero row, no NaN


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel", exact_mod.KERNELS)
def test_exact_paged_head_dim_64_and_the_reference(dtype, kernel):
    """D 64, and the paged output within the flash-attention rule of the float64 reference
    (the NaN pages and slots are never read)."""
    q, k, v, lens, cache = make_inputs(dtype, D=64, page_size=5, layout="HND", combined=True)
    got = exact_decode(q, cache, kernel=kernel)
    assert_bitwise(got, exact_decode(q, k, v, lens, kernel=kernel), "D 64")
    q64, k64, v64 = to_host64(q), to_host64(k), to_host64(v)
    scale = 1.0 / math.sqrt(64)
    ref = ref_exact(q64, k64, v64, lens, scale)
    naive = naive_attention(q64, k64, v64, lens, scale, dtype)
    err, err_naive = np.abs(host(got) - ref).max(), np.abs(naive - ref).max()
    assert err <= 2 * err_naive + 1e-5


@cases
@pytest.mark.parametrize("kernel", flash_mod.KERNELS)
def test_flash_paged_equals_contiguous(dtype, page_size, layout, combined, kernel):
    """Same seed and offset: same draws (indices), tile statistics and output, bit for bit."""
    q, k, v, lens, cache = make_inputs(dtype, page_size=page_size, layout=layout,
                                       combined=combined, seed=page_size + 7)
    opts = dict(budget=96, sampler="systematic", tile_size=64, seed=5, offset=11, kernel=kernel,
                return_indices=True, return_tile_stats=True)
    want, widx, wstats = santa_flash(q, k, v, lens, **opts)
    got, gidx, gstats = santa_flash(q, cache, **opts)
    assert_bitwise(got, want, "output")
    assert_bitwise(gidx, widx, "indices")
    for a, b, name in zip(gstats, wstats, ("tile_max", "tile_sum", "samples")):
        assert_bitwise(a, b, name)
    assert np.all(host(got)[LENS == 0] == 0)


@pytest.mark.parametrize("sampler", ["stratified", "iid"])
@pytest.mark.parametrize("tile_size", [32, 128])
@pytest.mark.parametrize("num_chunks", [None, 2])
def test_flash_paged_samplers_tiles_chunks(sampler, tile_size, num_chunks):
    q, k, v, lens, cache = make_inputs("bfloat16", page_size=3, layout="HND", combined=False,
                                       seed=3)
    opts = dict(budget=200, sampler=sampler, tile_size=tile_size, seed=2**40 + 1, offset=3,
                num_chunks=num_chunks)
    assert_bitwise(santa_flash(q, cache, **opts), santa_flash(q, k, v, lens, **opts),
                   (sampler, tile_size, num_chunks))


def test_page_shared_by_two_sequences():
    """A page may appear in several sequences (a shared prefix): both read it."""
    import torch

    q, k, v, lens, _ = make_inputs("bfloat16", lens=np.array([48, 48], dtype=np.int32))
    k[1, :, :32] = k[0, :, :32]  # the same 32-token prefix, in pages 0 and 1 of sequence 0
    v[1, :, :32] = v[0, :, :32]
    k32, v32 = to_host64(k).astype(np.float32), to_host64(v).astype(np.float32)
    hostc = from_contiguous(k32, v32, lens, page_size=16, layout="NHD")
    ind = np.asarray(hostc.kv_indices).copy()
    ind[3:5] = ind[0:2]  # sequence 1's first two pages are sequence 0's
    shared = paged_kv(hostc.k_pages, hostc.v_pages, kv_indptr=hostc.kv_indptr, kv_indices=ind,
                      kv_last_page_len=hostc.kv_last_page_len, layout="NHD", max_tokens=N)
    cache = gpu_paged(shared, "bfloat16", combined=False)
    assert torch.equal(exact_decode(q, cache), exact_decode(q, k, v, lens))


# ---- out= and workspace= ------------------------------------------------------------------------

def test_exact_plan_with_out_allocates_nothing_after_a_warm_up():
    """ExactPlan keeps its workspace: the second paged call with ``out`` makes no torch
    allocation at all (and the output is the contiguous one)."""
    import torch

    q, k, v, lens, cache = make_inputs("bfloat16", page_size=16, layout="HND", combined=True)
    plan = stochattn.ExactPlan(device="cuda")
    assert exact_mod.workspace_bytes(q, cache) > 0  # several chunks: partials in the workspace
    out = empty_like_out(q)
    assert plan.run(q, cache, out=out) is out
    assert plan.workspace.nbytes() >= exact_mod.workspace_bytes(q, cache)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert plan.run(q, cache, out=out) is out
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert torch.equal(out, exact_decode(q, k, v, lens))


@pytest.mark.parametrize("family", ["exact", "flash"])
@pytest.mark.parametrize("given", ["Workspace", "array"])
def test_cupy_call_with_out_and_workspace_allocates_nothing(family, given):
    q, k, v, lens, cache = make_inputs("float16", page_size=3, layout="NHD", combined=False)
    if family == "exact":
        run, opts = exact_decode, dict(num_chunks=3)
        nbytes = exact_mod.workspace_bytes(q, cache, num_chunks=3)
    else:
        run, opts = santa_flash, dict(budget=64, seed=1, offset=2, num_chunks=3)
        nbytes = flash_mod.workspace_bytes(q, cache, budget=64, num_chunks=3)
    assert nbytes > 0
    ws = Workspace() if given == "Workspace" else cupy.empty(nbytes, dtype=cupy.uint8)
    out = empty_like_out(q)
    assert run(q, cache, out=out, workspace=ws, **opts) is out  # warm-up (counters, plan)
    with CountingAllocator() as counter:
        assert run(q, cache, out=out, workspace=ws, **opts) is out
    assert counter.count == 0
    assert_bitwise(out, run(q, k, v, lens, **opts), "out")


@pytest.mark.parametrize("family", ["exact", "flash"])
def test_bad_workspace_and_out_name_the_argument(family):
    q, _, _, _, cache = make_inputs("float16", page_size=16, layout="NHD")
    if family == "exact":
        def run(**kw):
            return exact_decode(q, cache, num_chunks=3, **kw)
    else:
        def run(**kw):
            return santa_flash(q, cache, budget=64, num_chunks=3, **kw)
    with pytest.raises(ValueError, match="`workspace` must be a 1-D array of at least"):
        run(workspace=cupy.empty(16, dtype=cupy.uint8))
    with pytest.raises(TypeError, match="`workspace` must have dtype uint8"):
        run(workspace=cupy.empty(1 << 20, dtype=cupy.float32))
    with pytest.raises(ValueError, match="`out` must have shape"):
        run(out=cupy.empty((B, HKV * G, 64), dtype=cupy.float16))
    with pytest.raises(TypeError, match="`out` must have dtype float16"):
        run(out=cupy.empty((B, HKV * G, 128), dtype=cupy.float32))


# ---- bad paged input ----------------------------------------------------------------------------

def _host_cache(page_size=16, layout="NHD"):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, HKV, 300, 128)).astype(np.float32)
    return from_contiguous(k, k, np.array([300, 7]), page_size=page_size, layout=layout)


def test_int64_page_table_is_a_type_error_naming_it():
    q = to_device(np.zeros((2, HKV * G, 128)), "float16")
    cache = gpu_paged(_host_cache(), "float16", combined=False, index_dtype=np.int64)
    with pytest.raises(TypeError, match="`kv_indptr` must be int32"):
        exact_decode(q, cache)
    with pytest.raises(TypeError, match="`kv_indptr` must be int32"):
        santa_flash(q, cache, budget=8)


def test_page_size_129_is_refused():
    q = to_device(np.zeros((2, HKV * G, 128)), "float16")
    cache = gpu_paged(_host_cache(page_size=129), "float16", combined=True)
    with pytest.raises(ValueError, match=r"`page_size` must be in \[1, 128\]"):
        exact_decode(q, cache)
    with pytest.raises(ValueError, match=r"`page_size` must be in \[1, 128\]"):
        santa_flash(q, cache, budget=8)


def test_seq_lens_or_v_with_a_paged_cache_is_refused():
    q, k, v, lens, cache = make_inputs("float16")
    with pytest.raises(TypeError, match="pass no `seq_lens`"):
        exact_decode(q, cache, None, lens)
    with pytest.raises(TypeError, match="pass no `v`"):
        santa_flash(q, cache, v, budget=8)
    with pytest.raises(TypeError, match="pass no `seq_lens`"):
        stochattn.ExactPlan(device="cuda").run(q, cache, seq_lens=lens)


# ---- CUDA graphs --------------------------------------------------------------------------------

def test_graph_of_a_paged_exact_call_follows_the_page_table():
    """Captured once with ``out``; between replays the engine writes a new token into the
    pool and bumps ``kv_last_page_len`` (in place): each replay equals the eager call on the
    table as it then is."""
    import torch

    q, k, v, lens, cache = make_inputs("bfloat16", page_size=16, layout="NHD", combined=True)
    plan = stochattn.ExactPlan(device="cuda")
    out = empty_like_out(q)
    warm(lambda: plan.run(q, cache, out=out))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q, cache, out=out)
    b = 3  # 389 tokens: 24 full pages and 5 in the last one
    for step in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plan.run(q, cache)), step
        want_lens = lens.copy()
        want_lens[b] += step
        assert torch.equal(out, exact_decode(q, k, v, want_lens)), step
        # Append token want_lens[b] of sequence b: its K/V go into the contiguous copy and
        # into the last page's next slot; the table grows by one token.
        t = int(want_lens[b])
        page = int(cache.kv_indices[int(cache.kv_indptr[b]) + t // 16])
        new = torch.randn((2, HKV, 128), device="cuda").to(torch.bfloat16)
        k[b, :, t], v[b, :, t] = new[0], new[1]
        pool = cache.k_pages  # the combined pool's K view: (pages, 16, Hkv, D)
        pool[page, t % 16] = new[0]
        cache.v_pages[page, t % 16] = new[1]
        cache.kv_last_page_len[b] += 1


@pytest.mark.parametrize("kernel", flash_mod.KERNELS)
def test_graph_of_a_paged_flash_call_draws_fresh_numbers_per_replay(kernel):
    """Offset on the device, advanced inside the graph: replay i equals the eager call with
    offset o + i, bit for bit, and replays differ."""
    import torch

    q, k, v, lens, cache = make_inputs("bfloat16", page_size=3, layout="HND", combined=False)
    opts = dict(budget=64, seed=9, kernel=kernel)
    want = [santa_flash(q, k, v, lens, offset=o, **opts) for o in (20, 21, 22)]
    assert not torch.equal(want[0], want[1])
    ws, out = Workspace(), empty_like_out(q)
    offset = torch.tensor(20, dtype=torch.int64, device="cuda")

    def step():
        santa_flash(q, cache, offset=offset, out=out, workspace=ws, **opts)
        offset.add_(1)

    warm(lambda: santa_flash(q, cache, offset=0, out=out, workspace=ws, **opts))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    assert int(offset) == 20  # capturing runs nothing
    for i in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[i]), i
    assert int(offset) == 23


# ---- FlashInfer on the same cache ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size, layout, combined",
                         [(1, "NHD", False), (16, "NHD", True), (16, "HND", False),
                          (3, "HND", True)])
def test_exact_paged_matches_flashinfer(dtype, page_size, layout, combined):
    """Our exact paged decode and FlashInfer's BatchDecodeWithPagedKVCacheWrapper read the
    same pages and table; both are within the flash-attention rule of the float64
    reference, and within that of each other. (No empty sequence here: FlashInfer's
    output for one is not specified.)"""
    torch = pytest.importorskip("torch")
    flashinfer = pytest.importorskip("flashinfer")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    lens = np.array([N, 1, 389, 640], dtype=np.int32)
    qn, kn, vn = peaked_inputs(len(lens), HKV, G, N, 128, seed=page_size)
    q, k, v = (torch.as_tensor(a, device="cuda").to(tdt) for a in (qn, kn, vn))
    k32, v32 = (x.float().cpu().numpy() for x in (k, v))
    hostc = from_contiguous(k32, v32, lens, page_size=page_size, layout=layout,
                            shuffle_seed=4, extra_pages=2)
    # Unused pages and slots hold zeros here, not NaN: what FlashInfer's kernels do with
    # slots past a sequence's end is theirs (ours are checked against NaN above).
    pool = np.nan_to_num(np.stack([np.asarray(hostc.k_pages), np.asarray(hostc.v_pages)], 1))
    pool = torch.as_tensor(pool, device="cuda").to(tdt)
    tables = {n: torch.as_tensor(np.asarray(getattr(hostc, n)), device="cuda")
              for n in ("kv_indptr", "kv_indices", "kv_last_page_len")}
    if combined:
        cache = paged_kv(pool, **tables, layout=layout, max_tokens=N)
        fi_cache = pool
    else:
        kp, vp = pool[:, 0].contiguous(), pool[:, 1].contiguous()
        cache = paged_kv(kp, vp, **tables, layout=layout, max_tokens=N)
        fi_cache = (kp, vp)
    scale = 1.0 / math.sqrt(128)
    ours = exact_decode(q, cache)

    fi_ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fi_ws, kv_layout=layout)
    wrapper.plan(tables["kv_indptr"], tables["kv_indices"], tables["kv_last_page_len"],
                 HKV * G, HKV, 128, page_size, pos_encoding_mode="NONE", q_data_type=tdt,
                 kv_data_type=tdt, sm_scale=scale)
    theirs = wrapper.run(q, fi_cache)

    q64, k64, v64 = (x.double().cpu().numpy() for x in (q, k, v))
    ref = ref_exact(q64, k64, v64, lens, scale)
    naive = naive_attention(q64, k64, v64, lens, scale, dtype)
    err_naive = np.abs(naive - ref).max()
    err_ours = np.abs(host(ours) - ref).max()
    err_fi = np.abs(host(theirs) - ref).max()
    assert err_ours <= 2 * err_naive + 1e-5, (err_ours, err_naive)
    assert err_fi <= 2 * err_naive + 1e-5, (err_fi, err_naive)  # the same cache, read alike
    assert np.abs(host(ours) - host(theirs)).max() <= 4 * err_naive + 2e-5
