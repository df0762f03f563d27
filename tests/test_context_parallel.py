"""Context-parallel decode (issue 35) on the reference, ranks simulated in one process:
every split of the cache equals the unsplit output (docs/context_parallel.md).

Equal bit for bit: prop's indices (every R), flash's rows read (every R), the
Double-P index and output of one rank against the single-device ones, Double-P's global
selection against the reference's on the union index, and every output at R = 1 except
exact's and flash's. Equal to tolerance (``_close``: |diff| <= 1e-12 max|v|, float64
summation order): every output at R > 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from stochattn import context_parallel as cp
from stochattn.doublep import DoublePIndex
from stochattn.reference.doublep import cluster_scores, doublep_attention, select_clusters
from stochattn.reference.exact import exact_attention
from stochattn.reference.kmeans import build_index
from stochattn.reference.common import lengths, logits
from stochattn.reference.santa import global_points, santa_attention, tile_stats

TILE = 16
N = 203  # not a tile multiple: the last tile is partial
SCALE = 0.3


def _inputs(B=3, Hkv=2, G=2, n=N, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q = 2.0 * rng.standard_normal((B, Hkv * G, D))
    k = rng.standard_normal((B, Hkv, n, D))
    v = rng.standard_normal((B, Hkv, n, D))
    return q, k, v


def _close(got, want, v):
    """The tolerance rule: float64 outputs that differ only in summation order."""
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(v).max())


# Splits: even, uneven, empty shards in the middle and at the end, all tile-aligned.
SPLITS = [
    (1, None),
    (2, None),
    (3, None),
    (4, None),
    (2, [0, 16, N]),
    (3, [0, 0, 160, N]),  # rank 0 empty
    (4, [0, 48, 48, 192, N]),  # rank 1 empty, rank 3 one partial tile
    (4, [0, 32, 64, N, N]),  # rank 3 empty
]
# seq_lens shorter than the cache: ranks past a sequence's end hold no live token.
LENS = [None, np.array([N, 40, 0]), np.array([5, 130, 17])]


def _shards(R, bounds, k, v, lens, align=TILE):
    b = cp.shard_bounds(k.shape[2], R, boundaries=bounds, align=align)
    return cp.split_cache(k, v, lens, b)


# ---- shards and collectives ----------------------------------------------------------------

def test_shard_bounds_even_aligned_and_given():
    assert cp.shard_bounds(203, 4).tolist() == [0, 50, 101, 152, 203]
    assert cp.shard_bounds(203, 4, align=16).tolist() == [0, 48, 96, 144, 203]
    assert cp.shard_bounds(20, 4, align=16).tolist() == [0, 0, 16, 16, 20]
    assert cp.shard_bounds(10, 2, boundaries=[0, 10, 10]).tolist() == [0, 10, 10]
    with pytest.raises(ValueError, match="boundaries"):
        cp.shard_bounds(10, 2, boundaries=[0, 11, 10])
    with pytest.raises(ValueError, match="ranks"):
        cp.shard_bounds(10, 0)


def test_split_cache_views_and_local_lengths():
    q, k, v = _inputs()
    sh = cp.split_cache(k, v, np.array([N, 40, 0]), [0, 32, 100, N])
    assert [s.lens.tolist() for s in sh] == [[32, 32, 0], [68, 8, 0], [103, 0, 0]]
    np.testing.assert_array_equal(np.concatenate([s.k for s in sh], axis=2), k)
    assert all(np.shares_memory(s.v, v) for s in sh)


def test_simulated_collectives_rank_order_and_log():
    comm = cp.SimulatedCollectives(3)
    vals = [np.full(2, r, dtype=np.float64) for r in range(3)]
    g = comm.all_gather(vals)
    assert len(g) == 3 and all(np.array_equal(x, np.array([[0, 0], [1, 1], [2, 2]])) for x in g)
    assert comm.all_reduce(vals, "sum")[2].tolist() == [3, 3]
    assert comm.all_reduce(vals, "max")[0].tolist() == [2, 2]
    assert comm.log == [("all_gather", 16), ("all_reduce_sum", 16), ("all_reduce_max", 16)]
    with pytest.raises(ValueError, match="one value per rank"):
        comm.all_gather(vals[:2])
    with pytest.raises(ValueError, match="same shape"):
        comm.all_gather([np.zeros(2), np.zeros(3), np.zeros(2)])
    with pytest.raises(ValueError, match="op"):
        comm.all_reduce(vals, "min")


def test_merge_partials_of_any_partition_is_softmax():
    rng = np.random.default_rng(3)
    x, vals = 30 * rng.standard_normal(40), rng.standard_normal((40, 5))
    want = np.exp(x - x.max()) @ vals / np.exp(x - x.max()).sum()
    cuts = [0, 0, 7, 7, 25, 40]  # two empty parts
    m = np.array([x[a:b].max() if b > a else 123.0 for a, b in zip(cuts, cuts[1:])])
    w = [np.exp(x[a:b] - mm) for a, b, mm in zip(cuts, cuts[1:], m)]
    l = np.array([wi.sum() for wi in w])
    acc = np.array([wi @ vals[a:b] for wi, a, b in zip(w, cuts, cuts[1:])])
    np.testing.assert_allclose(cp.merge_partials(m, l, acc), want, rtol=1e-13)
    assert np.array_equal(cp.merge_partials(m[[0, 2]], l[[0, 2]], acc[[0, 2]]), np.zeros(5))  # nothing live


# ---- exact ----------------------------------------------------------------------------------

@pytest.mark.parametrize("R, bounds", SPLITS + [(3, [0, 1, 2, N]), (4, [0, 100, 101, 150, N])])
@pytest.mark.parametrize("li", range(len(LENS)))
def test_exact_equals_unsplit(R, bounds, li):
    q, k, v = _inputs(seed=li)
    lens = LENS[li]
    comm = cp.SimulatedCollectives(R)
    res = cp.cp_exact_attention(q, _shards(R, bounds, k, v, lens, align=1), comm, SCALE)
    want = exact_attention(q, k, v, lens, SCALE)
    _close(res.out, want, v)
    assert all(np.array_equal(o, res.out) for o in res.outs)  # every rank holds the same bits
    B, Hq, D = q.shape
    # One all-gather of (m, l, acc) per (b, h), plus the non-finite flag.
    assert comm.log == [("all_gather", B * Hq * (D + 2) * 8), ("all_reduce_max", B * Hq)]


def test_exact_non_finite_key_on_one_rank_reaches_its_group_only():
    q, k, v = _inputs()
    k[1, 0, 150, 3] = np.nan  # rank 2 of 3; heads 0 and 1 of sequence 1 read it
    want = exact_attention(q, k, v, None, SCALE)
    got = cp.cp_exact_attention(q, _shards(3, None, k, v, None), cp.SimulatedCollectives(3),
                                SCALE).out
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    _close(got[ok], want[ok], v)


@pytest.fixture
def lse_partials(monkeypatch):
    """Route every rank's exact partial through exact_partial_lse (the GPU shards' path:
    one exact_attention(return_lse=True) call per rank), here on the NumPy reference."""
    from stochattn.context_parallel import core

    monkeypatch.setattr(core, "backend_of", lambda **arrays: "cuda")


@pytest.mark.parametrize("R, bounds", SPLITS + [(3, [0, 1, 2, N])])
@pytest.mark.parametrize("li", range(len(LENS)))
def test_exact_through_lse_partials_equals_unsplit(lse_partials, R, bounds, li):
    q, k, v = _inputs(seed=li)
    lens = LENS[li]
    res = cp.cp_exact_attention(q, _shards(R, bounds, k, v, lens, align=1),
                                cp.SimulatedCollectives(R), SCALE)
    _close(res.out, exact_attention(q, k, v, lens, SCALE), v)


def test_exact_through_lse_partials_non_finite_rows(lse_partials):
    q, k, v = _inputs()
    k[1, 0, 150, 3] = np.nan  # rank 2 of 3: heads 0 and 1 of sequence 1
    q[2, 3, 0] = np.inf  # a non-finite query: its row on every rank that holds its tokens
    want = exact_attention(q, k, v, None, SCALE)
    got = cp.cp_exact_attention(q, _shards(3, None, k, v, None), cp.SimulatedCollectives(3),
                                SCALE).out
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    _close(got[ok], want[ok], v)


# ---- S²ANTA-prop ----------------------------------------------------------------------------

@pytest.mark.parametrize("R, bounds", SPLITS)
@pytest.mark.parametrize("li", range(len(LENS)))
@pytest.mark.parametrize("sampler", ["systematic", "stratified", "iid"])
def test_prop_same_indices_bit_for_bit(R, bounds, li, sampler):
    q, k, v = _inputs(seed=10 + li)
    lens = LENS[li]
    kw = dict(budget=37, sampler=sampler, tile_size=TILE, seed=5 + li, offset=3)
    comm = cp.SimulatedCollectives(R)
    res = cp.cp_prop_attention(q, _shards(R, bounds, k, v, lens), comm, SCALE, **kw)
    want = santa_attention(q, k, v, lens, SCALE, schedule="prop", **kw)
    np.testing.assert_array_equal(res.indices, want.indices)
    if R == 1:
        np.testing.assert_array_equal(res.out, want.out)
    _close(res.out, want.out, v)
    assert all(np.array_equal(o, res.out) for o in res.outs)
    B, Hq, D = q.shape
    Tmax = int(max(-(-np.diff(cp.shard_bounds(N, R, boundaries=bounds, align=TILE)) // TILE)))
    assert comm.log == [("all_gather", B * Hq * Tmax * 2 * 8), ("all_reduce_sum", B * Hq * D * 8),
                        ("all_reduce_max", B * Hq)]


@pytest.mark.parametrize("R, bounds", SPLITS)
@pytest.mark.parametrize("li", range(len(LENS)))
@pytest.mark.parametrize("sampler", ["systematic", "stratified", "iid"])
def test_prop_totals_exchange_moves_only_points_on_a_tile_boundary(R, bounds, li, sampler):
    """exchange="totals" sends 2 B Hq floats per rank; its points and indices are one
    device's except where a point lies within rounding of a tile boundary of the single
    device's prefix (the prefix is summed in another order), asserted per point; with one
    rank it is the single device bit for bit."""
    q, k, v = _inputs(seed=10 + li)
    lens = LENS[li]
    kw = dict(budget=37, sampler=sampler, tile_size=TILE, seed=5 + li, offset=3)
    comm = cp.SimulatedCollectives(R)
    res = cp.cp_prop_attention(q, _shards(R, bounds, k, v, lens), comm, SCALE,
                               exchange="totals", **kw)
    want = santa_attention(q, k, v, lens, SCALE, schedule="prop", **kw)
    moved = res.indices != want.indices
    assert _moved_only_on_boundaries(moved, q, k, lens, sampler, 37, 5 + li, 3)
    if R == 1:
        np.testing.assert_array_equal(res.indices, want.indices)
        np.testing.assert_array_equal(res.out, want.out)
    elif not moved.any():  # a moved point changes its row's mean by one V row over S
        _close(res.out, want.out, v)
    assert all(np.array_equal(o, res.out) for o in res.outs)
    B, Hq, D = q.shape
    assert comm.log == [("all_gather", B * Hq * 2 * 8), ("all_reduce_sum", B * Hq * D * 8),
                        ("all_reduce_max", B * Hq)]


def _moved_only_on_boundaries(moved, q, k, lens, sampler, S, seed, offset) -> bool:
    """Every moved point's target lies within 1e-12 Z of a tile boundary of the single
    device's prefix C."""
    if not moved.any():
        return True
    st = tile_stats(logits(q, k, lengths(lens, q.shape[0], N), SCALE), TILE)
    target = global_points(sampler, S, *q.shape[:2], seed=seed, offset=offset) * st.Z[..., None]
    gap = np.abs(st.C[..., None, :] - target[..., None]).min(axis=-1)
    return bool(np.all(gap[moved] <= 1e-12 * np.broadcast_to(st.Z[..., None], gap.shape)[moved]))


