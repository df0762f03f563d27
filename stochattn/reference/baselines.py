"""Token and page selection baselines: oracle top-k, Quest, oracle token top-p.

Every baseline here selects a set of tokens per query head and attends exactly over it,
renormalised: ``o = sum_{j in sel} e^{x_j} v_j / sum_{j in sel} e^{x_j}``. The selection
rules are written as boolean masks (B, Hq, N) so that the tests can check them exactly and
the public layer can count what was read. Everything is float64.

Tie rules (fixed, so that the reference and any kernel agree): equal scores go to the
lower position (token or page index); this is what a stable sort on the negated score
gives.
"""

from __future__ import annotations

import numpy as np

from .common import logits, masked_weights, propagate_nonfinite, valid_mask

__all__ = [
    "topk_mask",
    "top_p_mask",
    "quest_page_bounds",
    "quest_mask",
    "attend_subset",
    "selected_mass",
    "topk_attention",
    "quest_attention",
    "top_p_attention",
]


def _ranks(score: np.ndarray) -> np.ndarray:
    """Rank of each entry along the last axis by descending score, ties to lower index.

    A stable ascending sort of ``-score`` keeps equal scores in index order; -inf scores
    (masked positions) become +inf and sort last.
    """
    order = np.argsort(-score, axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(score.shape[-1])[None, None, :], axis=-1)
    return ranks


def topk_mask(x: np.ndarray, lens: np.ndarray, k_tokens: int) -> np.ndarray:
    """The ``k_tokens`` largest logits per row (ties to the lower position).

    Parameters
    ----------
    x : ndarray of float64, shape (B, H, N)
        Logits, -inf past ``lens[b]``.
    lens : ndarray of int64, shape (B,)
    k_tokens : int

    Returns
    -------
    ndarray of bool, shape (B, H, N)
        ``min(k_tokens, lens[b])`` tokens per row, all valid.
    """
    keep = np.minimum(lens, k_tokens)[:, None, None]
    return (_ranks(x) < keep) & valid_mask(lens, x.shape[-1])


def top_p_mask(w: np.ndarray, lens: np.ndarray, p: float) -> np.ndarray:
    """Shortest prefix of tokens by descending weight whose mass reaches ``p`` of the total.

    The arithmetic is fixed so that the property can be asserted exactly: with ``ws`` the
    weights sorted in descending order and ``c = np.cumsum(ws)``, the prefix length n is the
    smallest with ``c[n - 1] >= p * c[-1]``. ``p == 1`` keeps every valid token (also those
    whose weight underflowed to 0).

    Parameters
    ----------
    w : ndarray of float64, shape (B, H, N)
        Non-negative (unnormalised) weights, 0 past ``lens[b]``.
    lens : ndarray of int64, shape (B,)
    p : float
        In (0, 1].

    Returns
    -------
    ndarray of bool, shape (B, H, N)
    """
    ranks = _ranks(w)
    ws = -np.sort(-w, axis=-1)  # descending; ties are equal values, so order is immaterial
    c = np.cumsum(ws, axis=-1)  # running mass in that order
    target = p * c[..., -1:]
    # c is non-decreasing, so {i : c[i] < target} is a prefix; the next index reaches it.
    # Zero weights at the tail leave c unchanged, so they are never needed to reach it.
    count = np.sum(c < target, axis=-1) + 1
    if p == 1.0:
        count = np.full_like(count, w.shape[-1])
    count = np.minimum(count, lens[:, None])  # empty sequences select nothing
    return (ranks < count[..., None]) & valid_mask(lens, w.shape[-1])


