"""Exact decode attention on the GPU: split-KV ("flash decoding") CUDA kernels, on the CUDA
cores or on the tensor cores, and their shared merge.

Caches: contiguous ``(B, Hkv, N, D)`` K and V, or a GPU :class:`stochattn.paged.PagedKV`
(FlashInfer's layout, NHD or HND, page sizes 1 to 128, int32 page tables) read in place
through the page table; ``N`` is then its ``token_bound`` (the host-known bound of the
lengths: an engine passes ``max_tokens``). The same tokens and N give the same chunk split,
hence the same output bit for bit, paged or contiguous.

Workspace of one call (:func:`workspace_bytes`; the plan's ``scratch_bytes``): with
``rows = B Hq`` and C chunks per (sequence, KV head) stream,

    0                                          when C = 1 (the chunk writes ``out`` itself)
    align256(4 rows C D) + 8 rows C            otherwise: the fp32 chunk partials, then
                                               their (max, sum) pairs

C is chosen per device to fill it in whole waves (``launch.choose_chunks``): at most
``ceil(N / 256)`` and at most ``4 slots / (B Hkv) + 1`` (slots: resident CTAs of the GPU),
so ``rows C <= 4 slots G + B Hq`` whatever N: the workspace is at most about
``(4 D + 8) (4 slots G + B Hq)`` bytes (a few MB). With in-kernel merging (the default) the
plan also keeps B Hkv int32 arrival counters per CUDA stream, allocated on the first call
on that stream.

``exact_decode(..., out=, workspace=)``: the output is written into ``out`` (checked) and the
partials come from ``workspace`` (a kept :class:`.runtime.workspace.Workspace` or a uint8
GPU array of at least :func:`workspace_bytes` bytes): then a call on a stream it has run on
before allocates nothing, copies nothing to the host and does not synchronise.
"""

from __future__ import annotations

import math

import numpy as np

from . import kernels
from .kernels import abi
from .runtime import inputs, launch
from .runtime.workspace import output
from .config import get_config

__all__ = ["exact_decode", "workspace_bytes", "KERNELS", "DEFAULT_KERNEL"]

# The chunk kernels: "simt" (exact_decode.cu: CUDA-core dot products and sums) and "tc"
# (exact_decode_tc.cu: mma.sync on the tensor cores). The default is the faster one at the
# Llama-3.1-8B decode shape (tools/tune_exact_tc.py, H200, three runs on 2026-12-04): "tc"
# took 0.78-0.92x the time of "simt" at batch 8 and 32, 32k and 128k, fp16 and bf16 (98-110%
# of the K+V bandwidth floor, within ~2% of torch SDPA; "simt" 83-94%), and 0.78-0.85x at
# batch 1 / 128k.
KERNELS = ("simt", "tc")
DEFAULT_KERNEL = "tc"
# The chunk kernels' per-call arguments (both kernels take the same arguments: the inputs,
# the page table, the output and the partials, then the optional log-sum-exp output, null
# unless return_lse); a single chunk writes `out` and no partials (their pointers stay null).
_CHUNK_VARIABLE = launch.SPLIT_KV_VARIABLE + ("lse",)


