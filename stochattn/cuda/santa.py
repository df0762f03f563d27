"""S²ANTA-prop on the GPU: logits, tile statistics, sampling and gather (santa_prop.cu).

Caches: contiguous ``(B, Hkv, N, D)`` K and V, or a GPU :class:`stochattn.paged.PagedKV`
(FlashInfer's layout, read in place through the page table; ``N`` is then its
``token_bound``, the host-known bound of the lengths, so an engine passes ``max_tokens``).
The same tokens and N give the same draws and output, paged or contiguous, bit for bit.

Workspace of one call (``_PropPlan.scratch_bytes``; each piece rounded up to 256 bytes),
with rows = B Hq, T = ceil(N / tile_size), n_pad = T tile_size, S the budget:

    4 rows n_pad             the fp32 logit stash (pass 1 -> tiles -> step d of pass 3)
  + 4 rows T + 4 rows T      tile max m_t and sum l_t (fp32)
  + 8 rows T                 the tile prefix C_t (float64)
  + 8 rows (S + 1)           iid points (float64; 8 bytes for the other samplers)
  + 4 rows S                 drawn rows (int32)
  + 4 rows D + 4 B Hkv D + 4 B Hkv + 4 rows
                             Bernoulli scores: q_hat, the group's features and count,
                             the feature fractions (always laid out; small)

The stash dominates: 4 B Hq N bytes, 537 MB at B = 32, Hq = 32, N = 128k (the K cache of
that batch at Hkv = 8, D = 128 is 2.1 GB). It stays fp32 and whole: step d inverts the CDF
inside a tile by walking the stashed logits, and the drawn indices are fixed by the very
fp32 values pass 1 computed (tests/gpu/test_cuda_santa.py holds them to the reference's).
A narrower stash, or recomputing the drawn tiles' logits in another reduction order, would
move draws at CDF boundaries; recomputing them in pass 1's own order (the same mma or dot
sequence, for the at most min(S, T) tiles that hold points) would drop the stash, but is
a change of the sampling kernel's design, not done here. With a paged cache N is the
cache's ``token_bound``: pass ``max_tokens`` (the engine's context limit), not more.

``santa_prop(..., out=, workspace=)``: the output written into ``out`` (checked) and the
scratch taken from ``workspace`` (a kept :class:`.runtime.workspace.Workspace` or a uint8
GPU array): then a call allocates nothing, copies nothing to the host and does not
synchronise. The optional outputs (``return_indices``, ``return_feature_fraction``) are
still allocated per call (they are not the serving path).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from .. import _validation as val
from ..spec import PURPOSE_VALUE_SAMPLER, SAMPLERS
from . import kernels
from .kernels import abi
from .runtime import inputs, launch, pages
from .runtime import workspace as _workspace
from .config import get_config
from .kernels import group_max

__all__ = ["santa_prop", "santa_prop_targeted", "DeviceBudgets", "TILE_SIZES", "KERNELS",
           "workspace_bytes", "targeted_workspace_bytes"]

_FAMILY = "santa_prop"
# Block sizes and work per CTA that the kernels were compiled for (santa_prop.cu,
# bernoulli.cuh), read from the sources.
_SAMPLE_THREADS = abi.constant(_FAMILY, "kSampleThreads")
_TILE_THREADS = abi.constant(_FAMILY, "kTileThreads")
_TILE_LOGITS_PER_CTA = (abi.constant(_FAMILY, "kTileWarps") * abi.constant(_FAMILY, "kTileChunks")
                        * abi.constant(_FAMILY, "kChunkLogits"))
_QHAT_THREADS = abi.constant(_FAMILY, "kQhatThreads")
_FM_THREADS = abi.constant(_FAMILY, "kFmThreads")
_FM_TOKENS_PER_PASS = _FM_THREADS * abi.constant(_FAMILY, "kFmTokens")
_SCORES = ("exact", "bernoulli")
# The per-call arguments of the packed launches: santa_prop_logits (q_hat for q with
# Bernoulli scores), santa_prop_logits_tc, santa_prop_tiles, santa_prop_sample. Every one
# takes the page table (kernels/kv_rows.cuh; runtime.pages.page_args, zeros for contiguous
# caches) after seq_lens.
PAGE_VARIABLE = pages.PageArgs._fields
_LOGITS_VARIABLE = ("qv", "k", "seq_lens") + PAGE_VARIABLE + ("logits",)
_LOGITS_TC_VARIABLE = ("q", "k", "seq_lens") + PAGE_VARIABLE + ("logits", "tile_m", "tile_l")
# The page table last: a caller that passes only the first four (Double-P's sampled
# variant, on its own lengths) leaves it at zero, i.e. lengths from seq_lens.
_TILES_VARIABLE = ("logits", "seq_lens", "tile_m", "tile_l") + PAGE_VARIABLE
# santa_prop_sample's per-call arguments before its page table (PAGE_VARIABLE, which a
# launch binds after these and any others it adds, and passes last).
SAMPLE_VARIABLE = ("v", "seq_lens", "logits", "tile_m", "tile_l", "C", "iid_points", "idx32",
                   "idx_out", "out", "seed", "offset", "seed_ptr", "offset_ptr", "streams")
TILE_SIZES = (32, 64, 128, 256)
# Pass 1 with exact scores: "simt" (santa_prop_logits on the CUDA cores, then the
# santa_prop_tiles launch) or "tc" (santa_prop_logits_tc: mma.sync, tile statistics in the
# same pass). The default with exact scores is "tc"; Bernoulli scores have only "simt".
KERNELS = ("simt", "tc")


def santa_prop(q, k, v, seq_lens=None, *, budget, sampler="systematic", tile_size=64, seed=0,
               offset=0, softmax_scale=None, return_indices=False, num_chunks=None,
               check_seq_lens=False, scores="exact", bernoulli_draws=4,
               bernoulli_group_shared=False, k_feature_major=None, return_feature_fraction=False,
               kernel=None, out=None, workspace=None):
    """S²ANTA-prop estimate of one decode step on the GPU: ``(1/S) sum_m v[J_m]``.

    The S points of ``sampler`` (the reference's global points: Philox stream row
    ``b * Hq + h``, stream 0) are split over tiles of ``tile_size`` tokens by the tile
    masses and inverted inside their tiles, so the indices J equal
    ``stochattn.reference.santa.prop_indices`` up to rounding at CDF boundaries (the
    logits are fp32 here, float64 there). Unbiased. Tiles holding no point read no V.

    Parameters
    ----------
    q : GPU array, shape (B, Hq, D), float16 or bfloat16
    k, v : GPU array, shape (B, Hkv, N, D), dtype of ``q``
        Contiguous; ``Hq // Hkv <= 8``; D is 64 or 128. Or ``k`` a GPU
        :class:`stochattn.paged.PagedKV` and ``v`` None (pages read in place; N is its
        ``token_bound``; int32 page tables, page sizes 1 to 128, NHD or HND).
    seq_lens : integer array, shape (B,), optional
        Sequence lengths; 0 gives a zero row. Host values are checked on the host; GPU
        values are not checked (no synchronisation) unless ``check_seq_lens=True``, and the
        kernels clamp them to [0, N], so a bad value never reads outside the cache. None
        with a paged cache (its page table holds the lengths).
    budget : int
        S sample points per (sequence, query head), 1 <= S <= 2**30.
    sampler : {"systematic", "stratified", "iid"}
    tile_size : int
        Tokens per tile: 32, 64, 128 or 256.
    seed : int
        In [0, 2**64).
    offset : int
        In [0, 2**32).
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    return_indices : bool
        Also return the sampled token indices.
    num_chunks : int, optional
        Token-axis split of the logits kernel (tests and tuning); default fills the GPU.
    check_seq_lens : bool
        Check GPU ``seq_lens`` values against [0, N] (one device-to-host copy and a sync).
    scores : {"exact", "bernoulli"}
        Score stage. ``"bernoulli"``: the logits are ``scale * s_hat`` with s_hat the
        Bernoulli qK^T estimate of :func:`stochattn.bernoulli.bernoulli_scores` (same
        random stream as the reference, so the same features are kept). The scores are
        unbiased, the softmax of them is not: the output is then a biased estimate of o.
    bernoulli_draws : int
        Draws of the ternary query (>= 1); only with ``"bernoulli"``.
    bernoulli_group_shared : bool
        One feature pattern per KV head from the group's mean |q| ("mean group query");
        only with ``"bernoulli"``.
    k_feature_major : GPU array, shape (B, Hkv, D, L), dtype of ``k``, optional
        The keys again in a feature-major layout (``k.transpose(-1, -2)`` made contiguous,
        L >= N a multiple of 8 tokens; only the first N are read). With ``"bernoulli"``
        the score stage then reads only the rows of kept features, which is where the
        skipped features save memory traffic; without it the token-major ``k`` is read
        with the 16-byte pieces no head keeps skipped.
    return_feature_fraction : bool
        Also return the fraction of the D key features each query head reads (B, Hq),
        float32 (all ones for exact scores); only with ``"bernoulli"``.
    kernel : {"simt", "tc"}, optional
        Pass 1 (logits and tile statistics) with exact scores: "tc" on the tensor cores
        (mma.sync m16n8k16, fp32 accumulate, the tile statistics in the same pass), "simt"
        on the CUDA cores (fp32 dot products, then a second launch for the tile
        statistics). Default (None): "tc" with exact scores, "simt" with Bernoulli scores
        (the only one they have). The sampling and gather are the same for both.
    out : GPU array, shape (B, Hq, D), dtype of ``q``, optional
        Written and returned instead of a fresh output (contiguous, on q's GPU, q's
        framework).
    workspace : Workspace or 1-D uint8 GPU array, optional
        The call's scratch (:func:`workspace_bytes` bytes; see the module docstring); None
        allocates it. With ``out`` and a large enough workspace nothing is allocated
        (indices and feature fractions, when asked for, still are).

    Returns
    -------
    out : GPU array, shape (B, Hq, D), dtype of ``q``, caller's framework
    indices : GPU array of int64, shape (B, Hq, S), only with ``return_indices``
        Token index of every point, sorted along S (the points are sorted); 0 for empty
        sequences.
    feature_fraction : GPU array of float32, shape (B, Hq), only with
        ``return_feature_fraction`` (after ``indices`` when both are asked for).

    Examples
    --------
    >>> import cupy as cp
    >>> q = cp.random.standard_normal((1, 32, 128)).astype(cp.float16)
    >>> k = cp.random.standard_normal((1, 8, 4096, 128)).astype(cp.float16)
    >>> santa_prop(q, k, k, budget=256, seed=1).shape
    (1, 32, 128)
    """
    seed, offset = inputs.check_stream_words(seed, offset)
    inp = inputs.gather(q, k, v)
    kfm_meta = None
    if k_feature_major is not None:
        if not isinstance(inp, inputs.Inputs):
            raise ValueError("`k_feature_major` has no paged form: with a paged cache (`k` a "
                             "PagedKV) the Bernoulli score stage reads the token-major pages "
                             "(pass k_feature_major=None)")
        k_feature_major = _feature_major_input(inp, k_feature_major)
        kfm_meta = inp.ops.meta(k_feature_major)
    cfg = get_config(inp.device)
    # Every option is in the key with its type (True and 1 are different keys); a miss
    # validates them all in the plan's constructor, so a hit needs no checks.
    opts = (budget, sampler, tile_size, softmax_scale, num_chunks, return_indices, scores,
            bernoulli_draws, bernoulli_group_shared, return_feature_fraction, kernel)
    key = ("santa_prop", inp.key, kfm_meta, cfg, tuple(type(o) for o in opts), opts)
    plan = inputs.cached_plan(key, lambda: _PropPlan.build(inp, kfm_meta, cfg, *opts))
    return plan.run(inp, seq_lens, check_seq_lens, seed, offset, bool(return_indices),
                    k_feature_major, out, workspace)


def workspace_bytes(batch, q_heads, kv_heads, tokens, head_dim, budget, *, tile_size=64,
                    sampler="systematic") -> int:
    """Scratch bytes of one :func:`santa_prop` call (the module docstring's formula): what
    a ``workspace=`` array must hold. ``tokens``: N (a paged cache's ``token_bound``)."""
    rows, groups = batch * q_heads, batch * kv_heads
    n_tiles = math.ceil(tokens / tile_size)
    return launch.layout(_scratch_sizes(rows, groups, n_tiles * tile_size, n_tiles, budget,
                                        head_dim, sampler))[1]


def _scratch_sizes(rows, groups, n_pad, n_tiles, S, D, sampler) -> tuple:
    """Bytes of the scratch pieces: logits (f32, rows x n_pad), tile_m and tile_l (f32,
    rows x n_tiles), C (f64, rows x n_tiles), iid points (f64, rows x (S + 1); iid only),
    idx32 (i32, rows x S); for Bernoulli scores q_hat (f32, rows x D), the group's feature
    list (i32, groups x D) and count (i32, groups), and the feature fractions when not
    returned (f32, rows)."""
    return (4 * rows * n_pad, 4 * rows * n_tiles, 4 * rows * n_tiles, 8 * rows * n_tiles,
            8 * rows * (S + 1) if sampler == "iid" else 8, 4 * rows * S,
            4 * rows * D, 4 * groups * D, 4 * groups, 4 * rows)


class _ScoreStage(NamedTuple):
    """The score stage of one santa_prop configuration (part of the plan key)."""

    bernoulli: bool
    draws: int
    group_shared: bool
    kfm_meta: object  # ops.meta of the feature-major keys, or None (token-major reads)
    want_frac: bool

    @staticmethod
    def of(scores, draws, group_shared, kfm_meta, want_frac):
        val.check_choice("scores", scores, _SCORES)
        draws = check_draws("bernoulli_draws", draws)
        group_shared = val.check_bool("bernoulli_group_shared", group_shared)
        bern = scores == "bernoulli"
        if not bern and (kfm_meta is not None or want_frac):
            raise ValueError("`k_feature_major` and `return_feature_fraction` need "
                             "scores='bernoulli'")
        return _ScoreStage(bern, draws if bern else 0, group_shared and bern, kfm_meta, want_frac)


def _pass1_tiling(kernel, score, tc_tiling):
    """The tensor-core tiling of pass 1, or None for the CUDA-core kernels."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {', '.join(map(repr, KERNELS))} or None, "
                         f"got {kernel!r}")
    if score.bernoulli:
        if kernel == "tc":
            raise ValueError("`kernel='tc'` needs scores='exact' (the Bernoulli score stage runs "
                             "on the CUDA cores)")
        return None
    return None if kernel == "simt" else tc_tiling


def check_draws(name, draws) -> int:
    """Bernoulli draws: a positive int whose draw counter i * D + j fits in 32 bits."""
    draws = val.check_positive_int(name, draws)
    if draws >= 2**31 // 128:
        raise ValueError(f"`{name}` must be below {2**31 // 128}, got {draws}")
    return draws


def _feature_major_input(inp, kfm):
    """``kfm`` as a contiguous array of ``inp``'s framework (shape checked in the plan)."""
    ops = inp.ops
    if inputs.ops_for("k_feature_major", kfm) is not ops:
        raise TypeError("`k_feature_major` must come from the framework of `k`")
    return ops.contiguous("k_feature_major", kfm)


class _PropPlan:
    """Everything one configuration of :func:`santa_prop` needs, resolved once."""

    @classmethod
    def build(cls, inp, kfm_meta, cfg, budget, sampler, tile_size, softmax_scale,
              num_chunks, return_indices, scores, draws, group_shared, want_frac, kernel):
        """Validate the options of one configuration and build its plan."""
        want_frac = val.check_bool("return_feature_fraction", want_frac)
        score = _ScoreStage.of(scores, draws, group_shared, kfm_meta, want_frac)
        tiling = _pass1_tiling(kernel, score, cfg.prop_tc_tiling)
        return cls(inp, budget, sampler, tile_size, softmax_scale, num_chunks, cfg, score,
                   tiling)

    def __init__(self, inp, budget, sampler, tile_size, softmax_scale, num_chunks, cfg, score,
                 tiling=None):
        """``cfg``: the device's :class:`.config.GpuConfig`; ``tiling``: its
        ``prop_tc_tiling`` for pass 1 on the tensor cores, None for the CUDA cores."""
        config = cfg.tiling
        S = inputs.check_gpu_budget(budget)
        val.check_choice("sampler", sampler, SAMPLERS)
        if not isinstance(tile_size, (int, np.integer)) or isinstance(tile_size, bool):
            raise TypeError(f"`tile_size` must be an integer, got {type(tile_size).__name__}")
        if int(tile_size) not in TILE_SIZES:
            raise ValueError(f"`tile_size` must be one of {TILE_SIZES} on the GPU, got {tile_size}")
        ts = int(tile_size)
        s, scale, self.device, dtype_name = inputs.base_plan(inp, softmax_scale)
        num_chunks = inputs.check_num_chunks(num_chunks)
        if s.batch * s.q_heads >= 2**28:
            raise ValueError(f"`q` batch * heads must be below 2**28 (random-stream rows), got "
                             f"{s.batch * s.q_heads}")
        self.shape, self.S, self.tiling = s, S, tiling
        ctype = kernels.CTYPES[dtype_name]
        n_tiles = math.ceil(s.tokens / ts)
        n_pad = n_tiles * ts
        rows = s.batch * s.q_heads
        self.threads1 = config.threads
        gm = group_max(s.group)
        smem1 = config.smem_bytes("santa_prop", s.head_dim, gm)
        self.score = score
        if score.kfm_meta is not None:
            _check_feature_major(score.kfm_meta, inp, s, self.device)
        k = functools.partial(abi.kernel, _FAMILY)
        with inputs.device_scope(self.device):
            if tiling is None:
                decl1 = k("santa_prop_logits")
                name1 = decl1.expr(T=ctype, D=s.head_dim, GMAX=gm, QHAT=score.bernoulli)
                align = config.tile_rows(s.head_dim)
            else:  # tile statistics in pass 1: chunks hold whole sampling tiles
                decl1 = k("santa_prop_logits_tc")
                name1 = decl1.expr(T=ctype, D=s.head_dim, **tiling.params())
                smem1, align = tiling.smem_bytes(s.head_dim), max(tiling.align(), ts)
                self.threads1 = tiling.threads
            # First use: compile the plan's kernels in parallel threads, not one by one.
            names = [name1, k("santa_prop_sample").expr(T=ctype, D=s.head_dim)]
            if tiling is None:
                names.append(k("santa_prop_tiles").expr())
            if score.bernoulli:
                names.append(k("bernoulli_qhat").expr(T=ctype))
            if score.kfm_meta is not None:
                names.append(k("bernoulli_logits_fm").expr(T=ctype, GMAX=gm))
            launch.prefetch(_FAMILY, names, cfg)
            logits = launch.launcher(_FAMILY, name1, smem1, cfg)
            chunks, chunk_len = launch.split_tokens(_FAMILY, name1, smem1, cfg,
                                                     s.batch * s.kv_heads, s.tokens, align,
                                                     num_chunks, threads=self.threads1)
            if score.bernoulli:
                self.qhat_decl = k("bernoulli_qhat")
                self.qhat = launch.launcher(_FAMILY, self.qhat_decl.expr(T=ctype), 0, cfg)
            if score.kfm_meta is not None:
                self.fm_decl = k("bernoulli_logits_fm")
                name_fm = self.fm_decl.expr(T=ctype, GMAX=gm)
                self.logits_fm = launch.launcher(_FAMILY, name_fm, 0, cfg)
                fm_chunks, self.fm_chunk_len = launch.split_tokens(
                    _FAMILY, name_fm, 0, cfg, s.batch * s.kv_heads, s.tokens,
                    _FM_TOKENS_PER_PASS, None)
                self.grid_fm = (fm_chunks, s.kv_heads, s.batch)
            tiles = launch.launcher(_FAMILY, k("santa_prop_tiles").expr(), 0, cfg) \
                if tiling is None else None
            sample = launch.launcher(_FAMILY, k("santa_prop_sample").expr(T=ctype, D=s.head_dim),
                                      0, cfg)
        self.chunks, self.chunk_len = chunks, chunk_len
        self.grid1 = (chunks, s.kv_heads, s.batch)
        self.grid_tiles = (rows, math.ceil(n_pad / _TILE_LOGITS_PER_CTA))
        self.grid2 = (rows,)
        self.out_shape = (s.batch, s.q_heads, s.head_dim)
        self.idx_shape = (s.batch, s.q_heads, S)
        # One scratch buffer (the module docstring's formula; _scratch_sizes).
        sizes = _scratch_sizes(rows, s.batch * s.kv_heads, n_pad, n_tiles, S, s.head_dim,
                               sampler)
        self.offsets, self.scratch_bytes = launch.layout(sizes)
        self.scale, self.n_pad = scale, n_pad
        self.frac_shape = (s.batch, s.q_heads)
        # Packed launches of the exact-scores path (the Bernoulli stage's simt logits launch
        # has the same layout with q_hat for q); the pointers, the seed and the offset
        # change per call.
        p = launch.Packed
        pass1 = dict(Hkv=s.kv_heads, G=s.group, N=s.tokens, chunk_len=chunk_len, n_pad=n_pad,
                     scale=scale)
        if tiling is not None:
            self.logits = p(logits, self.grid1, (self.threads1,),
                            decl1.bind(_LOGITS_TC_VARIABLE, n_tiles=n_tiles, tile_size=ts, **pass1))
        else:
            # (after the q_hat launch with Bernoulli scores: a dependent launch there)
            self.logits = p(logits, self.grid1, (self.threads1,),
                            decl1.bind(_LOGITS_VARIABLE, **pass1),
                            pdl=config.pdl and score.bernoulli)
        # The second and later launches of a call may overlap the tail of the one before
        # (programmatic dependent launch, when config.pdl).
        self.tiles = None if tiles is None else p(
            tiles, self.grid_tiles, (_TILE_THREADS,),
            k("santa_prop_tiles").bind(_TILES_VARIABLE, Hq=s.q_heads, N=s.tokens, n_pad=n_pad,
                                       n_tiles=n_tiles, tile_size=ts), pdl=config.pdl)
        # SANTA's own output: purpose PURPOSE_VALUE_SAMPLER, no partial.
        self.sample = p(sample, self.grid2, (_SAMPLE_THREADS,),
                        k("santa_prop_sample").bind(
                            SAMPLE_VARIABLE + PAGE_VARIABLE, Hq=s.q_heads, G=s.group,
                            N=s.tokens, n_pad=n_pad,
                            n_tiles=n_tiles, tile_size=ts, S=S, sampler=sampler_code(sampler),
                            purpose=PURPOSE_VALUE_SAMPLER, part_o=0, part_ml=0, num_parts=0,
                            part=0),
                        pdl=config.pdl)

    def run(self, inp, seq_lens, check_seq_lens, seed, offset, return_indices, kfm, out=None,
            workspace=None):
        """Queue one call on the caller's stream. ``out`` and ``workspace``: see
        :mod:`.runtime.workspace` (None: allocated)."""
        ops = inp.ops
        s = self.shape
        score = self.score
        with inputs.device_scope(self.device):
            qp, kp, vp, lens, _keep, stream = inputs.launch_args(inp, seq_lens, check_seq_lens, s,
                                                                  self.device)
            pg = pages.page_args(inp)
            rs, _keep_rs = inputs.stream_args(inp, seed, offset, s.batch, self.device)
            base, _scratch = _workspace.scratch(ops, inp.q, self.scratch_bytes, workspace,
                                                self.device)
            logits, tile_m, tile_l, C, iid, idx32, qhat, feat, nfeat, frac_slot = (
                base + o for o in self.offsets)
            out = _workspace.output(ops, inp.q, self.out_shape, None, out, self.device)
            outp = ops.ptr(out)
            indices = ops.empty(inp.q, self.idx_shape, "int64") if return_indices else None
            idxp = 0 if indices is None else ops.ptr(indices)  # null: no indices
            frac = ops.empty(inp.q, self.frac_shape, "float32") if score.want_frac else None
            if self.tiles is None:  # tensor cores: logits and tile statistics
                self.logits(stream, qp, kp, lens, *pg, logits, tile_m, tile_l)
            elif not score.bernoulli:
                self.logits(stream, qp, kp, lens, *pg, logits)
            else:
                fracp = ops.ptr(frac) if frac is not None else frac_slot
                self.qhat((s.kv_heads, s.batch), (_QHAT_THREADS,), self.qhat_decl.args_of(
                    q=qp, qhat=qhat, feat=feat, nfeat=nfeat, frac=fracp, Hkv=s.kv_heads,
                    G=s.group, D=s.head_dim, draws=score.draws, group_shared=score.group_shared,
                    scale=self.scale, **rs._asdict()), stream)
                if kfm is None:
                    self.logits(stream, qhat, kp, lens, *pg, logits)
                else:
                    self.logits_fm(self.grid_fm, (_FM_THREADS,), self.fm_decl.args_of(
                        qhat=qhat, kfm=ops.ptr(kfm), feat=feat, nfeat=nfeat, seq_lens=lens,
                        logits=logits, Hkv=s.kv_heads, G=s.group, D=s.head_dim, N=s.tokens,
                        ld=score.kfm_meta[1][-1], chunk_len=self.fm_chunk_len,
                        n_pad=self.n_pad), stream)
            if self.tiles is not None:
                self.tiles(stream, logits, lens, tile_m, tile_l, *pg)
            self.sample(stream, vp, lens, logits, tile_m, tile_l, C, iid, idx32, idxp, outp, *rs,
                        *pg)
        res = (out,) + ((indices,) if return_indices else ()) + ((frac,) if frac is not None else ())
        return res if len(res) > 1 else out


def _check_feature_major(meta, inp, s, device):
    """The feature-major keys must be (B, Hkv, D, L) of k's dtype on k's device, L >= N and
    a multiple of 8 (16-byte rows of 8 tokens)."""
    dtype, shape, dev = meta
    if dev != device:
        raise ValueError(f"`k_feature_major` must be on the GPU of `k` ({device}), got {dev}")
    if dtype != inp.ops.meta(inp.k)[0]:
        raise TypeError(f"`k_feature_major` must have the dtype of `k`, got {dtype}")
    want = (s.batch, s.kv_heads, s.head_dim)
    if len(shape) != 4 or tuple(shape[:3]) != want or shape[3] < s.tokens or shape[3] % 8:
        raise ValueError(f"`k_feature_major` must have shape {want + ('L',)} with L >= {s.tokens} "
                         f"a multiple of 8, got {tuple(shape)}")


def sampler_code(sampler: str) -> int:
    """The kernels' code of a sampler (philox.cuh: enum Sampler, SAMPLER_<NAME>)."""
    return abi.enum(_FAMILY, "Sampler")["SAMPLER_" + sampler.upper()]


# ---- error-targeted budgets (docs/budgets.md, "GPU") ------------------------------------

class DeviceBudgets(NamedTuple):
    """The budgets of one :func:`santa_prop_targeted` call, as GPU arrays (B, Hq) of q's
    framework: ``budget`` (int32, S of the main draws, 0 for empty sequences), ``capped``
    (int32 0/1: the rule asked for more than ``max_budget``, or ||o|| could not be
    bounded), ``error_bound`` (float64: the relative tolerance the chosen S guarantees at
    delta; inf when L = 0), ``norm_sq_lower`` (float64 L^2) and ``second_moment`` (float64
    m2), as :class:`stochattn.reference.budgets.BudgetChoice` has them."""

    budget: object
    capped: object
    error_bound: object
    norm_sq_lower: object
    second_moment: object


# santa_prop_budgets' per-call arguments (its page table after seq_lens), and those of the
# pilot sets and the main sampling (santa_prop_sample_budgets; page table last).
_MOMENT_VARIABLE = (("logits", "tile_m", "seq_lens") + PAGE_VARIABLE
                    + ("sqnorms", "sq_page_stride", "sq_row_stride", "sq_head_stride", "parts"))
_BUDGETS_VARIABLE = (("tile_m", "seq_lens") + PAGE_VARIABLE
                     + ("parts", "pilot_o", "v", "pilot_b", "budgets", "capped", "error_bound",
                        "norm_sq_lower", "second_moment"))
# Tokens per CTA of santa_prop_second_moment (m2's sums split over the sequence).
_MOMENT_CHUNK = abi.constant(_FAMILY, "kMomentChunk")
# float64 fields per (row, chunk) of its sums: num, den, max ||v||^2, the positive-weight count.
MOMENT_FIELDS = abi.constant(_FAMILY, "kMomentFields")
_PILOT_VARIABLE = SAMPLE_VARIABLE + ("budgets", "part_o", "part_ml") + PAGE_VARIABLE
_MAIN_VARIABLE = SAMPLE_VARIABLE + ("budgets",) + PAGE_VARIABLE
_BUDGET_FIELDS = (("budget", "int32", 4), ("capped", "int32", 4), ("error_bound", "float64", 8),
                  ("norm_sq_lower", "float64", 8), ("second_moment", "float64", 8))
_NORMS_GPU = ("pilot", "student")


def santa_prop_targeted(q, k, v, seq_lens=None, *, v_sqnorms, eps, delta, max_budget,
                        rule="chebyshev", norm="pilot", pilot=64, pilot_share=0.25,
                        sampler="systematic", tile_size=64, seed=0, offset=0,
                        softmax_scale=None, return_indices=False, return_budgets=False,
                        check_seq_lens=False, kernel=None, out=None, workspace=None):
    """S²ANTA-prop with error-targeted budgets on the GPU: per (sequence, query head) the S
    of :func:`stochattn.reference.budgets.choose_budgets` (``norm="pilot"`` or
    ``"student"``), chosen on the device between pass 1 and the sampling, then the S-point
    estimate.

    Launches, all on the caller's stream, none reading anything back to the host:

    1. pass 1 as :func:`santa_prop` (logits stash, tile max m_t and sum l_t);
    2. the pilot: ``santa_prop_sample_budgets`` (no budgets array: a fixed S) with
       ``pilot`` stratified points on purpose PURPOSE_BUDGET_PILOT (stream 0, row
       b * Hq + h), writing the fp32 mean o_p of the drawn rows (the reference's pilot
       draws, the same Philox points); with ``norm="student"`` two launches, set A
       (S_A = max(1, pilot // 4) points, stream 1: its mean o_A) and set B (the rest,
       stream 2: its drawn rows);
    3. ``santa_prop_second_moment`` (one CTA per row and 4096-token chunk: the sums of
       m2 = sum_j p_j ||v_j||^2 from the stash and ``v_sqnorms``), then
       ``santa_prop_budgets``: m2 from those sums (a fixed order), L (pilot: the closed
       form from ||o_p|| and m2; student: the studentised bound along o_A from B's rows,
       with the range guard from the largest ||v_j||), S per head into a device (B, Hq)
       int32 array, with the capped flag and the error bound;
    4. ``santa_prop_sample_budgets``: the main draws of every row with its own S (purpose
       0: a row with S draws exactly what a fixed-S call draws).

    The scratch is sized by ``max_budget`` (fixed by the plan), so the call is graph-safe
    with ``out=`` and a kept ``workspace=`` (and device seed / offset arrays).

    Parameters
    ----------
    q, k, v, seq_lens, sampler, tile_size, seed, offset, softmax_scale, check_seq_lens, \
kernel, out, workspace
        As in :func:`santa_prop` (exact scores only).
    v_sqnorms : GPU array of float32
        ||v_j||^2 beside the cache (:func:`stochattn.value_norms.value_sqnorms`):
        (B, Hkv, N) for a contiguous cache, the V pool's shape without D for a paged one.
        Contiguous, on q's GPU and framework. Required.
    eps, delta, max_budget, rule, pilot, pilot_share
        As in :func:`stochattn.reference.budgets.choose_budgets` (same checks, same
        messages). ``max_budget`` <= 2**30.
    norm : {"pilot", "student"}
        How ||o|| is bounded from below (docs/budgets.md); "student" needs pilot >= 4.
    return_indices : bool
        Also return the main draws' token indices, int64 (B, Hq, max_budget), row (b, h)
        holding its S indices then -1, and the pilot's, int64 (B, Hq, pilot) (student:
        set A's S_A indices, then set B's).
    return_budgets : bool
        Also return a :class:`DeviceBudgets` (fresh arrays; the kernel writes them).

    Returns
    -------
    out, then (indices, pilot_indices) with ``return_indices``, then DeviceBudgets with
    ``return_budgets``.
    """
    seed, offset = inputs.check_stream_words(seed, offset)
    inp = inputs.gather(q, k, v)
    cfg = get_config(inp.device)
    opts = (eps, delta, max_budget, rule, norm, pilot, pilot_share, sampler, tile_size,
            softmax_scale, bool(return_indices), bool(return_budgets), kernel)
    key = ("santa_prop_targeted", inp.key, cfg, tuple(type(o) for o in opts), opts)
    plan = inputs.cached_plan(key, lambda: _TargetedPlan(inp, cfg, *opts))
    return plan.run(inp, seq_lens, check_seq_lens, seed, offset, v_sqnorms, out, workspace)


def targeted_workspace_bytes(batch, q_heads, kv_heads, tokens, head_dim, max_budget, pilot, *,
                             tile_size=64, sampler="systematic") -> int:
    """Scratch bytes of one :func:`santa_prop_targeted` call: :func:`workspace_bytes` at
    S = ``max_budget`` plus, per (b, h) row, the pilot sets' means (8 D), their drawn rows
    (4 ``pilot``), their partials (16), the budgets (32) and m2's chunk sums (32 per 4096
    tokens); each piece rounded up to 256 bytes."""
    rows, groups = batch * q_heads, batch * kv_heads
    n_tiles = math.ceil(tokens / tile_size)
    return launch.layout(_scratch_sizes(rows, groups, n_tiles * tile_size, n_tiles, max_budget,
                                        head_dim, sampler)
                         + _targeted_sizes(rows, head_dim, pilot, tokens))[1]


def _targeted_sizes(rows, D, pilot, tokens) -> tuple:
    """pilot_o and pilot_o2 (f32 rows x D: the pilot's or set A's mean, and set B's),
    pilot_ml and pilot_ml2 (f32 rows x 2), the pilot's idx32 (i32 rows x pilot: set A's
    rows x S_A then set B's rows x S_B), m2's partial sums (f64 rows x chunks x 3), then the
    budget fields (_BUDGET_FIELDS, rows each)."""
    return ((4 * rows * D, 4 * rows * D, 8 * rows, 8 * rows, 4 * rows * pilot,
             8 * MOMENT_FIELDS * rows * moment_chunks(tokens))
            + tuple(n * rows for _, _, n in _BUDGET_FIELDS))


def moment_chunks(tokens) -> int:
    """CTAs per row of santa_prop_second_moment (chunks of kMomentChunk tokens)."""
    return max(1, math.ceil(tokens / _MOMENT_CHUNK))


def sqnorms_args(inp, v_sqnorms, shape, device) -> tuple:
    """(pointer, page stride, row stride, head stride) of checked ||v_j||^2 beside the cache
    (:func:`stochattn.value_norms.value_sqnorms`), as santa_prop_second_moment takes them:
    float32 (B, Hkv, N) for a contiguous cache (strides unused: 0), the V pool's shape
    without D for a paged one (its strides in elements). The one check of the norms for
    every error-targeted GPU path (S²ANTA-prop, Double-P's sampled variant)."""
    if v_sqnorms is None:
        raise ValueError("`v_sqnorms` is required with error-targeted budgets: ||v_j||^2 "
                         "per token as float32 beside the cache (stochattn.value_norms."
                         "value_sqnorms(v))")
    ops = inp.ops
    if not isinstance(inp, inputs.Inputs):  # a paged cache
        pool = tuple(int(n) for n in ops.meta(inp.v)[1])
        want = pool[:-1]
        P, a1, a2 = want
        # Contiguous (P, page_size, Hkv) ("NHD") or (P, Hkv, page_size) ("HND").
        strides = (a1 * a2, a2, 1) if inp.cache.layout == "NHD" else (a1 * a2, 1, a2)
    else:
        want, strides = (shape.batch, shape.kv_heads, shape.tokens), (0, 0, 0)
    ptr = _workspace._check_array("v_sqnorms", ops, v_sqnorms, want, "float32", device, align=4)
    return (np.uint64(ptr),) + strides


class _TargetedPlan:
    """One configuration of :func:`santa_prop_targeted`: a :class:`_PropPlan` sized by
    ``max_budget`` for pass 1 and the scratch, plus the pilot, budget and per-row sampling
    launches."""

    def __init__(self, inp, cfg, eps, delta, max_budget, rule, norm, pilot, pilot_share,
                 sampler, tile_size, softmax_scale, return_indices, return_budgets, kernel):
        from .. import budget_rules as _budgets
        from ..spec import PURPOSE_BUDGET_PILOT

        _budgets.check_options(eps, delta, max_budget, rule, norm, pilot, pilot_share)
        if norm not in _NORMS_GPU:
            raise ValueError("`norm` must be 'pilot' or 'student' ('oracle' reads all of V: a "
                             "yardstick of the reference, not an option)")
        inputs.check_gpu_budget(max_budget)
        inputs.check_gpu_budget(pilot)
        score = _ScoreStage.of("exact", 4, False, None, False)
        tiling = _pass1_tiling(kernel, score, cfg.prop_tc_tiling)
        # Pass 1, the scratch layout and max_budget's checks are prop's at S = max_budget.
        self.base = base = _PropPlan(inp, int(max_budget), sampler, tile_size, softmax_scale,
                                     None, cfg, score, tiling)
        s = base.shape
        self.shape, self.device = s, base.device
        self.max_budget, self.pilot = int(max_budget), int(pilot)
        self.return_indices, self.return_budgets = return_indices, return_budgets
        self.student = norm == "student"
        delta_pilot = float(pilot_share) * float(delta)
        delta_main = float(delta) - delta_pilot
        self.c_main = _budgets.tail_factor(rule, delta_main)
        if self.student:
            # (points, Philox stream) of the sets: A gives the direction, B the bound.
            self.sets = tuple(zip(_budgets.student_split(self.pilot), (1, 2)))
            k_pilot, z = 0.0, _budgets.student_z(delta_pilot)
        else:
            self.sets = ((self.pilot, 0),)
            k_pilot, z = _budgets.tail_factor(rule, delta_pilot) / self.pilot, 0.0
        self.eps = float(eps)
        self.paged = not isinstance(inp, inputs.Inputs)
        self.layout = inp.cache.layout if self.paged else None
        rows = s.batch * s.q_heads
        ts = int(tile_size)
        n_tiles = math.ceil(s.tokens / ts)
        n_pad = n_tiles * ts
        sizes = (_scratch_sizes(rows, s.batch * s.kv_heads, n_pad, n_tiles, self.max_budget,
                                s.head_dim, sampler)
                 + _targeted_sizes(rows, s.head_dim, self.pilot, s.tokens))
        self.offsets, self.scratch_bytes = launch.layout(sizes)
        self.rows = rows
        dtype_name = inputs.base_plan(inp, softmax_scale)[3]
        ctype = kernels.CTYPES[dtype_name]
        pdl = cfg.tiling.pdl
        p = launch.Packed
        decl = abi.kernel(_FAMILY, "santa_prop_sample_budgets")
        bdecl = abi.kernel(_FAMILY, "santa_prop_budgets")
        mdecl = abi.kernel(_FAMILY, "santa_prop_second_moment")
        with inputs.device_scope(self.device):
            sample = launch.launcher(_FAMILY, decl.expr(T=ctype, D=s.head_dim), 0, cfg)
            budgets = launch.launcher(_FAMILY, bdecl.expr(), 0, cfg)
            moment = launch.launcher(_FAMILY, mdecl.expr(), 0, cfg)
        common = dict(Hq=s.q_heads, G=s.group, N=s.tokens, n_pad=n_pad, n_tiles=n_tiles,
                      tile_size=ts)
        # The pilot sets: fixed S (no budgets array), stratified, purpose 4, each on its
        # Philox stream; the fp32 mean of their rows as a partial (no rounding to q's
        # dtype); their indices (when asked) side by side in one (B, Hq, pilot) array.
        self.pilot_launches = tuple(
            p(sample, base.grid2, (_SAMPLE_THREADS,),
              decl.bind(_PILOT_VARIABLE, max_budget=n, idx_ld=self.pilot, rng_stream=stream,
                        num_parts=1, part=0, skip_zero=0,
                        sampler=sampler_code("stratified"), purpose=PURPOSE_BUDGET_PILOT,
                        **common), pdl=pdl)
            for n, stream in self.sets)
        n_chunks = moment_chunks(s.tokens)
        self.moment_launch = p(moment, (n_chunks * rows,), (_SAMPLE_THREADS,),
                               mdecl.bind(_MOMENT_VARIABLE, n_chunks=n_chunks, **common),
                               pdl=pdl)
        self.budgets_launch = p(budgets, base.grid2, (_SAMPLE_THREADS,),
                                bdecl.bind(_BUDGETS_VARIABLE, D=s.head_dim, eps=self.eps,
                                           n_chunks=n_chunks,
                                           c_main=self.c_main, k_pilot=k_pilot,
                                           max_budget=self.max_budget,
                                           student=int(self.student),
                                           dtype=0 if dtype_name == "float16" else 1,
                                           S_B=self.sets[-1][0], z=z,
                                           **{k: v for k, v in common.items() if k != "n_pad"}),
                                pdl=pdl)
        self.main_launch = p(sample, base.grid2, (_SAMPLE_THREADS,),
                             decl.bind(_MAIN_VARIABLE, max_budget=self.max_budget,
                                       idx_ld=self.max_budget, rng_stream=0,
                                       sampler=sampler_code(sampler),
                                       purpose=PURPOSE_VALUE_SAMPLER, part_o=0, part_ml=0,
                                       num_parts=0, part=0, skip_zero=0,
                                       **common),
                             pdl=pdl)

    def _norms(self, inp, v_sqnorms):
        """(pointer, page stride, row stride, head stride) of the checked norms."""
        return sqnorms_args(inp, v_sqnorms, self.shape, self.device)

    def run(self, inp, seq_lens, check_seq_lens, seed, offset, v_sqnorms, out=None,
            workspace=None):
        ops = inp.ops
        s, base = self.shape, self.base
        with inputs.device_scope(self.device):
            norms = self._norms(inp, v_sqnorms)
            qp, kp, vp, lens, _keep, stream = inputs.launch_args(inp, seq_lens, check_seq_lens, s,
                                                                  self.device)
            pg = pages.page_args(inp)
            rs, _keep_rs = inputs.stream_args(inp, seed, offset, s.batch, self.device)
            ptr, _scratch = _workspace.scratch(ops, inp.q, self.scratch_bytes, workspace,
                                               self.device)
            (logits, tile_m, tile_l, C, iid, idx32, _qhat, _feat, _nfeat, _frac, pilot_o,
             pilot_o2, pilot_ml, pilot_ml2, pilot_idx, parts, *fields) = (
                 ptr + o for o in self.offsets)
            out = _workspace.output(ops, inp.q, base.out_shape, None, out, self.device)
            outp = ops.ptr(out)
            extra = ()
            idxp = pidxp = 0
            if self.return_indices:
                indices = ops.empty(inp.q, (s.batch, s.q_heads, self.max_budget), "int64")
                pilot_indices = ops.empty(inp.q, (s.batch, s.q_heads, self.pilot), "int64")
                idxp, pidxp = ops.ptr(indices), ops.ptr(pilot_indices)
                extra += (indices, pilot_indices)
            if self.return_budgets:
                arrays = [ops.empty(inp.q, (s.batch, s.q_heads), dt) for _, dt, _ in _BUDGET_FIELDS]
                fields = [ops.ptr(a) for a in arrays]
                extra += (DeviceBudgets(*arrays),)
            if base.tiles is None:  # tensor cores: logits and tile statistics
                base.logits(stream, qp, kp, lens, *pg, logits, tile_m, tile_l)
            else:
                base.logits(stream, qp, kp, lens, *pg, logits)
                base.tiles(stream, logits, lens, tile_m, tile_l, *pg)
            # The pilot sets: (idx32 region, its offset in the returned pilot indices,
            # partial); the last set's rows are what a studentised bound reads.
            at_idx, at_out = pilot_idx, 0
            for (n, _), launch_set, (po, pml) in zip(self.sets, self.pilot_launches,
                                                      ((pilot_o, pilot_ml),
                                                       (pilot_o2, pilot_ml2))):
                launch_set(stream, vp, lens, logits, tile_m, tile_l, C, iid, at_idx,
                           pidxp + 8 * at_out if pidxp else 0, outp, *rs, 0, po, pml, *pg)
                last_idx = at_idx
                at_idx += 4 * self.rows * n
                at_out += n
            self.moment_launch(stream, logits, tile_m, lens, *pg, *norms, parts)
            self.budgets_launch(stream, tile_m, lens, *pg, parts, pilot_o, vp, last_idx,
                                *fields)
            self.main_launch(stream, vp, lens, logits, tile_m, tile_l, C, iid, idx32, idxp, outp,
                             *rs, fields[0], *pg)
        return (out,) + extra if extra else out
