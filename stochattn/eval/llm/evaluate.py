"""Teacher-forced next-token loss of SmolLM2 with an attention estimator in every layer.

Run from the repository root (needs the ``eval`` extra, docs/llm_eval.md)::

    python -m stochattn.eval.llm.evaluate --play hamlet --tokens 2048 --estimator santa --budget 128
    python -m stochattn.eval.llm.evaluate --list-plays

Protocol. The play's text is tokenized and cut to ``--tokens`` tokens. The prefix is
computed exactly (:func:`stochattn.eval.llm.forward.forward`, keeping every layer's keys and
values). Every ``--stride``-th position p from ``--first`` on is *evaluated*: its own
residual stream is recomputed layer by layer with the estimator in place of attention,
exactly as a decode step after an exact prefill would: at layer l the position's query
attends over the exact keys/values of positions 0..p-1 and its own key/value at p (from its
own, approximate, residual stream), so replacing attention in layer l changes layer l+1's
inputs of the evaluated positions only. The estimator is called on
``q (P, Hq, D)``, ``k, v (P, Hkv, N, D)``, ``seq_lens = p + 1`` for chunks of positions
(a handful of calls per layer; ``--cache-mb`` bounds the size of one call's K/V).

Double-P and fixed top-k clusters need a k-means index, which a decode builds once at the
prefill and grows with :meth:`stochattn.doublep.DoublePIndex.append`. Per layer and chunk,
:func:`decode_index` does the same: one index (batch 1) on the exact keys/values of the
prompt ``[0, first evaluated position)``, ``prompt // cluster_ratio`` clusters (default
16: 64 clusters at a 1024-token prompt), grown token by token to each evaluated length
(tokens leaving the window join their nearest centroid) and stacked into a batch index.
The index depends on the exact cache only (absorbed tokens are older than the window), so
it is the one a decode over the exact prefix would hold.

GPU (``--xp cupy``, ``evaluate(..., xp=cupy)``). The exact prefix, the evaluated
positions' residual streams and the losses run in CuPy, in float32 as on the CPU. Every
estimator call gets float16 CuPy arrays (q, K, V rounded to float16, the dtype of the CUDA
kernels; ``seq_lens`` int32 on the GPU) and its float16 output is widened back to float32;
by default every evaluated position of a layer is one call (``--cache-mb``, default 4096
MiB of float16 K, bounds it). Where the library has no GPU path and raises
``NotImplementedError`` (Double-P's sampled variant, the selection baselines), the calls
fall back to the NumPy reference on the same float16 values (:class:`HostFallback`);
``EvalResult.estimator_backend`` says which ran, and the GPU is tried again at every
:func:`evaluate`, so an estimator moves to the GPU by itself once its kernel exists.

Output: the mean loss ``-log p(token[p+1])`` over the evaluated positions and its
perplexity, for exact attention (from the exact pass) and for the estimator, and the change.
For stochastic estimators the loss is averaged over ``--seeds`` seeds (seed = 0, 1, ...;
offset = chunk * n_layers + layer, so that every call draws from its own stream), and the
95% confidence interval of the change is Student's t over seeds: it measures the
estimator's randomness on these positions, not the sampling of positions or texts (the
paired standard error over positions is printed as well).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .forward import forward, mlp, qkv, rope_tables, token_losses

__all__ = ["ESTIMATORS", "EvalResult", "HostFallback", "array_namespace", "decode_index",
           "evaluate", "evaluated_positions", "gpu_name", "load_tokens", "make_estimator",
           "summarize_diagnostics", "synchronize", "teacher_forced_losses"]

ESTIMATORS = ("exact", "santa", "topk", "quest", "top_p", "sinkwindow", "doublep",
              "cluster_topk")


def _namespace(a):
    """``cupy`` for a CuPy array, else ``numpy`` (CuPy is imported only when one arrives)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def _sink_window_attention(q, k, v, seq_lens, *, n_sink=4, window=64):
    """Exact attention over the first ``n_sink`` and the last ``window`` tokens only.

    NumPy or CuPy arrays (on the GPU the gathered rows go to the exact CUDA kernel)."""
    from stochattn.exact import exact_attention

    xp = _namespace(k)
    P, Hkv, N, D = k.shape
    M = n_sink + window
    lens = xp.asarray(seq_lens).astype(xp.int64)
    j = xp.arange(M)[None, :]
    # Rows longer than M keep tokens 0..n_sink-1 and L-window..L-1; shorter rows keep all.
    idx = xp.where(j < n_sink, j, lens[:, None] - M + j)
    idx = xp.where(lens[:, None] > M, idx, xp.minimum(j, N - 1))
    take = idx[:, None, :, None]
    ks = xp.ascontiguousarray(xp.take_along_axis(k, take, axis=2))
    vs = xp.ascontiguousarray(xp.take_along_axis(v, take, axis=2))
    return exact_attention(q, ks, vs, xp.minimum(lens, M).astype(xp.int32))