def test_the_boundary_check_catches_a_moved_point_inside_a_tile():
    """The check above is not vacuous: points moved away from any boundary fail it."""
    q, k, v = _inputs(seed=10)
    moved = np.zeros((q.shape[0], q.shape[1], 37), dtype=bool)
    moved[0, 0, 5] = True
    assert not _moved_only_on_boundaries(moved, q, k, None, "systematic", 37, 5, 3)


def test_prop_exchange_is_checked():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="`exchange`"):
        cp.cp_prop_attention(q, _shards(2, None, k, v, None), cp.SimulatedCollectives(2), SCALE,
                             budget=8, sampler="systematic", tile_size=TILE, seed=0, offset=0,
                             exchange="all")


def test_prop_gqa_groups_of_four_and_peaked_rows():
    q, k, v = _inputs(B=2, Hkv=2, G=4, seed=4)
    q *= 4.0  # peaked attention: most tiles get no point
    kw = dict(budget=8, sampler="systematic", tile_size=TILE, seed=1, offset=9)
    for R in (2, 4):
        res = cp.cp_prop_attention(q, _shards(R, None, k, v, None), cp.SimulatedCollectives(R),
                                   SCALE, **kw)
        want = santa_attention(q, k, v, None, SCALE, schedule="prop", **kw)
        np.testing.assert_array_equal(res.indices, want.indices)
        _close(res.out, want.out, v)


