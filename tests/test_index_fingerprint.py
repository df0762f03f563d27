"""A Double-P index knows the cache it indexes (docs/conventions.md, "An index knows what it
indexes"), and Double-P's p2 above p1 is clamped with a warning (docs/plans.md).

- The build records a fingerprint: per sequence, FINGERPRINT_ROWS positions spread over the
  built prefix (first and last built token included), and the key rows there, exactly.
- With ``check_finite=True`` every decode compares it with the cache it is given: an index
  of other keys of the same shape is a ValueError naming ``index`` and the first (sequence,
  head, token) that differs; the same index after appends, on a paged cache with shuffled
  pages (moved between calls), stacked, or on the same keys in another dtype passes.
- With checks off (the default) the fingerprint is not read: the outputs are those of a
  run with checks on, bit for bit, and check_keys is never called.
- The GPU index's host code (build, rows through a contiguous or paged cache, stack) runs
  here on NumPy arrays under Numba's CUDA simulator and gives the reference's fingerprint;
  tests/gpu/test_index_fingerprint_gpu.py runs it on CuPy and torch.
- The GPU decode's check of the index arrays against the call (stochattn.cuda.doublep,
  host code on array metadata, run here on NumPy arrays standing in for device arrays):
  an array of the wrong shape, dtype, rank or device is an error naming the attribute
  (`index.centroids`, ...) with the expected and the actual shape.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from stochattn import ClusterTopKPlan, DoublePPlan, clear_plan_cache
from stochattn.doublep import (FINGERPRINT_ROWS, DoublePIndex, _compare_fingerprint,
                               _fingerprint_positions, build_doublep_index,
                               cluster_topk_attention, doublep_attention)
from stochattn.paged import from_contiguous

B, HKV, G, N, D = 3, 2, 2, 60, 8
LENS = np.array([N, 0, 37])
INDEX = dict(n_clusters=4, n_sink=2, window=6, iterations=3)
FOREIGN = r"`index` must be built from this cache"


def inputs(seed=0, n=N):
    rng = np.random.default_rng(seed)
    q = 2 * rng.standard_normal((B, HKV * G, D))
    k = rng.standard_normal((B, HKV, n, D))
    v = rng.standard_normal((B, HKV, n, D))
    return q, k, v


def build(k, v, lens=LENS):
    return build_doublep_index(k, v, lens, **INDEX)


# Every decode entry point, as (name, call(q, k, v, lens, index, check_finite)).
CALLS = [
    ("doublep centroid", lambda q, k, v, L, ix, c: doublep_attention(
        q, k, v, L, index=ix, p1=0.9, p2=0.6, check_finite=c)),
    ("doublep sample", lambda q, k, v, L, ix, c: doublep_attention(
        q, k, v, L, index=ix, approx="sample", budget=5, seed=2, check_finite=c)),
    ("cluster top-k", lambda q, k, v, L, ix, c: cluster_topk_attention(
        q, k, v, L, index=ix, k_clusters=2, check_finite=c)),
    ("DoublePPlan.run", lambda q, k, v, L, ix, c: DoublePPlan(p1=0.9, p2=0.6, check_finite=c).run(
        q, k, v, L, index=ix)),
    ("ClusterTopKPlan.diagnose", lambda q, k, v, L, ix, c: ClusterTopKPlan(
        k_clusters=2, check_finite=c).diagnose(q, k, v, L, index=ix)[0]),
]
calls = pytest.mark.parametrize("name, call", CALLS, ids=[c[0] for c in CALLS])


# ---- what is recorded ------------------------------------------------------------------------

def test_positions_span_the_built_prefix():
    lens = np.array([0, 1, 2, 7, 8, 9, 300])
    pos = _fingerprint_positions(lens)
    assert pos.shape == (7, FINGERPRINT_ROWS) and pos.dtype == np.int64
    assert np.all(pos[0] == -1)  # an empty sequence records nothing
    for b, L in enumerate(lens[1:], start=1):
        assert pos[b, 0] == 0 and pos[b, -1] == L - 1  # first and last built token
        assert np.all(np.diff(pos[b]) >= 0) and np.all(pos[b] < L)
    assert len(set(pos[-1].tolist())) == FINGERPRINT_ROWS  # spread, no repeat when L >= S


def test_build_records_exact_key_rows():
    q, k, v = inputs()
    index = build(k.astype(np.float16), v.astype(np.float16))
    pos, keys = index.fingerprint_positions, index.fingerprint_keys
    np.testing.assert_array_equal(pos, _fingerprint_positions(LENS))
    assert keys.shape == (B, HKV, FINGERPRINT_ROWS, D) and keys.dtype == np.float64
    k16 = k.astype(np.float16)
    for b in range(B):
        for s in range(FINGERPRINT_ROWS):
            if pos[b, s] < 0:
                assert np.all(keys[b, :, s] == 0)
            else:
                np.testing.assert_array_equal(keys[b, :, s], k16[b, :, pos[b, s]])


# ---- a foreign index is an error with checks on ------------------------------------------------

@calls
def test_foreign_index_of_the_same_shape_is_an_error(name, call):
    q, k, v = inputs(0)
    _, k2, v2 = inputs(1)
    foreign = build(k2, v2)  # same shapes, lengths and options: only the keys differ
    with pytest.raises(ValueError, match=FOREIGN + r".*at sequence 0, head 0, the key of "
                                        r"token 0 differs from the one recorded at build time "
                                        r"\(32 of 32 recorded key rows differ\)"):
        call(q, k, v, LENS, foreign, True)
    call(q, k, v, LENS, build(k, v), True)  # its own index passes


def test_one_changed_key_is_named_and_unsampled_tokens_are_not_read():
    q, k, v = inputs()
    index = build(k, v)
    last = int(LENS[2]) - 1
    assert last in index.fingerprint_positions[2]
    bad = k.copy()
    bad[2, 1, last, 3] += 1.0
    with pytest.raises(ValueError, match=FOREIGN + rf".*at sequence 2, head 1, the key of token "
                                        rf"{last} differs .*\(1 of 32 recorded key rows differ\)"):
        doublep_attention(q, bad, v, LENS, index=index, check_finite=True)
    with pytest.raises(ValueError, match="sequence 2, head 1, the key of token"):
        index.check_keys(bad)  # the same check, on its own
    # The documented limit: a sample. A token it does not record is not compared.
    unsampled = next(t for t in range(last) if t not in index.fingerprint_positions[2])
    edited = k.copy()
    edited[2, 0, unsampled] += 1.0
    doublep_attention(q, edited, v, LENS, index=index, check_finite=True)


def test_keys_compare_in_the_index_precision():
    """The same keys held exactly in another dtype pass; rounded keys do not."""
    q, k, v = inputs()
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    index16 = build(k16, v16)
    doublep_attention(q, k16.astype(np.float64), v16.astype(np.float64), LENS, index=index16,
                      check_finite=True)
    index64 = build(k, v)
    with pytest.raises(ValueError, match=FOREIGN):
        doublep_attention(q.astype(np.float16), k16, v16, LENS, index=index64, check_finite=True)


def test_shape_part_and_hand_made_index():
    q, k, v = inputs()
    index = build(k, v)
    with pytest.raises(ValueError, match=r"`k` must match the index \(batch, kv_heads, "
                                         r"head_dim\) \(3, 2, 8\), got \(3, 2, 4\)"):
        index.check_keys(k[..., :4])
    with pytest.raises(ValueError, match="`k` must have 4 dimensions"):
        index.check_keys(k[0])
    # A position past the cache's tokens (a cache cut shorter than the index's prefix).
    with pytest.raises(ValueError, match=r"at sequence 0, head 0, token 42 lies past the "
                                         r"cache's 40 tokens"):
        index.check_keys(k[:, :, :40])
    _, k2, v2 = inputs(1)
    foreign = build(k2, v2)
    fields = {n: getattr(foreign, n) for n in ("centroids", "sizes", "value_sums", "labels",
                                               "seq_lens", "window_start", "n_initialized")}
    bare = DoublePIndex(n_sink=foreign.n_sink, window=foreign.window,
                        n_clusters=foreign.n_clusters, **fields)
    assert bare.fingerprint_positions is None and bare.fingerprint_keys is None
    doublep_attention(q, k, v, LENS, index=bare, check_finite=True)  # nothing to compare


# ---- the default path is unchanged and reads nothing --------------------------------------------

@calls
def test_checks_off_read_no_fingerprint(name, call, monkeypatch):
    q, k, v = inputs()
    index = build(k, v)
    want = call(q, k, v, LENS, index, True)

    def never(self, k):
        raise AssertionError("check_keys called with checks off")

    monkeypatch.setattr(DoublePIndex, "check_keys", never)
    np.testing.assert_array_equal(call(q, k, v, LENS, index, False), want)
    _, k2, v2 = inputs(1)
    call(q, k, v, LENS, build(k2, v2), False)  # unchecked: silently used, as documented


# ---- appends, paged caches, stacks --------------------------------------------------------------

def test_same_index_after_appends_passes_one_token_and_bulk():
    q, k, v = inputs(n=N + 12)
    lens0 = np.array([N, 0, 37])
    single, bulk = build(k, v, lens0), build(k, v, lens0)
    pos0, keys0 = single.fingerprint_positions.copy(), single.fingerprint_keys.copy()
    for step in range(1, 13):
        lens = lens0 + step
        single.append(k, v, lens)
        doublep_attention(q, k, v, lens, index=single, check_finite=True)
    bulk.append(k, v, lens0 + 12)
    for ix in (single, bulk):
        np.testing.assert_array_equal(ix.fingerprint_positions, pos0)  # the built prefix's
        np.testing.assert_array_equal(ix.fingerprint_keys, keys0)
        cluster_topk_attention(q, k, v, lens0 + 12, index=ix, k_clusters=2, check_finite=True)
    # A cache that grew from other keys is still caught (its prefix differs).
    _, k2, _ = inputs(1, n=N + 12)
    with pytest.raises(ValueError, match=FOREIGN):
        doublep_attention(q, k2, v, lens0 + 12, index=bulk, check_finite=True)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_cache_with_shuffled_pages_passes(page_size, layout):
    q, k, v = inputs(n=N + 5)
    lens0 = np.array([N, 0, 37])
    index = build(k, v, lens0)
    want = doublep_attention(q, k, v, lens0, index=index, p1=0.9, p2=0.6)
    plan = DoublePPlan(p1=0.9, p2=0.6, check_finite=True)
    for shuffle in (1, 2):  # the pages move between calls: the index keeps positions
        cache = from_contiguous(k, v, lens0, page_size=page_size, layout=layout,
                                shuffle_seed=shuffle + page_size, extra_pages=2)
        np.testing.assert_array_equal(plan.run(q, cache, index=index), want)
        index.check_keys(cache)  # the same check on the PagedKV itself
    built = build_doublep_index(cache, **INDEX)  # a build from the paged cache records the same
    np.testing.assert_array_equal(built.fingerprint_positions, index.fingerprint_positions)
    np.testing.assert_array_equal(built.fingerprint_keys, index.fingerprint_keys)
    grown = from_contiguous(k, v, lens0 + 5, page_size=page_size, layout=layout, shuffle_seed=9)
    index.append(grown)
    ClusterTopKPlan(k_clusters=2, check_finite=True).run(q, grown, index=index)
    _, k2, v2 = inputs(1, n=N + 5)
    foreign = from_contiguous(k2, v2, lens0 + 5, page_size=page_size, layout=layout,
                              shuffle_seed=3)
    with pytest.raises(ValueError, match=FOREIGN + ".*at sequence 0, head 0"):
        plan.run(q, foreign, index=index)


def test_stack_keeps_the_fingerprints():
    q, k, v = inputs()
    _, k2, v2 = inputs(1)
    a, b = build(k, v), build(k2, v2)
    stacked = DoublePIndex.stack([a, b])
    qq, kk, vv = (np.concatenate(x) for x in ((q, q), (k, k2), (v, v2)))
    lens = np.concatenate([LENS, LENS])
    doublep_attention(qq, kk, vv, lens, index=stacked, check_finite=True)
    with pytest.raises(ValueError, match="at sequence 3, head 0, the key of token 0"):
        doublep_attention(qq, np.concatenate([k, k]), vv, lens, index=stacked, check_finite=True)
    bare = DoublePIndex(**{n: getattr(a, n) for n in (
        "centroids", "sizes", "value_sums", "labels", "seq_lens", "window_start",
        "n_initialized", "n_sink", "window", "n_clusters")})
    assert DoublePIndex.stack([a, bare]).fingerprint_positions is None


# ---- the GPU index's host code, on NumPy arrays (Numba's simulator) -----------------------------

@pytest.fixture(scope="module")
def gpu_module():
    pytest.importorskip("numba.cuda")
    from stochattn.cuda import doublep_index

    return doublep_index


def test_gpu_build_records_the_reference_fingerprint(gpu_module):
    _, k, v = inputs()
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    fields = gpu_module.build_index_gpu(k16, v16, LENS, **INDEX)
    ref = build(k16, v16)
    np.testing.assert_array_equal(fields["fingerprint_positions"], ref.fingerprint_positions)
    assert fields["fingerprint_keys"].dtype == np.float32
    np.testing.assert_array_equal(fields["fingerprint_keys"], ref.fingerprint_keys)
    index = DoublePIndex(**fields)
    stacked = gpu_module.stack_gpu([index, index])
    assert stacked["fingerprint_keys"].shape == (2 * B, HKV, FINGERPRINT_ROWS, D)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_rows_through_arrays_and_pages(gpu_module, layout):
    """fingerprint_rows_gpu (the GPU check's gather) on NumPy arrays and a NumPy paged cache:
    the right rows, and the one comparison rule."""
    _, k, v = inputs()
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    index = DoublePIndex(**gpu_module.build_index_gpu(k16, v16, LENS, **INDEX))
    cache = from_contiguous(k16, v16, LENS, page_size=3, layout=layout, shuffle_seed=5,
                            extra_pages=2)
    for cache_k in (k16, cache):
        pos, recorded, rows, available = gpu_module.fingerprint_rows_gpu(index, cache_k)
        np.testing.assert_array_equal(pos, index.fingerprint_positions)
        assert rows.dtype == np.float32 and rows.shape == recorded.shape
        _compare_fingerprint(pos, recorded, rows, available)
    np.testing.assert_array_equal(available, LENS)  # the page table's lengths
    bad = k16.copy()
    bad[2, 1, 36, 0] += 1
    for cache_k in (bad, from_contiguous(bad, v16, LENS, page_size=3, layout=layout,
                                         shuffle_seed=6)):
        with pytest.raises(ValueError, match="at sequence 2, head 1, the key of token 36"):
            _compare_fingerprint(*gpu_module.fingerprint_rows_gpu(index, cache_k))


# ---- p2 > p1 ------------------------------------------------------------------------------------

def test_p2_above_p1_is_clamped_with_a_warning_except_one():
    """p2 in (p1, 1) cannot be reached (stage 2 works inside C_p): the plan clamps it to p1
    and warns, naming `p2` (tests/test_doublep.py's property test draws p1 and p2
    independently and relies on the cap); p2 = 1, "every cluster of C_p exact", is silent."""
    clear_plan_cache()  # the functions' plans are cached: warn at their first call
    with pytest.warns(UserWarning, match=r"`p2` \(0.9\) above p1 \(0.8\) cannot be reached.*"
                                         r"clamped to p1"):
        plan = DoublePPlan(p1=0.8, p2=0.9)
    assert plan.p2 == 0.8 and plan.options()["p2"] == 0.8
    q, k, v = inputs()
    index = build(k, v)
    same = doublep_attention(q, k, v, LENS, index=index, p1=0.8, p2=0.8)
    with pytest.warns(UserWarning, match=r"`p2` \(0.95\) above p1 \(0.8\)"):
        got = doublep_attention(q, k, v, LENS, index=index, p1=0.8, p2=0.95)
    np.testing.assert_array_equal(got, same)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = doublep_attention(q, k, v, LENS, index=index, p1=0.8, p2=1.0)
        DoublePPlan(p1=1.0, p2=0.3)
        DoublePPlan(p1=0.5, p2=0.5, approx="sample", budget=4)
    np.testing.assert_array_equal(one, same)  # p2 = 1: every cluster of C_p exact


# ---- the GPU decode's index-shape check (host code on array metadata) ---------------------------

class _MetaOps:
    """What ``_IndexArrays.check`` reads of a GPU framework's ops, for NumPy arrays standing
    in for arrays on device 0: (dtype, shape, device) and the dtype's name."""

    name = "numpy as device 0"

    @staticmethod
    def meta(a):
        return (a.dtype, a.shape, 0)

    @staticmethod
    def dtype_name(dtype) -> str:
        return str(dtype)


# The GPU index's dtypes (stochattn.cuda.doublep._INDEX_FIELDS).
GPU_DTYPES = dict(centroids=np.float32, sizes=np.int64, value_sums=np.float32, labels=np.int32,
                  seq_lens=np.int64, window_start=np.int64)


def gpu_like(index, **arrays):
    """``index`` with the GPU index's dtypes (NumPy arrays), ``arrays`` replacing fields."""
    fields = {n: getattr(index, n).astype(dt) for n, dt in GPU_DTYPES.items()}
    fields.update(arrays)
    return DoublePIndex(n_sink=index.n_sink, window=index.window, n_clusters=index.n_clusters,
                        n_initialized=index.n_initialized, **fields)


@pytest.fixture
def index_check(monkeypatch):
    """check(index, q, k, device=0): what doublep_decode's plan checks of ``index`` for a call
    with this q and k on ``device`` (returns (clusters, label tokens))."""
    from stochattn._validation import check_attention_inputs
    from stochattn.cuda import doublep as cuda_doublep

    monkeypatch.setattr(cuda_doublep, "ops_for", lambda name, a: _MetaOps)

    def check(index, q, k, device=0):
        return cuda_doublep._IndexArrays(index).check(check_attention_inputs(q, k, k), device)

    return check


def test_gpu_index_shape_errors_name_the_attribute(index_check):
    q, k, v = inputs()
    ref = build(k, v)
    index = gpu_like(ref)
    C = INDEX["n_clusters"]
    assert index_check(index, q, k) == (C, N)
    call = r"batch {}, kv_heads {} and head_dim {} of this call's `q` and `k`"
    # The call's batch, heads or head dim differ from the index's: its centroids are named.
    for qq, kk, got, want in (
            (q[:2], k[:2], (B, HKV, C, D), (2, HKV, C, D)),
            (q[..., :4], k[..., :4], (B, HKV, C, D), (B, HKV, C, 4)),
            (q, k[:, :1], (B, HKV, C, D), (B, 1, C, D))):
        with pytest.raises(ValueError, match=re.escape(
                f"`index.centroids` has shape {got}, expected (batch, kv_heads, clusters, "
                f"head_dim) = {want}: ") + call.format(want[0], want[1], want[3])):
            index_check(index, qq, kk)
    # One array of the index disagrees with the call (or with index.centroids).
    for name, array, got, want in (
            ("sizes", ref.sizes[..., :-1], (B, HKV, C - 1), (B, HKV, C)),
            ("value_sums", ref.value_sums[..., :4], (B, HKV, C, 4), (B, HKV, C, D)),
            ("labels", ref.labels[:2], (2, HKV, N), (B, HKV, N)),
            ("seq_lens", ref.seq_lens[:2], (2,), (B,)),
            ("window_start", np.zeros(B + 1), (B + 1,), (B,))):
        bad = gpu_like(ref, **{name: array.astype(GPU_DTYPES[name])})
        with pytest.raises(ValueError, match=re.escape(f"`index.{name}` has shape {got}, "
                                                       f"expected ") + r"\(.*\) = "
                           + re.escape(f"{want}: ")):
            index_check(bad, q, k)
    with pytest.raises(ValueError, match=re.escape(f", {C} clusters of `index.centroids`")):
        index_check(gpu_like(ref, sizes=ref.sizes[..., :-1]), q, k)
    # Rank, dtype and device are named too.
    with pytest.raises(TypeError, match=r"`index.labels` must be a 3-d int32 array .*got int32 "
                                        r"\(2, 60\)"):
        index_check(gpu_like(ref, labels=ref.labels[0].astype(np.int32)), q, k)
    with pytest.raises(TypeError, match=r"`index.centroids` must be a 4-d float32 array .*got "
                                        r"float64"):
        index_check(gpu_like(ref, centroids=ref.centroids), q, k)
    with pytest.raises(ValueError, match=r"`index.centroids` must be on the GPU of `q` \(1\), "
                                         r"got device 0"):
        index_check(index, q, k, device=1)
