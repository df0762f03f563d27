"""Selection baselines: oracle top-k, Quest, oracle token top-p.

Everything here is an exact property (no statistics): selection rules are checked on the
reference masks with adversarial scores (ties, zeros, underflow), the public functions
against a direct float64 computation written in this file, and Quest's bound in exact
arithmetic (small dyadic integers, where every float64 product and sum is exact).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stochattn.baselines import quest_attention, top_p_attention, topk_attention
from stochattn.exact import exact_attention
from stochattn.reference.baselines import quest_page_bounds, top_p_mask, topk_mask
from stochattn.reference.common import logits, masked_weights

from strategies import decode_inputs

BASELINES = {
    "topk_attention": (topk_attention, {"k_tokens": 8}),
    "quest_attention": (quest_attention, {"budget": 8, "page_size": 4}),
    "top_p_attention": (top_p_attention, {"p": 0.9}),
}


# ----------------------------------------------------------------------------- helpers


def _lens(seq_lens, q, k):
    return [int(k.shape[2]) if seq_lens is None else int(seq_lens[b]) for b in range(q.shape[0])]


def direct_logits(q, k, seq_lens, scale):
    """x[b][h] = scale * q[b, h] . k[b, h // G, j] for the valid tokens, float64, by loops."""
    B, Hq, _ = q.shape
    G = Hq // k.shape[1]
    lens = _lens(seq_lens, q, k)
    out = {}
    for b in range(B):
        for h in range(Hq):
            qh = q[b, h].astype(np.float64)
            kh = k[b, h // G, : lens[b]].astype(np.float64)
            out[b, h] = np.array([scale * float(np.dot(qh, kh[j])) for j in range(lens[b])])
    return out


def direct_subset_attention(x, v_rows, selected):
    """Softmax over the selected indices of x, renormalised, applied to v_rows (float64)."""
    if len(selected) == 0:
        return np.zeros(v_rows.shape[1])
    xs = x[selected]
    w = np.exp(xs - xs.max())
    return (w[:, None] * v_rows[selected].astype(np.float64)).sum(axis=0) / w.sum()


def assert_union_counts(diag_rows, selections, B, Hq, Hkv):
    """diag_rows (B, Hkv) == number of tokens selected by any head of the group."""
    G = Hq // Hkv
    for b in range(B):
        for g in range(Hkv):
            union = set()
            for h in range(g * G, (g + 1) * G):
                union |= set(int(j) for j in selections[b, h])
            assert diag_rows[b, g] == len(union)


# --------------------------------------------------------- selection rules (reference)


@st.composite
def scores_with_ties(draw, max_rows=3, max_tokens=40):
    """Rows of scores on a coarse grid (many ties), and per-row lengths (B, 1, N)."""
    B = draw(st.integers(1, max_rows))
    N = draw(st.integers(1, max_tokens))
    values = st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0, 3.0, -1.0, 5e-324, 1e-300])
    x = np.array([[draw(st.lists(values, min_size=N, max_size=N))] for _ in range(B)])
    lens = np.array([draw(st.integers(0, N)) for _ in range(B)], dtype=np.int64)
    return x, lens


@settings(max_examples=300)
@given(scores_with_ties(), st.integers(1, 45))
def test_topk_mask_keeps_the_k_largest_ties_to_lower_position(data, k_tokens):
    """min(k, L) tokens; every kept score >= every dropped one; equal scores: lower index kept."""
    x, lens = data
    N = x.shape[-1]
    x = np.where(np.arange(N)[None, None, :] < lens[:, None, None], x, -np.inf)
    mask = topk_mask(x, lens, k_tokens)
    for b in range(x.shape[0]):
        L = int(lens[b])
        kept, dropped = np.flatnonzero(mask[b, 0]), np.flatnonzero(~mask[b, 0][:L])
        assert kept.size == min(k_tokens, L) and (kept < L).all()
        if kept.size and dropped.size:
            lo = x[b, 0, kept].min()
            assert lo >= x[b, 0, dropped].max()
            ties_dropped = dropped[x[b, 0, dropped] == lo]
            ties_kept = kept[x[b, 0, kept] == lo]
            assert ties_dropped.size == 0 or ties_kept.max() < ties_dropped.min()