def exact_decode(q, k, v=None, seq_lens=None, *, softmax_scale=None, num_chunks=None,
                 check_seq_lens=False, kernel=None, out=None, workspace=None, return_lse=False,
                 lse=None):
    """Exact softmax attention of one decode step, on the GPU.

    Parameters
    ----------
    q : GPU array, shape (B, Hq, D), float16 or bfloat16
        CuPy array, or any CUDA array with ``__dlpack__`` (PyTorch tensors included).
    k, v : GPU array, shape (B, Hkv, N, D), dtype of ``q``
        Key and value caches, contiguous (a non-contiguous input is copied). Query head h
        reads KV head ``h // (Hq // Hkv)``; ``Hq // Hkv <= 8``; D is 64 or 128. Or ``k`` a
        GPU :class:`stochattn.paged.PagedKV` and ``v`` None: the pages are read in place
        (N is its ``token_bound``; see the module docstring).
    seq_lens : integer array, shape (B,), optional
        Sequence b uses ``k[b, :, :seq_lens[b]]``; a length of 0 gives a zero row. Host
        values (NumPy, list, CPU tensor) are checked on the host and copied asynchronously.
        GPU values are not checked (no synchronisation) unless ``check_seq_lens=True``;
        the kernels clamp them to [0, N], so a bad value never reads outside the cache.
        None with a paged cache (the page table holds the lengths).
    softmax_scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    num_chunks : int, optional
        Split of the token axis (for tests and tuning); default: enough chunks to fill
        the GPU in whole waves.
    check_seq_lens : bool
        Check the values of GPU ``seq_lens`` against [0, N] (one device-to-host copy of B
        integers and a synchronisation). Off by default: decode loops should not sync.
    kernel : {"simt", "tc"}, optional
        The chunk kernel: "simt" computes the dot products and weighted sums on the CUDA
        cores in fp32; "tc" on the tensor cores (mma.sync m16n8k16, fp32 accumulate; the
        softmax weights are rounded to the input dtype before the weighted V sum, as in
        FlashAttention). Default (None): :data:`DEFAULT_KERNEL`. Both split the token axis
        and share the merge kernel.
    out : GPU array, shape (B, Hq, D), dtype of ``q``, optional
        Written and returned instead of a fresh output (contiguous, on q's GPU, in q's
        framework; checked).
    workspace : Workspace or 1-D uint8 GPU array, optional
        Where the chunk partials live (:func:`workspace_bytes` bytes; a
        :class:`.runtime.workspace.Workspace` grows itself); None allocates them per call.
    return_lse : bool
        Also return the log-sum-exp of each row (see Returns). Off: the kernels skip it (a
        null pointer test) and the call is unchanged.
    lse : GPU array, shape (B, Hq), float32, optional
        Written and returned as the log-sum-exp instead of a fresh array (contiguous, on
        q's GPU, in q's framework; checked); only with ``return_lse=True``.

    Returns
    -------
    out : GPU array, shape (B, Hq, D), dtype of ``q``, in the caller's framework
        Computed in fp32 and rounded once; launched on the caller's current stream
        (torch's for tensors, CuPy's for arrays). PyTorch inputs allocate only through
        torch's caching allocator, so the call can be captured in a ``torch.cuda.CUDAGraph``
        (paged or contiguous; with ``out`` and a warmed workspace it allocates nothing).
    lse : GPU array, shape (B, Hq), float32, only with ``return_lse``
        ``ln sum_j exp(softmax_scale q.k_j)`` over the live tokens, in fp32, written by the
        kernel that writes the row of ``out`` (the single chunk, the in-kernel merge or the
        merge launch): -inf for an empty sequence, NaN where the query or a live key is not
        finite. ``(m=lse, l=1, acc=out)`` is the row's exact partial:
        :func:`stochattn.context_parallel.merge_partials` of such partials over disjoint
        token sets (cascade / prefix sharing, context-parallel ranks) is the attention over
        their union. With ``lse=`` and ``out=`` the call allocates nothing more.

    Notes
    -----
    Everything that depends only on the configuration (framework, dtypes, shapes, device,
    ``softmax_scale``, ``num_chunks``) is validated and resolved once and cached (see
    :mod:`stochattn.cuda.runtime.inputs`); a repeated call does attribute reads, one or two
    allocations and the launches.

    Examples
    --------
    >>> import cupy as cp
    >>> q = cp.random.standard_normal((1, 32, 128)).astype(cp.float16)
    >>> k = cp.random.standard_normal((1, 8, 4096, 128)).astype(cp.float16)
    >>> exact_decode(q, k, k).shape
    (1, 32, 128)
    """
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"`return_lse` must be a bool, got {type(return_lse).__name__}")
    if lse is not None and not return_lse:
        raise ValueError("`lse` is an output of return_lse=True; got an `lse` array with "
                         "return_lse=False")
    inp, plan = _plan(q, k, v, softmax_scale, num_chunks, kernel)
    if not return_lse:
        return plan.launch(inp, seq_lens, check_seq_lens, outputs=_NO_LSE, out=out,
                           workspace=workspace)[0]

    def lse_output(ops, like):
        a = output(ops, like, plan.out_shape[:2], "float32", lse, plan.device, name="lse")
        return (a,), (ops.ptr(a),)

    o, (lse_arr,) = plan.launch(inp, seq_lens, check_seq_lens, outputs=lse_output, out=out,
                                workspace=workspace, merge_lse=True)
    return o, lse_arr


