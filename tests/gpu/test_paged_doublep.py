"""Double-P on paged KV caches on the GPU (decode, index append, index build), read in place
through FlashInfer's page table (kernels/kv_rows.cuh), and its serving path (``out=``,
workspaces, CUDA graphs).

- Decode, paged vs contiguous on the same tokens and the same index, with the same N (the
  cache's ``max_tokens``): the same launches, so outputs are equal bit for bit (centroid
  Double-P, top-k clusters, and the sampled variant with the same seed and offset where
  its V gather, santa_prop_sample, reads pages; else a NotImplementedError naming it);
  page sizes 1, 3, 16, 128, NHD and HND, pages in shuffled physical order with unused NaN
  pages and NaN slots past each sequence's end (a read of a wrong page shows), odd
  lengths, a zero-length sequence, combined and separate pools, float16 (CuPy) and
  bfloat16 (torch), the default chunking and a forced one; diagnostics (the true mass
  reads K through the pages) equal too.
- Index build from a paged prefix equals the build from the contiguous prefix (labels
  widened to the cache's token_bound with -1); appends read from pages (which move between
  calls) equal contiguous appends bit for bit, token by token and in bulk.
- ``out=`` and workspaces: a warmed plan (its kept workspace, a Workspace, a uint8 array)
  and a warmed index append allocate nothing; too-small workspaces and bad ``out`` are
  errors naming them.
- Bad paged input: int64 page tables (TypeError naming ``kv_indptr``), page size 129.
- torch CUDA graph: one capture of [index append; decode with ``out=``, device offset
  advanced on the device] replayed while the engine bumps ``kv_last_page_len`` in place
  equals the eager sequence, outputs and index, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn import DoublePIndex  # noqa: E402
from stochattn.cuda import doublep as dp  # noqa: E402
from stochattn.cuda.doublep import doublep_decode  # noqa: E402
from stochattn.cuda.runtime.workspace import Workspace  # noqa: E402
from stochattn.paged import from_contiguous  # noqa: E402

from paged_helpers import CountingAllocator, assert_bitwise, gpu_paged, host, warm  # noqa: E402
from gpu_helpers import peaked_inputs, to_device, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu

B, HKV, G, N, D = 4, 2, 4, 701, 128
LENS = np.array([N, 0, 1, 389], dtype=np.int32)  # full, empty, one token, odd
PAGE_SIZES = (1, 3, 16, 128)
LAYOUTS = ("NHD", "HND")
INDEX = dict(n_clusters=24, n_sink=4, window=32, seed=1)
SAMPLE_PAGED = not dp._sample_pages_missing()
FIELDS = ("centroids", "sizes", "value_sums", "labels", "seq_lens", "window_start",
          "n_initialized")


# ---- helpers ------------------------------------------------------------------------------------

def fields(index):
    return {name: host(getattr(index, name)) for name in FIELDS}


def assert_same_index(a, b, what, labels_upto=None):
    fa, fb = fields(a), fields(b)
    for name in FIELDS:
        x, y = fa[name], fb[name]
        if name == "labels" and labels_upto is not None:
            x, y = x[..., :labels_upto], y[..., :labels_upto]
        assert np.array_equal(x, y), (what, name)


_INPUTS: dict = {}


def contiguous_inputs(dtype, seed=0):
    """``(q, k, v, k32, v32, index)``: GPU q, k, v of ``dtype``, their float32 host values
    (exact) and the index built from the contiguous cache at LENS (cached per dtype)."""
    key = (dtype, seed)
    if key not in _INPUTS:
        q, k, v = peaked_inputs(len(LENS), HKV, G, N, D, seed=seed)
        qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
        k32, v32 = to_host64(kd).astype(np.float32), to_host64(vd).astype(np.float32)
        index = stochattn.build_doublep_index(kd, vd, LENS, **INDEX)
        _INPUTS[key] = (qd, kd, vd, k32, v32, index)
    return _INPUTS[key]


def make_paged(dtype, *, page_size=16, layout="NHD", combined=False, lens=LENS,
               shuffle_seed=1, seed=0):
    """``(q, k, v, index, cache)``: the contiguous inputs and a GPU paged cache holding the
    same tokens at ``lens``."""
    q, k, v, k32, v32, index = contiguous_inputs(dtype, seed)
    hostc = from_contiguous(k32, v32, lens, page_size=page_size, layout=layout,
                            shuffle_seed=shuffle_seed, extra_pages=2)
    return q, k, v, index, gpu_paged(hostc, dtype, combined)


def empty_out(q):
    shape = (int(q.shape[0]), int(q.shape[1]), D)
    if type(q).__module__.split(".")[0] == "torch":
        import torch

        return torch.empty(shape, dtype=q.dtype, device=q.device)
    return cupy.empty(shape, dtype=q.dtype)


MODES = {
    "centroid": dict(p1=0.9, p2=0.6),
    "topk": dict(clusters=5),
    "sample": dict(p1=0.95, p2=0.5, budget=48, seed=7, offset=3),
}

cases = pytest.mark.parametrize(
    "dtype, page_size, layout, combined",
    [(d, p, l, c) for d in ("float16", "bfloat16") for p in PAGE_SIZES for l in LAYOUTS
     for c in (False, True)],
    ids=lambda x: str(x))


# ---- decode: paged vs contiguous, bit for bit ------------------------------------------------------

@cases
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("num_chunks", [None, 3])
def test_decode_paged_equals_contiguous(dtype, page_size, layout, combined, mode, num_chunks):
    q, k, v, index, cache = make_paged(dtype, page_size=page_size, layout=layout,
                                       combined=combined, shuffle_seed=page_size)
    opts = dict(MODES[mode], num_chunks=num_chunks)
    want = doublep_decode(q, k, v, index, **opts)
    if mode == "sample" and not SAMPLE_PAGED:
        with pytest.raises(NotImplementedError, match="santa_prop_sample"):
            doublep_decode(q, cache, None, index, **opts)
        return
    got = doublep_decode(q, cache, None, index, **opts)
    assert_bitwise(got, want, (dtype, page_size, layout, combined, mode))
    assert np.all(host(got)[LENS == 0] == 0)  # the empty sequence: a zero row, no NaN
    if mode == "sample":
        _, J = doublep_decode(q, cache, None, index, return_indices=True, **opts)
        _, Jc = doublep_decode(q, k, v, index, return_indices=True, **opts)
        assert_bitwise(J, Jc, "drawn rows")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["centroid", "topk"])
def test_plans_and_functions_take_the_paged_cache(dtype, mode):
    """The public entry points: a PagedKV in place of k (no v, no seq_lens), diagnostics
    (the true mass reads K through the page table) equal to the contiguous call's."""
    q, k, v, index, cache = make_paged(dtype, page_size=3, layout="HND", combined=True)
    if mode == "centroid":
        plan = stochattn.DoublePPlan(p1=0.9, p2=0.6, device="cuda")
        fn = lambda *a, **kw: stochattn.doublep_attention(*a, p1=0.9, p2=0.6, **kw)  # noqa: E731
    else:
        plan = stochattn.ClusterTopKPlan(k_clusters=5, device="cuda")
        fn = lambda *a, **kw: stochattn.cluster_topk_attention(*a, k_clusters=5, **kw)  # noqa: E731
    want, dwant = plan.diagnose(q, k, v, LENS, index=index)
    got, dgot = plan.diagnose(q, cache, index=index)
    assert_bitwise(got, want, "plan")
    for name in ("k_rows_read", "v_rows_read", "clusters_selected", "clusters_exact",
                 "tokens_exact", "estimated_mass", "true_mass"):
        assert np.array_equal(getattr(dgot, name), getattr(dwant, name)), name
    assert_bitwise(fn(q, cache, index=index), want, "function")
    with pytest.raises(TypeError, match="pass no `seq_lens`"):
        plan.run(q, cache, seq_lens=LENS, index=index)


