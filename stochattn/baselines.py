"""Selection baselines (docs/estimators.md): oracle top-k, Quest, oracle token top-p.

Each selects a set of tokens per query head and attends exactly over it, renormalised.
They exist so that every accuracy and speed table has its comparison; the oracle methods
read every key (they rank exact logits), Quest reads only its pages' keys plus the page
metadata.
"""

from __future__ import annotations

import numpy as np

from . import _validation as val
from ._backend import backend_of
from ._plan import AttentionPlan, cached_plan, device_of, no_call_arguments, renamed
from .diagnostics import Diagnostics
from .reference import baselines as _ref
from .reference.common import finish, lengths, union_rows_per_kv_head

__all__ = ["QuestPlan", "TopKPlan", "TopPPlan", "quest_attention", "top_p_attention",
           "topk_attention"]


def _diagnostics(shape, lens, mask, x, k_rows_read=None) -> Diagnostics:
    """Diagnostics of a selection: rows read per KV head (union over the GQA group)."""
    v_rows = union_rows_per_kv_head(mask, shape.kv_heads)
    if k_rows_read is None:  # oracle selection: every key is read to rank the logits
        k_rows_read = np.repeat(lens[:, None], shape.kv_heads, axis=1)
    return Diagnostics(
        seq_lens=lens,
        k_rows_read=k_rows_read,
        v_rows_read=v_rows,
        tokens_exact=mask.sum(axis=-1).astype(np.int64),
        true_mass=_ref.selected_mass(x, mask),
    )


class _SelectionPlan(AttentionPlan):
    """What the three selection baselines share: reference only, exact attention over a
    selected set, the same diagnostics. Subclasses set ``function`` and ``kernel`` and
    implement ``_select``."""

    kernel = ""  # the GPU kernel this baseline lacks, for the refusal


    def _cuda_missing(self) -> list[str]:
        return [self.kernel]

    def _run(self, backend, q, k, v, seq_lens, diagnose, call):
        no_call_arguments(call)
        backend_of(q=q, k=k, v=v, seq_lens=seq_lens)  # host seq_lens only, for the reference
        shape = val.check_attention_inputs(q, k, v, seq_lens)
        scale = val.check_scale(self.softmax_scale, shape.head_dim)
        if self.check_finite:
            val.check_finite(q=q, k=k, v=v)
        lens = lengths(seq_lens, shape.batch, shape.tokens)
        out, x, mask, k_rows = self._select(q, k, v, lens, scale, shape)
        out = finish(out, q.dtype)
        if not diagnose:
            return out
        return out, _diagnostics(shape, lens, mask, x, k_rows_read=k_rows)


class TopKPlan(_SelectionPlan):
    """A plan of :func:`topk_attention` (``k_tokens``, ``softmax_scale``, ``check_finite``
    as there; ``device`` and the sizes as in :class:`~stochattn.SantaPlan`). Reference only:
    ``device="cuda"`` is refused with the reason."""

    function = "topk_attention"
    kernel = "the oracle top-k decode kernel"

    def __init__(self, *, k_tokens, **common):
        self.k_tokens = val.check_budget("k_tokens", k_tokens)
        super().__init__(**common)

    def options(self) -> dict:
        return dict(k_tokens=self.k_tokens, **super().options())

    def _select(self, q, k, v, lens, scale, shape):
        return (*_ref.topk_attention(q, k, v, lens, scale, self.k_tokens), None)


class QuestPlan(_SelectionPlan):
    """A plan of :func:`quest_attention` (``k_tokens``, ``page_size``, ``softmax_scale``,
    ``check_finite`` as there). Reference only."""

    function = "quest_attention"
    kernel = "the Quest page-selection kernel"

    def __init__(self, *, k_tokens, page_size=16, **common):
        self.k_tokens = val.check_budget("k_tokens", k_tokens)
        self.page_size = val.check_positive_int("page_size", page_size)
        super().__init__(**common)

    def options(self) -> dict:
        return dict(k_tokens=self.k_tokens, page_size=self.page_size, **super().options())

    def _select(self, q, k, v, lens, scale, shape):
        out, x, mask = _ref.quest_attention(q, k, v, lens, scale, self.k_tokens, self.page_size)
        return out, x, mask, union_rows_per_kv_head(mask, shape.kv_heads)