@settings(max_examples=300)
@given(scores_with_ties(), st.one_of(st.floats(1e-6, 1.0), st.sampled_from([1.0, 0.5, 0.25])))
def test_top_p_mask_is_the_shortest_prefix_reaching_p(data, p):
    """Kept tokens are a prefix of the descending order (ties: lower index), and with
    c = cumsum(weights sorted descending): c[n-1] >= p c[-1] and c[n-2] < p c[-1] (exact).
    p == 1 keeps every valid token, also those of zero weight."""
    w, lens = data
    w = np.abs(w)
    N = w.shape[-1]
    w = np.where(np.arange(N)[None, None, :] < lens[:, None, None], w, 0.0)
    mask = top_p_mask(w, lens, p)
    for b in range(w.shape[0]):
        L = int(lens[b])
        row = w[b, 0, :L]
        kept, dropped = np.flatnonzero(mask[b, 0]), np.flatnonzero(~mask[b, 0][:L])
        n = kept.size
        assert (kept < L).all()
        if L == 0:
            assert n == 0
            continue
        if p == 1.0:
            assert n == L
            continue
        c = np.cumsum(np.sort(row)[::-1])
        assert 1 <= n <= L
        assert c[n - 1] >= p * c[-1]
        assert n == 1 or c[n - 2] < p * c[-1]
        if dropped.size:
            lo = row[kept].min()
            assert lo >= row[dropped].max()
            ties_dropped = dropped[row[dropped] == lo]
            ties_kept = kept[row[kept] == lo]
            assert ties_dropped.size == 0 or ties_kept.max() < ties_dropped.min()


# ------------------------------------------------------------------ Quest's page bound


