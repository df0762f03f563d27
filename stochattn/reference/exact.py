"""Exact decode attention, the ground truth of every test."""

from __future__ import annotations

import numpy as np

from .common import lengths, logits, masked_weights, propagate_nonfinite

__all__ = ["exact_attention", "attention_weights"]


def attention_weights(q, k, seq_lens, scale):
    """Softmax weights A (B, Hq, N) in float64; rows of empty sequences are all zero."""
    lens = lengths(seq_lens, q.shape[0], k.shape[2])
    w, _ = masked_weights(logits(q, k, lens, scale))
    z = w.sum(axis=-1, keepdims=True)
    return np.divide(w, z, out=np.zeros_like(w), where=z > 0)


def exact_attention(q, k, v, seq_lens, scale):
    """o[b, h] = sum_j A[b, h, j] v[b, h // G, j] in float64; zeros for empty sequences;
    NaN rows for heads that read a non-finite query or key (``propagate_nonfinite``), and
    a non-finite visible value row reaches every head of its group (0 * NaN is NaN)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    A = attention_weights(q, k, seq_lens, scale)
    Ag = A.reshape(B, Hkv, Hq // Hkv, -1)
    vv = np.asarray(v, dtype=np.float64)
    lens = lengths(seq_lens, B, k.shape[2])
    vv = np.where(np.arange(k.shape[2])[None, None, :, None] < lens[:, None, None, None], vv, 0.0)
    out = np.einsum("bkgn,bknd->bkgd", Ag, vv).reshape(B, Hq, D)
    return propagate_nonfinite(out, q, k, lens)
