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
