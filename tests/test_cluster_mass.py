"""Cluster mass estimators (stochattn.reference.cluster_mass) and the reference Double-P's
``mass=`` / ``value=`` options (issue 31).

Exact properties are asserted exactly (or to rounding where a bound is compared across
different float operations); the one statistical test uses fixed seeds, so it is
deterministic, and its margin is set so that a fresh seed would fail it with probability
below 1e-6 (stated at the test).
"""

import numpy as np
import pytest

from stochattn.doublep import build_doublep_index
from stochattn.reference import cluster_mass as cm
from stochattn.reference.doublep import doublep_attention, select_clusters
from stochattn.reference.kmeans import cluster_csr


def _one_cluster_stats(X, W=None, rank=4, n_sub=4):
    W = np.zeros_like(X) if W is None else W
    s = X.shape[0]
    off = np.array([0, s])
    st = cm.member_stats(X, W, off, np.arange(s), 1, rank=rank, n_sub=n_sub)
    return st


def _instance(seed=0, B=2, Hkv=2, G=2, N=260, D=16, C=10):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    q = (2 * rng.standard_normal((B, Hkv * G, D))).astype(np.float32)
    lens = np.array([N, N - 40])
    index = build_doublep_index(k, v, lens, n_clusters=C, window=32)
    return q, k, v, lens, index


def _run(q, k, v, lens, index, **kw):
    opts = dict(p1=0.95, p2=0.7, approx="centroid", budget=None, sampler="systematic", seed=0,
                offset=0, scale=0.25)
    opts.update(kw)
    return doublep_attention(q, k, v, lens, index, **opts)


@pytest.mark.parametrize("name", ["paper", "mean", "diag-var", "pca", "pca-clip", "bennett",
                                  "sub", "exact"])
def test_identical_keys_every_estimator_is_exact(name):
    # Dyadic keys and query: every dot product and mean is exact in float64, whatever the
    # summation order, so the estimate must equal the true log-mass bit for bit.
    s = 7
    key = np.array([1, -2, 0.5, 3, 0, -1, 2, 0.25])
    X = np.tile(key, (s, 1))
    q = np.array([0.5, 1, -1, 2, 0.125, 1, -0.5, 1])
    scale = 0.5
    st = cm.stats_at(_one_cluster_stats(X), np.array([0]))
    x = (X @ q) * scale
    truth = cm.log_mass_exact(x, np.array([0, s]), np.arange(s), np.array([0]))
    assert truth[0] == x[0] + np.log(s)
    got = cm.log_mass(name, q, scale=scale, centroids=key[None], sizes=np.array([s]), stats=st,
                      x=x, offsets=np.array([0, s]), token_ids=np.arange(s), ids=np.array([0]))
    assert got[0] == truth[0]


def test_identical_keys_value_estimates_are_the_mean():
    s = 5
    X = np.tile(np.array([1.0, 2.0, -1.0, 0.5]), (s, 1))
    W = np.arange(20, dtype=np.float64).reshape(s, 4)
    st = cm.stats_at(_one_cluster_stats(X, W, rank=2, n_sub=2), np.array([0]))
    vm = W.mean(axis=0)[None]
    q = np.array([1.0, -1.0, 2.0, 0.5])
    assert np.array_equal(cm.value_tilt(q, vm, st, 0.5), vm)  # no key spread: no tilt
    assert np.allclose(cm.value_sub(q, st, 0.5), vm, rtol=0, atol=1e-12)


def test_bounds_hold_on_random_clusters():
    # Exact inequalities (to rounding): Jensen lower bound <= sub-centroids <= truth;
    # the max logit <= scale q.mu + b (the deviation bound), hence clipped <= that bound.
    rng = np.random.default_rng(1)
    for trial in range(20):
        s, D = int(rng.integers(2, 40)), 12
        X = rng.standard_normal((s, D)) * rng.uniform(0.1, 2, D) + rng.standard_normal(D)
        q = 3 * rng.standard_normal(D)
        scale = 0.3
        st = cm.stats_at(_one_cluster_stats(X, rank=3, n_sub=4), np.array([0]))
        x = (X @ q) * scale
        sz = np.array([s])
        truth = cm.log_mass_exact(x, np.array([0, s]), np.arange(s), np.array([0]))[0]
        lo = cm.log_mass_mean(q, st, sz, scale)[0]
        sub = cm.log_mass_subcentroid(q, st, scale)[0]
        assert lo <= sub + 1e-12 and sub <= truth + 1e-12
        b = cm._dev_bound(q, st, scale)[0]
        assert x.max() <= scale * (st.mean[0] @ q) + b + 1e-12
        assert cm.log_mass_clipped(q, st, sz, scale)[0] <= lo + b + 1e-12
        assert cm.log_mass_bennett(q, st, sz, scale)[0] <= lo + b + 1e-12