def _NO_LSE(ops, like):
    """The chunk kernels' ``lse`` argument of a call without return_lse: null."""
    return (), (0,)


def workspace_bytes(q, k, v=None, *, softmax_scale=None, num_chunks=None, kernel=None) -> int:
    """Scratch bytes of one :func:`exact_decode` call with these inputs and options (the
    module docstring's formula for the chunk count chosen on this device): what a
    ``workspace=`` array must hold. Builds (or finds) the launch plan; launches nothing."""
    return _plan(q, k, v, softmax_scale, num_chunks, kernel)[1].scratch_bytes


def _plan(q, k, v, softmax_scale, num_chunks, kernel):
    """``(inputs, cached _ExactPlan)`` of a call."""
    if kernel is None:
        kernel = DEFAULT_KERNEL
    elif kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {', '.join(map(repr, KERNELS))} or None, "
                         f"got {kernel!r}")
    inp = inputs.gather(q, k, v)
    cfg = get_config(inp.device)
    key = ("exact_decode", inp.key, type(softmax_scale), softmax_scale, type(num_chunks), num_chunks,
           cfg, kernel)
    plan = inputs.cached_plan(key, lambda: _ExactPlan(inp, softmax_scale, num_chunks, cfg,
                                                       kernel == "tc"))
    return inp, plan


class _ExactPlan(launch.SplitKVPlan):
    """Everything one configuration of :func:`exact_decode` needs, resolved once."""

    def __init__(self, inp, softmax_scale, num_chunks, cfg, tensor_cores):
        """``cfg``: the device's :class:`.config.GpuConfig`; ``tensor_cores``: the
        tensor-core kernel (``cfg.tc_tiling``), else the CUDA-core one."""
        config, in_kernel = cfg.tiling, cfg.merge_in_kernel
        tiling = cfg.tc_tiling if tensor_cores else None
        s, scale, self.device, dtype_name = inputs.base_plan(inp, softmax_scale)
        num_chunks = inputs.check_num_chunks(num_chunks)
        self.shape = s
        ctype = kernels.CTYPES[dtype_name]
        gm = kernels.group_max(s.group)
        if tiling is None:
            family = "exact_decode"
            decl = abi.kernel(family, "exact_decode_chunk")
            name = decl.expr(T=ctype, D=s.head_dim, GMAX=gm)
            align, self.threads = config.tile_rows(s.head_dim), config.threads
            smem = config.smem_bytes("exact_decode", s.head_dim, gm)
        else:
            family = "exact_decode_tc"
            decl = abi.kernel(family, "exact_decode_tc_chunk")
            name = decl.expr(T=ctype, D=s.head_dim, **tiling.params())
            align, self.threads = tiling.align(), tiling.threads
            smem = tiling.smem_bytes(s.head_dim)
        with inputs.device_scope(self.device):
            chunk, chunks, chunk_len, self.split = launch.split_kv(
                family, name, smem, cfg, s, ctype, align, num_chunks, self.threads, in_kernel)
        self.chunks, self.chunk_len = chunks, chunk_len
        self.out_shape = (s.batch, s.q_heads, s.head_dim)
        self.chunk = launch.Packed(
            chunk, (chunks, s.kv_heads, s.batch), (self.threads,),
            decl.bind(_CHUNK_VARIABLE, Hkv=s.kv_heads, G=s.group, N=s.tokens, chunk_len=chunk_len,
                      num_chunks=chunks, scale_log2=scale * math.log2(math.e)))