# ---- the index: build from a paged prefix, append from pages ------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size, layout, combined", [(3, "NHD", False), (16, "HND", True),
                                                         (128, "NHD", True)])
def test_index_build_from_pages_equals_the_contiguous_prefix(dtype, page_size, layout,
                                                              combined):
    """The paged prefix is gathered into a contiguous temporary of max(len) tokens: the
    index equals the one built from k[:, :, :max(len)] bit for bit, with labels widened
    to the cache's token_bound (-1 past the prefix) so that appends never grow them."""
    lens = np.array([400, 0, 1, 389], dtype=np.int32)
    q, k, v, _, cache = make_paged(dtype, page_size=page_size, layout=layout, combined=combined,
                                   lens=lens)
    Ng = int(lens.max())
    got = stochattn.build_doublep_index(cache, **INDEX)
    want = stochattn.build_doublep_index(prefix(k, Ng), prefix(v, Ng), lens, **INDEX)
    assert tuple(got.labels.shape) == (len(lens), HKV, N)
    assert_same_index(got, want, "build", labels_upto=Ng)
    assert np.all(host(got.labels)[..., Ng:] == -1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("method", ["scan", "gemm"])
def test_index_does_not_depend_on_the_cache_capacity(dtype, method):
    """A static cache of capacity N holding max(len) < N tokens gives the index of its
    prefix bit for bit (a serving loop builds on its whole static cache; the paged loop on
    the gathered prefix), on either k-means path."""
    from stochattn.cuda.kmeans import kmeans_gpu

    lens = np.array([400, 0, 1, 389], dtype=np.int32)
    q, k, v, _, _ = make_paged(dtype, page_size=16, layout="NHD", combined=False, lens=lens)
    Ng = int(lens.max())
    opts = dict(INDEX, method=method)
    got = kmeans_gpu(k, v, lens, **opts)
    want = kmeans_gpu(prefix(k, Ng), prefix(v, Ng), lens, **opts)
    for name in ("centroids", "sizes", "value_sums", "labels", "window_start"):
        x, y = host(got[name]), host(want[name])
        if name == "labels":
            x, y = x[..., :Ng], y[..., :Ng]
        assert np.array_equal(x, y), (method, name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size, layout, combined", [(1, "HND", True), (16, "NHD", False),
                                                         (128, "HND", False)])