def make_estimator(name, *, budget=128, p=0.95, sampler="systematic", schedule="prop",
                   n_sink=4, window=64, p1=0.95, p2=0.7, approx="centroid", clusters=8,
                   prefill=None, cluster_ratio=16, kmeans_iterations=10, mass="paper",
                   diagnostics=None):
    """An estimator ``f(q, k, v, seq_lens, *, seed, offset) -> out (P, Hq, D)``.

    Parameters
    ----------
    name : {"exact", "santa", "topk", "quest", "top_p", "sinkwindow"}
        ``"santa"``: :func:`stochattn.santa.santa_attention` with ``budget`` samples and
        the given ``sampler`` / ``schedule`` (stochastic); ``"topk"``: oracle top-k with
        ``k_tokens = budget``; ``"quest"``: Quest with ``budget`` tokens (pages of 16);
        ``"top_p"``: oracle token top-p at ``p``; ``"sinkwindow"``: the first ``n_sink``
        and the last ``window`` tokens only; ``"exact"``: exact attention;
        ``"doublep"``: :func:`stochattn.doublep.doublep_attention` at ``p1``, ``p2``,
        ``approx`` (``"sample"``: ``budget`` draws, ``sampler``; stochastic);
        ``"cluster_topk"``: :func:`stochattn.doublep.cluster_topk_attention` with
        ``clusters`` clusters. Both on the decode-faithful index of :func:`decode_index`
        (``prefill``, ``cluster_ratio``, ``kmeans_iterations``; sinks ``n_sink``, window
        ``window``). ``mass="sub"`` (``"doublep"`` only): the index is built with
        ``mass="sub"`` (4 sub-centroids per cluster, grown by append) and the clusters are
        scored by their sub-centroids (issue 31; ``doublep_attention(..., mass="sub")``).
    prefill : int
        Required by ``"doublep"`` / ``"cluster_topk"``: the prompt length whose exact keys
        the k-means index is built on (:func:`evaluate` passes the first evaluated position).
    diagnostics : list, optional
        If given, every call of a library estimator (santa, topk, quest, top_p) asks for
        ``return_diagnostics=True`` and appends its :class:`stochattn.Diagnostics` here
        (see :func:`summarize_diagnostics`); exact and sinkwindow append nothing.

    Returns
    -------
    (callable, bool)
        The estimator and whether it is stochastic.
    """
    f, stochastic = _make_estimator(name, budget=budget, p=p, sampler=sampler,
                                    schedule=schedule, n_sink=n_sink, window=window,
                                    p1=p1, p2=p2, approx=approx, clusters=clusters,
                                    prefill=prefill, cluster_ratio=cluster_ratio,
                                    kmeans_iterations=kmeans_iterations, mass=mass,
                                    with_diagnostics=diagnostics is not None)
    if diagnostics is None or name in ("exact", "sinkwindow"):
        return f, stochastic

    def collecting(q, k, v, lens, *, seed, offset):
        out, diag = f(q, k, v, lens, seed=seed, offset=offset)
        diagnostics.append(diag)
        return out

    return collecting, stochastic


def summarize_diagnostics(diags):
    """Means over every (position, KV head) row of every call in ``diags``.

    Returns a dict with ``k_read_fraction`` and ``v_read_fraction`` (rows read / seq_len,
    averaged over rows, so every evaluated position and layer weighs the same),
    ``v_rows_read`` / ``k_rows_read`` (mean counts, union over the GQA group) and, where
    present, per query head means of ``true_mass`` (of the selected tokens),
    ``estimated_mass``, ``clusters_selected``, ``clusters_exact`` and ``tokens_exact``.
    Empty dict for no calls.
    """
    if not diags:
        return {}
    kf = np.concatenate([d.k_read_fraction.ravel() for d in diags])
    vf = np.concatenate([d.v_read_fraction.ravel() for d in diags])
    vr = np.concatenate([d.v_rows_read.ravel() for d in diags])
    out = {"k_read_fraction": float(kf.mean()), "v_read_fraction": float(vf.mean()),
           "v_rows_read": float(vr.mean())}
    # Per query head, where the estimator reports them (Double-P, cluster top-k).
    for key in ("true_mass", "estimated_mass", "clusters_selected", "clusters_exact",
                "tokens_exact"):
        if all(getattr(d, key) is not None for d in diags):
            out[key] = float(np.concatenate([getattr(d, key).ravel() for d in diags]).mean())
    k_only = [d.k_rows_read.ravel() for d in diags]
    out["k_rows_read"] = float(np.concatenate(k_only).mean())
    return out


