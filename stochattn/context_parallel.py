"""Context-parallel decode: one sequence's KV cache split along the tokens over R ranks.

NumPy reference of issue 35 (docs/context_parallel.md), float64, ranks simulated in one
process. Rank r holds the tokens ``[bounds[r], bounds[r + 1])`` of every sequence (a
contiguous shard; shards may be empty, and with ``seq_lens`` shorter than the cache a rank
may hold no live token). Every algorithm is written as phases: a local phase per rank, a
collective, a local phase per rank. ``comm.local_ranks`` are the ranks this process drives:
all of them in :class:`SimulatedCollectives`, one in a torch.distributed / NCCL
implementation (not written: no multi-GPU machine this session), so the same code runs in
both.

- :func:`cp_exact_attention`: per rank the split-KV partial (max m, sum l, weighted sum
  acc) over its shard, one all-gather, :func:`merge_partials`.
- :func:`cp_prop_attention`: S²ANTA-prop. Per rank pass 1 over its tiles
  (``reference.santa.tile_stats`` on the shard), one all-gather of the tile (m_t, l_t),
  every rank runs the reducer (W, C, Z) over all T tiles in tile order and the same global
  points (stream 0), keeps the points that fall in its own tiles, inverts them tile-locally
  and gathers its V rows; one all-reduce of the (B, Hq, D) partial sums, divided by S.
- :func:`cp_flash_attention`: S²ANTA-flash. Per rank the flash tiles of its shard (stream =
  global tile index, S_t = ceil(S / T_L) from the global length), combined into one partial
  per rank; one all-gather and :func:`merge_partials`.
- :func:`cp_doublep_attention`: Double-P (``approx="centroid"``) over per-rank indexes
  (:func:`build_shard_indexes`); one all-gather of the (B, Hq, C) cluster scores, the
  global stage 1 / stage 2 selection by ``reference.doublep.select_clusters`` over the
  rank-major concatenation, partials per rank, one all-gather and :func:`merge_partials`.

prop and flash need shard boundaries on multiples of ``tile_size`` (the tiles of the
single-device reference then never straddle a shard); a ``ValueError`` says so otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .reference.common import kv_head_of, lengths, logits, masked_weights, nonfinite_rows
from .reference.doublep import _tokens_of, cluster_scores, select_clusters
from .reference.kmeans import build_index, cluster_csr, window_starts
from .reference.samplers import invert_cdf, sample_points
from .reference.santa import _last_positive, _searchsorted_rows, global_points, tile_stats

__all__ = [
    "Shard",
    "shard_bounds",
    "split_cache",
    "Collectives",
    "SimulatedCollectives",
    "combine_partials",
    "merge_partials",
    "reduce_tiles",
    "CPResult",
    "cp_exact_attention",
    "cp_prop_attention",
    "cp_flash_attention",
    "build_shard_indexes",
    "union_index",
    "cp_doublep_attention",
    "RANK_SEED_STEP",
]

# ---------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` holds: tokens ``[start, end)`` of every sequence.

    ``k``, ``v`` are (B, Hkv, end - start, D) views; ``lens`` (B,) the live tokens of each
    sequence inside the shard, ``clip(seq_lens - start, 0, end - start)``; ``seq_lens``
    (B,), ``tokens`` (the cache's N) and ``bounds`` (R + 1,) are the global metadata every
    rank knows.
    """

    rank: int
    start: int
    end: int
    k: np.ndarray
    v: np.ndarray
    lens: np.ndarray
    seq_lens: np.ndarray
    tokens: int
    bounds: np.ndarray


