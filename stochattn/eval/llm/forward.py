"""A plain Llama forward pass (prefill) in any NumPy-like array namespace.

Every function takes ``xp`` (``numpy`` by default, ``cupy`` on the GPU, with the weights
moved there by ``weights.to(cupy)``) and only uses what both provide: ``matmul``, ``exp``,
``log``, ``sqrt``, ``max``, ``sum``, ``take_along_axis``, slicing. Activations are float32
in both (CuPy's float32 matmuls are plain fp32, no TF32 unless ``CUPY_TF32=1``); softmax and
log-softmax are max-shifted. ``tests/gpu/test_llm_harness_gpu.py`` checks that the CuPy
losses equal the NumPy ones.

Shapes: T tokens; x (T, hidden); q (T, Hq, D); k, v (T, Hkv, D); one sequence, no batch.
The per-layer cache of the exact pass, ``ForwardResult.k[l]`` / ``.v[l]`` (T, Hkv, D),
holds the keys after RoPE, as a KV cache does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ForwardResult", "PAIRINGS", "apply_rope", "causal_attention", "final_logits",
           "forward", "mlp", "qkv", "rms_norm", "rope_tables", "token_losses"]

PAIRINGS = ("interleaved", "half")


def rms_norm(x, w, eps, xp=np):
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis."""
    ms = xp.mean(x * x, axis=-1, keepdims=True)
    return (x / xp.sqrt(ms + eps)) * w


def rope_tables(positions, head_dim, theta, xp=np):
    """cos and sin of angle ``pos * theta**(-2i/D)``, shape (len(positions), D/2), float32.

    The angles are formed in float64 (pos * freq reaches ~8e3 rad at 8k context, where
    float32 would keep only ~3 decimal digits of the phase).
    """
    pos = xp.asarray(positions, dtype=xp.float64)
    freq = theta ** (-xp.arange(0, head_dim, 2, dtype=xp.float64) / head_dim)
    ang = pos[:, None] * freq[None, :]
    return xp.cos(ang).astype(xp.float32), xp.sin(ang).astype(xp.float32)


def apply_rope(x, cos, sin, pairing="interleaved", xp=np):
    """Rotate x (n, H, D) by the position angles cos/sin (n, D/2).

    ``"interleaved"`` rotates pairs (x[2i], x[2i+1]) (llama.cpp's layout, right for GGUF
    weights); ``"half"`` rotates (x[i], x[i + D/2]) (Hugging Face's ``rotate_half``).
    """
    c, s = cos[:, None, :], sin[:, None, :]
    if pairing == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        out = xp.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out
    if pairing == "half":
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        return xp.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    raise ValueError(f"`pairing`: expected one of {PAIRINGS}, got {pairing!r}")


def qkv(layer, x, cos, sin, config, pairing="interleaved", xp=np):
    """Queries (n, Hq, D), keys and values (n, Hkv, D) of rows x (n, hidden), after RoPE."""
    n, D = x.shape[0], config.head_dim
    h = rms_norm(x, layer["attn_norm"], config.rms_eps, xp)
    q = (h @ layer["attn_q"].T).reshape(n, config.q_heads, D)
    k = (h @ layer["attn_k"].T).reshape(n, config.kv_heads, D)
    v = (h @ layer["attn_v"].T).reshape(n, config.kv_heads, D)
    return apply_rope(q, cos, sin, pairing, xp), apply_rope(k, cos, sin, pairing, xp), v


def mlp(layer, x, config, xp=np):
    """SwiGLU feed-forward ``down(silu(gate(h)) * up(h))``, h the ffn norm of x (n, hidden)."""
    h = rms_norm(x, layer["ffn_norm"], config.rms_eps, xp)
    g = h @ layer["ffn_gate"].T
    u = h @ layer["ffn_up"].T
    # silu(g) = g * sigmoid(g) = g / (1 + exp(-g)); exp(-g) may overflow to inf for
    # g < -88 in float32, which gives the right limit 0.
    with np.errstate(over="ignore"):
        act = g / (1 + xp.exp(-g))
    return (act * u) @ layer["ffn_down"].T


