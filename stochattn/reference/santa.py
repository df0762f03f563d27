"""SANTA / S²ANTA value stage: the global sampler and the prop and flash tile schedules.

Per (sequence b, query head h), with ``row = b * Hq + h``, logits x_j over the L tokens of
the sequence and weights w_j = exp(x_j - max x), every estimator returns

    o_hat = (1 / S) sum_m v_{J_m}          (global, prop)
    o_hat = sum_t (W_t / Z) mu_t           (flash)

Schedules (docs/estimators.md):

- ``global``: S sorted points T_m from :func:`.samplers.sample_points` (row, stream 0) are
  mapped through the CDF of the whole sequence: J_m = F^-1(T_m).
- ``prop``: what the two-pass GPU kernel does. Pass 1 keeps per tile of ``tile_size``
  tokens its max m_t and l_t = sum exp(x - m_t); a reducer forms the tile masses
  W_t = exp(m_t - m*) l_t, Z = sum_t W_t and the prefix C_t. The SAME points as
  ``global`` are split over the tiles (tile t holds C_{t-1} <= T_m Z < C_t) and each is
  mapped to a row by the tile-local CDF, so the indices equal the global ones up to
  rounding at CDF boundaries: prop is exactly as unbiased as global. Tiles holding no
  point read no V.
- ``flash``: no global sync. Each of the T_L = ceil(L / tile_size) tiles draws
  S_t = ceil(S / T_L) points (stream = tile index) from its own local distribution, takes
  the mean mu_t of those V rows, and the merge weights it by W_t / Z. Unbiased because
  E[mu_t] is the tile's exact local attention output.

Everything is float64. These functions take validated NumPy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..spec import SCHEDULES, SCORES
from .common import kv_head_of, lengths, logits, masked_weights, propagate_nonfinite
from .samplers import invert_cdf, sample_points

__all__ = [
    "SCHEDULES",
    "SCORES",
    "SantaResult",
    "TileStats",
    "tile_stats",
    "merge_scales",
    "searchsorted_rows",
    "last_positive",
    "global_indices",
    "prop_indices",
    "systematic_tile_counts",
    "flash_estimate",
    "gather_mean",
    "santa_attention",
    "santa_attention_per_head",
    "check_head_budgets",
]

# SCHEDULES and SCORES (re-exported) are defined in stochattn.spec.


@dataclass(frozen=True)
class TileStats:
    """Pass-1 statistics of the tiles of each row (B, Hq rows, T = ceil(N / tile_size) tiles).

    Attributes
    ----------
    tile_size : int
    local : ndarray of float64, shape (B, Hq, T, tile_size)
        exp(x - m_t) inside each tile; 0 past the sequence (and in padding).
    m : ndarray of float64, shape (B, Hq, T)
        Tile max m_t (0 for tiles past the sequence).
    l : ndarray of float64, shape (B, Hq, T)
        l_t = sum of ``local`` over the tile.
    scale : ndarray of float64, shape (B, Hq, T)
        exp(m_t - m*), m* the row max; 0 for tiles past the sequence.
    W : ndarray of float64, shape (B, Hq, T)
        Tile masses W_t = scale_t l_t (relative to exp(m*)).
    C : ndarray of float64, shape (B, Hq, T)
        Inclusive prefix sums of W along the tiles.
    Z : ndarray of float64, shape (B, Hq)
        Total mass C_{T-1}; 0 for empty sequences.
    """

    tile_size: int
    local: np.ndarray
    m: np.ndarray
    l: np.ndarray
    scale: np.ndarray
    W: np.ndarray
    C: np.ndarray
    Z: np.ndarray

    @property
    def C_before(self) -> np.ndarray:
        """Exclusive prefix C_{t-1} (0 for the first tile), shape (B, Hq, T)."""
        first = np.zeros(self.C.shape[:-1] + (1,))
        return np.concatenate([first, self.C[..., :-1]], axis=-1)


def merge_scales(m: np.ndarray, has: np.ndarray, axis: int = -1):
    """Flash-decoding's merge of parts along ``axis``: ``(m*, scale)``, m* the max of m
    over the parts that exist (0 when none does) and scale = exp(m - m*) <= 1 on them, 0 on
    the others. Parts that do not exist use m* in place of m (exp(0) = 1, no overflow when
    m* << 0) and are then zeroed. The one home of this rule: the tiles of pass 1 here, the
    ranks of :mod:`stochattn.context_parallel`."""
    mstar = np.max(np.where(has, m, -np.inf), axis=axis)
    mstar = np.where(np.isfinite(mstar), mstar, 0.0)
    ms = np.expand_dims(mstar, axis)
    return mstar, np.where(has, np.exp(np.where(has, m, ms) - ms), 0.0)


def tile_stats(x: np.ndarray, tile_size: int) -> TileStats:
    """Pass 1 of the tiled schedules: per-tile max, local sums, masses and prefix.

    Parameters
    ----------
    x : ndarray of float64, shape (B, Hq, N)
        Logits, -inf past each sequence.
    tile_size : int
        Tokens per tile (the last tile of a sequence may be partial).
    """
    B, Hq, N = x.shape
    T = -(-N // tile_size)
    pad = T * tile_size - N
    xt = np.pad(x, ((0, 0), (0, 0), (0, pad)), constant_values=-np.inf).reshape(B, Hq, T, tile_size)
    m = xt.max(axis=-1)
    has = np.isfinite(m)  # the tile holds at least one token of the sequence
    # Empty tiles get m_t = 0 so that x - m_t is -inf - 0 = -inf, never -inf - (-inf) = NaN.
    m = np.where(has, m, 0.0)
    local = np.exp(xt - m[..., None])  # <= 1: shifted by the tile max, so |x| ~ 1e4 is safe
    l = local.sum(axis=-1)
    _, scale = merge_scales(m, has)
    W = scale * l
    C = np.cumsum(W, axis=-1)  # prefix sums over tiles: the reducer's global CDF at tile ends
    return TileStats(tile_size, local, m, l, scale, W, C, C[..., -1].copy())


def _rows(B: int, Hq: int) -> np.ndarray:
    """Random-stream row of each (b, h): b * Hq + h, shape (B, Hq)."""
    return np.arange(B, dtype=np.int64)[:, None] * Hq + np.arange(Hq, dtype=np.int64)[None, :]


def global_points(sampler: str, S: int, B: int, Hq: int, *, seed: int, offset: int) -> np.ndarray:
    """The S sorted points of every row (stream 0), shape (B, Hq, S)."""
    return sample_points(sampler, S, seed=seed, offset=offset, row=_rows(B, Hq), stream=0,
                         heads=Hq)


def global_indices(x: np.ndarray, sampler: str, S: int, *, seed: int, offset: int) -> np.ndarray:
    """Global schedule: J_m = F^-1(T_m) over the whole sequence, shape (B, Hq, S), int64.

    Rows of empty sequences get index 0 (the caller ignores them).
    """
    B, Hq, _ = x.shape
    w, _ = masked_weights(x)  # exp(x - max): the unnormalised CDF's increments
    return invert_cdf(w, global_points(sampler, S, B, Hq, seed=seed, offset=offset))


def searchsorted_rows(c: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per row, the first index i with c[i] > target (c non-decreasing along the last axis)."""
    lead = c.shape[:-1]
    c2 = c.reshape(-1, c.shape[-1])
    t2 = targets.reshape(-1, targets.shape[-1])
    out = np.empty(t2.shape, dtype=np.int64)
    for i in range(c2.shape[0]):
        out[i] = np.searchsorted(c2[i], t2[i], side="right")
    return out.reshape(lead + targets.shape[-1:])