@st.composite
def dyadic_inputs(draw):
    """Small-integer q and k: every product and sum below is exact in float64."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    N = draw(st.integers(1, 40))
    D = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.integers(-64, 65, size=(B, Hkv * G, D)).astype(np.float64)
    k = rng.integers(-64, 65, size=(B, Hkv, N, D)).astype(np.float64)
    lens = np.array([draw(st.integers(0, N)) for _ in range(B)], dtype=np.int64)
    return q, k, lens


@settings(max_examples=100)
@given(dyadic_inputs(), st.integers(1, 9), st.sampled_from([1.0, 0.5, 0.125, 2.0]))
def test_quest_bound_bounds_every_logit_of_its_page_exactly(data, page_size, scale):
    """bound[page(j)] >= scale * q . k_j for every valid token j, in exact arithmetic, and
    the bound is exactly scale * sum_d max(q_d min_d, q_d max_d) over the page's keys."""
    q, k, lens = data
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    bounds = quest_page_bounds(q, k, lens, page_size, scale)
    n_pages = -(-k.shape[2] // page_size)
    assert bounds.shape == (B, Hq, n_pages)
    for b in range(B):
        L = int(lens[b])
        for h in range(Hq):
            qi = [int(t) for t in q[b, h]]
            ki = [[int(t) for t in row] for row in k[b, h // G]]
            for page in range(n_pages):
                tokens = range(page * page_size, min((page + 1) * page_size, L))
                if len(tokens) == 0:
                    assert bounds[b, h, page] == -np.inf
                    continue
                mn = [min(ki[j][d] for j in tokens) for d in range(D)]
                mx = [max(ki[j][d] for j in tokens) for d in range(D)]
                exact_bound = sum(max(qi[d] * mn[d], qi[d] * mx[d]) for d in range(D))
                assert bounds[b, h, page] == exact_bound * scale
                for j in tokens:
                    assert exact_bound >= sum(qi[d] * ki[j][d] for d in range(D))
                    assert bounds[b, h, page] >= scale * sum(qi[d] * ki[j][d] for d in range(D))


@given(decode_inputs(max_tokens=120, head_dims=(4, 16, 64)), st.integers(1, 20))
def test_quest_bound_holds_for_float_inputs_up_to_rounding(inputs, page_size):
    """On real-valued inputs the bound holds up to the float64 rounding of two D-term dot
    products: |error| <= 2 * D * eps * scale * sum_d |q_d| max(|mn_d|, |mx_d|)."""
    q, k, v, seq_lens = inputs
    lens = np.array(_lens(seq_lens, q, k), dtype=np.int64)
    scale = 1.0 / math.sqrt(q.shape[-1])
    bounds = quest_page_bounds(q, k, lens, page_size, scale)
    x = logits(q, k, lens, scale)
    G = q.shape[1] // k.shape[1]
    eps = np.finfo(np.float64).eps
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for j in range(int(lens[b])):
                page = j // page_size
                tokens = slice(page * page_size, min((page + 1) * page_size, int(lens[b])))
                amax = np.abs(k[b, h // G, tokens]).max(axis=0)
                tol = 2 * q.shape[-1] * eps * scale * float(np.abs(q[b, h]) @ amax)
                assert bounds[b, h, page] >= x[b, h, j] - tol


# ------------------------------------------------------ public functions against direct


def _gap_ok(sorted_desc, n):
    """The n-th and (n+1)-th largest differ by more than rounding (no near-tie at the cut)."""
    if n >= sorted_desc.size:
        return True
    return sorted_desc[n - 1] - sorted_desc[n] > 1e-9 * (1.0 + abs(sorted_desc[n]))


@settings(max_examples=60)
@given(decode_inputs(), st.integers(1, 60))
def test_topk_matches_direct_top_k(inputs, k_tokens):
    """Output = exact attention renormalised over the k largest logits (computed here);
    diagnostics: all K rows read, V rows = union of the group's selections, exact mass."""
    q, k, v, seq_lens = inputs
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, diag = topk_attention(q, k, v, seq_lens, k_tokens=k_tokens, return_diagnostics=True)
    B, Hq, _ = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    lens = _lens(seq_lens, q, k)
    x = direct_logits(q, k, seq_lens, scale)
    sel = {}
    for (b, h), xb in x.items():
        order = sorted(range(xb.size), key=lambda j: (-xb[j], j))
        assume(_gap_ok(xb[order], min(k_tokens, xb.size)))
        sel[b, h] = np.array(order[:k_tokens], dtype=np.int64)
        expect = direct_subset_attention(xb, v[b, h // G], sel[b, h])
        np.testing.assert_allclose(out[b, h], expect, rtol=1e-10, atol=1e-12)
        w = np.exp(xb - xb.max())
        assert diag.true_mass[b, h] == pytest.approx(w[sel[b, h]].sum() / w.sum(), rel=1e-12)
        assert diag.tokens_exact[b, h] == min(k_tokens, lens[b])
    np.testing.assert_array_equal(diag.k_rows_read, np.repeat(np.array(lens)[:, None], Hkv, 1))
    np.testing.assert_array_equal(diag.seq_lens, lens)
    assert_union_counts(diag.v_rows_read, sel, B, Hq, Hkv)


@settings(max_examples=60)
@given(decode_inputs(), st.floats(0.05, 1.0))
def test_top_p_mass_reaches_p_and_is_minimal(inputs, p):
    """With the reference weights w = exp(x - max x) and c = cumsum(w sorted descending),
    the n kept tokens satisfy c[n-1] >= p c[-1] > c[n-2] (exact); the output is the
    renormalised attention over the n heaviest tokens (computed here), and the reported
    exact mass is >= p up to rounding."""
    q, k, v, seq_lens = inputs
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, diag = top_p_attention(q, k, v, seq_lens, p=p, return_diagnostics=True)
    B, Hq, _ = q.shape
    G = Hq // k.shape[1]
    lens_arr = np.array(_lens(seq_lens, q, k), dtype=np.int64)
    w_ref, _ = masked_weights(logits(q, k, lens_arr, scale))
    x = direct_logits(q, k, seq_lens, scale)
    sel = {}
    for (b, h), xb in x.items():
        L = xb.size
        n = int(diag.tokens_exact[b, h])
        c = np.cumsum(np.sort(w_ref[b, h, :L])[::-1])
        assert c[n - 1] >= p * c[-1]
        assert n == 1 or c[n - 2] < p * c[-1] or p == 1.0
        assert diag.true_mass[b, h] >= p * (1 - 1e-12)
        order = sorted(range(L), key=lambda j: (-xb[j], j))
        assume(_gap_ok(xb[order], n))
        sel[b, h] = np.array(order[:n], dtype=np.int64)
        expect = direct_subset_attention(xb, v[b, h // G], sel[b, h])
        np.testing.assert_allclose(out[b, h], expect, rtol=1e-10, atol=1e-12)
    assert_union_counts(diag.v_rows_read, sel, B, Hq, k.shape[1])


@settings(max_examples=60)
@given(decode_inputs(max_tokens=100), st.integers(1, 64), st.integers(1, 17))
def test_quest_attends_over_the_pages_with_largest_bounds(inputs, budget, page_size):
    """Output = attention over the tokens of the ceil(budget / page_size) pages with the
    largest bound (ties: lower page), selected here from the bounds; K and V rows read are
    the union of the group's pages."""
    q, k, v, seq_lens = inputs
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, diag = quest_attention(q, k, v, seq_lens, k_tokens=budget, page_size=page_size,
                                return_diagnostics=True)
    B, Hq, _ = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    lens = _lens(seq_lens, q, k)
    bounds = quest_page_bounds(q, k, np.array(lens, dtype=np.int64), page_size, scale)
    x = direct_logits(q, k, seq_lens, scale)
    keep = -(-budget // page_size)
    sel = {}
    for (b, h), xb in x.items():
        L = xb.size
        pages = [pg for pg in range(-(-L // page_size))]
        pages.sort(key=lambda pg: (-bounds[b, h, pg], pg))
        chosen = pages[:keep]
        sel[b, h] = np.array(sorted(j for pg in chosen
                                    for j in range(pg * page_size, min((pg + 1) * page_size, L))),
                             dtype=np.int64)
        expect = direct_subset_attention(xb, v[b, h // G], sel[b, h])
        np.testing.assert_allclose(out[b, h], expect, rtol=1e-10, atol=1e-12)
        assert diag.tokens_exact[b, h] == sel[b, h].size
    assert_union_counts(diag.v_rows_read, sel, B, Hq, Hkv)
    np.testing.assert_array_equal(diag.k_rows_read, diag.v_rows_read)


@settings(max_examples=15)
@given(decode_inputs(max_tokens=150), st.integers(0, 40), st.integers(1, 20))
def test_full_budgets_equal_exact_attention(inputs, extra, page_size):
    """top-k with k >= L, Quest with budget >= L and top-p with p = 1 are exact attention."""
    q, k, v, seq_lens = inputs
    N = k.shape[2]
    exact = exact_attention(q, k, v, seq_lens)
    for out, diag in (
        topk_attention(q, k, v, seq_lens, k_tokens=N + extra, return_diagnostics=True),
        quest_attention(q, k, v, seq_lens, k_tokens=N + extra, page_size=page_size,
                        return_diagnostics=True),
        top_p_attention(q, k, v, seq_lens, p=1.0, return_diagnostics=True),
    ):
        np.testing.assert_allclose(out, exact, rtol=1e-12, atol=1e-13)
        lens = np.array(_lens(seq_lens, q, k))
        np.testing.assert_array_equal(diag.v_rows_read, np.repeat(lens[:, None], k.shape[1], 1))
        np.testing.assert_allclose(diag.true_mass, 1.0, rtol=1e-12)


# ----------------------------------------------------------------- edge cases and dtypes


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_empty_sequence_gives_zero_row_and_zero_reads(name):
    fn, kwargs = BASELINES[name]
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 8))
    k = rng.standard_normal((2, 2, 30, 8))
    v = rng.standard_normal((2, 2, 30, 8))
    with np.errstate(all="raise"):
        out, diag = fn(q, k, v, np.array([0, 30], dtype=np.int32), **kwargs,
                       return_diagnostics=True)
    assert (out[0] == 0).all() and np.isfinite(out).all()
    assert (diag.k_rows_read[0] == 0).all() and (diag.v_rows_read[0] == 0).all()
    assert (diag.true_mass[0] == 0).all() and (diag.tokens_exact[0] == 0).all()


@pytest.mark.parametrize("name", sorted(BASELINES))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtype_is_kept_and_huge_logits_do_not_overflow(name, dtype):
    """Logits of about 1e4 (computed in float64 even for float16 inputs) stay finite and
    match the float64 computation to the output dtype's precision."""
    fn, kwargs = BASELINES[name]
    rng = np.random.default_rng(2)
    D = 64
    q = np.full((1, 2, D), 60.0) * rng.choice([1.0, 0.98], size=(1, 2, D))
    k = 60.0 * rng.choice([1.0, 0.97, 0.95], size=(1, 1, 40, D))
    v = rng.standard_normal((1, 1, 40, D))
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    out = fn(q, k, v, **kwargs)
    assert out.dtype == dtype and np.isfinite(out).all()
    ref = fn(*(a.astype(np.float64) for a in (q, k, v)), **kwargs)
    tol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)


# -------------------------------------------------------------------------------- errors


class FakeGPUArray:
    """Stands for a CUDA tensor: only its DLPack device says where it lives."""

    shape, dtype, ndim = (1, 2, 4), "float32", 3

    def __dlpack__(self, stream=None):  # pragma: no cover - never called
        raise AssertionError

    def __dlpack_device__(self):
        return (2, 0)


def _small():
    rng = np.random.default_rng(3)
    return rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 1, 6, 4)), rng.standard_normal((1, 1, 6, 4))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"k_tokens": 0}, ValueError, r"`k_tokens` must be >= 1, got 0"),
        ({"k_tokens": -3}, ValueError, r"`k_tokens` must be >= 1, got -3"),
        ({"k_tokens": 2.0}, TypeError, r"`k_tokens` must be an integer, got float"),
        ({"k_tokens": True}, TypeError, r"`k_tokens` must be an integer, got bool"),
    ],
)
def test_topk_errors(kwargs, exc, match):
    q, k, v = _small()
    with pytest.raises(exc, match=match):
        topk_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"budget": 0}, ValueError, r"`budget` must be >= 1, got 0"),
        ({"budget": 1.5}, TypeError, r"`budget` must be an integer, got float"),
        ({"budget": 8, "page_size": 0}, ValueError, r"`page_size` must be >= 1, got 0"),
        ({"budget": 8, "page_size": "16"}, TypeError, r"`page_size` must be an integer, got str"),
    ],
)
def test_quest_errors(kwargs, exc, match):
    q, k, v = _small()
    with pytest.raises(exc, match=match):
        quest_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "p, exc, match",
    [
        (0.0, ValueError, r"`p` must lie in \(0, 1\], got 0.0"),
        (-0.5, ValueError, r"`p` must lie in \(0, 1\], got -0.5"),
        (1.0000001, ValueError, r"`p` must lie in \(0, 1\], got 1.0000001"),
        (float("nan"), ValueError, r"`p` must lie in \(0, 1\], got nan"),
        ("0.9", TypeError, r"`p` must be a real number, got str"),
    ],
)
def test_top_p_errors(p, exc, match):
    q, k, v = _small()
    with pytest.raises(exc, match=match):
        top_p_attention(q, k, v, p=p)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_shared_validation_and_gpu_dispatch_errors(name):
    fn, kwargs = BASELINES[name]
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"`q` heads must be a multiple of `k` heads \(GQA\), got Hq=3 and Hkv=2"):
        fn(np.zeros((1, 3, 4)), np.zeros((1, 2, 6, 4)), np.zeros((1, 2, 6, 4)), **kwargs)
    with pytest.raises(ValueError, match=r"`softmax_scale` must be finite and > 0, got -1.0"):
        fn(q, k, v, softmax_scale=-1.0, **kwargs)
    bad = k.copy()
    bad[0, 0, 2, 1] = np.nan
    with pytest.raises(ValueError, match=r"`k` must hold only finite values \(check_finite=True\)"):
        fn(q, bad, v, check_finite=True, **kwargs)
    gpu = FakeGPUArray()
    with pytest.raises(NotImplementedError, match=rf"`{name}` has no CUDA kernel yet"):
        fn(gpu, gpu, gpu, **kwargs)
    with pytest.raises(TypeError, match=r"all arrays must live on one device"):
        fn(gpu, k, v, **kwargs)
