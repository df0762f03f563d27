"""A Llama decode loop in PyTorch over a static or a paged KV cache, whose whole step can be
captured in one CUDA graph.

The worked example of docs/serving.md ("Calling stochattn from a graph-captured decode
step", issue 30 item 5): SmolLM2-135M (weights from :func:`~stochattn.eval.llm.model.load_model`)
or a model of any Llama shape with random weights (:meth:`DecodeConfig.llama31_8b`), a KV
cache of fixed size, and one decode step that does everything on the device:

    embed -> [paged: page table of the new lengths] -> per layer [RMSNorm, fused QKV,
    interleaved RoPE from the device positions, write k/v at the position (static: a
    scatter into the cache row; paged: into its page slot), (Double-P: append to the
    layer's index), attention through the backend, o-proj, RMSNorm, SwiGLU] -> final norm
    -> logits -> greedy argmax written into static tensors -> position += 1

with no host synchronisation and no allocation outside torch's caching allocator (so
``torch.cuda.graph`` puts it in the graph's pool). Batches of B > 1 sequences of one length
(the same or different prompts) run the same step.

Caches (``DecodeSession(cache=...)``, :data:`CACHES`):

- ``"static"``: ``(layers, B, Hkv, max_tokens, D)`` for K and for V; the step scatters the
  new row at the position.
- ``"paged"``: one page pool for every layer, ``(layers, num_pages, 2, page_size, Hkv, D)``
  (``"NHD"``) or ``(layers, num_pages, 2, Hkv, page_size, D)`` (``"HND"``): layer ``l``'s
  ``pool[l]`` is a combined K/V cache in FlashInfer's layout (``[:, 0]`` K, ``[:, 1]`` V).
  Every sequence owns ``ceil(max_tokens / page_size)`` pages, allocated up front in a
  random physical order (:func:`page_table`: ``(B, pages)`` int64 on the device, a copy on
  the host); all layers share one page table. The CSR arrays the kernels read
  (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, int32, fixed addresses) are
  rewritten on the device from the lengths at the start of every step
  (:func:`csr_from_lengths`), and the new token's K/V go to page
  ``table[b, pos // page_size]``, slot ``pos % page_size`` (:func:`token_slots`) by one
  ``index_put_`` per layer. Each layer's cache is a :class:`stochattn.paged.PagedKV` over
  ``pool[l]`` and those CSR arrays, made once, with ``max_tokens`` the session's (so its
  kernels plan the launches of a static cache of the same size); every backend reads the
  pages in place.

Attention backends (:data:`BACKENDS`):

- ``"sdpa"`` (static cache only): torch SDPA over the whole static cache with an additive
  mask built on the device from ``seq_lens`` (graph-safe; it reads all ``max_tokens`` rows,
  valid or not); queries grouped as (B, Hkv, G, D) so GQA needs no copy of K/V.
- ``"exact"``: :class:`stochattn.ExactPlan`.
- ``"santa-prop"``, ``"santa-flash"``: :class:`stochattn.SantaPlan` with
  ``advance_offset=True`` and one device offset shared by all layers, so each layer's call
  draws its own numbers (offset o + layer at step 0) and every graph replay draws fresh ones.
- ``"doublep"``: :class:`stochattn.DoublePPlan` (``approx="centroid"`` by default), one GPU
  index per layer built once after the prefill; the step appends the new token to every
  layer's index inside the graph (:meth:`DoublePIndex.append` launches two kernels and
  never synchronises; on a paged cache it reads the new lengths from the page table).
- ``"flashinfer"`` (paged cache only): FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``
  (``use_tensor_cores=True``) on the same pool, as the exact baseline of the paged loop.
  FlashInfer's ``plan`` reads the lengths on the host and splits the KV axis by them (its
  docs: a plan for other lengths is not CUDA-graph safe), so one plan cannot serve a
  growing sequence. The backend uses the wrapper's CUDA-graph mode instead (fixed page
  table buffers and a fixed grid; ``split_kv`` forced on), and plans once per step on the
  host *before* the step or the graph replay, for the lengths that step will have (known
  on the host: prefill + step + 1), as engines do. One plan serves all layers. See
  :class:`_FlashInfer`.

Double-P and graph replays: before 2026-12-06 ``DoublePIndex.append`` on the GPU wrote the
new lengths and window starts into a *fresh* buffer and rebound the index to it, which a
graph would have frozen. The loop keeps each index's lengths and window starts in a
buffer of its own (``_PersistentIndex``) and copies the append's result back into it
inside the step; the in-place append of today makes this redundant but harmless. See
docs/serving.md.

RoPE: the pairing of the GGUF weights is interleaved (see :mod:`stochattn.eval.llm.model`);
random weights do not care. Angles are formed in float64 on the device from the position
tensor, as :func:`stochattn.eval.llm.forward.rope_tables` does on the host.

Numerics: weights, q/k/v, the cache and every matmul in ``dtype`` (float16 by default);
the residual stream, RMSNorm and RoPE in float32; logits in float32 from a ``dtype``
matmul. A static and a paged session of one model, prompt and ``max_tokens`` compute the
same step bit for bit up to attention, and our kernels read the same rows in the same
order from either cache.

torch is imported inside the functions: the module imports without it (the config,
cache-size and page-table arithmetic are used on CPU-only machines; :func:`csr_from_lengths`
and :func:`token_slots` take NumPy arrays or torch tensors alike).
"""

from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["BACKENDS", "CACHES", "DecodeConfig", "DecodeModel", "DecodeSession",
           "GenerateResult", "agreement", "csr_from_lengths", "generate", "kv_cache_bytes",
           "page_table", "pages_per_sequence", "token_slots"]

BACKENDS = ("sdpa", "exact", "santa-prop", "santa-flash", "doublep", "flashinfer")
CACHES = ("static", "paged")
STATIC_ONLY = ("sdpa",)       # backends that read a static cache only
PAGED_ONLY = ("flashinfer",)  # backends that read a paged cache only