def last_positive(a: np.ndarray) -> np.ndarray:
    """Index of the last positive entry along the last axis (0 when none)."""
    n = a.shape[-1]
    pos = a > 0
    return np.where(pos.any(axis=-1), n - 1 - np.argmax(pos[..., ::-1], axis=-1), 0)


def prop_indices(x: np.ndarray, sampler: str, S: int, tile_size: int, *, seed: int, offset: int):
    """Prop schedule: the global points split over tiles and inverted tile-locally.

    Parameters
    ----------
    x : ndarray of float64, shape (B, Hq, N)
        Logits, -inf past each sequence.
    sampler : str
    S, tile_size : int
    seed, offset : int

    Returns
    -------
    J : ndarray of int64, shape (B, Hq, S)
        Token index of each point (0 for empty sequences).
    counts : ndarray of int64, shape (B, Hq, T)
        Points held by each tile (all 0 for empty sequences).
    stats : TileStats
    """
    B, Hq, _ = x.shape
    st = tile_stats(x, tile_size)
    T = st.W.shape[-1]
    points = global_points(sampler, S, B, Hq, seed=seed, offset=offset)
    target = points * st.Z[..., None]  # T_m * Z: the point on the unnormalised global CDF
    # Tile t holds C_{t-1} <= T_m Z < C_t: the first tile whose prefix exceeds the target.
    tile = searchsorted_rows(st.C, target)
    # A point that rounding pushes to Z (or past it) belongs to the last tile with mass,
    # as in invert_cdf; this also keeps the index in range for empty rows (-> tile 0).
    tile = np.minimum(tile, last_positive(st.W)[..., None])
    bi = np.arange(B)[:, None, None]
    hi = np.arange(Hq)[None, :, None]
    before = st.C_before[bi, hi, tile]
    sc = st.scale[bi, hi, tile]
    # Target inside the tile, in the tile's own units exp(x - m_t): the mass to the left
    # of the point within the tile is T Z - C_{t-1} = exp(m_t - m*) * (local mass).
    # sc > 0 for every tile that holds a point of a non-empty row; 1 avoids 0/0 otherwise.
    local_target = (target - before) / np.where(sc > 0, sc, 1.0)
    cum = np.cumsum(st.local, axis=-1)[bi, hi, tile]  # (B, Hq, S, tile_size): tile-local CDF
    # First row whose local cumsum exceeds the target (= searchsorted side="right") ...
    r = (cum <= local_target[..., None]).sum(axis=-1)
    # ... clipped to the last positive-weight row of the tile (a target at or past l_t
    # through rounding must not select padding or a zero-weight row).
    r = np.minimum(r, last_positive(st.local)[bi, hi, tile])
    nonempty = (st.Z > 0)[..., None]
    J = np.where(nonempty, tile * tile_size + r, 0).astype(np.int64)
    counts = np.zeros((B, Hq, T), dtype=np.int64)
    bb, hh, _ = np.broadcast_arrays(bi, hi, tile)
    np.add.at(counts, (bb, hh, tile), nonempty.astype(np.int64) * np.ones_like(tile))
    return J, counts, st


