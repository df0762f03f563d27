"""Exact decode attention, the ground truth of every test."""

from __future__ import annotations

import numpy as np

from .common import lengths, logits, masked_weights, nonfinite_rows, propagate_nonfinite

__all__ = ["exact_attention", "attention_weights", "log_sum_exp"]


def attention_weights(q, k, seq_lens, scale):
    """Softmax weights A (B, Hq, N) in float64; rows of empty sequences are all zero."""
    lens = lengths(seq_lens, q.shape[0], k.shape[2])
    w, _ = masked_weights(logits(q, k, lens, scale))
    z = w.sum(axis=-1, keepdims=True)
    return np.divide(w, z, out=np.zeros_like(w), where=z > 0)


def log_sum_exp(q, k, seq_lens, scale):
    """lse[b, h] = ln sum_j exp(x[b, h, j]) over the live tokens j < seq_lens[b] of the
    scaled logits x (B, Hq) in float64: -inf for an empty sequence, NaN for heads that read
    a non-finite query or key (``nonfinite_rows``, as the output rows).

    Log-sum-exp trick: with m the row max, ln sum exp(x) = m + ln sum exp(x - m), every
    exponent <= 0, so nothing overflows (``masked_weights`` gives m = 0 and no weight for an
    empty row: ln 0 = -inf)."""
    lens = lengths(seq_lens, q.shape[0], k.shape[2])
    w, m = masked_weights(logits(q, k, lens, scale))
    with np.errstate(divide="ignore", invalid="ignore"):  # ln 0 = -inf: an empty row
        lse = m[..., 0] + np.log(w.sum(axis=-1))
    return np.where(nonfinite_rows(q, k, lens), np.nan, lse)


def exact_attention(q, k, v, seq_lens, scale, return_lse=False):
    """o[b, h] = sum_j A[b, h, j] v[b, h // G, j] in float64; zeros for empty sequences;
    NaN rows for heads that read a non-finite query or key (``propagate_nonfinite``), and
    a non-finite visible value row reaches every head of its group (0 * NaN is NaN).
    ``return_lse``: also :func:`log_sum_exp` (B, Hq), returning ``(o, lse)``; ``(m=lse,
    l=1, acc=o)`` is then the exact partial of these tokens (l = 0 where lse = -inf), which
    ``context_parallel.merge_partials`` merges over disjoint token sets."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    A = attention_weights(q, k, seq_lens, scale)
    Ag = A.reshape(B, Hkv, Hq // Hkv, -1)
    vv = np.asarray(v, dtype=np.float64)
    lens = lengths(seq_lens, B, k.shape[2])
    vv = np.where(np.arange(k.shape[2])[None, None, :, None] < lens[:, None, None, None], vv, 0.0)
    out = propagate_nonfinite(np.einsum("bkgn,bknd->bkgd", Ag, vv).reshape(B, Hq, D), q, k, lens)
    return (out, log_sum_exp(q, k, seq_lens, scale)) if return_lse else out
