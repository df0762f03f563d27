"""The counter-based generator (Philox-4x32-10), its stream layout, and the samplers.

Exact properties are asserted exactly (known-answer vectors, the float format of the
uniforms, stratum membership, sortedness). Distribution tests are chi-square tests on bin
COUNTS with a p-value threshold ALPHA per Hypothesis example; each test states its total
false-failure rate (ALPHA times its number of examples).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from pathlib import Path

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
from stochattn import spec
from stochattn.reference.samplers import SAMPLERS, invert_cdf, sample_points

ROOT = Path(__file__).resolve().parents[1]

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


# ------------------------------------------------------- the one Philox (stochattn.spec)


def _philox_ints(c, k):
    """Philox-4x32-10 on Python ints (Random123's definition), independent of stochattn."""
    c, (k0, k1) = list(c), k
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
    return tuple(c)


@pytest.mark.parametrize("counter, key, expect", KAT)
def test_spec_philox_known_answers(counter, key, expect):
    """spec.philox4x32_10 on NumPy uint64 scalars: Random123's vectors, uint64 results."""
    out = spec.philox4x32_10(*(np.uint64(w) for w in counter + key))
    assert tuple(int(w) for w in out) == expect == _philox_ints(counter, key)
    assert all(np.asarray(w).dtype == np.uint64 for w in out)


def test_spec_philox_matches_integer_philox_on_many_blocks():
    """Vectorised over 20000 blocks x 16 keys (all-ones words included) without a NumPy
    warning, every word equals the Python-int Philox; the reference's front end too."""
    rs = np.random.default_rng(2026)
    n = 20000
    for t in range(16):
        c = [rs.integers(0, 2**32, size=n, dtype=np.uint64) for _ in range(4)]
        c[t % 4][: n // 8] = 0xFFFFFFFF
        k = (int(rs.integers(0, 2**32)), 0xFFFFFFFF if t % 3 == 0 else int(rs.integers(0, 2**32)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = spec.philox4x32_10(*c, np.uint64(k[0]), np.uint64(k[1]))
            ref_out = philox4x32(c, k)
        assert all(w.dtype == np.uint64 for w in out)
        for i in rs.integers(0, n, size=200).tolist() + list(range(4)):
            expect = _philox_ints([int(w[i]) for w in c], k)
            assert tuple(int(w[i]) for w in out) == expect
            assert tuple(int(w[i]) for w in ref_out) == expect
        for a, b in zip(out, ref_out):
            np.testing.assert_array_equal(a, b.astype(np.uint64))


# SHA-256 of random_words(0x0123456789ABCDEF, 0xDEADBEEF, purpose, rows, streams, draws)
# (8 rows x 4 streams x 128 draws, little-endian uint32), recorded with the reference's own
# Philox before the block function moved to stochattn.spec: the move changed no draw.
WORDS_SHA256 = {
    0: "9405c9c20f487187f7df524e05cc81a2a098a05c10fa3aff67b838a36acf6ae3",
    1: "96719417088aa6bb14f4f12a7910014a822212725c3ec28d465c803745c467bb",
    2: "2196fc046f7d68b846351826ec19ae1a2eb6a5aebcc2b3657f2b010c49b61c7c",
    3: "83708cae602f435f7a0264696597a5e146c70dfccc76f534c16486c17ac13ee4",
}


@pytest.mark.parametrize("purpose", sorted(WORDS_SHA256))
def test_random_words_unchanged(purpose):
    rows = np.arange(8)[:, None, None] * 1000003 % 2**28
    w = random_words(0x0123456789ABCDEF, 0xDEADBEEF, purpose, rows,
                     np.arange(4)[None, :, None], np.arange(128)[None, None, :])
    assert w.shape == (8, 4, 128) and w.dtype == np.uint32
    assert hashlib.sha256(w.astype("<u4").tobytes()).hexdigest() == WORDS_SHA256[purpose]


def test_reference_reexports_the_spec():
    """Names importable from reference/ today are spec's objects, not copies."""
    from stochattn.reference import kmeans as ref_kmeans
    from stochattn.reference import rng as ref_rng
    from stochattn.reference import samplers as ref_samplers
    from stochattn.reference import santa as ref_santa

    for name in ("PURPOSE_VALUE_SAMPLER", "PURPOSE_BERNOULLI", "PURPOSE_KMEANS_INIT",
                 "PURPOSE_CLUSTER_SAMPLER"):
        assert getattr(ref_rng, name) is getattr(spec, name)
    assert (spec.PURPOSE_VALUE_SAMPLER, spec.PURPOSE_BERNOULLI, spec.PURPOSE_KMEANS_INIT,
            spec.PURPOSE_CLUSTER_SAMPLER) == (0, 1, 2, 3)  # never renumbered
    assert ref_samplers.SAMPLERS is spec.SAMPLERS == ("iid", "stratified", "systematic")
    assert ref_santa.SCHEDULES is spec.SCHEDULES and ref_santa.SCORES is spec.SCORES
    assert ref_kmeans.DEFAULT_TOL is spec.DEFAULT_TOL and ref_kmeans.check_tol is spec.check_tol
    assert spec.ROW_LIMIT == 2**28 and spec.PURPOSE_LIMIT == 16


def _imports(path):
    """Absolute names of the modules a source file imports (relative ones resolved)."""
    import ast

    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("package, forbidden", [("cuda", "stochattn.reference"),
                                                ("reference", "stochattn.cuda")])
def test_backends_do_not_import_each_other(package, forbidden):
    """stochattn/cuda and stochattn/reference both read stochattn.spec, never each other."""
    files = sorted((ROOT / "stochattn" / package).rglob("*.py"))
    assert files
    bad = [(f.name, n) for f in files for n in _imports(f)
           if n == forbidden or n.startswith(forbidden + ".")]
    assert not bad


def test_spec_imports_numpy_only():
    mods = {n.split(".")[0] for n in _imports(ROOT / "stochattn" / "spec.py")}
    assert mods <= {"__future__", "numbers", "numpy"}, mods


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
    counts = uniform_bin_counts(seed, offset, purpose)
    assert counts.size == 64
    assert chi2_uniform_pvalue(counts) > ALPHA


def uniform_bin_counts(seed, offset, purpose):
    """The 64 bin counts of test_uniforms_are_uniform_chi_square."""
    u = uniforms(seed, offset, purpose, np.arange(256)[:, None], 0, np.arange(256)[None, :])
    return np.bincount((u * 64).astype(np.int64).ravel(), minlength=64)


@settings(max_examples=10)
@given(seeds, offsets)
def test_consecutive_draws_are_independent_chi_square(seed, offset):
    """Pairs (u_2i, u_2i+1) of one stream in an 8 x 8 grid: 2**15 pairs, df 63;
    false-failure rate ALPHA per example, 1e-5 over the 10 examples."""
    assert chi2_uniform_pvalue(pair_cell_counts(seed, offset)) > ALPHA


def pair_cell_counts(seed, offset):
    """The 8 x 8 cell counts of test_consecutive_draws_are_independent_chi_square."""
    u = uniforms(seed, offset, PURPOSE_VALUE_SAMPLER, 0, 0, np.arange(2**16))
    cells = (u[0::2] * 8).astype(np.int64) * 8 + (u[1::2] * 8).astype(np.int64)
    return np.bincount(cells, minlength=64)


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
    assert chi2_uniform_pvalue(iid_point_counts(seed, offset, S)) > ALPHA


def iid_point_counts(seed, offset, S):
    """The 32 bin counts of test_iid_points_are_marginally_uniform_chi_square."""
    pts = sample_points("iid", S, seed=seed, offset=offset, row=np.arange(512))
    return np.bincount((pts * 32).astype(np.int64).ravel(), minlength=32)


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