# ---- configuration (torch-free) ----------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """The shape of a Llama model (what the decode loop needs of it)."""

    n_layers: int
    hidden: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tied: bool = True
    pairing: str = "interleaved"

    def __post_init__(self):
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if self.pairing not in ("interleaved", "half"):
            raise ValueError(f"pairing must be 'interleaved' or 'half', got {self.pairing!r}")

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @classmethod
    def from_llama(cls, cfg, tied: bool = True) -> "DecodeConfig":
        """From a :class:`stochattn.eval.llm.model.LlamaConfig` (the GGUF metadata)."""
        return cls(n_layers=cfg.n_layers, hidden=cfg.hidden, ffn=cfg.ffn, q_heads=cfg.q_heads,
                   kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                   rope_theta=float(cfg.rope_theta), rms_eps=float(cfg.rms_eps), tied=tied)

    @classmethod
    def llama31_8b(cls, **overrides) -> "DecodeConfig":
        """Llama-3.1-8B's shape: 32 layers, hidden 4096, Hq 32, Hkv 8, D 128, ffn 14336,
        vocab 128256, rope theta 500000 (no rope scaling: random weights), untied head."""
        base = cls(n_layers=32, hidden=4096, ffn=14336, q_heads=32, kv_heads=8, head_dim=128,
                   vocab_size=128256, rope_theta=500000.0, rms_eps=1e-5, tied=False)
        return replace(base, **overrides)

    def param_count(self) -> int:
        """Parameters (embedding, output head unless tied, layers, norms)."""
        H, D = self.hidden, self.head_dim
        attn = H * (self.q_heads * D) * 2 + H * (self.kv_heads * D) * 2
        mlp = 3 * H * self.ffn
        per_layer = attn + mlp + 2 * H
        emb = self.vocab_size * H
        return emb * (1 if self.tied else 2) + self.n_layers * per_layer + H

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        return self.param_count() * dtype_bytes

    def kv_cache_bytes(self, tokens: int, batch: int = 1, dtype_bytes: int = 2) -> int:
        """K and V of every layer: ``2 * layers * batch * Hkv * tokens * D * dtype_bytes``."""
        return kv_cache_bytes(self.n_layers, self.kv_heads, self.head_dim, tokens, batch,
                              dtype_bytes)

    def fits(self, tokens: int, batch: int, memory_bytes: int, dtype_bytes: int = 2,
             headroom: float = 0.1) -> bool:
        """Whether weights plus the cache fit ``memory_bytes`` with ``headroom`` (a fraction
        of it) left for activations, workspaces and the allocator."""
        need = self.weight_bytes(dtype_bytes) + self.kv_cache_bytes(tokens, batch, dtype_bytes)
        return need <= (1.0 - headroom) * memory_bytes


def kv_cache_bytes(n_layers: int, kv_heads: int, head_dim: int, tokens: int, batch: int = 1,
                   dtype_bytes: int = 2) -> int:
    """Bytes of a K and V cache: ``2 * layers * batch * Hkv * tokens * D * dtype_bytes``."""
    return 2 * n_layers * batch * kv_heads * tokens * head_dim * dtype_bytes


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def agreement(tokens, reference) -> dict:
    """Fraction of identical tokens and the first divergence (None: none), per the
    flattened step order of two (steps, B) token arrays of one length."""
    a, b = np.asarray(tokens), np.asarray(reference)
    if a.shape != b.shape:
        raise ValueError(f"token arrays differ in shape: {a.shape} and {b.shape}")
    same = a == b
    first = None
    if not same.all():
        first = int(np.argmax(~same.all(axis=tuple(range(1, a.ndim))) if a.ndim > 1 else ~same))
    return dict(identical_fraction=float(same.mean()) if same.size else 1.0,
                first_divergence=first)


# ---- paged cache arithmetic (NumPy or torch, no framework calls) ------------------------------