def decode_index(k, v, seq_lens, *, prefill, n_clusters, iterations=10, n_sink=4, window=64,
                 seed=0, mass="paper"):
    """The Double-P index a decode would hold at each row's length, as a batch index.

    One k-means index (batch 1) is built on the exact keys/values ``[0, prefill)`` of row 0
    (the prompt); it is then grown with :meth:`stochattn.doublep.DoublePIndex.append`
    through the rows' lengths in increasing order (tokens leaving the window join their
    nearest centroid, as in decode), and a copy is taken at each row's length. The
    absorbed tokens of row i are positions ``< seq_lens[i] - window``, read from row i's
    cache, so they must be exact there: in :func:`teacher_forced_losses` only the last
    position of a row (inside the window) comes from the row's own stream.

    Parameters
    ----------
    k, v : ndarray (P, Hkv, N, D)
    seq_lens : int array (P,)
        Non-decreasing, each > ``prefill``.
    prefill, n_clusters, iterations, n_sink, window, seed, mass
        Of :func:`stochattn.doublep.build_doublep_index`.

    Returns
    -------
    DoublePIndex with batch P and ``seq_lens`` equal to ``seq_lens``.
    """
    from stochattn.doublep import DoublePIndex, build_doublep_index

    lens = _host(seq_lens).astype(np.int64)  # host lengths, also for GPU caches
    if np.any(np.diff(lens) < 0) or lens[0] <= prefill:
        raise ValueError(f"`seq_lens`: expected non-decreasing and > prefill {prefill}, "
                         f"got {lens.tolist()}")
    index = build_doublep_index(k[:1, :, :prefill], v[:1, :, :prefill], n_clusters=n_clusters,
                                iterations=iterations, n_sink=n_sink, window=window, seed=seed,
                                mass=mass)
    snaps = []
    for i, L in enumerate(lens):
        index.append(k[i:i + 1], v[i:i + 1], lens[i:i + 1])
        snaps.append(DoublePIndex.stack([index]))  # a copy at this row's length
    return DoublePIndex.stack(snaps)


