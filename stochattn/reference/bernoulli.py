"""Bernoulli qK^T: an unbiased estimate of the scores that reads only some key features.

Per query head (docs/estimators.md), with a = |q| and alpha = max_j a_j, feature j has the
inclusion probability p_j = a_j / alpha. Each of ``draws`` independent draws i keeps
feature j when z_ij = [u_ij < p_j], and

    s_hat = (1 / draws) sum_i sum_j z_ij (q_j / p_j) k_j
          = (alpha / draws) sum_i t_i . k,        t_ij = sign(q_j) z_ij,

so E[s_hat] = sum_j p_j (q_j / p_j) k_j = q . k. Only features with some z_ij = 1 need to
be read from K. The variance of one score is

    Var(s_hat_n) = (1 / draws) sum_f k_nf^2 q_f^2 (1 - p_f) / p_f.

Mean group query (``group_shared=True``): the query heads of one GQA group share ONE
feature pattern, drawn from the mean magnitude pbar_j = mean_h |q_hj| over the group,
p_j = pbar_j / max_j pbar_j; head h weights the drawn features by q_hj / p_j, which keeps
every head unbiased. A feature with pbar_j = 0 is never drawn; then q_hj = 0 for every
head of the group, so it contributes nothing either way.

Random stream (``docs/rng.md``): u_ij = uniforms(seed, offset, PURPOSE_BERNOULLI,
row, stream=0, draw=i * D + j), with row = b * Hq + h per head, or b * Hkv + kv_head for a
shared group pattern.
"""

from __future__ import annotations

import numpy as np

from .common import valid_mask
from .rng import PURPOSE_BERNOULLI, uniforms

__all__ = ["estimate_scores", "feature_counts"]


def feature_counts(magnitude: np.ndarray, *, draws: int, seed: int, offset: int) -> np.ndarray:
    """How many of the ``draws`` draws keep each feature: c_j ~ Binomial(draws, p_j).

    Parameters
    ----------
    magnitude : ndarray of float64, shape (B, H, D)
        Non-negative feature magnitudes a_j of each row (|q| per head, or the group's
        summed |q|); p_j = a_j / max_j a_j. Row (b, h) of the random stream is b * H + h.
    draws : int
        Number of Bernoulli draws, >= 1.
    seed, offset : int or integer ndarray of shape (B,)
        Stream selection (see :mod:`.rng`): one per call, or one per sequence.

    Returns
    -------
    ndarray of int64, shape (B, H, D)
    """
    B, H, D = magnitude.shape
    amax = magnitude.max(axis=-1, keepdims=True)  # (B, H, 1)
    row = (np.arange(B, dtype=np.int64)[:, None] * H + np.arange(H, dtype=np.int64)[None, :])
    draw = np.arange(draws, dtype=np.int64)[:, None] * D + np.arange(D, dtype=np.int64)[None, :]
    u = uniforms(seed, offset, PURPOSE_BERNOULLI, row[:, :, None, None], 0, draw,
                 heads=H)  # (B, H, draws, D)
    # z = [u < a_j / amax], decided as u * amax < a_j to avoid the division. u has 24
    # significant bits, so for float16/float32 magnitudes the product is exact in float64
    # and the decision is exactly "u < p_j" (a GPU kernel can reproduce it bit for bit).
    # u < 1 makes a_j = amax (p_j = 1) always kept; a_j = 0 (and amax = 0) never is.
    keep = u * amax[:, :, None, :] < magnitude[:, :, None, :]
    return keep.sum(axis=2, dtype=np.int64)


def estimate_scores(q, k, lens, *, draws: int, group_shared: bool, seed: int, offset: int):
    """Unbiased Bernoulli estimate of the unscaled scores q . k, and the features read.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, D)
    k : ndarray, shape (B, Hkv, N, D)
        Validated arrays of any float dtype; the math runs in float64.
    lens : ndarray of int64, shape (B,)
        Tokens per sequence.
    draws : int
        Number of Bernoulli draws, >= 1.
    group_shared : bool
        One feature pattern per KV head from the group's mean |q| (mean group query)
        instead of one per query head.
    seed, offset : int
        Stream selection (see :mod:`.rng`).

    Returns
    -------
    s_hat : ndarray of float64, shape (B, Hq, N)
        Unbiased for q[b, h] . k[b, h // G, j] when j < lens[b]; -inf for j >= lens[b], so
        that ``scale * s_hat`` feeds a softmax directly. Exactly 0 on valid positions of
        a head whose q is all zero.
    feature_fraction : ndarray of float64, shape (B, Hq)
        Fraction of the D key features that some draw keeps (the pattern's fraction for
        every head of the group when ``group_shared``; 0 for an all-zero q).
    """
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q64 = np.asarray(q, dtype=np.float64)
    if not group_shared:
        a = np.abs(q64)
        counts = feature_counts(a, draws=draws, seed=seed, offset=offset)  # (B, Hq, D)
        alpha = a.max(axis=-1, keepdims=True)
        # q_j / p_j = alpha * sign(q_j): the weight written without a division, so a
        # p_j = 1 feature (always drawn, counts = draws) carries exactly q_j.
        q_hat = alpha * np.sign(q64) * (counts / draws)
        read = counts > 0
    else:
        qg = q64.reshape(B, Hkv, G, D)
        # The group's summed magnitude: p_j = pbar_j / max pbar_j is the same with sums
        # as with means, and a sum of G terms rounds once less.
        a = np.abs(qg).sum(axis=2)  # (B, Hkv, D)
        counts = feature_counts(a, draws=draws, seed=seed, offset=offset)  # (B, Hkv, D)
        amax = a.max(axis=-1, keepdims=True)
        # Importance weight per drawn feature: (counts / draws) / p_j with
        # p_j = a_j / amax, written as (counts / draws) * (amax / a_j) so that a p_j = 1
        # feature gets exactly counts / draws. Features never drawn get weight 0 (no
        # division by a_j = 0: a drawn feature has a_j > 0).
        drawn = counts > 0
        inv_p = np.ones_like(a)
        np.divide(amax, a, out=inv_p, where=drawn)
        weight = np.where(drawn, (counts / draws) * inv_p, 0.0)
        q_hat = (qg * weight[:, :, None, :]).reshape(B, Hq, D)
        read = np.repeat(drawn, G, axis=1)  # every head of the group reads the pattern
    # s_hat = q_hat . k per KV head, GQA as in common.logits: each K head read once.
    s_hat = np.einsum(
        "bkgd,bknd->bkgn", q_hat.reshape(B, Hkv, G, D), np.asarray(k, dtype=np.float64)
    ).reshape(B, Hq, N)
    s_hat = np.where(valid_mask(lens, N), s_hat, -np.inf)
    feature_fraction = read.sum(axis=-1) / D
    return s_hat, feature_fraction
