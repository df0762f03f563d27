"""Exact decode attention: the baseline every estimator is measured against."""

from __future__ import annotations

import numpy as np

from . import _validation as val
from ._backend import backend_of, host_ints, in_callers_framework, require_cupy
from ._plan import AttentionPlan, cached_plan, device_of, is_paged, no_call_arguments
from .diagnostics import Diagnostics
from .reference import exact as _ref
from .reference.common import finish, lengths

__all__ = ["ExactPlan", "exact_attention"]


class ExactPlan(AttentionPlan):
    """A plan of :func:`exact_attention` (options as there; ``device``, ``q_heads``,
    ``kv_heads``, ``head_dim``, ``dtype`` as in :class:`~stochattn.SantaPlan`).

    Calls: ``plan.run(q, k, v, seq_lens=None, *, out=None, workspace=None, return_lse=False,
    lse=None)`` returns the output (B, Hq, D), or ``(output, lse)`` with ``return_lse`` (see
    :func:`exact_attention`; ``lse=``: a preallocated (B, Hq) float32 GPU output, GPU only);
    ``plan.diagnose(...)`` returns ``(output, Diagnostics)`` (``(output, lse, Diagnostics)``).

    ``k`` may be a :class:`stochattn.paged.PagedKV` (FlashInfer's layout) with ``v`` and
    ``seq_lens`` left out: the reference reads a contiguous copy, the GPU kernels read the
    pages in place (N = the cache's ``token_bound``; same tokens and N, same output as the
    contiguous call, bit for bit). With ``check_finite`` a paged cache's pools are not
    scanned (their unused pages and slots may hold anything; the kernels never read them):
    q is checked, and the lengths are clamped to [0, N] by the kernels.

    ``out``: the output array to write (the reference copies its result into a NumPy
    ``out``; on the GPU the kernel writes it: contiguous, q's dtype, GPU and framework).
    ``workspace`` (GPU only): the call's scratch, the split-KV chunk partials — a uint8 GPU
    array of at least ``stochattn.cuda.exact.workspace_bytes(q, k, v)`` bytes (at most
    about ``(4 D + 8) (4 slots G + B Hq)`` bytes whatever N; ``stochattn.cuda.exact``'s
    docstring has the formula); by default the plan keeps its own (:attr:`workspace`),
    grown by the first call that needs more. So a plan called once eagerly, then with
    ``out=``, allocates nothing, copies nothing to the host and does not synchronise
    (diagnostics do all three). The reference takes no ``workspace``.

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn import ExactPlan
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 100, 64))
    >>> plan = ExactPlan(q_heads=4, kv_heads=2, head_dim=64, dtype="float64")
    >>> plan.run(q, k, k).shape
    (1, 4, 64)
    """

    function = "exact_attention"


    def _paged_cuda_missing(self) -> list[str]:
        return []  # both chunk kernels read the pages in place

    def _run(self, backend, q, k, v, seq_lens, diagnose, call):
        out, workspace = self._buffers(call)
        return_lse = val.check_bool("return_lse", call.pop("return_lse", False))
        lse = call.pop("lse", None)
        no_call_arguments(call)
        if lse is not None and not return_lse:
            raise ValueError("`lse` is an output of return_lse=True; got an `lse` array with "
                             "return_lse=False")
        if backend == "cuda":
            return _exact_cuda(q, k, v, seq_lens, self.softmax_scale, self.check_finite, diagnose,
                               out, workspace, return_lse, lse)
        if lse is not None:
            raise TypeError("`lse` is a preallocated GPU output; the reference takes none "
                            "(it returns a new array)")
        return _exact_reference(q, k, v, seq_lens, self.softmax_scale, self.check_finite,
                                diagnose, return_lse)


