"""SANTA / S²ANTA: unbiased sampled attention for the value stage of decoding."""

from __future__ import annotations

import numpy as np

from . import _validation as val
from ._backend import host_floats, host_ints, in_callers_framework, require_cupy
from ._plan import Plan, advance, cached_plan, device_of, is_paged
from .diagnostics import Diagnostics
from .reference import santa as _ref
from .reference.common import finish, lengths, union_rows_per_kv_head
from .spec import SAMPLERS, SCHEDULES, SCORES

__all__ = ["SantaPlan", "santa_attention"]


class SantaPlan(Plan):
    """A plan of :func:`santa_attention`: its options checked once, the backend chosen.

    Parameters
    ----------
    budget, sampler, schedule, tile_size, scores, bernoulli_draws, bernoulli_group_shared, \
softmax_scale, check_finite
        As in :func:`santa_attention`.
    device : {"cpu", "cuda"}
        ``"cpu"`` runs the NumPy reference on NumPy arrays; ``"cuda"`` the S²ANTA-prop and
        S²ANTA-flash kernels on CuPy arrays or GPU tensors with ``__dlpack__`` (PyTorch,
        JAX), whose results come back in the caller's framework.
    q_heads, kv_heads, head_dim, dtype : optional
        The sizes and dtype of the arrays the plan will see (all four or none). Given, they
        are checked against what the backend takes when the plan is made, and every call
        must match them.

    advance_offset : bool
        After each call, add 1 to ``offset`` in place (modulo 2**32); ``offset`` must then be
        an integer array. N calls with one array starting at o draw what N calls with
        offsets o, o + 1, ..., o + N - 1 draw: the form a captured CUDA graph needs (docs/plans.md; on the GPU the increment runs on the device, after the kernels).

    Calls: ``plan.run(q, k, v, seq_lens=None, *, seed=0, offset=0, out=None,
    workspace=None)`` returns the output (B, Hq, D); ``plan.diagnose(...)`` returns
    ``(output, Diagnostics)``. ``seed`` and ``offset`` are ints, or integer arrays of shape
    () or (B,) (NumPy on the reference, GPU arrays read by the kernels at run time on the
    GPU): sequence b then draws with ``seed[b]`` and ``offset[b]`` (docs/rng.md).

    ``k`` may be a :class:`stochattn.paged.PagedKV` (FlashInfer's layout) with ``v`` and
    ``seq_lens`` left out: the reference reads a contiguous copy, the GPU kernels of both
    schedules read the pages in place (N = the cache's ``token_bound``; same tokens and N,
    same output as the contiguous call, bit for bit).

    ``out``: the output array to write (the reference copies its result into a NumPy
    ``out``; on the GPU the kernels write it: contiguous, q's dtype, GPU and framework).
    ``workspace`` (GPU only): the call's scratch, a uint8 GPU array of at least the
    schedule's workspace bytes; by default the plan keeps its own (:attr:`workspace`),
    grown by the first call that needs more. So a plan called once eagerly, then with
    ``out=``, allocates nothing, copies nothing to the host and does not synchronise
    (diagnostics do all three). Workspace bytes, prop: about ``4 B Hq N`` for the fp32
    logit stash plus ``24 B Hq N / tile_size + 4 B Hq S`` (``stochattn.cuda.santa``'s
    docstring has the whole formula, ``stochattn.cuda.santa.workspace_bytes`` computes it);
    flash: the split-KV partials (``stochattn.cuda.flash``).

    Raises
    ------
    ValueError, TypeError
        A bad option (the message names it), or a value the GPU kernels cannot take.
    NotImplementedError
        ``device="cuda"`` with options that have no GPU kernel (every reason listed).

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn import SantaPlan
    >>> plan = SantaPlan(budget=32, sampler="stratified")
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 1000, 64))
    >>> plan.run(q, k, k, seed=7, offset=0).shape
    (1, 4, 64)
    """

    function = "santa_attention"

    def __init__(self, *, budget=None, sampler="systematic", schedule="prop", tile_size=64,
                 scores="exact", bernoulli_draws=4, bernoulli_group_shared=False,
                 softmax_scale=None, check_finite=False, advance_offset=False, device="cpu",
                 q_heads=None, kv_heads=None, head_dim=None, dtype=None, eps=None,
                 delta=None, max_budget=None, budget_rule="chebyshev", pilot=64,
                 pilot_share=0.25, budget_norm="pilot"):
        self.eps = eps
        if eps is None:
            self.budget = val.check_budget("budget", budget)
            self.delta = self.max_budget = None
        else:
            from . import budget_rules as _budgets

            # One set of rules for both backends and both plans (messages name the argument).
            self.eps, self.delta, self.max_budget = _budgets.check_plan_options(
                budget, eps, delta, max_budget, budget_rule, budget_norm, pilot, pilot_share)
            if scores != "exact":
                raise ValueError("error-targeted budgets (`eps`) need scores='exact', got "
                                 f"{scores!r}")
            self.budget = None
        self.budget_rule = budget_rule
        self.pilot, self.pilot_share = pilot, pilot_share
        self.budget_norm = budget_norm
        self.sampler = val.check_choice("sampler", sampler, SAMPLERS)
        self.schedule = val.check_choice("schedule", schedule, SCHEDULES)
        self.scores = val.check_choice("scores", scores, SCORES)
        self.tile_size = val.check_positive_int("tile_size", tile_size)
        self.bernoulli_draws = val.check_positive_int("bernoulli_draws", bernoulli_draws)
        self.bernoulli_group_shared = val.check_bool("bernoulli_group_shared",
                                                     bernoulli_group_shared)
        if softmax_scale is not None:
            val.check_scale(softmax_scale, 1)
        self.softmax_scale = softmax_scale
        self.check_finite = val.check_bool("check_finite", check_finite)
        self.advance_offset = val.check_bool("advance_offset", advance_offset)
        super().__init__(device=device, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                         dtype=dtype)

    def options(self) -> dict:
        return dict(budget=self.budget, sampler=self.sampler, schedule=self.schedule,
                    tile_size=self.tile_size, scores=self.scores,
                    bernoulli_draws=self.bernoulli_draws,
                    bernoulli_group_shared=self.bernoulli_group_shared,
                    softmax_scale=self.softmax_scale, check_finite=self.check_finite,
                    advance_offset=self.advance_offset, eps=self.eps, delta=self.delta,
                    max_budget=self.max_budget, budget_rule=self.budget_rule,
                    pilot=self.pilot, pilot_share=self.pilot_share,
                    budget_norm=self.budget_norm)

    def _cuda_missing(self) -> list[str]:
        if self.eps is not None:
            missing = []
            if self.schedule != "prop":
                missing.append("error-targeted budgets (`eps`) with schedule="
                               f"{self.schedule!r}; the GPU has them with schedule='prop' "
                               "(flash would need per-head S_t)")
            return missing
        if self.schedule == "global":
            return ["schedule='global'; the GPU has 'prop' and 'flash'"]
        if self.scores != "exact" and self.schedule != "prop":
            return ["the Bernoulli score stage with schedule='flash'; it is on the GPU with "
                    "schedule='prop'"]
        return []

    def _check_cuda_limits(self) -> None:
        from .cuda import flash, santa
        from .cuda.runtime import inputs

        sizes = santa.TILE_SIZES if self.schedule == "prop" else flash.TILE_SIZES
        if self.tile_size not in sizes:
            raise ValueError(f"`tile_size` must be one of {sizes} on the GPU, got {self.tile_size}")
        if self.eps is not None:
            inputs.check_gpu_budget(self.max_budget)
            inputs.check_gpu_budget(self.pilot)
            return
        inputs.check_gpu_budget(self.budget, 2**30 if self.schedule == "prop"
                                 else flash.FLASH_MAX_BUDGET)

    def _paged_cuda_missing(self) -> list[str]:
        return []  # both schedules' kernels read the pages in place

    def _run(self, backend, q, k, v, seq_lens, diagnose, call):
        out, workspace = self._buffers(call)
        v_sqnorms = call.pop("v_sqnorms", None)
        if v_sqnorms is not None and self.eps is None:
            raise TypeError("`v_sqnorms` is read only with error-targeted budgets (`eps`)")
        seed, offset = self._streams(backend, q, call)
        if backend == "cuda":
            result = _santa_cuda(q, k, v, seq_lens, self, seed, offset, diagnose, out, workspace,
                                 v_sqnorms)
        else:
            result = _santa_reference(q, k, v, seq_lens, self, seed, offset, diagnose, v_sqnorms)
        if self.advance_offset:
            advance(offset)
        return result


