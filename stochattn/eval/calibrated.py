"""Long-context decode inputs calibrated on SmolLM2's real attention (docs/generator.md).

:func:`make_calibrated_inputs` draws ``(q, k, v)`` for one decode step whose attention
statistics (keys for 50/90/95/99% of the mass, entropy, sink and window mass) match the
real traces of :mod:`stochattn.eval.llm.attention_stats`, at any context length up to 128k. The
model and its calibration are described in ``docs/generator.md``; the side-by-side table
comes from ``python -m stochattn.eval.compare_stats``.

The model, per (sequence, KV head), in logits at the default scale ``1 / sqrt(D)``
(keys are ``sqrt(D)`` times a "unit key", so ``scale * q . k = q . unit_key``):

- **Frame.** A random orthonormal frame: ``e_sink``, three age directions ``e_age``, and a
  (D - 4)-dim content subspace.
- **Content (clustered keys, topic runs).** ``n_centres`` = 256 topic centres (entries
  N(0, 1/(D-4)), about unit norm) in the content subspace; the cache is a sequence of topic
  runs of geometric length (mean ``run_length`` = 16 tokens) and a key's content part is
  its run's centre plus isotropic noise of the same size (``key_noise`` = 1): half of the
  content variance is shared by a run, so pages and clusters of keys mean something.
- **Recency (power laws in age).** Each key holds :func:`age_features` of its age (0 = the
  newest token): ``log(1 + age)``, ``log(1 + age / 64)`` and ``max(0, log((1 + age) /
  2048))`` along ``e_age``; a query head holds ``-(gamma1, gamma2, gamma3)`` there, so a
  key's weight carries ``(1 + age)^-gamma1 (1 + age/64)^-gamma2`` and, beyond 2048 tokens
  of age, a further ``((1 + age) / 2048)^-gamma3``.
- **Sinks.** The first 4 tokens are ``e_sink`` plus a small content part (0.2 of the
  noise) and no age; a head's sink logit ``s`` is its query's component along ``e_sink``.
- **Query head.** ``q = beta u - gamma . e_age + s e_sink`` with ``u`` a random unit vector
  of the content subspace and ``beta = sigma * sqrt((D - 4) / (1 + key_noise^2))``, so the
  content logits of ordinary keys have standard deviation ``sigma``.

Per-head ``(sigma, gamma1, gamma2, gamma3, s)``: one row of a table fitted head by head to
SmolLM2's 270 (layer, head) pairs on two plays at 2048 tokens, ``gamma3`` per (layer, head)
on hamlet at 8192 tokens (``stochattn/eval/calibrated_smollm2.json``, made by ``python -m
stochattn.eval.compare_stats --fit``). The ``G`` query heads of a generated KV group take heads of
one real (play, layer), so the heads that share a cache are alike as in the model (e.g. no
sink in layers 0-11).

Scaling with context (the assumption, ``docs/generator.md``): the fitted power laws in age
continue unchanged to 128k, i.e. the key counts for a mass level keep growing as they do
from 2k to 8k in the real model (95%: x1.4 for x4 context, about N^0.25), neither constant
nor proportional to N.

Harder variant (``hardness="spread"``): the same model and heads with every query divided
by :data:`SPREAD_TEMPERATURE` = 1.4, i.e. all logits at temperature 1.4; mass spread wider
(95% in about 6% of the keys at 32k), for figures that must not depend on one generator's
shape (docs/generator.md).

Values: a key's topic value centre (entries N(0, 0.7^2)) plus unit Gaussian noise; sink
values scaled by 0.1 (sinks in real models have small values). All randomness comes from
``numpy.random.default_rng(seed)``; same seed, same arrays, on any machine with the same
NumPy.
"""

from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["HARDNESS", "PROFILES", "SPREAD_TEMPERATURE", "age_features", "make_calibrated_inputs",
           "head_parameters", "unit_logit_components"]

PROFILES = ("smollm2",)
HARDNESS = ("calibrated", "spread")
# "spread": every head of the fitted table at this logit temperature (all its logits, content,
# recency and sink, divided by it), chosen so that 95% of the mass sits in about 5% of the keys
# at 32k (docs/generator.md, "A second, harder generator").
SPREAD_TEMPERATURE = 1.4
N_SINK = 4
TAUS = (1.0, 64.0)
HORIZON = 2048


def age_features(age):
    """(N, 3) decay features of key ages: ``log(1 + age)``, ``log(1 + age / 64)``, and
    ``max(0, log((1 + age) / 2048))`` (zero inside the 2k context the first two are fitted
    on; its weight is fitted on the 2k -> 8k growth)."""
    age = np.asarray(age, dtype=np.float64)
    return np.stack([np.log1p(age / TAUS[0]), np.log1p(age / TAUS[1]),
                     np.maximum(0.0, np.log1p(age) - np.log(HORIZON))], axis=1)
