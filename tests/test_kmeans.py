"""The Double-P k-means index: invariants of build_doublep_index, its seeding and errors.

All properties here are exact (up to float rounding where a float comparison is made,
with the tolerance stated); none is statistical.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stochattn.doublep import DoublePIndex, build_doublep_index
from stochattn.reference.kmeans import cluster_csr, window_starts
from stochattn.reference.rng import PURPOSE_KMEANS_INIT, random_words


@st.composite
def index_inputs(draw, max_tokens=48):
    """(k, v, seq_lens, kwargs) for build_doublep_index, small."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    N = draw(st.integers(1, max_tokens))
    D = draw(st.sampled_from((2, 4, 8)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k = rng.standard_normal((B, Hkv, N, D))
    v = rng.standard_normal((B, Hkv, N, D))
    if draw(st.booleans()):  # a few exact duplicates: ties in the distances
        k[:, :, N // 2:] = k[:, :, : N - N // 2]
    seq_lens = None
    if draw(st.booleans()):
        seq_lens = np.array([draw(st.integers(0, N)) for _ in range(B)], dtype=np.int32)
    kwargs = dict(
        n_clusters=draw(st.integers(1, N)),
        iterations=draw(st.integers(0, 4)),
        n_sink=draw(st.integers(0, 4)),
        window=draw(st.integers(0, 12)),
        seed=draw(st.integers(0, 2**64 - 1)),
    )
    return k, v, seq_lens, kwargs


def lens_of(seq_lens, k):
    return np.full(k.shape[0], k.shape[2]) if seq_lens is None else seq_lens.astype(np.int64)


def check_index_invariants(index: DoublePIndex, k, v):
    """Every exact invariant of an index describing k, v at index.seq_lens."""
    B, Hkv, N, D = k.shape
    C = index.n_clusters
    lens = index.seq_lens
    ws = window_starts(lens, index.n_sink, index.window)
    np.testing.assert_array_equal(index.window_start, ws)
    assert index.labels.dtype == np.int32 and index.sizes.dtype == np.int64
    assert index.centroids.shape == (B, Hkv, C, D) and index.value_sums.shape == (B, Hkv, C, D)
    offsets, token_ids = index.csr()
    for b in range(B):
        lo, hi = index.n_sink, int(ws[b])
        M = max(hi - lo, 0)
        for h in range(Hkv):
            lab = index.labels[b, h]
            # Labelled exactly at the middle positions, each with one cluster in range.
            middle = np.zeros(lab.size, dtype=bool)
            middle[lo:hi] = True
            np.testing.assert_array_equal(lab >= 0, middle)
            live = int(index.n_initialized[b, h])
            assert live <= C and (M == 0) == (live == 0)
            assert np.all(lab[middle] < live)
            # Sizes and value sums are those of the labels.
            mid = lab[middle].astype(np.int64)
            np.testing.assert_array_equal(index.sizes[b, h], np.bincount(mid, minlength=C))
            sums = np.zeros((C, D))
            for j, c in zip(np.flatnonzero(middle), mid):
                sums[c] += v[b, h, j]
            np.testing.assert_allclose(index.value_sums[b, h], sums, rtol=1e-12, atol=1e-12)
            # Clusters that never held a centroid: empty, zero.
            assert not index.centroids[b, h, live:].any()
            assert not index.value_sums[b, h, live:].any()
            # CSR: cluster c holds its tokens, ascending.
            np.testing.assert_array_equal(np.diff(offsets[b, h]), index.sizes[b, h])
            ids = token_ids[b, h]
            assert np.all(ids[M:] == -1)
            for c in range(C):
                members = ids[offsets[b, h, c]:offsets[b, h, c + 1]]
                np.testing.assert_array_equal(members, np.flatnonzero(lab == c))


def check_nearest(index, k):
    """Stored labels are nearest-centroid (among live clusters) for the stored centroids.

    Distances are recomputed directly as sum((k - c)^2); the assigned cluster may exceed
    the minimum only by float rounding of the library's |c|^2 - 2 k.c form, bounded by
    1e-12 * (|k|^2 + |c|^2) * D.
    """
    B, Hkv, N, D = k.shape
    for b in range(B):
        for h in range(Hkv):
            live = int(index.n_initialized[b, h])
            pos = np.flatnonzero(index.labels[b, h] >= 0)
            if pos.size == 0:
                continue
            keys = k[b, h, pos].astype(np.float64)
            cent = index.centroids[b, h, :live]
            d = ((keys[:, None, :] - cent[None, :, :]) ** 2).sum(-1)
            assigned = d[np.arange(pos.size), index.labels[b, h, pos]]
            tol = 1e-12 * D * ((keys**2).sum(-1) + (cent**2).sum(-1).max())
            assert np.all(assigned <= d.min(axis=1) + tol)


@given(index_inputs())
@settings(max_examples=60)
def test_index_invariants(inputs):
    """Middle tokens labelled once, nothing else labelled; sizes, sums, CSR, nearest."""
    k, v, seq_lens, kwargs = inputs
    index = build_doublep_index(k, v, seq_lens, **kwargs)
    assert index.n_clusters == kwargs["n_clusters"]
    np.testing.assert_array_equal(index.seq_lens, lens_of(seq_lens, k))
    check_index_invariants(index, k, v)
    check_nearest(index, k)
    M = np.maximum(index.window_start - index.n_sink, 0)
    np.testing.assert_array_equal(index.n_initialized,
                                  np.minimum(M, kwargs["n_clusters"])[:, None].repeat(k.shape[1], 1))


def test_init_is_the_random_key_order():
    """iterations=0: the centroids are the keys of the first C tokens in (key, position) order."""
    rng = np.random.default_rng(1)
    B, Hkv, N, D, C = 2, 3, 40, 4, 5
    k = rng.standard_normal((B, Hkv, N, D))
    index = build_doublep_index(k, k, n_clusters=C, iterations=0, n_sink=2, window=6, seed=77)
    positions = np.arange(2, N - 6)
    for b in range(B):
        for h in range(Hkv):
            keys = random_words(77, 0, PURPOSE_KMEANS_INIT, row=b * Hkv + h, stream=0, draw=positions)
            first = positions[np.lexsort((positions, keys))[:C]]
            np.testing.assert_array_equal(index.centroids[b, h], k[b, h, first])


def test_same_seed_same_index_other_seed_other_init():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((1, 2, 60, 4))
    v = rng.standard_normal((1, 2, 60, 4))
    a = build_doublep_index(k, v, n_clusters=4, iterations=3, n_sink=2, window=4, seed=5)
    b = build_doublep_index(k, v, n_clusters=4, iterations=3, n_sink=2, window=4, seed=5)
    for name in ("centroids", "sizes", "value_sums", "labels", "window_start", "n_initialized"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    # Different seeds pick different initial subsets (checked for this fixed data).
    c0 = build_doublep_index(k, v, n_clusters=4, iterations=0, n_sink=2, window=4, seed=5)
    c1 = build_doublep_index(k, v, n_clusters=4, iterations=0, n_sink=2, window=4, seed=6)
    assert not np.array_equal(c0.centroids, c1.centroids)


def test_short_sequences_have_no_middle():
    """L <= n_sink + window: no label, no cluster, nothing live."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((3, 2, 30, 4))
    index = build_doublep_index(k, k, np.array([0, 3, 20]), n_clusters=3, n_sink=4, window=16)
    np.testing.assert_array_equal(index.window_start, [4, 4, 4])
    assert np.all(index.labels == -1) and not index.sizes.any() and not index.centroids.any()
    assert not index.n_initialized.any()
    assert index.csr()[1].shape == (3, 2, 0)


def test_more_clusters_than_middle_tokens():
    """C > M: every middle token is a singleton; clusters M..C-1 stay empty with zero centroid."""
    rng = np.random.default_rng(4)
    k = rng.standard_normal((1, 1, 20, 4))
    v = rng.standard_normal((1, 1, 20, 4))
    index = build_doublep_index(k, v, n_clusters=15, iterations=2, n_sink=2, window=8)
    M = 10
    assert index.n_initialized[0, 0] == M
    np.testing.assert_array_equal(index.sizes[0, 0], [1] * M + [0] * 5)
    pos = np.flatnonzero(index.labels[0, 0] >= 0)
    np.testing.assert_array_equal(index.centroids[0, 0, index.labels[0, 0, pos]], k[0, 0, pos])
    np.testing.assert_array_equal(index.value_sums[0, 0, index.labels[0, 0, pos]], v[0, 0, pos])
    assert not index.centroids[0, 0, M:].any()


def inertia(index, k):
    total = 0.0
    for b in range(k.shape[0]):
        for h in range(k.shape[1]):
            pos = np.flatnonzero(index.labels[b, h] >= 0)
            c = index.centroids[b, h, index.labels[b, h, pos]]
            total += float(((k[b, h, pos] - c) ** 2).sum())
    return total


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=10)
def test_inertia_never_increases_with_iterations(data_seed):
    """Lloyd's algorithm: each assignment and each mean update can only lower the sum of
    squared distances, so the stored index's inertia is non-increasing in `iterations`
    (float rounding aside: relative 1e-12). A wrong update (not the mean) breaks this."""
    rng = np.random.default_rng(data_seed)
    k = rng.standard_normal((1, 2, 80, 4))
    values = [inertia(build_doublep_index(k, k, n_clusters=6, iterations=t, n_sink=2, window=4,
                                          seed=data_seed), k) for t in range(6)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(values, values[1:])), values
    assert values[-1] < values[0]  # the update moved something (random data, 6 clusters)


def test_finds_planted_clusters():
    """Far apart, tight blobs and one seed per blob (C = blobs, all tokens): k-means
    recovers the blobs exactly in one iteration, whichever tokens the seeding picks when
    every blob is seeded; this fixed case is checked to seed every blob."""
    rng = np.random.default_rng(6)
    centers = np.array([[50.0, 0, 0, 0], [0, 50.0, 0, 0], [0, 0, 50.0, 0]])
    truth = rng.integers(0, 3, size=60)
    k = (centers[truth] + 0.1 * rng.standard_normal((60, 4)))[None, None]
    for seed in range(20):
        index = build_doublep_index(k, k, n_clusters=3, iterations=5, n_sink=0, window=0, seed=seed)
        lab = index.labels[0, 0]
        # Same partition up to renaming: a bijection between labels and blobs.
        pairs = set(zip(lab.tolist(), truth.tolist()))
        if len(pairs) == 3:
            return
    pytest.fail("no seed out of 20 recovered the planted blobs")


def test_float16_and_float32_inputs():
    rng = np.random.default_rng(7)
    k = rng.standard_normal((1, 1, 50, 8))
    for dt in (np.float16, np.float32):
        index = build_doublep_index(k.astype(dt), k.astype(dt), n_clusters=5, n_sink=1, window=5)
        assert index.centroids.dtype == np.float64
        check_index_invariants(index, k.astype(dt).astype(np.float64), k.astype(dt).astype(np.float64))
        check_nearest(index, k.astype(dt).astype(np.float64))


def test_csr_of_a_known_labelling():
    labels = np.array([[[-1, 1, 0, 1, 1, 0, -1, -1]]], dtype=np.int32)
    sizes = np.array([[[2, 3, 0]]])
    offsets, ids = cluster_csr(labels, sizes, np.array([6]), 1)
    np.testing.assert_array_equal(offsets, [[[0, 2, 5, 5]]])
    np.testing.assert_array_equal(ids, [[[2, 5, 1, 3, 4]]])


# ---- errors -------------------------------------------------------------------------


def test_errors():
    k = np.zeros((1, 2, 10, 4))
    with pytest.raises(ValueError, match="`n_clusters` must be <= 10.*more clusters than tokens"):
        build_doublep_index(k, k, n_clusters=11)
    with pytest.raises(ValueError, match="`n_clusters` must be >= 1, got 0"):
        build_doublep_index(k, k, n_clusters=0)
    with pytest.raises(TypeError, match="`n_clusters` must be an integer"):
        build_doublep_index(k, k, n_clusters=2.0)
    with pytest.raises(TypeError, match="n_clusters"):
        build_doublep_index(k, k)  # required keyword
    with pytest.raises(ValueError, match="`iterations` must be >= 0, got -1"):
        build_doublep_index(k, k, n_clusters=2, iterations=-1)
    with pytest.raises(ValueError, match="`n_sink` must be >= 0, got -1"):
        build_doublep_index(k, k, n_clusters=2, n_sink=-1)
    with pytest.raises(ValueError, match="`window` must be >= 0, got -2"):
        build_doublep_index(k, k, n_clusters=2, window=-2)
    with pytest.raises(ValueError, match="`seed` must lie in"):
        build_doublep_index(k, k, n_clusters=2, seed=-1)
    with pytest.raises(ValueError, match="`v` must have the shape of `k`"):
        build_doublep_index(k, k[:, :1], n_clusters=2)
    with pytest.raises(ValueError, match="`k` must have 4 dimensions"):
        build_doublep_index(k[0], k[0], n_clusters=2)
    with pytest.raises(TypeError, match="`k` dtype must be one of"):
        build_doublep_index(k.astype(np.int32), k.astype(np.int32), n_clusters=2)
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 10\]"):
        build_doublep_index(k, k, np.array([11]), n_clusters=2)
    bad = k.copy()
    bad[0, 0, 3, 1] = np.nan
    with pytest.raises(ValueError, match="`k` must hold only finite values"):
        build_doublep_index(bad, k, n_clusters=2, check_finite=True)