@pytest.mark.parametrize("fn", [cp.cp_prop_attention, cp.cp_flash_attention])
def test_tiled_schedules_refuse_a_shard_inside_a_tile(fn):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="shard 1 starts at token 50, not a multiple of tile"):
        fn(q, _shards(4, None, k, v, None, align=1), cp.SimulatedCollectives(4), SCALE,
           budget=8, sampler="systematic", tile_size=TILE, seed=0, offset=0)


# ---- S²ANTA-flash ---------------------------------------------------------------------------

@pytest.mark.parametrize("R, bounds", SPLITS)
@pytest.mark.parametrize("li", range(len(LENS)))
@pytest.mark.parametrize("sampler", ["systematic", "iid"])
def test_flash_same_rows_and_output(R, bounds, li, sampler):
    q, k, v = _inputs(seed=20 + li)
    lens = LENS[li]
    kw = dict(budget=21, sampler=sampler, tile_size=TILE, seed=2, offset=li)
    comm = cp.SimulatedCollectives(R)
    res = cp.cp_flash_attention(q, _shards(R, bounds, k, v, lens), comm, SCALE, **kw)
    want = santa_attention(q, k, v, lens, SCALE, schedule="flash", **kw)
    np.testing.assert_array_equal(res.read, want.read)
    _close(res.out, want.out, v)
    B, Hq, D = q.shape
    assert comm.log == [("all_gather", B * Hq * (D + 2) * 8), ("all_reduce_max", B * Hq)]