_TABLE_PATH = os.path.join(os.path.dirname(__file__), "calibrated_smollm2.json")
_TABLE = {}


def _load_profile(profile):
    """Fitted per-head parameters: (rows, 5) [sigma, gamma1..3, s] and (rows,) group ids."""
    if profile not in PROFILES:
        raise ValueError(f"`profile`: expected one of {PROFILES}, got {profile!r}")
    if profile not in _TABLE:
        with open(_TABLE_PATH) as fh:
            d = json.load(fh)
        params = np.asarray(d["params"], dtype=np.float64)       # (rows, 5)
        groups = np.asarray(d["group"], dtype=np.int64)          # (rows,) real (play, layer)
        _TABLE[profile] = (params, groups)
    return _TABLE[profile]


def _topic_runs(rng, tokens, n_centres, run_length):
    """Topic id of each token: runs of geometric length (mean ``run_length``), vectorized."""
    parts, total = [], 0
    while total < tokens:
        n = int(tokens / run_length) + 16
        lengths = rng.geometric(1.0 / run_length, size=n)
        parts.append(lengths)
        total += int(lengths.sum())
    lengths = np.concatenate(parts)
    topics = rng.integers(n_centres, size=lengths.shape[0])
    return np.repeat(topics, lengths)[:tokens]


def _group_cache(rng, tokens, head_dim, *, n_centres, run_length, key_noise, dtype):
    """Unit keys (N, D), values (N, D) and the frame of one (sequence, KV head).

    Returns ``unit_keys, values, e_sink, e_age, content`` with ``content`` (D, D - 2) an
    orthonormal basis of the content subspace.
    """
    N, D = tokens, head_dim
    d = D - 4
    frame, _ = np.linalg.qr(rng.standard_normal((D, D)))
    e_sink, e_age, content = frame[:, 0], frame[:, 1:4], frame[:, 4:]
    centres = (rng.standard_normal((n_centres, d)) / np.sqrt(d)) @ content.T   # (C, D)
    z = _topic_runs(rng, N, n_centres, run_length)
    # Isotropic noise of the content subspace without a D x D product per key: draw in all
    # D dims, then remove the components along e_sink and e_age (a rank-2 projection).
    noise = rng.standard_normal((N, D), dtype=np.float32)
    noise *= np.float32(key_noise / np.sqrt(d))
    special = frame[:, :4].astype(np.float32)                                  # (D, 4)
    noise -= (noise @ special) @ special.T
    keys = centres.astype(np.float32)[z]
    keys += noise
    ns = min(N_SINK, N)
    keys[:ns] = 0.2 * noise[:ns] + e_sink.astype(np.float32)
    age = np.arange(N - 1, -1, -1, dtype=np.float64)                           # 0 = newest
    a = age_features(age)                                                      # (N, 3)
    a[:ns] = 0.0                                                               # sinks: no age
    keys += a.astype(np.float32) @ e_age.astype(np.float32).T
    values = rng.standard_normal((N, D), dtype=np.float32)
    values += (0.7 * rng.standard_normal((n_centres, D))).astype(np.float32)[z]
    values[:ns] *= np.float32(0.1)
    return keys, values, e_sink, e_age, content


def head_parameters(rng, n_groups, group_size, profile="smollm2"):
    """Per query head ``(sigma, gamma1, gamma2, gamma3, s)``, (n_groups, group_size, 5).

    Each KV group takes one real (play, layer) at random and its heads from that layer's
    heads (without replacement while there are enough).
    """
    params, groups = _load_profile(profile)
    ids = np.unique(groups)
    out = np.empty((n_groups, group_size, params.shape[1]))
    for g in range(n_groups):
        rows = np.flatnonzero(groups == ids[rng.integers(ids.shape[0])])
        pick = rng.choice(rows, size=group_size, replace=group_size > rows.shape[0])
        out[g] = params[pick]
    return out