def test_pca_full_rank_is_the_full_quadratic_form():
    # With r = D - 1 and the remainder, q^T Sigma q is exact (to rounding).
    rng = np.random.default_rng(2)
    s, D = 30, 6
    X = rng.standard_normal((s, D)) @ rng.standard_normal((D, D))
    st = cm.stats_at(_one_cluster_stats(X, rank=D - 1), np.array([0]))
    q = rng.standard_normal(D)
    Y = X - X.mean(axis=0)
    quad = q @ (Y.T @ Y / s) @ q
    assert np.isclose(cm._var_pca(q, st, 1.0)[0], quad, rtol=1e-10, atol=1e-12)


def test_gaussian_clusters_variance_corrections_beat_paper():
    # Gaussian clusters: member logits are Gaussian, so the lognormal correction is right
    # in expectation and the paper's estimate is short by Var / 2. 40 clusters of 64 keys
    # (D = 16, per-dimension sd 0.6), 50 queries with |scale q| ~ 1.6: Var ~ 0.9 per
    # cluster, expected mean log-error about -0.45 for paper (-Var/2) and within ~0.1 of 0
    # for diag-var and pca. Margin asserted: the mean absolute error is at least 0.2
    # nats smaller. Over 2000 (query, cluster) errors whose per-query means have s.e.
    # ~0.02, a fresh seed falls short of a 0.2 margin against a ~0.35 expected gap with
    # probability < 1e-6 (z > 7); with seed 3 the test is deterministic. Measured over 1000
    # fresh seeds (tools/calibrate_stat_tests.py, cluster_mass_margin): smallest gap 0.38
    # +- 0.018 nats, minimum 0.33, 9.9 standard deviations above the 0.2 margin; 0 failures.
    mae = variance_correction_mae()
    for n in ("diag-var", "pca", "pca-clip"):
        assert mae[n] + 0.2 < mae["paper"], mae
    assert mae["sub"] < mae["paper"], mae  # never overshoots; still below truth


def variance_correction_mae(seed=3):
    """The mean absolute log-mass errors of test_gaussian_clusters_variance_corrections_beat_paper
    per estimator, on the instance of default_rng(seed) (the test uses 3)."""
    rng = np.random.default_rng(seed)
    C, s, D = 40, 64, 16
    scale = 0.25
    centres = rng.standard_normal((C, D))
    K = (centres[:, None, :] + 0.6 * rng.standard_normal((C, s, D))).reshape(C * s, D)
    off = np.arange(C + 1) * s
    tok = np.arange(C * s)
    st = cm.member_stats(K, np.zeros_like(K), off, tok, C, rank=4, n_sub=4)
    ids = np.arange(C)
    sizes = np.full(C, s)
    err = {n: [] for n in ("paper", "diag-var", "pca", "pca-clip", "sub")}
    for _ in range(50):
        q = 1.6 / scale * rng.standard_normal(D) / np.sqrt(D)
        x = (K @ q) * scale
        lz = cm.log_mass_exact(x, off, tok, ids)
        for n in err:
            e = cm.log_mass(n, q, scale=scale, centroids=st.mean, sizes=sizes, stats=st) - lz
            err[n].append(np.abs(e).mean())
    return {n: float(np.mean(e)) for n, e in err.items()}


def test_paper_mode_is_the_default_bit_for_bit():
    q, k, v, lens, index = _instance()
    for approx, budget in (("centroid", None), ("sample", 8)):
        a = _run(q, k, v, lens, index, approx=approx, budget=budget)
        b = _run(q, k, v, lens, index, approx=approx, budget=budget, mass="paper",
                 value="mean", mass_alpha=0.3, mass_diagnostics=True)
        assert np.array_equal(a[0], b[0])
        for key in a[1]:
            assert np.array_equal(a[1][key], b[1][key]), key


