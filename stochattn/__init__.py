"""stochattn: fast approximate attention for long-context LLM decoding.

Layout everywhere: q (B, Hq, D); k, v (B, Hkv, N, D); seq_lens (B,). See docs/conventions.md.

Estimators: :func:`exact_attention`, :func:`santa_attention` (SANTA / S²ANTA),
:func:`bernoulli_scores` (Bernoulli qK^T), :func:`build_doublep_index` and
:func:`doublep_attention` (Double-P); baselines :func:`topk_attention`,
:func:`quest_attention`, :func:`top_p_attention`, :func:`cluster_topk_attention`.
NumPy arrays run the reference (``stochattn.reference``), GPU arrays the CUDA kernels
(``stochattn.cuda``), which this import does not load.

Each function has a plan class (:class:`SantaPlan`, :class:`ExactPlan`, ...): options and
device checked once, then ``plan.run(q, k, v, ...)``; the functions are thin wrappers over
cached plans (docs/plans.md).
"""

from ._plan import Plan, clear_plan_cache
from .baselines import QuestPlan, TopKPlan, TopPPlan, quest_attention, top_p_attention, topk_attention
from .bernoulli import BernoulliPlan, bernoulli_scores
from .diagnostics import Diagnostics
from .doublep import (ClusterTopKPlan, DoublePIndex, DoublePPlan, build_doublep_index,
                      cluster_topk_attention, doublep_attention)
from .exact import ExactPlan, exact_attention
from .paged import PagedKV, paged_kv
from .santa import SantaPlan, santa_attention
from .value_norms import append_value_sqnorms, value_sqnorms

__version__ = "0.1.0.dev0"

__all__ = [
    "BernoulliPlan",
    "ClusterTopKPlan",
    "Diagnostics",
    "DoublePPlan",
    "ExactPlan",
    "PagedKV",
    "Plan",
    "QuestPlan",
    "SantaPlan",
    "TopKPlan",
    "TopPPlan",
    "clear_plan_cache",
    "DoublePIndex",
    "bernoulli_scores",
    "build_doublep_index",
    "cluster_topk_attention",
    "doublep_attention",
    "exact_attention",
    "paged_kv",
    "quest_attention",
    "santa_attention",
    "top_p_attention",
    "topk_attention",
    "value_sqnorms",
    "append_value_sqnorms",
]