def shard_bounds(tokens: int, ranks: int, *, boundaries=None, align: int = 1) -> np.ndarray:
    """Shard boundaries ``bounds`` (R + 1,) int64: rank r holds ``[bounds[r], bounds[r+1])``.

    ``boundaries`` (R + 1 non-decreasing ints from 0 to ``tokens``) is taken as given (equal
    entries make empty shards); otherwise the even split in units of ``align`` tokens:
    ``bounds[r] = min(tokens, align * ((r * ceil(tokens / align)) // R))``.
    """
    if ranks < 1:
        raise ValueError(f"`ranks` must be >= 1, got {ranks}")
    if boundaries is not None:
        b = np.asarray(boundaries, dtype=np.int64)
        if b.shape != (ranks + 1,) or b[0] != 0 or b[-1] != tokens or (np.diff(b) < 0).any():
            raise ValueError(f"`boundaries` must be {ranks + 1} non-decreasing ints from 0 to "
                             f"{tokens}, got {b.tolist()}")
        return b
    units = -(-tokens // align)
    return np.minimum(tokens, align * ((np.arange(ranks + 1) * units) // ranks)).astype(np.int64)


def split_cache(k, v, seq_lens, bounds) -> list[Shard]:
    """The R shards of a (B, Hkv, N, D) cache along the tokens (views, no copy)."""
    B, _, N, _ = k.shape
    lens = lengths(seq_lens, B, N)
    bounds = np.asarray(bounds, dtype=np.int64)
    if bounds[0] != 0 or bounds[-1] != N or (np.diff(bounds) < 0).any():
        raise ValueError(f"`bounds` must be non-decreasing from 0 to {N}, got {bounds.tolist()}")
    out = []
    for r in range(bounds.size - 1):
        a, e = int(bounds[r]), int(bounds[r + 1])
        out.append(Shard(r, a, e, k[:, :, a:e], v[:, :, a:e], np.clip(lens - a, 0, e - a),
                         lens, N, bounds))
    return out


# ---------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------


class Collectives:
    """The collectives context-parallel decode needs, over ``world_size`` ranks.

    A process drives the ranks ``local_ranks``; every method takes one value per local
    rank (a list in ``local_ranks`` order, the same shape and dtype on every rank) and
    returns one result per local rank. :class:`SimulatedCollectives` drives all ranks in
    one process; a torch.distributed / NCCL implementation (one process per GPU, launched
    by torchrun) would drive one, ``local_ranks = (dist.get_rank(),)``, and map
    ``all_gather`` to ``dist.all_gather_into_tensor`` and ``all_reduce`` to
    ``dist.all_reduce`` (SUM / MAX). Not written here (no multi-GPU machine).
    """

    world_size: int
    local_ranks: tuple

    def all_gather(self, values):
        """Per local rank, the (world_size, *shape) stack of every rank's value, rank order."""
        raise NotImplementedError

    def all_reduce(self, values, op: str = "sum"):
        """Per local rank, the elementwise ``op`` ("sum" or "max") over the ranks' values."""
        raise NotImplementedError


class SimulatedCollectives(Collectives):
    """All ranks in one process, deterministic: sums run in rank order.

    ``log`` records ``(op, bytes per rank)`` of every call (the payload's own dtype; the
    docs size the GPU payloads in float32).
    """

    def __init__(self, world_size: int):
        self.world_size = int(world_size)
        self.local_ranks = tuple(range(self.world_size))
        self.log: list[tuple[str, int]] = []

    def _check(self, values):
        if len(values) != self.world_size:
            raise ValueError(f"expected one value per rank ({self.world_size}), got {len(values)}")
        values = [np.asarray(x) for x in values]
        if any(x.shape != values[0].shape for x in values):
            raise ValueError(f"every rank must pass the same shape, got {[x.shape for x in values]}")
        return values

    def all_gather(self, values):
        values = self._check(values)
        self.log.append(("all_gather", values[0].nbytes))
        stacked = np.stack(values)
        return [stacked.copy() for _ in self.local_ranks]

    def all_reduce(self, values, op: str = "sum"):
        values = self._check(values)
        self.log.append((f"all_reduce_{op}", values[0].nbytes))
        acc = values[0].copy()
        for x in values[1:]:
            if op == "sum":
                acc = acc + x
            elif op == "max":
                acc = np.maximum(acc, x)
            else:
                raise ValueError(f"`op` must be 'sum' or 'max', got {op!r}")
        return [acc.copy() for _ in self.local_ranks]


# ---------------------------------------------------------------------------------------
# The merge rule (split-KV / flash-decoding) and the prop reducer
# ---------------------------------------------------------------------------------------


def combine_partials(m, l, acc, axis: int = 0):
    """Combine partials ``(m, l, acc)`` along ``axis`` into one, unnormalised.

    A partial over a set of tokens holds m (its max logit; any value when empty),
    l = sum exp(x - m) (0 when empty) and acc = sum exp(x - m) v (shape of l plus D). The
    rule is the one of ``reference.santa.tile_stats``: m* the max over non-empty parts
    (0 when none), scale = exp(m - m*) on non-empty parts and 0 elsewhere; then
    l* = sum scale l and acc* = sum scale acc, summed in index order along ``axis``.
    """
    m, l, acc = (np.moveaxis(np.asarray(a, dtype=np.float64), axis, 0) for a in (m, l, acc))
    has = l > 0
    mstar = np.max(np.where(has, m, -np.inf), axis=0)
    mstar = np.where(np.isfinite(mstar), mstar, 0.0)
    scale = np.where(has, np.exp(np.where(has, m, mstar) - mstar), 0.0)
    return mstar, (scale * l).sum(axis=0), (scale[..., None] * acc).sum(axis=0)


def merge_partials(m, l, acc, axis: int = 0) -> np.ndarray:
    """``acc* / l*`` of :func:`combine_partials` (0 where nothing is live)."""
    _, L, A = combine_partials(m, l, acc, axis)
    return np.divide(A, L[..., None], out=np.zeros_like(A), where=L[..., None] > 0)


def reduce_tiles(m: np.ndarray, l: np.ndarray):
    """The prop reducer over all T tiles (B, Hq, T): ``(scale, W, C, Z)``.

    The same operations, in the same order, as ``reference.santa.tile_stats`` after its
    pass 1 (a tile exists iff l_t > 0), so the results are the same bits for the same
    (m_t, l_t).
    """
    has = l > 0
    mstar = np.max(np.where(has, m, -np.inf), axis=-1)
    mstar = np.where(np.isfinite(mstar), mstar, 0.0)
    scale = np.where(has, np.exp(np.where(has, m, mstar[..., None]) - mstar[..., None]), 0.0)
    W = scale * l
    C = np.cumsum(W, axis=-1)
    return scale, W, C, C[..., -1].copy()


@dataclass
class CPResult:
    """Output of a context-parallel call.

    ``outs``: the (B, Hq, D) float64 output as each local rank holds it after the last
    collective (the same bits on every rank); ``out`` is ``outs[0]``. ``indices`` (prop:
    (B, Hq, S) int64, every point from the rank that owns it) and ``read`` (flash: (B, Hq,
    N) bool) exist for the tests; a GPU run would not gather them. ``diagnostics``: Double-P
    per (b, h) ``clusters_selected`` (|C_p|), ``clusters_exact`` (|C_exact|),
    ``tokens_exact`` (over all ranks) and ``selected`` (B, Hq, R * C): the global ids
    r * C + i of C_p in selection order, -1 after them.
    """

    outs: list
    indices: np.ndarray | None = None
    read: np.ndarray | None = None
    diagnostics: dict | None = None

    @property
    def out(self) -> np.ndarray:
        return self.outs[0]


def _local(comm: Collectives, shards):
    by_rank = {s.rank: s for s in shards}
    return [by_rank[r] for r in comm.local_ranks]


def _finish(comm, shards, q, outs, bad_local):
    """Empty sequences give 0 rows (the merge already does); rows that read a non-finite
    query or key on any rank become NaN (``common.propagate_nonfinite``)."""
    bad = comm.all_reduce([b.astype(np.uint8) for b in bad_local], "max")
    res = []
    for o, b in zip(outs, bad):
        o = np.array(o, copy=True)
        o[b.astype(bool)] = np.nan
        res.append(o)
    return res


def _bad(q, s: Shard):
    return nonfinite_rows(q, s.k, s.lens)


# ---------------------------------------------------------------------------------------
# Exact decode
# ---------------------------------------------------------------------------------------


def _exact_partial(q, s: Shard, scale: float):
    """(m, l, acc) of rank s over its live tokens: (B, Hq), (B, Hq), (B, Hq, D)."""
    B, Hq, D = q.shape
    Hkv, n = s.k.shape[1], s.k.shape[2]
    if n == 0:  # an empty shard: nothing live
        return np.zeros((B, Hq)), np.zeros((B, Hq)), np.zeros((B, Hq, D))
    x = logits(q, s.k, s.lens, scale)
    w, m = masked_weights(x)
    vv = np.asarray(s.v, dtype=np.float64)
    vv = np.where(np.arange(n)[None, None, :, None] < s.lens[:, None, None, None], vv, 0.0)
    acc = np.einsum("bkgn,bknd->bkgd", w.reshape(B, Hkv, Hq // Hkv, n), vv).reshape(B, Hq, D)
    return m[..., 0], w.sum(axis=-1), acc


def _pack(m, l, acc):
    return np.concatenate([m[..., None], l[..., None], acc], axis=-1)


def _merge_packed(gathered):
    return merge_partials(gathered[..., 0], gathered[..., 1], gathered[..., 2:])


def cp_exact_attention(q, shards, comm: Collectives, scale: float) -> CPResult:
    """Exact decode over the shards: one all-gather of (m, l, acc) per (b, h), then
    :func:`merge_partials`. Equals ``reference.exact.exact_attention`` up to summation
    order (docs/context_parallel.md gives the tolerance)."""
    local = _local(comm, shards)
    packs = [_pack(*_exact_partial(q, s, scale)) for s in local]
    outs = [_merge_packed(g) for g in comm.all_gather(packs)]
    return CPResult(_finish(comm, shards, q, outs, [_bad(q, s) for s in local]))


# ---------------------------------------------------------------------------------------
# S²ANTA-prop
# ---------------------------------------------------------------------------------------


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
        tile = np.minimum(_searchsorted_rows(C, target), _last_positive(W)[..., None])
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
            r = np.minimum(r, _last_positive(st.local)[bi, hi, lt])
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
    from .doublep import DoublePIndex

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
                exact = np.concatenate([base, _tokens_of(ex, offsets[b, kvh],
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
