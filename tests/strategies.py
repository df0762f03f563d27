"""Hypothesis strategies for decode-attention inputs with LLM-like (peaked) attention."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


@st.composite
def decode_inputs(draw, max_batch=2, max_kv_heads=2, max_group=4, min_tokens=1, max_tokens=200,
                  head_dims=(4, 8, 16), dtype=np.float64, with_seq_lens=True, min_len=1):
    """(q, k, v, seq_lens) with q (B, Hq, D), k/v (B, Hkv, N, D).

    Logit spread is drawn per call (temperature 0.5 to 4 logit standard deviations), and
    a few "sink" keys aligned with the queries are planted, so attention ranges from
    nearly flat to very peaked, as in real models.
    """
    B = draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, max_kv_heads))
    G = draw(st.integers(1, max_group))
    N = draw(st.integers(min_tokens, max_tokens))
    D = draw(st.sampled_from(head_dims))
    temp = draw(st.floats(0.5, 4.0))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, Hkv, N, D))
    q = rng.standard_normal((B, Hkv * G, D)) * temp
    sinks = min(N, draw(st.integers(0, 3)))
    if sinks:
        qmean = q.reshape(B, Hkv, G, D).mean(axis=2)
        k[:, :, :sinks, :] += 2.0 * qmean[:, :, None, :] / np.sqrt(D)
    v = rng.standard_normal((B, Hkv, N, D))
    seq_lens = None
    if with_seq_lens and draw(st.booleans()):
        seq_lens = np.array([draw(st.integers(min(min_len, N), N)) for _ in range(B)], dtype=np.int32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), seq_lens