def test_append_from_pages_equals_contiguous(dtype, page_size, layout, combined):
    """Token by token (the pages move at every step: a new physical order) and in bulk, an
    append that reads the pages gives the contiguous append's index bit for bit; the
    index's length arrays keep their addresses."""
    q, k, v, k32, v32, _ = contiguous_inputs(dtype)
    L0 = np.array([300, 0, 1, 200], dtype=np.int32)
    L1 = np.array([340, 5, 1, 389], dtype=np.int32)
    base = stochattn.build_doublep_index(k, v, L0, **INDEX)
    paged, flat, bulk = (DoublePIndex.stack([base]) for _ in range(3))
    addresses = [int(host_ptr(a)) for a in (paged.seq_lens, paged.window_start)]
    for step in range(1, int((L1 - L0).max()) + 1):
        lens = np.minimum(L0 + step, L1).astype(np.int32)
        hostc = from_contiguous(k32, v32, lens, page_size=page_size, layout=layout,
                                shuffle_seed=step, extra_pages=1)
        paged.append(gpu_paged(hostc, dtype, combined))
        flat.append(k, v, lens)
    assert_same_index(paged, flat, "token by token")
    assert [int(host_ptr(a)) for a in (paged.seq_lens, paged.window_start)] == addresses
    hostc = from_contiguous(k32, v32, L1, page_size=page_size, layout=layout, shuffle_seed=99)
    bulk.append(gpu_paged(hostc, dtype, combined))
    assert_same_index(bulk, flat, "bulk")


def prefix(x, n):
    """The first n tokens of a (B, Hkv, N, D) GPU array, contiguous."""
    if type(x).__module__.split(".")[0] == "torch":
        return x[:, :, :n].contiguous()
    return cupy.ascontiguousarray(x[:, :, :n])


