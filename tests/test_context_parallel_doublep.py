"""Context-parallel Double-P (issue 35): the sampled variant and appends, on the reference,
ranks simulated in one process (docs/context_parallel.md).

Equal bit for bit: the sampled variant's selection (the union index's), its drawn
positions and output at R = 1 (the single device's), and at any R its drawn positions
except a point within rounding of a token boundary of the single device's CDF over C_approx
(asserted per point, and the check is shown to catch a point moved inside a token); the
appended indexes: R = 1 against ``DoublePIndex.append``, many tokens at once against one
at a time, the union index against the single-device append rule with each token limited
to its own rank's clusters. Equal to tolerance (``_close``, test_context_parallel.py): the
outputs at R > 1.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from stochattn import context_parallel as cp
from stochattn.doublep import DoublePIndex
from stochattn.reference.doublep import doublep_attention
from stochattn.reference.kmeans import build_index
from stochattn.reference.rng import PURPOSE_CLUSTER_SAMPLER
from stochattn.reference.samplers import sample_points
from test_context_parallel import (C, DP_LENS, DP_SPLITS, N, NS, SCALE, WIN, _close, _inputs,
                                   _shards)

S = 13  # budget of the sampled variant
SAMPLED = dict(approx="sample", budget=S, seed=3, offset=2)


def _points(sampler, B, Hq):
    rows = np.arange(B * Hq).reshape(B, Hq)
    return sample_points(sampler, S, seed=SAMPLED["seed"], offset=SAMPLED["offset"], row=rows,
                         stream=0, purpose=PURPOSE_CLUSTER_SAMPLER, heads=Hq)


def _ref_sample(q, k, v, lens, index, p1, p2, sampler):
    full = np.full(q.shape[0], k.shape[2]) if lens is None else lens
    return doublep_attention(q, k, v, full, index, p1=p1, p2=p2, sampler=sampler, scale=SCALE,
                             token_sets=True, **SAMPLED)


def _moved_only_on_token_boundaries(moved, q, k, lens, token_set, points) -> bool:
    """Every moved point's target T Z_A lies within 1e-12 Z_A of a token boundary of the
    single device's CDF over C_approx (its tokens in ascending position, weights shifted
    by the max over the exact and C_approx logits, as the reference forms them)."""
    G = q.shape[1] // k.shape[1]
    for b, h, i in np.argwhere(moved):
        L = k.shape[2] if lens is None else int(lens[b])
        x = (np.asarray(k[b, h // G, :L], dtype=np.float64) @ q[b, h]) * SCALE
        ts = token_set[b, h, :L]
        xe, xa = x[ts == 1], x[np.flatnonzero(ts == 2)]
        c = np.cumsum(np.exp(xa - max(xe.max(initial=-np.inf), xa.max(initial=-np.inf))))
        if not c.size or np.abs(c - points[b, h, i] * c[-1]).min() > 1e-12 * c[-1]:
            return False
    return True


# ---- the sampled variant --------------------------------------------------------------------

@pytest.mark.parametrize("R, bounds", DP_SPLITS)
@pytest.mark.parametrize("li", range(len(DP_LENS)))
@pytest.mark.parametrize("sampler", ["systematic", "stratified", "iid"])
@pytest.mark.parametrize("p1, p2", [(0.9, 0.6), (0.99, 0.2), (0.9, 1.0)])
def test_sample_draws_the_union_index_points(R, bounds, li, sampler, p1, p2):
    """The selection and tokens_exact are the union index's; the drawn positions are the
    reference's (p2 = 1: C_approx empty, nothing drawn, -1 as the reference); R = 1 is the
    single device bit for bit; four collectives, the second 3 floats per (b, h)."""
    q, k, v = _inputs(seed=60 + li)
    lens = DP_LENS[li]
    sh = _shards(R, bounds, k, v, lens, align=1)
    ixs = cp.build_shard_indexes(sh, n_clusters=C, iterations=4, n_sink=NS, window=WIN, seed=7)
    comm = cp.SimulatedCollectives(R)
    res = cp.cp_doublep_attention(q, sh, ixs, comm, SCALE, p1=p1, p2=p2, n_sink=NS,
                                  window=WIN, sampler=sampler, **SAMPLED)
    union = cp.union_index(sh, ixs, n_sink=NS, window=WIN)
    want, diag = _ref_sample(q, k, v, lens, union, p1, p2, sampler)
    for key in ("clusters_selected", "clusters_exact", "tokens_exact"):
        np.testing.assert_array_equal(res.diagnostics[key], diag[key])
    moved = res.indices != diag["sample_indices"]
    assert _moved_only_on_token_boundaries(moved, q, k, lens, diag["token_set"],
                                           _points(sampler, *q.shape[:2]))
    if R == 1:
        np.testing.assert_array_equal(res.indices, diag["sample_indices"])
        np.testing.assert_array_equal(res.out, want)
    elif not moved.any():  # a moved point changes its row's estimate by one V row
        _close(res.out, want, v)
    if p2 == 1.0:
        assert (res.indices == -1).all()
    assert all(np.array_equal(o, res.out) for o in res.outs)
    B, Hq, D = q.shape
    assert comm.log == [("all_gather", B * Hq * C * 8), ("all_gather", B * Hq * 3 * 8),
                        ("all_gather", B * Hq * (D + 2) * 8), ("all_reduce_max", B * Hq)]


def test_the_token_boundary_check_catches_a_point_moved_inside_a_token():
    q, k, v = _inputs(seed=60)
    sh = _shards(1, None, k, v, None, align=1)
    ixs = cp.build_shard_indexes(sh, n_clusters=C, iterations=4, n_sink=NS, window=WIN, seed=7)
    _, diag = _ref_sample(q, k, v, None, cp.union_index(sh, ixs, n_sink=NS, window=WIN),
                          0.99, 0.2, "systematic")
    moved = np.zeros(diag["sample_indices"].shape, dtype=bool)
    moved[0, 0, 5] = True
    assert (diag["token_set"][0, 0] == 2).sum() > 1  # the row has a CDF of several tokens
    assert not _moved_only_on_token_boundaries(moved, q, k, None, diag["token_set"],
                                               _points("systematic", *q.shape[:2]))


def test_sample_gqa_groups_of_four_and_peaked_rows():
    q, k, v = _inputs(B=2, Hkv=2, G=4, seed=64)
    q *= 3.0  # peaked: C_approx's mass sits in a few tokens
    for R in (2, 4):
        sh = _shards(R, None, k, v, None, align=1)
        ixs = cp.build_shard_indexes(sh, n_clusters=C, iterations=4, n_sink=NS, window=WIN,
                                     seed=7)
        res = cp.cp_doublep_attention(q, sh, ixs, cp.SimulatedCollectives(R), SCALE, p1=0.99,
                                      p2=0.2, n_sink=NS, window=WIN, sampler="iid", **SAMPLED)
        union = cp.union_index(sh, ixs, n_sink=NS, window=WIN)
        want, diag = _ref_sample(q, k, v, None, union, 0.99, 0.2, "iid")
        moved = res.indices != diag["sample_indices"]
        assert _moved_only_on_token_boundaries(moved, q, k, None, diag["token_set"],
                                               _points("iid", *q.shape[:2]))
        assert not moved.any()  # none on these inputs; a moved point would be legitimate
        _close(res.out, want, v)


def test_centroid_collectives():
    q, k, v = _inputs(seed=65)
    sh = _shards(3, None, k, v, None, align=1)
    ixs = cp.build_shard_indexes(sh, n_clusters=C, iterations=4, n_sink=NS, window=WIN, seed=7)
    comm = cp.SimulatedCollectives(3)
    res = cp.cp_doublep_attention(q, sh, ixs, comm, SCALE, p1=0.9, p2=0.6, n_sink=NS,
                                  window=WIN)
    assert res.indices is None
    B, Hq, D = q.shape
    assert comm.log == [("all_gather", B * Hq * C * 8), ("all_gather", B * Hq * (D + 2) * 8),
                        ("all_reduce_max", B * Hq)]


@pytest.mark.parametrize("kw, match", [
    (dict(approx="topk"), "`approx` must be one of"),
    (dict(approx="sample"), r"`budget` must be an int >= 1 with approx='sample', got None"),
    (dict(approx="sample", budget=0), "`budget` must be an int >= 1"),
    (dict(approx="sample", budget=4.0), "`budget` must be an int >= 1"),
    (dict(approx="centroid", budget=4), "`budget` is read by approx='sample' only"),
    (dict(approx="sample", budget=4, sampler="sobol"), "`sampler` must be one of"),
])
def test_decode_options_are_checked(kw, match):
    q, k, v = _inputs()
    sh = _shards(2, None, k, v, None, align=1)
    ixs = cp.build_shard_indexes(sh, n_clusters=C, iterations=1, n_sink=NS, window=WIN, seed=7)
    comm = cp.SimulatedCollectives(2)
    with pytest.raises(ValueError, match=match):
        cp.cp_doublep_attention(q, sh, ixs, comm, SCALE, p1=0.9, p2=0.6, n_sink=NS,
                                window=WIN, **kw)
    assert comm.log == []  # refused before any collective


# ---- appends ---------------------------------------------------------------------------------

N2 = N + 12  # the cache grows past the build's N: the last shard grows
L0, L1 = np.array([150, 40, 9]), np.array([N2, 125, 31])
# Growth from L0 to L1 moves the window start 130 -> 195, 20 -> 105, 4 -> 11, so the
# absorbed tokens cross rank boundaries (100; 150; 40 and 160 below). Sequence 2 has no
# middle at L0: its first tokens seed clusters (6 of its 7).
GROW_SPLITS = [
    (1, None),
    (2, [0, 100, N]),
    (3, [0, 2, 150, N]),  # the sinks straddle ranks 0 and 1; rank 1 seeds sequence 2
    (4, [0, 60, 60, 200, N]),  # an empty rank; at L1 sequence 0's window straddles 2 and 3
    (4, [0, 40, 120, 160, N]),  # sequence 1 ends at rank 0's end and grows into rank 1;
                                # at L1 its window straddles ranks 1 and 2
]


def _grown_cache(seed=70):
    q, k, v = _inputs(n=N2, seed=seed)
    return q, k, v


def _split(k, v, lens, R, bounds, n):
    b = cp.shard_bounds(N, R, boundaries=bounds)
    b = np.append(b[:-1], n)  # the last shard ends where the cache ends
    return cp.split_cache(k[:, :, :n], v[:, :, :n], lens, b)


def _build(k, v, R, bounds):
    sh = _split(k, v, L0, R, bounds, N)
    return sh, cp.build_shard_indexes(sh, n_clusters=C, iterations=4, n_sink=NS, window=WIN,
                                      seed=7)


def _steps():
    """Lengths one token at a time from L0 to L1 (every sequence grows while short of L1)."""
    out, lens = [], L0.copy()
    while (lens < L1).any():
        lens = np.minimum(lens + 1, L1)
        out.append(lens.copy())
    return out


def _grow(k, v, R, bounds, one_at_a_time):
    sh0, ixs = _build(k, v, R, bounds)
    before = copy.deepcopy(ixs)
    for lens in (_steps() if one_at_a_time else [L1]):
        cp.cp_doublep_append(_split(k, v, lens, R, bounds, N2), ixs, n_sink=NS, window=WIN)
    return sh0, before, _split(k, v, L1, R, bounds, N2), ixs


KEYS = ("centroids", "sizes", "value_sums", "labels", "n_initialized", "window_start",
        "seq_lens")


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_append_one_rank_is_the_single_device_append(one_at_a_time):
    q, k, v = _grown_cache()
    _, _, _, ixs = _grow(k, v, 1, None, one_at_a_time)
    ref = build_index(k[:, :, :N], v[:, :, :N], L0, C, 4, NS, WIN, 7)
    index = DoublePIndex(centroids=ref["centroids"], sizes=ref["sizes"],
                         value_sums=ref["value_sums"], labels=ref["labels"], seq_lens=L0,
                         window_start=ref["window_start"], n_sink=NS, window=WIN, n_clusters=C,
                         n_initialized=ref["n_initialized"])
    index.append(k, v, L1)
    for key in KEYS:
        np.testing.assert_array_equal(ixs[0][key], getattr(index, key))
    assert index.n_initialized[2].tolist() == [C, C]  # sequence 2 seeded every cluster


@pytest.mark.parametrize("R, bounds", GROW_SPLITS)
def test_append_many_at_once_is_one_at_a_time(R, bounds):
    q, k, v = _grown_cache()
    *_, bulk = _grow(k, v, R, bounds, False)
    *_, single = _grow(k, v, R, bounds, True)
    for a, b in zip(bulk, single):
        for key in KEYS:
            np.testing.assert_array_equal(a[key], b[key])


def _union_append_rule(union, n_init, owner, k, v):
    """The single-device append rule (``reference.kmeans.append_tokens``) on the union
    index, each token limited to its own rank's clusters ``[r C, (r + 1) C)``: in position
    order it seeds its rank's next cluster while one has no centroid, else joins the
    nearest live centroid of its rank (|c|^2 - 2 k.c, ties to the lower index)."""
    cent, sizes, vs = union.centroids.copy(), union.sizes.copy(), union.value_sums.copy()
    labels = np.full(union.labels.shape[:2] + (N2,), -1, dtype=union.labels.dtype)
    labels[..., :union.labels.shape[-1]] = union.labels
    n_init = [x.copy() for x in n_init]
    new_ws = np.maximum(NS, L1 - WIN)
    for b in range(k.shape[0]):
        for h in range(k.shape[1]):
            for t in range(int(union.window_start[b]), int(new_ws[b])):
                r = owner(t)
                own = cent[b, h, r * C:(r + 1) * C]
                if n_init[r][b, h] < C:
                    i = int(n_init[r][b, h])
                    own[i] = k[b, h, t]
                    n_init[r][b, h] += 1
                else:
                    i = int(np.argmin(np.sum(own * own, axis=-1) - 2.0 * (own @ k[b, h, t])))
                labels[b, h, t] = r * C + i
                sizes[b, h, r * C + i] += 1
                vs[b, h, r * C + i] += v[b, h, t]
    return cent, sizes, vs, labels, n_init


@pytest.mark.parametrize("R, bounds", GROW_SPLITS)
def test_append_union_index_follows_the_single_device_rule_on_own_clusters(R, bounds):
    q, k, v = _grown_cache()
    sh0, before, sh1, ixs = _grow(k, v, R, bounds, False)
    union0 = cp.union_index(sh0, before, n_sink=NS, window=WIN)
    union1 = cp.union_index(sh1, ixs, n_sink=NS, window=WIN)
    starts = [s.start for s in sh1]
    owner = lambda t: max(r for r in range(R) if starts[r] <= t and sh1[r].end > t)  # noqa: E731
    cent, sizes, vs, labels, n_init = _union_append_rule(
        union0, [ix["n_initialized"] for ix in before], owner, k, v)
    np.testing.assert_array_equal(union1.centroids, cent)
    np.testing.assert_array_equal(union1.sizes, sizes)
    np.testing.assert_array_equal(union1.value_sums, vs)
    np.testing.assert_array_equal(union1.labels, labels)
    for r in range(R):
        np.testing.assert_array_equal(ixs[r]["n_initialized"], n_init[r])
    np.testing.assert_array_equal(union1.window_start, np.maximum(NS, L1 - WIN))
    assert (sizes.sum(axis=-1) == (union1.window_start - NS)[:, None]).all()  # each token once
    if R > 1:  # not vacuous: for some tokens the nearest of all ranks' clusters is elsewhere
        elsewhere = 0
        for b in range(k.shape[0]):
            t = np.arange(union0.window_start[b], union1.window_start[b])
            for h in range(k.shape[1]):
                sc = np.sum(cent[b, h] ** 2, axis=-1) - 2.0 * (k[b, h, t] @ cent[b, h].T)
                sc[:, sizes[b, h] == 0] = np.inf
                elsewhere += (np.argmin(sc, axis=-1) // C != labels[b, h, t] // C).sum()
        assert elsewhere > 0


@pytest.mark.parametrize("R, bounds", GROW_SPLITS)
@pytest.mark.parametrize("approx", ["centroid", "sample"])
def test_decode_after_appends_is_the_union_index_one(R, bounds, approx):
    q, k, v = _grown_cache()
    *_, sh1, ixs = _grow(k, v, R, bounds, False)
    union = cp.union_index(sh1, ixs, n_sink=NS, window=WIN)
    kw = dict(SAMPLED, sampler="stratified") if approx == "sample" else {}
    res = cp.cp_doublep_attention(q, sh1, ixs, cp.SimulatedCollectives(R), SCALE, p1=0.99,
                                  p2=0.3, n_sink=NS, window=WIN, **kw)
    want, diag = doublep_attention(q, k, v, L1, union, p1=0.99, p2=0.3, scale=SCALE,
                                   token_sets=True, **(kw or dict(approx="centroid",
                                                                  budget=None,
                                                                  sampler="systematic",
                                                                  seed=0, offset=0)))
    for key in ("clusters_selected", "clusters_exact", "tokens_exact"):
        np.testing.assert_array_equal(res.diagnostics[key], diag[key])
    if approx == "sample":
        moved = res.indices != diag["sample_indices"]
        assert _moved_only_on_token_boundaries(moved, q, k, L1, diag["token_set"],
                                               _points("stratified", *q.shape[:2]))
        assert (diag["sample_indices"] >= 0).any()
        if moved.any():
            return
    if R == 1:
        np.testing.assert_array_equal(res.out, want)
    _close(res.out, want, v)


def test_append_errors_name_the_argument():
    q, k, v = _grown_cache()
    sh, ixs = _build(k, v, 2, [0, 100, N])
    with pytest.raises(ValueError, match=r"`shards` lengths must not shrink"):
        cp.cp_doublep_append(_split(k, v, L0 - 1, 2, [0, 100, N], N), ixs, n_sink=NS,
                             window=WIN)
    with pytest.raises(ValueError, match=r"`shards\[0\]` starts at token 100"):
        cp.cp_doublep_append(sh[::-1], ixs, n_sink=NS, window=WIN)
    with pytest.raises(ValueError, match="one index per shard"):
        cp.cp_doublep_append(sh, ixs[:1], n_sink=NS, window=WIN)
    with pytest.raises(ValueError, match="`n_sink` 2 gives rank 0 2 sinks"):
        cp.cp_doublep_append(sh, ixs, n_sink=2, window=WIN)