def santa_attention(q, k, v=None, seq_lens=None, *, budget=None, sampler="systematic",
                    schedule="prop", tile_size=64, seed=0, offset=0, scores="exact",
                    bernoulli_draws=4, bernoulli_group_shared=False, softmax_scale=None,
                    check_finite=False, return_diagnostics=False, eps=None, delta=None,
                    max_budget=None, budget_rule="chebyshev", pilot=64, pilot_share=0.25,
                    budget_norm="pilot", v_sqnorms=None):
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
        length: tokens are then drawn more than once). Required unless ``eps`` is given.
    eps, delta, max_budget : float, float, int, optional
        Error-targeted budgets instead of ``budget`` (docs/budgets.md): per query head the
        smallest S with P(|o_hat - o| > eps |o|) <= delta, capped at ``max_budget``
        (exact scores only; on the GPU with schedule="prop", chosen on the device, which
        then needs ``v_sqnorms``).
    budget_rule : {"chebyshev", "clt"}
        Tail bound of the error-targeted budgets: Chebyshev (safe) or the one-degree
        chi-square quantile (smaller; delta <= 0.2; validated on generated inputs).
    pilot, pilot_share : int, float
        Pilot draws per head that bound |o| from below (their cost counts), and the share
        of delta they spend (see ``stochattn.reference.budgets.pilot_size``).
    budget_norm : {"pilot", "student"}
        How the pilot bounds |o| from below: ``"pilot"`` (default) the worst-case bound,
        ``"student"`` the studentised bound along the pilot's direction (asymptotic;
        1.7-2.8x the oracle budget on SmolLM2 heads at ``pilot=512``, against 2.1-4.4x for
        the best-sized ``"pilot"``; ``pilot`` >= 4; docs/budgets.md).
    v_sqnorms : array, optional
        ||v_j||^2 per token kept beside the cache (:func:`stochattn.value_norms.value_sqnorms`;
        only with ``eps``). GPU: required, float32, (B, Hkv, N), or the V pool's shape
        without D for a paged cache. Reference: optional (computed from ``v``), (B, Hkv, N).
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
        Bernoulli estimate of q . k that reads only some key features (docs/estimators.md).
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
    plan = cached_plan(SantaPlan, device_of(q=q, k=k, v=v), budget=budget, sampler=sampler,
                       schedule=schedule, tile_size=tile_size, scores=scores,
                       bernoulli_draws=bernoulli_draws,
                       bernoulli_group_shared=bernoulli_group_shared,
                       softmax_scale=softmax_scale, check_finite=check_finite, eps=eps,
                       delta=delta, max_budget=max_budget, budget_rule=budget_rule,
                       pilot=pilot, pilot_share=pilot_share, budget_norm=budget_norm)
    call = dict(seed=seed, offset=offset)
    if v_sqnorms is not None:
        call["v_sqnorms"] = v_sqnorms
    return plan.dispatch(q, k, v, seq_lens, val.check_bool("return_diagnostics", return_diagnostics),
                         call)


