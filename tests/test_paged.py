"""Paged KV caches (stochattn.paged, docs/paged.md): FlashInfer's length rule, contiguous ->
paged -> gather is the identity, gather agrees with a token-by-token reading of the page
table, every validation error is pinned, and every estimator gives on gathered paged input
what it gives on the contiguous cache, bit for bit."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import stochattn
from stochattn import paged as pg
from stochattn.paged import LAYOUTS, PagedKV, contiguous, from_contiguous, gather, paged_kv

from strategies import decode_inputs

PAGE_SIZES = (1, 3, 16, 128)


def _i32(*values):
    return np.array(values, dtype=np.int32)


def _boundary_lens(page_size, n_max):
    """Lengths around page boundaries: 0, 1, ps - 1, ps, ps + 1, 2 ps, capped at n_max."""
    return sorted({min(x, n_max) for x in (0, 1, page_size - 1, page_size, page_size + 1,
                                           2 * page_size) if x >= 0})


def _read_token_by_token(cache: PagedKV, which: str):
    """The definition of docs/paged.md, one token at a time: token t of sequence b is in page
    kv_indices[kv_indptr[b] + t // page_size], slot t % page_size. Returns a list of
    (Hkv, len_b, D) arrays."""
    pages = np.asarray(cache.k_pages if which == "k" else cache.v_pages)
    ps, out = cache.page_size, []
    for b in range(cache.batch):
        n = int(cache.kv_indptr[b + 1] - cache.kv_indptr[b])
        length = 0 if n == 0 else (n - 1) * ps + int(cache.kv_last_page_len[b])
        rows = []
        for t in range(length):
            p = int(cache.kv_indices[int(cache.kv_indptr[b]) + t // ps])
            rows.append(pages[p, t % ps] if cache.layout == "NHD" else pages[p, :, t % ps])
        out.append(np.stack(rows, axis=1) if rows else
                   np.zeros((cache.kv_heads, 0, cache.head_dim), pages.dtype))
    return out


# ---- FlashInfer's convention ------------------------------------------------------------------

def test_lengths_follow_flashinfers_rule():
    """The page table of FlashInfer's BatchDecodeWithPagedKVCacheWrapper example (page size
    16): length = (pages - 1) * 16 + kv_last_page_len; a sequence with no pages has length 0
    (paged_kv_t::get_length), which needs kv_last_page_len 0 to agree with get_seq_lens."""
    indptr = _i32(0, 17, 29, 44, 48, 66, 100, 128, 128)
    last = _i32(1, 7, 14, 4, 3, 1, 16, 0)
    cache = paged_kv(np.zeros((128, 2, 16, 1, 4), np.float16), kv_indptr=indptr,
                     kv_indices=np.arange(128, dtype=np.int32), kv_last_page_len=last)
    want = [16 * 16 + 1, 11 * 16 + 7, 14 * 16 + 14, 3 * 16 + 4, 17 * 16 + 3, 33 * 16 + 1,
            27 * 16 + 16, 0]
    assert cache.seq_lens.dtype == np.int64 and cache.seq_lens.tolist() == want
    assert cache.max_len == max(want)
    assert (cache.batch, cache.num_pages, cache.page_size, cache.kv_heads, cache.head_dim) == \
        (8, 128, 16, 1, 4)
    assert cache.dtype == np.float16 and cache.device == "cpu"


def test_combined_cache_is_split_into_views_without_a_copy():
    pool = np.zeros((3, 2, 1, 4, 2))  # HND: (pages, 2, heads, page_size, dim)
    cache = paged_kv(pool, kv_indptr=_i32(0, 2), kv_indices=_i32(2, 0),
                     kv_last_page_len=_i32(4), layout="HND")
    assert np.shares_memory(cache.k_pages, pool) and np.shares_memory(cache.v_pages, pool)
    pool[:, 1] = 7.0
    assert (cache.v_pages == 7).all() and (cache.k_pages == 0).all()
    assert (cache.page_size, cache.kv_heads, cache.seq_lens.tolist()) == (4, 1, [8])


def test_repr_gives_the_sizes():
    cache = from_contiguous(np.zeros((2, 3, 5, 4)), np.zeros((2, 3, 5, 4)), _i32(5, 2),
                            page_size=2, extra_pages=1)
    assert repr(cache) == ("PagedKV(batch=2, num_pages=5, page_size=2, kv_heads=3, head_dim=4, "
                           "dtype=float64, layout='NHD', nnz_pages=4, device='cpu')")


def test_docstring_example_runs():
    result = doctest.testmod(pg)
    assert result.attempted > 0 and result.failed == 0


# ---- round trips --------------------------------------------------------------------------------

def _check_round_trip(k, v, lens, cache, tokens=None):
    K, V, L = gather(cache, tokens=tokens)
    M = int(lens.max())
    N = max(M, 1) if tokens is None else tokens
    assert K.shape == V.shape == (k.shape[0], k.shape[1], N, k.shape[3])
    assert K.dtype == V.dtype == k.dtype and L.dtype == np.int64
    assert np.array_equal(L, lens)
    assert K.flags.c_contiguous and V.flags.c_contiguous
    valid = (np.arange(N)[None, :] < lens[:, None])[:, None, :, None]
    for got, want in ((K, k), (V, v)):
        padded = np.zeros_like(got)
        padded[:, :, :min(N, want.shape[2])] = want[:, :, :N]
        assert np.array_equal(np.where(valid, got, 0), np.where(valid, padded, 0))
        assert not np.any(np.where(valid, 0, got))  # zero past each length (no NaN read)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_round_trip_at_page_boundaries(layout, combined, page_size):
    lens = np.array(_boundary_lens(page_size, 2 * page_size + 1), dtype=np.int64)
    rng = np.random.default_rng(page_size)
    B, N = lens.size, int(lens.max())
    k = rng.standard_normal((B, 2, N, 8)).astype(np.float32)
    v = rng.standard_normal((B, 2, N, 8)).astype(np.float32)
    for seed, extra in ((None, 0), (page_size, 3)):
        cache = from_contiguous(k, v, lens, page_size=page_size, layout=layout,
                                shuffle_seed=seed, extra_pages=extra, combined=combined)
        assert cache.layout == layout and cache.page_size == page_size
        _check_round_trip(k, v, lens, cache)
        _check_round_trip(k, v, lens, cache, tokens=N + 5)


@given(st.data())
def test_round_trip_property(data):
    """For any cache, page size, layout, K/V form, physical page order and spare pages:
    gather(from_contiguous(k, v, lens)) holds k and v up to each length and zeros after."""
    B = data.draw(st.integers(1, 4), label="B")
    page_size = data.draw(st.one_of(st.sampled_from(PAGE_SIZES), st.integers(1, 40)),
                          label="page_size")
    N = data.draw(st.integers(1, 3 * page_size + 2), label="N")
    length = st.one_of(st.integers(0, N),
                       st.sampled_from(_boundary_lens(page_size, N)), st.just(N))
    lens = np.array(data.draw(st.lists(length, min_size=B, max_size=B), label="lens"),
                    dtype=np.int64)
    H, D = data.draw(st.integers(1, 3), label="H"), data.draw(st.sampled_from([1, 4]), label="D")
    dtype = data.draw(st.sampled_from([np.float16, np.float32, np.float64]), label="dtype")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="data seed"))
    k = rng.standard_normal((B, H, N, D)).astype(dtype)
    v = rng.standard_normal((B, H, N, D)).astype(dtype)
    cache = from_contiguous(
        k, v, lens, page_size=page_size, layout=data.draw(st.sampled_from(LAYOUTS), label="layout"),
        shuffle_seed=data.draw(st.none() | st.integers(0, 2**32 - 1), label="shuffle_seed"),
        extra_pages=data.draw(st.integers(0, 3), label="extra_pages"),
        combined=data.draw(st.booleans(), label="combined"))
    _check_round_trip(k, v, lens, cache)


@given(st.data())
def test_gather_reads_what_the_page_table_says(data):
    """A page table drawn directly (pages shared between sequences, in any order, spare
    pages): gather equals the token-by-token reading of docs/paged.md."""
    page_size = data.draw(st.integers(1, 6), label="page_size")
    num_pages = data.draw(st.integers(1, 8), label="num_pages")
    B = data.draw(st.integers(1, 4), label="B")
    counts = data.draw(st.lists(st.integers(0, 4), min_size=B, max_size=B), label="pages")
    indices = data.draw(st.lists(st.integers(0, num_pages - 1), min_size=sum(counts),
                                 max_size=sum(counts)), label="kv_indices")
    last = [data.draw(st.integers(1, page_size)) if c else 0 for c in counts]
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="data seed"))
    shape = (num_pages, page_size, 2, 3) if layout == "NHD" else (num_pages, 2, page_size, 3)
    cache = paged_kv(rng.standard_normal(shape), rng.standard_normal(shape),
                     kv_indptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                     kv_indices=np.array(indices, dtype=np.int32),
                     kv_last_page_len=np.array(last, dtype=np.int32), layout=layout)
    K, V, lens = gather(cache)
    for which, got in (("k", K), ("v", V)):
        for b, want in enumerate(_read_token_by_token(cache, which)):
            assert lens[b] == want.shape[1]
            assert np.array_equal(got[b, :, :lens[b]], want)
            assert not got[b, :, lens[b]:].any()


def test_from_contiguous_fills_unused_pages_and_slots_with_nan():
    k = np.ones((2, 1, 5, 2), np.float32)
    cache = from_contiguous(k, k, _i32(5, 0), page_size=4, shuffle_seed=0, extra_pages=2)
    assert cache.kv_indptr.tolist() == [0, 2, 2] and cache.kv_last_page_len.tolist() == [1, 0]
    assert all(a.dtype == np.int32 for a in (cache.kv_indptr, cache.kv_indices,
                                             cache.kv_last_page_len))
    used = set(cache.kv_indices.tolist())
    assert len(used) == 2 and used <= set(range(4))
    for p in set(range(4)) - used:
        assert np.isnan(cache.k_pages[p]).all() and np.isnan(cache.v_pages[p]).all()
    last_page = cache.kv_indices[1]
    assert not np.isnan(cache.k_pages[last_page, :1]).any()
    assert np.isnan(cache.k_pages[last_page, 1:]).all()


def test_empty_batch_gathers_one_zero_column():
    cache = paged_kv(np.full((2, 4, 1, 3), np.nan), np.full((2, 4, 1, 3), np.nan),
                     kv_indptr=_i32(0, 0, 0), kv_indices=_i32(), kv_last_page_len=_i32(0, 0))
    k, v, lens = gather(cache)
    assert cache.max_len == 0 and lens.tolist() == [0, 0]
    assert k.shape == (2, 1, 1, 3) and not k.any() and not v.any()
    q = np.ones((2, 2, 3))
    assert not stochattn.exact_attention(q, k, v, lens).any()


# ---- validation ---------------------------------------------------------------------------------

def _table(**change):
    """A valid NHD cache (4 pages of 4 tokens, 2 heads, D=3; two sequences of 6 and 0
    tokens), with ``change`` applied."""
    args = dict(k_pages=np.zeros((4, 4, 2, 3)), v_pages=np.zeros((4, 4, 2, 3)),
                kv_indptr=_i32(0, 2, 2), kv_indices=_i32(3, 1), kv_last_page_len=_i32(2, 0),
                layout="NHD")
    args.update(change)
    return args


def _make(**change):
    args = _table(**change)
    return paged_kv(args.pop("k_pages"), args.pop("v_pages"), **args)


VALUE_ERRORS = [
    (dict(layout="NDH"), r"`layout` must be one of 'NHD', 'HND', got 'NDH'"),
    (dict(k_pages=np.zeros((4, 4, 2))),
     r"`k_pages` must have 4 dimensions \(num_pages, page_size, kv_heads, head_dim\) \(layout "
     r"'NHD'\), got shape \(4, 4, 2\)"),
    (dict(layout="HND", k_pages=np.zeros((4, 2, 4, 3, 1)), v_pages=np.zeros((4, 2, 4, 3, 1))),
     r"`k_pages` must have 4 dimensions \(num_pages, kv_heads, page_size, head_dim\) \(layout "
     r"'HND'\), got shape \(4, 2, 4, 3, 1\)"),
    (dict(v_pages=np.zeros((4, 4, 2, 5))),
     r"`v_pages` must have the shape of `k_pages` \(4, 4, 2, 3\), got \(4, 4, 2, 5\)"),
    (dict(k_pages=np.zeros((4, 0, 2, 3)), v_pages=np.zeros((4, 0, 2, 3))),
     r"`k_pages` must have non-zero page_size \(num_pages, page_size, kv_heads, head_dim\), "
     r"got shape \(4, 0, 2, 3\)"),
    (dict(kv_indptr=np.zeros((3, 1), np.int32)),
     r"`kv_indptr` must have 1 dimension, got shape \(3, 1\)"),
    (dict(kv_indices=np.zeros((2, 1), np.int32)),
     r"`kv_indices` must have 1 dimension, got shape \(2, 1\)"),
    (dict(kv_indptr=_i32(0), kv_last_page_len=_i32()),
     r"`kv_indptr` must have shape \(batch \+ 1,\) with batch >= 1, got shape \(1,\)"),
    (dict(kv_last_page_len=_i32(2, 0, 0)),
     r"`kv_last_page_len` must have shape \(2,\) \(batch, from `kv_indptr`\), got \(3,\)"),
    (dict(kv_indptr=_i32(1, 2, 2)), r"`kv_indptr` must start at 0, got 1"),
    (dict(kv_indptr=_i32(0, 2, 1, 2), kv_last_page_len=_i32(2, 0, 1)),
     r"`kv_indptr` must be non-decreasing, got 1 after 2 at position 2"),
    (dict(kv_indptr=_i32(0, 2, 3), kv_last_page_len=_i32(2, 1)),
     r"`kv_indptr` must end at 2 \(the length of `kv_indices`\), got 3"),
    (dict(kv_indices=_i32(3, 4)),
     r"`kv_indices` values must lie in \[0, 4\) \(the pages of `k_pages`\), got 4 at position 1"),
    (dict(kv_indices=_i32(-1, 0)),
     r"`kv_indices` values must lie in \[0, 4\) \(the pages of `k_pages`\), got -1 at position 0"),
    (dict(kv_last_page_len=_i32(0, 0)),
     r"`kv_last_page_len` must lie in \[1, 4\] \(page_size\) for a sequence with pages, got 0 "
     r"for sequence 0"),
    (dict(kv_last_page_len=_i32(5, 0)),
     r"`kv_last_page_len` must lie in \[1, 4\] \(page_size\) for a sequence with pages, got 5 "
     r"for sequence 0"),
    (dict(kv_last_page_len=_i32(2, 1)),
     r"`kv_last_page_len` must be 0 for a sequence with no pages, got 1 for sequence 1"),
]


@pytest.mark.parametrize("change, match", VALUE_ERRORS)
def test_value_errors_are_pinned(change, match):
    with pytest.raises(ValueError, match=match):
        _make(**change)


TYPE_ERRORS = [
    (dict(k_pages=[[0.0]]), r"`k_pages` must be an array, got list"),
    (dict(kv_indices=[3, 1]), r"`kv_indices` must be an array, got list"),
    (dict(k_pages=np.zeros((4, 4, 2, 3), np.int64), v_pages=np.zeros((4, 4, 2, 3), np.int64)),
     r"`k_pages` dtype must be one of float16, bfloat16, float32, float64, got int64"),
    (dict(v_pages=np.zeros((4, 4, 2, 3), np.float32)),
     r"`k_pages` and `v_pages` must share one dtype, got float64 and float32"),
    (dict(kv_indptr=np.array([0.0, 2.0, 2.0])),
     r"`kv_indptr` must have an integer dtype, got float64"),
    (dict(kv_last_page_len=np.array([True, False])),
     r"`kv_last_page_len` must have an integer dtype, got bool"),
]


@pytest.mark.parametrize("change, match", TYPE_ERRORS)
def test_type_errors_are_pinned(change, match):
    with pytest.raises(TypeError, match=match):
        _make(**change)


def test_combined_form_errors_are_pinned():
    t = _table()
    table = dict(kv_indptr=t["kv_indptr"], kv_indices=t["kv_indices"],
                 kv_last_page_len=t["kv_last_page_len"])
    with pytest.raises(ValueError, match=r"`k_pages` without `v_pages` must be the combined cache "
                       r"\(num_pages, 2, page_size, kv_heads, head_dim\) with 2 on axis 1 \(layout "
                       r"'NHD'\), got shape \(4, 4, 2, 3\) \(pass `v_pages` too"):
        paged_kv(np.zeros((4, 4, 2, 3)), **table)
    with pytest.raises(ValueError, match=r"\(num_pages, 2, kv_heads, page_size, head_dim\) with 2 "
                       r"on axis 1 \(layout 'HND'\), got shape \(4, 3, 2, 4, 3\)$"):
        paged_kv(np.zeros((4, 3, 2, 4, 3)), layout="HND", **table)
    with pytest.raises(TypeError, match=r"`k_pages` must be an array, got NoneType"):
        paged_kv(None, **table)
    with pytest.raises(TypeError, match=r"`check_values` must be a bool, got int"):
        paged_kv(np.zeros((4, 2, 4, 2, 3)), check_values=1, **table)


def test_gather_and_from_contiguous_errors_are_pinned():
    cache = _make()
    with pytest.raises(TypeError, match=r"`paged` must be a PagedKV \(see `paged_kv`\), got tuple"):
        gather((cache.k_pages, cache.v_pages))
    with pytest.raises(ValueError, match=r"`tokens` must be >= 6 \(the longest sequence\), got 5"):
        gather(cache, tokens=5)
    with pytest.raises(ValueError, match=r"`tokens` must be >= 1, got 0"):
        gather(cache, tokens=0)
    k = np.zeros((2, 1, 5, 2))
    with pytest.raises(ValueError, match=r"`page_size` must be >= 1, got 0"):
        from_contiguous(k, k, page_size=0)
    with pytest.raises(TypeError, match=r"`page_size` must be an integer, got float"):
        from_contiguous(k, k, page_size=2.0)
    with pytest.raises(ValueError, match=r"`extra_pages` must be >= 0, got -1"):
        from_contiguous(k, k, page_size=2, extra_pages=-1)
    with pytest.raises(ValueError, match=r"`layout` must be one of 'NHD', 'HND', got 'nhd'"):
        from_contiguous(k, k, page_size=2, layout="nhd")
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 5\]"):
        from_contiguous(k, k, _i32(6, 1), page_size=2)
    with pytest.raises(ValueError, match=r"`shuffle_seed` must be >= 0, got -3"):
        from_contiguous(k, k, page_size=2, shuffle_seed=-3)


# ---- GPU arrays: attributes only, no values read -----------------------------------------------

class _DeviceArray:
    """Stands for a GPU array: shape, dtype and a CUDA DLPack device; any read of the values
    fails, so a test passes only if nothing reads them."""

    def __init__(self, shape, dtype):
        self.shape, self.ndim = tuple(shape), len(shape)
        self.dtype = dtype if dtype == "bfloat16" else np.dtype(dtype)  # NumPy has no bfloat16

    def __dlpack_device__(self):
        return (2, 0)

    def __getitem__(self, item):
        raise AssertionError("a value of a GPU array was read")

    __array__ = __getitem__


def test_gpu_arrays_are_checked_by_attributes_only():
    g = _DeviceArray
    pages = g((4, 4, 2, 3), np.float16)
    cache = paged_kv(pages, pages, kv_indptr=g((3,), np.int32), kv_indices=g((2,), np.int32),
                     kv_last_page_len=g((2,), np.int32))
    assert cache.device == "cuda" and cache.k_pages is pages
    assert (cache.batch, cache.page_size, cache.kv_heads, cache.head_dim) == (2, 4, 2, 3)
    with pytest.raises(TypeError, match=r"`gather` builds the reference's contiguous cache from "
                       r"NumPy pages, got GPU arrays"):
        gather(cache)
    with pytest.raises(ValueError, match=r"`kv_last_page_len` must have shape \(2,\)"):
        paged_kv(pages, pages, kv_indptr=g((3,), np.int32), kv_indices=g((2,), np.int32),
                 kv_last_page_len=g((3,), np.int32))
    with pytest.raises(NotImplementedError, match=r"paged caches on the GPU: the kernels read "
                       r"contiguous caches for now"):
        contiguous(cache)
    with pytest.raises(TypeError, match=r"`kv_indptr` must have an integer dtype, got bfloat16"):
        paged_kv(pages, pages, kv_indptr=g((3,), "bfloat16"),
                 kv_indices=g((2,), np.int32), kv_last_page_len=g((2,), np.int32))
    with pytest.raises(TypeError, match=r"all arrays must live on one device, got .*`kv_indptr` "
                       r"on host \(NumPy\)"):
        paged_kv(pages, pages, kv_indptr=_i32(0, 2, 2),
                 kv_indices=g((2,), np.int32), kv_last_page_len=g((2,), np.int32))


def test_contiguous_passes_arrays_through_and_gathers_paged_caches():
    k = np.arange(24.0).reshape(1, 2, 3, 4)
    assert contiguous(k, k, None) == (k, k, None)
    cache = from_contiguous(k, 2 * k, _i32(2), page_size=2)
    K, V, L = contiguous(cache)
    assert np.array_equal(K, k[:, :, :2]) and np.array_equal(V, 2 * k[:, :, :2])
    assert L.tolist() == [2]
    with pytest.raises(TypeError, match=r"with a paged cache \(`k` a PagedKV\) pass no `v` and no "
                       r"`seq_lens`: the page table holds"):
        contiguous(cache, k, _i32(2))
    with pytest.raises(TypeError, match=r"pass no `seq_lens`: "):
        contiguous(cache, None, _i32(2))


# ---- estimators on gathered paged input ----------------------------------------------------------

def _estimators(index_of):
    """(name, call(q, k, v, lens) -> (output, diagnostics or None)) of every estimator;
    ``index_of(k, v, lens)`` builds the Double-P index of the cache it is called with."""
    s = stochattn
    return [
        ("exact", lambda q, k, v, L: s.exact_attention(q, k, v, L, return_diagnostics=True)),
        ("santa prop", lambda q, k, v, L: s.santa_attention(
            q, k, v, L, budget=16, seed=3, offset=1, return_diagnostics=True)),
        ("santa prop stratified", lambda q, k, v, L: s.santa_attention(
            q, k, v, L, budget=16, sampler="stratified", tile_size=8, seed=3, offset=1,
            return_diagnostics=True)),
        ("santa flash", lambda q, k, v, L: s.santa_attention(
            q, k, v, L, budget=16, schedule="flash", sampler="iid", tile_size=8, seed=5,
            return_diagnostics=True)),
        ("santa global", lambda q, k, v, L: s.santa_attention(
            q, k, v, L, budget=16, schedule="global", seed=2, return_diagnostics=True)),
        ("santa bernoulli", lambda q, k, v, L: s.santa_attention(
            q, k, v, L, budget=8, scores="bernoulli", bernoulli_draws=2, seed=4,
            return_diagnostics=True)),
        ("bernoulli scores", lambda q, k, v, L: s.bernoulli_scores(
            q, k, L, bernoulli_draws=3, seed=9, offset=2, return_diagnostics=True)),
        ("top-p", lambda q, k, v, L: s.top_p_attention(q, k, v, L, p=0.9,
                                                       return_diagnostics=True)),
        ("top-k", lambda q, k, v, L: s.topk_attention(q, k, v, L, k_tokens=5,
                                                      return_diagnostics=True)),
        ("quest", lambda q, k, v, L: s.quest_attention(q, k, v, L, k_tokens=8, page_size=4,
                                                       return_diagnostics=True)),
        ("double-p", lambda q, k, v, L: s.doublep_attention(
            q, k, v, L, index=index_of(k, v, L), p1=0.9, p2=0.5, return_diagnostics=True)),
        ("double-p sample", lambda q, k, v, L: s.doublep_attention(
            q, k, v, L, index=index_of(k, v, L), approx="sample", budget=6, seed=1,
            return_diagnostics=True)),
    ]


def _index(k, v, lens):
    return stochattn.build_doublep_index(k, v, lens, n_clusters=min(3, k.shape[2]), n_sink=1,
                                         window=4)


def _same(name, got, want):
    (out, diag), (want_out, want_diag) = got, want
    assert out.dtype == want_out.dtype and out.shape == want_out.shape, name
    assert np.array_equal(out, want_out), name
    for field in ("seq_lens", "k_rows_read", "v_rows_read", "true_mass"):
        a, b = getattr(diag, field), getattr(want_diag, field)
        assert (a is None and b is None) or np.array_equal(a, b, equal_nan=True), (name, field)


@given(inputs=decode_inputs(max_batch=3, max_tokens=60, head_dims=(4, 8)),
       page_size=st.sampled_from(PAGE_SIZES), layout=st.sampled_from(LAYOUTS),
       combined=st.booleans(), shuffle_seed=st.none() | st.integers(0, 2**32 - 1),
       extra_pages=st.integers(0, 2), data=st.data())
def test_estimators_on_gathered_pages_equal_the_contiguous_cache_bit_for_bit(
        inputs, page_size, layout, combined, shuffle_seed, extra_pages, data):
    """Two cases: the contiguous cache cut to the longest sequence (what gather returns by
    default), and the whole contiguous cache, with whatever it holds past each length,
    against gather(..., tokens=N). Lengths may be 0 and may sit on page boundaries."""
    q, k, v, lens = inputs
    B, _, N, _ = k.shape
    if lens is None:
        lens = np.full(B, N, dtype=np.int64)
    length = st.one_of(st.integers(0, N), st.sampled_from(_boundary_lens(page_size, N)))
    lens = np.array([data.draw(length) for _ in range(B)], dtype=np.int64)
    cache = from_contiguous(k, v, lens, page_size=page_size, layout=layout,
                            shuffle_seed=shuffle_seed, extra_pages=extra_pages, combined=combined)
    M = max(int(lens.max()), 1)
    cut = (q, np.ascontiguousarray(k[:, :, :M]), np.ascontiguousarray(v[:, :, :M]), lens)
    for (name, call), (_, call2) in zip(_estimators(_index), _estimators(_index)):
        _same(name, call(q, *gather(cache)), call(*cut))
        _same(name, call2(q, *gather(cache, tokens=N)), call2(q, k, v, lens))
