"""Shards, the collectives interface and its single-process simulation, the merge rule,
and context-parallel exact decode (docs/context_parallel.md)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._backend import backend_of
from ..reference.common import lengths, logits, masked_weights, nonfinite_rows
from ..reference.santa import merge_scales


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
    one process; :class:`~stochattn.context_parallel.dist.TorchCollectives` (one process
    per rank over ``torch.distributed``, launched by torchrun) drives one,
    ``local_ranks = (dist.get_rank(),)``.
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
    mstar, scale = merge_scales(m, l > 0, axis=0)
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
    _, scale = merge_scales(m, l > 0)
    W = scale * l
    C = np.cumsum(W, axis=-1)
    return scale, W, C, C[..., -1].copy()


@dataclass
class CPResult:
    """Output of a context-parallel call.

    ``outs``: the (B, Hq, D) float64 output as each local rank holds it after the last
    collective (the same bits on every rank); ``out`` is ``outs[0]``. ``indices`` (prop and
    Double-P's sampled variant: (B, Hq, S) int64 positions, every point from the rank that
    owns it; -1 where a sampled Double-P row draws nothing) and ``read`` (flash: (B, Hq, N)
    bool) exist for the tests; a GPU run would not gather them. ``diagnostics``: Double-P
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
    """(m, l, acc, bad) of rank s over its live tokens: (B, Hq), (B, Hq), (B, Hq, D) float64
    and the rows that read a non-finite query or key. NumPy shards: the reference, float64.
    GPU shards (CuPy or torch): :func:`exact_partial_lse`, one ``exact_attention`` call of
    the GPU kernels on the rank's shard."""
    B, Hq, D = q.shape
    Hkv, n = s.k.shape[1], s.k.shape[2]
    if n == 0:  # an empty shard: nothing live
        return np.zeros((B, Hq)), np.zeros((B, Hq)), np.zeros((B, Hq, D)), np.zeros((B, Hq), bool)
    if backend_of(q=q, k=s.k, v=s.v) == "cuda":
        return exact_partial_lse(q, s, scale)
    x = logits(q, s.k, s.lens, scale)
    w, m = masked_weights(x)
    vv = np.asarray(s.v, dtype=np.float64)
    vv = np.where(np.arange(n)[None, None, :, None] < s.lens[:, None, None, None], vv, 0.0)
    acc = np.einsum("bkgn,bknd->bkgd", w.reshape(B, Hkv, Hq // Hkv, n), vv).reshape(B, Hq, D)
    return m[..., 0], w.sum(axis=-1), acc, _bad(q, s)


def exact_partial_lse(q, s: Shard, scale: float):
    """(m, l, acc, bad) of rank s from ``stochattn.exact_attention(..., return_lse=True)``
    on its shard, whichever backend the arrays pick (the GPU kernels for CuPy / torch,
    which copy a non-contiguous shard view first): ``(m=lse, l=1, acc=out)`` where lse is
    finite, an empty partial (m 0, l 0, acc 0) where it is -inf (no live token), and bad
    where it is NaN (a non-finite query or live key: the row becomes NaN after the merge,
    as :func:`_finish` does for the reference). Only the (B, Hq, D + 1) result comes to the
    host."""
    from ..cuda.runtime.arrays import to_host
    from ..exact import exact_attention

    out, lse = exact_attention(q, s.k, s.v, s.lens, softmax_scale=scale, return_lse=True)
    out = np.asarray(to_host(out), dtype=np.float64)
    lse = np.asarray(to_host(lse), dtype=np.float64)
    bad = np.isnan(lse)
    live = np.isfinite(lse)
    m = np.where(live, lse, 0.0)
    acc = np.where(live[..., None], out, 0.0)
    return m, live.astype(np.float64), acc, bad


def _pack(m, l, acc):
    return np.concatenate([m[..., None], l[..., None], acc], axis=-1)


def _merge_packed(gathered):
    return merge_partials(gathered[..., 0], gathered[..., 1], gathered[..., 2:])


def cp_exact_attention(q, shards, comm: Collectives, scale: float) -> CPResult:
    """Exact decode over the shards: one all-gather of (m, l, acc) per (b, h), then
    :func:`merge_partials`. Equals ``reference.exact.exact_attention`` up to summation
    order (docs/context_parallel.md gives the tolerance)."""
    local = _local(comm, shards)
    parts = [_exact_partial(q, s, scale) for s in local]
    outs = [_merge_packed(g) for g in comm.all_gather([_pack(*p[:3]) for p in parts])]
    return CPResult(_finish(comm, shards, q, outs, [p[3] for p in parts]))
