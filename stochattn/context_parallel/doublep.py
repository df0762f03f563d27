"""Context-parallel Double-P (``approx="centroid"``): per-rank k-means indexes and the
global top-p over the all-gathered cluster scores (docs/context_parallel.md)."""

from __future__ import annotations

import numpy as np

from ..reference.doublep import tokens_of, cluster_scores, select_clusters
from ..reference.kmeans import build_index, cluster_csr, window_starts
from .core import Collectives, CPResult, Shard, _bad, _finish, _local, _merge_packed, _pack


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
    single rank builds the single-device index, bit for bit."""
    out = []
    for s in shards:
        ns, mid_end, _ = _shard_ranges(s, n_sink, window)
        kw = {} if tol is None else {"tol": tol}
        idx = build_index(s.k, s.v, mid_end, n_clusters, iterations, ns, 0,
                          (int(seed) + s.rank * RANK_SEED_STEP) % 2**64, **kw)
        idx["n_sink"] = ns
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


def cp_doublep_attention(q, shards, indexes, comm: Collectives, scale: float, *, p1: float,
                         p2: float, n_sink: int, window: int) -> CPResult:
    """Double-P (``approx="centroid"``) over per-rank indexes; see the module docstring.

    Cluster g = r * C + i (rank-major) is rank r's cluster i; the global selection is
    ``select_clusters`` over the non-empty clusters in that order (ties to the lower g).
    """
    local = _local(comm, shards)
    B, Hq, D = q.shape
    Hkv = local[0].k.shape[1]
    G, C = Hq // Hkv, indexes[0]["sizes"].shape[-1]
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
    packs, diags = [], []
    for s, g in zip(local, gathered):
        ix = by_rank[s.rank]
        ns, mid_end, ws = _shard_ranges(s, n_sink, window)
        offsets, token_ids = cluster_csr(ix["labels"], ix["sizes"], mid_end, ns)
        means = np.divide(ix["value_sums"], ix["sizes"][..., None],
                          out=np.zeros_like(ix["value_sums"]), where=ix["sizes"][..., None] > 0)
        m, l, acc = np.zeros((B, Hq)), np.zeros((B, Hq)), np.zeros((B, Hq, D))
        d = {k: np.zeros((B, Hq), dtype=np.int64)
             for k in ("clusters_selected", "clusters_exact", "tokens_exact")}
        d["selected"] = np.full((B, Hq, g.shape[0] * C), -1, dtype=np.int64)
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
                exact = np.concatenate([base, tokens_of(ex, offsets[b, kvh],
                                                         token_ids[b, kvh])]).astype(np.int64)
                K = np.asarray(s.k[b, kvh, :Lr], dtype=np.float64)
                V = np.asarray(s.v[b, kvh, :Lr], dtype=np.float64)
                xe = ((K @ q64[b, h]) * scale)[exact]  # as the reference: all, then pick
                xa = g[s.rank, b, h, ap]
                mx = max(xe.max(initial=-np.inf), xa.max(initial=-np.inf))
                if np.isfinite(mx):
                    we, wa = np.exp(xe - mx), np.exp(xa - mx)
                    m[b, h], l[b, h] = mx, we.sum() + wa.sum()
                    acc[b, h] = we @ V[exact] + wa @ means[b, kvh, ap]
                d["clusters_selected"][b, h], d["clusters_exact"][b, h] = n_p, n_e
                d["tokens_exact"][b, h] = exact.size
                d["selected"][b, h, :n_p] = sel
        packs.append(_pack(m, l, acc))
        diags.append(d)
    outs = [_merge_packed(g) for g in comm.all_gather(packs)]
    diag = dict(diags[0])
    diag["tokens_exact"] = sum(d["tokens_exact"] for d in diags)  # test bookkeeping
    return CPResult(_finish(comm, shards, q, outs, [_bad(q, s) for s in local]),
                    diagnostics=diag)
