"""S²ANTA-flash on the GPU: per-tile draws merged with deferred weights (santa_flash.cu; the
tile logits on the tensor cores with ``kernel="tc"``: santa_flash_tc.cu).

Caches: contiguous ``(B, Hkv, N, D)`` K and V, or a GPU :class:`stochattn.paged.PagedKV`
(FlashInfer's layout, NHD or HND, page sizes 1 to 128, int32 page tables) read in place
through the page table; ``N`` is then its ``token_bound`` (the host-known bound of the
lengths: an engine passes ``max_tokens``). The same tokens, N, seed and offset give the same
draws and the same output bit for bit, paged or contiguous.

Workspace of one call (:func:`workspace_bytes`; the plan's ``scratch_bytes``): with
``rows = B Hq`` and C chunks per (sequence, KV head) stream,

    0                                          when C = 1 (the chunk writes ``out`` itself)
    align256(4 rows C D) + 8 rows C            otherwise: the fp32 chunk partials, then
                                               their (max, sum) pairs

as exact decode (the same merge). C is chosen per device to fill it in whole waves, with
chunks of whole sampling tiles: at most ``ceil(N / max(256, tile_size))`` and at most
``4 slots / (B Hkv) + 1`` (slots: resident CTAs of the GPU), so the workspace is at most
about ``(4 D + 8) (4 slots G + B Hq)`` bytes whatever N (a few MB). The draws need no
scratch (they are counted in shared memory). With in-kernel merging (the default) the plan
also keeps B Hkv int32 arrival counters per CUDA stream, allocated on the first call on
that stream.

``santa_flash(..., out=, workspace=)``: the output is written into ``out`` (checked) and the
partials come from ``workspace`` (a kept :class:`.runtime.workspace.Workspace` or a uint8
GPU array of at least :func:`workspace_bytes` bytes): then a call on a stream it has run on
before allocates nothing, copies nothing to the host and does not synchronise (seed and
offset as ints or GPU arrays). The optional outputs (``return_indices``,
``return_tile_stats``) are still allocated per call (they are not the serving path).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .. import _validation as val
from ..spec import SAMPLERS
from . import kernels
from .kernels import abi
from .runtime import inputs, launch
from .runtime.arrays import to_host
from .kernels import group_max
from .config import flash_tc_smem_bytes, get_config, smem_limit
from .santa import sampler_code

__all__ = ["santa_flash", "workspace_bytes", "FlashTileStats", "flash_diagnostics", "TILE_SIZES",
           "KERNELS"]

_FAMILY = "santa_flash"
_FAMILY_TC = "santa_flash_tc"
# Step 1 (the tile's logits): "simt" on the CUDA cores (santa_flash.cu) or "tc" on the
# tensor cores (santa_flash_tc.cu, tilings config.FLASH_TC_TILINGS); same draws, same
# estimator. The default stays "simt" until tools/tune_flash.py has timed "tc" on the GPU.
KERNELS = ("simt", "tc")
DEFAULT_KERNEL = "simt"
# The chunk kernels' per-call arguments (santa_flash_chunk and santa_flash_tc_chunk take
# the same arguments): the split-KV ones (inputs, page table, output, partials), then the
# optional outputs and the random stream.
_CHUNK_VARIABLE = launch.SPLIT_KV_VARIABLE + ("idx_out", "tile_m_out", "tile_l_out",
                                              "samples_out", "seed", "offset", "seed_ptr",
                                              "offset_ptr", "streams")
# At most G * S_t <= 8 * 2**27 draws per tile share one int32 counter (santa_flash.cu).
FLASH_MAX_BUDGET = 2**27
# Powers of two from 32 up to flash_tile.cuh's kFlashMaxTile.
TILE_SIZES = tuple(32 << i for i in range((abi.constant(_FAMILY, "kFlashMaxTile") // 32)
                                          .bit_length()))


class FlashTileStats(NamedTuple):
    """Per-tile statistics of one :func:`santa_flash` call (GPU arrays, caller's framework).

    Attributes
    ----------
    tile_max : shape (B, Hq, T), float32
        m_t, the max logit ``softmax_scale * q . k`` of each tile (natural-log units);
        -inf for tiles past the sequence. T = ceil(N / tile_size).
    tile_sum : shape (B, Hq, T), float32
        l_t = sum over the tile of exp(x - m_t) (the last entry of the tile-local CDF the
        draws were inverted through); 0 for tiles past the sequence.
    samples : shape (B,), int32
        S_t = ceil(S / T_L) draws of every tile of sequence b, T_L = ceil(L_b / tile_size);
        0 for an empty sequence.
    """

    tile_max: object
    tile_sum: object
    samples: object


def santa_flash(q, k, v=None, seq_lens=None, *, budget, sampler="systematic", tile_size=64,
                seed=0, offset=0, softmax_scale=None, return_indices=False,
                return_tile_stats=False, num_chunks=None, check_seq_lens=False, kernel=None,
                out=None, workspace=None):
    """S²ANTA-flash estimate of one decode step on the GPU: ``sum_t (W_t / Z) mu_t``.

    Each of the T_L = ceil(L / tile_size) tiles of a sequence of L tokens draws
    S_t = ceil(S / T_L) points from its own tile-local softmax (Philox row ``b * Hq + h``,
    stream = tile index: ``stochattn.reference.santa.flash_estimate``'s draws), averages
    those V rows into mu_t, and the tiles are merged with the weights W_t / Z of their
    softmax mass, in one streaming pass without a global sync (split-KV chunks merged as
    in exact decode). Unbiased. The indices equal the reference's up to rounding at CDF
    boundaries (logits are fp32 here, float64 there; iid points may differ in the last
    bit through ``log``).

    Parameters
    ----------
    q : GPU array, shape (B, Hq, D), float16 or bfloat16
    k, v : GPU array, shape (B, Hkv, N, D), dtype of ``q``
        Contiguous (else copied); ``Hq // Hkv <= 8``; D is 64 or 128. Or ``k`` a GPU
        :class:`stochattn.paged.PagedKV` and ``v`` None: the pages are read in place (N is
        its ``token_bound``; see the module docstring).
    seq_lens : integer array, shape (B,), optional
        Sequence lengths; 0 gives a zero row. Host values are checked on the host; GPU
        values are not checked (no synchronisation) unless ``check_seq_lens=True``, and the
        kernel clamps them to [0, N], so a bad value never reads outside the cache. None
        with a paged cache (the page table holds the lengths).
    budget : int
        S, 1 <= S <= 2**27: a sequence draws T_L * S_t >= S points in all.
    sampler : {"systematic", "stratified", "iid"}
        How each tile's S_t points are drawn (per tile, from its own stream).
    tile_size : int
        Tokens per tile: 32, 64, 128 or 256.
    seed : int or GPU integer array
        In [0, 2**64); a GPU array of shape () or (B,) is read by the kernel (docs/rng.md).
    offset : int or GPU integer array
        In [0, 2**32); as ``seed``.
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    return_indices : bool
        Also return the drawn token indices.
    return_tile_stats : bool
        Also return a :class:`FlashTileStats` (per-tile max and local sum, S_t per
        sequence), from which :func:`flash_diagnostics` computes the sample waste.
    num_chunks : int, optional
        Token-axis split (tests and tuning); default fills the GPU. Draws and tile
        statistics do not depend on it; the output does only through fp32 rounding.
    check_seq_lens : bool
        Check GPU ``seq_lens`` values against [0, N] (one device-to-host copy and a sync).
    kernel : {"simt", "tc"}, optional
        How each tile's logits are computed: on the CUDA cores ("simt") or with mma.sync on
        the tensor cores ("tc"; the tiling is the device config's ``flash_tc_tiling``,
        :mod:`stochattn.cuda.config`). The draws and the estimator are the same; the logits
        differ by fp32 rounding. Default (None): :data:`DEFAULT_KERNEL`.
    out : GPU array, shape (B, Hq, D), dtype of ``q``, optional
        Written and returned instead of a fresh output (contiguous, on q's GPU, in q's
        framework; checked).
    workspace : Workspace or 1-D uint8 GPU array, optional
        Where the chunk partials live (:func:`workspace_bytes` bytes; a
        :class:`.runtime.workspace.Workspace` grows itself); None allocates them per call.
        The indices and tile statistics, when asked for, are allocated per call.

    Returns
    -------
    out : GPU array, shape (B, Hq, D), dtype of ``q``, caller's framework
        Alone when neither ``return_indices`` nor ``return_tile_stats``; otherwise the
        first entry of a tuple ``(out, indices)``, ``(out, stats)`` or
        ``(out, indices, stats)``.
    indices : GPU array of int64, shape (B, Hq, S + T - 1), only with ``return_indices``
        Tile t's draws (global token indices) at ``[t * S_t, (t + 1) * S_t)``, so the
        first T_L * S_t entries are sorted; the remaining entries (all, for an empty
        sequence) are -1. T = ceil(N / tile_size).
    stats : FlashTileStats, only with ``return_tile_stats``

    Notes
    -----
    Precision: logits, tile sums and the weighted V sum are fp32, the sample points
    float64; the output is rounded once to the dtype of ``q`` (with several chunks, the
    chunk partials are fp32 and merged in fp32). Same seed and offset, same output bit for
    bit (the accumulation order is fixed). Launched on the caller's current stream; no
    host synchronisation unless ``check_seq_lens``.

    Examples
    --------
    >>> import cupy as cp
    >>> q = cp.random.standard_normal((1, 32, 128)).astype(cp.float16)
    >>> k = cp.random.standard_normal((1, 8, 4096, 128)).astype(cp.float16)
    >>> santa_flash(q, k, k, budget=2048, seed=1).shape
    (1, 32, 128)
    """
    seed, offset = inputs.check_stream_words(seed, offset)
    want_idx = val.check_bool("return_indices", return_indices)
    want_stats = val.check_bool("return_tile_stats", return_tile_stats)
    inp, plan = _plan(q, k, v, budget, sampler, tile_size, softmax_scale, num_chunks, kernel)
    return plan.run(inp, seq_lens, check_seq_lens, seed, offset, want_idx, want_stats, out,
                    workspace)


def workspace_bytes(q, k, v=None, *, budget, sampler="systematic", tile_size=64,
                    softmax_scale=None, num_chunks=None, kernel=None) -> int:
    """Scratch bytes of one :func:`santa_flash` call with these inputs and options (the
    module docstring's formula for the chunk count chosen on this device): what a
    ``workspace=`` array must hold. Builds (or finds) the launch plan; launches nothing."""
    return _plan(q, k, v, budget, sampler, tile_size, softmax_scale, num_chunks,
                 kernel)[1].scratch_bytes


def _plan(q, k, v, budget, sampler, tile_size, softmax_scale, num_chunks, kernel):
    """``(inputs, cached _FlashPlan)`` of a call."""
    kernel = _check_kernel(DEFAULT_KERNEL if kernel is None else kernel)
    inp = inputs.gather(q, k, v)
    cfg = get_config(inp.device)
    tiling = cfg.flash_tc_tiling if kernel == "tc" else None
    key = (_FAMILY, inp.key, type(budget), budget, sampler, type(tile_size), tile_size,
           type(softmax_scale), softmax_scale, type(num_chunks), num_chunks, cfg, tiling)
    plan = inputs.cached_plan(
        key, lambda: _FlashPlan(inp, budget, sampler, tile_size, softmax_scale, num_chunks, cfg,
                                tiling))
    return inp, plan


def _check_kernel(kernel):
    """``kernel`` if it is one of :data:`KERNELS`."""
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {', '.join(map(repr, KERNELS))} or None, "
                         f"got {kernel!r}")
    return kernel


def _check_tile_size(tile_size) -> int:
    if not isinstance(tile_size, (int, np.integer)) or isinstance(tile_size, bool):
        raise TypeError(f"`tile_size` must be an integer, got {type(tile_size).__name__}")
    if int(tile_size) not in TILE_SIZES:
        raise ValueError(f"`tile_size` must be one of {TILE_SIZES} on the GPU, got {tile_size}")
    return int(tile_size)


class _FlashPlan(launch.SplitKVPlan):
    """Everything one configuration of :func:`santa_flash` needs, resolved once."""

    def __init__(self, inp, budget, sampler, tile_size, softmax_scale, num_chunks, cfg,
                 tiling=None):
        """``cfg``: the device's :class:`.config.GpuConfig`; ``tiling``: its
        ``flash_tc_tiling`` for the tensor-core kernel, None for the CUDA-core one."""
        config = cfg.tiling
        S = inputs.check_gpu_budget(budget, FLASH_MAX_BUDGET)
        val.check_choice("sampler", sampler, SAMPLERS)
        ts = _check_tile_size(tile_size)
        s, scale, self.device, dtype_name = inputs.base_plan(inp, softmax_scale)
        num_chunks = inputs.check_num_chunks(num_chunks)
        if s.batch * s.q_heads >= 2**28:
            raise ValueError(f"`q` batch * heads must be below 2**28 (random-stream rows), got "
                             f"{s.batch * s.q_heads}")
        self.shape = s
        ctype = kernels.CTYPES[dtype_name]
        n_tiles = math.ceil(s.tokens / ts)
        # chunk_len: a multiple of the sampling tile, so no tile straddles two chunks (the
        # warps of a CTA own whole tiles).
        align = ts
        gm = group_max(s.group)
        if tiling is None:
            family, self.threads = _FAMILY, config.threads
            smem = config.smem_bytes(_FAMILY, s.head_dim, gm, ts)
            decl = abi.kernel(family, "santa_flash_chunk")
            name = decl.expr(T=ctype, D=s.head_dim, GMAX=gm)
        else:
            family, self.threads = _FAMILY_TC, tiling.threads
            smem = flash_tc_smem_bytes(tiling, s.head_dim, gm, ts)
            if smem > smem_limit():
                raise ValueError(f"`tile_size` {ts} with kernel='tc' (tiling {tiling.label()}, "
                                 f"head_dim {s.head_dim}, {gm} heads per group) needs {smem} "
                                 f"bytes of shared memory per CTA, more than the "
                                 f"{smem_limit()} available: use a smaller tile_size")
            decl = abi.kernel(family, "santa_flash_tc_chunk")
            name = decl.expr(T=ctype, D=s.head_dim, GMAX=gm, **tiling.params())
        with inputs.device_scope(self.device):
            chunk, chunks, chunk_len, self.split = launch.split_kv(
                family, name, smem, cfg, s, ctype, align, num_chunks, self.threads,
                cfg.merge_in_kernel)
        self.chunks, self.chunk_len = chunks, chunk_len
        self.out_shape = (s.batch, s.q_heads, s.head_dim)
        self.idx_stride = S + n_tiles - 1  # >= T_L * ceil(S / T_L) for every T_L <= n_tiles
        self.idx_shape = (s.batch, s.q_heads, self.idx_stride)
        self.tile_shape = (s.batch, s.q_heads, n_tiles)
        self.chunk = launch.Packed(
            chunk, (chunks, s.kv_heads, s.batch), (self.threads,),
            decl.bind(_CHUNK_VARIABLE, Hkv=s.kv_heads, G=s.group, N=s.tokens, chunk_len=chunk_len,
                      num_chunks=chunks, tile_size=ts, n_tiles=n_tiles,
                      idx_stride=self.idx_stride, S=S, sampler=sampler_code(sampler),
                      scale=scale))

    def run(self, inp, seq_lens, check_seq_lens, seed, offset, want_idx, want_stats, out=None,
            workspace=None):
        s = self.shape

        def outputs(ops, like):  # indices, tile statistics; the seed and offset follow
            indices = ops.empty(like, self.idx_shape, "int64") if want_idx else None
            stats = None
            if want_stats:
                stats = FlashTileStats(ops.empty(like, self.tile_shape, "float32"),
                                       ops.empty(like, self.tile_shape, "float32"),
                                       ops.empty(like, (s.batch,), "int32"))
            ptrs = (ops.ptr(indices) if want_idx else 0,) + (
                tuple(ops.ptr(a) for a in stats) if want_stats else (0, 0, 0))
            rs, keep = inputs.stream_args(inp, seed, offset, s.batch, self.device)
            return (indices, stats, keep), ptrs + tuple(rs)

        out, (indices, stats, _keep) = self.launch(inp, seq_lens, check_seq_lens, outputs,
                                                   out=out, workspace=workspace)
        if not (want_idx or want_stats):
            return out
        return (out,) + ((indices,) if want_idx else ()) + ((stats,) if want_stats else ())


def flash_diagnostics(stats: FlashTileStats, budget: int):
    """Host-side flash bookkeeping from :class:`FlashTileStats` (copies to the host: a sync).

    Parameters
    ----------
    stats : FlashTileStats
        As returned by ``santa_flash(..., return_tile_stats=True)``.
    budget : int
        The S of that call.

    Returns
    -------
    samples_per_tile : ndarray of int64, shape (B, Hq, T)
        S_t for the T_L tiles of each sequence, 0 past it (``Diagnostics.samples_per_tile``).
    sample_waste : ndarray of float64, shape (B, Hq)
        ``sum_t max(0, S_t - S W_t / Z) / sum_t S_t`` with W_t = exp(m_t - m*) l_t, as the
        reference's ``flash_estimate``; 0 for empty sequences (``Diagnostics.sample_waste``).
    """
    m = to_host(stats.tile_max).astype(np.float64)
    l = to_host(stats.tile_sum).astype(np.float64)
    st = to_host(stats.samples).astype(np.int64)
    has = l > 0  # tiles of the sequence (l_t >= 1 there; 0 past it)
    samples = np.where(has, st[:, None, None], 0)
    # W_t = exp(m_t - m*) l_t <= l_t: shifted by the row max m* (0 for an empty row).
    mstar = np.max(np.where(has, m, -np.inf), axis=-1, keepdims=True)
    mstar = np.where(np.isfinite(mstar), mstar, 0.0)
    W = np.where(has, np.exp(np.where(has, m, mstar) - mstar) * l, 0.0)
    Z = W.sum(axis=-1, keepdims=True)
    share = np.divide(W, Z, out=np.zeros_like(W), where=Z > 0)
    drawn = samples.sum(axis=-1)
    excess = np.where(has, np.maximum(0.0, samples - int(budget) * share), 0.0).sum(axis=-1)
    waste = np.divide(excess, drawn, out=np.zeros_like(excess), where=drawn > 0)
    return samples, waste
