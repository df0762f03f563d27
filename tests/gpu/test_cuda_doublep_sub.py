"""Double-P's sub-centroid cluster mass on a real GPU (issue 31): the index build and append
of ``mass="sub"`` (stochattn/cuda/doublep_sub.py, doublep_append.cu) and the decode's
``doublep_cluster_logits_sub`` (doublep_decode.cu), against the float64 NumPy reference
run on the same index arrays (the GPU index copied to the host, its float32 sub-centroids
widened exactly).

What is asserted:
- build: the GPU's sub-centroids are the reference's split of the same clusters
  (cluster_mass.index_sub_stats on the GPU index's labels) up to the order of the parts
  (the split directions' signs are arbitrary in both): sizes equal, means within 1e-5 of
  the keys' scale (float32 storage); the sub sizes sum to the cluster sizes; the paper
  fields equal those of a paper build bit for bit;
- decode: selections and outputs as tests/gpu/test_cuda_doublep.py's ``compare`` (near-ties
  of the float32 sub mass excepted, at most 2% of rows), for the centroid variant, and for
  the sampled variant the same selections as the centroid variant's;
- paper mode unchanged: a paper decode of the sub index equals a paper decode of the paper
  index bit for bit;
- paged cache: a sub decode through the page table equals the contiguous one bit for bit;
- edges: empty and one-token clusters (more clusters than middle tokens), clusters seeded
  by an append, whose sub-centroid is then the seeding key; the GPU append's sub arrays
  equal the reference append (cluster_mass.append_sub_tokens) on the host copy, and one
  token at a time equals one bulk append.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn.cuda.doublep import doublep_decode  # noqa: E402
from stochattn.doublep import DoublePIndex, build_doublep_index  # noqa: E402
from stochattn.reference import cluster_mass as cm  # noqa: E402
from stochattn.reference import doublep as ref_dp  # noqa: E402

from gpu_helpers import to_device, to_host, to_host64  # noqa: E402
from test_cuda_doublep import (INDEX_FIELDS, MASS_TIE, OUT_TOL, clustered_inputs,  # noqa: E402
                               to_device_lens)

pytestmark = pytest.mark.gpu


def host_index_sub(index) -> DoublePIndex:
    """The GPU index as a host index, with its sub-centroids (float64, exact copies)."""
    arrays = {name: to_host(getattr(index, name)) for name in INDEX_FIELDS}
    for name in ("centroids", "value_sums"):
        arrays[name] = arrays[name].astype(np.float64)
    sub = {}
    if index.sub_centroids is not None:
        sub = dict(sub_centroids=to_host(index.sub_centroids).astype(np.float64),
                   sub_sizes=to_host(index.sub_sizes).astype(np.int64))
    return DoublePIndex(n_sink=index.n_sink, window=index.window, n_clusters=index.n_clusters,
                        **arrays, **sub)


def setup(B, Hkv, G, N, D, lens, *, C, dtype="float16", seed=0, n_sink=4, window=16,
          mass="sub"):
    q, k, v = clustered_inputs(B, Hkv, G, N, D, seed=seed)
    qd, kd, vd = (to_device(x, dtype) for x in (q, k, v))
    lens = np.asarray(lens, dtype=np.int64)
    index = build_doublep_index(kd, vd, to_device_lens(lens, kd), n_clusters=C, iterations=4,
                                n_sink=n_sink, window=window, mass=mass)
    return (qd, kd, vd), tuple(to_host64(x) for x in (qd, kd, vd)), lens, index


def canonical(means, sizes):
    """The parts of each cluster sorted (by size, then mean): the split up to its order."""
    key = np.concatenate([np.asarray(sizes, dtype=np.float64)[..., None],
                          np.asarray(means, dtype=np.float64)], axis=-1)
    flat = key.reshape(-1, *key.shape[-2:])
    out = np.stack([np.array(sorted(map(tuple, f))) for f in flat]) if flat.size else flat
    return out.reshape(key.shape)


def sub_boundaries(q64, hix, lens):
    """Per (b, h): cumulative sub-mass shares (float64) in the reference's order."""
    B, Hq, D = q64.shape
    G = Hq // hix.centroids.shape[1]
    scale = 1 / np.sqrt(D)
    st = cm.sub_only_stats(hix.sub_centroids, hix.sub_sizes)
    out = {}
    for b in range(B):
        for h in range(Hq):
            ids = np.flatnonzero(hix.sizes[b, h // G] > 0)
            x = cm.log_mass_subcentroid(q64[b, h], cm.stats_at(st, b, h // G, ids), scale)
            _, _, _, cs = ref_dp.select_clusters(x, 1.0, 1.0)
            out[b, h] = cs / cs[-1] if cs.size else cs
    return out


def near_tie(cs, n, p) -> bool:
    return any(0 < m <= len(cs) and abs(cs[m - 1] - p) < MASS_TIE for m in (n - 1, n, n + 1))


def compare_sub(qd, kd, vd, host, lens, index, *, p1=0.95, p2=0.7, dtype="float16"):
    q64, k64, v64 = host
    hix = host_index_sub(index)
    got, gd = stochattn.doublep_attention(qd, kd, vd, index=index, p1=p1, p2=p2, mass="sub",
                                          return_diagnostics=True)
    want, wd = stochattn.doublep_attention(q64, k64, v64, lens, index=hix, p1=p1, p2=p2,
                                           mass="sub", return_diagnostics=True)
    got = to_host64(got)
    same = ((gd.clusters_selected == wd.clusters_selected)
            & (gd.clusters_exact == wd.clusters_exact))
    if not same.all():
        bounds = sub_boundaries(q64, hix, lens)
        for b, h in zip(*np.nonzero(~same)):
            cs = bounds[b, h]
            ok = near_tie(cs, gd.clusters_selected[b, h], p1) and (
                gd.clusters_exact[b, h] == wd.clusters_exact[b, h]
                or near_tie(cs, gd.clusters_exact[b, h], p2))
            assert ok, (f"sub selection differs at (b={b}, h={h}) away from a near-tie: GPU "
                        f"{gd.clusters_selected[b, h]}/{gd.clusters_exact[b, h]}, reference "
                        f"{wd.clusters_selected[b, h]}/{wd.clusters_exact[b, h]}")
        assert (~same).mean() <= 0.02, f"{(~same).sum()} of {same.size} rows at near-ties"
    tol = OUT_TOL[dtype] * max(1.0, np.abs(v64).max())
    err = np.abs(got - want).max(axis=-1)
    assert np.all(err[same] <= tol), f"largest output error {err[same].max():.3g} > {tol:.3g}"
    np.testing.assert_array_equal(gd.tokens_exact[same], wd.tokens_exact[same])
    np.testing.assert_allclose(gd.estimated_mass[same], wd.estimated_mass[same], atol=1e-4)
    np.testing.assert_allclose(gd.true_mass[same], wd.true_mass[same], atol=1e-4)
    assert np.all(gd.clusters_exact <= gd.clusters_selected)
    return gd


CASES = {
    # name: (B, Hkv, G, N, D, lens, C)
    "llama-like group of 4": (2, 2, 4, 3000, 128, [3000, 2100], 96),
    "G=1, D=64": (1, 3, 1, 2500, 64, [2500], 80),
    "G=3, odd lengths": (3, 2, 3, 1777, 128, [1777, 1, 0], 50),
    "G=8, many clusters": (1, 1, 8, 5000, 128, [4999], 400),
    "empty and one-token clusters": (2, 2, 2, 40, 64, [40, 19], 30),
    "one cluster": (1, 2, 4, 600, 128, [600], 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_build_sub_is_the_reference_split(name):
    B, Hkv, G, N, D, lens, C = CASES[name]
    dev, host, lens, index = setup(B, Hkv, G, N, D, lens, C=C, seed=len(name))
    hix = host_index_sub(index)
    assert hix.sub_centroids.shape == (B, Hkv, C, 4, D)
    np.testing.assert_array_equal(hix.sub_sizes.sum(-1), hix.sizes)
    means, sizes = cm.index_sub_stats(host[1], lens, hix, n_sub=4)
    a, b = canonical(hix.sub_centroids, hix.sub_sizes), canonical(means, sizes)
    np.testing.assert_array_equal(a[..., 0], b[..., 0])
    scale = max(1.0, np.abs(host[1]).max())
    assert np.abs(a - b).max() <= 1e-5 * scale
    _, _, _, paper = setup(B, Hkv, G, N, D, lens, C=C, seed=len(name), mass="paper")
    assert paper.sub_centroids is None and paper.sub_sizes is None
    for f in INDEX_FIELDS:
        assert np.array_equal(to_host(getattr(paper, f)), to_host(getattr(index, f))), f


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("p1, p2", [(0.95, 0.7), (0.99, 0.8), (0.6, 0.9)])
def test_sub_decode_equals_reference(name, p1, p2):
    B, Hkv, G, N, D, lens, C = CASES[name]
    dev, host, lens, index = setup(B, Hkv, G, N, D, lens, C=C, seed=len(name))
    compare_sub(*dev, host, lens, index, p1=p1, p2=p2)


def test_sub_decode_bfloat16_torch():
    torch = pytest.importorskip("torch")
    dev, host, lens, index = setup(2, 2, 4, 9000, 128, [9000, 5000], C=300, dtype="bfloat16",
                                   seed=5)
    assert isinstance(index.sub_centroids, torch.Tensor)
    assert index.sub_centroids.dtype == torch.float32 and index.sub_sizes.dtype == torch.int32
    compare_sub(*dev, host, lens, index, dtype="bfloat16")


@pytest.mark.parametrize("n_sub", [2, 8])
def test_other_sub_counts(n_sub):
    q, k, v = clustered_inputs(1, 2, 4, 2000, 128, seed=4)
    qd, kd, vd = (to_device(x, "float16") for x in (q, k, v))
    index = build_doublep_index(kd, vd, n_clusters=64, iterations=4, window=16, mass="sub",
                                n_sub=n_sub)
    assert index.sub_sizes.shape[-1] == n_sub
    compare_sub(qd, kd, vd, tuple(to_host64(x) for x in (qd, kd, vd)), np.array([2000]), index)


def test_paper_mode_unchanged_on_a_sub_index():
    dev, host, lens, index = setup(2, 2, 4, 3000, 128, [3000, 2100], C=96, seed=2)
    _, _, _, paper = setup(2, 2, 4, 3000, 128, [3000, 2100], C=96, seed=2, mass="paper")
    for opts in (dict(p1=0.95, p2=0.7), dict(clusters=7),
                 dict(p1=0.9, p2=0.5, budget=32, seed=3, offset=1)):
        a = to_host(doublep_decode(*dev, index, **opts))
        b = to_host(doublep_decode(*dev, paper, **opts))
        assert np.array_equal(a, b), opts
    with pytest.raises(ValueError, match=r"`index` has no sub-centroids"):
        doublep_decode(*dev, paper, mass="sub")


def test_sampled_variant_selects_by_the_sub_mass():
    dev, host, lens, index = setup(2, 2, 4, 3000, 128, [3000, 2100], C=96, seed=6)
    _, dc = stochattn.doublep_attention(*dev, index=index, mass="sub", return_diagnostics=True)
    _, ds = stochattn.doublep_attention(*dev, index=index, mass="sub", approx="sample",
                                        budget=32, seed=1, return_diagnostics=True)
    np.testing.assert_array_equal(ds.clusters_selected, dc.clusters_selected)
    np.testing.assert_array_equal(ds.clusters_exact, dc.clusters_exact)


def test_paged_sub_decode_equals_contiguous():
    from paged_helpers import assert_bitwise, gpu_paged
    from stochattn.paged import from_contiguous

    lens = np.array([701, 0, 1, 389], dtype=np.int32)
    dev, host, _, index = setup(4, 2, 4, 701, 128, lens, C=24, seed=8)
    k32, v32 = host[1].astype(np.float32), host[2].astype(np.float32)
    for page_size, layout in ((1, "NHD"), (16, "HND"), (128, "NHD")):
        cache = gpu_paged(from_contiguous(k32, v32, lens, page_size=page_size, layout=layout,
                                          shuffle_seed=page_size, extra_pages=2), "float16")
        want = doublep_decode(*dev, index, p1=0.9, p2=0.6, mass="sub")
        got = doublep_decode(dev[0], cache, None, index, p1=0.9, p2=0.6, mass="sub")
        assert_bitwise(got, want, (page_size, layout))


def test_append_adds_tokens_to_the_nearest_sub_centroid():
    """More clusters than prompt middle tokens: the append seeds clusters (sub part 0 = the
    seeding key) and joins the rest to their nearest sub-centroid, as the reference."""
    B, Hkv, G, N, D = 2, 2, 4, 900, 64
    q, k, v = clustered_inputs(B, Hkv, G, N, D, seed=12)
    qd, kd, vd = (to_device(x, "float16") for x in (q, k, v))
    host = tuple(to_host64(x) for x in (qd, kd, vd))
    index = build_doublep_index(kd, vd, cupy.asarray([30, 50]), n_clusters=40, iterations=3,
                                n_sink=4, window=16, mass="sub")
    before = host_index_sub(index)
    new = np.array([700, 900])
    index.append(kd, vd, cupy.asarray(new))
    after = host_index_sub(index)
    want = host_index_sub(index)  # labels, centroids of the GPU append; sub from the reference
    want.sub_centroids, want.sub_sizes = before.sub_centroids.copy(), before.sub_sizes.copy()
    cm.append_sub_tokens(want.sub_centroids, want.sub_sizes, after.centroids, host[1],
                         after.labels, before.window_start, after.window_start)
    np.testing.assert_array_equal(after.sub_sizes, want.sub_sizes)
    np.testing.assert_array_equal(after.sub_centroids, want.sub_centroids)
    np.testing.assert_array_equal(after.sub_sizes.sum(-1), after.sizes)
    seeded = (before.sizes == 0) & (after.sizes > 0)
    assert seeded.any()
    np.testing.assert_array_equal(after.sub_centroids[seeded][:, 0], after.centroids[seeded])
    compare_sub(qd, kd, vd, host, new, index)
    # One token at a time: the same index.
    step = build_doublep_index(kd, vd, cupy.asarray([30, 50]), n_clusters=40, iterations=3,
                               n_sink=4, window=16, mass="sub")
    lens = np.array([30, 50])
    while (lens < new).any():
        lens = np.minimum(lens + 1, new)
        step.append(kd, vd, cupy.asarray(lens))
    one = host_index_sub(step)
    np.testing.assert_array_equal(one.sub_sizes, after.sub_sizes)
    np.testing.assert_array_equal(one.sub_centroids, after.sub_centroids)
