"""Context-parallel Double-P: per-rank k-means indexes, the global top-p over the
all-gathered cluster scores, both approximations of C_approx (``approx="centroid"`` and
``"sample"``) and appends (decode growth) into the rank that holds the token
(docs/context_parallel.md)."""

from __future__ import annotations

import numpy as np

from ..reference.doublep import tokens_of, cluster_scores, select_clusters
from ..reference.kmeans import append_tokens, build_index, cluster_csr, window_starts
from ..reference.rng import PURPOSE_CLUSTER_SAMPLER
from ..reference.samplers import sample_points
from ..reference.santa import last_positive, merge_scales, searchsorted_rows
from ..spec import SAMPLERS
from .core import (Collectives, CPResult, Shard, _bad, _finish, _local, _merge_packed, _pack,
                   combine_partials)


# ---------------------------------------------------------------------------------------
# Double-P
# ---------------------------------------------------------------------------------------

#: Rank r seeds its k-means with ``(seed + r * RANK_SEED_STEP) mod 2**64`` (rank 0: ``seed``,
#: so one rank builds the single-device index), so ranks do not reuse each other's draws.
RANK_SEED_STEP = 0x9E3779B97F4A7C15


def _shard_ranges(s: Shard, n_sink: int, window: int):
    """Local ``(n_sink_r, middle_end (B,))``: sinks ``[0, n_sink)``, middle ``[n_sink,
    window_start)`` and window ``[window_start, L)`` are global; the shard holds their
    intersections with ``[start, end)``."""
    n = s.end - s.start
    ns = int(np.clip(n_sink - s.start, 0, n))
    ws = window_starts(s.seq_lens, n_sink, window)
    return ns, np.clip(ws - s.start, ns, n).astype(np.int64), ws


def build_shard_indexes(shards, *, n_clusters: int, iterations: int, n_sink: int, window: int,
                        seed: int, tol=None) -> list[dict]:
    """Per rank, ``reference.kmeans.build_index`` on the shard's middle tokens (the global
    middle ``[n_sink, window_start)`` intersected with the shard): the shard with the
    local sink count and ``window=0``, lengths cut at the global window start. Rank 0 of a
    single rank builds the single-device index, bit for bit.

    Each dict holds ``build_index``'s arrays (local positions: ``labels`` (B, Hkv, n_r),
    ``window_start`` the local end of the middle) and ``n_sink`` (local), ``start`` and
    ``seq_lens`` (the global lengths it describes), which :func:`cp_doublep_append` reads."""
    out = []
    for s in shards:
        ns, mid_end, _ = _shard_ranges(s, n_sink, window)
        kw = {} if tol is None else {"tol": tol}
        idx = build_index(s.k, s.v, mid_end, n_clusters, iterations, ns, 0,
                          (int(seed) + s.rank * RANK_SEED_STEP) % 2**64, **kw)
        idx.update(n_sink=ns, start=s.start, seq_lens=np.array(s.seq_lens, dtype=np.int64))
        out.append(idx)
    return out


def union_index(shards, indexes, *, n_sink: int, window: int):
    """One ``stochattn.doublep.DoublePIndex`` over the whole cache holding every rank's
    clusters: cluster ``r * C + i`` is rank r's cluster i (for the tests: the reference's
    Double-P on it selects what :func:`cp_doublep_attention` selects)."""
    from ..doublep import DoublePIndex

    s0, C = shards[0], indexes[0]["sizes"].shape[-1]
    B, Hkv = indexes[0]["sizes"].shape[:2]
    labels = np.full((B, Hkv, s0.tokens), -1, dtype=np.int32)
    for r, (s, ix) in enumerate(zip(shards, indexes)):
        lab = ix["labels"]
        labels[:, :, s.start:s.end] = np.where(lab >= 0, lab + r * C, -1)
    cat = lambda key: np.concatenate([ix[key] for ix in indexes], axis=2)  # noqa: E731
    return DoublePIndex(centroids=cat("centroids"), sizes=cat("sizes"),
                        value_sums=cat("value_sums"), labels=labels, seq_lens=s0.seq_lens.copy(),
                        window_start=window_starts(s0.seq_lens, n_sink, window), n_sink=n_sink,
                        window=window, n_clusters=C * len(shards),
                        n_initialized=sum(ix["n_initialized"] for ix in indexes))


