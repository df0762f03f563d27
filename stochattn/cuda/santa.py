"""S²ANTA-prop on the GPU: logits, tile statistics, sampling and gather (santa_prop.cu)."""

from __future__ import annotations

import math

import numpy as np

from .. import _validation as val
from ..reference.samplers import SAMPLERS
from . import _inputs, _module, _sources
from ._sources import group_max

__all__ = ["santa_prop", "TILE_SIZES"]

_SAMPLE_THREADS = 256  # santa_prop.cu: kSampleThreads
_TILE_THREADS = 256  # santa_prop.cu: kTileThreads
_TILES_PER_CTA = (_TILE_THREADS // 32) * 4  # santa_prop.cu: kTileWarps * kTilesPerWarp
_SAMPLER_CODE = {"systematic": 0, "stratified": 1, "iid": 2}  # philox.cuh: Sampler
TILE_SIZES = (32, 64, 128, 256)


def santa_prop(q, k, v, seq_lens=None, *, budget, sampler="systematic", tile_size=64, seed=0,
               offset=0, softmax_scale=None, return_indices=False, num_chunks=None,
               check_seq_lens=False):
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
        Contiguous; ``Hq // Hkv <= 8``; D is 64 or 128.
    seq_lens : integer array, shape (B,), optional
        Sequence lengths; 0 gives a zero row. Host values are checked on the host; GPU
        values are not checked (no synchronisation) unless ``check_seq_lens=True``, and the
        kernels clamp them to [0, N], so a bad value never reads outside the cache.
    budget : int
        S >= 1 sample points per (sequence, query head).
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

    Returns
    -------
    out : GPU array, shape (B, Hq, D), dtype of ``q``, caller's framework
    indices : GPU array of int64, shape (B, Hq, S), only with ``return_indices``
        Token index of every point, sorted along S (the points are sorted); 0 for empty
        sequences.

    Examples
    --------
    >>> import cupy as cp
    >>> q = cp.random.standard_normal((1, 32, 128)).astype(cp.float16)
    >>> k = cp.random.standard_normal((1, 8, 4096, 128)).astype(cp.float16)
    >>> santa_prop(q, k, k, budget=256, seed=1).shape
    (1, 32, 128)
    """
    seed, offset = val.check_seed_offset(seed, offset)
    inp = _inputs.gather(q, k, v)
    config = _sources.get_config()  # pass 1 tiling
    key = ("santa_prop", inp.key, type(budget), budget, sampler, type(tile_size), tile_size,
           type(softmax_scale), softmax_scale, type(num_chunks), num_chunks, bool(return_indices),
           config)
    plan = _inputs.cached_plan(
        key, lambda: _PropPlan(inp, budget, sampler, tile_size, softmax_scale, num_chunks, config))
    return plan.run(inp, seq_lens, check_seq_lens, seed, offset, bool(return_indices))


class _PropPlan:
    """Everything one configuration of :func:`santa_prop` needs, resolved once."""

    def __init__(self, inp, budget, sampler, tile_size, softmax_scale, num_chunks, config):
        S = val.check_budget("budget", budget)
        val.check_choice("sampler", sampler, SAMPLERS)
        if not isinstance(tile_size, (int, np.integer)) or isinstance(tile_size, bool):
            raise TypeError(f"`tile_size` must be an integer, got {type(tile_size).__name__}")
        if int(tile_size) not in TILE_SIZES:
            raise ValueError(f"`tile_size` must be one of {TILE_SIZES} on the GPU, got {tile_size}")
        ts = int(tile_size)
        s, scale, self.device, dtype_name = _inputs.base_plan(inp, softmax_scale)
        num_chunks = _inputs.check_num_chunks(num_chunks)
        if s.batch * s.q_heads >= 2**28:
            raise ValueError(f"`q` batch * heads must be below 2**28 (random-stream rows), got "
                             f"{s.batch * s.q_heads}")
        self.shape, self.S = s, S
        ctype = _sources.CTYPES[dtype_name]
        n_tiles = math.ceil(s.tokens / ts)
        n_pad = n_tiles * ts
        rows = s.batch * s.q_heads
        self.threads1 = config.threads
        gm = group_max(s.group)
        smem1 = config.smem_bytes("santa_prop", s.head_dim, gm)
        with _inputs.device_scope(self.device):
            name1 = f"santa_prop_logits<{ctype}, {s.head_dim}, {gm}>"
            self.logits = _module.launcher("santa_prop", name1, smem1, config)
            chunks, chunk_len = _module.split_tokens("santa_prop", name1, smem1, config,
                                                     s.batch * s.kv_heads, s.tokens,
                                                     config.tile_rows(s.head_dim), num_chunks)
            self.tiles = _module.launcher("santa_prop", "santa_prop_tiles", 0, config)
            self.sample = _module.launcher("santa_prop", f"santa_prop_sample<{ctype}, {s.head_dim}>",
                                           0, config)
        self.chunks, self.chunk_len = chunks, chunk_len
        self.grid1 = (chunks, s.kv_heads, s.batch)
        self.grid_tiles = (rows, math.ceil(n_tiles / _TILES_PER_CTA))
        self.grid2 = (rows,)
        self.out_shape = (s.batch, s.q_heads, s.head_dim)
        self.idx_shape = (s.batch, s.q_heads, S)
        # One scratch buffer: logits (f32, rows x n_pad), tile_m and tile_l (f32, rows x
        # n_tiles), C (f64, rows x n_tiles), iid points (f64, rows x (S + 1); iid only),
        # idx32 (i32, rows x S).
        sizes = (4 * rows * n_pad, 4 * rows * n_tiles, 4 * rows * n_tiles, 8 * rows * n_tiles,
                 8 * rows * (S + 1) if sampler == "iid" else 8, 4 * rows * S)
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += _align(size)
        self.offsets, self.scratch_bytes = tuple(offsets), total
        self.tail1 = (np.int32(s.kv_heads), np.int32(s.group), np.int64(s.tokens),
                      np.int64(chunk_len), np.int64(n_pad), np.float32(scale))
        self.tail_tiles = (np.int32(s.q_heads), np.int64(s.tokens), np.int64(n_pad),
                           np.int64(n_tiles), np.int32(ts))
        self.mid2 = (np.int32(s.q_heads), np.int32(s.group), np.int64(s.tokens), np.int64(n_pad),
                     np.int64(n_tiles), np.int32(ts), np.int32(S), np.int32(_SAMPLER_CODE[sampler]))

    def run(self, inp, seq_lens, check_seq_lens, seed, offset, return_indices):
        ops = inp.ops
        s = self.shape
        with _inputs.device_scope(self.device):
            qp, kp, vp, lens, _keep, stream = _inputs.launch_args(inp, seq_lens, check_seq_lens, s,
                                                                  self.device)
            scratch = ops.empty(inp.q, (self.scratch_bytes,), "uint8")
            base = ops.ptr(scratch)
            logits, tile_m, tile_l, C, iid, idx32 = (np.uint64(base + o) for o in self.offsets)
            out = ops.empty(inp.q, self.out_shape)
            outp = np.uint64(ops.ptr(out))
            indices = ops.empty(inp.q, self.idx_shape, "int64") if return_indices else None
            idxp = _inputs.NULL if indices is None else np.uint64(ops.ptr(indices))  # null: none
            self.logits(self.grid1, (self.threads1,), (qp, kp, lens, logits) + self.tail1, stream)
            self.tiles(self.grid_tiles, (_TILE_THREADS,),
                       (logits, lens, tile_m, tile_l) + self.tail_tiles, stream)
            self.sample(self.grid2, (_SAMPLE_THREADS,),
                        (vp, lens, logits, tile_m, tile_l, C, iid, idx32, idxp, outp) + self.mid2
                        + (np.uint64(seed), np.uint32(offset)), stream)
        return (out, indices) if return_indices else out


def _align(nbytes: int, to: int = 256) -> int:
    return -(-nbytes // to) * to
