"""The batched Double-P of the mass study (stochattn.eval.mass_batched, NumPy) against the
reference doublep_attention with mass= / value= (issue 31).

Every check is deterministic (fixed seeds): the batched path must select the same clusters
(stage 1 and stage 2, per query head) and give the same outputs and diagnostics within
float64 rounding, on random inputs, on planted clusters and on exact ties.
"""

import numpy as np
import pytest

from stochattn.doublep import DoublePIndex, build_doublep_index
from stochattn.reference import cluster_mass as cm
from stochattn.reference.doublep import cluster_scores, doublep_attention, select_clusters
from stochattn.reference.kmeans import cluster_csr
from stochattn.eval import mass_batched as mb

MASSES = ("paper", "mean", "diag-var", "pca", "pca-clip", "bennett", "sub", "exact")
SETTINGS = ((0.95, 0.7), (0.9, 0.7), (0.99, 0.8), (1.0, 0.7), (0.95, 1.0), (1.0, 1.0))


def _random(seed=0, B=3, Hkv=2, G=3, N=300, D=16, C=12, window=32):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    q = (2 * rng.standard_normal((B, Hkv * G, D))).astype(np.float32)
    lens = np.array([N, N - 37, 70])[:B]  # the last row: no middle tokens but 2
    index = build_doublep_index(k, v, lens, n_clusters=C, window=window)
    return q, k, v, lens, index


def _planted(seed=1, B=2, Hkv=2, G=2, N=400, D=16, C=16, window=32):
    # Keys around 8 well-separated centres with spread of different sizes, queries aligned
    # with a few centres: most of the mass in a few wide clusters (the Jensen gap regime).
    rng = np.random.default_rng(seed)
    centres = 3 * rng.standard_normal((8, D))
    which = rng.integers(0, 8, size=(B, Hkv, N))
    spread = np.linspace(0.2, 1.5, 8)[which][..., None]
    k = (centres[which] + spread * rng.standard_normal((B, Hkv, N, D))).astype(np.float32)
    v = (rng.standard_normal((8, D))[which] + 0.3 * rng.standard_normal((B, Hkv, N, D))).astype(np.float32)
    q = (1.5 * centres[rng.integers(0, 8, size=(B, Hkv * G))]
         + 0.5 * rng.standard_normal((B, Hkv * G, D))).astype(np.float32)
    lens = np.array([N, N - 101])[:B]
    index = build_doublep_index(k, v, lens, n_clusters=C, window=window)
    return q, k, v, lens, index


