"""A static-cache Llama decode loop in PyTorch whose whole step can be captured in one CUDA graph.

The worked example of docs/serving.md ("Calling stochattn from a graph-captured decode
step", issue 30 item 5): SmolLM2-135M (weights from :func:`~stochattn.eval.llm.model.load_model`)
or a model of any Llama shape with random weights (:meth:`DecodeConfig.llama31_8b`), a KV
cache of fixed size ``(layers, B, Hkv, max_tokens, D)``, and one decode step that does
everything on the device:

    embed -> per layer [RMSNorm, fused QKV, interleaved RoPE from the device positions,
    scatter k/v into the cache at the position, (Double-P: append to the layer's index),
    attention through the backend, o-proj, RMSNorm, SwiGLU] -> final norm -> logits ->
    greedy argmax written into static tensors -> position += 1

with no host synchronisation and no allocation outside torch's caching allocator (so
``torch.cuda.graph`` puts it in the graph's pool). Attention backends (:data:`BACKENDS`):

- ``"sdpa"``: torch SDPA over the whole static cache with an additive mask built on the
  device from ``seq_lens`` (graph-safe; it reads all ``max_tokens`` rows, valid or not);
  queries grouped as (B, Hkv, G, D) so GQA needs no copy of K/V.
- ``"exact"``: :class:`stochattn.ExactPlan`.
- ``"santa-prop"``, ``"santa-flash"``: :class:`stochattn.SantaPlan` with
  ``advance_offset=True`` and one device offset shared by all layers, so each layer's call
  draws its own numbers (offset o + layer at step 0) and every graph replay draws fresh ones.
- ``"doublep"``: :class:`stochattn.DoublePPlan` (``approx="centroid"`` by default), one GPU
  index per layer built once after the prefill; the step appends the new token to every
  layer's index inside the graph (:meth:`DoublePIndex.append` launches two kernels and
  never synchronises).

Double-P and graph replays: ``DoublePIndex.append`` on the GPU writes the new lengths and
window starts into a *fresh* buffer and rebinds ``index.seq_lens`` / ``index.window_start``
to it. Under capture that buffer is the graph's, and the next replay's append would still
read the lengths of capture time (the pointers captured are those of before the call), so
tokens would be absorbed again on every replay. The loop therefore keeps each index's
lengths and window starts in a buffer of its own (``_PersistentIndex``) and copies the
append's result back into it inside the step; the index is rebound to that buffer, whose
address never changes. See docs/serving.md.

RoPE: the pairing of the GGUF weights is interleaved (see :mod:`stochattn.eval.llm.model`);
random weights do not care. Angles are formed in float64 on the device from the position
tensor, as :func:`stochattn.eval.llm.forward.rope_tables` does on the host.

Numerics: weights, q/k/v, the cache and every matmul in ``dtype`` (float16 by default);
the residual stream, RMSNorm and RoPE in float32; logits in float32 from a ``dtype``
matmul.

torch is imported inside the functions: the module imports without it (the config and
cache-size arithmetic are used on CPU-only machines).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["BACKENDS", "DecodeConfig", "DecodeModel", "DecodeSession", "GenerateResult",
           "agreement", "generate", "kv_cache_bytes"]

BACKENDS = ("sdpa", "exact", "santa-prop", "santa-flash", "doublep")


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
    """An attention function of the step: ``__call__(layer, q, kc, vc, seq_lens)`` -> (B, Hq, D).

    ``bind(session)`` makes plans and state once (outside any capture); ``prepare(session)``
    runs once per step before the layers; ``after_write(layer, kc, vc, seq_lens)`` runs after
    the step wrote the new k/v row of that layer; ``snapshot()``/``restore()`` save and
    reset whatever state the backend mutates (Double-P's index).
    """

    name = "?"
    stochastic = False

    def options(self) -> dict:
        return {}

    def bind(self, session) -> None:
        self.session = session

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
            ix = stochattn.build_doublep_index(
                session.k_cache[layer], session.v_cache[layer], session.seq_lens,
                n_clusters=self.n_clusters, iterations=self.iterations, n_sink=self.n_sink,
                window=self.window)
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


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def make_backend(name: str, **options) -> _Backend:
    """A backend of :data:`BACKENDS` by name; ``options``: ``budget`` (and other SantaPlan
    options) for the S2ANTA backends, DoublePPlan / index options for ``"doublep"``."""
    if name == "sdpa":
        return _SDPA()
    if name == "exact":
        return _Exact()
    if name in ("santa-prop", "santa-flash"):
        options.setdefault("budget", 256)
        return _Santa(name.split("-")[1], **options)
    if name == "doublep":
        return _DoubleP(**options)
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

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / max(1, self.tokens.shape[0])


class DecodeSession:
    """Static KV cache and static step tensors of one batch, on the model's device.

    Parameters
    ----------
    model : DecodeModel
    batch : int
    max_tokens : int
        The cache's token axis (prefill + generated tokens; rounded up to a multiple of 256).
    seed, offset : int
        The random stream of the stochastic backends (device tensors; ``offset`` is restored
        to this value at the start of every :meth:`generate`).
    """

    def __init__(self, model: DecodeModel, batch: int, max_tokens: int, *, seed: int = 0,
                 offset: int = 0):
        torch = _torch()
        cfg = model.config
        self.model, self.batch, self.device = model, int(batch), model.device
        self.max_tokens = round_up(max_tokens, 256)
        shape = (cfg.n_layers, self.batch, cfg.kv_heads, self.max_tokens, cfg.head_dim)
        # Zeros: rows past the valid prefix are read by "sdpa" (masked) and must be finite.
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        dev = self.device
        i64 = torch.int64
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

    # -- filling the cache -----------------------------------------------------------------------

    def prefill(self, prompt_tokens):
        """Causal prefill of prompts (B, T) (or (T,), every row the same) with torch SDPA;
        fills cache rows [0, T) of every layer; the first generated token is the argmax of
        the last position's logits. Returns those logits (B, V) float32."""
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
                q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # (B, heads, T, D)
                self.k_cache[li, :, :, :T].copy_(k)
                self.v_cache[li, :, :, :T].copy_(v)
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1),
                    is_causal=True)
                x = x + (o.transpose(1, 2).reshape(B, T, -1) @ layer["wo"].T).float()
                x = x + m.mlp(layer, x)
            logits = m.logits(x[:, -1])
        self._set_start(T, logits.argmax(-1))
        return logits

    def fill_random(self, context: int, seed: int = 0, first_token: int = 1, k_scale=1.0):
        """Cache rows [0, context) of every layer with Gaussian K (std ``k_scale``) and V
        (std 1), as if a prompt of ``context`` tokens had been prefilled; the first step
        reads token ``first_token``."""
        torch = _torch()
        if context + 1 > self.max_tokens:
            raise ValueError(f"context {context} does not fit max_tokens {self.max_tokens}")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for li in range(self.model.config.n_layers):
            self.k_cache[li, :, :, :context].normal_(0.0, k_scale, generator=gen)
            self.v_cache[li, :, :, :context].normal_(0.0, 1.0, generator=gen)
        self._set_start(context, torch.full((self.batch,), first_token, dtype=torch.int64,
                                            device=self.device))

    def _set_start(self, T, first_token):
        self.prefill_len = int(T)
        self.first_token = first_token.to(self.tokens.dtype).clone()
        self.reset()

    def reset(self):
        """The state right after the prefill (token, position, lengths, offset, output
        counter); the cache rows past the prefill need no reset (each step writes its row
        before any read of it)."""
        self.tokens.copy_(self.first_token)
        self.pos.fill_(self.prefill_len)
        self.seq_lens.fill_(self.prefill_len)
        self.offset.fill_(self.offset0)
        self.counter.zero_()
        if self.out_tokens is not None:
            self.out_tokens.zero_()

    # -- the step ---------------------------------------------------------------------------------

    def step(self, backend: _Backend):
        """One decode step on the device: reads ``tokens`` at ``pos``, writes ``next_tokens``
        (also into ``tokens``), ``logits``, ``out_tokens[counter]``; ``pos += 1``."""
        torch = _torch()
        m, cfg = self.model, self.model.config
        B, D, Hkv = self.batch, cfg.head_dim, cfg.kv_heads
        self.seq_lens.copy_(self.pos + 1)          # the new token is attended to
        backend.prepare(self)
        cos, sin = m.rope_cos_sin(self.pos)        # (B, D/2)
        idx = self.pos.view(B, 1, 1, 1).expand(B, Hkv, 1, D)
        x = m.embed[self.tokens].float()           # (B, H)
        for li, layer in enumerate(m.layers):
            q, k, v = m.qkv(layer, x, cos, sin)    # (B, Hq, D), (B, Hkv, D)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc.scatter_(2, idx, k.unsqueeze(2))
            vc.scatter_(2, idx, v.unsqueeze(2))
            backend.after_write(li, kc, vc, self.seq_lens)
            o = backend(li, q, kc, vc, self.seq_lens)
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
            self.reset()
            be.bind(self)
            self._backends[key] = be
        return be

    def generate(self, backend, n_new: int, graph: bool, *, warmup: int = 1,
                 keep_first_logits: bool = False) -> GenerateResult:
        """``n_new`` greedy steps from the post-prefill state, eagerly or as replays of one
        captured step; timed with CUDA events (the warm-up and the capture are not timed).

        Every call starts from the same state (:meth:`reset` and the backend's
        :meth:`restore`), so eager and graph runs with the same backend are comparable
        token for token.
        """
        torch = _torch()
        be = self.backend(backend) if isinstance(backend, str) else backend
        if not hasattr(be, "session") or be.session is not self:
            self.reset()
            be.bind(self)
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
                self.step(be)
                first_logits = self.logits.clone()
            if cuda:
                side = torch.cuda.Stream(device=self.device)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):   # warm-up: plans, launch caches, compiles
                    self._restart(be)
                    for _ in range(max(1, warmup)):
                        self.step(be)
                torch.cuda.current_stream().wait_stream(side)
            graph_obj = None
            if graph:
                self._restart(be)
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
            if graph:
                for _ in range(n_new):
                    graph_obj.replay()
            else:
                for _ in range(n_new):
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
                             options=be.options())
        del graph_obj
        return res

    def _restart(self, be):
        self.reset()
        be.restore()


def generate(model: DecodeModel, prompt_tokens, n_new: int, backend: str = "exact",
             graph: bool = True, *, batch: int = 1, seed: int = 0, offset: int = 0,
             **backend_options) -> GenerateResult:
    """One-shot: a session for ``prompt_tokens`` (T,) or (B, T), prefill, then
    :meth:`DecodeSession.generate`. For several backends on one prompt, make one
    :class:`DecodeSession` and call its ``generate`` per backend (one prefill)."""
    p = np.asarray(prompt_tokens)
    if p.ndim == 2:
        batch = p.shape[0]
    sess = DecodeSession(model, batch, p.shape[-1] + n_new + 2, seed=seed, offset=offset)
    sess.prefill(p)
    return sess.generate(sess.backend(backend, **backend_options), n_new, graph)
