"""Squared value norms beside the cache (stochattn/value_norms.py), host side: against a
direct NumPy computation, for contiguous caches and paged pools (both layouts), and the
append form that an engine calls after writing V. The GPU kernel is checked against the
same in tests/gpu/test_cuda_santa_budgets.py."""

from __future__ import annotations

import numpy as np
import pytest

from stochattn.paged import from_contiguous
from stochattn.reference.budgets import value_sqnorms as ref_value_sqnorms
from stochattn.value_norms import append_value_sqnorms, sqnorms_shape, value_sqnorms


def _direct(v):
    """sum_d v_d^2 row by row in float64, then float32."""
    v = np.asarray(v, dtype=np.float64)
    out = np.zeros(v.shape[:-1])
    for idx in np.ndindex(*v.shape[:-1]):
        out[idx] = float(np.sum(v[idx] * v[idx]))
    return out.astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_contiguous_norms_match_direct(dtype):
    rng = np.random.default_rng(0)
    v = (rng.standard_normal((2, 3, 17, 8)) * 3).astype(dtype)
    got = value_sqnorms(v)
    assert got.dtype == np.float32 and got.shape == (2, 3, 17)
    np.testing.assert_array_equal(got, _direct(v))
    # The reference's float64 norms, rounded once.
    np.testing.assert_array_equal(got, ref_value_sqnorms(v).astype(np.float32))