def _reference_selection(q, k, lens, index, mass, scale, p1, p2, st, alpha, margin=None):
    """Per (b, h): the set of C_exact and C_approx clusters of the reference."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    offsets, token_ids = cluster_csr(index.labels, index.sizes, index.window_start, index.n_sink)
    sel = {}
    for b in range(B):
        L = int(lens[b])
        for h in range(Hq):
            kvh = h // G
            qh = np.asarray(q[b, h], np.float64)
            x = (np.asarray(k[b, kvh, :L], np.float64) @ qh) * scale
            ids, xbar = cluster_scores(qh, index.centroids[b, kvh], index.sizes[b, kvh], scale)
            if mass != "paper":
                xbar = cm.log_mass(mass, qh, scale=scale, centroids=index.centroids[b, kvh][ids],
                                   p1=p1, margin=cm.REFINE_MARGIN if margin is None else margin,
                                   sizes=index.sizes[b, kvh][ids],
                                   stats=cm.stats_at(st, b, kvh, ids) if st is not None else None,
                                   alpha=alpha, x=x, offsets=offsets[b, kvh],
                                   token_ids=token_ids[b, kvh], ids=ids)
            order, n_p, n_e, _ = select_clusters(xbar, p1, p2)
            sel[b, h] = (sorted(ids[order[:n_e]].tolist()), sorted(ids[order[n_e:n_p]].tolist()))
    return sel


def _batched_selection(code):
    B, Hq, _ = code.shape
    return {(b, h): (np.flatnonzero(code[b, h] == 1).tolist(),
                     np.flatnonzero(code[b, h] == 2).tolist()) for b in range(B) for h in range(Hq)}


def _compare(inst, mass, value, p1, p2, alpha=1.0, stats="reference", rtol=1e-9,
             approx_weight="estimate", margin=None):
    q, k, v, lens, index = inst
    scale = 0.25
    ref_st = cm.index_stats(k, v, lens, index) if (mass not in ("paper", "exact")
                                                   or value != "mean") else None
    ref_out, ref_d = doublep_attention(q, k, v, lens, index, p1=p1, p2=p2, approx="centroid",
                                       budget=None, sampler="systematic", seed=0, offset=0,
                                       scale=scale, mass=mass, value=value, mass_alpha=alpha,
                                       mass_stats=ref_st, mass_diagnostics=True,
                                       approx_weight=approx_weight, mass_margin=margin)
    given = ref_st if stats == "reference" else None
    out, d = mb.doublep_batched(q, k, v, lens, index, p1=p1, p2=p2, scale=scale, mass=mass,
                                value=value, mass_alpha=alpha, mass_stats=given,
                                mass_diagnostics=True, approx_weight=approx_weight,
                                mass_margin=margin)
    sel_ref = _reference_selection(q, k, lens, index, mass, scale, p1, p2, ref_st, alpha, margin)
    assert _batched_selection(d["code"]) == sel_ref
    np.testing.assert_allclose(out, ref_out, rtol=rtol, atol=rtol)
    for key in ("clusters_selected", "clusters_exact", "tokens_exact", "k_rows_read",
                "v_rows_read", "k_index_rows", "v_index_rows"):
        np.testing.assert_array_equal(d[key], ref_d[key], err_msg=key)
    for key in ("estimated_mass", "true_mass", "cluster_true_mass", "approx_log_mass_error"):
        np.testing.assert_allclose(d[key], ref_d[key], rtol=rtol, atol=rtol, err_msg=key)
    return sel_ref


@pytest.mark.parametrize("mass", MASSES)
@pytest.mark.parametrize("p1,p2", SETTINGS)
def test_random_same_selection_and_output(mass, p1, p2):
    _compare(_random(), mass, "mean", p1, p2, alpha=0.5 if mass == "pca-clip" else 1.0)


@pytest.mark.parametrize("mass,value,alpha", [("paper", "mean", 1.0), ("sub", "mean", 1.0),
                                              ("exact", "mean", 1.0), ("pca-clip", "mean", 0.5),
                                              ("sub", "sub", 1.0), ("exact", "tilt", 1.0),
                                              ("diag-var", "sub", 1.0)])
@pytest.mark.parametrize("p1,p2", SETTINGS[:3])
def test_planted_same_selection_and_output(mass, value, alpha, p1, p2):
    sel = _compare(_planted(), mass, value, p1, p2, alpha=alpha)
    # the planted instance exercises both stages: some head approximates clusters
    assert any(s[1] for s in sel.values()) or p2 >= 1


@pytest.mark.parametrize("mass,value,alpha", [("sub", "mean", 1.0), ("pca-clip", "mean", 0.5),
                                              ("sub", "sub", 1.0), ("bennett", "tilt", 1.0)])
def test_batched_statistics_end_to_end(mass, value, alpha):
    # Statistics from state_stats (squaring, level-wise splits) instead of the reference's
    # SVDs: the same selections and outputs to rounding.
    for inst in (_random(seed=3), _planted(seed=4)):
        for p1, p2 in SETTINGS[:3]:
            _compare(inst, mass, value, p1, p2, alpha=alpha, stats="batched", rtol=1e-7)


def test_state_stats_match_member_stats():
    q, k, v, lens, index = _planted(seed=5)
    ref = cm.index_stats(k, v, lens, index)
    got = mb.index_stats_batched(np, k, v, lens, index)
    for f in ("mean", "var", "eig", "rest", "radius", "proj_max", "perp_radius"):
        np.testing.assert_allclose(got[f], getattr(ref, f), rtol=1e-8, atol=1e-10, err_msg=f)
    # principal directions up to sign
    dots = np.abs((got["basis"] * ref.basis).sum(-1))
    live = ref.eig > 1e-9
    np.testing.assert_allclose(dots[live], 1.0, atol=1e-8)
    # the sub-clusters as sets of (size, key mean, value mean), in any order
    for b, h, c in zip(*np.nonzero(index.sizes)):
        def parts(sizes, means, values):
            keep = sizes > 0
            rows = np.concatenate([sizes[keep, None], means[keep], values[keep]], axis=1)
            return rows[np.lexsort(rows.T[::-1])]
        np.testing.assert_allclose(parts(got["sub_sizes"][b, h, c], got["sub_means"][b, h, c],
                                         got["sub_values"][b, h, c]),
                                   parts(ref.sub_sizes[b, h, c], ref.sub_means[b, h, c],
                                         ref.sub_values[b, h, c]), rtol=1e-9, atol=1e-9)


def test_ties_go_to_the_lower_cluster():
    # q = 0: every logit is 0, so log Zhat_i = log s_i for every estimator and equal sizes
    # tie exactly; stage 1 and 2 must break them toward the lower cluster index.
    q, k, v, lens, _ = _random(seed=6, B=1, G=2)
    q = np.zeros_like(q)
    B, Hkv, N, D = k.shape
    C = 8
    L = int(lens[0])
    ws = L - 32
    labels = np.full((B, Hkv, N), -1, dtype=np.int32)
    labels[:, :, 4:ws] = (np.arange(4, ws) % C)[None, None]     # equal sizes (+-1)
    sizes = np.stack([np.bincount(labels[0, h, 4:ws], minlength=C) for h in range(Hkv)])[None]
    vs = np.zeros((B, Hkv, C, D))
    for h in range(Hkv):
        np.add.at(vs[0, h], labels[0, h, 4:ws], v[0, h, 4:ws].astype(np.float64))
    index = DoublePIndex(centroids=np.zeros((B, Hkv, C, D)), sizes=sizes.astype(np.int64),
                         value_sums=vs, labels=labels, seq_lens=lens[:1].astype(np.int64),
                         window_start=np.array([ws]), n_sink=4, window=32, n_clusters=C,
                         n_initialized=np.full((B, Hkv), C))
    inst = (q, k, v, lens[:1], index)
    for mass in ("paper", "exact", "sub", "mean"):
        for p1, p2 in ((0.5, 0.25), (0.95, 0.7), (0.6, 0.3)):
            sel = _compare(inst, mass, "mean", p1, p2)
            assert sel[0, 0][0] == sorted(sel[0, 0][0])


def test_decode_index_batched_matches_decode_index():
    # The study's index (k-means of the prompt, every later token at once) against the
    # harness's decode_index (reference k-means, one append per row), and the per-row
    # statistics table against the reference's statistics of each row's clusters.
    from stochattn.eval.llm.evaluate import decode_index

    rng = np.random.default_rng(7)
    Hkv, T, D = 2, 360, 16
    K = rng.standard_normal((Hkv, T, D))
    V = rng.standard_normal((Hkv, T, D))
    prefill = 200
    lens = np.arange(prefill + 1, T + 1, 16)
    P = lens.size
    kc = np.ascontiguousarray(np.broadcast_to(K[None], (P, Hkv, T, D)))
    vc = np.ascontiguousarray(np.broadcast_to(V[None], (P, Hkv, T, D)))
    for C in (8, 200):  # 200 > the prompt's 132 middle tokens: appends seed clusters
        ref = decode_index(kc, vc, lens.astype(np.int32), prefill=prefill, n_clusters=C,
                           iterations=10, seed=3)
        li = mb.decode_index_batched(np, K, V, lens, prefill=prefill, n_clusters=C, seed=3)
        # a cluster's centroid never moves once set (later rows may have seeded more)
        for i in range(P):
            live = ref.sizes[i] > 0
            np.testing.assert_allclose(li.centroids[live], ref.centroids[i][live], rtol=1e-12,
                                       atol=1e-12)
        np.testing.assert_array_equal(li.sizes, ref.sizes)
        np.testing.assert_array_equal(li.ws, ref.window_start)
        for i in range(P):
            L = int(lens[i])
            lab = np.where(np.arange(L) < ref.window_start[i], li.labels[:, :L], -1)
            np.testing.assert_array_equal(lab, ref.labels[i][:, :L])
        li.add_stats()
        st = cm.index_stats(kc, vc, lens, ref)
        for f in ("mean", "var", "eig", "radius"):
            got = li.stats[f][li.state]
            np.testing.assert_allclose(got, getattr(st, f), rtol=1e-8, atol=1e-10, err_msg=f)
        np.testing.assert_allclose(li.stats["vmean"][li.state], ref.value_means, rtol=1e-9,
                                   atol=1e-12)


def test_decode_rows_matches_reference_on_the_harness_layout():
    # decode_rows (shared exact cache, each row's own key/value at its position) against
    # the reference on the harness's per-row caches, as mass_study's run_play calls it.
    from stochattn.eval.llm.evaluate import decode_index

    rng = np.random.default_rng(8)
    Hkv, G, T, D = 2, 3, 330, 16
    K = rng.standard_normal((Hkv, T, D))
    V = rng.standard_normal((Hkv, T, D))
    prefill = 200
    pos = np.arange(prefill, T - 1, 9)
    P = pos.size
    q = 2 * rng.standard_normal((P, Hkv * G, D))
    k_own = rng.standard_normal((P, Hkv, D))
    v_own = rng.standard_normal((P, Hkv, D))
    n = int(pos[-1]) + 1
    kc = np.ascontiguousarray(np.broadcast_to(K[None, :, :n], (P, Hkv, n, D)))
    vc = np.ascontiguousarray(np.broadcast_to(V[None, :, :n], (P, Hkv, n, D)))
    lens = pos + 1
    index = decode_index(kc, vc, lens.astype(np.int32), prefill=prefill, n_clusters=12,
                         iterations=10)
    st = cm.index_stats(kc, vc, lens, index)
    kc[np.arange(P), :, pos] = k_own
    vc[np.arange(P), :, pos] = v_own
    li = mb.decode_index_batched(np, K[:, :n], V[:, :n], lens, prefill=prefill,
                                 n_clusters=12).add_stats()
    for mass, value, alpha in (("paper", "mean", 1.0), ("sub", "mean", 1.0),
                               ("exact", "mean", 1.0), ("pca-clip", "mean", 0.5),
                               ("sub", "sub", 1.0), ("sub", "tilt", 1.0)):
        for p1, p2 in SETTINGS[:3]:
            ref_out, ref_d = doublep_attention(q, kc, vc, lens, index, p1=p1, p2=p2,
                                               approx="centroid", budget=None,
                                               sampler="systematic", seed=0, offset=0,
                                               scale=0.25, mass=mass, value=value,
                                               mass_alpha=alpha, mass_stats=st,
                                               mass_diagnostics=True)
            out, d = mb.decode_rows(np, li, q, k_own, v_own, pos, 0, P, mass=mass, value=value,
                                    alpha=alpha, p1=p1, p2=p2, scale=0.25)
            np.testing.assert_allclose(out, ref_out, rtol=1e-7, atol=1e-7)
            for key in ("clusters_selected", "clusters_exact", "k_rows_read", "k_index_rows",
                        "v_index_rows"):
                np.testing.assert_array_equal(d[key], ref_d[key], err_msg=key)
            for key in ("true_mass", "cluster_true_mass", "approx_log_mass_error"):
                np.testing.assert_allclose(d[key], ref_d[key], rtol=1e-7, atol=1e-7, err_msg=key)


def _cupy():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        return None


@pytest.mark.skipif(_cupy() is None, reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("mass,value,alpha", [("paper", "mean", 1.0), ("sub", "sub", 1.0),
                                              ("exact", "mean", 1.0), ("pca-clip", "mean", 0.5)])
def test_cupy_matches_numpy(mass, value, alpha):
    # The same code on CuPy (its own statistics, sorts and scans) against NumPy's batched
    # path, which the tests above tie to the reference: same selections, same outputs.
    cp = _cupy()
    for inst in (_random(seed=9), _planted(seed=10)):
        q, k, v, lens, index = inst
        for p1, p2 in SETTINGS[:3]:
            kw = dict(p1=p1, p2=p2, scale=0.25, mass=mass, value=value, mass_alpha=alpha,
                      mass_diagnostics=True)
            out, d = mb.doublep_batched(q, k, v, lens, index, **kw)
            out_g, d_g = mb.doublep_batched(q, k, v, lens, index, xp=cp, **kw)
            np.testing.assert_array_equal(cp.asnumpy(d_g["code"]), d["code"])
            np.testing.assert_allclose(cp.asnumpy(out_g), out, rtol=1e-7, atol=1e-7)
            for key in ("true_mass", "cluster_true_mass", "approx_log_mass_error"):
                np.testing.assert_allclose(cp.asnumpy(d_g[key]), d[key], rtol=1e-7, atol=1e-7)


@pytest.mark.skipif(_cupy() is None, reason="needs CuPy and a CUDA GPU")
def test_cupy_decode_rows_matches_numpy():
    cp = _cupy()
    rng = np.random.default_rng(11)
    Hkv, G, T, D = 2, 3, 330, 16
    K = rng.standard_normal((Hkv, T, D))
    V = rng.standard_normal((Hkv, T, D))
    pos = np.arange(200, T - 1, 9)
    P = pos.size
    q = 2 * rng.standard_normal((P, Hkv * G, D))
    ko = rng.standard_normal((P, Hkv, D))
    vo = rng.standard_normal((P, Hkv, D))
    n = int(pos[-1]) + 1
    li = mb.decode_index_batched(np, K[:, :n], V[:, :n], pos + 1, prefill=200,
                                 n_clusters=12).add_stats()
    lg = mb.decode_index_batched(cp, cp.asarray(K[:, :n]), cp.asarray(V[:, :n]), pos + 1,
                                 prefill=200, n_clusters=12).add_stats()
    np.testing.assert_array_equal(cp.asnumpy(lg.sizes), li.sizes)
    np.testing.assert_array_equal(cp.asnumpy(lg.labels), li.labels)
    for mass, value, alpha in (("sub", "sub", 1.0), ("pca-clip", "mean", 0.5),
                               ("exact", "mean", 1.0)):
        out, d = mb.decode_rows(np, li, q, ko, vo, pos, 0, P, mass=mass, value=value,
                                alpha=alpha, p1=0.95, p2=0.7, scale=0.25)
        og, dg = mb.decode_rows(cp, lg, cp.asarray(q), cp.asarray(ko), cp.asarray(vo),
                                cp.asarray(pos), 0, P, mass=mass, value=value, alpha=alpha,
                                p1=0.95, p2=0.7, scale=0.25)
        np.testing.assert_array_equal(cp.asnumpy(dg["code"]), d["code"])
        np.testing.assert_allclose(cp.asnumpy(og), out, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("mass,value", [("paper", "mean"), ("paper", "tilt"), ("sub", "tilt")])
@pytest.mark.parametrize("p1,p2", SETTINGS[:3])
def test_exact_approx_weights_same_as_reference(mass, value, p1, p2):
    """approx_weight="exact": the selection is the estimate's, the pseudo-tokens' logits the
    true log Z_i, and the keys of C_approx count as read (K only)."""
    _compare(_random(), mass, value, p1, p2, approx_weight="exact")


@pytest.mark.parametrize("margin", [0.0, 1.5, 3.0, 50.0])
@pytest.mark.parametrize("p1,p2", SETTINGS[:3])
def test_sub_near_same_as_reference(margin, p1, p2):
    """mass="sub-near": the same selection, output and reads (the refined clusters'
    sub-centroids counted) as the reference."""
    _compare(_random(), "sub-near", "mean", p1, p2, margin=margin)
