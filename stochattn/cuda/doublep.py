"""Double-P decode and fixed top-k clusters on the GPU (doublep_decode.cu).

The public entry points are :func:`stochattn.doublep_attention` and
:func:`stochattn.cluster_topk_attention`, which validate their arguments and call
:func:`doublep_decode` for GPU arrays with a GPU index (built by
:func:`stochattn.build_doublep_index` from GPU arrays). One call is five launches on the
caller's current stream, with no host synchronisation (the kernel file's header says what
each does): cluster logits, the per-head selection (a mass histogram over logit bins and a
shared-memory sort of the boundary bins' clusters for C <= :data:`SORT_SELECT_MAX_CLUSTERS`,
else a radix select),
the row list of the tokens computed exactly, the attention over those tokens and the
approximated clusters (split-K), and the merge. Diagnostics
add one launch over the whole cache (the true mass needs every logit) and copy a few
arrays to the host.

K and V: a contiguous cache (B, Hkv, N, D), or a GPU :class:`~stochattn.paged.PagedKV`
(FlashInfer's layout, NHD or HND, page sizes 1 to 128) read in place through its page
table, with N its ``token_bound``. The index keeps token positions, so the same index
serves a paged cache whose pages move between calls. With a paged cache the lengths are
the index's clamped to the page table's (the index must describe the cache, as it must
equal ``seq_lens`` for a contiguous one). The sampled variant's CDF and V gather are the
S²ANTA-prop kernels ``santa_prop_tiles`` and ``santa_prop_sample``; they take the page
table where those kernels do (:func:`_sample_pages_missing` says why not otherwise), and
then their lengths come from the table: doublep_rows fills the logit stash with -inf up to
the table's length, so tokens the index does not cover yet are never drawn.

Workspace (scratch) of one call, in bytes, each piece rounded up to 256
(:func:`workspace_bytes` computes it for given arrays; ``rows = B Hq``, ``pairs = B Hkv``,
``cap = min(N, NL)`` with NL the index's label axis, ``slices = ceil(cap / 2048)``,
``T`` = token chunks (about two waves of attention CTAs: a function of the SM count,
``pairs`` and ``cap``; ``num_chunks`` when given), ``total = T + ceil(C / 1024)`` for
Double-P's centroid mode, ``T + 1`` for the sampled variant, ``T`` for top-k clusters)::

    4 rows C                      cluster logits
  + 8 pairs C                     selection codes
  + 4 rows total D + 8 rows total partial outputs and (max, sum) pairs
  + 5 pairs slices 2048 + 4 pairs slices    row lists, head masks, counts
  + 8 pairs slices 2048           paged caches only: the listed rows' byte offsets

and for the sampled variant (budget S, ``n_tiles = ceil(N / 64)``, ``n_pad = 64 n_tiles``)::

  + pairs slices 2048             sampled-head masks
  + 4 rows n_pad                  logit stash (the C_approx tokens' logits)
  + 4 B + 16 rows n_tiles         lengths, tile max / sum / prefix
  + 8 rows (S + 1) (iid; else 8) + 4 rows S    iid points, drawn rows

and with error-targeted budgets (``eps``; S = ``max_budget`` above, :func:`split_scratch_sizes`;
``chunks = ceil(N / 4096)``)::

  + 32 rows chunks               m2_A's chunk sums (num, den, max norm, count)
  + 64 rows + 8 rows D           the rows' split state, w_E o_E (float64)
  + 4 rows D + 8 rows            the pilot's fp32 mean and its (max, sum)
  + 4 rows pilot + 4 rows        the pilot's drawn rows (and the exact read's list), S0
  + 40 rows                      budget, capped, error bound, L^2, m2_A, variance bound

With ``out=`` and a workspace that holds this (a kept ``Workspace`` after a first call,
or a caller's uint8 array), a call allocates nothing, copies nothing to the host and does
not synchronise (so it can be captured in a CUDA graph, device offsets included). The
optional outputs may allocate: ``return_indices`` its (B, Hq, S) int64 array, and
``return_diagnostics`` its own scratch, the statistics and the true-mass launch's partials,
and it synchronises (host copies).

Cluster mass (issue 31): with ``mass="sub"`` (an index built with ``mass="sub"``) the first
launch is doublep_cluster_logits_sub, which reads each cluster's ``n_sub`` float32
sub-centroids and int32 sizes (``n_sub`` times the centroid bytes) and writes the
logsumexp mass in the same place; the other launches, the workspace and the diagnostics
are the paper mode's.

Differences from the float64 reference: logits, weights and sums are float32, so a cluster
whose cumulative estimated mass lies within float32 rounding of ``p1`` or ``p2`` (or whose
logit ties another's within rounding, for top-k) may be selected differently; the
estimated mass is summed in 40-bit fixed point (exact and order-independent, weights below
2^-40 of the largest count as 0, except that ``p = 1`` keeps every non-empty cluster as the
reference does).
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import NamedTuple

import numpy as np

from .. import _validation as val
from ..spec import PURPOSE_BUDGET_PILOT, PURPOSE_CLUSTER_SAMPLER, SAMPLERS
from . import kernels
from .kernels import abi
from .runtime import inputs, launch
from .runtime import workspace as _workspace
from .runtime.pages import PageArgs, page_args
from .runtime.arrays import ops_for, to_host
from .kernels import group_max
from .config import get_config
from .santa import _SAMPLE_THREADS, _TILE_LOGITS_PER_CTA, _TILE_THREADS, _TILES_VARIABLE, \
    _MOMENT_VARIABLE, MOMENT_FIELDS, PAGE_VARIABLE, SAMPLE_VARIABLE, moment_chunks, \
    sampler_code, sqnorms_args

__all__ = ["doublep_decode", "workspace_bytes", "split_scratch_sizes", "split_constants",
           "SplitBudgets", "SPLIT_NORMS_GPU", "SORT_SELECT_MAX_CLUSTERS"]

#: Largest cluster count whose selection sorts the keys in shared memory (8 bytes each);
#: above it the radix select runs. Read when a plan is made (tests set it to 0 to compare).
SORT_SELECT_MAX_CLUSTERS = 8192
_FAMILY = "doublep_decode"
# Block sizes and capacities the kernels were compiled for (doublep_decode.cu), read from
# the source.
_LOGIT_THREADS = abi.constant(_FAMILY, "kLogitThreads")
_SELECT_THREADS = abi.constant(_FAMILY, "kSelectThreads")
_SORT_THREADS = abi.constant(_FAMILY, "kSortThreads")
_SORT_MAX_CLUSTERS = abi.constant(_FAMILY, "kSortMaxClusters")
_ROW_THREADS = abi.constant(_FAMILY, "kRowThreads")
_SLICE_TOKENS = abi.constant(_FAMILY, "kSliceTokens")
_LIST_CAP = abi.constant(_FAMILY, "kListCap")
# The per-call arguments of the packed launches, in the order the calls pass them.
_LOGITS_VARIABLE = ("q", "centroids", "sizes", "xb")
_LOGITS_SUB_VARIABLE = ("q", "sub_centroids", "sub_sizes", "sizes", "xb")
_SELECT_VARIABLE = ("xb", "sizes", "lens", "window_start", "codes", "stats", "rows_read",
                    "n_sink", "p1", "p2", "counts", "count")
_PAGE_NAMES = PageArgs._fields  # the seven page-table arguments (kernels/kv_rows.cuh)
_ROWS_VARIABLE = (("lens", "window_start") + _PAGE_NAMES
                  + ("labels", "codes", "rows", "row_offs", "hmasks", "counts", "rows_read",
                     "n_sink", "amasks", "stash", "lens32"))
_ATTEND_VARIABLE = (("q", "k", "v") + _PAGE_NAMES
                    + ("rows", "row_offs", "hmasks", "counts", "codes", "xb", "sizes",
                       "value_sums", "out", "part_o", "part_ml", "amasks", "stash"))
_CLUSTERS_PER_LOGIT_CTA = 128
_CLUSTERS_PER_ATTEND_CTA = 1024
#: Sampling tile of the sampled variant's CDF (santa_prop_tiles / santa_prop_sample).
_SAMPLE_TILE = 64
_INDEX_FIELDS = (("centroids", "float32", 4), ("sizes", "int64", 3), ("value_sums", "float32", 4),
                 ("labels", "int32", 3), ("seq_lens", "int64", 1), ("window_start", "int64", 1))
# mass="sub" (issue 31): the sub-centroids doublep_cluster_logits_sub reads instead.
_SUB_FIELDS = (("sub_centroids", "float32", 5), ("sub_sizes", "int32", 4))
MASSES = ("paper", "sub")


def doublep_decode(q, k, v, index, *, p1=1.0, p2=1.0, clusters=None, budget=None,
                   sampler="systematic", seed=0, offset=0, softmax_scale=None,
                   return_diagnostics=False, return_indices=False, num_chunks=None, out=None,
                   workspace=None, mass="paper", eps=None, delta=None, max_budget=None,
                   budget_rule="chebyshev", budget_norm="pilot", pilot=64, pilot_share=0.25,
                   v_sqnorms=None, return_budgets=False):
    """One decode step of Double-P (centroid approximation, or with ``budget`` the sampled
    variant) or, with ``clusters``, of fixed top-k clusters, on the GPU.

    Parameters
    ----------
    q : GPU array, shape (B, Hq, D), float16 or bfloat16
    k, v : GPU array, shape (B, Hkv, N, D), dtype of ``q``
        Or ``k`` a GPU :class:`~stochattn.paged.PagedKV` and ``v`` None: the pages are read
        in place through the page table (N: its ``token_bound``).
    index : stochattn.doublep.DoublePIndex
        A GPU index of this cache (same device); its ``seq_lens`` and ``window_start`` are
        the lengths used (clamped to N and to the label axis, and with a paged cache to
        the page table's lengths, so nothing past a sequence's pages is read).
    p1, p2 : float in (0, 1]
        Stage 1 and stage 2 thresholds (ignored with ``clusters``).
    clusters : int, optional
        Fixed top-k clusters: keep this many clusters per head, all exact.
    budget : int, optional
        The sampled variant (``approx="sample"``): ``budget`` draws per query head over the
        exact weights of the C_approx tokens (in ascending position), as the reference.
    sampler, seed, offset
        The sampled variant's sampler and random stream (purpose PURPOSE_CLUSTER_SAMPLER).
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    return_diagnostics : bool
        Also return a dict of NumPy arrays (a host synchronisation): clusters_selected,
        clusters_exact, tokens_exact, estimated_mass, true_mass (B, Hq) and
        k_rows_read, v_rows_read (B, Hkv).
    return_indices : bool
        With ``budget``: also return the drawn rows (B, Hq, budget) int64, -1 for a head
        without C_approx tokens (it draws nothing). With ``eps``: the main draws (B, Hq,
        max_budget), a row's S indices then -1, and the pilot's (B, Hq, pilot), -1 past a
        row's pilot (None under ``budget_norm="bound"``, which draws none).
    eps, delta, max_budget, budget_rule, budget_norm, pilot, pilot_share : optional
        Error-targeted budgets of the sampled variant (``budget`` None), as
        :func:`stochattn.reference.split_budgets.choose_split_budgets` chooses them, on the
        device (no host synchronisation): ``budget_norm`` "pilot", "bound" or "auto"
        (:data:`SPLIT_NORMS_GPU`; "student" is the reference's only for now). A row with S
        draws the points of a fixed-budget call with S, and its output is that call's.
    v_sqnorms : GPU array of float32, required with ``eps``
        ||v_j||^2 beside the cache (:func:`stochattn.value_norms.value_sqnorms`): (B, Hkv, N)
        for a contiguous cache, the V pool's shape without D for a paged one.
    return_budgets : bool
        With ``eps``: also return a :class:`SplitBudgets` of fresh GPU arrays.
    num_chunks : int, optional
        Token chunks of the attention launch (tests and tuning); default fills the GPU.
    out : GPU array (B, Hq, D) of ``q``'s dtype and framework, optional
        Where the output goes (checked: shape, dtype, device, contiguity).
    mass : {"paper", "sub"}
        The clusters' logits: ``"paper"`` ``scale q.C_i + log s_i`` (doublep_cluster_logits);
        ``"sub"`` the logsumexp of ``scale q.c_ia + log s_ia`` over the index's
        sub-centroids (doublep_cluster_logits_sub; an index built with ``mass="sub"`` and
        ``n_sub`` in :data:`~stochattn.cuda.kernels.DOUBLEP_SUB_COUNTS`). Both stages and
        the centroid pseudo-token logits read them; ignored by top-k ``clusters`` (which
        keeps the paper logits).
    workspace : None, Workspace or 1-D uint8 GPU array
        The call's scratch (:func:`workspace_bytes`; the module docstring gives the formula):
        None allocates it, a :class:`~stochattn.cuda.runtime.workspace.Workspace` keeps it
        between calls, an array must hold at least that many bytes (``ValueError`` naming
        ``workspace`` otherwise). With ``out`` and a large enough workspace the call
        allocates nothing, copies nothing to the host and does not synchronise, unless
        ``return_diagnostics`` (which allocates its own scratch and synchronises) or
        ``return_indices`` (which allocates the indices).

    Returns
    -------
    out : GPU array (B, Hq, D), dtype of ``q``, in the caller's framework
    indices : GPU array, only with ``return_indices`` (with ``eps``: then the pilot's)
    budgets : SplitBudgets, only with ``return_budgets``
    diagnostics : dict, only with ``return_diagnostics`` (with ``eps`` also budget,
        budget_capped, error_bound and budget_pilot, (B, Hq) NumPy arrays)
    """
    centroid = clusters is None
    if budget is not None and not centroid:
        raise ValueError("`budget` (the sampled variant) and `clusters` (top-k) exclude each other")
    targeted = None
    if eps is not None:
        if budget is not None or not centroid:
            raise ValueError("`eps` (error-targeted budgets of the sampled variant) needs "
                             "budget=None and clusters=None")
        targeted = targeted_of(eps, delta, max_budget, budget_rule, budget_norm, pilot,
                               pilot_share)
        budget = targeted.max_budget  # the scratch and the indices are sized by it
    elif return_budgets or v_sqnorms is not None:
        raise ValueError("`return_budgets` and `v_sqnorms` need `eps` (error-targeted budgets)")
    if return_indices and budget is None:
        raise ValueError("`return_indices` needs `budget` (only the sampled variant draws rows)")
    sample = _sample_of(budget, sampler)
    if sample is not None:
        seed, offset = inputs.check_stream_words(seed, offset)
    sub = _sub_of(mass, centroid)
    inp, ix, plan = _plan(q, k, v, index, clusters is None, sample, softmax_scale, num_chunks,
                          sub, targeted)
    return plan.run(inp, ix, int(index.n_sink), float(p1), float(p2),
                    0 if clusters is None else int(clusters), bool(return_diagnostics),
                    (seed, offset), bool(return_indices), out, workspace, v_sqnorms,
                    bool(return_budgets))


def workspace_bytes(q, k, v, index, *, clusters=None, budget=None, sampler="systematic",
                    softmax_scale=None, num_chunks=None, mass="paper", eps=None, delta=None,
                    max_budget=None, budget_rule="chebyshev", budget_norm="pilot", pilot=64,
                    pilot_share=0.25) -> int:
    """Scratch bytes of one :func:`doublep_decode` call with these arrays and options (the
    module docstring's formula; the token chunks depend on the device's SM count): what a
    ``workspace=`` array must hold. Builds (or finds) the launch plan; launches nothing."""
    if budget is not None and clusters is not None:
        raise ValueError("`budget` (the sampled variant) and `clusters` (top-k) exclude each other")
    targeted = None
    if eps is not None:
        targeted = targeted_of(eps, delta, max_budget, budget_rule, budget_norm, pilot,
                               pilot_share)
        budget = targeted.max_budget
    return _plan(q, k, v, index, clusters is None, _sample_of(budget, sampler), softmax_scale,
                 num_chunks, _sub_of(mass, clusters is None), targeted)[2].scratch_bytes


def _sub_of(mass, centroid) -> bool:
    """Whether the call scores the clusters by their sub-centroids (``mass="sub"``; top-k
    clusters always use the paper logits)."""
    return val.check_choice("mass", mass, MASSES) == "sub" and centroid


def _sample_of(budget, sampler):
    """The sampled variant's checked configuration (None without ``budget``)."""
    if budget is None:
        return None
    return _Sample(inputs.check_gpu_budget(budget), val.check_choice("sampler", sampler, SAMPLERS),
                   _SAMPLE_TILE)


def _plan(q, k, v, index, centroid, sample, softmax_scale, num_chunks, sub=False,
          targeted=None):
    """``(inputs, index arrays, cached _DoublePPlan)`` of a call."""
    inp = inputs.gather(q, k, v)
    ix = _IndexArrays.of(index, sub)
    cfg = get_config(inp.device)
    key = ("doublep", inp.key, ix.key, centroid, sample, type(softmax_scale), softmax_scale,
           type(num_chunks), num_chunks, cfg, SORT_SELECT_MAX_CLUSTERS, sub, targeted)
    plan = inputs.cached_plan(
        key, lambda: _DoublePPlan(inp, ix, centroid, softmax_scale, num_chunks, cfg, sample,
                                  targeted))
    return inp, ix, plan


def _with_pages(variable: tuple, kernel) -> tuple:
    """A S²ANTA-prop launch's per-call names plus the page-table names its kernel takes
    that they lack (the kernels' signature decides: doublep passes every name by value)."""
    return variable + tuple(n for n in _PAGE_NAMES
                            if n in kernel.arg_names and n not in variable)


def _sample_pages_missing() -> list:
    """Why the sampled variant cannot read a paged cache: its V gather (santa_prop_sample,
    the S²ANTA-prop family's kernel) takes no page table yet; empty once it does."""
    if "kv_indptr" in abi.kernel("santa_prop", "santa_prop_sample").arg_names:
        return []
    return ["the sampled variant's V gather (santa_prop_sample) does not read paged caches yet"]


class _Sample(NamedTuple):
    """The sampled variant's configuration (part of the plan key)."""

    budget: int
    sampler: str
    tile_size: int


#: The norms of the split budgets that the GPU runs (the kernels' enum SplitNorm, in order).
SPLIT_NORMS_GPU = ("pilot", "bound", "auto")
#: Why the other norms of :data:`stochattn.budget_rules.SPLIT_NORMS` have no GPU path.
SPLIT_NORMS_MISSING = {
    "student": "the studentised bound of Double-P's sampled variant (`budget_norm='student'`): "
               "the reference has it, the GPU kernels not yet",
    "oracle": "`budget_norm='oracle'` reads all of C_approx's values: a yardstick of the "
              "reference, not an option",
}
_SPLIT_FIELDS = abi.constant("santa_prop", "kSplitFields")
_SPLIT_WAY_SAMPLED = abi.enum("santa_prop", "SplitWay")["SPLIT_WAY_SAMPLED"]
_SPLIT_STATUS_OK = abi.enum("santa_prop", "SplitStatus")["SPLIT_OK"]


class _Targeted(NamedTuple):
    """Error-targeted budgets of the sampled variant (part of the plan key; checked)."""

    eps: float
    delta: float
    max_budget: int
    rule: str
    norm: str
    pilot: int
    pilot_share: float


def targeted_of(eps, delta, max_budget, rule, norm, pilot, pilot_share) -> _Targeted:
    """The checked options of :func:`doublep_decode`'s error-targeted budgets: the
    reference's checks and messages (:func:`stochattn.budget_rules.check_options` with the
    split norms), then the GPU's own limits: a norm of :data:`SPLIT_NORMS_GPU`, and
    ``max_budget`` and ``pilot`` at most 2**30 (int32 draw counters)."""
    from .. import budget_rules as _budgets

    if delta is None or max_budget is None:
        raise ValueError("`eps` needs `delta` and `max_budget`")
    _budgets.check_options(eps, delta, max_budget, rule, norm, pilot, pilot_share,
                           _budgets.SPLIT_NORMS)
    if norm not in SPLIT_NORMS_GPU:
        raise ValueError(f"`budget_norm` must be one of {', '.join(map(repr, SPLIT_NORMS_GPU))} "
                         f"on the GPU ({SPLIT_NORMS_MISSING[norm]}), got {norm!r}")
    inputs.check_gpu_budget(max_budget)
    if pilot > 2**30:
        raise ValueError(f"`pilot` must be at most 2**30 on the GPU, got {pilot}")
    return _Targeted(float(eps), float(delta), int(max_budget), rule, norm, int(pilot),
                     float(pilot_share))


def split_constants(t: _Targeted) -> dict:
    """The float64 constants the split-budget kernels take, computed as the reference
    computes them (:func:`stochattn.reference.split_budgets.choose_split_budgets` and
    ``auto_pilot_plan``): ``c_main = c(delta - delta_pilot)``, ``c_full = c(delta)``,
    ``inv_dp = 1 / delta_pilot`` (norm "auto": the pilot's Markov factor is
    ``inv_dp / S0``) and ``k_pilot = c(delta_pilot) / pilot`` (norm "pilot"), with
    ``delta_pilot = pilot_share * delta``; ``norm`` is the kernels' code."""
    from ..budget_rules import tail_factor

    dp = float(t.pilot_share) * float(t.delta)
    return dict(eps=t.eps, c_main=tail_factor(t.rule, float(t.delta) - dp),
                c_full=tail_factor(t.rule, float(t.delta)), inv_dp=1.0 / dp,
                k_pilot=tail_factor(t.rule, dp) / t.pilot if t.norm == "pilot" else 0.0,
                norm=abi.enum("santa_prop", "SplitNorm")["SPLIT_NORM_" + t.norm.upper()])


def split_scratch_sizes(rows, D, pilot, tokens) -> tuple:
    """Bytes of the error-targeted scratch pieces, in the order the plan lays them out:
    m2_A's chunk sums (f64 rows x chunks x 4), the split state (f64 rows x kSplitFields),
    w_E o_E (f64 rows x D), the pilot's mean and (max, sum) (f32 rows x D, rows x 2), the
    pilot's drawn rows (i32 rows x pilot; also the exact read's token list), S0 (i32 rows),
    then budget and capped (i32 rows), error_bound, norm_sq_lower, second_moment and
    variance (f64 rows)."""
    return (8 * MOMENT_FIELDS * rows * moment_chunks(tokens), 8 * _SPLIT_FIELDS * rows,
            8 * rows * D, 4 * rows * D, 8 * rows, 4 * rows * pilot, 4 * rows,
            4 * rows, 4 * rows, 8 * rows, 8 * rows, 8 * rows, 8 * rows)


class SplitBudgets(NamedTuple):
    """The budgets of one error-targeted :func:`doublep_decode` call, as GPU arrays of q's
    framework (B, Hq): ``budget`` (int32, S of the main draws, 0 without C_approx),
    ``capped`` (int32 0/1), ``error_bound``, ``norm_sq_lower`` (L^2), ``second_moment``
    (m2_A), ``variance`` (w_A^2 V_A, the bound S was chosen from; float64), and ``state``
    (B, Hq, 8) float64: w_E, w_A, m2_A, ||w_E o_E||, n_A, the way (0 bound, 1 exact read,
    2 pilot), the value rows read before the main draws, the status (0, 1 no C_approx,
    2 non-finite)."""

    budget: object
    capped: object
    error_bound: object
    norm_sq_lower: object
    second_moment: object
    variance: object
    state: object


_SPLIT_FIELD_DTYPES = (("budget", "int32"), ("capped", "int32"), ("error_bound", "float64"),
                       ("norm_sq_lower", "float64"), ("second_moment", "float64"),
                       ("variance", "float64"))
_SPLIT_PREP_VARIABLE = (("part_o", "part_ml", "tile_m", "seq_lens") + PAGE_VARIABLE
                        + ("parts", "state", "exact_o", "pilot_budgets"))
_SPLIT_BUDGETS_VARIABLE = (("state", "exact_o", "pilot_o", "logits", "tile_m", "v", "seq_lens")
                           + PAGE_VARIABLE + ("list",) + tuple(n for n, _ in _SPLIT_FIELD_DTYPES))
_SPLIT_SAMPLE_VARIABLE = SAMPLE_VARIABLE + ("budgets", "part_o", "part_ml") + PAGE_VARIABLE


class _IndexArrays:
    """The index arrays the kernels read: metas (the plan key) and, on demand, pointers."""

    __slots__ = ("arrays", "fields", "ops", "key", "_pointers", "__weakref__")

    #: (index, sub) -> its _IndexArrays, reused while the index holds the same array objects
    #: (an append or a stack gives new ones): a decode step does not re-inspect seven arrays.
    _caches = {False: weakref.WeakKeyDictionary(), True: weakref.WeakKeyDictionary()}

    def __init__(self, index, arrays=None, sub=False):
        self.fields = _INDEX_FIELDS + (_SUB_FIELDS if sub else ())
        self.arrays = arrays or _arrays_of(index, self.fields)
        self.ops = tuple(ops_for(f"index.{name}", a)
                         for (name, _, _), a in zip(self.fields, self.arrays))
        self.key = tuple((o.name,) + tuple(o.meta(a)) for o, a in zip(self.ops, self.arrays))
        self._pointers = None

    @property
    def n_sub(self) -> int:
        """Sub-centroids per cluster (0: the paper logits)."""
        return int(self.arrays[-1].shape[-1]) if len(self.fields) > len(_INDEX_FIELDS) else 0

    @classmethod
    def of(cls, index, sub=False) -> "_IndexArrays":
        fields = _INDEX_FIELDS + (_SUB_FIELDS if sub else ())
        arrays = _arrays_of(index, fields)
        cache = cls._caches[bool(sub)]
        try:
            hit = cache.get(index)
        except TypeError:  # not weak-referenceable: no cache
            return cls(index, arrays, sub)
        if hit is not None and all(a is b for a, b in zip(hit.arrays, arrays)):
            return hit
        ix = cls(index, arrays, sub)
        cache[index] = ix
        return ix

    def check(self, shape, device):
        """Dtypes, shapes and device against the cache (plan time)."""
        B, Hkv, D = shape.batch, shape.kv_heads, shape.head_dim
        C = None
        for (name, dtype, ndim), o, a in zip(self.fields, self.ops, self.arrays):
            dt, shp, dev = o.meta(a)
            shp = tuple(int(x) for x in shp)
            if dev != device:
                raise ValueError(f"`index.{name}` must be on the GPU of `q` ({device}), got "
                                 f"{'the host' if dev < 0 else f'device {dev}'}")
            if o.dtype_name(dt) != dtype or len(shp) != ndim:
                raise TypeError(f"`index.{name}` must be a {ndim}-d {dtype} array (a GPU index "
                                f"from build_doublep_index), got {o.dtype_name(dt)} {shp}")
            if name == "centroids":
                C = shp[2]
                want, dims = (B, Hkv, C, D), "(batch, kv_heads, clusters, head_dim)"
            elif name == "value_sums":
                want, dims = (B, Hkv, C, D), "(batch, kv_heads, clusters, head_dim)"
            elif name == "sizes":
                want, dims = (B, Hkv, C), "(batch, kv_heads, clusters)"
            elif name == "labels":
                want, dims = (B, Hkv, shp[2]), "(batch, kv_heads, tokens)"
            elif name == "sub_centroids":
                if shp[3:4] and shp[3] not in kernels.DOUBLEP_SUB_COUNTS:
                    raise ValueError(f"`index.sub_centroids` holds {shp[3]} sub-centroids per "
                                     f"cluster; the GPU decode takes "
                                     f"{kernels.DOUBLEP_SUB_COUNTS} (build_doublep_index's "
                                     f"`n_sub`)")
                want = (B, Hkv, C, shp[3] if len(shp) > 3 else 0, D)
                dims = "(batch, kv_heads, clusters, n_sub, head_dim)"
            elif name == "sub_sizes":
                want = tuple(int(x) for x in self.arrays[-2].shape[:4])
                dims = "(batch, kv_heads, clusters, n_sub) of `index.sub_centroids`"
            else:
                want, dims = (B,), "(batch,)"
            if shp != want:
                # Named by attribute: batch, kv_heads and head_dim are the call's (q, k),
                # the cluster count index.centroids', the label axis any length.
                raise ValueError(
                    f"`index.{name}` has shape {shp}, expected {dims} = {want}: batch "
                    f"{B}, kv_heads {Hkv} and head_dim {D} of this call's `q` and `k`"
                    + (f", {C} clusters of `index.centroids`"
                       if name in ("value_sums", "sizes", "sub_centroids") else "")
                    + "; pass an index built from this cache")
        return C, int(self.arrays[3].shape[2])

    def pointers(self):
        """Device pointers of the arrays, and the arrays they point into (keep them alive
        until the launches are enqueued). Remembered when every array is contiguous and
        aligned as it is (the index's own arrays always are): the same array objects keep
        their storage. Otherwise copies are made at every call, which stay current."""
        if self._pointers is not None:
            return self._pointers, self.arrays
        used = tuple(o.contiguous("index", a) for o, a in zip(self.ops, self.arrays))
        ptrs = tuple(np.uint64(o.ptr(a)) for o, a in zip(self.ops, used))
        if all(u is a for u, a in zip(used, self.arrays)):
            self._pointers = ptrs
        return ptrs, used


def _arrays_of(index, fields) -> tuple:
    """The index's arrays of ``fields``; a missing sub-centroid array is a ValueError naming
    `index` (an index built without mass="sub")."""
    arrays = tuple(getattr(index, name, None) for name, _, _ in fields)
    if any(a is None for a in arrays):
        raise ValueError("`index` has no sub-centroids, which mass='sub' reads: build it with "
                         "build_doublep_index(..., mass='sub')")
    return arrays


class _DoublePPlan:
    """Everything one configuration of :func:`doublep_decode` needs, resolved once."""

    def __init__(self, inp, ix, centroid, softmax_scale, num_chunks, cfg, sample,
                 targeted=None):
        config = cfg.tiling  # the device's GpuConfig's tiling
        s, scale, self.device, dtype_name = inputs.base_plan(inp, softmax_scale)
        num_chunks = inputs.check_num_chunks(num_chunks)
        C, NL = ix.check(s, self.device)
        self.shape, self.C = s, C
        self.paged = not isinstance(inp, inputs.Inputs)
        if self.paged and sample is not None and _sample_pages_missing():
            raise NotImplementedError("`doublep_attention`: " + _sample_pages_missing()[0])
        ctype = kernels.CTYPES[dtype_name]
        gm = group_max(s.group)
        D = s.head_dim
        stage = config.smem_bytes("doublep_decode", D, gm)
        self.threads = config.threads
        fam = _FAMILY
        k = functools.partial(abi.kernel, fam)
        cap = min(s.tokens, NL)
        pairs = s.batch * s.kv_heads
        with inputs.device_scope(self.device):
            # First use: compile the plan's kernels in parallel threads, not one by one.
            flag = sample is not None
            self.n_sub = n_sub = ix.n_sub
            logits_expr = (k("doublep_cluster_logits_sub").expr(T=ctype, D=D, GMAX=gm, NSUB=n_sub)
                           if n_sub else k("doublep_cluster_logits").expr(T=ctype, D=D, GMAX=gm))
            launch.prefetch(fam, [
                logits_expr,
                k("doublep_select_sorted").expr()
                if C <= min(SORT_SELECT_MAX_CLUSTERS, _SORT_MAX_CLUSTERS)
                else k("doublep_select").expr(),
                k("doublep_rows").expr(GMAX=gm, SAMPLE=flag),
                k("doublep_attend").expr(T=ctype, D=D, GMAX=gm, SAMPLE=flag),
                k("exact_decode_merge").expr(T=ctype),
                k("doublep_true_mass").expr(T=ctype, D=D, GMAX=gm)], cfg)
            logits = launch.launcher(fam, logits_expr, 0, cfg)
            self.sorted = C <= min(SORT_SELECT_MAX_CLUSTERS, _SORT_MAX_CLUSTERS)
            if self.sorted:
                self.sort_p = max(2 * _SORT_THREADS, 1 << (C - 1).bit_length())
                select = launch.launcher(fam, k("doublep_select_sorted").expr(), 8 * self.sort_p,
                                          cfg)
                self.select_threads = _SORT_THREADS
            else:
                select = launch.launcher(fam, k("doublep_select").expr(), 0, cfg)
                self.select_threads = _SELECT_THREADS
            rows_k = launch.launcher(fam, k("doublep_rows").expr(GMAX=gm, SAMPLE=flag), 0, cfg)
            name = k("doublep_attend").expr(T=ctype, D=D, GMAX=gm, SAMPLE=flag)
            # The list: row ids, head masks (and sampled-head masks); paged, then each row's
            # byte offset in the pool (8 bytes an entry), found once per staged entry.
            list_offs = stage + launch.align(_LIST_CAP * (5 if sample is None else 6), 16)
            smem = list_offs + (8 * _LIST_CAP if self.paged else 0)
            attend = launch.launcher(fam, name, smem, cfg)
            cl_chunks = math.ceil(C / _CLUSTERS_PER_ATTEND_CTA) if centroid and not sample else 0
            if sample is not None:
                prop = functools.partial(abi.kernel, "santa_prop")
                tiles = launch.launcher("santa_prop", prop("santa_prop_tiles").expr(), 0, cfg)
                sample_k = launch.launcher("santa_prop",
                                            prop("santa_prop_sample").expr(T=ctype, D=D), 0, cfg)
            if num_chunks is None:
                # Two waves' worth of token CTAs (a token CTA takes an equal share of its
                # row list, so its work does not depend on where the exact tokens lie; the
                # gathered rows are latency-bound, so more CTAs in flight help), at least
                # 128 tokens of the cache per token CTA. H200, calibrated K/V, (0.95, 0.7)
                # (tools/tune_doublep.py): B=8 / 128k 255 us at 16 per pair against 393 at
                # 4 and 285 at 64; B=32 / 32k best at 4 to 8.
                slots = launch.num_sms() * launch.ctas_per_sm(fam, name, config.threads, smem,
                                                                cfg)
                tok_chunks = max(1, min(math.ceil(cap / 128), round(2 * slots / pairs)))
            else:
                tok_chunks = num_chunks
            self.list_off, self.list_offs = stage, list_offs
            # Partials: the token CTAs', the cluster CTAs' (centroid) or the draws' (sample).
            total = tok_chunks + cl_chunks + (sample is not None)
            merge = (launch.launcher(fam, k("exact_decode_merge").expr(T=ctype), 0, cfg)
                     if total > 1 else None)
            self.true_mass = launch.launcher(
                fam, k("doublep_true_mass").expr(T=ctype, D=D, GMAX=gm), 0, cfg)
        self.tok_chunks, self.total = tok_chunks, total
        self.slices = max(1, math.ceil(cap / _SLICE_TOKENS))
        rows = s.batch * s.q_heads
        self.grid_logits = (math.ceil(C / _CLUSTERS_PER_LOGIT_CTA), s.kv_heads, s.batch)
        self.grid_select = (rows,)
        self.grid_rows = (self.slices, s.kv_heads, s.batch)
        self.grid_attend = (tok_chunks + cl_chunks, s.kv_heads, s.batch)
        self.merge_grid = (rows,)
        self.out_shape = (s.batch, s.q_heads, D)
        scale_log2 = np.float32(scale * math.log2(math.e))
        self.scale_log2 = scale_log2
        # One scratch buffer: xb (f32, rows x C), codes (u8, B Hkv C 8), partial outputs
        # (f32, rows x total x D), (m, l) pairs (f32, rows x total x 2), the row lists
        # (i32 and u8, pairs x slices x slice tokens) and their counts (i32, pairs x slices).
        list_len = pairs * self.slices * _SLICE_TOKENS
        sizes = (4 * rows * C, 8 * pairs * C, 4 * rows * total * D, 8 * rows * total,
                 4 * list_len, list_len, 4 * pairs * self.slices)
        self.sample_cfg = sample
        if sample is not None:
            if rows >= 2**28:
                raise ValueError(f"`q` batch * heads must be below 2**28 (random-stream rows), "
                                 f"got {rows}")
            # The sampled variant's buffers: sampled-head masks (u8, like the list), the
            # logit stash (f32, rows x n_pad), lengths (i32, B), tile_m and tile_l (f32,
            # rows x n_tiles), the tile prefix (f64, rows x n_tiles), iid points (f64,
            # rows x (S + 1); iid only) and the drawn rows (i32, rows x S).
            S, ts = sample.budget, sample.tile_size
            n_tiles = math.ceil(s.tokens / ts)
            n_pad = n_tiles * ts
            sizes += (list_len, 4 * rows * n_pad, 4 * s.batch, 4 * rows * n_tiles,
                      4 * rows * n_tiles, 8 * rows * n_tiles,
                      8 * rows * (S + 1) if sample.sampler == "iid" else 8, 4 * rows * S)
            self.grid_tiles = (rows, math.ceil(n_pad / _TILE_LOGITS_PER_CTA))
            self.n_pad = n_pad
            self.idx_shape = (s.batch, s.q_heads, S)
        self.targeted = targeted
        if targeted is not None:
            sizes += split_scratch_sizes(rows, D, targeted.pilot, s.tokens)
        if self.paged:  # each listed row's byte offset in the pool (i64, like the list)
            sizes += (8 * list_len,)
        self.offsets, self.scratch_bytes = launch.layout(sizes)
        self.NL = NL
        n_pad = self.n_pad if sample is not None else 0
        # Packed launches (launch.Packed): the pointers and the per-call options (n_sink,
        # p1, p2, the count, the seed and offset) are the variable arguments.
        P = launch.Packed
        dep = config.pdl  # every launch after the first: programmatic dependent launch
        self.logits = P(logits, self.grid_logits, (_LOGIT_THREADS,),
                        k("doublep_cluster_logits_sub" if self.n_sub else "doublep_cluster_logits")
                        .bind(_LOGITS_SUB_VARIABLE if self.n_sub else _LOGITS_VARIABLE,
                              Hkv=s.kv_heads, G=s.group, C=C, per_cta=_CLUSTERS_PER_LOGIT_CTA,
                              scale_log2=scale_log2))
        select_fixed = dict(Hkv=s.kv_heads, G=s.group, C=C, cap=cap)
        if self.sorted:
            select_fixed["P"] = self.sort_p
        self.select = P(select, self.grid_select, (self.select_threads,),
                        k("doublep_select_sorted" if self.sorted else "doublep_select").bind(
                            _SELECT_VARIABLE, **select_fixed), pdl=dep)
        self.rows = P(rows_k, self.grid_rows, (_ROW_THREADS,),
                      k("doublep_rows").bind(_ROWS_VARIABLE, Hkv=s.kv_heads, G=s.group, cap=cap,
                                             NL=NL, C=C, slices=self.slices, n_pad=n_pad),
                      pdl=dep)
        self.attend = P(attend, self.grid_attend, (self.threads,),
                        k("doublep_attend").bind(
                            _ATTEND_VARIABLE, Hkv=s.kv_heads, G=s.group, N=s.tokens, C=C,
                            slices=self.slices, tok_chunks=tok_chunks,
                            cl_per_chunk=_CLUSTERS_PER_ATTEND_CTA, num_chunks=total,
                            list_off=self.list_off, list_offs=self.list_offs,
                            scale_log2=scale_log2, n_pad=n_pad),
                        pdl=dep)
        if sample is not None:
            # By name: the page-table arguments where the S²ANTA-prop kernels take them.
            self.tiles_variable = _with_pages(_TILES_VARIABLE, prop("santa_prop_tiles"))
            self.tiles = P(tiles, self.grid_tiles, (_TILE_THREADS,),
                           prop("santa_prop_tiles").bind(
                               self.tiles_variable, Hq=s.q_heads, N=s.tokens, n_pad=n_pad,
                               n_tiles=n_tiles, tile_size=ts), pdl=dep)
            # The draws' partial is the last of the merge's `total` (purpose
            # PURPOSE_CLUSTER_SAMPLER).
            self.sample_variable = (_with_pages(SAMPLE_VARIABLE, prop("santa_prop_sample"))
                                    + ("part_o", "part_ml"))
            self.sample = P(sample_k, (rows,), (_SAMPLE_THREADS,),
                            prop("santa_prop_sample").bind(
                                self.sample_variable, Hq=s.q_heads, G=s.group,
                                N=s.tokens, n_pad=n_pad, n_tiles=n_tiles, tile_size=ts, S=S,
                                sampler=sampler_code(sample.sampler),
                                purpose=PURPOSE_CLUSTER_SAMPLER, num_parts=total, part=total - 1),
                            pdl=dep)
        if targeted is not None:
            self._targeted_launches(targeted, cfg, dep, ctype, dtype_name, total, tok_chunks,
                                    n_pad, n_tiles)
        self.merge = None if merge is None else P(
            merge, self.merge_grid, (D,),
            k("exact_decode_merge").bind(("part_o", "part_ml", "out"), num_chunks=total, D=D,
                                         lse=0),
            pdl=dep)

    def _targeted_launches(self, t, cfg, dep, ctype, dtype_name, total, tok_chunks, n_pad,
                           n_tiles):
        """The error-targeted budgets' launches (santa_prop.cu's Double-P section): m2_A's
        sums over the stash, the rows' preparation, the pilot, the budgets and the main
        draws with the row's S as the merge's last partial (a fixed-budget call's slot)."""
        s, P = self.shape, launch.Packed
        rows = s.batch * s.q_heads
        prop = functools.partial(abi.kernel, "santa_prop")
        sdecl, mdecl = prop("santa_prop_sample_budgets"), prop("santa_prop_second_moment")
        pdecl, bdecl = prop("doublep_split_prep"), prop("doublep_split_budgets")
        ts = self.sample_cfg.tile_size
        with inputs.device_scope(self.device):
            launch.prefetch("santa_prop", [sdecl.expr(T=ctype, D=s.head_dim), mdecl.expr(),
                                           pdecl.expr(), bdecl.expr()], cfg)
            sample = launch.launcher("santa_prop", sdecl.expr(T=ctype, D=s.head_dim), 0, cfg)
            moment = launch.launcher("santa_prop", mdecl.expr(), 0, cfg)
            prep = launch.launcher("santa_prop", pdecl.expr(), 0, cfg)
            budgets = launch.launcher("santa_prop", bdecl.expr(), 0, cfg)
        k = split_constants(t)
        common = dict(Hq=s.q_heads, G=s.group, N=s.tokens, n_pad=n_pad, n_tiles=n_tiles,
                      tile_size=ts)
        n_chunks = moment_chunks(s.tokens)
        self.split_moment = P(moment, (n_chunks * rows,), (_SAMPLE_THREADS,),
                              mdecl.bind(_MOMENT_VARIABLE, n_chunks=n_chunks, **common), pdl=dep)
        self.split_prep = P(prep, (rows,), (_SAMPLE_THREADS,),
                            pdecl.bind(_SPLIT_PREP_VARIABLE, num_parts=total, n_exact=tok_chunks,
                                       n_chunks=n_chunks, Hq=s.q_heads, N=s.tokens,
                                       n_tiles=n_tiles, tile_size=ts, D=s.head_dim,
                                       norm=k["norm"], eps=k["eps"], c_main=k["c_main"],
                                       c_full=k["c_full"], inv_dp=k["inv_dp"], pilot=t.pilot),
                            pdl=dep)
        # The pilot: stratified, purpose PURPOSE_BUDGET_PILOT, stream 0 (the reference's
        # pilot points); S = pilot under "pilot", S0 per row under "auto" (rows with S0 = 0
        # draw nothing); none under "bound".
        self.split_pilot = None if t.norm == "bound" else P(
            sample, (rows,), (_SAMPLE_THREADS,),
            sdecl.bind(_SPLIT_SAMPLE_VARIABLE, max_budget=t.pilot, idx_ld=t.pilot, rng_stream=0,
                       sampler=sampler_code("stratified"), purpose=PURPOSE_BUDGET_PILOT,
                       num_parts=1, part=0, skip_zero=1, **common), pdl=dep)
        self.split_budgets = P(budgets, (rows,), (_SAMPLE_THREADS,),
                               bdecl.bind(_SPLIT_BUDGETS_VARIABLE, D=s.head_dim,
                                          dtype=0 if dtype_name == "float16" else 1,
                                          max_budget=t.max_budget, pilot=t.pilot, **k,
                                          **common), pdl=dep)
        self.split_main = P(
            sample, (rows,), (_SAMPLE_THREADS,),
            sdecl.bind(_SPLIT_SAMPLE_VARIABLE, max_budget=t.max_budget, idx_ld=t.max_budget,
                       rng_stream=0, sampler=sampler_code(self.sample_cfg.sampler),
                       purpose=PURPOSE_CLUSTER_SAMPLER, num_parts=total, part=total - 1,
                       skip_zero=0, **common), pdl=dep)

    def run(self, inp, ix, n_sink, p1, p2, count, diagnostics, rng, return_indices, out=None,
            workspace=None, v_sqnorms=None, return_budgets=False):
        ops = inp.ops
        s = self.shape
        sample = self.sample_cfg
        t = self.targeted
        with inputs.device_scope(self.device):
            norms = sqnorms_args(inp, v_sqnorms, s, self.device) if t is not None else None
            qp, kp, vp, _null, _keep, stream = inputs.launch_args(inp, None, False, s, self.device)
            pages = page_args(inp)
            ptrs_ix, held = ix.pointers()
            cent, sizes, vsums, labels, lens, ws = ptrs_ix[:6]
            out = _workspace.output(ops, inp.q, self.out_shape, None, out, self.device)
            outp = ops.ptr(out)
            if diagnostics:  # its own scratch, read back by the host (codes)
                scratch = ops.empty(inp.q, (self.scratch_bytes,), "uint8")
                base = ops.ptr(scratch)
            else:
                base, scratch = _workspace.scratch(ops, inp.q, self.scratch_bytes, workspace,
                                                   self.device)
            ptrs = tuple(base + o for o in self.offsets)
            xb, codes, po, pml, rl, hm, cnt = ptrs[:7]
            ro = ptrs[-1] if self.paged else 0
            if sample is not None:
                am, stash, lens32, tile_m, tile_l, cdf, iid, idx32 = ptrs[7:15]
            else:
                am = stash = lens32 = 0
            indices = None
            if sample is not None and (return_indices or diagnostics):
                indices = ops.empty(inp.q, self.idx_shape, "int64")
            if diagnostics:
                rows = s.batch * s.q_heads
                diag = ops.empty(inp.q, (launch.align(32 * rows) + 16 * s.batch * s.kv_heads,),
                                 "uint8")
                stats = ops.ptr(diag)
                rows_read = stats + launch.align(32 * rows)
            else:
                stats = rows_read = 0
            if self.n_sub:  # mass="sub": the sub-centroids and their sizes
                self.logits(stream, qp, ptrs_ix[6], ptrs_ix[7], sizes, xb)
            else:
                self.logits(stream, qp, cent, sizes, xb)
            self.select(stream, xb, sizes, lens, ws, codes, stats, rows_read, n_sink, p1, p2,
                        1 if count else 0, count)
            self.rows(stream, lens, ws, *pages, labels, codes, rl, ro, hm, cnt, rows_read,
                      n_sink, am, stash, lens32)
            self.attend(stream, qp, kp, vp, *pages, rl, ro, hm, cnt, codes, xb, sizes, vsums,
                        outp, po, pml, am, stash)
            if sample is not None:
                named = dict(pages._asdict(), logits=stash, seq_lens=lens32, tile_m=tile_m,
                             tile_l=tile_l)
                self.tiles(stream, *(named[n] for n in self.tiles_variable))
                idxp = 0 if indices is None else ops.ptr(indices)
                rs, _keep_rs = inputs.stream_args(inp, rng[0], rng[1], s.batch, self.device)
                named.update(rs._asdict(), v=vp, C=cdf, iid_points=iid,
                             idx32=idx32, idx_out=idxp, out=outp, part_o=po, part_ml=pml)
                if t is None:
                    self.sample(stream, *(named[n] for n in self.sample_variable))
                else:
                    split = self._run_targeted(inp, stream, named, ptrs[15:15 + 13], norms,
                                               return_indices, return_budgets)
            if self.merge is not None:
                self.merge(stream, po, pml, outp)
            res = (out,) + ((indices,) if return_indices else ())
            if t is not None:
                res += ((split[0],) if return_indices else ()) + (
                    (split[1],) if return_budgets else ())
            if diagnostics:
                extra = None
                if sample is not None:
                    c0 = self.offsets[1]
                    extra = self._drawn_rows_outside_exact(
                        ops, indices, scratch[c0:c0 + 8 * s.batch * s.kv_heads * self.C], held[3])
                d = self._diagnostics(inp, diag, codes, (lens, ws, labels), n_sink, stream,
                                      extra)
                if t is not None:
                    d.update(self._split_diagnostics(split[1], scratch))
                res += (d,)
            return res if len(res) > 1 else out

    def _run_targeted(self, inp, stream, named, ptrs, norms, return_indices, return_budgets):
        """The error-targeted launches after santa_prop_tiles (``named``: the sampled
        variant's pointers by argument name). Returns (pilot indices or None, SplitBudgets
        of fresh arrays or None)."""
        ops, s, t = inp.ops, self.shape, self.targeted
        (parts, state, exact_o, pilot_o, pilot_ml, pilot_idx, pilot_budgets,
         *fields) = ptrs
        pilot_indices = budgets = None
        if return_indices and self.split_pilot is not None:
            pilot_indices = ops.empty(inp.q, (s.batch, s.q_heads, t.pilot), "int64")
        if return_budgets:  # the kernels write these instead of the scratch's fields
            arrays = [ops.empty(inp.q, (s.batch, s.q_heads), dt) for _, dt in _SPLIT_FIELD_DTYPES]
            st = ops.empty(inp.q, (s.batch, s.q_heads, _SPLIT_FIELDS), "float64")
            fields = [ops.ptr(a) for a in arrays]
            state = ops.ptr(st)
            budgets = SplitBudgets(*arrays, st)
        named = dict(named, sqnorms=norms[0], sq_page_stride=norms[1], sq_row_stride=norms[2],
                     sq_head_stride=norms[3], parts=parts, state=state, exact_o=exact_o,
                     pilot_budgets=pilot_budgets, list=pilot_idx,
                     **dict(zip((n for n, _ in _SPLIT_FIELD_DTYPES), fields)))
        self.split_moment(stream, *(named[n] for n in _MOMENT_VARIABLE))
        self.split_prep(stream, *(named[n] for n in _SPLIT_PREP_VARIABLE))
        if self.split_pilot is not None:
            pilot = dict(named, idx32=pilot_idx, idx_out=0 if pilot_indices is None
                         else ops.ptr(pilot_indices), out=0, part_o=pilot_o, part_ml=pilot_ml,
                         budgets=pilot_budgets if t.norm == "auto" else 0)
            self.split_pilot(stream, *(pilot[n] for n in _SPLIT_SAMPLE_VARIABLE))
        self.split_budgets(stream, *(dict(named, pilot_o=pilot_o)[n]
                                     for n in _SPLIT_BUDGETS_VARIABLE))
        self.split_main(stream, *(dict(named, budgets=named["budget"])[n]
                                  for n in _SPLIT_SAMPLE_VARIABLE))
        return pilot_indices, budgets

    def _split_diagnostics(self, budgets, scratch) -> dict:
        """The budget diagnostics (host copies; the call synchronises anyway): budget,
        budget_capped, error_bound and budget_pilot (the value rows read before the main
        draws: the state's pilot size on rows with C_approx, else 0), (B, Hq)."""
        s = self.shape
        shape = (s.batch, s.q_heads)
        if budgets is not None:
            S, cap, bound = (to_host(a) for a in budgets[:3])
            state = to_host(budgets.state)
        else:  # copies of the scratch's pieces: the state and the fields
            i = len(self.offsets) - 13 - (1 if self.paged else 0)
            at = self.offsets[i:i + 13]
            rows = s.batch * s.q_heads

            def piece(j, dt, n=1):
                dt = np.dtype(dt)
                raw = to_host(scratch[at[j]:at[j] + dt.itemsize * rows * n])
                return raw.view(np.uint8).view(dt)

            state = piece(1, "float64", _SPLIT_FIELDS)
            S, cap, bound = piece(7, "int32"), piece(8, "int32"), piece(9, "float64")
        state = np.asarray(state, dtype=np.float64).reshape(shape + (_SPLIT_FIELDS,))
        ok = state[..., 7] == _SPLIT_STATUS_OK
        return dict(budget=np.asarray(S).reshape(shape).astype(np.int64),
                    budget_capped=np.asarray(cap).reshape(shape) != 0,
                    error_bound=np.asarray(bound).reshape(shape).astype(np.float64),
                    budget_pilot=np.where(ok, state[..., 6], 0).astype(np.int64))

    def _diagnostics(self, inp, diag, codes, lens_ws_labels, n_sink, stream, drawn_extra):
        """The true-mass launch and the host copies (synchronises)."""
        ops = inp.ops
        s = self.shape
        rows = s.batch * s.q_heads
        tm_chunks = max(1, min(64, math.ceil(s.tokens / 2048)))
        tm_len = math.ceil(s.tokens / tm_chunks)
        part = ops.empty(inp.q, (rows * tm_chunks * 3,), "float32")
        lens, ws, labels = lens_ws_labels
        self.true_mass((tm_chunks, s.kv_heads, s.batch), (_LOGIT_THREADS,),
                       abi.kernel(_FAMILY, "doublep_true_mass").args_of(
                           q=ops.ptr(inp.q), k=ops.ptr(inp.k), **page_args(inp)._asdict(),
                           lens=lens, window_start=ws,
                           labels=labels, codes=codes, part=ops.ptr(part), Hkv=s.kv_heads,
                           G=s.group, N=s.tokens, NL=self.NL, C=self.C, n_sink=n_sink,
                           chunk_len=tm_len, scale_log2=self.scale_log2), stream)
        host = to_host(diag).view(np.uint8)
        stats = host[:32 * rows].view(np.float64).reshape(s.batch, s.q_heads, 4)
        off = launch.align(32 * rows)
        pairs = s.batch * s.kv_heads
        read = host[off:off + 16 * pairs].view(np.uint64).reshape(2, s.batch, s.kv_heads)
        p = to_host(part).reshape(rows, tm_chunks, 3).astype(np.float64)
        M = p[..., 0].max(axis=1, keepdims=True)
        w = np.where(np.isfinite(p[..., 0]), np.exp2(p[..., 0] - np.where(np.isfinite(M), M, 0)), 0)
        total = (p[..., 1] * w).sum(axis=1)
        covered = (p[..., 2] * w).sum(axis=1)
        true = np.divide(covered, total, out=np.zeros_like(total), where=total > 0)
        read = read.astype(np.int64)
        k_read = read[0]
        if self.sample_cfg is None:
            v_read = k_read.copy()  # every listed row is computed exactly: K and V read
        else:
            v_read = read[1] + drawn_extra
        return dict(clusters_selected=stats[..., 0].astype(np.int64),
                    clusters_exact=stats[..., 1].astype(np.int64),
                    tokens_exact=stats[..., 2].astype(np.int64),
                    estimated_mass=stats[..., 3].copy(),
                    true_mass=true.reshape(s.batch, s.q_heads),
                    k_rows_read=k_read, v_rows_read=v_read)

    def _drawn_rows_outside_exact(self, ops, indices, codes, labels):
        """Per (b, kv head): distinct drawn rows that no head of the group computes exactly
        (a drawn row lies in a C_approx cluster of its head; another head may have the same
        cluster in C_exact). Host arithmetic on copies of the draws, codes and labels."""
        s = self.shape
        G = s.group
        drawn = to_host(indices).reshape(s.batch, s.kv_heads, G * self.sample_cfg.budget)
        code = to_host(codes).reshape(s.batch, s.kv_heads, self.C, 8)[..., :G]
        labels = to_host(labels)
        extra = np.zeros((s.batch, s.kv_heads), dtype=np.int64)
        for b in range(s.batch):
            for kvh in range(s.kv_heads):
                rows = np.unique(drawn[b, kvh])
                rows = rows[rows >= 0]
                exact = (code[b, kvh, labels[b, kvh, rows]] == 2).any(axis=1)
                extra[b, kvh] = int((~exact).sum())
        return extra
