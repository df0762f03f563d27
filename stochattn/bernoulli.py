"""Bernoulli qK^T: unbiased attention scores from a random subset of the key features."""

from __future__ import annotations

import numpy as np

from . import _validation as val
from ._backend import backend_of, host_floats, host_ints, in_callers_framework, require_cupy
from .diagnostics import Diagnostics
from .reference import bernoulli as _ref
from .reference.common import finish, lengths

__all__ = ["bernoulli_scores"]


def bernoulli_scores(q, k, seq_lens=None, *, draws=4, group_shared=False, seed=0, offset=0,
                     check_finite=False, return_diagnostics=False):
    """Unbiased estimate of the unscaled scores q . k that reads only some key features.

    Per query head, with alpha = max_j |q_j| and p_j = |q_j| / alpha, each of ``draws``
    independent draws keeps feature j with probability p_j, and

        s_hat = (1 / draws) sum_i sum_{j kept by draw i} (q_j / p_j) k_j
              = (alpha / draws) sum_i t_i . k,      t_ij = sign(q_j) Bernoulli(p_j),

    so E[s_hat] = q . k exactly, with Var(s_hat_n) = (1 / draws) sum_j k_nj^2 q_j^2
    (1 - p_j) / p_j. The largest feature (p_j = 1) is always read; zero features never.
    With ``group_shared=True`` (mean group query) the query heads of a GQA group share one
    feature pattern drawn from their mean |q| (p_j = mean_h |q_hj| / max_j of it), and
    each head weights the drawn features by q_hj / p_j, so every head stays unbiased and
    the group reads one set of features.

    Two caveats, stated plainly:

    - The scores are unbiased, but ``softmax(scale * s_hat)`` is NOT an unbiased estimate
      of the softmax weights (nor is the attention output built from them): softmax is
      not linear in the scores, so by Jensen's inequality zero-mean noise in the scores
      shifts the expected weights, the more so the larger ``scale**2 * Var(s_hat)``.
    - Reading fewer features saves memory bandwidth only if each skipped feature is a
      whole memory sector, which calls for a feature-major K layout (features of many
      tokens contiguous); with the usual token-major layout a 64- to 128-feature row is
      one or two sectors and nothing is saved. Whether it pays is for the GPU benchmark
      to decide; this function only estimates the scores and reports what it would read.

    Parameters
    ----------
    q : array, shape (B, Hq, D)
        One query per sequence and query head; float16, float32 or float64.
    k : array, shape (B, Hkv, N, D)
        Key cache, dtype of ``q``; query head h reads KV head ``h // (Hq // Hkv)``.
    seq_lens : integer array, shape (B,), optional
        Sequence b uses ``k[b, :, :seq_lens[b]]``; default: all N tokens.
    draws : int
        Number of Bernoulli draws per head, >= 1. More draws: lower variance, more
        features read.
    group_shared : bool
        Share one feature pattern per KV head across its GQA group (mean group query)
        instead of drawing one per query head.
    seed : int
        Seed in [0, 2**64) of the counter-based generator; same seed, same output.
    offset : int
        Per-call counter in [0, 2**32) (decode step, layer): different offsets give
        independent draws.
    check_finite : bool
        Check that q and k hold no NaN or inf (reads the data; off by default).
    return_diagnostics : bool
        Also return a :class:`~stochattn.Diagnostics`.

    Returns
    -------
    s_hat : array, shape (B, Hq, N), dtype of ``q``
        Unbiased estimate of ``q[b, h] . k[b, h // G, j]`` for ``j < seq_lens[b]``
        (computed in float64, then cast), and ``-inf`` for ``j >= seq_lens[b]``, so that
        ``softmax(scale * s_hat)`` is the estimated attention. The scores are not scaled:
        with float16 inputs, an |s_hat| above 65504 becomes inf, as it would in a float16
        matmul.
    diagnostics : Diagnostics, only when ``return_diagnostics``
        ``k_feature_fraction`` (B, Hq): fraction of the D key features read (kept by some
        draw; the group's pattern for every head when ``group_shared``, 0 for an all-zero
        q); ``k_rows_read`` (B, Hkv): ``seq_lens`` (every row is touched, in part);
        ``v_rows_read``: 0 (no value stage).

    Notes
    -----
    Random stream: ``u_ij = uniforms(seed, offset, PURPOSE_BERNOULLI, row, 0, i * D + j)``
    with ``row = b * Hq + h``, or ``b * Hkv + h // G`` when ``group_shared`` (see
    ``docs/rng.md``); feature j is kept by draw i when ``u_ij < p_j``. The uniforms are odd
    multiples of 2**-24, so the inclusion probability is p_j to within 2**-24 (a bias of
    at most ``alpha * 2**-24 * |k_j|`` per feature, below float32 rounding).

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.bernoulli import bernoulli_scores
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 100, 64))
    >>> s_hat, diag = bernoulli_scores(q, k, draws=4, seed=1, return_diagnostics=True)
    >>> s_hat.shape, diag.k_feature_fraction.shape
    ((1, 4, 100), (1, 4))
    """
    backend = backend_of(q=q, k=k)
    if backend == "cuda":
        return _bernoulli_cuda(q, k, seq_lens, draws, group_shared, seed, offset, check_finite,
                               return_diagnostics)
    backend_of(q=q, k=k, seq_lens=seq_lens)  # host seq_lens only, for the reference
    shape = val.check_score_inputs(q, k, seq_lens)
    draws = val.check_budget("draws", draws)
    group_shared = val.check_bool("group_shared", group_shared)
    seed, offset = val.check_seed_offset(seed, offset)
    if check_finite:
        val.check_finite(q=q, k=k)
    lens = lengths(seq_lens, shape.batch, shape.tokens)
    s_hat, fraction = _ref.estimate_scores(q, k, lens, draws=draws, group_shared=group_shared,
                                           seed=seed, offset=offset)
    out = finish(s_hat, q.dtype)
    if not return_diagnostics:
        return out
    rows = np.repeat(lens[:, None], shape.kv_heads, axis=1)
    diag = Diagnostics(seq_lens=lens, k_rows_read=rows, v_rows_read=np.zeros_like(rows),
                       k_feature_fraction=fraction)
    return out, diag


@in_callers_framework()
def _bernoulli_cuda(q, k, seq_lens, draws, group_shared, seed, offset, check_finite,
                    return_diagnostics):
    """GPU arrays: stochattn.cuda.bernoulli (token-major K, pieces of unkept features skipped)."""
    require_cupy("bernoulli_scores")
    from .cuda.bernoulli import bernoulli_scores_gpu

    if check_finite:
        val.check_finite(q=q, k=k)
    out, frac = bernoulli_scores_gpu(q, k, seq_lens, draws=draws, group_shared=group_shared,
                                     seed=seed, offset=offset, check_seq_lens=check_finite)
    if not return_diagnostics:
        return out
    B, Hkv, N = int(k.shape[0]), int(k.shape[1]), int(k.shape[2])
    lens = np.full(B, N, dtype=np.int64) if seq_lens is None else host_ints(seq_lens)
    rows = np.repeat(lens[:, None], Hkv, axis=1)
    return out, Diagnostics(seq_lens=lens, k_rows_read=rows, v_rows_read=np.zeros_like(rows),
                            k_feature_fraction=host_floats(frac))
