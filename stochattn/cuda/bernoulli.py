"""Bernoulli qK^T scores on the GPU (bernoulli.cuh; the score stage of S²ANTA-prop).

K is contiguous ``(B, Hkv, N, D)`` or a GPU :class:`stochattn.paged.PagedKV` read in place
(N = its ``token_bound``); the feature-major copy (``k_feature_major``) has no paged form.

Per call: q_hat (f32, B Hq D), the group features (i32, B Hkv D) and their count (i32,
B Hkv), the fp32 scores (B Hq ceil(N / 8) 8) and the feature fractions (f32, B Hq), then
the scores cast to q's dtype: a standalone score estimate allocates these (it is not the
serving path; S²ANTA-prop's Bernoulli score stage takes them from its workspace). With
``out=`` the cast is written into ``out`` instead of a fresh array.
"""

from __future__ import annotations

import math

from .. import _validation as val
from . import kernels
from .kernels import abi
from .runtime import inputs, launch, pages
from .runtime import workspace as _workspace
from .kernels import group_max
from .config import get_config
from .santa import _FAMILY, _FM_THREADS, _FM_TOKENS_PER_PASS, _QHAT_THREADS, _check_feature_major, \
    _feature_major_input, check_draws

__all__ = ["bernoulli_scores_gpu"]


