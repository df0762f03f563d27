"""Double-P's sub-centroid mass as an index option (issue 31), on the host: the index
fields of ``build_doublep_index(..., mass="sub")``, their append rule, the plan option
``mass="sub"`` against the reference estimator, the batched (xp) sub-centroid statistics
the GPU build runs, and the kernels' name expressions (tests/gpu/test_cuda_doublep_sub.py
runs the GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import stochattn
from stochattn.cuda import kernels
from stochattn.doublep import DoublePIndex, build_doublep_index
from stochattn.eval import mass_batched as mb
from stochattn.reference import cluster_mass as cm
from stochattn.reference import doublep as ref_dp


def inputs(B=2, Hkv=2, G=2, N=300, D=16, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, Hkv, N, D))
    v = rng.standard_normal((B, Hkv, N, D))
    q = rng.standard_normal((B, Hkv * G, D)) * 2
    return q, k, v


def canonical(means, sizes):
    """The parts of each cluster sorted (by size, then mean): a split up to its order."""
    key = np.concatenate([np.asarray(sizes, dtype=np.float64)[..., None],
                          np.asarray(means, dtype=np.float64)], axis=-1)
    flat = key.reshape(-1, *key.shape[-2:])
    return np.stack([np.array(sorted(map(tuple, f))) for f in flat]).reshape(key.shape)


def test_build_sub_stores_the_reference_split():
    q, k, v = inputs()
    lens = np.array([300, 211])
    index = build_doublep_index(k, v, lens, n_clusters=16, mass="sub")
    st = cm.index_stats(k, v, lens, index, rank=0, n_sub=4)
    np.testing.assert_array_equal(index.sub_sizes, st.sub_sizes)
    np.testing.assert_array_equal(index.sub_centroids, st.sub_means)
    np.testing.assert_array_equal(index.sub_sizes.sum(-1), index.sizes)
    assert index.mass == "sub"
    paper = build_doublep_index(k, v, lens, n_clusters=16)
    assert paper.mass == "paper" and paper.sub_centroids is None and paper.sub_sizes is None
    for f in ("centroids", "sizes", "value_sums", "labels", "window_start", "n_initialized"):
        np.testing.assert_array_equal(getattr(paper, f), getattr(index, f))


def test_build_options_are_checked():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="`mass`"):
        build_doublep_index(k, v, n_clusters=8, mass="pca")
    with pytest.raises(ValueError, match="`n_sub`"):
        build_doublep_index(k, v, n_clusters=8, mass="sub", n_sub=3)


@pytest.mark.parametrize("approx", ["centroid", "sample"])
@pytest.mark.parametrize("p1, p2", [(0.95, 0.7), (0.8, 0.5), (1.0, 1.0)])
def test_plan_sub_equals_the_reference_estimator(approx, p1, p2):
    q, k, v = inputs(seed=1)
    lens = np.array([300, 123])
    index = build_doublep_index(k, v, lens, n_clusters=16, mass="sub")
    budget = 16 if approx == "sample" else None
    got, gd = stochattn.doublep_attention(q, k, v, lens, index=index, p1=p1, p2=p2,
                                          approx=approx, budget=budget, seed=3, mass="sub",
                                          return_diagnostics=True)
    st = cm.index_stats(k, v, lens, index, rank=4, n_sub=4)
    want, wd = ref_dp.doublep_attention(q, k, v, lens, index, p1=p1, p2=p2, approx=approx,
                                        budget=budget, sampler="systematic", seed=3, offset=0,
                                        scale=0.25, mass="sub", mass_stats=st)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(gd.clusters_selected, wd["clusters_selected"])
    np.testing.assert_array_equal(gd.clusters_exact, wd["clusters_exact"])
    paper = stochattn.doublep_attention(q, k, v, lens, index=index, p1=p1, p2=p2, approx=approx,
                                        budget=budget, seed=3)
    plain = build_doublep_index(k, v, lens, n_clusters=16)
    np.testing.assert_array_equal(paper, stochattn.doublep_attention(
        q, k, v, lens, index=plain, p1=p1, p2=p2, approx=approx, budget=budget, seed=3))


def test_sub_decode_needs_a_sub_index():
    q, k, v = inputs()
    index = build_doublep_index(k, v, n_clusters=8)
    with pytest.raises(ValueError, match=r"`index` has no sub-centroids"):
        stochattn.doublep_attention(q, k, v, index=index, mass="sub")
    with pytest.raises(ValueError, match="`mass`"):
        stochattn.DoublePPlan(mass="exact")
    assert stochattn.DoublePPlan(mass="sub").options()["mass"] == "sub"


def test_sub_only_stats_hold_nothing_else():
    means, sizes = np.ones((3, 4, 5)), np.array([[1, 0, 2, 0]] * 3)
    st = cm.sub_only_stats(means, sizes)
    assert st.rank == 0 and st.n_sub == 4
    assert np.isnan(st.mean).all() and np.isnan(st.sub_values).all()
    np.testing.assert_array_equal(st.sub_means, means)
    with pytest.raises(ValueError, match="`sub_sizes`"):
        cm.sub_only_stats(means, sizes[:, :3])


def test_append_joins_the_nearest_sub_centroid_and_seeds_part_zero():
    """More clusters than prompt middle tokens: appends seed clusters (part 0 = the seeding
    key) and join the rest to their nearest sub-centroid; one token at a time gives the
    same arrays as one bulk append; the parts' sizes keep summing to the cluster sizes."""
    q, k, v = inputs(N=400, seed=2)
    start = np.array([40, 30])
    index = build_doublep_index(k, v, start, n_clusters=40, window=32, mass="sub")
    before = DoublePIndex.stack([index])
    index.append(k, v, np.array([400, 333]))
    np.testing.assert_array_equal(index.sub_sizes.sum(-1), index.sizes)
    seeded = (before.sizes == 0) & (index.sizes > 0)
    assert seeded.any()
    np.testing.assert_array_equal(index.sub_centroids[seeded][:, 0], index.centroids[seeded])
    # The rule by hand for a joining token of an old cluster.
    b, h = 0, 1
    t = int(before.window_start[b])
    c = int(index.labels[b, h, t])
    live = np.flatnonzero(before.sub_sizes[b, h, c] > 0)
    if live.size:
        d = ((k[b, h, t] - before.sub_centroids[b, h, c, live]) ** 2).sum(-1)
        a = live[np.argmin(d)]
        assert index.sub_sizes[b, h, c, a] > before.sub_sizes[b, h, c, a]
    step = before
    lens = start.copy()
    while (lens < [400, 333]).any():
        lens = np.minimum(lens + 7, [400, 333])
        step.append(k, v, lens)
    np.testing.assert_array_equal(step.sub_sizes, index.sub_sizes)
    np.testing.assert_array_equal(step.sub_centroids, index.sub_centroids)


