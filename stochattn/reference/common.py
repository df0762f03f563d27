"""Pieces every reference estimator shares: lengths, logits, masked softmax weights.

Everything here works in float64, the precision that decides correctness.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "lengths",
    "logits",
    "masked_weights",
    "kv_head_of",
    "union_rows_per_kv_head",
    "finish",
    "nonfinite_rows",
    "propagate_nonfinite",
]


def lengths(seq_lens, batch: int, tokens: int) -> np.ndarray:
    """``seq_lens`` as int64 (B,), or every sequence full when None."""
    if seq_lens is None:
        return np.full(batch, tokens, dtype=np.int64)
    return np.asarray(seq_lens).astype(np.int64)


def valid_mask(lens: np.ndarray, tokens: int) -> np.ndarray:
    """(B, 1, N) boolean: token j exists in sequence b."""
    return (np.arange(tokens)[None, :] < lens[:, None])[:, None, :]


def logits(q, k, lens, scale: float) -> np.ndarray:
    """x[b, h, j] = scale * q[b, h] . k[b, h // G, j] in float64; -inf past seq_lens[b].

    GQA is handled by viewing q as (B, Hkv, G, D) so each KV head is read once.
    """
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = np.asarray(q, dtype=np.float64).reshape(B, Hkv, G, D)
    x = np.einsum("bkgd,bknd->bkgn", qg, np.asarray(k, dtype=np.float64)).reshape(B, Hq, N)
    x *= scale
    return np.where(valid_mask(lens, N), x, -np.inf)


def masked_weights(x: np.ndarray):
    """Max-shifted exponentials of logits along the last axis.

    Returns ``(w, m)`` with ``w = exp(x - m)`` and ``m`` the row max (kept dims). Rows that
    are all -inf (empty sequences) get ``m = 0`` and ``w = 0`` instead of NaN; the shift by
    the max is what keeps |x| ~ 1e4 from overflowing.
    """
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(x - m)  # exp(-inf) = 0 for masked tokens
    return w, m


def nonfinite_rows(q, k, lens: np.ndarray) -> np.ndarray:
    """(B, Hq) bool: query row ``q[b, h]`` or a key its head reads (``k[b, h // G, :len_b]``)
    holds a NaN or an infinity. Past ``seq_lens`` nothing is read, so nothing counts."""
    B, Hq, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    bad_q = ~np.isfinite(np.asarray(q)).all(axis=-1)
    bad_k = ~np.isfinite(np.asarray(k)).all(axis=-1) & valid_mask(lens, N)  # (B, Hkv, N)
    return bad_q | np.repeat(bad_k.any(axis=-1), Hq // Hkv, axis=1)


def propagate_nonfinite(out: np.ndarray, q, k, lens: np.ndarray) -> np.ndarray:
    """``out`` (B, Hq, D) with NaN rows where :func:`nonfinite_rows` holds: non-finite
    queries or keys propagate to the heads that read them, as torch SDPA's do, never a
    zero row or a finite wrong answer (docs/conventions.md, non-finite input). Values
    propagate by themselves where they are read."""
    rows = nonfinite_rows(q, k, lens)
    if rows.any():
        out = np.array(out, copy=True)
        out[rows] = np.nan
    return out


def kv_head_of(q_heads: int, kv_heads: int) -> np.ndarray:
    """KV head read by each query head: h // G."""
    return np.arange(q_heads) // (q_heads // kv_heads)


def union_rows_per_kv_head(read: np.ndarray, kv_heads: int) -> np.ndarray:
    """Count rows read by any query head of a group: read (B, Hq, N) bool -> (B, Hkv)."""
    B, Hq, N = read.shape
    return read.reshape(B, kv_heads, Hq // kv_heads, N).any(axis=2).sum(axis=-1).astype(np.int64)


def finish(out: np.ndarray, dtype) -> np.ndarray:
    """Cast a float64 result to the caller's dtype."""
    return out.astype(dtype, copy=False)