def pages_per_sequence(max_tokens: int, page_size: int) -> int:
    """Pages each sequence owns for ``max_tokens`` tokens: ``ceil(max_tokens / page_size)``."""
    if page_size < 1 or max_tokens < 1:
        raise ValueError(f"page_size and max_tokens must be >= 1, got {page_size}, {max_tokens}")
    return -(-int(max_tokens) // int(page_size))


def page_table(batch: int, max_tokens: int, page_size: int, *, shuffle_seed=0,
               extra_pages: int = 0):
    """The whole generation's page assignment, made up front: ``(table, num_pages)``.

    ``table`` (B, P_seq) int64, ``P_seq = pages_per_sequence(max_tokens, page_size)``:
    logical page i of sequence b lives in physical page ``table[b, i]``. The pool has
    ``num_pages = B * P_seq + extra_pages`` pages; the physical order is a random
    permutation of them (``shuffle_seed``; None: in order), so every sequence's pages are
    scattered over the pool and unused pages sit between them.
    """
    pps = pages_per_sequence(max_tokens, page_size)
    if batch < 1 or extra_pages < 0:
        raise ValueError(f"batch must be >= 1 and extra_pages >= 0, got {batch}, {extra_pages}")
    num = batch * pps + int(extra_pages)
    order = (np.arange(num) if shuffle_seed is None
             else np.random.default_rng(shuffle_seed).permutation(num))
    return order[:batch * pps].reshape(batch, pps).astype(np.int64), num


def csr_from_lengths(seq_lens, table, page_size: int, flat_positions):
    """FlashInfer's page-table CSR for sequences of lengths ``seq_lens`` over ``table``.

    Pure array arithmetic (operators, ``cumsum``, ``sum``, ``clip``, indexing), so it runs
    on NumPy arrays on the host and on torch tensors on the device, where every shape is
    fixed and nothing is read back: a CUDA graph captures it.

    Parameters
    ----------
    seq_lens : int64 array (B,)
        Lengths, each in [0, table.shape[1] * page_size].
    table : int64 array (B, P_seq)
        Physical page of each logical page (:func:`page_table`).
    page_size : int
    flat_positions : int64 array (B * P_seq,)
        ``arange(B * P_seq)`` (made once by the caller, in its framework).

    Returns
    -------
    ends : int64 (B,)
        ``kv_indptr[1:]`` (``kv_indptr[0]`` is 0): the cumulative page counts, sequence b
        using ``n_b = ceil(seq_lens[b] / page_size)`` pages.
    indices : int64 (B * P_seq,)
        ``kv_indices``: entry j < ends[-1] is the physical page of logical page
        ``j - kv_indptr[b]`` of the sequence b with ``kv_indptr[b] <= j < kv_indptr[b+1]``;
        entries past ``ends[-1]`` repeat pages of the last sequence and are never read.
    last : int64 (B,)
        ``kv_last_page_len``: ``seq_lens - (n_b - 1) * page_size`` in [1, page_size] for a
        sequence with pages, 0 for an empty one.
    """
    B, pps = table.shape[0], table.shape[1]
    n = (seq_lens + (page_size - 1)) // page_size
    ends = n.cumsum(0)
    last = seq_lens - (n - 1) * page_size - (n == 0) * page_size
    # The sequence of flat entry j: how many sequences end at or before j.
    b = (flat_positions[:, None] >= ends[None, :]).sum(1).clip(0, B - 1)
    start = ends - n
    i = (flat_positions - start[b]).clip(0, pps - 1)
    indices = table.reshape(-1)[b * pps + i]
    return ends, indices, last


def token_slots(pos, table, page_size: int, seq_ids):
    """``(page, slot)`` of the tokens at positions ``pos`` (B,) or (B, T): physical page
    ``table[b, pos // page_size]`` and slot ``pos % page_size``. ``seq_ids`` is
    ``arange(B)`` in the framework of ``table`` (NumPy or torch; no framework calls)."""
    rows = seq_ids if pos.ndim == 1 else seq_ids.reshape(-1, *([1] * (pos.ndim - 1)))
    return table[rows, pos // page_size], pos % page_size


# ---- the model ---------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def _dtype(name):
    torch = _torch()
    if not isinstance(name, str):
        return name
    return {"float16": torch.float16, "bfloat16": torch.bfloat16,
            "float32": torch.float32}[name]


class DecodeModel:
    """Weights of a Llama model as torch tensors on one device, with fused QKV and gate/up.

    Build with :meth:`from_weights` (a :class:`~stochattn.eval.llm.model.LlamaWeights`) or
    :meth:`random` (a :class:`DecodeConfig`).
    """

    def __init__(self, config: DecodeConfig, embed, layers, output_norm, lm_head, dtype, device):
        self.config = config
        self.embed = embed            # (V, H) dtype
        self.layers = layers          # dicts: attn_norm, ffn_norm (H,) fp32; wqkv, wo, wgu, wd
        self.output_norm = output_norm
        self.lm_head = lm_head        # (V, H) dtype (the embedding itself when tied)
        self.dtype = dtype
        self.device = device

    @classmethod
    def from_weights(cls, weights, dtype="float16", device="cuda") -> "DecodeModel":
        torch = _torch()
        dt = _dtype(dtype)
        cfg = DecodeConfig.from_llama(weights.config, tied=weights.output is None)

        def t(a, d=dt):
            return torch.tensor(np.asarray(a)).to(device=device, dtype=d)

        layers = []
        for L in weights.layers:
            layers.append(dict(
                attn_norm=t(L["attn_norm"], torch.float32),
                ffn_norm=t(L["ffn_norm"], torch.float32),
                wqkv=t(np.concatenate([L["attn_q"], L["attn_k"], L["attn_v"]], axis=0)),
                wo=t(L["attn_output"]),
                wgu=t(np.concatenate([L["ffn_gate"], L["ffn_up"]], axis=0)),
                wd=t(L["ffn_down"])))
        embed = t(weights.token_embd)
        head = embed if weights.output is None else t(weights.output)
        return cls(cfg, embed, layers, t(weights.output_norm, torch.float32), head, dt, device)

    @classmethod
    def random(cls, config: DecodeConfig, dtype="float16", device="cuda",
               seed: int = 0) -> "DecodeModel":
        """Gaussian weights: linear layers with std 1/sqrt(fan_in), embedding std 1, norms 1
        (activations stay O(1) through the layers; the tokens mean nothing)."""
        torch = _torch()
        dt = _dtype(dtype)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        H, D, F = config.hidden, config.head_dim, config.ffn

        def lin(rows, cols):
            w = torch.empty((rows, cols), dtype=dt, device=device)
            w.normal_(0.0, 1.0 / math.sqrt(cols), generator=gen)
            return w

        layers = []
        for _ in range(config.n_layers):
            layers.append(dict(
                attn_norm=torch.ones(H, dtype=torch.float32, device=device),
                ffn_norm=torch.ones(H, dtype=torch.float32, device=device),
                wqkv=lin((config.q_heads + 2 * config.kv_heads) * D, H),
                wo=lin(H, config.q_heads * D), wgu=lin(2 * F, H), wd=lin(H, F)))
        embed = torch.empty((config.vocab_size, H), dtype=dt, device=device)
        embed.normal_(0.0, 1.0, generator=gen)
        head = embed if config.tied else lin(config.vocab_size, H)
        return cls(config, embed, layers, torch.ones(H, dtype=torch.float32, device=device),
                   head, dt, device)

    # -- pieces of the forward pass ------------------------------------------------------------

    def rms_norm(self, x, w):
        """float32 x (..., H) -> normalised, times w, in the model dtype."""
        torch = _torch()
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
                * w).to(self.dtype)

    def rope_cos_sin(self, positions):
        """cos, sin (..., D/2) float32 of integer positions (any shape), angles in float64."""
        torch = _torch()
        inv = getattr(self, "_inv_freq", None)
        if inv is None or inv.device != positions.device:  # made once, outside any capture
            D = self.config.head_dim
            inv = self.config.rope_theta ** (
                -torch.arange(0, D, 2, dtype=torch.float64, device=positions.device) / D)
            self._inv_freq = inv
        ang = positions.to(torch.float64)[..., None] * inv
        return torch.cos(ang).float(), torch.sin(ang).float()

    def apply_rope(self, x, cos, sin):
        """Rotate x (..., heads, D) by cos/sin (..., D/2) (broadcast over heads); float32."""
        torch = _torch()
        x = x.float()
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if self.config.pairing == "interleaved":
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)

    def qkv(self, layer, x, cos, sin):
        """x (..., H) float32 -> q (..., Hq, D), k, v (..., Hkv, D) in the model dtype, RoPE'd."""
        cfg = self.config
        D = cfg.head_dim
        h = self.rms_norm(x, layer["attn_norm"])
        y = h @ layer["wqkv"].T
        nq, nk = cfg.q_heads * D, cfg.kv_heads * D
        lead = y.shape[:-1]
        q = y[..., :nq].reshape(*lead, cfg.q_heads, D)
        k = y[..., nq:nq + nk].reshape(*lead, cfg.kv_heads, D)
        v = y[..., nq + nk:].reshape(*lead, cfg.kv_heads, D)
        q = self.apply_rope(q, cos, sin).to(self.dtype)
        k = self.apply_rope(k, cos, sin).to(self.dtype)
        return q, k, v

    def mlp(self, layer, x):
        """SwiGLU of the ffn norm of x (..., H) float32; returns float32 (..., H)."""
        torch = _torch()
        h = self.rms_norm(x, layer["ffn_norm"])
        gu = h @ layer["wgu"].T
        F = self.config.ffn
        a = torch.nn.functional.silu(gu[..., :F]) * gu[..., F:]
        return (a @ layer["wd"].T).float()

    def logits(self, x):
        """float32 logits (..., V) of final residual rows x (..., H)."""
        return (self.rms_norm(x, self.output_norm) @ self.lm_head.T).float()


# ---- attention backends --------------------------------------------------------------------------