# ---- Double-P -------------------------------------------------------------------------------

NS, WIN, C = 4, 20, 6
DP_SPLITS = [
    (1, None),
    (2, None),
    (3, [0, 2, 150, N]),  # the sinks straddle ranks 0 and 1
    (4, [0, 60, 60, 190, N]),  # an empty rank; the window straddles ranks 2 and 3
    (4, None),
]
DP_LENS = [None, np.array([N, 70, 9])]  # sequence 1's window on rank 1 of 4; 2: no middle


def _dp(q, k, v, lens, R, bounds, p1=0.9, p2=0.6):
    sh = _shards(R, bounds, k, v, lens, align=1)
    ixs = cp.build_shard_indexes(sh, n_clusters=C, iterations=4, n_sink=NS, window=WIN, seed=7)
    res = cp.cp_doublep_attention(q, sh, ixs, cp.SimulatedCollectives(R), SCALE, p1=p1, p2=p2,
                                  n_sink=NS, window=WIN)
    return sh, ixs, res


def _ref_dp(q, k, v, lens, index, p1=0.9, p2=0.6):
    full = np.full(q.shape[0], k.shape[2]) if lens is None else lens
    return doublep_attention(q, k, v, full, index, p1=p1, p2=p2, approx="centroid", budget=None,
                             sampler="systematic", seed=0, offset=0, scale=SCALE)