def cp_doublep_append(shards, indexes, *, n_sink: int, window: int) -> None:
    """Absorb, in place, the tokens that left the exact window into the index of the rank
    that holds them (decode growth; no collective).

    Call after writing the new tokens into the cache and splitting it at the new lengths
    (``split_cache(k, v, new_seq_lens, bounds)``: the shards' ``seq_lens`` are the new
    global lengths, ``bounds`` those of the build, the last shard may be longer). The
    global window start moves from ``max(n_sink, L - window)`` to ``max(n_sink, L' -
    window)``; each rank takes the part of that range it holds and runs the single-device
    append, ``reference.kmeans.append_tokens``, on its own index in local positions: in
    position order a token seeds the rank's next cluster without a centroid while there is
    one, else joins the nearest of the rank's live centroids (ties to the lower index);
    sizes and value sums are updated, centroids do not move. A token joins only clusters
    of its own rank. One token at a time or many at once, the same bits.

    Parameters
    ----------
    shards : list of Shard
        The ranks this process drives, at the new lengths.
    indexes : list of dict
        Their indexes (:func:`build_shard_indexes`), in the same order; updated in place.
    n_sink, window : int
        As at the build.

    Raises
    ------
    ValueError
        A shard and an index of different ranks, a sequence that shrinks, or ``n_sink``
        not the build's.
    """
    if len(shards) != len(indexes):
        raise ValueError(f"`indexes` must hold one index per shard ({len(shards)}), "
                         f"got {len(indexes)}")
    for i, (s, ix) in enumerate(zip(shards, indexes)):
        if s.start != ix["start"]:
            raise ValueError(f"`shards[{i}]` starts at token {s.start}, but `indexes[{i}]` "
                             f"was built on a shard starting at token {ix['start']}")
        if np.any(s.seq_lens < ix["seq_lens"]):
            raise ValueError(f"`shards` lengths must not shrink: expected each >= "
                             f"{ix['seq_lens'].tolist()}, got {s.seq_lens.tolist()}")
        ns, mid_end, _ = _shard_ranges(s, n_sink, window)
        if ns != ix["n_sink"]:
            raise ValueError(f"`n_sink` {n_sink} gives rank {s.rank} {ns} sinks, its index "
                             f"was built with {ix['n_sink']}")
        n, lab = s.end - s.start, ix["labels"]
        if n > lab.shape[-1]:  # the last shard grew: extend the labels with -1
            ix["labels"] = np.concatenate(
                [lab, np.full(lab.shape[:2] + (n - lab.shape[-1],), -1, dtype=lab.dtype)], -1)
        # The middle's local end is the rank's window_start with window 0 (as at the build).
        append_tokens(ix["centroids"], ix["sizes"], ix["value_sums"], ix["labels"],
                      ix["window_start"], ix["n_initialized"], s.k, s.v, mid_end, ns, 0)
        ix["seq_lens"] = np.array(s.seq_lens, dtype=np.int64)


APPROX = ("centroid", "sample")


def _check_decode(approx, budget, sampler):
    """The variant's options, checked before any collective (every rank raises alike)."""
    if approx not in APPROX:
        raise ValueError(f"`approx` must be one of {APPROX}, got {approx!r}")
    if approx == "centroid":
        if budget is not None:
            raise ValueError(f"`budget` is read by approx='sample' only, got {budget!r}")
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"`budget` must be an int >= 1 with approx='sample', got {budget!r}")
    if sampler not in SAMPLERS:
        raise ValueError(f"`sampler` must be one of {SAMPLERS}, got {sampler!r}")