def host_ptr(a):
    return a.data_ptr() if type(a).__module__.split(".")[0] == "torch" else a.data.ptr


# ---- out= and workspaces ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["centroid", "sample"])
def test_torch_plan_and_append_with_out_allocate_nothing_after_a_warm_up(mode):
    """A user's plan keeps its workspace and the index its append scratch: the second decode
    with ``out`` and the second append make no torch (or CuPy) allocation. Paged (the
    sampled variant on the contiguous cache where its V gather reads no pages; the append
    then takes its lengths as a device int32 array, by pointer)."""
    import torch

    q, k, v, index, cache = make_paged("bfloat16", page_size=16, layout="HND", combined=True)
    index = DoublePIndex.stack([index])
    if mode == "sample":
        plan = stochattn.DoublePPlan(approx="sample", budget=32, device="cuda")
        call = dict(seed=1, offset=torch.tensor(4, device="cuda"))
    else:
        plan = stochattn.DoublePPlan(p1=0.9, p2=0.6, device="cuda")
        call = {}
    paged = mode != "sample" or SAMPLE_PAGED
    lens = torch.as_tensor(LENS, device="cuda")

    def decode():
        args = (q, cache) if paged else (q, k, v)
        return plan.run(*args, index=index, out=out, **call)

    def append():
        if paged:
            index.append(cache)
        else:
            index.append(k, v, lens)

    out = empty_out(q)
    assert decode() is out  # warm-up: the plan's workspace
    assert plan.workspace.nbytes() > 0
    append()  # warm-up: the index's append scratch
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    with CountingAllocator() as counter:
        assert decode() is out
        append()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert counter.count == 0
    assert torch.equal(out, plan.run(q, k, v, index=index, **call))


@pytest.mark.parametrize("given", ["Workspace", "array"])
def test_cupy_call_with_out_and_workspace_allocates_nothing(given):
    q, k, v, index, cache = make_paged("float16", page_size=3, layout="NHD")
    opts = dict(p1=0.9, p2=0.6, num_chunks=3)
    nbytes = dp.workspace_bytes(q, cache, None, index, num_chunks=3)
    assert nbytes > 0
    ws = Workspace() if given == "Workspace" else cupy.empty(nbytes, dtype=cupy.uint8)
    out = empty_out(q)
    assert doublep_decode(q, cache, None, index, out=out, workspace=ws, **opts) is out
    with CountingAllocator() as counter:
        assert doublep_decode(q, cache, None, index, out=out, workspace=ws, **opts) is out
    assert counter.count == 0
    assert_bitwise(out, doublep_decode(q, k, v, index, **opts), "out")


def test_bad_workspace_and_out_name_the_argument():
    q, _, _, index, cache = make_paged("float16", page_size=16)
    nbytes = dp.workspace_bytes(q, cache, None, index)

    def run(**kw):
        return doublep_decode(q, cache, None, index, **kw)

    with pytest.raises(ValueError, match="`workspace` must be a 1-D array of at least"):
        run(workspace=cupy.empty(nbytes - 1, dtype=cupy.uint8))
    with pytest.raises(TypeError, match="`workspace` must have dtype uint8"):
        run(workspace=cupy.empty(nbytes, dtype=cupy.float32))
    with pytest.raises(ValueError, match="`out` must have shape"):
        run(out=cupy.empty((B, HKV * G, 64), dtype=cupy.float16))
    with pytest.raises(TypeError, match="`out` must have dtype float16"):
        run(out=cupy.empty((B, HKV * G, D), dtype=cupy.float32))
    with pytest.raises(ValueError, match="`workspace` must be a 1-D array of at least"):
        index.append(cache, workspace=cupy.empty(8, dtype=cupy.uint8))


# ---- bad paged input ----------------------------------------------------------------------------