def test_paper_mode_matches_the_papers_formula():
    # An independent re-derivation of docs/estimators.md's centroid output for one head.
    q, k, v, lens, index = _instance(seed=4)
    out, _ = _run(q, k, v, lens, index)
    scale, b, h, G = 0.25, 1, 3, 2
    kvh = h // G
    L = int(lens[b])
    K = k[b, kvh, :L].astype(np.float64)
    V = v[b, kvh, :L].astype(np.float64)
    qh = q[b, h].astype(np.float64)
    sizes = index.sizes[b, kvh]
    ids = np.flatnonzero(sizes > 0)
    xbar = scale * index.centroids[b, kvh, ids] @ qh + np.log(sizes[ids])
    order, n_p, n_e, _ = select_clusters(xbar, 0.95, 0.7)
    labels = index.labels[b, kvh, :L]
    ws = int(index.window_start[b])
    exact = np.concatenate([np.arange(4), np.arange(ws, L),
                            np.flatnonzero(np.isin(labels, ids[order[:n_e]]))])
    x = scale * K[exact] @ qh
    logits = np.concatenate([x, xbar[order[n_e:n_p]]])
    vals = np.concatenate([V[exact], index.value_means[b, kvh, ids[order[n_e:n_p]]]])
    w = np.exp(logits - logits.max())
    assert np.allclose(out[b, h], w @ vals / w.sum(), rtol=0, atol=1e-12)


def test_options_run_and_precomputed_stats_are_the_same():
    q, k, v, lens, index = _instance(seed=5)
    st = cm.index_stats(k, v, lens, index, rank=3, n_sub=2)
    for mass in cm.MASS_ESTIMATORS:
        for value in cm.VALUE_ESTIMATES:
            a = _run(q, k, v, lens, index, mass=mass, value=value, mass_rank=3, mass_sub=2,
                     mass_diagnostics=True)
            b = _run(q, k, v, lens, index, mass=mass, value=value, mass_stats=st,
                     mass_diagnostics=True)
            assert np.isfinite(a[0]).all()
            assert np.array_equal(a[0], b[0])
    # The oracle mass selects by true mass: its estimated and true C_p masses agree.
    _, d = _run(q, k, v, lens, index, mass="exact", mass_diagnostics=True)
    assert np.allclose(d["estimated_mass"], d["cluster_true_mass"], rtol=0, atol=1e-12)
    assert np.allclose(d["approx_log_mass_error"], 0, atol=1e-12)
    with pytest.raises(ValueError):
        _run(q, k, v, lens, index, mass="nope")
    with pytest.raises(ValueError):
        _run(q, k, v, lens, index, value="nope")


def test_index_stats_matches_member_stats():
    q, k, v, lens, index = _instance(seed=6)
    st = cm.index_stats(k, v, lens, index, rank=2, n_sub=2)
    off, tok = cluster_csr(index.labels, index.sizes, index.window_start, index.n_sink)
    one = cm.member_stats(k[1, 0, :lens[1]], v[1, 0, :lens[1]], off[1, 0], tok[1, 0],
                          index.sizes.shape[-1], rank=2, n_sub=2)
    for f in cm.ClusterStats.__dataclass_fields__:
        assert np.array_equal(getattr(st, f)[1, 0], getattr(one, f)), f
    assert np.array_equal(st.sub_sizes.sum(-1), index.sizes)  # parts partition the cluster