@pytest.mark.parametrize("li", range(len(DP_LENS)))
def test_doublep_one_rank_is_the_single_device_index_and_output(li):
    q, k, v = _inputs(seed=30 + li)
    lens = DP_LENS[li]
    full = np.full(q.shape[0], N) if lens is None else lens
    _, ixs, res = _dp(q, k, v, lens, 1, None)
    ref = build_index(k, v, full, C, 4, NS, WIN, 7)
    for key in ("centroids", "sizes", "value_sums", "labels", "n_initialized"):
        np.testing.assert_array_equal(ixs[0][key], ref[key])
    index = DoublePIndex(centroids=ref["centroids"], sizes=ref["sizes"],
                         value_sums=ref["value_sums"], labels=ref["labels"], seq_lens=full,
                         window_start=ref["window_start"], n_sink=NS, window=WIN, n_clusters=C,
                         n_initialized=ref["n_initialized"])
    want, diag = _ref_dp(q, k, v, lens, index)
    np.testing.assert_array_equal(res.out, want)
    for key in ("clusters_selected", "clusters_exact", "tokens_exact"):
        np.testing.assert_array_equal(res.diagnostics[key], diag[key])


@pytest.mark.parametrize("R, bounds", DP_SPLITS)
@pytest.mark.parametrize("li", range(len(DP_LENS)))
@pytest.mark.parametrize("p1, p2", [(0.9, 0.6), (0.99, 0.99), (1.0, 0.3)])
def test_doublep_global_selection_is_the_union_index_one(R, bounds, li, p1, p2):
    q, k, v = _inputs(seed=40 + li)
    lens = DP_LENS[li]
    sh, ixs, res = _dp(q, k, v, lens, R, bounds, p1, p2)
    union = cp.union_index(sh, ixs, n_sink=NS, window=WIN)
    # The selection, cluster by cluster, is what one index of all ranks' clusters selects.
    B, Hq, _ = q.shape
    G = Hq // k.shape[1]
    for b in range(B):
        for h in range(Hq):
            ids, xbar = cluster_scores(q[b, h], union.centroids[b, h // G],
                                       union.sizes[b, h // G], SCALE)
            order, n_p, n_e, _ = select_clusters(xbar, p1, p2)
            assert res.diagnostics["clusters_selected"][b, h] == n_p
            assert res.diagnostics["clusters_exact"][b, h] == n_e
            np.testing.assert_array_equal(res.diagnostics["selected"][b, h, :n_p], ids[order[:n_p]])
    # And the reference's Double-P on that index gives the output, sinks and window once.
    want, diag = _ref_dp(q, k, v, lens, union, p1, p2)
    _close(res.out, want, v)
    for key in ("clusters_selected", "clusters_exact", "tokens_exact"):
        np.testing.assert_array_equal(res.diagnostics[key], diag[key])


def test_doublep_sinks_and_window_are_read_once():
    """With p1 tiny only one cluster is selected, so the exact tokens are the sinks, the
    window and that cluster's members: counted once over the ranks."""
    q, k, v = _inputs(seed=50)
    lens = np.array([N, 70, 9])
    sh, ixs, res = _dp(q, k, v, lens, 4, [0, 2, 60, 190, N], p1=1e-9, p2=1e-9)
    union = cp.union_index(sh, ixs, n_sink=NS, window=WIN)
    G = q.shape[1] // k.shape[1]
    for b, L in enumerate(lens):
        base = min(NS, L) + (L - max(NS, L - WIN))
        for h in range(q.shape[1]):
            gid = res.diagnostics["selected"][b, h, 0]
            members = union.sizes[b, h // G, gid] if gid >= 0 else 0
            assert res.diagnostics["tokens_exact"][b, h] == base + members