def _santa_reference(q, k, v, seq_lens, plan, seed, offset, diagnose, v_sqnorms=None):
    from ._backend import backend_of

    backend_of(q=q, k=k, v=v, seq_lens=seq_lens)  # host seq_lens only, for the reference
    shape = val.check_attention_inputs(q, k, v, seq_lens)
    tiles = -(-shape.tokens // plan.tile_size)
    # Error-targeted budgets: the memory bound is the cap (every head may hit it).
    name, S = ("budget", plan.budget) if plan.eps is None else ("max_budget", plan.max_budget)
    val.check_reference_memory(
        name, S,
        8 * shape.batch * shape.q_heads * (S + tiles) * (shape.head_dim + 3),
        "8 B x batch x q_heads x (budget + tiles) x (head_dim + 3): points, indices, V rows")
    scale = val.check_scale(plan.softmax_scale, shape.head_dim)
    if plan.check_finite:
        val.check_finite(q=q, k=k, v=v)
    choice = None
    if plan.eps is not None:
        from .reference.budgets import santa_attention_targeted

        res, choice = santa_attention_targeted(
            q, k, v, seq_lens, scale, eps=plan.eps, delta=plan.delta,
            max_budget=plan.max_budget, rule=plan.budget_rule, norm=plan.budget_norm,
            pilot=plan.pilot,
            pilot_share=plan.pilot_share, sampler=plan.sampler, schedule=plan.schedule,
            tile_size=plan.tile_size, seed=seed, offset=offset,
            v_sqnorms=_reference_sqnorms(v_sqnorms, shape))
    else:
        res = _ref.santa_attention(q, k, v, seq_lens, scale, budget=plan.budget,
                                   sampler=plan.sampler, schedule=plan.schedule,
                                   tile_size=plan.tile_size, seed=seed, offset=offset,
                                   scores=plan.scores, bernoulli_draws=plan.bernoulli_draws,
                                   bernoulli_group_shared=plan.bernoulli_group_shared)
    out = finish(res.out, q.dtype)
    if not diagnose:
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
        budget=None if choice is None else choice.budget,
        budget_capped=None if choice is None else choice.capped,
        error_bound=None if choice is None else choice.error_bound,
        budget_pilot=None if choice is None else (
            choice.pilot * (choice.second_moment > 0)).astype(np.int64),
    )
    return out, diag