def test_index_reads_follow_the_read_cost_rule():
    # Exact counts: every non-empty cluster's scoring summary, each cluster some head of the
    # group approximates its value summary; the oracle reads every key.
    q, k, v, lens, index = _instance(seed=6)
    B, Hkv, C = index.sizes.shape
    G = q.shape[1] // Hkv
    nonempty = (index.sizes > 0).sum(-1)
    for mass, value in (("paper", "mean"), ("sub", "tilt"), ("pca-clip", "tilt"),
                        ("paper", "sub"), ("sub", "sub"), ("diag-var", "mean")):
        out, d = _run(q, k, v, lens, index, mass=mass, value=value, mass_rank=3, mass_sub=2)
        ke, ka, va = cm.summary_vectors(mass, value, rank=3, n_sub=2)
        n_approx = (d["clusters_selected"] - d["clusters_exact"]).reshape(B, Hkv, G)
        # the union over the group is at least each head's count and at most their sum
        k_approx = d["k_index_rows"] - nonempty * ke
        assert (k_approx == (d["v_index_rows"] // max(va, 1)) * ka).all()
        if va:
            assert (d["v_index_rows"] % va == 0).all()
            assert (d["v_index_rows"] // va >= n_approx.max(-1)).all()
            assert (d["v_index_rows"] // va <= n_approx.sum(-1)).all()
    _, d = _run(q, k, v, lens, index, mass="exact")
    assert (d["k_index_rows"] + d["k_rows_read"] == lens[:, None]).all()
    _, d = _run(q, k, v, lens, index, approx="sample", budget=8, mass="sub")
    assert (d["k_index_rows"] == nonempty * 4).all() and (d["v_index_rows"] == 0).all()
    with pytest.raises(ValueError, match="mass"):
        cm.summary_vectors("nope", "mean")
    with pytest.raises(ValueError, match="value"):
        cm.summary_vectors("paper", "nope")
    assert cm.summary_vectors("sub", "tilt", rank=4, n_sub=4) == (4, 4, 5)
    assert cm.summary_vectors("exact", "tilt", rank=4, n_sub=4) == (0, 4, 5)
    assert cm.summary_vectors("pca-clip", "sub", rank=4, n_sub=4) == (5, 4, 4)


def test_exact_approx_weights():
    # With the exact-mass selection the weights were exact already: same output; with the
    # paper's selection the same clusters are selected, C_approx's keys are read (K only)
    # and the output moves.
    q, k, v, lens, index = _instance(seed=7)
    a, da = _run(q, k, v, lens, index, mass="exact")
    b, db = _run(q, k, v, lens, index, mass="exact", approx_weight="exact")
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    a, da = _run(q, k, v, lens, index, p2=0.5)
    b, db = _run(q, k, v, lens, index, p2=0.5, approx_weight="exact")
    for key in ("clusters_selected", "clusters_exact", "tokens_exact", "v_rows_read"):
        assert np.array_equal(da[key], db[key]), key
    approx = (da["clusters_selected"] > da["clusters_exact"]).reshape(db["k_rows_read"].shape[0],
                                                                      db["k_rows_read"].shape[1], -1)
    assert (db["k_rows_read"] >= da["k_rows_read"]).all()
    assert (db["k_rows_read"] > da["k_rows_read"])[approx.any(-1)].all()
    assert not np.allclose(a, b)
    with pytest.raises(ValueError, match="approx_weight"):
        _run(q, k, v, lens, index, approx_weight="nope")


def test_sub_near_refines_the_cut_and_shifts_the_rest():
    rng = np.random.default_rng(3)
    paper = rng.normal(0, 2, 40)
    sub = paper + rng.uniform(0, 2, 40)
    for p1 in (0.5, 0.9, 0.99):
        order, n_p, _, _ = select_clusters(paper, p1, p1)
        cp = np.zeros(40, dtype=bool)
        cp[order[:n_p]] = True
        r0 = cm.refined_mask(paper, p1, 0.0)
        assert (r0 >= cp).all() and (r0 == (paper >= paper[cp].min())).all()
        r3 = cm.refined_mask(paper, p1, 3.0)
        assert (r3 >= r0).all() and cm.refined_mask(paper, p1, 1e9).all()
        out = cm.log_mass_refined(paper, sub, r3)
        gap = (sub - paper)[r3].mean()
        assert np.array_equal(out[r3], sub[r3])
        assert np.allclose(out[~r3], paper[~r3] + gap, rtol=0, atol=1e-12)
    assert cm.refined_mask(np.zeros(0), 0.9).size == 0
    q, k, v, lens, index = _instance(seed=9)
    # every cluster refined: "sub-near" is "sub"
    a, da = _run(q, k, v, lens, index, mass="sub")
    b, db = _run(q, k, v, lens, index, mass="sub-near", mass_margin=1e9)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    nonempty = (index.sizes > 0).sum(-1)
    assert (db["k_index_rows"] == nonempty * (1 + 4)).all()  # centroid + 4 sub-centroids each