def causal_attention(q, k, v, *, block=256, xp=np):
    """Exact causal softmax attention of a whole sequence.

    q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D); query t sees keys 0..t; query head h reads
    KV head h // (Hq / Hkv). Queries are processed in blocks of ``block`` rows, so memory is
    O(block * T) instead of O(T^2); each block's logits are max-shifted before ``exp``.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = 1.0 / float(np.sqrt(D))
    kt = xp.transpose(k, (1, 2, 0))           # (Hkv, D, T)
    vt = xp.transpose(v, (1, 0, 2))           # (Hkv, T, D)
    out = xp.empty_like(q)
    for s in range(0, T, block):
        e = min(T, s + block)
        # (Hkv, G, n, D) queries of this block, grouped by their KV head.
        qb = xp.transpose(q[s:e].reshape(e - s, Hkv, G, D), (1, 2, 0, 3))
        logits = (qb @ kt[:, None, :, :e]) * scale          # (Hkv, G, n, e)
        # Causal mask: query s+i sees keys 0..s+i.
        mask = xp.arange(e)[None, :] > xp.arange(s, e)[:, None]
        logits = xp.where(mask, -xp.inf, logits)
        logits = logits - xp.max(logits, axis=-1, keepdims=True)  # max shift: exp <= 1
        w = xp.exp(logits)
        w = w / xp.sum(w, axis=-1, keepdims=True)
        o = w @ vt[:, None, :e, :]                           # (Hkv, G, n, D)
        out[s:e] = xp.transpose(o, (2, 0, 1, 3)).reshape(e - s, Hq, D)
    return out


def final_logits(weights, x, xp=np):
    """Logits (n, vocab) of final residual rows x (n, hidden): output norm, output matrix."""
    h = rms_norm(x, weights.output_norm, weights.config.rms_eps, xp)
    return h @ weights.lm_head.T


def token_losses(weights, x, targets, *, block=256, xp=np):
    """Next-token losses ``-log softmax(logits)[target]`` (n,) float64 of residual rows x.

    Blocks of ``block`` rows bound the memory of the (n, vocab) logits; the log-softmax is
    max-shifted and summed in float64.
    """
    targets = xp.asarray(targets)
    out = []
    for s in range(0, x.shape[0], block):
        z = final_logits(weights, x[s:s + block], xp).astype(xp.float64)
        z = z - xp.max(z, axis=-1, keepdims=True)
        lse = xp.log(xp.sum(xp.exp(z), axis=-1))
        zt = xp.take_along_axis(z, targets[s:s + block, None], axis=-1)[:, 0]
        out.append(lse - zt)
    return xp.concatenate(out) if out else xp.zeros(0, dtype=xp.float64)


@dataclass
class ForwardResult:
    """What :func:`forward` returns.

    Attributes
    ----------
    hidden : (T, hidden) float32, the final residual stream (before the output norm).
    k, v : per layer (T, Hkv, D) float32 keys (after RoPE) and values; empty unless
        ``keep_kv``.
    q : per layer (len(capture_q), Hq, D) queries (after RoPE) at the ``capture_q``
        positions; empty unless asked for.
    """

    hidden: object
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    q: list = field(default_factory=list)


def forward(weights, tokens, *, pairing="interleaved", keep_kv=False, capture_q=None,
            block=256, xp=np):
    """Exact prefill of one token sequence.

    Parameters
    ----------
    weights : LlamaWeights
        From :func:`stochattn.eval.llm.model.load_model` (converted with ``weights.to(xp)`` for
        another namespace).
    tokens : int array (T,)
        Token ids; T at most the model's context length.
    pairing : {"interleaved", "half"}
        RoPE pairing (see :func:`apply_rope`); the GGUF weights want ``"interleaved"``.
    keep_kv : bool
        Keep every layer's keys and values (what the teacher-forced evaluation reuses).
    capture_q : int array, optional
        Positions whose per-layer queries to keep (attention statistics).
    block : int
        Query rows per block of the causal attention.
    xp : module
        Array namespace (``numpy`` or ``cupy``).

    Returns
    -------
    ForwardResult
    """
    cfg = weights.config
    tokens = xp.asarray(tokens)
    T = int(tokens.shape[0])
    if T > cfg.context_length:
        raise ValueError(f"`tokens`: expected at most {cfg.context_length} tokens, got {T}")
    cos, sin = rope_tables(np.arange(T), cfg.head_dim, cfg.rope_theta, xp)
    x = xp.take(weights.token_embd, tokens, axis=0)
    res = ForwardResult(hidden=None)
    for layer in weights.layers:
        q, k, v = qkv(layer, x, cos, sin, cfg, pairing, xp)
        if keep_kv:
            res.k.append(k)
            res.v.append(v)
        if capture_q is not None:
            res.q.append(q[xp.asarray(capture_q)])
        o = causal_attention(q, k, v, block=block, xp=xp)
        x = x + o.reshape(T, -1) @ layer["attn_output"].T
        x = x + mlp(layer, x, cfg, xp)
    res.hidden = x
    return res