def quest_page_bounds(q, k, lens: np.ndarray, page_size: int, scale: float) -> np.ndarray:
    """Quest's upper bound on the logits of each page, per query head.

    Page p holds tokens ``[p * page_size, min((p + 1) * page_size, lens[b]))``. With
    ``mn``/``mx`` the per-dimension min/max of its keys, the bound is
    ``scale * sum_d max(q_d * mn_d, q_d * mx_d)``, which is at least ``scale * q . k_j``
    for every key of the page (term by term).

    Returns
    -------
    ndarray of float64, shape (B, Hq, ceil(N / page_size))
        -inf for pages with no valid token.
    """
    B, Hq, D = q.shape
    _, Hkv, N, _ = k.shape
    G = Hq // Hkv
    P = int(page_size)
    n_pages = -(-N // P)
    kp = np.zeros((B, Hkv, n_pages * P, D))
    kp[:, :, :N] = np.asarray(k, dtype=np.float64)
    kp = kp.reshape(B, Hkv, n_pages, P, D)
    valid = (np.arange(n_pages * P)[None, :] < lens[:, None]).reshape(B, 1, n_pages, P, 1)
    mn = np.where(valid, kp, np.inf).min(axis=3)  # (B, Hkv, n_pages, D)
    mx = np.where(valid, kp, -np.inf).max(axis=3)
    page_valid = (np.arange(n_pages)[None, :] * P < lens[:, None])  # (B, n_pages)
    # Empty pages: put 0 in place of +-inf so that the products below stay finite; their
    # bound is set to -inf afterwards.
    mn = np.where(page_valid[:, None, :, None], mn, 0.0)
    mx = np.where(page_valid[:, None, :, None], mx, 0.0)
    qg = np.asarray(q, dtype=np.float64).reshape(B, Hkv, G, D)
    # max(q_d mn_d, q_d mx_d) = max(q_d, 0) mx_d + min(q_d, 0) mn_d since mn_d <= mx_d; the
    # zero term adds exactly 0, so each term equals the max of the two products exactly.
    bound = (np.einsum("bkgd,bkpd->bkgp", np.maximum(qg, 0.0), mx)
             + np.einsum("bkgd,bkpd->bkgp", np.minimum(qg, 0.0), mn))
    bound = bound.reshape(B, Hq, n_pages) * scale
    return np.where(page_valid[:, None, :], bound, -np.inf)


def quest_mask(bounds: np.ndarray, lens: np.ndarray, pages_kept: int, page_size: int,
               tokens: int) -> np.ndarray:
    """Tokens of the ``pages_kept`` pages with the largest bound (ties to the lower page).

    Returns
    -------
    ndarray of bool, shape (B, Hq, tokens)
    """
    pages_valid = -(-lens // page_size)  # ceil(lens / page_size) pages hold tokens
    keep = np.minimum(pages_valid, pages_kept)[:, None, None]
    page_sel = _ranks(bounds) < keep  # (B, Hq, n_pages)
    # n_pages * page_size >= tokens, so the repeated page mask covers every token.
    token_sel = np.repeat(page_sel, page_size, axis=-1)[..., :tokens]
    return token_sel & valid_mask(lens, tokens)


def attend_subset(x: np.ndarray, v, mask: np.ndarray) -> np.ndarray:
    """Softmax attention restricted to ``mask``, renormalised; zero rows where it is empty.

    x (B, Hq, N) logits, v (B, Hkv, N, D), mask (B, Hq, N) -> (B, Hq, D) float64.
    """
    B, Hq, N = x.shape
    Hkv, D = v.shape[1], v.shape[3]
    # Shift by the max over the selected tokens (not the global max, which may be left
    # out): the largest kept weight is 1, so nothing overflows and the sum is >= 1.
    w, _ = masked_weights(np.where(mask, x, -np.inf))
    z = w.sum(axis=-1, keepdims=True)
    a = np.divide(w, z, out=np.zeros_like(w), where=z > 0)
    ag = a.reshape(B, Hkv, Hq // Hkv, N)
    # Only the selected rows are read: a non-finite value row reaches the heads that select
    # it (NaN rows), and no other (0 * inf would be NaN).
    vv = np.asarray(v, dtype=np.float64)
    bad_v = ~np.isfinite(vv).all(axis=-1)  # (B, Hkv, N)
    out = np.einsum("bkgn,bknd->bkgd", ag, np.where(bad_v[..., None], 0.0, vv))
    read_bad = (mask.reshape(B, Hkv, Hq // Hkv, N) & bad_v[:, :, None, :]).any(axis=-1)
    out[read_bad] = np.nan
    return out.reshape(B, Hq, D)


def selected_mass(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Exact softmax mass (over the whole sequence) of the selected tokens, (B, Hq)."""
    w, _ = masked_weights(x)
    z = w.sum(axis=-1)
    sel = np.where(mask, w, 0.0).sum(axis=-1)
    return np.divide(sel, z, out=np.zeros_like(sel), where=z > 0)


def topk_attention(q, k, v, lens, scale, k_tokens):
    """Oracle top-k; returns ``(out, x, mask)`` with ``x`` the logits (B, Hq, N)."""
    x = logits(q, k, lens, scale)
    mask = topk_mask(x, lens, k_tokens)
    return propagate_nonfinite(attend_subset(x, v, mask), q, k, lens), x, mask


def quest_attention(q, k, v, lens, scale, budget, page_size):
    """Quest with ``ceil(budget / page_size)`` pages; returns ``(out, x, mask)``."""
    x = logits(q, k, lens, scale)
    bounds = quest_page_bounds(q, k, lens, page_size, scale)
    pages_kept = -(-int(budget) // int(page_size))
    mask = quest_mask(bounds, lens, pages_kept, page_size, k.shape[2])
    return propagate_nonfinite(attend_subset(x, v, mask), q, k, lens), x, mask


def top_p_attention(q, k, v, lens, scale, p):
    """Oracle token top-p; returns ``(out, x, mask)``."""
    x = logits(q, k, lens, scale)
    w, _ = masked_weights(x)
    mask = top_p_mask(w, lens, p)
    return propagate_nonfinite(attend_subset(x, v, mask), q, k, lens), x, mask