class _Backend:
    """An attention function of the step: ``__call__(layer, q, kc, vc, seq_lens)`` -> (B, Hq, D),
    where ``(kc, vc, seq_lens)`` is :meth:`DecodeSession.attn_inputs` of the layer: the
    layer's static K/V caches and the device lengths, or its paged cache (a
    :class:`~stochattn.paged.PagedKV`; on a CPU session a namespace of its fields) with
    ``vc`` and ``seq_lens`` None.

    ``bind(session)`` makes plans and state once (outside any capture); ``host_step(session,
    i)`` runs on the host before step i (0-based from the post-prefill state) and before the
    graph replay of step i, outside any capture (FlashInfer's plan); ``prepare(session)``
    runs once per step, on the device, before the layers; ``after_write(layer, kc, vc,
    seq_lens)`` runs after the step wrote the new k/v row of that layer;
    ``snapshot()``/``restore()`` save and reset whatever state the backend mutates
    (Double-P's index). ``caches``: the caches it reads; ``graph_safe``: whether its step
    can be captured (False: eager only, with ``graph_unsafe_reason``).
    """

    name = "?"
    stochastic = False
    caches = CACHES
    graph_safe = True
    graph_unsafe_reason = None

    def options(self) -> dict:
        return {}

    def bind(self, session) -> None:
        self.session = session

    def host_step(self, session, i: int) -> None:
        pass

    def prepare(self, session) -> None:
        pass

    def after_write(self, layer, kc, vc, seq_lens) -> None:
        pass

    def snapshot(self) -> None:
        pass

    def restore(self) -> None:
        pass


