"""SANTA / S²ANTA: unbiased sampled attention for the value stage of decoding."""

from __future__ import annotations

import numpy as np

from . import _validation as val
from ._backend import (backend_of, cuda_not_implemented, host_floats, host_ints,
                       in_callers_framework, require_cupy)
from .diagnostics import Diagnostics
from .reference import santa as _ref
from .reference.common import finish, lengths, union_rows_per_kv_head
from .reference.samplers import SAMPLERS

__all__ = ["santa_attention"]


def santa_attention(q, k, v, seq_lens=None, *, budget, sampler="systematic", schedule="prop",
                    tile_size=64, seed=0, offset=0, scores="exact", bernoulli_draws=4,
                    bernoulli_group_shared=False, softmax_scale=None, check_finite=False,
                    return_diagnostics=False):
    """Sampled decode attention: the mean of ``budget`` V rows drawn from the softmax.

    For every sequence b and query head h the output is an estimate of the exact attention
    output ``o = sum_j A_j v_j`` (A the softmax of ``softmax_scale * q . k_j`` over the
    sequence). With ``schedule="global"`` or ``"prop"`` it is ``(1/S) sum_m v_{J_m}``
    with S = ``budget`` indices J_m drawn from A by ``sampler``: no multiply after the
    softmax, only S V rows read. With ``scores="exact"`` every sampler and schedule is
    unbiased: the mean over seeds converges to o.

    Parameters
    ----------
    q : array, shape (B, Hq, D)
        One query per sequence and query head.
    k, v : array, shape (B, Hkv, N, D)
        Key and value caches; query head h reads KV head ``h // (Hq // Hkv)``.
    seq_lens : integer array, shape (B,), optional
        Sequence b uses ``k[b, :, :seq_lens[b]]``; default: all N tokens. A sequence of
        length 0 yields a zero output row.
    budget : int
        S, the number of sample points per query head (>= 1; may exceed the sequence
        length: tokens are then drawn more than once).
    sampler : {"systematic", "stratified", "iid"}
        How the S points in [0, 1) are drawn before inverting the CDF of A:
        ``"iid"`` independent uniforms (SANTA); ``"stratified"`` one uniform in each of
        the S strata [m/S, (m+1)/S) (variance never above iid); ``"systematic"`` one
        uniform u, points (u + m)/S (one random number; usually the lowest variance on
        real attention, but not always below iid).
    schedule : {"prop", "global", "flash"}
        How the CDF is split over tiles of ``tile_size`` tokens, as the GPU kernels do it.
        ``"global"``: one CDF over the whole sequence. ``"prop"``: two passes; the global
        points are assigned to the tiles by the tile masses and inverted tile-locally,
        which selects the same indices as ``"global"`` (up to rounding at CDF
        boundaries); tiles without points read no V. ``"flash"``: no global sync; each of
        the T_L tiles of the sequence draws ``ceil(S / T_L)`` points from its own local
        distribution and the tile means are merged with weights W_t / Z; unbiased, but
        samples drawn in low-mass tiles are wasted (see ``sample_waste``).
    tile_size : int
        Tokens per tile for ``"prop"`` and ``"flash"`` (>= 1); also the tiling of
        ``Diagnostics.samples_per_tile``.
    seed : int
        Seed of the counter-based generator, in [0, 2**64). Same seed and offset, same
        output bit for bit.
    offset : int
        Per-call counter (decode step, layer), in [0, 2**32): a new offset gives new draws.
    scores : {"exact", "bernoulli"}
        Score stage. ``"exact"``: exact logits. ``"bernoulli"``: logits from the unbiased
        Bernoulli estimate of q . k that reads only some key features (SPEC section 2).
        The score estimate is unbiased, but the softmax of an unbiased score is **not**
        an unbiased softmax (exp is convex and the normaliser is random), so with
        ``"bernoulli"`` the output is a biased estimate of o.
    bernoulli_draws : int
        Number of Bernoulli draws of the ternary query (>= 1); only with ``"bernoulli"``.
    bernoulli_group_shared : bool
        One feature pattern per KV head from the GQA group's mean |q| ("mean group
        query") instead of one per query head; only with ``"bernoulli"``.
    softmax_scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    check_finite : bool
        Check that q, k, v hold no NaN or inf (reads the data; off by default).
    return_diagnostics : bool
        Also return a :class:`~stochattn.Diagnostics` with ``k_rows_read`` (the sequence
        length), ``v_rows_read`` (distinct sampled rows, union over each GQA group),
        ``samples_per_tile`` (B, Hq, ceil(N / tile_size)), ``sample_waste`` (0 except for
        ``"flash"``), ``true_mass`` (exact softmax mass of the sampled rows) and, with
        ``"bernoulli"``, ``k_feature_fraction``.

    Returns
    -------
    out : array, shape (B, Hq, D), dtype of ``q``
    diagnostics : Diagnostics, only when ``return_diagnostics``

    Raises
    ------
    ValueError
        Bad shapes, seq_lens out of [0, N], budget or tile_size < 1, unknown sampler,
        schedule or scores, seed or offset out of range.
    TypeError
        Unsupported dtypes or argument types.

    Notes
    -----
    The reference computes in float64 with max-shifted exponentials, so logits of
    magnitude 1e4 and float16 inputs do not overflow. Random draws use the Philox stream
    of ``docs/rng.md`` (purpose 0: value sampler; the flash schedule uses stream = tile).

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.santa import santa_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 1000, 64))
    >>> v = rng.standard_normal((1, 2, 1000, 64))
    >>> out, diag = santa_attention(q, k, v, budget=32, seed=7, return_diagnostics=True)
    >>> out.shape, bool((diag.v_rows_read <= 64).all())
    ((1, 4, 64), True)
    """
    backend = backend_of(q=q, k=k, v=v)
    if backend == "cuda":
        return _santa_cuda(q, k, v, seq_lens, budget, sampler, schedule, tile_size, seed, offset,
                           scores, bernoulli_draws, bernoulli_group_shared, softmax_scale,
                           check_finite, return_diagnostics)
    backend_of(q=q, k=k, v=v, seq_lens=seq_lens)  # host seq_lens only, for the reference
    shape = val.check_attention_inputs(q, k, v, seq_lens)
    S = val.check_budget("budget", budget)
    val.check_choice("sampler", sampler, SAMPLERS)
    val.check_choice("schedule", schedule, _ref.SCHEDULES)
    val.check_choice("scores", scores, _ref.SCORES)
    tile_size = val.check_positive_int("tile_size", tile_size)
    seed, offset = val.check_seed_offset(seed, offset)
    draws = val.check_positive_int("bernoulli_draws", bernoulli_draws)
    group_shared = val.check_bool("bernoulli_group_shared", bernoulli_group_shared)
    scale = val.check_scale(softmax_scale, shape.head_dim)
    if check_finite:
        val.check_finite(q=q, k=k, v=v)

    res = _ref.santa_attention(q, k, v, seq_lens, scale, budget=S, sampler=sampler,
                               schedule=schedule, tile_size=tile_size, seed=seed, offset=offset,
                               scores=scores, bernoulli_draws=draws,
                               bernoulli_group_shared=group_shared)
    out = finish(res.out, q.dtype)
    if not return_diagnostics:
        return out
    lens = lengths(seq_lens, shape.batch, shape.tokens)
    diag = Diagnostics(
        seq_lens=lens,
        # The score stage reads every K row of the sequence (Bernoulli: some features).
        k_rows_read=np.repeat(lens[:, None], shape.kv_heads, axis=1),
        v_rows_read=union_rows_per_kv_head(res.read, shape.kv_heads),
        samples_per_tile=res.samples_per_tile,
        sample_waste=res.sample_waste,
        k_feature_fraction=res.k_feature_fraction,
        true_mass=res.true_mass,
    )
    return out, diag


