"""Sample points of the SANTA samplers and the inverse-CDF map from points to tokens.

A sampler turns S budget slots into S sorted points T_0 <= ... <= T_{S-1} in [0, 1); a
point T selects the token J = F^-1(T), the first token whose cumulative weight exceeds
T * Z. Every sampler's points are uniform in [0, 1) marginally, which is what makes the
average of the selected V rows unbiased.

Draws come from the shared counter-based generator (:mod:`.rng`), one stream per
(row, stream) pair:

- ``systematic``: one uniform u (draw 0); T_m = (m + u) / S.
- ``stratified``: S uniforms u_m (draw m); T_m = (m + u_m) / S.
- ``iid``: S + 1 uniforms u_i (draw i), exponential spacings E_i = -log(u_i);
  T_m = (E_0 + ... + E_m) / (E_0 + ... + E_S). These are the order statistics of S iid
  uniforms (Renyi's representation), so the points come sorted, which is what lets a GPU
  tile find its points by binary search; the estimator is symmetric in its draws, so
  sorting changes nothing else.
"""

from __future__ import annotations

import numpy as np

from ..spec import PURPOSE_VALUE_SAMPLER, SAMPLERS
from .rng import uniforms

__all__ = ["SAMPLERS", "sample_points", "invert_cdf"]

# SAMPLERS (re-exported) is defined in stochattn.spec, which the CUDA backend reads too.


def sample_points(sampler: str, S: int, *, seed, offset, row, stream=0,
                  purpose: int = PURPOSE_VALUE_SAMPLER, heads=None) -> np.ndarray:
    """Sorted sample points in [0, 1), float64, shape ``broadcast(row, stream).shape + (S,)``.

    Parameters
    ----------
    sampler : {"iid", "stratified", "systematic"}
    S : int
        Number of points, >= 1.
    seed, offset, purpose : int
        Stream selection (see :mod:`.rng`); ``seed`` and ``offset`` may also be per-sequence
        arrays (B,), with ``heads`` rows per sequence (``row = b * heads + h``).
    row, stream : array_like of int
        Counter fields; broadcast together.
    """
    row, stream = np.broadcast_arrays(np.asarray(row, dtype=np.int64), np.asarray(stream, dtype=np.int64))
    r, s = row[..., None], stream[..., None]
    m = np.arange(S, dtype=np.int64)
    if sampler == "systematic":
        u = uniforms(seed, offset, purpose, r, s, 0, heads=heads)
        return (m + u) / S
    if sampler == "stratified":
        u = uniforms(seed, offset, purpose, r, s, m, heads=heads)
        return (m + u) / S
    if sampler == "iid":
        e = -np.log(uniforms(seed, offset, purpose, r, s, np.arange(S + 1, dtype=np.int64),
                                heads=heads))
        c = np.cumsum(e, axis=-1)  # prefix sums of the spacings
        return c[..., :S] / c[..., S:]
    raise ValueError(f"`sampler` must be one of {', '.join(map(repr, SAMPLERS))}, got {sampler!r}")


def invert_cdf(weights: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Token index of each point: J = first j with cumsum(weights)[j] > T * sum(weights).

    Parameters
    ----------
    weights : ndarray, shape (..., N)
        Non-negative (unnormalised) weights, at least one positive per row.
    points : ndarray, shape (..., S)
        Points in [0, 1).

    Returns
    -------
    ndarray of int64, shape (..., S)
        Never a zero-weight token: a point that rounding pushes to the total maps to the
        last positive-weight token.
    """
    lead = weights.shape[:-1]
    w2 = weights.reshape(-1, weights.shape[-1])
    p2 = np.broadcast_to(points, lead + points.shape[-1:]).reshape(-1, points.shape[-1])
    out = np.empty(p2.shape, dtype=np.int64)
    for i in range(w2.shape[0]):
        c = np.cumsum(w2[i])  # running mass in token order: the unnormalised CDF
        idx = np.searchsorted(c, p2[i] * c[-1], side="right")
        last = int(np.flatnonzero(w2[i] > 0)[-1]) if c[-1] > 0 else 0
        out[i] = np.minimum(idx, last)
    return out.reshape(lead + points.shape[-1:])
