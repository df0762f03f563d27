"""Bernoulli qK^T: unbiased attention scores from a random subset of the key features."""

from __future__ import annotations

import numpy as np

from . import _validation as val
from ._backend import backend_of, host_floats, host_ints, in_callers_framework, require_cupy
from ._plan import Plan, advance, cached_plan, device_of, is_paged, renamed
from .diagnostics import Diagnostics
from .reference import bernoulli as _ref
from .reference.common import finish, lengths

__all__ = ["BernoulliPlan", "bernoulli_scores"]


class BernoulliPlan(Plan):
    """A plan of :func:`bernoulli_scores` (options as there; ``device``, ``q_heads``,
    ``kv_heads``, ``head_dim``, ``dtype`` as in :class:`~stochattn.SantaPlan`).

    Calls take ``q`` and ``k`` only: ``plan.run(q, k, seq_lens=None, *, seed=0, offset=0,
    out=None)`` returns the scores (B, Hq, N); ``plan.diagnose(...)`` returns ``(scores,
    Diagnostics)``. ``k`` may be a :class:`stochattn.paged.PagedKV` (``seq_lens`` left out;
    on the GPU read in place, N = its ``token_bound``). ``out``: the array the scores are
    written to (NumPy on the reference). On the GPU the call allocates its fp32 scores and
    the per-group features (a score estimate, not the serving path: S²ANTA-prop's
    Bernoulli score stage takes them from its workspace), so ``workspace=`` is refused.
    """

    function = "bernoulli_scores"
    needs_v = False

    def __init__(self, *, bernoulli_draws=4, bernoulli_group_shared=False, check_finite=False,
                 advance_offset=False, device="cpu", q_heads=None, kv_heads=None,
                 head_dim=None, dtype=None):
        self.bernoulli_draws = val.check_budget("bernoulli_draws", bernoulli_draws)
        self.bernoulli_group_shared = val.check_bool("bernoulli_group_shared",
                                                     bernoulli_group_shared)
        self.check_finite = val.check_bool("check_finite", check_finite)
        self.advance_offset = val.check_bool("advance_offset", advance_offset)
        super().__init__(device=device, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                         dtype=dtype)

    def options(self) -> dict:
        return dict(bernoulli_draws=self.bernoulli_draws,
                    bernoulli_group_shared=self.bernoulli_group_shared,
                    check_finite=self.check_finite, advance_offset=self.advance_offset)

    def run(self, q, k, seq_lens=None, **call):
        return self._call(q, k, None, seq_lens, False, call)

    def diagnose(self, q, k, seq_lens=None, **call):
        return self._call(q, k, None, seq_lens, True, call)

    def _paged_cuda_missing(self) -> list[str]:
        return []  # santa_prop_logits reads the pages in place

    def _run(self, backend, q, k, v, seq_lens, diagnose, call):
        given_ws = call.get("workspace") is not None
        out, _ = self._buffers(call)
        if given_ws and backend == "cuda":
            raise TypeError("`workspace`: bernoulli_scores takes none on the GPU (its call "
                            "allocates its fp32 scores; see BernoulliPlan)")
        seed, offset = self._streams(backend, q, call)
        if backend == "cuda":
            result = _bernoulli_cuda(q, k, seq_lens, self.bernoulli_draws,
                                     self.bernoulli_group_shared, seed, offset,
                                     self.check_finite, diagnose, out)
        else:
            result = _bernoulli_reference(q, k, seq_lens, self.bernoulli_draws,
                                          self.bernoulli_group_shared, seed, offset,
                                          self.check_finite, diagnose)
        if self.advance_offset:
            advance(offset)
        return result