class _SDPA(_Backend):
    name = "sdpa"
    caches = ("static",)

    def bind(self, session):
        torch = _torch()
        self.session = session
        n = session.max_tokens
        self.arange = torch.arange(n, device=session.device, dtype=torch.int32)
        # The additive mask, rewritten in place each step: (B, 1, 1, Nmax) in the model dtype.
        self.mask = torch.zeros((session.batch, 1, 1, n), dtype=session.model.dtype,
                                device=session.device)

    def prepare(self, session):
        torch = _torch()
        valid = self.arange[None, :] < session.seq_lens[:, None]
        self.mask.copy_(torch.where(valid, 0.0, float("-inf")).to(self.mask.dtype)[:, None, None, :])

    def __call__(self, layer, q, kc, vc, seq_lens):
        torch = _torch()
        B, Hq, D = q.shape
        Hkv = kc.shape[1]
        qg = q.view(B, Hkv, Hq // Hkv, D)   # the G query heads of a KV head as G query rows
        o = torch.nn.functional.scaled_dot_product_attention(qg, kc, vc, attn_mask=self.mask)
        return o.reshape(B, Hq, D)


class _Exact(_Backend):
    name = "exact"

    def bind(self, session):
        import stochattn

        self.session = session
        cfg = session.model.config
        self.plan = stochattn.ExactPlan(device="cuda", q_heads=cfg.q_heads,
                                        kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                        dtype=_dtype_name(session.model.dtype))

    def __call__(self, layer, q, kc, vc, seq_lens):
        return self.plan.run(q, kc, vc, seq_lens)


class _Santa(_Backend):
    stochastic = True

    def __init__(self, schedule, budget, sampler="systematic", **plan_options):
        self.schedule, self.budget, self.sampler = schedule, int(budget), sampler
        self.plan_options = plan_options
        self.name = f"santa-{schedule}"

    def options(self):
        return dict(budget=self.budget, sampler=self.sampler, schedule=self.schedule,
                    **self.plan_options)

    def bind(self, session):
        import stochattn

        self.session = session
        cfg = session.model.config
        self.plan = stochattn.SantaPlan(
            budget=self.budget, sampler=self.sampler, schedule=self.schedule,
            advance_offset=True, device="cuda", q_heads=cfg.q_heads, kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, dtype=_dtype_name(session.model.dtype), **self.plan_options)

    def __call__(self, layer, q, kc, vc, seq_lens):
        s = self.session  # one device seed and one offset for all layers: each call adds 1
        return self.plan.run(q, kc, vc, seq_lens, seed=s.seed, offset=s.offset)


class _PersistentIndex:
    """A GPU DoublePIndex whose ``seq_lens`` and ``window_start`` live in one buffer of
    fixed address (rows 16-byte aligned, as the append writes them), so that a captured
    append reads on each replay what the previous replay wrote (see the module docstring)."""

    def __init__(self, index):
        torch = _torch()
        self.index = index
        B = int(index.centroids.shape[0])
        Bp = B + (B & 1)
        self.buf = torch.zeros((2, Bp), dtype=torch.int64, device=index.centroids.device)
        self.buf[0, :B].copy_(index.seq_lens)
        self.buf[1, :B].copy_(index.window_start)
        self.lens, self.ws = self.buf[0, :B], self.buf[1, :B]
        index.seq_lens, index.window_start = self.lens, self.ws
        self.labels = index.labels
        self.saved = None

    _FIELDS = ("centroids", "sizes", "value_sums", "labels", "n_initialized")

    def append(self, kc, vc, seq_lens):
        ix = self.index
        ix.append(kc, vc, seq_lens)
        if ix.labels is not self.labels:  # never with a static cache of the index's size
            raise RuntimeError("the Double-P index grew its labels (a cache larger than the "
                               "one it was built from); build it on the full static cache")
        self.lens.copy_(ix.seq_lens)      # stream-ordered after the append's kernels
        self.ws.copy_(ix.window_start)
        ix.seq_lens, ix.window_start = self.lens, self.ws

    def snapshot(self):
        self.saved = {f: getattr(self.index, f).clone() for f in self._FIELDS}
        self.saved["buf"] = self.buf.clone()

    def restore(self):
        for f in self._FIELDS:
            getattr(self.index, f).copy_(self.saved[f])
        self.buf.copy_(self.saved["buf"])
        self.index.seq_lens, self.index.window_start = self.lens, self.ws


class _DoubleP(_Backend):
    name = "doublep"

    def __init__(self, p1=0.95, p2=0.7, approx="centroid", budget=None, tokens_per_cluster=32,
                 n_clusters=None, iterations=10, n_sink=4, window=64):
        self.p1, self.p2, self.approx, self.budget = p1, p2, approx, budget
        self.tokens_per_cluster, self.n_clusters = tokens_per_cluster, n_clusters
        self.iterations, self.n_sink, self.window = iterations, n_sink, window
        self.stochastic = approx == "sample"
        self.indexes = None
        self.build_s = None

    def options(self):
        return dict(p1=self.p1, p2=self.p2, approx=self.approx, budget=self.budget,
                    n_clusters=self.n_clusters, tokens_per_cluster=self.tokens_per_cluster,
                    iterations=self.iterations, n_sink=self.n_sink, window=self.window,
                    build_s=self.build_s)

    def bind(self, session):
        import stochattn

        torch = _torch()
        self.session = session
        self.plan = stochattn.DoublePPlan(p1=self.p1, p2=self.p2, approx=self.approx,
                                          budget=self.budget, advance_offset=self.stochastic,
                                          device="cuda")
        if self.n_clusters is None:
            self.n_clusters = max(1, int(session.prefill_len) // self.tokens_per_cluster)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.indexes = []
        for layer in range(session.model.config.n_layers):
            # static: the full cache (labels over max_tokens); paged: the layer's PagedKV
            # (its prefix gathered once; labels widened to its token_bound = max_tokens)
            kc, vc, lens = session.attn_inputs(layer)
            ix = stochattn.build_doublep_index(
                kc, vc, lens, n_clusters=self.n_clusters, iterations=self.iterations,
                n_sink=self.n_sink, window=self.window)
            self.indexes.append(_PersistentIndex(ix))
        torch.cuda.synchronize()
        self.build_s = time.perf_counter() - t0
        self.snapshot()

    def after_write(self, layer, kc, vc, seq_lens):
        self.indexes[layer].append(kc, vc, seq_lens)

    def __call__(self, layer, q, kc, vc, seq_lens):
        ix = self.indexes[layer].index  # lengths: the index's own, on the device
        if self.stochastic:
            s = self.session
            return self.plan.run(q, kc, vc, None, index=ix, seed=s.seed, offset=s.offset)
        return self.plan.run(q, kc, vc, None, index=ix)

    def snapshot(self):
        for p in self.indexes:
            p.snapshot()

    def restore(self):
        for p in self.indexes:
            p.restore()


class _FlashInfer(_Backend):
    """FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, tensor cores) on the
    session's page pool: the exact baseline of the paged loop.

    Why not one plan for the whole generation: FlashInfer's ``plan`` takes the page table on
    the host and partitions the KV axis of every sequence by its length (the number of
    chunks, the chunk size, the work list); a sequence that grows past the planned length
    would lose its new tokens, and its docs say a plan is not CUDA-graph safe when the
    lengths change. The wrapper's CUDA-graph mode (``use_cuda_graph=True`` with fixed
    page-table buffers) fixes the grid and forces the split-KV path, so that a new ``plan``
    only rewrites device buffers the captured kernels read. So this backend plans once per
    step, on the host, in :meth:`host_step` (before the eager step or the graph replay,
    outside any capture), for the lengths that step will have: ``prefill + i + 1``, known on
    the host without reading the device. The page table comes from the host copy of the
    session's table (:func:`csr_from_lengths` in NumPy); ``kv_indices`` are copied to the
    device from pinned memory (``plan`` would copy host indices synchronously), ``kv_indptr``
    and ``kv_last_page_len`` go to ``plan`` in pinned memory. Before each plan the host
    waits for the previous plan's copies (an event), because ``plan`` rewrites pinned
    staging buffers that an earlier, still queued copy may read: the host runs at most one
    step ahead of the device, which keeps the GPU fed while planning takes less than a step.

    If the installed FlashInfer has no CUDA-graph mode, the wrapper is made without it and
    the backend is eager-only (``graph_safe`` False, the reason in ``options()``).

    ``bind`` also runs a probe: layer 0's attention for a random query, FlashInfer against
    :class:`stochattn.ExactPlan` on the same pages (``probe_max_abs_diff``).
    """

    name = "flashinfer"
    caches = ("paged",)

    def __init__(self, backend="fa2", workspace_mb=128):
        self.fi_backend, self.workspace_mb = backend, int(workspace_mb)
        self.notes = {}
        self.plan_infos = set()
        self.plan_s = []

    def options(self):
        opts = dict(flashinfer_backend=self.fi_backend, use_tensor_cores=True,
                    cuda_graph_mode=self.graph_safe, **self.notes)
        if self.plan_infos:
            # CUDA-graph mode keeps the launch shape fixed: one distinct plan_info expected
            opts["distinct_plan_infos"] = len(self.plan_infos)
        if self.plan_s:
            opts["plan_host_us_median"] = 1e6 * float(np.median(self.plan_s))
        return opts

    def bind(self, session):
        torch = _torch()
        import flashinfer

        if session.cache != "paged":
            raise ValueError("`flashinfer` reads a paged cache: make the session with "
                             "cache='paged'")
        self.session = session
        self.notes["version"] = getattr(flashinfer, "__version__", "?")
        B, dev = session.batch, session.device
        nnz = B * session.pages_per_seq
        i32 = torch.int32
        self._indptr_d = torch.zeros(B + 1, dtype=i32, device=dev)
        self._indices_d = torch.zeros(nnz, dtype=i32, device=dev)
        self._last_d = torch.zeros(B, dtype=i32, device=dev)
        self._src_d = torch.zeros(nnz, dtype=i32, device=dev)
        self._indptr_h = torch.zeros(B + 1, dtype=i32, pin_memory=True)
        self._last_h = torch.zeros(B, dtype=i32, pin_memory=True)
        self._indices_h = torch.zeros(nnz, dtype=i32, pin_memory=True)
        self._table_h = session.page_table_host
        self._flat_h = np.arange(nnz, dtype=np.int64)
        self._workspace = torch.zeros(self.workspace_mb << 20, dtype=torch.uint8, device=dev)
        self._done = torch.cuda.Event()
        self._pending = False
        common = dict(kv_layout=session.layout, use_tensor_cores=True)
        if self.fi_backend != "auto":
            common["backend"] = self.fi_backend
        try:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, use_cuda_graph=True, paged_kv_indptr_buffer=self._indptr_d,
                paged_kv_indices_buffer=self._indices_d,
                paged_kv_last_page_len_buffer=self._last_d, **common)
            self.graph_safe = True
        except Exception as e:  # noqa: BLE001 - an older or other wheel: eager only
            self.graph_safe = False
            self.graph_unsafe_reason = ("BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph="
                                        f"True) failed: {type(e).__name__}: {str(e)[:200]}")
            self.notes["graph_unsafe_reason"] = self.graph_unsafe_reason
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace,
                                                                         **common)
        self._probe()

    def _plan(self, lens_host):
        """Plan for host lengths (B,), after the previous plan's copies (see the class)."""
        torch = _torch()
        s = self.session
        if self._pending:
            self._done.synchronize()
        t0 = time.perf_counter()
        ends, indices, last = csr_from_lengths(np.asarray(lens_host, dtype=np.int64),
                                               self._table_h, s.page_size, self._flat_h)
        n = int(ends[-1])
        ip = self._indptr_h.numpy()
        ip[0] = 0
        ip[1:] = ends
        self._last_h.numpy()[:] = last
        self._indices_h.numpy()[:n] = indices[:n]
        self._src_d[:n].copy_(self._indices_h[:n], non_blocking=True)
        cfg = s.model.config
        self.wrapper.plan(self._indptr_h, self._src_d[:n], self._last_h, cfg.q_heads,
                          cfg.kv_heads, cfg.head_dim, s.page_size, pos_encoding_mode="NONE",
                          q_data_type=s.model.dtype, kv_data_type=s.model.dtype)
        self._done.record(torch.cuda.current_stream())
        self._pending = True
        self.plan_s.append(time.perf_counter() - t0)
        try:
            self.plan_infos.add(tuple(int(x) for x in self.wrapper._plan_info))
        except Exception:  # noqa: BLE001 - a diagnostic only
            pass

    def _probe(self):
        import stochattn

        torch = _torch()
        s, cfg = self.session, self.session.model.config
        self._plan(np.full(s.batch, s.prefill_len, dtype=np.int64))  # the reset state's lengths
        gen = torch.Generator(device=s.device)
        gen.manual_seed(0)
        q = torch.randn((s.batch, cfg.q_heads, cfg.head_dim), generator=gen,
                        device=s.device).to(s.model.dtype)
        got = self.wrapper.run(q, s.pool[0])
        want = stochattn.ExactPlan(device="cuda").run(q, s.attn_inputs(0)[0])
        self.notes["probe_max_abs_diff"] = float((got.float() - want.float()).abs().max())
        self.plan_s.clear()
        self.plan_infos.clear()

    def host_step(self, session, i):
        self._plan(np.full(session.batch, session.prefill_len + i + 1, dtype=np.int64))

    def restore(self):
        # generate() restores right before its timed loop: the statistics cover that loop
        self.plan_s.clear()
        self.plan_infos.clear()

    def __call__(self, layer, q, kc, vc, seq_lens):
        return self.wrapper.run(q, self.session.pool[layer])


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def make_backend(name: str, **options) -> _Backend:
    """A backend of :data:`BACKENDS` by name; ``options``: ``budget`` (and other SantaPlan
    options) for the S2ANTA backends, DoublePPlan / index options for ``"doublep"``,
    ``backend`` (FlashInfer's: ``"fa2"`` by default, ``"auto"``, ``"fa3"``) and
    ``workspace_mb`` for ``"flashinfer"``. Nothing is imported or allocated before
    ``bind``."""
    if name == "sdpa":
        return _SDPA()
    if name == "exact":
        return _Exact()
    if name in ("santa-prop", "santa-flash"):
        options.setdefault("budget", 256)
        return _Santa(name.split("-")[1], **options)
    if name == "doublep":
        return _DoubleP(**options)
    if name == "flashinfer":
        return _FlashInfer(**options)
    raise ValueError(f"`backend`: expected one of {BACKENDS}, got {name!r}")