def _make_estimator(name, *, budget, p, sampler, schedule, n_sink, window, p1, p2, approx,
                    clusters, prefill, cluster_ratio, kmeans_iterations, with_diagnostics,
                    mass="paper"):
    """:func:`make_estimator` without the collection; library calls pass ``with_diagnostics``."""
    rd = with_diagnostics
    if name in ("doublep", "cluster_topk"):
        from stochattn.doublep import cluster_topk_attention, doublep_attention

        if prefill is None:
            raise ValueError(f"`prefill`: required by estimator {name!r}, got None")
        n_clusters = max(1, prefill // cluster_ratio)

        def index_of(k, v, lens):
            return decode_index(k, v, lens, prefill=prefill, n_clusters=n_clusters,
                                iterations=kmeans_iterations, n_sink=n_sink, window=window,
                                mass=mass if name == "doublep" else "paper")

        if name == "cluster_topk":
            return (lambda q, k, v, lens, *, seed, offset: cluster_topk_attention(
                q, k, v, lens, index=index_of(k, v, lens), k_clusters=clusters,
                return_diagnostics=rd)), False
        b = budget if approx == "sample" else None
        return (lambda q, k, v, lens, *, seed, offset: doublep_attention(
            q, k, v, lens, index=index_of(k, v, lens), p1=p1, p2=p2, approx=approx, budget=b,
            sampler=sampler, seed=seed, offset=offset, mass=mass, return_diagnostics=rd)), \
            approx == "sample"
    if name == "exact":
        from stochattn.exact import exact_attention
        return (lambda q, k, v, lens, *, seed, offset: exact_attention(q, k, v, lens)), False
    if name == "santa":
        from stochattn.santa import santa_attention
        return (lambda q, k, v, lens, *, seed, offset: santa_attention(
            q, k, v, lens, budget=budget, sampler=sampler, schedule=schedule, seed=seed,
            offset=offset, return_diagnostics=rd)), True
    if name == "topk":
        from stochattn.baselines import topk_attention
        return (lambda q, k, v, lens, *, seed, offset: topk_attention(
            q, k, v, lens, k_tokens=budget, return_diagnostics=rd)), False
    if name == "quest":
        from stochattn.baselines import quest_attention
        return (lambda q, k, v, lens, *, seed, offset: quest_attention(
            q, k, v, lens, k_tokens=budget, return_diagnostics=rd)), False
    if name == "top_p":
        from stochattn.baselines import top_p_attention
        return (lambda q, k, v, lens, *, seed, offset: top_p_attention(
            q, k, v, lens, p=p, return_diagnostics=rd)), False
    if name == "sinkwindow":
        return (lambda q, k, v, lens, *, seed, offset: _sink_window_attention(
            q, k, v, lens, n_sink=n_sink, window=window)), False
    raise ValueError(f"`estimator`: expected one of {ESTIMATORS}, got {name!r}")


def array_namespace(name):
    """``numpy`` for ``"numpy"``, ``cupy`` for ``"cupy"`` (imported here, with a clear
    error without it)."""
    if name == "numpy":
        return np
    if name != "cupy":
        raise ValueError(f"`xp`: expected 'numpy' or 'cupy', got {name!r}")
    try:
        import cupy
    except ImportError as exc:
        raise ImportError("`xp`: 'cupy' needs CuPy and a CUDA GPU (stochattn[cuda13] or "
                          "stochattn[cuda12])") from exc
    return cupy


def synchronize(xp):
    """Wait for the GPU's queued work (a no-op for NumPy): for wall-clock timings."""
    if xp is not np:
        xp.cuda.Device().synchronize()


def _host(a):
    """A NumPy copy of a NumPy or CuPy array (CuPy refuses implicit conversion)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def load_tokens(play, n_tokens, *, tokenizer=None):
    """The first ``n_tokens`` token ids (int64) of a play's plain text."""
    from .texts import play_text
    from .tokenizer import build_tokenizer

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    ids = np.asarray(tok.encode(play_text(play)).ids, dtype=np.int64)
    if ids.shape[0] < n_tokens:
        raise ValueError(f"`n_tokens`: play {play!r} has {ids.shape[0]} tokens, asked {n_tokens}")
    return ids[:n_tokens]


def evaluated_positions(n_tokens, *, first, stride):
    """Positions ``first, first + stride, ... <= n_tokens - 2`` (each predicts the next token)."""
    if not 0 <= first <= n_tokens - 2:
        raise ValueError(f"`first`: expected in [0, {n_tokens - 2}], got {first}")
    if stride < 1:
        raise ValueError(f"`stride`: expected >= 1, got {stride}")
    return np.arange(first, n_tokens - 1, stride, dtype=np.int64)


def _chunks(positions, kv_heads, head_dim, cache_bytes, itemsize=8):
    """Index ranges [a, b) of sorted positions whose K/V copy fits in ``cache_bytes``.

    A call's K (and V) holds rows x Hkv x (last position + 1) x D values of ``itemsize``
    bytes: 8 on the CPU (the reference estimators work on float64 copies), 2 on the GPU
    (the float16 inputs of the CUDA kernels).
    """
    out, a = [], 0
    while a < len(positions):
        b = a + 1
        while b < len(positions) and \
                (b + 1 - a) * kv_heads * (positions[b] + 1) * head_dim * itemsize <= cache_bytes:
            b += 1
        out.append((a, b))
        a = b
    return out


# The offset of the j-th host sub-call of a fallback (HostFallback): offset + j * 2**20, so
# that sub-calls draw from streams of their own (harness offsets stay below 2**20).
_SUBCALL_OFFSET = 1 << 20


class HostFallback:
    """An estimator on GPU (CuPy) arrays, with the NumPy reference as the fallback.

    The first call passes the GPU arrays to the estimator, so that the library dispatches
    to its CUDA kernels. If it raises ``NotImplementedError`` (Double-P's sampled variant,
    the selection baselines, SANTA's ``"global"`` schedule), this
    call and every later one copy q, k, v and ``seq_lens`` to the host and run the NumPy
    reference, and the output comes back to the GPU. ``backend`` then says which ran
    (``"cuda"`` or ``"numpy-fallback"``; None before the first call) and ``note`` holds
    the library's message. A new object (one per :func:`evaluate`) tries the GPU again, so
    the GPU path is taken by itself once the library stops raising.

    On the fallback, the rows of one call are cut into host sub-calls whose float64 K (or
    V) stays within ``host_bytes`` (as :func:`teacher_forced_losses` chunks on the CPU),
    reading only the columns below the sub-call's longest sequence; sub-call j gets
    ``offset + j * 2**20`` (its own random streams; j = 0 keeps the offset). NumPy
    arguments go straight to the estimator.
    """

    def __init__(self, estimator, *, host_bytes=256 << 20):
        self.estimator = estimator
        self.host_bytes = host_bytes
        self.backend = None
        self.note = ""

    def __call__(self, q, k, v, seq_lens, *, seed, offset):
        xp = _namespace(k)
        if xp is np:
            return self.estimator(q, k, v, seq_lens, seed=seed, offset=offset)
        if self.backend != "numpy-fallback":
            try:
                out = self.estimator(q, k, v, seq_lens, seed=seed, offset=offset)
            except NotImplementedError as exc:
                self.backend, self.note = "numpy-fallback", str(exc)
            else:
                self.backend = "cuda"
                return out
        lens = _host(seq_lens).astype(np.int64)
        P, Hkv, N, D = (int(x) for x in k.shape)
        out = xp.empty(q.shape, dtype=q.dtype)
        a, j = 0, 0
        while a < P:   # greedy row groups within host_bytes (at least one row each)
            b = a + 1
            while b < P and (b + 1 - a) * Hkv * int(lens[a:b + 1].max()) * D * 8 \
                    <= self.host_bytes:
                b += 1
            n = max(int(lens[a:b].max()), 1)
            res = self.estimator(_host(q[a:b]), _host(k[a:b, :, :n]), _host(v[a:b, :, :n]),
                                 lens[a:b].astype(np.int32), seed=seed,
                                 offset=offset + j * _SUBCALL_OFFSET)
            out[a:b] = xp.asarray(res).astype(q.dtype)
            a, j = b, j + 1
        return out


def teacher_forced_losses(weights, tokens, positions, estimator, prefix, *, seed=0,
                          pairing="interleaved", cache_bytes=256 << 20, kv_dtype=None, xp=np):
    """Next-token losses (P,) at ``positions`` with ``estimator`` in every layer.

    Parameters
    ----------
    weights : LlamaWeights
    tokens : int array (T,)
        The sequence; position p predicts ``tokens[p + 1]``.
    positions : int array (P,)
        Sorted evaluated positions in [0, T - 2].
    estimator : callable
        ``f(q (P, Hq, D), k (P, Hkv, N, D), v, seq_lens (P,), *, seed, offset)``, as from
        :func:`make_estimator`.
    prefix : ForwardResult
        The exact pass over at least ``tokens[:positions[-1] + 1]`` with ``keep_kv=True``.
    seed : int
        Passed to every call; ``offset = chunk * n_layers + layer``.
    cache_bytes : int
        Bound on one call's K (or V) size in bytes (float64 values for the float32 inputs
        of the CPU path, whose reference estimators copy to float64; ``kv_dtype`` values
        otherwise); sets the chunking.
    kv_dtype : dtype, optional
        The dtype of the estimator's q, k, v (default: the prefix's, float32). The GPU
        path passes float16, the dtype of the CUDA kernels: the forward stays float32,
        q, k, v are rounded to float16 for the call and its output widened back.
    xp : module
        ``numpy``, or ``cupy`` with weights and prefix on the GPU.

    Returns
    -------
    float64 array (P,), of namespace ``xp``
    """
    cfg = weights.config
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size == 0 or np.any(np.diff(pos) <= 0) or pos[0] < 0 or pos[-1] + 1 >= len(tokens):
        raise ValueError("`positions`: expected sorted distinct positions in [0, T - 2]")
    P, Hkv, D = pos.shape[0], cfg.kv_heads, cfg.head_dim
    tokens = xp.asarray(tokens)
    cos, sin = rope_tables(pos, D, cfg.rope_theta, xp)
    dtype = np.dtype(prefix.k[0].dtype if kv_dtype is None else kv_dtype)
    cast = dtype != prefix.k[0].dtype
    itemsize = 8 if dtype.itemsize >= 4 else dtype.itemsize
    chunks = _chunks(pos, Hkv, D, cache_bytes, itemsize)
    y = xp.take(weights.token_embd, tokens[xp.asarray(pos)], axis=0)
    size = max((b - a) * Hkv * (int(pos[b - 1]) + 1) * D for a, b in chunks)
    kbuf = xp.empty(size, dtype=dtype)
    vbuf = xp.empty(size, dtype=dtype)
    for li, layer in enumerate(weights.layers):
        q, k_own, v_own = qkv(layer, y, cos, sin, cfg, pairing, xp)
        K = xp.transpose(prefix.k[li], (1, 0, 2))   # (Hkv, T, D), exact, after RoPE
        V = xp.transpose(prefix.v[li], (1, 0, 2))
        if cast:
            _check_range(li, dtype, xp, K=K, V=V, k=k_own, v=v_own, q=q)
            K, V = K.astype(dtype), V.astype(dtype)
            k_own, v_own = k_own.astype(dtype), v_own.astype(dtype)
        o = xp.empty_like(q)
        for c, (a, b) in enumerate(chunks):
            ps = pos[a:b]
            n = int(ps[-1]) + 1
            rows = xp.arange(b - a)
            # Each row: the exact cache of tokens 0..n-1, with its own key/value at p.
            # Views of two buffers reused by every call: fresh memory per call would
            # cost more in page faults than the copy itself.
            kc = kbuf[:(b - a) * Hkv * n * D].reshape(b - a, Hkv, n, D)
            vc = vbuf[:(b - a) * Hkv * n * D].reshape(b - a, Hkv, n, D)
            kc[...] = K[None, :, :n]
            vc[...] = V[None, :, :n]
            pj = xp.asarray(ps)
            kc[rows, :, pj, :] = k_own[a:b]
            vc[rows, :, pj, :] = v_own[a:b]
            lens = xp.asarray(ps + 1, dtype=xp.int32)
            qc = q[a:b].astype(dtype) if cast else q[a:b]
            out = estimator(qc, kc, vc, lens, seed=seed, offset=c * cfg.n_layers + li)
            o[a:b] = out.astype(o.dtype) if cast else out
        y = y + o.reshape(P, -1) @ layer["attn_output"].T
        y = y + mlp(layer, y, cfg, xp)
    return token_losses(weights, y, tokens[xp.asarray(pos + 1)], xp=xp)


def _check_range(layer, dtype, xp, **arrays):
    """Raise if a float32 array would overflow ``dtype`` (one device sync per layer)."""
    top = float(np.finfo(dtype).max)
    for name, a in arrays.items():
        m = float(xp.abs(a).max())
        if not m < top:
            raise ValueError(f"layer {layer}: `{name}` holds |values| up to {m:.4g}, beyond "
                             f"{dtype} (max {top:.4g}); the GPU path cannot cast it")


# Student's t quantile t_{0.975, df} for df = 1..30; beyond, 2.042 (df = 30) is a slightly
# conservative stand-in for the exact value (1.96 as df -> infinity).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def _t975(df):
    return _T975[min(df, 30) - 1]


@dataclass
class EvalResult:
    """One evaluation (see the module docstring); losses in nats per token."""

    play: str
    n_tokens: int
    n_positions: int
    estimator: str
    options: dict
    seeds: list
    loss_exact: float
    ppl_exact: float
    loss_per_seed: list
    loss: float
    ppl: float
    delta_loss: float
    delta_loss_ci95: float          # half-width over seeds (NaN for one seed / deterministic)
    delta_loss_se_positions: float  # paired standard error over positions (seed mean)
    # Standard error of the seed-mean change due to the estimator's randomness alone, pooled
    # over positions: sqrt(sum_p var_seeds(loss_p) / n_seeds) / P (positions' draws are
    # independent streams, so their variances add); P - ish degrees of freedom instead of
    # n_seeds - 1. NaN for one seed / deterministic.
    delta_loss_se_seeds_pooled: float
    ppl_change: float               # ppl / ppl_exact - 1
    seconds_prefix: float
    seconds_per_seed: list = field(default_factory=list)
    diagnostics: dict = field(default_factory=dict)  # summarize_diagnostics, all seeds
    # Where it ran: the forward's namespace ("numpy" or "cupy"), the dtype of the
    # estimator's q, k, v ("float32" on the CPU, "float16" on the GPU) and the backend of
    # the estimator calls: "numpy" (CPU path), "cuda" (the library's CUDA kernels) or
    # "numpy-fallback" (GPU path, the library raised NotImplementedError for GPU arrays;
    # its message in estimator_backend_note), see HostFallback.
    xp: str = "numpy"
    kv_dtype: str = "float32"
    estimator_backend: str = "numpy"
    estimator_backend_note: str = ""


def evaluate(play="hamlet", *, n_tokens=2048, first=None, stride=4, estimator="santa",
             seeds=1, weights=None, tokens=None, prefix=None, pairing="interleaved",
             cache_bytes=None, collect_diagnostics=False, kv_dtype=None, xp=np, **options):
    """Exact vs estimator teacher-forced loss on one play.

    Parameters
    ----------
    play : str
        A name from :func:`stochattn.eval.llm.texts.list_plays`.
    n_tokens : int
        Sequence length T (at most 8192).
    first, stride : int
        Evaluated positions ``first, first + stride, ...``; ``first`` defaults to T // 2.
    estimator : str
        See :func:`make_estimator`; ``options`` go to it (``budget``, ``p``, ``sampler``,
        ``schedule``, ``n_sink``, ``window``).
    seeds : int
        Number of seeds (0, 1, ...) for a stochastic estimator; deterministic ones run once.
    weights, tokens, prefix : optional
        Reuse a loaded model, token array and exact pass (``keep_kv=True``).
    cache_bytes : int, optional
        Bound on one estimator call's K (see :func:`teacher_forced_losses`); default
        256 MiB of float64 on the CPU, 4 GiB of float16 on the GPU (every evaluated
        position of a layer in one call up to 8k tokens and ~600 positions).
    collect_diagnostics : bool
        Fill ``EvalResult.diagnostics`` with :func:`summarize_diagnostics` over every call
        of every seed (fraction of K and V rows read, selected mass).
    kv_dtype : dtype, optional
        The estimator's input dtype (:func:`teacher_forced_losses`); default float32 on
        the CPU, float16 on the GPU (the dtype of the CUDA kernels).
    xp : module
        ``numpy`` (default) or ``cupy``: the exact forward, the teacher-forced forward and
        the losses run in float32 in that namespace (NumPy weights are moved there); on
        CuPy every estimator call gets float16 CuPy arrays and runs the library's CUDA
        kernels, or its NumPy reference where the library has no GPU path
        (:class:`HostFallback`; ``EvalResult.estimator_backend`` says which).

    Returns
    -------
    EvalResult
    """
    from .model import load_model

    weights = weights if weights is not None else load_model()
    if xp is not np and isinstance(weights.token_embd, np.ndarray):
        weights = weights.to(xp)
    tokens = np.asarray(tokens) if tokens is not None else load_tokens(play, n_tokens)
    T = int(tokens.shape[0])
    first = T // 2 if first is None else first
    pos = evaluated_positions(T, first=first, stride=stride)
    t0 = time.perf_counter()
    if prefix is None:
        prefix = forward(weights, tokens[:pos[-1] + 1], pairing=pairing, keep_kv=True, xp=xp)
    exact_losses = _host(token_losses(weights, prefix.hidden[xp.asarray(pos)],
                                           xp.asarray(tokens[pos + 1]), xp=xp))
    t_prefix = time.perf_counter() - t0
    diags = [] if collect_diagnostics else None
    if estimator in ("doublep", "cluster_topk"):
        options.setdefault("prefill", int(pos[0]))  # the prompt: tokens before the first
    f, stochastic = make_estimator(estimator, diagnostics=diags, **options)
    on_gpu = xp is not np
    if on_gpu:
        kv_dtype = np.float16 if kv_dtype is None else kv_dtype
        cache_bytes = 4 << 30 if cache_bytes is None else cache_bytes
        f = HostFallback(f)
    cache_bytes = 256 << 20 if cache_bytes is None else cache_bytes
    n_seeds = seeds if stochastic else 1
    per_seed, secs, deltas_pos = [], [], []
    for s in range(n_seeds):
        t0 = time.perf_counter()
        # _host copies the losses back: the time includes the GPU's work.
        losses = _host(teacher_forced_losses(weights, tokens, pos, f, prefix, seed=s,
                                             pairing=pairing, cache_bytes=cache_bytes,
                                             kv_dtype=kv_dtype, xp=xp))
        secs.append(time.perf_counter() - t0)
        per_seed.append(float(losses.mean()))
        deltas_pos.append(losses - exact_losses)
    loss_exact = float(exact_losses.mean())
    loss = float(np.mean(per_seed))
    d = np.asarray(per_seed) - loss_exact
    ci = float(_t975(n_seeds - 1) * d.std(ddof=1) / math.sqrt(n_seeds)) if n_seeds > 1 else math.nan
    dpos = np.mean(deltas_pos, axis=0)
    se_pool = (float(math.sqrt(np.var(deltas_pos, axis=0, ddof=1).sum() / n_seeds) / dpos.size)
               if n_seeds > 1 else math.nan)
    se_pos = float(dpos.std(ddof=1) / math.sqrt(dpos.size)) if dpos.size > 1 else math.nan
    return EvalResult(play=play, n_tokens=T, n_positions=int(pos.size), estimator=estimator,
                      options=dict(options), seeds=list(range(n_seeds)), loss_exact=loss_exact,
                      ppl_exact=math.exp(loss_exact), loss_per_seed=per_seed, loss=loss,
                      ppl=math.exp(loss), delta_loss=loss - loss_exact, delta_loss_ci95=ci,
                      delta_loss_se_positions=se_pos, delta_loss_se_seeds_pooled=se_pool,
                      ppl_change=math.exp(loss - loss_exact) - 1,
                      seconds_prefix=t_prefix, seconds_per_seed=secs,
                      diagnostics=summarize_diagnostics(diags) if diags is not None else {},
                      xp=xp.__name__, kv_dtype=np.dtype(kv_dtype or np.float32).name,
                      estimator_backend=(f.backend or "cuda") if on_gpu else "numpy",
                      estimator_backend_note=f.note if on_gpu else "")


def _print(res: EvalResult, full_ppl=None):
    opts = " ".join(f"{k}={v}" for k, v in res.options.items())
    print(f"play {res.play}, {res.n_tokens} tokens, {res.n_positions} evaluated positions; "
          f"{platform.processor() or platform.machine()}")
    if full_ppl is not None:
        print(f"exact perplexity over all {res.n_tokens - 1} predictions: {full_ppl:.3f}")
    print(f"{'':28s} {'loss':>8s} {'ppl':>9s}")
    print(f"{'exact':28s} {res.loss_exact:8.4f} {res.ppl_exact:9.3f}")
    print(f"{(res.estimator + ' ' + opts)[:28]:28s} {res.loss:8.4f} {res.ppl:9.3f}")
    ci = "" if math.isnan(res.delta_loss_ci95) else \
        f" +- {res.delta_loss_ci95:.4f} (95% CI over {len(res.seeds)} seeds)"
    print(f"change: loss {res.delta_loss:+.4f}{ci}, positions' paired s.e. "
          f"{res.delta_loss_se_positions:.4f}; perplexity {100 * res.ppl_change:+.2f}%")
    where = ("CPU" if res.xp == "numpy" else
             f"GPU ({gpu_name()}), estimator on {res.estimator_backend} with "
             f"{res.kv_dtype} q/K/V")
    secs = ", ".join(f"{t:.2f}" for t in res.seconds_per_seed)
    print(f"time ({where}): exact prefix {res.seconds_prefix:.2f} s; estimator in every "
          f"layer, {res.n_positions} positions of {res.n_tokens} tokens: "
          f"{np.mean(res.seconds_per_seed):.2f} s per seed [{secs}]")
    if res.estimator_backend == "numpy-fallback":
        print(f"note: {res.estimator} has no GPU path yet, ran the NumPy reference "
              f"(float16-rounded inputs): {res.estimator_backend_note}")



def gpu_name():
    """The current CUDA device's name (CuPy), for printing."""
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # printing only
        return "CUDA device"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m stochattn.eval.llm.evaluate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--play", default="hamlet")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--first", type=int, default=None,
                    help="first evaluated position (default T/2)")
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--estimator", default="santa", choices=ESTIMATORS)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--p", type=float, default=0.95)
    ap.add_argument("--sampler", default="systematic")
    ap.add_argument("--schedule", default="prop")
    ap.add_argument("--p1", type=float, default=0.95, help="doublep stage 1 threshold")
    ap.add_argument("--p2", type=float, default=0.7, help="doublep stage 2 threshold")
    ap.add_argument("--approx", default="centroid", choices=("centroid", "sample"),
                    help="doublep: C_approx as centroids or --budget SANTA draws")
    ap.add_argument("--mass", default="paper", choices=("paper", "sub"),
                    help="doublep: cluster mass from the centroid (paper) or 4 sub-centroids")
    ap.add_argument("--clusters", type=int, default=8, help="cluster_topk: clusters kept")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cache-mb", type=int, default=None,
                    help="bound on one estimator call's K in MiB (default 256 of float64 "
                         "on the CPU, 4096 of float16 on the GPU)")
    ap.add_argument("--xp", default="numpy", choices=("numpy", "cupy"),
                    help="array namespace: cupy runs everything on the GPU (float32 "
                         "forward, float16 estimator inputs, CUDA kernels)")
    ap.add_argument("--pairing", default="interleaved", choices=("interleaved", "half"))
    ap.add_argument("--full-ppl", action="store_true",
                    help="also print the exact perplexity over all tokens")
    ap.add_argument("--json", help="write the result as JSON to this file")
    ap.add_argument("--list-plays", action="store_true")
    args = ap.parse_args(argv)
    if args.list_plays:
        from .texts import list_plays
        print("\n".join(list_plays()))
        return 0
    opts = {"santa": dict(budget=args.budget, sampler=args.sampler, schedule=args.schedule),
            "topk": dict(budget=args.budget), "quest": dict(budget=args.budget),
            "top_p": dict(p=args.p), "sinkwindow": {}, "exact": {},
            "doublep": dict(p1=args.p1, p2=args.p2, approx=args.approx, mass=args.mass,
                            **(dict(budget=args.budget) if args.approx == "sample" else {})),
            "cluster_topk": dict(clusters=args.clusters)}[args.estimator]
    from .model import load_model

    xp = array_namespace(args.xp)
    weights = load_model()
    if xp is not np:
        weights = weights.to(xp)
    tokens = load_tokens(args.play, args.tokens)
    t0 = time.perf_counter()
    prefix = forward(weights, tokens, pairing=args.pairing, keep_kv=True, xp=xp)
    synchronize(xp)
    t_fwd = time.perf_counter() - t0
    full = None
    if args.full_ppl:
        full = math.exp(float(token_losses(weights, prefix.hidden[:-1], tokens[1:],
                                           xp=xp).mean()))
    res = evaluate(args.play, estimator=args.estimator, seeds=args.seeds, weights=weights,
                   tokens=tokens, prefix=prefix, first=args.first, stride=args.stride,
                   pairing=args.pairing,
                   cache_bytes=None if args.cache_mb is None else args.cache_mb << 20,
                   xp=xp, **opts)
    res.seconds_prefix += t_fwd
    _print(res, full)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(asdict(res), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