class TopPPlan(_SelectionPlan):
    """A plan of :func:`top_p_attention` (``p``, ``softmax_scale``, ``check_finite`` as
    there). Reference only."""

    function = "top_p_attention"
    kernel = "the oracle top-p decode kernel"

    def __init__(self, *, p, **common):
        self.p = val.check_probability("p", p)
        super().__init__(**common)

    def options(self) -> dict:
        return dict(p=self.p, **super().options())

    def _select(self, q, k, v, lens, scale, shape):
        return (*_ref.top_p_attention(q, k, v, lens, scale, self.p), None)


def topk_attention(q, k, v=None, seq_lens=None, *, k_tokens, softmax_scale=None, check_finite=False,
                   return_diagnostics=False):
    """Oracle top-k attention: exact attention over the ``k_tokens`` largest logits.

    Per query head, the ``k_tokens`` tokens with the largest exact logits (ties go to the
    lower position) are kept and the softmax is renormalised over them; a sequence of at
    most ``k_tokens`` tokens gives exact attention. "Oracle" because the selection needs
    every exact logit, so all K rows are read; it bounds what any token-level top-k method
    can achieve at that V budget.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, D)
        One query per sequence and query head; float16, float32 or float64.
    k, v : ndarray, shape (B, Hkv, N, D)
        Key and value caches, dtype of ``q``; query head h reads KV head ``h // (Hq // Hkv)``.
    seq_lens : integer ndarray, shape (B,), optional
        Sequence b uses ``k[b, :, :seq_lens[b]]``; default: all N tokens. A sequence of
        length 0 yields a zero output row.
    k_tokens : int
        Tokens kept per query head, >= 1.
    softmax_scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    check_finite : bool
        Check that q, k, v hold no NaN or inf (reads the data; off by default).
    return_diagnostics : bool
        Also return a :class:`~stochattn.Diagnostics`: ``k_rows_read`` = sequence length
        (every key is scored), ``v_rows_read`` = V rows kept by any head of the GQA group,
        ``tokens_exact`` (B, Hq) = tokens kept, ``true_mass`` (B, Hq) = their exact mass.

    Returns
    -------
    out : ndarray, shape (B, Hq, D), dtype of ``q``
    diagnostics : Diagnostics, only when ``return_diagnostics``

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.baselines import topk_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 100, 64))
    >>> out, diag = topk_attention(q, k, k, k_tokens=16, return_diagnostics=True)
    >>> out.shape, diag.tokens_exact.tolist()
    ((1, 4, 64), [[16, 16, 16, 16]])
    """
    plan = cached_plan(TopKPlan, device_of(q=q, k=k, v=v), k_tokens=k_tokens,
                       softmax_scale=softmax_scale, check_finite=check_finite)
    return plan.dispatch(q, k, v, seq_lens, val.check_bool("return_diagnostics", return_diagnostics), {})