def test_out_is_written_and_checked():
    v = np.random.default_rng(1).standard_normal((1, 2, 5, 4)).astype(np.float16)
    out = np.full((1, 2, 5), -1.0, dtype=np.float32)
    assert value_sqnorms(v, out=out) is out
    np.testing.assert_array_equal(out, _direct(v))
    with pytest.raises(TypeError, match="`out`"):
        value_sqnorms(v, out=np.zeros((1, 2, 5)))
    with pytest.raises(ValueError, match="`out`"):
        value_sqnorms(v, out=np.zeros((1, 2, 6), dtype=np.float32))
    with pytest.raises(ValueError, match="`v`"):
        value_sqnorms(v[0])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_norms_follow_the_page_table(layout, page_size):
    rng = np.random.default_rng(2)
    B, H, N, D = 3, 2, 37, 8
    k = rng.standard_normal((B, H, N, D)).astype(np.float16)
    v = rng.standard_normal((B, H, N, D)).astype(np.float16)
    lens = np.array([37, 0, 20])
    cache = from_contiguous(k, v, lens, page_size=page_size, layout=layout, shuffle_seed=5)
    sq = value_sqnorms(cache)
    assert sq.shape == sqnorms_shape(cache) == tuple(cache.v_pages.shape[:-1])
    np.testing.assert_array_equal(sq, _direct(cache.v_pages))
    # Through the page table, the norm of token n of (b, h) is the contiguous one.
    want = _direct(v)
    indptr, idx = np.asarray(cache.kv_indptr), np.asarray(cache.kv_indices)
    for b in range(B):
        for n in range(lens[b]):
            page, slot = idx[indptr[b] + n // page_size], n % page_size
            row = sq[page, slot] if layout == "NHD" else sq[page, :, slot]
            np.testing.assert_array_equal(row, want[b, :, n])


def test_append_contiguous_updates_only_the_new_rows():
    rng = np.random.default_rng(3)
    v = rng.standard_normal((2, 3, 10, 8)).astype(np.float32)
    sq = value_sqnorms(v)
    start = np.array([4, 9])
    v[0, :, 4:6] = rng.standard_normal((3, 2, 8))
    v[1, :, 9] = rng.standard_normal((3, 8))
    v[1, :, 0] = 100.0  # written but not announced: stays stale
    stale = sq.copy()
    assert append_value_sqnorms(v, sq, start, count=2) is sq  # token 10 of b = 1 is past N
    want = stale.copy()
    full = _direct(v)
    want[0, :, 4:6] = full[0, :, 4:6]
    want[1, :, 9] = full[1, :, 9]
    np.testing.assert_array_equal(sq, want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_paged_equals_recomputing(layout):
    rng = np.random.default_rng(4)
    B, H, N, D, P = 2, 2, 24, 8, 8
    k = rng.standard_normal((B, H, N, D)).astype(np.float16)
    v = rng.standard_normal((B, H, N, D)).astype(np.float16)
    lens = np.array([24, 13])
    cache = from_contiguous(k, v, lens, page_size=P, layout=layout)
    sq = value_sqnorms(cache)
    pool = cache.v_pages
    # Overwrite the last token of each sequence in the pool, then append its norms.
    indptr, idx = np.asarray(cache.kv_indptr), np.asarray(cache.kv_indices)
    for b in range(B):
        n = lens[b] - 1
        page, slot = idx[indptr[b] + n // P], n % P
        at = (page, slot) if layout == "NHD" else (page, slice(None), slot)
        pool[at] = rng.standard_normal(pool[at].shape).astype(np.float16)
    append_value_sqnorms(cache, sq, lens - 1, count=2)  # the second token has no page: skipped
    np.testing.assert_array_equal(sq, _direct(pool))


def test_append_checks_arguments():
    v = np.zeros((1, 1, 4, 8), dtype=np.float32)
    sq = value_sqnorms(v)
    with pytest.raises(ValueError, match="`count`"):
        append_value_sqnorms(v, sq, 0, count=0)
    with pytest.raises(TypeError, match="`sqnorms`"):
        append_value_sqnorms(v, sq.astype(np.float64), 0)
    with pytest.raises(ValueError, match="`sqnorms`"):
        append_value_sqnorms(v, sq[:, :, :3], 0)


# ---- the GPU launch's host half (no GPU: a fake launcher) --------------------------------


from test_packed_launch import _FakeLauncher  # noqa: E402  (one fake Launcher for the tests)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_gpu_plan_packs_the_kernel_arguments_once(monkeypatch, mode):
    """_NormsPlan binds every argument of value_sqnorms_rows by its declared name and type
    (the one launch description); a call then passes only pointers and the scalar start,
    with the grid of one warp per row."""
    from stochattn import value_norms
    from stochattn.cuda.kernels import abi
    from stochattn.cuda.runtime import launch

    fake = _FakeLauncher()
    monkeypatch.setattr(launch, "launcher", lambda family, name, smem, cfg: fake)
    shape, vs, os_ = (6, 16, 4), (2 * 16 * 4 * 64, 4 * 64, 64), (64, 4, 1)
    rows = 6 * 16 * 4 if mode == 0 else 3 * 4 * 5
    plan = value_norms._NormsPlan(None, 1, 64, rows, mode, shape, vs, os_, int(mode == 1), 5,
                                  16 if mode == 2 else 0, 1, 4)
    threads = abi.constant("santa_prop", "kNormThreads")
    plan.packed(None, 0x1000, 0x2000, 0x3000 if mode else 0, np.int64(-7), 0x4000 * (mode == 2),
                0x5000 * (mode == 2))
    (grid, block, args, stream), = fake.calls
    assert grid == (-(-rows // (threads // 32)), 1, 1) and block == (threads, 1, 1)
    want = abi.kernel("santa_prop", "value_sqnorms_rows").args_of(
        v=0x1000, dtype=1, D=64, rows=rows, mode=mode, s0=6, s1=16, s2=4, vs0=vs[0], vs1=vs[1],
        vs2=vs[2], out=0x2000, os0=64, os1=4, os2=1, start=0x3000 if mode else 0,
        start_int64=int(mode == 1), start0=-7, count=5, kv_indptr=0x4000 * (mode == 2),
        kv_indices=0x5000 * (mode == 2), page_size=16 if mode == 2 else 0, hnd=1, H=4)
    assert len(args) == len(want)
    for got, w in zip(args, want):
        assert int(np.asarray(got, dtype=w.dtype)) == int(w)


def test_gpu_start_argument_needs_no_array_for_an_integer():
    """An integer start (or a 0-d host array) is the kernel's scalar: nothing is allocated
    or copied to the device for it."""
    from stochattn.value_norms import _start_arg

    keep = []
    assert _start_arg(7, 3, None, None, 0, keep) == (0, 0, 7)
    assert _start_arg(np.int64(-2), 3, None, None, 0, keep) == (0, 0, -2)
    assert _start_arg(np.array(5), 3, None, None, 0, keep) == (0, 0, 5)
    assert keep == []
    with pytest.raises(ValueError, match="`start`"):
        _start_arg(2**63, 3, None, None, 0, keep)


def test_gpu_paged_strides_are_checked():
    from stochattn.value_norms import _check_paged_strides

    _check_paged_strides((2**40, 2**28, 64), (64, 4, 1), 4)  # page stride: 64-bit
    with pytest.raises(ValueError, match="`v`"):
        _check_paged_strides((2**40, 2**29, 64), (64, 4, 1), 4)
    with pytest.raises(ValueError, match="`sqnorms`"):
        _check_paged_strides((64, 4, 1), (2**31, 1, 2**29), 2)