def bernoulli_scores(q, k, seq_lens=None, *, bernoulli_draws=None, bernoulli_group_shared=None,
                     seed=0, offset=0, check_finite=False, return_diagnostics=False,
                     **deprecated):
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
    bernoulli_draws : int
        Number of Bernoulli draws per head, >= 1. More draws: lower variance, more
        features read. (Formerly ``draws``, still accepted with a DeprecationWarning.)
    bernoulli_group_shared : bool
        Share one feature pattern per KV head across its GQA group (mean group query)
        instead of drawing one per query head. (Formerly ``bernoulli_group_shared``.)
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
        draw; the group's pattern for every head when ``bernoulli_group_shared``, 0 for an all-zero
        q); ``k_rows_read`` (B, Hkv): ``seq_lens`` (every row is touched, in part);
        ``v_rows_read``: 0 (no value stage).

    Notes
    -----
    Random stream: ``u_ij = uniforms(seed, offset, PURPOSE_BERNOULLI, row, 0, i * D + j)``
    with ``row = b * Hq + h``, or ``b * Hkv + h // G`` when ``bernoulli_group_shared`` (see
    ``docs/rng.md``); feature j is kept by draw i when ``u_ij < p_j``. The uniforms are odd
    multiples of 2**-24, so the inclusion probability is p_j to within 2**-24 (a bias of
    at most ``alpha * 2**-24 * |k_j|`` per feature, below float32 rounding).

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.bernoulli import bernoulli_scores
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 100, 64))
    >>> s_hat, diag = bernoulli_scores(q, k, bernoulli_draws=4, seed=1,
    ...                               return_diagnostics=True)
    >>> s_hat.shape, diag.k_feature_fraction.shape
    ((1, 4, 100), (1, 4))
    """
    opts = dict(bernoulli_draws=bernoulli_draws, bernoulli_group_shared=bernoulli_group_shared)
    if deprecated:
        opts = renamed("bernoulli_scores", deprecated,
                       {"draws": "bernoulli_draws", "group_shared": "bernoulli_group_shared"}, opts,
                       {"draws": val.check_budget, "group_shared": val.check_bool})
    draws, shared = opts["bernoulli_draws"], opts["bernoulli_group_shared"]
    plan = cached_plan(BernoulliPlan, device_of(q=q, k=k),
                       bernoulli_draws=4 if draws is None else draws,
                       bernoulli_group_shared=False if shared is None else shared,
                       check_finite=check_finite)
    return plan.dispatch(q, k, None, seq_lens,
                         val.check_bool("return_diagnostics", return_diagnostics),
                         dict(seed=seed, offset=offset))


def _bernoulli_reference(q, k, seq_lens, draws, group_shared, seed, offset, check_finite,
                         return_diagnostics):
    backend_of(q=q, k=k, seq_lens=seq_lens)  # host seq_lens only, for the reference
    shape = val.check_score_inputs(q, k, seq_lens)
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
                    return_diagnostics, out=None):
    """GPU arrays: stochattn.cuda.bernoulli (token-major K, pieces of unkept features
    skipped; a GPU PagedKV read in place)."""
    require_cupy("bernoulli_scores")
    from .cuda.bernoulli import bernoulli_scores_gpu

    paged = is_paged(k)
    if check_finite:  # a paged cache's pools may hold anything in unused pages: not read
        val.check_finite(q=q) if paged else val.check_finite(q=q, k=k)
    out, frac = bernoulli_scores_gpu(q, k, seq_lens, draws=draws, group_shared=group_shared,
                                     seed=seed, offset=offset, check_seq_lens=check_finite,
                                     out=out)
    if not return_diagnostics:
        return out
    if paged:
        B, Hkv, N = k.batch, k.kv_heads, k.token_bound
        lens = np.clip(host_ints(k.seq_lens), 0, N)
    else:
        B, Hkv, N = int(k.shape[0]), int(k.shape[1]), int(k.shape[2])
        lens = np.full(B, N, dtype=np.int64) if seq_lens is None else host_ints(seq_lens)
    rows = np.repeat(lens[:, None], Hkv, axis=1)
    return out, Diagnostics(seq_lens=lens, k_rows_read=rows, v_rows_read=np.zeros_like(rows),
                            k_feature_fraction=host_floats(frac))