def _host_cache(page_size=16):
    _, _, _, k32, v32, _ = contiguous_inputs("float16")
    return from_contiguous(k32, v32, LENS, page_size=page_size)


def test_int64_page_table_is_a_type_error_naming_it():
    q, _, _, _, _, index = contiguous_inputs("float16")
    cache = gpu_paged(_host_cache(), "float16", index_dtype=np.int64)
    with pytest.raises(TypeError, match="`kv_indptr` must be int32"):
        doublep_decode(q, cache, None, index)
    with pytest.raises(TypeError, match="`kv_indptr` must be int32"):
        DoublePIndex.stack([index]).append(cache)
    with pytest.raises(TypeError, match="`kv_indptr` must be int32"):
        stochattn.build_doublep_index(cache, **INDEX)


def test_page_size_129_is_refused():
    q, _, _, _, _, index = contiguous_inputs("float16")
    cache = gpu_paged(_host_cache(page_size=129), "float16", combined=True)
    with pytest.raises(ValueError, match=r"`page_size` must be in \[1, 128\]"):
        doublep_decode(q, cache, None, index)
    with pytest.raises(ValueError, match=r"`page_size` must be in \[1, 128\]"):
        DoublePIndex.stack([index]).append(cache)


# ---- a CUDA graph of [append; decode] --------------------------------------------------------------

def test_graph_of_append_and_decode_follows_the_page_table():
    """An engine's decode step on a paged cache, captured once: append the token that left
    the window to the index, then decode into ``out`` (the sampled variant with a device
    offset advanced inside the graph where it reads pages, else centroid Double-P). Between
    replays the engine bumps ``kv_last_page_len`` in place (the token is already in its
    slot). Replay i equals the eager step i, and the index ends equal, bit for bit."""
    import torch

    full = np.array([600, 333, 201, 393], dtype=np.int32)  # 8, 13, 9, 9 in the last page
    steps = 4
    start = full - steps
    q, k, v, k32, v32, _ = contiguous_inputs("bfloat16", seed=3)
    hostc = from_contiguous(k32, v32, full, page_size=16, layout="NHD", shuffle_seed=5)
    base = stochattn.build_doublep_index(k, v, start, **INDEX)
    if SAMPLE_PAGED:
        eager_plan = stochattn.DoublePPlan(approx="sample", budget=32, device="cuda")
        graph_plan = stochattn.DoublePPlan(approx="sample", budget=32, advance_offset=True,
                                           device="cuda")
    else:
        eager_plan = graph_plan = stochattn.DoublePPlan(p1=0.9, p2=0.6, device="cuda")

    def cache_at(lens0):
        c = gpu_paged(hostc, "bfloat16", combined=True)
        c.kv_last_page_len.sub_(torch.as_tensor(full - lens0, device="cuda"))
        return c

    # Eager: step i appends and decodes with offset 40 + i.
    eager_index, eager_cache = DoublePIndex.stack([base]), cache_at(start)
    want = []
    for i in range(steps):
        eager_cache.kv_last_page_len.add_(1)
        eager_index.append(eager_cache)
        call = dict(seed=2, offset=40 + i) if SAMPLE_PAGED else {}
        want.append(eager_plan.run(q, eager_cache, index=eager_index, **call).clone())
    assert not torch.equal(want[0], want[1])

    index, cache = DoublePIndex.stack([base]), cache_at(start)
    out = empty_out(q)
    offset = torch.tensor(40, dtype=torch.int64, device="cuda")

    def step(off):
        index.append(cache)
        call = dict(seed=2, offset=off) if SAMPLE_PAGED else {}
        graph_plan.run(q, cache, index=index, out=out, **call)

    warm(lambda: step(torch.tensor(0, dtype=torch.int64, device="cuda")))  # a no-op append
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(offset)
    for i in range(steps):
        cache.kv_last_page_len.add_(1)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[i]), i
    if SAMPLE_PAGED:
        assert int(offset) == 40 + steps
    assert_same_index(index, eager_index, "graph")
    assert np.array_equal(host(index.seq_lens), full)
