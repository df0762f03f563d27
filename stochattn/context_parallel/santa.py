"""Context-parallel S²ANTA-prop and S²ANTA-flash over tile-aligned shards
(docs/context_parallel.md)."""

from __future__ import annotations

import numpy as np

from ..reference.common import kv_head_of, logits
from ..reference.samplers import invert_cdf, sample_points
from ..reference.santa import last_positive, searchsorted_rows, global_points, tile_stats
from ..reference.santa import merge_scales
from .core import (Collectives, CPResult, Shard, _bad, _finish, _local, _merge_packed, _pack,
                   combine_partials, reduce_tiles)


def _check_aligned(shards, tile_size: int):
    """Every non-empty shard starts on a tile boundary (so no tile straddles two ranks)."""
    bounds = shards[0].bounds
    bad = np.flatnonzero((bounds[:-1] % tile_size != 0) & (np.diff(bounds) > 0))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"shard {r} starts at token {int(bounds[r])}, not a multiple of "
                         f"tile_size {tile_size}: prop and flash need tile-aligned shards "
                         f"(shard_bounds(..., align=tile_size))")


def _tile_stats(q, s: Shard, scale: float, tile_size: int):
    """Pass 1 over the shard's tiles (``reference.santa.tile_stats``); None when empty."""
    if s.end == s.start:
        return None
    return tile_stats(logits(q, s.k, s.lens, scale), tile_size)


EXCHANGES = ("tiles", "totals")