# ---- the session: static cache, static tensors, step, generate ---------------------------------


@dataclass
class GenerateResult:
    """What :meth:`DecodeSession.generate` returns."""

    backend: str
    graph: bool
    tokens: np.ndarray            # (n_new, B) int64: the step outputs, in order
    seconds: float                # CUDA-event time of the n_new steps (replays)
    tokens_per_s: float           # B * n_new / seconds
    offset_start: int = 0
    offset_end: int = 0
    first_logits: object = None   # (B, V) float32 torch tensor of the first step (a copy)
    last_logits: object = None    # (B, V) float32 torch tensor of the last step (a copy)
    options: dict = field(default_factory=dict)
    cache: str = "static"
    batch: int = 1

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / max(1, self.tokens.shape[0])


class DecodeSession:
    """KV cache and static step tensors of one batch, on the model's device.

    Parameters
    ----------
    model : DecodeModel
    batch : int
    max_tokens : int
        The cache's token bound (prefill + generated tokens; rounded up to a multiple of
        256): the static cache's token axis, or the paged cache's ``max_tokens`` (what its
        kernels plan for) and the pages each sequence owns (``ceil(max_tokens /
        page_size)``).
    seed, offset : int
        The random stream of the stochastic backends (device tensors; ``offset`` is restored
        to this value at the start of every :meth:`generate`).
    cache : {"static", "paged"}
        See the module docstring.
    page_size, layout, shuffle_seed, extra_pages
        The paged cache: tokens per page (1 to 128 on the GPU), ``"NHD"`` or ``"HND"``, the
        seed of the physical page order (None: pages in order), unused pages added to the
        pool (:func:`page_table`).
    pool_fill : float
        What the pool holds before any write (0.0; NaN makes a read of a slot or page
        never written show in the output). Slots past a sequence's length are never read
        by our kernels.
    """

    def __init__(self, model: DecodeModel, batch: int, max_tokens: int, *, seed: int = 0,
                 offset: int = 0, cache: str = "static", page_size: int = 16,
                 layout: str = "NHD", shuffle_seed=0, extra_pages: int = 0,
                 pool_fill: float = 0.0):
        torch = _torch()
        if cache not in CACHES:
            raise ValueError(f"`cache`: expected one of {CACHES}, got {cache!r}")
        if layout not in ("NHD", "HND"):
            raise ValueError(f"`layout`: expected 'NHD' or 'HND', got {layout!r}")
        cfg = model.config
        self.model, self.batch, self.device = model, int(batch), model.device
        self.cache = cache
        self.max_tokens = round_up(max_tokens, 256)
        dev = self.device
        i64 = torch.int64
        L, B, Hkv, D = cfg.n_layers, self.batch, cfg.kv_heads, cfg.head_dim
        self.k_cache = self.v_cache = self.pool = None
        if cache == "static":
            shape = (L, B, Hkv, self.max_tokens, D)
            # Zeros: rows past the valid prefix are read by "sdpa" (masked) and must be finite.
            self.k_cache = torch.zeros(shape, dtype=model.dtype, device=dev)
            self.v_cache = torch.zeros(shape, dtype=model.dtype, device=dev)
        else:
            self.page_size, self.layout = int(page_size), layout
            self.pages_per_seq = pages_per_sequence(self.max_tokens, self.page_size)
            table, self.num_pages = page_table(B, self.max_tokens, self.page_size,
                                               shuffle_seed=shuffle_seed,
                                               extra_pages=extra_pages)
            self.page_table_host = table
            self.page_table = torch.as_tensor(table, device=dev)            # (B, P_seq) int64
            P, NP = self.page_size, self.num_pages
            inner = (P, Hkv) if layout == "NHD" else (Hkv, P)
            self.pool = torch.full((L, NP, 2) + inner + (D,), float(pool_fill),
                                   dtype=model.dtype, device=dev)
            # (num_pages, 2, P, Hkv, D) views of every layer, whatever the layout
            self._nhd = [self.pool[li] if layout == "NHD" else self.pool[li].transpose(2, 3)
                         for li in range(L)]
            i32 = torch.int32
            self.kv_indptr = torch.zeros(B + 1, dtype=i32, device=dev)
            self.kv_indices = torch.zeros(B * self.pages_per_seq, dtype=i32, device=dev)
            self.kv_last_page_len = torch.zeros(B, dtype=i32, device=dev)
            self._flat = torch.arange(B * self.pages_per_seq, dtype=i64, device=dev)
            self._seq_ids = torch.arange(B, dtype=i64, device=dev)
            self._kv_sel = torch.cat([torch.zeros(B, dtype=i64, device=dev),
                                      torch.ones(B, dtype=i64, device=dev)])
            self._layer_caches = [self._make_layer_cache(li) for li in range(L)]
        self.tokens = torch.zeros(self.batch, dtype=i64, device=dev)      # step input
        self.pos = torch.zeros(self.batch, dtype=i64, device=dev)         # its position
        self.seq_lens = torch.zeros(self.batch, dtype=torch.int32, device=dev)
        self.next_tokens = torch.zeros(self.batch, dtype=i64, device=dev)
        self.logits = torch.zeros((self.batch, cfg.vocab_size), dtype=torch.float32, device=dev)
        self.seed = torch.tensor(seed, dtype=i64, device=dev)
        self.offset = torch.tensor(offset, dtype=i64, device=dev)
        self.offset0 = int(offset)
        self.counter = torch.zeros(1, dtype=i64, device=dev)
        self.out_tokens = None
        self.prefill_len = 0
        self.first_token = None     # (B,) int64 device tensor after the prefill
        self._backends = {}

    # -- the paged cache ---------------------------------------------------------------------------

    def _make_layer_cache(self, li):
        """Layer li's paged cache over the shared page table: a PagedKV on a GPU; on a CPU
        session (tests; PagedKV takes NumPy or GPU arrays) a namespace of its fields."""
        table = dict(kv_indptr=self.kv_indptr, kv_indices=self.kv_indices,
                     kv_last_page_len=self.kv_last_page_len, layout=self.layout,
                     max_tokens=self.max_tokens)
        if _torch().device(self.device).type == "cuda":
            from stochattn.paged import paged_kv

            return paged_kv(self.pool[li], **table)
        return types.SimpleNamespace(k_pages=self.pool[li][:, 0], v_pages=self.pool[li][:, 1],
                                     page_size=self.page_size, **table)

    def attn_inputs(self, li):
        """``(kc, vc, seq_lens)`` of layer li as the backends take them: the static caches
        ``(B, Hkv, max_tokens, D)`` and the device lengths, or the layer's paged cache with
        None, None (the lengths are the page table's)."""
        if self.cache == "static":
            return self.k_cache[li], self.v_cache[li], self.seq_lens
        return self._layer_caches[li], None, None

    def _update_pages(self):
        """The CSR page table of the current ``seq_lens``, on the device, in place."""
        ends, indices, last = csr_from_lengths(self.seq_lens.long(), self.page_table,
                                               self.page_size, self._flat)
        self.kv_indptr[1:].copy_(ends)
        self.kv_indices.copy_(indices)
        self.kv_last_page_len.copy_(last)

    def cache_bytes(self) -> int:
        """Bytes of the KV cache (static K and V, or the page pool)."""
        if self.cache == "static":
            return 2 * self.k_cache.numel() * self.k_cache.element_size()
        return self.pool.numel() * self.pool.element_size()

    # -- filling the cache -----------------------------------------------------------------------

    def _write_prefix(self, li, k, v):
        """Tokens [0, T) of layer li from k, v (B, T, Hkv, D)."""
        torch = _torch()
        B, T = k.shape[0], k.shape[1]
        if self.cache == "static":
            self.k_cache[li, :, :, :T].copy_(k.transpose(1, 2))
            self.v_cache[li, :, :, :T].copy_(v.transpose(1, 2))
            return
        pos = torch.arange(T, device=self.device).expand(B, T)
        page, slot = token_slots(pos, self.page_table, self.page_size, self._seq_ids)
        page, slot = page.reshape(-1), slot.reshape(-1)
        Hkv, D = k.shape[2], k.shape[3]
        for sel, x in ((0, k), (1, v)):
            which = torch.full_like(page, sel)
            self._nhd[li].index_put_((page, which, slot), x.reshape(B * T, Hkv, D))

    def prefill(self, prompt_tokens):
        """Causal prefill of prompts (B, T) (or (T,), every row the same) with torch SDPA;
        fills tokens [0, T) of every layer's cache; the first generated token is the argmax
        of the last position's logits. Returns those logits (B, V) float32."""
        torch = _torch()
        m, cfg = self.model, self.model.config
        toks = torch.as_tensor(np.asarray(prompt_tokens), dtype=torch.int64, device=self.device)
        if toks.ndim == 1:
            toks = toks[None].expand(self.batch, -1)
        B, T = toks.shape
        if B != self.batch or T + 1 > self.max_tokens:
            raise ValueError(f"prompt of shape {(B, T)} does not fit batch {self.batch}, "
                             f"max_tokens {self.max_tokens}")
        G = cfg.group
        with torch.no_grad():
            pos = torch.arange(T, device=self.device)
            cos, sin = m.rope_cos_sin(pos)                      # (T, D/2)
            x = m.embed[toks].float()                           # (B, T, H)
            for li, layer in enumerate(m.layers):
                q, k, v = m.qkv(layer, x, cos, sin)             # (B, T, heads, D)
                self._write_prefix(li, k, v)
                q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # (B, heads, T, D)
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1),
                    is_causal=True)
                x = x + (o.transpose(1, 2).reshape(B, T, -1) @ layer["wo"].T).float()
                x = x + m.mlp(layer, x)
            logits = m.logits(x[:, -1])
        self._set_start(T, logits.argmax(-1))
        return logits

    def fill_random(self, context: int, seed: int = 0, first_token: int = 1, k_scale=1.0):
        """Tokens [0, context) of every layer with Gaussian K (std ``k_scale``) and V
        (std 1), as if a prompt of ``context`` tokens had been prefilled; the first step
        reads token ``first_token``. The values are drawn into a contiguous (B, Hkv,
        context, D) tensor per layer and array, so a static and a paged session of one
        seed hold the same tokens."""
        torch = _torch()
        if context + 1 > self.max_tokens:
            raise ValueError(f"context {context} does not fit max_tokens {self.max_tokens}")
        cfg = self.model.config
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        shape = (self.batch, cfg.kv_heads, context, cfg.head_dim)
        with torch.no_grad():
            for li in range(cfg.n_layers):
                k = torch.empty(shape, dtype=self.model.dtype, device=self.device)
                v = torch.empty_like(k)
                k.normal_(0.0, k_scale, generator=gen)
                v.normal_(0.0, 1.0, generator=gen)
                self._write_prefix(li, k.transpose(1, 2), v.transpose(1, 2))
                del k, v
        self._set_start(context, torch.full((self.batch,), first_token, dtype=torch.int64,
                                            device=self.device))

    def _set_start(self, T, first_token):
        self.prefill_len = int(T)
        self.first_token = first_token.to(self.tokens.dtype).clone()
        self.reset()

    def reset(self):
        """The state right after the prefill (token, position, lengths and page table,
        offset, output counter); the cache rows past the prefill need no reset (each step
        writes its row before any read of it)."""
        self.tokens.copy_(self.first_token)
        self.pos.fill_(self.prefill_len)
        self.seq_lens.fill_(self.prefill_len)
        if self.cache == "paged":
            self._update_pages()
        self.offset.fill_(self.offset0)
        self.counter.zero_()
        if self.out_tokens is not None:
            self.out_tokens.zero_()

    # -- the step ---------------------------------------------------------------------------------

    def step(self, backend: _Backend):
        """One decode step on the device: reads ``tokens`` at ``pos``, writes ``next_tokens``
        (also into ``tokens``), ``logits``, ``out_tokens[counter]``; ``pos += 1``. On a paged
        cache it first rewrites the page table for the new lengths."""
        torch = _torch()
        m, cfg = self.model, self.model.config
        B, D, Hkv = self.batch, cfg.head_dim, cfg.kv_heads
        self.seq_lens.copy_(self.pos + 1)          # the new token is attended to
        paged = self.cache == "paged"
        if paged:
            self._update_pages()
            page, slot = token_slots(self.pos, self.page_table, self.page_size, self._seq_ids)
            where = (torch.cat([page, page]), self._kv_sel, torch.cat([slot, slot]))
        else:
            idx = self.pos.view(B, 1, 1, 1).expand(B, Hkv, 1, D)
        backend.prepare(self)
        cos, sin = m.rope_cos_sin(self.pos)        # (B, D/2)
        x = m.embed[self.tokens].float()           # (B, H)
        for li, layer in enumerate(m.layers):
            q, k, v = m.qkv(layer, x, cos, sin)    # (B, Hq, D), (B, Hkv, D)
            if paged:
                self._nhd[li].index_put_(where, torch.cat([k, v]))
            else:
                self.k_cache[li].scatter_(2, idx, k.unsqueeze(2))
                self.v_cache[li].scatter_(2, idx, v.unsqueeze(2))
            kc, vc, lens = self.attn_inputs(li)
            backend.after_write(li, kc, vc, lens)
            o = backend(li, q, kc, vc, lens)
            x = x + (o.reshape(B, -1) @ layer["wo"].T).float()
            x = x + m.mlp(layer, x)
        logits = m.logits(x)
        nxt = logits.argmax(-1)
        self.logits.copy_(logits)
        self.next_tokens.copy_(nxt)
        self.tokens.copy_(nxt)
        if self.out_tokens is not None:
            self.out_tokens.index_copy_(0, self.counter, nxt.view(1, B))
            self.counter.add_(1)
        self.pos.add_(1)

    # -- generation -------------------------------------------------------------------------------

    def backend(self, name: str, **options) -> _Backend:
        """The bound backend of this name and options (made and bound once per session:
        Double-P builds its indexes here, from the prefilled cache)."""
        key = (name, tuple(sorted(options.items())))
        be = self._backends.get(key)
        if be is None:
            be = make_backend(name, **options)
            self._bind(be)
            self._backends[key] = be
        return be

    def _bind(self, be):
        if self.cache not in be.caches:
            raise ValueError(f"backend {be.name!r} reads a {' or '.join(be.caches)} cache, "
                             f"this session's is {self.cache!r}")
        self.reset()
        be.bind(self)

    def generate(self, backend, n_new: int, graph: bool, *, warmup: int = 1,
                 keep_first_logits: bool = False) -> GenerateResult:
        """``n_new`` greedy steps from the post-prefill state, eagerly or as replays of one
        captured step; timed with CUDA events (the warm-up and the capture are not timed;
        a backend's host work before each step, FlashInfer's plan, is).

        Every call starts from the same state (:meth:`reset` and the backend's
        :meth:`restore`), so eager and graph runs with the same backend are comparable
        token for token.
        """
        torch = _torch()
        be = self.backend(backend) if isinstance(backend, str) else backend
        if not hasattr(be, "session") or be.session is not self:
            self._bind(be)
        if graph and not be.graph_safe:
            raise RuntimeError(f"backend {be.name!r} cannot be captured: "
                               f"{be.graph_unsafe_reason}")
        if self.out_tokens is None or self.out_tokens.shape[0] < n_new:
            self.out_tokens = torch.zeros((max(n_new, 1), self.batch), dtype=torch.int64,
                                          device=self.device)
        if self.prefill_len + max(n_new, warmup, 1) > self.max_tokens:
            raise ValueError("n_new does not fit the cache: raise max_tokens")
        first_logits = None
        cuda = torch.device(self.device).type == "cuda"
        if graph and not cuda:
            raise ValueError("graph=True needs a CUDA device")
        with torch.no_grad():
            if keep_first_logits:  # one eager step from the start state
                self._restart(be)
                be.host_step(self, 0)
                self.step(be)
                first_logits = self.logits.clone()
            if cuda:
                side = torch.cuda.Stream(device=self.device)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):   # warm-up: plans, launch caches, compiles
                    self._restart(be)
                    for i in range(max(1, warmup)):
                        be.host_step(self, i)
                        self.step(be)
                torch.cuda.current_stream().wait_stream(side)
            graph_obj = None
            if graph:
                self._restart(be)
                be.host_step(self, 0)
                graph_obj = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph_obj):
                    self.step(be)
            self._restart(be)
            if cuda:
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for i in range(n_new):
                be.host_step(self, i)
                if graph:
                    graph_obj.replay()
                else:
                    self.step(be)
            if cuda:
                end.record()
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        seconds = start.elapsed_time(end) / 1e3 if cuda else wall
        tokens = self.out_tokens[:n_new].cpu().numpy().copy()
        last_logits = self.logits.clone()
        res = GenerateResult(backend=be.name, graph=bool(graph), tokens=tokens, seconds=seconds,
                             tokens_per_s=self.batch * n_new / seconds if seconds > 0 else 0.0,
                             offset_start=self.offset0, offset_end=int(self.offset.item()),
                             first_logits=first_logits, last_logits=last_logits,
                             options=be.options(), cache=self.cache, batch=self.batch)
        del graph_obj
        return res

    def _restart(self, be):
        self.reset()
        be.restore()


def generate(model: DecodeModel, prompt_tokens, n_new: int, backend: str = "exact",
             graph: bool = True, *, batch: int = 1, seed: int = 0, offset: int = 0,
             cache: str = "static", page_size: int = 16, layout: str = "NHD",
             **backend_options) -> GenerateResult:
    """One-shot: a session for ``prompt_tokens`` (T,) or (B, T), prefill, then
    :meth:`DecodeSession.generate`. For several backends on one prompt, make one
    :class:`DecodeSession` and call its ``generate`` per backend (one prefill)."""
    p = np.asarray(prompt_tokens)
    if p.ndim == 2:
        batch = p.shape[0]
    sess = DecodeSession(model, batch, p.shape[-1] + n_new + 2, seed=seed, offset=offset,
                         cache=cache, page_size=page_size, layout=layout)
    sess.prefill(p)
    return sess.generate(sess.backend(backend, **backend_options), n_new, graph)