def systematic_tile_counts(u: np.ndarray, S: int, C: np.ndarray, Z: np.ndarray) -> np.ndarray:
    """Closed-form points per tile of the systematic sampler, from the prefix alone.

    With T_m = (u + m) / S, m = 0..S-1 and u in [0, 1), the number of points below c is
    n(c) = clip(ceil(S c - u), 0, S), and tile t holds n(C_t / Z) - n(C_{t-1} / Z). This is
    what a GPU tile computes without seeing any other tile's points.

    Parameters
    ----------
    u : ndarray of float64, shape (B, Hq)
        S * T_0, the systematic offset in [0, 1).
    S : int
    C : ndarray of float64, shape (B, Hq, T)
        Inclusive prefix of the tile masses.
    Z : ndarray of float64, shape (B, Hq)
        Total mass (rows with Z = 0 get all-zero counts).

    Returns
    -------
    ndarray of int64, shape (B, Hq, T)
    """
    safe_z = np.where(Z > 0, Z, 1.0)[..., None]
    frac = np.concatenate([np.zeros(C.shape[:-1] + (1,)), C / safe_z], axis=-1)
    n = np.clip(np.ceil(S * frac - u[..., None]), 0, S).astype(np.int64)
    counts = np.diff(n, axis=-1)
    return np.where((Z > 0)[..., None], counts, 0)