@in_callers_framework()
def _santa_cuda(q, k, v, seq_lens, budget, sampler, schedule, tile_size, seed, offset, scores,
                draws, group_shared, softmax_scale, check_finite, return_diagnostics):
    """GPU arrays: the S²ANTA-prop (exact or Bernoulli scores) and S²ANTA-flash kernels;
    other options say what is missing."""
    val.check_choice("schedule", schedule, _ref.SCHEDULES)
    val.check_choice("scores", scores, _ref.SCORES)
    if schedule == "global":
        raise cuda_not_implemented("santa_attention", "schedule='global'; the GPU has 'prop' and 'flash'")
    if scores != "exact" and schedule != "prop":
        raise cuda_not_implemented("santa_attention", "the Bernoulli score stage with "
                                   "schedule='flash'; it is on the GPU with schedule='prop'")
    require_cupy("santa_attention")
    if check_finite:
        val.check_finite(q=q, k=k, v=v)
    common = dict(budget=budget, sampler=sampler, tile_size=tile_size, seed=seed, offset=offset,
                  softmax_scale=softmax_scale, check_seq_lens=check_finite)
    if schedule == "prop":
        from .cuda import santa_prop

        bern = scores == "bernoulli"
        if bern:
            common.update(scores=scores, bernoulli_draws=draws, bernoulli_group_shared=group_shared,
                          return_feature_fraction=return_diagnostics)
        res = santa_prop(q, k, v, seq_lens, return_indices=return_diagnostics, **common)
        if not return_diagnostics:
            return res
        out, idx = res[0], res[1]
        extra = dict(k_feature_fraction=host_floats(res[2])) if bern else {}
    else:
        from .cuda import flash_diagnostics, santa_flash

        res = santa_flash(q, k, v, seq_lens, return_indices=return_diagnostics,
                          return_tile_stats=return_diagnostics, **common)
        if not return_diagnostics:
            return res
        out, idx, stats = res
        samples, waste = flash_diagnostics(stats, budget)
        extra = dict(samples_per_tile=samples, sample_waste=waste)
    # Diagnostics copy the sampled indices to the host (a synchronisation); flash pads its
    # per-tile index slots with -1.
    idx = host_ints(idx)
    B = idx.shape[0]
    Hkv, N = int(k.shape[1]), int(k.shape[2])
    lens = np.full(B, N, dtype=np.int64) if seq_lens is None else host_ints(seq_lens)
    groups = idx.reshape(B, Hkv, -1)  # the draws of every query head of a KV group
    v_rows = np.array([[np.unique(g[g >= 0]).size if lens[b] > 0 else 0
                        for g in groups[b]] for b in range(B)], dtype=np.int64)
    return out, Diagnostics(seq_lens=lens, k_rows_read=np.repeat(lens[:, None], Hkv, axis=1),
                            v_rows_read=v_rows, **extra)