def test_stack_keeps_the_sub_centroids():
    q, k, v = inputs()
    a = build_doublep_index(k[:1], v[:1], n_clusters=8, mass="sub")
    s = DoublePIndex.stack([a, a])
    assert s.sub_centroids.shape[0] == 2
    np.testing.assert_array_equal(s.sub_sizes[1], a.sub_sizes[0])
    plain = build_doublep_index(k[:1], v[:1], n_clusters=8)
    assert DoublePIndex.stack([a, plain]).sub_centroids is None


def test_batched_sub_stats_match_the_reference_split():
    """What the GPU build runs (mass_batched.sub_stats, here with NumPy through the GPU
    module's own entry point on a host index): the reference's parts up to their order;
    sizes equal, means to float32 storage."""
    from stochattn.cuda.doublep_sub import sub_stats_gpu

    q, k, v = inputs(N=500, D=32, seed=4)
    k = k.astype(np.float32)
    lens = np.array([500, 377])
    index = build_doublep_index(k, v.astype(np.float32), lens, n_clusters=24, mass="sub")
    means, sizes = sub_stats_gpu(index, k, 4)
    assert means.dtype == np.float32 and sizes.dtype == np.int32
    a, b = canonical(means, sizes), canonical(index.sub_centroids, index.sub_sizes)
    np.testing.assert_array_equal(a[..., 0], b[..., 0])
    assert np.abs(a - b).max() <= 1e-6 * np.abs(k).max()
    # and equal to the full batched statistics' sub fields (state_stats), bit for bit
    full = mb.index_stats_batched(np, k, v, lens, index, rank=0, n_sub=4)
    np.testing.assert_array_equal(full["sub_sizes"], sizes)
    np.testing.assert_array_equal(full["sub_means"].astype(np.float32), means)


def test_name_expressions_list_the_sub_logits():
    names = kernels.name_expressions("doublep_decode")
    for m in kernels.DOUBLEP_SUB_COUNTS:
        assert f"doublep_cluster_logits_sub<stochattn::f16, 128, 8, {m}>" in names
        assert f"doublep_cluster_logits_sub<stochattn::bf16, 64, 4, {m}>" in names