def gather_mean(v: np.ndarray, J: np.ndarray, q_heads: int) -> np.ndarray:
    """(1/S) sum_m v[b, h // G, J[b, h, m]]: gather-and-add, shape (B, Hq, D), float64."""
    B, Hkv = v.shape[:2]
    kv = kv_head_of(q_heads, Hkv)
    rows = np.asarray(v, dtype=np.float64)[np.arange(B)[:, None, None], kv[None, :, None], J]
    return rows.sum(axis=2) / J.shape[-1]


def flash_estimate(x: np.ndarray, v: np.ndarray, lens: np.ndarray, sampler: str, S: int,
                   tile_size: int, *, seed: int, offset: int):
    """Flash schedule: per-tile local samples merged with weights W_t / Z.

    Returns
    -------
    out : ndarray of float64, shape (B, Hq, D)
    read : ndarray of bool, shape (B, Hq, N)
        Rows sampled by any tile.
    samples : ndarray of int64, shape (B, Hq, T)
        S_t per tile (0 past the sequence).
    waste : ndarray of float64, shape (B, Hq)
        sum_t max(0, S_t - S W_t / Z) / sum_t S_t (0 for empty sequences).
    """
    B, Hq, N = x.shape
    D = v.shape[-1]
    st = tile_stats(x, tile_size)
    T = st.W.shape[-1]
    kv = kv_head_of(Hq, v.shape[1])
    v64 = np.asarray(v, dtype=np.float64)
    out = np.zeros((B, Hq, D))
    read = np.zeros((B, Hq, N), dtype=bool)
    samples = np.zeros((B, Hq, T), dtype=np.int64)
    waste = np.zeros((B, Hq))
    rows = _rows(B, Hq)
    for b in range(B):
        TL = -(-int(lens[b]) // tile_size)  # tiles of this sequence
        if TL == 0:
            continue
        St = -(-S // TL)
        # (Hq, TL, St) points, stream = tile index: each tile samples independently.
        pts = sample_points(sampler, St, seed=seed, offset=offset, row=rows[b][:, None],
                            stream=np.arange(TL)[None, :], heads=Hq)
        local_j = invert_cdf(st.local[b, :, :TL], pts)  # rows inside each tile
        J = local_j + (np.arange(TL) * tile_size)[None, :, None]
        mu = v64[b][kv[:, None, None], J].mean(axis=2)  # (Hq, TL, D): local means
        share = st.W[b, :, :TL] / st.Z[b][:, None]  # W_t / Z, Z > 0 since L > 0
        out[b] = np.einsum("ht,htd->hd", share, mu)  # the delayed-normalisation merge
        read[b, np.arange(Hq)[:, None], J.reshape(Hq, -1)] = True
        samples[b, :, :TL] = St
        waste[b] = np.maximum(0.0, St - S * share).sum(axis=-1) / (TL * St)
    return out, read, samples, waste


@dataclass(frozen=True)
class SantaResult:
    """Output and bookkeeping of one reference call (all NumPy, float64 / int64 / bool).

    Attributes
    ----------
    out : shape (B, Hq, D)
    indices : shape (B, Hq, S) or None
        Sampled token indices (global and prop; None for flash). Rows of empty sequences
        hold 0 and are not used.
    read : shape (B, Hq, N), bool
        Distinct V rows read per query head.
    samples_per_tile : shape (B, Hq, T)
    sample_waste : shape (B, Hq)
    k_feature_fraction : shape (B, Hq) or None
    true_mass : shape (B, Hq)
        Exact softmax mass (exact logits) of the rows in ``read``.
    """

    out: np.ndarray
    indices: np.ndarray | None
    read: np.ndarray
    samples_per_tile: np.ndarray
    sample_waste: np.ndarray
    k_feature_fraction: np.ndarray | None
    true_mass: np.ndarray


def _score_stage(q, k, lens, scale, scores, bernoulli_draws, bernoulli_group_shared, seed,
                 offset):
    """``(exact logits, the logits the sampler uses, feature fraction or None)``: the exact
    logits, or the Bernoulli estimate of the scores times ``scale``."""
    x_exact = logits(q, k, lens, scale)
    if scores == "exact":
        return x_exact, x_exact, None
    if scores != "bernoulli":
        raise ValueError(f"`scores` must be one of {', '.join(map(repr, SCORES))}, got {scores!r}")
    from .bernoulli import estimate_scores  # the score stage lives in its own module

    s_hat, fraction = estimate_scores(q, k, lens, draws=bernoulli_draws,
                                      group_shared=bernoulli_group_shared, seed=seed,
                                      offset=offset)
    x = scale * np.asarray(s_hat, dtype=np.float64)  # -inf past the sequence stays -inf
    return x_exact, x, np.asarray(fraction, dtype=np.float64)


def santa_attention(q, k, v, seq_lens, scale: float, *, budget: int, sampler: str, schedule: str,
                    tile_size: int, seed: int, offset: int, scores: str = "exact",
                    bernoulli_draws: int = 4, bernoulli_group_shared: bool = False) -> SantaResult:
    """Reference SANTA estimate of one decode step; see the module docstring.

    Parameters are validated NumPy inputs; ``budget`` is S. Returns a :class:`SantaResult`.
    """
    B, Hq, D = q.shape
    N = k.shape[2]
    lens = lengths(seq_lens, B, N)
    S = int(budget)
    x_exact, x, feature_fraction = _score_stage(q, k, lens, scale, scores, bernoulli_draws,
                                                bernoulli_group_shared, seed, offset)

    nonempty = lens > 0
    T = -(-N // tile_size)
    indices = None
    if schedule in ("global", "prop"):
        if schedule == "global":
            indices = global_indices(x, sampler, S, seed=seed, offset=offset)
            # Points per tile, counted from the tile of each sampled token.
            samples = np.zeros((B, Hq, T), dtype=np.int64)
            np.add.at(samples, (np.arange(B)[:, None, None], np.arange(Hq)[None, :, None],
                                indices // tile_size), 1)
        else:
            indices, samples, _ = prop_indices(x, sampler, S, tile_size, seed=seed, offset=offset)
        samples = samples * nonempty[:, None, None]
        out = gather_mean(v, indices, Hq)
        read = np.zeros((B, Hq, N), dtype=bool)
        read[np.arange(B)[:, None, None], np.arange(Hq)[None, :, None], indices] = True
        waste = np.zeros((B, Hq))
    elif schedule == "flash":
        out, read, samples, waste = flash_estimate(x, v, lens, sampler, S, tile_size,
                                                   seed=seed, offset=offset)
    else:
        raise ValueError(f"`schedule` must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")

    # Empty sequences: a zero output row, nothing read; non-finite queries or keys: NaN rows.
    out = propagate_nonfinite(np.where(nonempty[:, None, None], out, 0.0), q, k, lens)
    read &= nonempty[:, None, None]

    # True mass of the rows read, under exact attention (exact logits even for Bernoulli).
    w_exact, _ = masked_weights(x_exact)
    z_exact = w_exact.sum(axis=-1)
    mass = (w_exact * read).sum(axis=-1)
    true_mass = np.divide(mass, z_exact, out=np.zeros_like(mass), where=z_exact > 0)
    return SantaResult(out, indices, read, samples, waste, feature_fraction, true_mass)


# ---------------------------------------------------------------------------------------
# Per-head budgets (docs/budgets.md): every (b, h) row with its own S.
# ---------------------------------------------------------------------------------------

def check_head_budgets(budget, batch: int, q_heads: int, lens: np.ndarray) -> np.ndarray:
    """``budget`` as int64 (B, Hq): an integer array, >= 1 on every row of a non-empty
    sequence (rows of empty sequences may hold 0: they draw nothing)."""
    arr = np.asarray(budget)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"`budget` must be an integer array, got dtype {arr.dtype}")
    if arr.shape != (batch, q_heads):
        raise ValueError(f"`budget` must have shape ({batch}, {q_heads}), got {arr.shape}")
    arr = arr.astype(np.int64)
    need = np.broadcast_to((lens > 0)[:, None], arr.shape)
    if (arr[need] < 1).any() or (arr < 0).any():
        raise ValueError(f"`budget` must be >= 1 on every head of a non-empty sequence, got "
                         f"min {int(arr[need].min() if need.any() else arr.min())}")
    return arr


def _budget_groups(budget: np.ndarray):
    """(S, mask (B, Hq)) for every distinct S >= 1 in ``budget`` (rows with 0 draw nothing)."""
    for S in np.unique(budget):
        if S >= 1:
            yield int(S), budget == S


def _prop_rows(st: TileStats, cum: np.ndarray, mask: np.ndarray, points: np.ndarray):
    """prop_indices' tile split and tile-local inversion for the rows ``mask`` only.

    ``points`` (R, S) are the rows' global points; ``cum`` is ``np.cumsum(st.local, -1)``.
    Every float operation is the one prop_indices does (same operands, same order), so the
    indices are the same bits; only the search differs: a per-tile ``searchsorted`` on the
    non-decreasing local cumsum (cumsum of non-negative floats never decreases) counts the
    entries <= target, which is what prop_indices' ``(cum <= target).sum()`` counts, without
    its (S, tile_size) temporary per row.
    Returns J (R, S) int64 and counts (R, T) int64.
    """
    Z = st.Z[mask]
    target = points * Z[:, None]  # T_m * Z, as in prop_indices
    tile = searchsorted_rows(st.C[mask], target)
    tile = np.minimum(tile, last_positive(st.W)[mask][:, None])
    ri = np.arange(points.shape[0])[:, None]
    before = st.C_before[mask][ri, tile]
    sc = st.scale[mask][ri, tile]
    local_target = (target - before) / np.where(sc > 0, sc, 1.0)
    cum_rows = cum[mask]  # (R, T, tile_size)
    r = np.empty_like(tile)
    for i in range(points.shape[0]):
        # Points are sorted, so each tile's points are one contiguous run.
        for t in np.unique(tile[i]):
            sel = tile[i] == t
            r[i, sel] = np.searchsorted(cum_rows[i, t], local_target[i, sel], side="right")
    r = np.minimum(r, last_positive(st.local)[mask][ri, tile])
    nonempty = (Z > 0)[:, None]
    J = np.where(nonempty, tile * st.tile_size + r, 0).astype(np.int64)
    T = st.W.shape[-1]
    counts = np.zeros((points.shape[0], T), dtype=np.int64)
    np.add.at(counts, (np.broadcast_to(ri, tile.shape), tile), nonempty.astype(np.int64))
    return J, counts


def santa_attention_per_head(q, k, v, seq_lens, scale: float, *, budget, sampler: str,
                             schedule: str, tile_size: int, seed, offset,
                             scores: str = "exact", bernoulli_draws: int = 4,
                             bernoulli_group_shared: bool = False) -> SantaResult:
    """:func:`santa_attention` with a budget per query head: ``budget`` (B, Hq) int.

    Row (b, h) draws exactly what a fixed-budget call with ``budget = budget[b, h]`` draws
    for that row (same points from the same stream: row b * Hq + h, stream 0 or the tile
    for flash), and its output is the same bits: the random stream layout does not depend
    on the other rows' budgets. Allocation over tiles is the fixed-S one per row, so prop
    stays exactly as unbiased as global.

    Parameters
    ----------
    budget : integer array, shape (B, Hq)
        S per (sequence, query head), >= 1 on non-empty sequences (0 allowed, and ignored,
        on empty ones).
    Other parameters as in :func:`santa_attention`.

    Returns
    -------
    SantaResult
        ``indices`` (global, prop) has shape (B, Hq, max S); row (b, h) holds its
        ``budget[b, h]`` indices first and -1 after them. Other fields as in
        :func:`santa_attention`.

    Notes
    -----
    Rows are processed in groups of equal S. The flash schedule runs
    :func:`flash_estimate` once per distinct S over every row (the per-tile streams are
    laid out per (row, tile), so a subset cannot be drawn apart without repeating it);
    its cost is (distinct budgets) x (one fixed-S call).
    """
    B, Hq, D = q.shape
    N = k.shape[2]
    lens = lengths(seq_lens, B, N)
    S_of = check_head_budgets(budget, B, Hq, lens)
    x_exact, x, feature_fraction = _score_stage(q, k, lens, scale, scores, bernoulli_draws,
                                                bernoulli_group_shared, seed, offset)
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")

    nonempty = lens > 0
    T = -(-N // tile_size)
    rows = _rows(B, Hq)
    bidx = np.broadcast_to(np.arange(B)[:, None], (B, Hq))
    kv = np.broadcast_to(kv_head_of(Hq, v.shape[1])[None, :], (B, Hq))
    v64 = np.asarray(v, dtype=np.float64)
    out = np.zeros((B, Hq, D))
    read = np.zeros((B, Hq, N), dtype=bool)
    samples = np.zeros((B, Hq, T), dtype=np.int64)
    waste = np.zeros((B, Hq))
    indices = None
    if schedule in ("global", "prop"):
        indices = np.full((B, Hq, max(int(S_of.max()), 1)), -1, dtype=np.int64)
        if schedule == "global":
            w, _ = masked_weights(x)
        else:
            st = tile_stats(x, tile_size)
            cum = np.cumsum(st.local, axis=-1)  # tile-local CDFs, as prop_indices forms them
        for S, mask in _budget_groups(S_of):
            pts = sample_points(sampler, S, seed=seed, offset=offset, row=rows[mask], stream=0,
                                heads=Hq)  # the rows' own stream-0 points: global_points
            if schedule == "global":
                J = invert_cdf(w[mask], pts)
                cnt = np.zeros((J.shape[0], T), dtype=np.int64)
                np.add.at(cnt, (np.arange(J.shape[0])[:, None], J // tile_size), 1)
            else:
                J, cnt = _prop_rows(st, cum, mask, pts)
            indices[mask, :S] = J
            samples[mask] = cnt
            # gather_mean for these rows: sum over the S draws, then / S (same order).
            out[mask] = v64[bidx[mask][:, None], kv[mask][:, None], J].sum(axis=1) / S
            read_rows = np.zeros((J.shape[0], N), dtype=bool)
            read_rows[np.arange(J.shape[0])[:, None], J] = True
            read[mask] = read_rows
        samples = samples * nonempty[:, None, None]
    else:
        for S, mask in _budget_groups(S_of):
            o_S, read_S, samples_S, waste_S = flash_estimate(x, v, lens, sampler, S, tile_size,
                                                             seed=seed, offset=offset)
            out[mask], read[mask] = o_S[mask], read_S[mask]
            samples[mask], waste[mask] = samples_S[mask], waste_S[mask]

    out = propagate_nonfinite(np.where(nonempty[:, None, None], out, 0.0), q, k, lens)
    read &= nonempty[:, None, None]
    w_exact, _ = masked_weights(x_exact)
    z_exact = w_exact.sum(axis=-1)
    mass = (w_exact * read).sum(axis=-1)
    true_mass = np.divide(mass, z_exact, out=np.zeros_like(mass), where=z_exact > 0)
    return SantaResult(out, indices, read, samples, waste, feature_fraction, true_mass)