def _queries(rng, params, e_sink, e_age, content, key_noise):
    """Queries (G, D) of one group for per-head params (G, 5) [sigma, gamma1..3, s]."""
    D, d = content.shape
    u = rng.standard_normal((params.shape[0], d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    beta = params[:, 0] * np.sqrt(d / (1.0 + key_noise ** 2))
    return ((beta[:, None] * u) @ content.T - params[:, 1:4] @ e_age.T
            + params[:, 4:5] * e_sink[None, :])


def make_calibrated_inputs(batch, q_heads, kv_heads, tokens, head_dim, *, seed,
                           dtype=np.float32, profile="smollm2", hardness="calibrated",
                           n_centres=256, run_length=16.0, key_noise=1.0):
    """One decode step whose attention statistics match a real model's: ``(q, k, v)``.

    Parameters
    ----------
    batch, q_heads, kv_heads, tokens, head_dim : int
        Shapes: q (batch, q_heads, head_dim); k, v (batch, kv_heads, tokens, head_dim).
        ``q_heads`` must be a multiple of ``kv_heads``; ``head_dim`` >= 4; ``tokens`` >= 1.
    seed : int
        Seed of ``numpy.random.default_rng``; same seed, same arrays.
    dtype : numpy dtype
        Output dtype (keys and values are generated in float32, queries in float64).
    profile : {"smollm2"}
        Which fitted per-head table to draw from.
    hardness : {"calibrated", "spread"}
        ``"calibrated"`` (the default): the fitted heads as they are. ``"spread"``: a
        second, harder generator for sparse methods, the same heads at logit temperature
        :data:`SPREAD_TEMPERATURE` = 1.4 (every query divided by it), so the mass is spread
        wider: 95% of it in a median of about 6% of the keys at 32k instead of about 1%
        (1.6% instead of 0.25% at 128k), and Double-P (0.95, 0.7) reads 15-22% of K rows
        at 32k, what it reads on real SmolLM2 attention at 2k-8k (docs/generator.md). Not
        fitted to real statistics: a pessimistic bound for sparse methods. Same seed, same
        keys and values as ``"calibrated"``; only the queries differ.
    n_centres, run_length, key_noise
        Topic model of the keys (module docstring); the fitted table assumes the defaults.

    Returns
    -------
    q : ndarray, shape (batch, q_heads, head_dim)
    k, v : ndarray, shape (batch, kv_heads, tokens, head_dim)

    Notes
    -----
    Logits use the default scale ``1 / sqrt(head_dim)``. About 1.5 s per (sequence, KV
    head) at 128k tokens and D = 128 on a shared 2-core CPU (12 s for batch 1, 8 KV heads,
    float16); the float32 noise draws dominate.

    Examples
    --------
    >>> q, k, v = make_calibrated_inputs(1, 8, 2, 2048, 64, seed=0)
    >>> q.shape, k.shape, k.dtype
    ((1, 8, 64), (1, 2, 2048, 64), dtype('float32'))
    """
    for name, val in (("batch", batch), ("q_heads", q_heads), ("kv_heads", kv_heads),
                      ("tokens", tokens)):
        if int(val) < 1:
            raise ValueError(f"`{name}` must be >= 1, got {val}")
    if q_heads % kv_heads:
        raise ValueError(f"`q_heads` must be a multiple of `kv_heads`, "
                         f"got {q_heads} and {kv_heads}")
    if head_dim < 4:
        raise ValueError(f"`head_dim` must be >= 4, got {head_dim}")
    if hardness not in HARDNESS:
        raise ValueError(f"`hardness`: expected one of {HARDNESS}, got {hardness!r}")
    temperature = SPREAD_TEMPERATURE if hardness == "spread" else 1.0
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, N, D = batch, q_heads, kv_heads, tokens, head_dim
    G = Hq // Hkv
    params = head_parameters(rng, B * Hkv, G, profile).reshape(B, Hkv, G, 5)
    q = np.empty((B, Hq, D), dtype=dtype)
    k = np.empty((B, Hkv, N, D), dtype=dtype)
    v = np.empty((B, Hkv, N, D), dtype=dtype)
    root = np.float32(np.sqrt(D))
    for b in range(B):
        for g in range(Hkv):
            keys, values, e_sink, e_age, content = _group_cache(
                rng, N, D, n_centres=n_centres, run_length=run_length, key_noise=key_noise,
                dtype=dtype)
            keys *= root          # scale * q . k = (1/sqrt(D)) q . (sqrt(D) unit) = q . unit
            k[b, g] = keys
            v[b, g] = values
            q[b, g * G:(g + 1) * G] = _queries(rng, params[b, g], e_sink, e_age, content,
                                               key_noise) / temperature
    return q, k, v


def unit_logit_components(tokens, head_dim, n_heads, *, seed, n_centres=256, run_length=16.0,
                          key_noise=1.0):
    """The three logit components of the model for ``n_heads`` random content directions.

    Returns ``content`` (n_heads, N): ``u . unit_key`` rescaled to unit standard deviation
    for ordinary keys (multiply by ``sigma``); ``age`` (3, N): minus :func:`age_features`
    (multiply by ``gamma1..3``); ``sink`` (N,): 1 on the sink tokens (multiply by ``s``).
    The logit of a head is ``sigma * content + gamma . age + s * sink``, up to float32
    rounding of the keys: what the fit of ``stochattn.eval.compare_stats`` simulates.
    """
    rng = np.random.default_rng(seed)
    keys, _, e_sink, e_age, content = _group_cache(
        rng, tokens, head_dim, n_centres=n_centres, run_length=run_length, key_noise=key_noise,
        dtype=np.float32)
    keys = keys.astype(np.float64)
    d = head_dim - 4
    u = rng.standard_normal((n_heads, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    c = (u @ content.T) @ keys.T * np.sqrt(d / (1.0 + key_noise ** 2))
    return c, -(keys @ e_age).T, keys @ e_sink