def _reference_sqnorms(v_sqnorms, shape):
    """The reference's ||v_j||^2: None (computed from v in float64), or the caller's
    (B, Hkv, N) NumPy array (a paged cache's pool-shaped norms are not taken: the reference
    reads a contiguous copy of the cache and computes them)."""
    if v_sqnorms is None:
        return None
    if not isinstance(v_sqnorms, np.ndarray):
        raise TypeError(f"`v_sqnorms` must be a NumPy array on the reference, got "
                        f"{type(v_sqnorms).__name__}")
    want = (shape.batch, shape.kv_heads, shape.tokens)
    if tuple(v_sqnorms.shape) != want:
        raise ValueError(f"`v_sqnorms` must have shape {want} (B, Hkv, N) on the reference, got "
                         f"{tuple(v_sqnorms.shape)}")
    return v_sqnorms


@in_callers_framework()
def _santa_cuda(q, k, v, seq_lens, plan, seed, offset, return_diagnostics, out=None,
                workspace=None, v_sqnorms=None):
    """GPU arrays: the S²ANTA-prop (exact or Bernoulli scores) and S²ANTA-flash kernels.
    ``k`` may be a GPU PagedKV (``v``, ``seq_lens`` None): both schedules read it in place.
    ``out`` and ``workspace`` go to the kernels' host modules (None: allocated)."""
    require_cupy("santa_attention")
    paged = is_paged(k)
    if plan.check_finite:
        # A paged cache's pools are not checked: their unused pages and slots may hold
        # anything (the kernels never read them).
        val.check_finite(q=q) if paged else val.check_finite(q=q, k=k, v=v)
    if plan.eps is not None:
        return _santa_cuda_targeted(q, k, v, seq_lens, plan, seed, offset, return_diagnostics,
                                    out, workspace, v_sqnorms)
    budget = plan.budget
    common = dict(budget=budget, sampler=plan.sampler, tile_size=plan.tile_size, seed=seed,
                  offset=offset, softmax_scale=plan.softmax_scale,
                  check_seq_lens=plan.check_finite, out=out, workspace=workspace)
    if plan.schedule == "prop":
        from .cuda import santa_prop

        bern = plan.scores == "bernoulli"
        if bern:
            common.update(scores=plan.scores, bernoulli_draws=plan.bernoulli_draws,
                          bernoulli_group_shared=plan.bernoulli_group_shared,
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
    return out, _cuda_diagnostics(host_ints(idx), k, seq_lens, extra)


def _cuda_diagnostics(idx, k, seq_lens, extra):
    """Diagnostics of a GPU call from its host indices (B, Hq, *) (-1: no draw)."""
    B = idx.shape[0]
    if is_paged(k):
        Hkv, N = k.kv_heads, k.token_bound
        lens = np.clip(host_ints(k.seq_lens), 0, N)  # as the kernels clamp them
    else:
        Hkv, N = int(k.shape[1]), int(k.shape[2])
        lens = np.full(B, N, dtype=np.int64) if seq_lens is None else host_ints(seq_lens)
    groups = idx.reshape(B, Hkv, -1)  # the draws of every query head of a KV group
    v_rows = np.array([[np.unique(g[g >= 0]).size if lens[b] > 0 else 0
                        for g in groups[b]] for b in range(B)], dtype=np.int64)
    return Diagnostics(seq_lens=lens, k_rows_read=np.repeat(lens[:, None], Hkv, axis=1),
                       v_rows_read=v_rows, **extra)


def _santa_cuda_targeted(q, k, v, seq_lens, plan, seed, offset, return_diagnostics, out,
                         workspace, v_sqnorms):
    """Error-targeted budgets on the GPU (S²ANTA-prop; stochattn.cuda.santa.santa_prop_targeted):
    the budgets are chosen on the device. Diagnostics copy the indices and the budgets to
    the host (a synchronisation); ``v_rows_read`` counts the main draws (not the pilot's),
    as the reference does."""
    from .cuda.santa import santa_prop_targeted

    res = santa_prop_targeted(q, k, v, seq_lens, v_sqnorms=v_sqnorms, eps=plan.eps,
                              delta=plan.delta, max_budget=plan.max_budget,
                              rule=plan.budget_rule, norm=plan.budget_norm, pilot=plan.pilot,
                              pilot_share=plan.pilot_share, sampler=plan.sampler,
                              tile_size=plan.tile_size, seed=seed, offset=offset,
                              softmax_scale=plan.softmax_scale,
                              check_seq_lens=plan.check_finite,
                              return_indices=return_diagnostics,
                              return_budgets=return_diagnostics, out=out, workspace=workspace)
    if not return_diagnostics:
        return res
    out, idx, _pilot_idx, dev = res
    budget = host_ints(dev.budget).astype(np.int64)
    extra = dict(budget=budget, budget_capped=host_ints(dev.capped).astype(bool),
                 error_bound=host_floats(dev.error_bound),
                 budget_pilot=np.where(budget > 0, plan.pilot, 0).astype(np.int64))
    return out, _cuda_diagnostics(host_ints(idx), k, seq_lens, extra)