def bernoulli_scores_gpu(q, k, seq_lens=None, *, draws=4, group_shared=False, seed=0, offset=0,
                         k_feature_major=None, check_seq_lens=False, out=None):
    """Unbiased Bernoulli estimate of the unscaled scores q . k on the GPU.

    The same kept features as :func:`stochattn.bernoulli.bernoulli_scores` (same random
    stream, exact decision), the dot products in fp32.

    Parameters
    ----------
    q : GPU array, shape (B, Hq, D), float16 or bfloat16
    k : GPU array, shape (B, Hkv, N, D), dtype of ``q``
        Or a GPU :class:`stochattn.paged.PagedKV` (pages read in place; N its
        ``token_bound``).
    seq_lens : integer array, shape (B,), optional
        None with a paged cache.
    draws, group_shared, seed, offset
        As :func:`stochattn.bernoulli.bernoulli_scores`.
    k_feature_major : GPU array, shape (B, Hkv, D, L), optional
        The keys feature-major (L >= N, a multiple of 8): only kept feature rows are read.
    check_seq_lens : bool
        Check GPU ``seq_lens`` against [0, N] (a sync).
    out : GPU array, shape (B, Hq, N), dtype of ``q``, optional
        The scores are written here (checked) instead of a fresh array.

    Returns
    -------
    s_hat : GPU array, shape (B, Hq, N), dtype of ``q``, caller's framework
        -inf past ``seq_lens[b]``.
    feature_fraction : GPU array of float32, shape (B, Hq)
        Fraction of the D features each head reads.
    """
    seed, offset = inputs.check_stream_words(seed, offset)
    draws = check_draws("draws", draws)
    group_shared = val.check_bool("group_shared", group_shared)
    paged = type(k).__name__ == "PagedKV"
    inp = inputs.gather(q, k, None if paged else k)
    ops = inp.ops
    s, _, device, dtype_name = inputs.base_plan(inp, None)
    if k_feature_major is not None:
        if paged:
            raise ValueError("`k_feature_major` has no paged form: with a paged cache (`k` a "
                             "PagedKV) the scores read the token-major pages (pass "
                             "k_feature_major=None)")
        k_feature_major = _feature_major_input(inp, k_feature_major)
        _check_feature_major(ops.meta(k_feature_major), inp, s, device)
    cfg = get_config(device)
    config = cfg.tiling
    ctype = kernels.CTYPES[dtype_name]
    gm = group_max(s.group)
    n_pad = math.ceil(s.tokens / 8) * 8
    with inputs.device_scope(device):
        qp, kp, _, lens, _keep, stream = inputs.launch_args(inp, seq_lens, check_seq_lens, s,
                                                             device)
        pg = pages.page_args(inp)._asdict()
        rs, _keep_rs = inputs.stream_args(inp, seed, offset, s.batch, device)
        qhat = ops.empty(inp.q, (s.batch * s.q_heads * s.head_dim,), "float32")
        feat = ops.empty(inp.q, (s.batch * s.kv_heads * s.head_dim,), "int32")
        nfeat = ops.empty(inp.q, (s.batch * s.kv_heads,), "int32")
        frac = ops.empty(inp.q, (s.batch, s.q_heads), "float32")
        x = ops.empty(inp.q, (s.batch, s.q_heads, n_pad), "float32")
        x.fill_(-math.inf) if ops is inputs.TORCH else x.fill(-math.inf)
        ptr = {"qhat": ops.ptr(qhat), "feat": ops.ptr(feat), "nfeat": ops.ptr(nfeat),
               "logits": ops.ptr(x)}
        qhat_k = abi.kernel(_FAMILY, "bernoulli_qhat")
        launch.launcher(_FAMILY, qhat_k.expr(T=ctype), 0, cfg)(
            (s.kv_heads, s.batch), (_QHAT_THREADS,),
            qhat_k.args_of(q=qp, qhat=ptr["qhat"], feat=ptr["feat"], nfeat=ptr["nfeat"],
                           frac=ops.ptr(frac), Hkv=s.kv_heads, G=s.group, D=s.head_dim,
                           draws=draws, group_shared=group_shared, scale=1.0,
                           **rs._asdict()), stream)
        if k_feature_major is None:
            logits_k = abi.kernel(_FAMILY, "santa_prop_logits")
            name = logits_k.expr(T=ctype, D=s.head_dim, GMAX=gm, QHAT=True)
            smem = config.smem_bytes(_FAMILY, s.head_dim, gm)
            chunks, chunk_len = launch.split_tokens(_FAMILY, name, smem, cfg,
                                                     s.batch * s.kv_heads, s.tokens,
                                                     config.tile_rows(s.head_dim))
            launch.launcher(_FAMILY, name, smem, cfg)(
                (chunks, s.kv_heads, s.batch), (config.threads,),
                logits_k.args_of(qv=ptr["qhat"], k=kp, seq_lens=lens, **pg, logits=ptr["logits"],
                                 Hkv=s.kv_heads, G=s.group, N=s.tokens, chunk_len=chunk_len,
                                 n_pad=n_pad, scale=1.0), stream)
        else:
            fm_k = abi.kernel(_FAMILY, "bernoulli_logits_fm")
            name = fm_k.expr(T=ctype, GMAX=gm)
            chunks, chunk_len = launch.split_tokens(_FAMILY, name, 0, cfg,
                                                     s.batch * s.kv_heads, s.tokens,
                                                     _FM_TOKENS_PER_PASS)
            launch.launcher(_FAMILY, name, 0, cfg)(
                (chunks, s.kv_heads, s.batch), (_FM_THREADS,),
                fm_k.args_of(qhat=ptr["qhat"], kfm=ops.ptr(k_feature_major), feat=ptr["feat"],
                             nfeat=ptr["nfeat"], seq_lens=lens, logits=ptr["logits"],
                             Hkv=s.kv_heads, G=s.group, D=s.head_dim, N=s.tokens,
                             ld=ops.meta(k_feature_major)[1][-1], chunk_len=chunk_len,
                             n_pad=n_pad), stream)
        x = x[..., :s.tokens]
        if out is None:
            out = x.to(inp.q.dtype) if ops is inputs.TORCH else x.astype(inp.q.dtype)
        else:
            out = _workspace.output(ops, inp.q, (s.batch, s.q_heads, s.tokens), None, out,
                                    device)
            out.copy_(x) if ops is inputs.TORCH else out.__setitem__(Ellipsis, x)
    return out, frac