def exact_attention(q, k, v=None, seq_lens=None, *, softmax_scale=None, check_finite=False,
                    return_diagnostics=False, return_lse=False):
    """Exact softmax attention of one decode step.

    Parameters
    ----------
    q : array, shape (B, Hq, D)
        One query per sequence and query head. NumPy (float16/32/64) runs the float64
        reference; a CuPy array or a CUDA tensor with ``__dlpack__`` (PyTorch, JAX; float16
        or bfloat16, D 64 or 128, Hq / Hkv <= 8) runs the split-KV CUDA kernel and the
        result comes back in the caller's framework, on its current stream.
    k, v : array, shape (B, Hkv, N, D)
        Key and value caches; query head h reads KV head ``h // (Hq // Hkv)``. Or ``k`` a
        :class:`stochattn.paged.PagedKV` and ``v`` None (NumPy pages: the reference reads a
        contiguous copy; GPU pages: the kernels read them in place, docs/paged.md).
    seq_lens : integer array, shape (B,), optional
        Sequence b uses ``k[b, :, :seq_lens[b]]``; default: all N tokens. A sequence of
        length 0 yields a zero output row. None with a paged cache.
    softmax_scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    check_finite : bool
        Check that q, k, v hold no NaN or inf, and on the GPU that ``seq_lens`` values lie
        in [0, N] (reads the data and synchronises; off by default).
    return_diagnostics : bool
        Also return a :class:`~stochattn.Diagnostics`.
    return_lse : bool
        Also return the log-sum-exp of each row's scaled logits (below).

    Returns
    -------
    out : array, shape (B, Hq, D), dtype of ``q``
    lse : array, shape (B, Hq), only when ``return_lse``
        ``ln sum_j exp(softmax_scale q.k_j)`` over the live tokens: float64 on the
        reference, float32 on the GPU (in q's framework); -inf for an empty sequence, NaN
        where the query or a live key is not finite. ``(m=lse, l=1, acc=out)`` (l = 0 where
        lse is -inf) is the exact partial of these tokens:
        :func:`stochattn.context_parallel.merge_partials` of partials over disjoint token
        sets is the attention over their union (cascade / prefix sharing, context-parallel
        decode).
    diagnostics : Diagnostics, only when ``return_diagnostics``

    Examples
    --------
    >>> import numpy as np, stochattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 64)); k = rng.standard_normal((1, 2, 100, 64))
    >>> stochattn.exact_attention(q, k, k).shape
    (1, 4, 64)
    """
    plan = cached_plan(ExactPlan, device_of(q=q, k=k, v=v), softmax_scale=softmax_scale,
                       check_finite=check_finite)
    return plan.dispatch(q, k, v, seq_lens, val.check_bool("return_diagnostics", return_diagnostics),
                         {"return_lse": return_lse})


def _exact_reference(q, k, v, seq_lens, softmax_scale, check_finite, return_diagnostics,
                     return_lse=False):
    backend_of(q=q, k=k, v=v, seq_lens=seq_lens)  # host seq_lens only, for the reference
    shape = val.check_attention_inputs(q, k, v, seq_lens)
    scale = val.check_scale(softmax_scale, shape.head_dim)
    if check_finite:
        val.check_finite(q=q, k=k, v=v)
    out = _ref.exact_attention(q, k, v, seq_lens, scale, return_lse=return_lse)
    lse = ()
    if return_lse:
        out, lse = out[0], (out[1],)
    out = finish(out, q.dtype)
    if not return_diagnostics:
        return (out,) + lse if return_lse else out
    lens = lengths(seq_lens, shape.batch, shape.tokens)
    rows = np.repeat(lens[:, None], shape.kv_heads, axis=1)
    diag = Diagnostics(seq_lens=lens, k_rows_read=rows, v_rows_read=rows.copy(),
                       true_mass=(lens[:, None] > 0) * np.ones((shape.batch, shape.q_heads)))
    return (out,) + lse + (diag,)


@in_callers_framework()
def _exact_cuda(q, k, v, seq_lens, softmax_scale, check_finite, return_diagnostics, out=None,
                workspace=None, return_lse=False, lse=None):
    """GPU arrays: the split-KV kernels. ``k`` may be a GPU PagedKV (``v``, ``seq_lens``
    None), read in place. ``out`` and ``workspace`` go to :func:`stochattn.cuda.exact_decode`
    (None: allocated)."""
    require_cupy("exact_attention")
    from .cuda import exact_decode

    paged = is_paged(k)
    if check_finite:
        # A paged cache's pools are not checked: their unused pages and slots may hold
        # anything (the kernels never read them).
        val.check_finite(q=q) if paged else val.check_finite(q=q, k=k, v=v)
    out = exact_decode(q, k, v, seq_lens, softmax_scale=softmax_scale, check_seq_lens=check_finite,
                       out=out, workspace=workspace, return_lse=return_lse, lse=lse)
    lse = ()
    if return_lse:
        out, lse = out[0], (out[1],)
    if not return_diagnostics:
        return (out,) + lse if return_lse else out
    if paged:
        B, Hkv, N = k.batch, k.kv_heads, k.token_bound
        lens = np.clip(host_ints(k.seq_lens), 0, N)  # as the kernels clamp them
    else:
        B, Hkv, N = int(k.shape[0]), int(k.shape[1]), int(k.shape[2])
        lens = np.full(B, N, dtype=np.int64) if seq_lens is None else host_ints(seq_lens)
    rows = np.repeat(lens[:, None], Hkv, axis=1)
    return (out,) + lse + (Diagnostics(seq_lens=lens, k_rows_read=rows, v_rows_read=rows.copy(),
                                       true_mass=(lens[:, None] > 0) * np.ones((B, int(q.shape[1])))),)