def cp_prop_attention(q, shards, comm: Collectives, scale: float, *, budget: int, sampler: str,
                      tile_size: int, seed: int, offset: int, exchange: str = "tiles") -> CPResult:
    """S²ANTA-prop over tile-aligned shards.

    ``exchange="tiles"``: every rank all-gathers every tile's (m_t, l_t) (2 B Hq T floats in
    all), so the points, their tiles and their indices are the single-device
    ``santa_attention(schedule="prop")``'s, bit for bit. ``exchange="totals"``: each rank
    all-gathers only its own total (m_r, Z_r) (2 B Hq floats per rank) and places its tile
    prefix after the earlier ranks' totals: the same CDF summed in another order, so the
    estimator is as unbiased and its indices are one device's except for a point within
    rounding of a tile boundary (docs/context_parallel.md).
    """
    _check_aligned(shards, tile_size)
    if exchange not in EXCHANGES:
        raise ValueError(f"`exchange` must be one of {EXCHANGES}, got {exchange!r}")
    if exchange == "totals":
        return _prop_totals(q, shards, comm, scale, budget=budget, sampler=sampler,
                            tile_size=tile_size, seed=seed, offset=offset)
    local = _local(comm, shards)
    B, Hq, D = q.shape
    S = int(budget)
    N = local[0].tokens
    T = -(-N // tile_size)
    kv = kv_head_of(Hq, local[0].k.shape[1])
    # Pass 1 per rank over its own tiles; padded to the largest shard for the all-gather.
    tiles = -(-np.diff(local[0].bounds) // tile_size)  # T_r of every rank
    Tmax = int(tiles.max())
    stats, packs = [], []
    for s in local:
        st = _tile_stats(q, s, scale, tile_size)
        stats.append(st)
        Tr = tiles[s.rank]
        ml = np.zeros((B, Hq, Tmax, 2))
        if Tr:
            ml[:, :, :Tr, 0], ml[:, :, :Tr, 1] = st.m, st.l
        packs.append(ml)
    gathered = comm.all_gather(packs)  # (R, B, Hq, Tmax, 2) on every rank
    sums, idx = [], []
    bi, hi = np.arange(B)[:, None, None], np.arange(Hq)[None, :, None]
    for s, st, g in zip(local, stats, gathered):
        ml = np.concatenate([g[r, :, :, :tiles[r]] for r in range(comm.world_size)], axis=2)
        assert ml.shape[2] == T
        tscale, W, C, Z = reduce_tiles(ml[..., 0], ml[..., 1])
        C_before = np.concatenate([np.zeros((B, Hq, 1)), C[..., :-1]], axis=-1)
        # The global points of every row (stream 0) and their tiles, as prop_indices does.
        target = global_points(sampler, S, B, Hq, seed=seed, offset=offset) * Z[..., None]
        tile = np.minimum(searchsorted_rows(C, target), last_positive(W)[..., None])
        t0, Tr = s.start // tile_size, tiles[s.rank]
        mine = (tile >= t0) & (tile < t0 + Tr) & (Z > 0)[..., None]
        part, J = _draw_own(s, st, kv, tile, tile - t0, mine, target,
                            C_before[bi, hi, tile], tscale[bi, hi, tile], tile_size)
        sums.append(part)
        idx.append(J)
    return _finish_prop(q, shards, comm, local, sums, idx, S)


def _draw_own(s: Shard, st, kv, tile, lt, mine, target, before, sc, tile_size: int):
    """A rank's points in its own tiles: ``(sum of their V rows, indices)``, -1 for the
    points of other ranks. Per point: ``tile`` its global tile, ``lt`` that tile on this
    rank, ``before`` the CDF before the tile and ``sc`` the tile's factor exp(m_t - m*), in
    the units of ``target`` (the point on the unnormalised CDF)."""
    B, Hq, S = target.shape
    part = np.zeros((B, Hq, s.v.shape[-1]))
    J = np.full((B, Hq, S), -1, dtype=np.int64)
    if st is None or not mine.any():
        return part, J
    bi, hi = np.arange(B)[:, None, None], np.arange(Hq)[None, :, None]
    lt = np.clip(lt, 0, st.l.shape[-1] - 1)
    local_target = (target - before) / np.where(sc > 0, sc, 1.0)
    cum = np.cumsum(st.local, axis=-1)[bi, hi, lt]  # (B, Hq, S, tile_size)
    r = (cum <= local_target[..., None]).sum(axis=-1)
    r = np.minimum(r, last_positive(st.local)[bi, hi, lt])
    J = np.where(mine, tile * tile_size + r, -1)
    rows = np.asarray(s.v, dtype=np.float64)[bi, kv[None, :, None],
                                              np.where(mine, J - s.start, 0)]
    return np.where(mine[..., None], rows, 0.0).sum(axis=2), J  # own points, in order


def _prop_totals(q, shards, comm: Collectives, scale: float, *, budget: int, sampler: str,
                 tile_size: int, seed: int, offset: int) -> CPResult:
    """cp_prop_attention with ``exchange="totals"``: one (m_r, Z_r) per rank and head."""
    local = _local(comm, shards)
    B, Hq, _ = q.shape
    S = int(budget)
    kv = kv_head_of(Hq, local[0].k.shape[1])
    bi, hi = np.arange(B)[:, None, None], np.arange(Hq)[None, :, None]
    stats, packs, local_cdf = [], [], []
    for s in local:
        st = _tile_stats(q, s, scale, tile_size)
        stats.append(st)
        if st is None:  # no tiles: an empty total
            packs.append(np.zeros((B, Hq, 2)))
            local_cdf.append(None)
            continue
        m_r, tsc = merge_scales(st.m, st.l > 0)  # the rank's tiles against its own max
        C_r = np.cumsum(tsc * st.l, axis=-1)
        packs.append(np.stack([m_r, C_r[..., -1]], axis=-1))
        local_cdf.append((tsc, C_r))
    gathered = comm.all_gather(packs)  # (R, B, Hq, 2) on every rank
    sums, idx = [], []
    for s, st, g, cdf in zip(local, stats, gathered, local_cdf):
        # The ranks' totals merged as tiles are (every rank computes the same numbers):
        # factors, weights and prefix over the ranks, (B, Hq, R).
        rsc, Wr, Cr, Z = reduce_tiles(np.moveaxis(g[..., 0], 0, -1),
                                      np.moveaxis(g[..., 1], 0, -1))
        target = global_points(sampler, S, B, Hq, seed=seed, offset=offset) * Z[..., None]
        # A point's rank: the first whose prefix exceeds it, the last rank with mass at Z.
        rank = np.minimum(searchsorted_rows(Cr, target), last_positive(Wr)[..., None])
        mine = (rank == s.rank) & (Z > 0)[..., None]
        if cdf is None:  # no tiles, no mass: no point falls here (mine is all False)
            part, J = _draw_own(s, None, kv, None, None, mine, target, None, None, tile_size)
        else:
            tsc, C_r = cdf
            f = rsc[..., s.rank, None]  # the rank's factor to the global max
            # The CDF before the rank: the earlier ranks' prefix itself, so that the rank's
            # last tile ends exactly at Cr[rank] (f C_r[-1] is Wr[rank], bit for bit).
            before_rank = (Cr[..., s.rank - 1] if s.rank else np.zeros_like(Z))[..., None]
            Cg = before_rank + f * C_r  # the rank's tile prefix on the global CDF
            Wg = f * tsc * st.l
            lt = np.minimum(searchsorted_rows(Cg, target), last_positive(Wg)[..., None])
            lt = np.minimum(lt, Cg.shape[-1] - 1)
            Cg_before = np.concatenate([before_rank, Cg[..., :-1]], axis=-1)
            part, J = _draw_own(s, st, kv, s.start // tile_size + lt, lt, mine, target,
                                Cg_before[bi, hi, lt], (f * tsc)[bi, hi, lt], tile_size)
        sums.append(part)
        idx.append(J)
    return _finish_prop(q, shards, comm, local, sums, idx, S)


def _finish_prop(q, shards, comm: Collectives, local, sums, idx, S: int) -> CPResult:
    """The all-reduce of the ranks' sums, and the test bookkeeping of the indices."""
    outs = [x / S for x in comm.all_reduce(sums, "sum")]
    # Test bookkeeping only: every point is owned by exactly one rank.
    indices = np.max(np.stack(idx), axis=0) if len(idx) == comm.world_size else None
    if indices is not None:
        assert ((np.stack(idx) >= 0).sum(axis=0) == (local[0].seq_lens > 0)[:, None, None]).all()
        indices = np.where(indices >= 0, indices, 0)  # empty sequences: 0, as the reference
    return CPResult(_finish(comm, shards, q, outs, [_bad(q, s) for s in local]), indices=indices)


# ---------------------------------------------------------------------------------------
# S²ANTA-flash
# ---------------------------------------------------------------------------------------


def cp_flash_attention(q, shards, comm: Collectives, scale: float, *, budget: int, sampler: str,
                       tile_size: int, seed: int, offset: int) -> CPResult:
    """S²ANTA-flash over tile-aligned shards: each global tile draws what the single-device
    ``flash_estimate`` draws for it (same S_t, same stream), so the rows read are the same;
    the tiles' local means merge by :func:`combine_partials` within a rank and
    :func:`merge_partials` across ranks (equal to the reference up to summation order)."""
    _check_aligned(shards, tile_size)
    local = _local(comm, shards)
    B, Hq, D = q.shape
    S = int(budget)
    kv = kv_head_of(Hq, local[0].k.shape[1])
    rows = np.arange(B)[:, None] * Hq + np.arange(Hq)[None, :]
    packs, reads = [], []
    for s in local:
        st = _tile_stats(q, s, scale, tile_size)
        v64 = np.asarray(s.v, dtype=np.float64)
        m, l, acc = np.zeros((B, Hq)), np.zeros((B, Hq)), np.zeros((B, Hq, D))
        read = np.zeros((B, Hq, s.tokens), dtype=bool)
        t0 = s.start // tile_size
        for b in range(B):
            TL = -(-int(s.seq_lens[b]) // tile_size)  # the sequence's tiles, all ranks
            nt = -(-int(s.lens[b]) // tile_size)  # its tiles on this rank
            if nt == 0:
                continue
            pts = sample_points(sampler, -(-S // TL), seed=seed, offset=offset,
                                row=rows[b][:, None], stream=(t0 + np.arange(nt))[None, :],
                                heads=Hq)
            Jl = invert_cdf(st.local[b, :, :nt], pts) + (np.arange(nt) * tile_size)[None, :, None]
            mu = v64[b][kv[:, None, None], Jl].mean(axis=2)  # (Hq, nt, D) local means
            lt = st.l[b, :, :nt]
            m[b], l[b], acc[b] = combine_partials(st.m[b, :, :nt], lt, lt[..., None] * mu, axis=1)
            read[b, np.arange(Hq)[:, None], (Jl + s.start).reshape(Hq, -1)] = True
        packs.append(_pack(m, l, acc))
        reads.append(read)
    outs = [_merge_packed(g) for g in comm.all_gather(packs)]
    read = np.any(np.stack(reads), axis=0) if len(reads) == comm.world_size else None
    return CPResult(_finish(comm, shards, q, outs, [_bad(q, s) for s in local]), read=read)
