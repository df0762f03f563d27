"""The evaluation harness's Double-P with ``mass="sub"`` (issue 31 through the library):
the decode-faithful index carries sub-centroids whose sizes keep summing to the clusters'
sizes through the appends, and the estimator is ``doublep_attention(..., mass="sub")`` on
that index, which scores clusters differently from the paper mass."""

from __future__ import annotations

import numpy as np

from stochattn.doublep import doublep_attention
from stochattn.eval.llm.evaluate import decode_index, make_estimator


def _inputs(P=3, Hkv=2, G=2, N=160, D=16, seed=0):
    rng = np.random.default_rng(seed)
    centres = 3.0 * rng.standard_normal((Hkv, 8, D))
    k = centres[None, :, rng.integers(0, 8, N)] + 0.7 * rng.standard_normal((P, Hkv, N, D))
    v = rng.standard_normal((P, Hkv, N, D))
    q = 1.5 * rng.standard_normal((P, Hkv * G, D))
    return q, k, v, np.array([100, 130, 160])


def test_sub_index_grows_with_the_appends():
    q, k, v, lens = _inputs()
    ix = decode_index(k, v, lens, prefill=64, n_clusters=8, iterations=3, window=16,
                      mass="sub")
    assert ix.sub_centroids is not None and ix.sub_centroids.shape[:3] == ix.sizes.shape
    np.testing.assert_array_equal(np.asarray(ix.sub_sizes).sum(axis=-1), np.asarray(ix.sizes))
    assert decode_index(k, v, lens, prefill=64, n_clusters=8, iterations=3,
                        window=16).sub_centroids is None


def test_sub_estimator_is_the_library_call_and_differs_from_paper():
    q, k, v, lens = _inputs(seed=1)
    opts = dict(p1=0.9, p2=0.6, prefill=64, cluster_ratio=8, kmeans_iterations=3, window=16)
    f_sub, stochastic = make_estimator("doublep", mass="sub", **opts)
    assert not stochastic
    got = f_sub(q, k, v, lens, seed=0, offset=0)
    ix = decode_index(k, v, lens, prefill=64, n_clusters=8, iterations=3, window=16,
                      mass="sub")
    want = doublep_attention(q, k, v, lens, index=ix, p1=0.9, p2=0.6, mass="sub")
    np.testing.assert_array_equal(got, want)
    paper = make_estimator("doublep", **opts)[0](q, k, v, lens, seed=0, offset=0)
    assert np.abs(got - paper).max() > 1e-6