def cp_doublep_attention(q, shards, indexes, comm: Collectives, scale: float, *, p1: float,
                         p2: float, n_sink: int, window: int, approx: str = "centroid",
                         budget=None, sampler: str = "systematic", seed: int = 0,
                         offset: int = 0) -> CPResult:
    """Double-P over per-rank indexes (docs/context_parallel.md).

    Cluster g = r * C + i (rank-major) is rank r's cluster i; the global selection is
    ``select_clusters`` over the non-empty clusters in that order (ties to the lower g),
    from one all-gather of the (B, Hq, C) scores. Then ``approx="centroid"``: each rank's
    partial over its exact tokens and its C_approx pseudo-tokens, one all-gather,
    :func:`merge_partials`. ``approx="sample"`` (``budget`` points of ``sampler`` per row,
    ``seed``, ``offset``; the reference's stream): see :func:`_sample_partials`, one more
    all-gather of 3 floats per (b, h).

    Parameters
    ----------
    q : ndarray, shape (B, Hq, D)
        The queries, the same on every rank.
    shards : list of Shard
        At least the ranks ``comm`` drives (:func:`~.core.split_cache`).
    indexes : list of dict
        Their indexes (:func:`build_shard_indexes`, :func:`cp_doublep_append`), in the
        order of ``shards``.
    comm : Collectives
    scale : float
    p1, p2 : float
        Stage 1 and stage 2 masses, as ``reference.doublep.select_clusters``.
    n_sink, window : int
        As at the build.
    approx : {"centroid", "sample"}
    budget : int or None
        Points per (b, h), >= 1, with ``approx="sample"`` only (a ``ValueError`` otherwise).
    sampler : {"iid", "stratified", "systematic"}
    seed, offset : int
        The draws' stream (purpose ``PURPOSE_CLUSTER_SAMPLER``, row b Hq + h, stream 0).

    Returns
    -------
    CPResult
        ``outs`` (B, Hq, D) float64 per local rank; ``diagnostics`` as documented there;
        with ``approx="sample"`` and every rank in this process, ``indices`` (B, Hq,
        budget) int64: the drawn positions, -1 where a row draws nothing (the reference's
        ``sample_indices``).
    """
    _check_decode(approx, budget, sampler)
    local = _local(comm, shards)
    B, Hq, _ = q.shape
    G, C = Hq // local[0].k.shape[1], indexes[0]["sizes"].shape[-1]
    by_rank = {s.rank: ix for s, ix in zip(shards, indexes)}
    q64 = np.asarray(q, dtype=np.float64)
    # Phase 1: cluster scores (-inf for empty clusters), all-gathered.
    scores = []
    for s in local:
        ix = by_rank[s.rank]
        xs = np.full((B, Hq, C), -np.inf)
        for b in range(B):
            for h in range(Hq):
                ids, xbar = cluster_scores(q64[b, h], ix["centroids"][b, h // G],
                                           ix["sizes"][b, h // G], scale)
                xs[b, h, ids] = xbar
        scores.append(xs)
    gathered = comm.all_gather(scores)  # (R, B, Hq, C)
    # Phase 2: the global selection (the same on every rank), this rank's part of it.
    picked = [_select(s, by_rank[s.rank], g, p1=p1, p2=p2, n_sink=n_sink, window=window, G=G)
              for s, g in zip(local, gathered)]
    indices = None
    if approx == "centroid":
        packs = [_centroid_partial(q64, s, by_rank[s.rank], g, rows, scale, G)
                 for s, g, (rows, _) in zip(local, gathered, picked)]
    else:
        packs, idx, drawn = _sample_partials(q64, local, [p[0] for p in picked], comm, scale,
                                             G, budget=int(budget), sampler=sampler,
                                             seed=seed, offset=offset)
        if len(idx) == comm.world_size:  # test bookkeeping: each point from exactly one rank
            assert ((np.stack(idx) >= 0).sum(axis=0) == drawn[..., None]).all()
            indices = np.max(np.stack(idx), axis=0)
    outs = [_merge_packed(g) for g in comm.all_gather(packs)]
    diags = [d for _, d in picked]
    diag = dict(diags[0])
    diag["tokens_exact"] = sum(d["tokens_exact"] for d in diags)  # test bookkeeping
    return CPResult(_finish(comm, shards, q, outs, [_bad(q, s) for s in local]),
                    indices=indices, diagnostics=diag)


def _select(s: Shard, ix, g, *, p1, p2, n_sink, window, G):
    """Rank s's part of the global selection from the gathered scores ``g`` (R, B, Hq, C).

    Returns ``rows``: per (b, h) ``(exact, ap, approx_tokens)``, this rank's exact tokens
    (its sinks and window tokens, then its C_exact clusters' tokens in selection order), its
    C_approx clusters (local ids, selection order) and their tokens in ascending position,
    all local; and the diagnostics (global, the same on every rank, but ``tokens_exact``).
    """
    R, B, Hq, C = g.shape
    ns, mid_end, ws = _shard_ranges(s, n_sink, window)
    offsets, token_ids = cluster_csr(ix["labels"], ix["sizes"], mid_end, ns)
    d = {k: np.zeros((B, Hq), dtype=np.int64)
         for k in ("clusters_selected", "clusters_exact", "tokens_exact")}
    d["selected"] = np.full((B, Hq, R * C), -1, dtype=np.int64)
    rows = {}
    for b in range(B):
        L, Lr = int(s.seq_lens[b]), int(s.lens[b])
        # Sinks and window of the sequence, those on this rank, in local positions.
        base = np.concatenate([np.arange(min(n_sink, L)), np.arange(ws[b], L)]) - s.start
        base = base[(base >= 0) & (base < Lr)].astype(np.int64)
        for h in range(Hq):
            kvh = h // G
            flat = g[:, b, h].reshape(-1)  # rank-major cluster scores
            gids = np.flatnonzero(~np.isneginf(flat))
            order, n_p, n_e, _ = select_clusters(flat[gids], p1, p2)
            sel = gids[order[:n_p]]
            own = (sel // C) == s.rank
            ex = sel[:n_e][own[:n_e]] % C
            ap = sel[n_e:][own[n_e:]] % C
            exact = np.concatenate([base, tokens_of(ex, offsets[b, kvh], token_ids[b, kvh])])
            rows[b, h] = (exact.astype(np.int64), ap,
                          np.sort(tokens_of(ap, offsets[b, kvh], token_ids[b, kvh])))
            d["clusters_selected"][b, h], d["clusters_exact"][b, h] = n_p, n_e
            d["tokens_exact"][b, h] = exact.size
            d["selected"][b, h, :n_p] = sel
    return rows, d


def _kv(s: Shard, b: int, kvh: int):
    Lr = int(s.lens[b])
    return (np.asarray(s.k[b, kvh, :Lr], dtype=np.float64),
            np.asarray(s.v[b, kvh, :Lr], dtype=np.float64))


def _centroid_partial(q64, s: Shard, ix, g, rows, scale: float, G: int):
    """Rank s's packed (m, l, acc): its exact tokens and its C_approx pseudo-tokens
    (logit xbar_i, value Vbar_i), as the reference mixes them."""
    B, Hq, D = q64.shape
    means = np.divide(ix["value_sums"], ix["sizes"][..., None],
                      out=np.zeros_like(ix["value_sums"]), where=ix["sizes"][..., None] > 0)
    m, l, acc = np.zeros((B, Hq)), np.zeros((B, Hq)), np.zeros((B, Hq, D))
    for (b, h), (exact, ap, _) in rows.items():
        K, V = _kv(s, b, h // G)
        xe = ((K @ q64[b, h]) * scale)[exact]  # as the reference: all, then pick
        xa = g[s.rank, b, h, ap]
        mx = max(xe.max(initial=-np.inf), xa.max(initial=-np.inf))
        if np.isfinite(mx):
            we, wa = np.exp(xe - mx), np.exp(xa - mx)
            m[b, h], l[b, h] = mx, we.sum() + wa.sum()
            acc[b, h] = we @ V[exact] + wa @ means[b, h // G, ap]
    return _pack(m, l, acc)


def _sample_partials(q64, local, rows_of, comm: Collectives, scale: float, G: int, *,
                     budget: int, sampler: str, seed: int, offset: int):
    """``approx="sample"``: per local rank its packed (m, l, acc) and its drawn positions
    (B, Hq, S), -1 for the points of other ranks; and where any rank draws (B, Hq).

    C_approx's tokens in ascending position are, over contiguous shards, rank order and
    then local order, so the global CDF is each rank's local CDF placed after the earlier
    ranks' totals (prop's ``exchange="totals"``):

    1. Local, per (b, h): the rank's exact logits and C_approx logits (ascending position)
       shifted by m_r, the max over both (the reference's shift when R = 1); the exact
       part (m_r, l_e, acc_e); the total (m_r, c_r, z_r), c_r the end of the C_approx
       weights' running sum (the CDF's total, as ``invert_cdf`` forms it) and z_r their
       sum (the weight, as the reference's z_a).
    2. One all-gather of the totals, 3 floats per (b, h).
    3. Every rank merges the totals as tiles are merged (the same numbers on every rank):
       f_r = exp(m_r - m*) over the ranks with mass, W_r = f_r c_r, prefix Cr, Z = Cr[-1].
       It draws the reference's points T (purpose PURPOSE_CLUSTER_SAMPLER, row b Hq + h,
       stream 0) and keeps those whose rank, the first with Cr > T Z (clipped to the last
       with mass), is its own; it inverts them in its prefix Cr[r-1] + f_r C_r, which ends
       at Cr[r] bit for bit (clipped to its last positive weight), and sums their V rows P_r.
    4. Its partial: the exact part at m_r and the approximate part at m* with weight
       f_r z_r and numerator Z_A P_r / S, Z_A = sum_r f_r z_r; over the ranks these add up
       to the reference's z_a mean(v_J) and z_a.
    """
    B, Hq, D = q64.shape
    S = budget
    totals, parts = [], []
    for s, rows in zip(local, rows_of):
        tot = np.zeros((B, Hq, 3))
        m_e, l_e, acc_e = np.zeros((B, Hq)), np.zeros((B, Hq)), np.zeros((B, Hq, D))
        cdfs = {}
        for (b, h), (exact, _, tokens) in rows.items():
            K, V = _kv(s, b, h // G)
            x = (K @ q64[b, h]) * scale  # as the reference: all, then pick
            xe, xa = x[exact], x[tokens]
            mx = max(xe.max(initial=-np.inf), xa.max(initial=-np.inf))  # max shift
            if not np.isfinite(mx):
                continue
            we, wa = np.exp(xe - mx), np.exp(xa - mx)
            m_e[b, h], l_e[b, h], acc_e[b, h] = mx, we.sum(), we @ V[exact]
            if tokens.size:
                c = np.cumsum(wa)  # the rank's CDF over C_approx, unnormalised
                tot[b, h] = mx, c[-1], wa.sum()
                cdfs[b, h] = c, wa
        totals.append(tot)
        parts.append((m_e, l_e, acc_e, cdfs))
    gathered = comm.all_gather(totals)  # (R, B, Hq, 3) on every rank
    rows_bh = np.arange(B * Hq, dtype=np.int64).reshape(B, Hq)  # row = b * Hq + h
    points = sample_points(sampler, S, seed=seed, offset=offset, row=rows_bh, stream=0,
                           purpose=PURPOSE_CLUSTER_SAMPLER, heads=Hq)  # (B, Hq, S)
    packs, idx = [], []
    for s, rows, (m_e, l_e, acc_e, cdfs), g in zip(local, rows_of, parts, gathered):
        mr, cr, zr = (np.moveaxis(g[..., i], 0, -1) for i in range(3))  # (B, Hq, R)
        mstar, f = merge_scales(mr, cr > 0)  # the ranks merged as reduce_tiles merges tiles
        Wr = f * cr
        Cr = np.cumsum(Wr, axis=-1)  # the ranks' prefix on the global CDF
        Z = Cr[..., -1]
        target = points * Z[..., None]
        owner = np.minimum(searchsorted_rows(Cr, target), last_positive(Wr)[..., None])
        mine = (owner == s.rank) & (Z > 0)[..., None]
        J = np.full((B, Hq, S), -1, dtype=np.int64)
        P = np.zeros((B, Hq, D))
        for b, h in zip(*np.nonzero(mine.any(axis=-1))):
            c, wa = cdfs[b, h]
            before = Cr[b, h, s.rank - 1] if s.rank else 0.0
            Cg = before + f[b, h, s.rank] * c  # the rank's CDF on the global one
            own = mine[b, h]
            j = np.searchsorted(Cg, target[b, h, own], side="right")  # first Cg > target
            picks = rows[b, h][2][np.minimum(j, np.flatnonzero(wa > 0)[-1])]
            J[b, h, own] = picks + s.start
            P[b, h] = _kv(s, b, h // G)[1][picks].sum(axis=0)
        z_a = (f * zr).sum(axis=-1)  # Z_A, the weight of C_approx (every rank alike)
        la, acc_a = f[..., s.rank] * zr[..., s.rank], z_a[..., None] * (P / S)
        packs.append(_pack(*combine_partials(np.stack([m_e, mstar]), np.stack([l_e, la]),
                                             np.stack([acc_e, acc_a]))))
        idx.append(J)
    return packs, idx, Z > 0