def quest_attention(q, k, v=None, seq_lens=None, *, k_tokens=None, page_size=16, softmax_scale=None,
                    check_finite=False, return_diagnostics=False, budget=None):
    """Quest: exact attention over the pages with the largest logit upper bound.

    The cache is cut into pages of ``page_size`` tokens (the last one partial). Each page
    keeps the per-dimension minimum ``mn`` and maximum ``mx`` of its keys, and a query
    bounds every logit of the page by ``scale * sum_d max(q_d mn_d, q_d mx_d)``. Per query
    head, the ``ceil(k_tokens / page_size)`` pages with the largest bound (ties go to the
    lower page) are kept and attended exactly, renormalised. Pages are shared by the GQA
    group; the selection is per query head. A ``k_tokens`` of at least the sequence length gives
    exact attention.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, D)
        One query per sequence and query head; float16, float32 or float64.
    k, v : ndarray, shape (B, Hkv, N, D)
        Key and value caches, dtype of ``q``; query head h reads KV head ``h // (Hq // Hkv)``.
    seq_lens : integer ndarray, shape (B,), optional
        Sequence b uses ``k[b, :, :seq_lens[b]]``; default: all N tokens. A sequence of
        length 0 yields a zero output row.
    k_tokens : int
        Token budget per query head, >= 1; rounded up to whole pages. (Formerly
        ``budget``, still accepted with a DeprecationWarning: every token-selection
        baseline counts tokens in ``k_tokens``, while ``budget`` counts samples.)
    page_size : int
        Tokens per page, >= 1 (Quest uses 16).
    softmax_scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    check_finite : bool
        Check that q, k, v hold no NaN or inf (reads the data; off by default).
    return_diagnostics : bool
        Also return a :class:`~stochattn.Diagnostics`: ``k_rows_read`` and ``v_rows_read``
        = rows of the pages kept by any head of the GQA group (the page metadata, two rows
        of D per page, ``2 * ceil(seq_len / page_size)`` rows per KV head, is read too and
        is not counted there), ``tokens_exact`` (B, Hq) = tokens kept, ``true_mass``
        (B, Hq) = their exact mass.

    Returns
    -------
    out : ndarray, shape (B, Hq, D), dtype of ``q``
    diagnostics : Diagnostics, only when ``return_diagnostics``

    Notes
    -----
    Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
    ICML 2024. The metadata is computed here from the cache on every call; a serving
    system keeps it up to date at prefill and append time.

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.baselines import quest_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 100, 64))
    >>> out, diag = quest_attention(q, k, k, k_tokens=32, return_diagnostics=True)
    >>> out.shape, diag.tokens_exact.tolist()
    ((1, 4, 64), [[32, 32, 32, 32]])
    """
    if budget is not None:  # the old name of `k_tokens`
        k_tokens = renamed("quest_attention", {"budget": budget}, {"budget": "k_tokens"},
                           {"k_tokens": k_tokens}, {"budget": val.check_budget})["k_tokens"]
    if k_tokens is None:
        raise TypeError("quest_attention() missing required keyword argument: 'k_tokens'")
    plan = cached_plan(QuestPlan, device_of(q=q, k=k, v=v), k_tokens=k_tokens,
                       page_size=page_size, softmax_scale=softmax_scale, check_finite=check_finite)
    return plan.dispatch(q, k, v, seq_lens, val.check_bool("return_diagnostics", return_diagnostics), {})


def top_p_attention(q, k, v=None, seq_lens=None, *, p, softmax_scale=None, check_finite=False,
                    return_diagnostics=False):
    """Oracle token top-p (Twilight-like): the fewest tokens that hold a fraction p of the mass.

    Per query head, tokens are ranked by exact softmax weight (ties go to the lower
    position) and the shortest prefix whose cumulative weight reaches ``p`` times the total
    is kept and attended exactly, renormalised. The cumulative weight is
    ``np.cumsum`` of the weights in that order, compared with ``p`` times its last entry;
    ``p == 1`` keeps every token. All K rows are read (the selection needs every logit).

    Parameters
    ----------
    q : ndarray, shape (B, Hq, D)
        One query per sequence and query head; float16, float32 or float64.
    k, v : ndarray, shape (B, Hkv, N, D)
        Key and value caches, dtype of ``q``; query head h reads KV head ``h // (Hq // Hkv)``.
    seq_lens : integer ndarray, shape (B,), optional
        Sequence b uses ``k[b, :, :seq_lens[b]]``; default: all N tokens. A sequence of
        length 0 yields a zero output row.
    p : float
        Mass fraction to keep, in (0, 1].
    softmax_scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    check_finite : bool
        Check that q, k, v hold no NaN or inf (reads the data; off by default).
    return_diagnostics : bool
        Also return a :class:`~stochattn.Diagnostics`: ``k_rows_read`` = sequence length,
        ``v_rows_read`` = V rows kept by any head of the GQA group, ``tokens_exact``
        (B, Hq) = tokens kept, ``true_mass`` (B, Hq) = their exact mass (>= p up to
        rounding).

    Returns
    -------
    out : ndarray, shape (B, Hq, D), dtype of ``q``
    diagnostics : Diagnostics, only when ``return_diagnostics``

    Notes
    -----
    Lin et al., "Twilight: Adaptive Attention Sparsity with Hierarchical Top-p Pruning",
    2025, select by top-p on estimated weights; this oracle uses the exact weights, so it
    is the best any top-p selection can do.

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.baselines import top_p_attention
    >>> rng = np.random.default_rng(0)
    >>> q = 4 * rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 100, 64))
    >>> out, diag = top_p_attention(q, k, k, p=0.9, return_diagnostics=True)
    >>> bool((diag.true_mass >= 0.9 - 1e-12).all())
    True
    """
    plan = cached_plan(TopPPlan, device_of(q=q, k=k, v=v), p=p, softmax_scale=softmax_scale,
                       check_finite=check_finite)
    return plan.dispatch(q, k, v, seq_lens, val.check_bool("return_diagnostics", return_diagnostics), {})
