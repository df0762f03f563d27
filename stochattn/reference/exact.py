"""Exact decode attention, the ground truth of every test."""

from __future__ import annotations

import numpy as np

from .common import lengths, logits, masked_weights

__all__ = ["exact_attention", "attention_weights"]


def attention_weights(q, k, seq_lens, scale):
    """Softmax weights A (B, Hq, N) in float64; rows of empty sequences are all zero."""
    lens = lengths(seq_lens, q.shape[0], k.shape[2])
    w, _ = masked_weights(logits(q, k, lens, scale))
    z = w.sum(axis=-1, keepdims=True)
    return np.divide(w, z, out=np.zeros_like(w), where=z > 0)


def exact_attention(q, k, v, seq_lens, scale):
    """o[b, h] = sum_j A[b, h, j] v[b, h // G, j] in float64; zeros for empty sequences."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    A = attention_weights(q, k, seq_lens, scale)
    Ag = A.reshape(B, Hkv, Hq // Hkv, -1)
    return np.einsum("bkgn,bknd->bkgd", Ag, np.asarray(v, dtype=np.float64)).reshape(B, Hq, D)
