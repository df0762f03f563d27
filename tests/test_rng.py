"""The counter-based generator (Philox-4x32-10), its stream layout, and the samplers.

Exact properties are asserted exactly (known-answer vectors, the float format of the
uniforms, stratum membership, sortedness). Distribution tests are chi-square tests on bin
COUNTS with a p-value threshold ALPHA per Hypothesis example; each test states its total
false-failure rate (ALPHA times its number of examples).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stochattn.reference.rng import (
    PURPOSE_BERNOULLI,
    PURPOSE_CLUSTER_SAMPLER,
    PURPOSE_KMEANS_INIT,
    PURPOSE_VALUE_SAMPLER,
    philox4x32,
    random_words,
    uniforms,
)
from stochattn.reference.samplers import SAMPLERS, invert_cdf, sample_points

ALPHA = 1e-6  # p-value threshold of one chi-square test (its false-failure rate)

seeds = st.integers(0, 2**64 - 1)
offsets = st.integers(0, 2**32 - 1)
purposes = st.sampled_from([PURPOSE_VALUE_SAMPLER, PURPOSE_BERNOULLI, PURPOSE_KMEANS_INIT,
                            PURPOSE_CLUSTER_SAMPLER])


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), integer df.

    Closed forms of the regularised upper incomplete gamma function Q(df/2, x/2), terms
    summed in log space so large df and x neither overflow nor underflow early:
    even df = 2m: exp(-h) sum_{i<m} h^i / i!; odd df = 2m+1: erfc(sqrt h) +
    exp(-h) sum_{i=1..m} h^(i-1/2) / Gamma(i+1/2), with h = x/2.
    """
    if x <= 0:
        return 1.0
    h = x / 2.0
    if df % 2 == 0:
        terms = (i * math.log(h) - h - math.lgamma(i + 1) for i in range(df // 2))
        return min(1.0, sum(math.exp(t) for t in terms))
    terms = ((i - 0.5) * math.log(h) - h - math.lgamma(i + 0.5) for i in range(1, (df - 1) // 2 + 1))
    return min(1.0, math.erfc(math.sqrt(h)) + sum(math.exp(t) for t in terms))


def chi2_uniform_pvalue(counts: np.ndarray) -> float:
    """Pearson chi-square p-value of integer bin counts against equal bin probabilities."""
    counts = np.asarray(counts, dtype=np.int64).ravel()
    expected = counts.sum() / counts.size
    stat = float(((counts - expected) ** 2).sum() / expected)
    return chi2_sf(stat, counts.size - 1)


def test_chi2_sf_known_values():
    """Spot values of the chi-square tail (df 1: 2 Phi(-sqrt x); df 2: exp(-x/2); df 63:
    values of scipy.stats.chi2.sf)."""
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(10.0, 2) == pytest.approx(math.exp(-5.0), rel=1e-12)
    assert chi2_sf(63.0, 63) == pytest.approx(0.47630238333813013, rel=1e-10)
    assert chi2_sf(150.0, 63) == pytest.approx(4.679451669007613e-09, rel=1e-10)


# ------------------------------------------------------------------ known-answer vectors

# Random123's philox4x32-10 known-answer vectors (kat_vectors): counter, key -> output.
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expect", KAT)
def test_philox_known_answers(counter, key, expect):
    out = philox4x32(counter, key)
    assert tuple(int(w) for w in out) == expect
    assert all(w.dtype == np.uint32 for w in out)


@pytest.mark.parametrize("counter, key, expect", KAT)
def test_stream_layout_maps_fields_to_counter_words(counter, key, expect):
    """counter = (draw, stream, purpose << 28 | row, offset), key = (seed lo, seed hi)."""
    seed = key[0] | (key[1] << 32)
    word = random_words(seed, counter[3], counter[2] >> 28, counter[2] & 0x0FFFFFFF,
                        counter[1], counter[0])
    assert int(word) == expect[0]
    u = uniforms(seed, counter[3], counter[2] >> 28, counter[2] & 0x0FFFFFFF, counter[1], counter[0])
    assert float(u) == (2 * (expect[0] >> 9) + 1) / 2**24


def test_philox_vectorises_like_scalar_calls():
    draws = np.arange(5, dtype=np.uint64)
    vec = philox4x32((draws, 7, 9, 11), (3, 4))
    for i in range(5):
        one = philox4x32((i, 7, 9, 11), (3, 4))
        assert tuple(int(w[i]) for w in vec) == tuple(int(w) for w in one)


def test_row_limit_is_enforced():
    with pytest.raises(ValueError, match=r"row index must be below 2\*\*28, got 268435456"):
        random_words(0, 0, 0, 2**28, 0, 0)


# ------------------------------------------------------------------------- the uniforms


@given(seeds, offsets, purposes, st.integers(0, 2**28 - 1), st.integers(0, 2**32 - 1))
def test_uniforms_are_odd_multiples_of_2_pow_minus_24(seed, offset, purpose, row, stream):
    """In (0, 1), odd multiples of 2**-24, exactly representable in float32."""
    u = uniforms(seed, offset, purpose, row, stream, np.arange(4096))
    assert u.dtype == np.float64
    assert (u > 0).all() and (u < 1).all()
    scaled = u * 2**24  # exact: multiplying by a power of two
    assert (scaled == np.floor(scaled)).all() and (scaled.astype(np.int64) % 2 == 1).all()
    assert (u.astype(np.float32).astype(np.float64) == u).all()


def test_uniform_extremes_are_reachable_values():
    """The map u = (2 (x0 >> 9) + 1) 2**-24 sends 0 to 2**-24 and 2**32 - 1 to 1 - 2**-24."""
    for x0, expect in ((0, 2.0**-24), (0xFFFFFFFF, 1 - 2.0**-24)):
        assert (2 * (x0 >> 9) + 1) * 2.0**-24 == expect
        assert np.float32(expect) == expect


@settings(max_examples=10)
@given(seeds, offsets, purposes)
def test_uniforms_are_uniform_chi_square(seed, offset, purpose):
    """2**16 uniforms (256 rows x 256 draws) in 64 equal bins. The 2**23 possible values
    split exactly 2**17 per bin, so equal bin probabilities are exact. Chi-square on the
    counts, df 63; false-failure rate ALPHA per example, 1e-5 over the 10 examples."""
    u = uniforms(seed, offset, purpose, np.arange(256)[:, None], 0, np.arange(256)[None, :])
    counts = np.bincount((u * 64).astype(np.int64).ravel(), minlength=64)
    assert counts.size == 64
    assert chi2_uniform_pvalue(counts) > ALPHA


@settings(max_examples=10)
@given(seeds, offsets)
def test_consecutive_draws_are_independent_chi_square(seed, offset):
    """Pairs (u_2i, u_2i+1) of one stream in an 8 x 8 grid: 2**15 pairs, df 63;
    false-failure rate ALPHA per example, 1e-5 over the 10 examples."""
    u = uniforms(seed, offset, PURPOSE_VALUE_SAMPLER, 0, 0, np.arange(2**16))
    cells = (u[0::2] * 8).astype(np.int64) * 8 + (u[1::2] * 8).astype(np.int64)
    assert chi2_uniform_pvalue(np.bincount(cells, minlength=64)) > ALPHA


@given(seeds, offsets, purposes, st.integers(0, 2**28 - 2), st.integers(0, 2**32 - 2))
def test_every_counter_field_and_the_seed_change_the_words(seed, offset, purpose, row, stream):
    """Changing any one of seed (low or high word), offset, purpose, row or stream changes
    the 16 words of a stream (equal by chance with probability 2**-512 per pair)."""
    draws = np.arange(16)
    base = dict(seed=seed, offset=offset, purpose=purpose, row=row, stream=stream)
    variants = [
        dict(base, seed=seed ^ 1),
        dict(base, seed=seed ^ (1 << 32)),
        dict(base, offset=(offset + 1) % 2**32),
        dict(base, purpose=(purpose + 1) % 4),
        dict(base, row=row + 1),
        dict(base, stream=stream + 1),
    ]
    words = [random_words(c["seed"], c["offset"], c["purpose"], c["row"], c["stream"], draws)
             for c in [base] + variants]
    for i in range(len(words)):
        for j in range(i):
            assert not np.array_equal(words[i], words[j]), (i, j)


# -------------------------------------------------------------------------- the samplers


@given(st.sampled_from(SAMPLERS), st.integers(1, 300), seeds, offsets,
       st.lists(st.integers(0, 2**28 - 1), min_size=1, max_size=3), st.integers(0, 2**32 - 1))
def test_points_are_sorted_in_unit_interval(sampler, S, seed, offset, rows, stream):
    pts = sample_points(sampler, S, seed=seed, offset=offset, row=np.array(rows)[:, None],
                        stream=np.array([stream, stream // 2 + 1])[None, :])
    assert pts.shape == (len(rows), 2, S) and pts.dtype == np.float64
    assert (pts >= 0).all() and (pts < 1).all()
    assert (np.diff(pts, axis=-1) >= 0).all()


@given(st.integers(1, 400), seeds, offsets, st.integers(0, 2**28 - 1))
def test_systematic_points_are_one_uniform_spaced_1_over_S(S, seed, offset, row):
    """T_m = (m + u) / S with u the stream's draw 0, exactly; for S a power of two (exact
    division) consecutive points differ by exactly 1/S."""
    pts = sample_points("systematic", S, seed=seed, offset=offset, row=row)
    u = float(uniforms(seed, offset, PURPOSE_VALUE_SAMPLER, row, 0, 0))
    m = np.arange(S)
    assert (pts == (m + u) / S).all()
    S2 = 1 << (S % 10)
    pts2 = sample_points("systematic", S2, seed=seed, offset=offset, row=row)
    assert (np.diff(pts2) == 1.0 / S2).all()
    assert pts2[0] == u / S2


@given(st.integers(1, 400), seeds, offsets, st.integers(0, 2**28 - 1))
def test_stratified_point_m_lies_in_stratum_m(S, seed, offset, row):
    """m/S <= T_m < (m+1)/S, and T_m = (m + u_m) / S with u_m the stream's draw m."""
    pts = sample_points("stratified", S, seed=seed, offset=offset, row=row)
    m = np.arange(S)
    assert (pts >= m / S).all() and (pts < (m + 1) / S).all()
    u = uniforms(seed, offset, PURPOSE_VALUE_SAMPLER, row, 0, m)
    assert (pts == (m + u) / S).all()


@settings(max_examples=5)
@given(seeds, offsets, st.sampled_from([1, 7, 32]))
def test_iid_points_are_marginally_uniform_chi_square(seed, offset, S):
    """The S sorted points of a row are the order statistics of S iid uniforms, so all
    points of 512 rows pooled are 512 S iid uniforms (up to the 2**-24 grid of the draws,
    a bin-probability error below 1e-6). Chi-square on counts in 32 bins, df 31;
    false-failure rate ALPHA per example, 5e-6 over the 5 examples."""
    pts = sample_points("iid", S, seed=seed, offset=offset, row=np.arange(512))
    counts = np.bincount((pts * 32).astype(np.int64).ravel(), minlength=32)
    assert chi2_uniform_pvalue(counts) > ALPHA


def test_unknown_sampler_is_refused():
    with pytest.raises(ValueError, match=r"`sampler` must be one of 'iid', 'stratified', 'systematic', got 'sobol'"):
        sample_points("sobol", 4, seed=0, offset=0, row=0)


# ------------------------------------------------------------------------ inverse CDF


weight_values = st.one_of(
    st.just(0.0), st.just(0.0), st.just(5e-324), st.floats(1e-300, 1e-290),
    st.floats(0.0, 1.0), st.just(1.0), st.floats(1e10, 1e300),
)
edge_points = st.sampled_from([0.0, 2.0**-24, 0.5, 1 - 2.0**-24, 1 - 2.0**-53,
                               np.nextafter(1.0, 0.0)])


@settings(max_examples=200)
@given(st.lists(weight_values, min_size=1, max_size=50).filter(lambda w: sum(w) > 0),
       st.lists(st.one_of(st.floats(0.0, 1.0, exclude_max=True), edge_points),
                min_size=1, max_size=30))
def test_invert_cdf_never_returns_a_zero_weight_token(weights, points):
    """J = first j with c[j] > T c[-1] (c the cumulative weights): never a zero-weight
    token, c[J-1] <= T c[-1] always, and c[J] > T c[-1] unless J is the last positive
    token (where rounding may leave T c[-1] at the total); J is monotone in T."""
    w = np.array(weights, dtype=np.float64)
    t = np.sort(np.array(points, dtype=np.float64))
    idx = invert_cdf(w[None, :], t[None, :])[0]
    assert idx.shape == t.shape and idx.dtype == np.int64
    assert (w[idx] > 0).all()
    c = np.cumsum(w)
    last = int(np.flatnonzero(w > 0)[-1])
    for j, tj in zip(idx, t):
        assert j == 0 or c[j - 1] <= tj * c[-1]
        assert c[j] > tj * c[-1] or j == last
    assert (np.diff(idx) >= 0).all()
