"""Shared helpers of the GPU tests: inputs with LLM-like attention, device transfer in
float16 (CuPy) or bfloat16 (PyTorch, since CuPy may lack the dtype), and the
flash-attention tolerance rule."""

from __future__ import annotations

import numpy as np
import pytest


def peaked_inputs(B, Hkv, G, N, D, *, seed, temp=2.0, sinks=2):
    """float64 q (B, Hq, D), k, v (B, Hkv, N, D): Gaussian keys plus a few sink keys aligned
    with the group's mean query, so attention is peaked on a few tokens and spread over the
    rest (as in real models)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, Hkv, N, D))
    q = rng.standard_normal((B, Hkv * G, D)) * temp
    s = min(N, sinks)
    if s:
        qmean = q.reshape(B, Hkv, G, D).mean(axis=2)
        k[:, :, :s, :] += 2.0 * qmean[:, :, None, :] / np.sqrt(D)
    v = rng.standard_normal((B, Hkv, N, D))
    return q, k, v


def to_device(x, dtype):
    """NumPy float64 -> GPU array of ``dtype`` ("float16": CuPy; "bfloat16": torch)."""
    if dtype == "float16":
        import cupy

        return cupy.asarray(np.asarray(x, dtype=np.float16))
    torch = pytest.importorskip("torch")
    return torch.tensor(np.asarray(x, dtype=np.float32), device="cuda").to(torch.bfloat16)


def to_host64(x):
    """GPU array (CuPy or torch) -> NumPy float64 (exact: fp16/bf16 widen exactly)."""
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().float().cpu().numpy().astype(np.float64)
    import cupy

    return cupy.asnumpy(x).astype(np.float64)


def to_host(x):
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy()
    import cupy

    return cupy.asnumpy(x)


def naive_attention(q, k, v, lens, scale, dtype):
    """Naive attention with every intermediate rounded to ``dtype`` (torch on the GPU):
    the yardstick of the flash-attention tolerance rule. Zero rows for empty sequences."""
    torch = pytest.importorskip("torch")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qt = torch.tensor(q, device="cuda").to(tdt).view(B, Hkv, G, D)
    kt = torch.tensor(k, device="cuda").to(tdt)
    vt = torch.tensor(v, device="cuda").to(tdt)
    x = torch.matmul(qt, kt.transpose(-1, -2)) * torch.tensor(scale, dtype=tdt, device="cuda")
    mask = torch.arange(N, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None]
    x = x.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(x, dim=-1).to(tdt)
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.matmul(p, vt).reshape(B, Hq, D)
    return o.float().cpu().numpy().astype(np.float64)
