"""Context-parallel S²ANTA-prop and S²ANTA-flash over tile-aligned shards
(docs/context_parallel.md)."""

from __future__ import annotations

import numpy as np

from ..reference.common import kv_head_of, logits
from ..reference.samplers import invert_cdf, sample_points
from ..reference.santa import last_positive, searchsorted_rows, global_points, tile_stats
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


def cp_prop_attention(q, shards, comm: Collectives, scale: float, *, budget: int, sampler: str,
                      tile_size: int, seed: int, offset: int) -> CPResult:
    """S²ANTA-prop over tile-aligned shards; the points, their tiles and their indices are
    the single-device ``santa_attention(schedule="prop")``'s, bit for bit."""
    _check_aligned(shards, tile_size)
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
        lt = np.clip(tile - t0, 0, max(Tr - 1, 0))
        part = np.zeros((B, Hq, D))
        J = np.full((B, Hq, S), -1, dtype=np.int64)
        if Tr and mine.any():
            before, sc = C_before[bi, hi, tile], tscale[bi, hi, tile]
            local_target = (target - before) / np.where(sc > 0, sc, 1.0)
            cum = np.cumsum(st.local, axis=-1)[bi, hi, lt]  # (B, Hq, S, tile_size)
            r = (cum <= local_target[..., None]).sum(axis=-1)
            r = np.minimum(r, last_positive(st.local)[bi, hi, lt])
            J = np.where(mine, tile * tile_size + r, -1)
            rows = np.asarray(s.v, dtype=np.float64)[bi, kv[None, :, None],
                                                      np.where(mine, J - s.start, 0)]
            part = np.where(mine[..., None], rows, 0.0).sum(axis=2)  # own points, in order
        sums.append(part)
        idx.append(J)
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
