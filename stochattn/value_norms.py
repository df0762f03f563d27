"""Squared value norms beside the cache: ||v_j||^2, one float32 per (row of V).

The error-targeted budgets (docs/budgets.md) need m2 = sum_j p_j ||v_j||^2 per head, so an
engine keeps one float per token and KV head beside its V cache and updates it where it
writes V. This module computes them, on the host (NumPy) or on the GPU (a small kernel of
``stochattn/cuda/kernels/santa_prop.cu``, ``value_sqnorms_rows``), for

- a contiguous cache ``v`` (B, Hkv, N, D): norms (B, Hkv, N);
- a paged cache (a :class:`stochattn.paged.PagedKV`, or its V pool): norms of the pool's
  shape without D, (num_pages, page_size, Hkv) for "NHD" and (num_pages, Hkv, page_size)
  for "HND". Slot (page, s, h) holds the norm of the V row in that slot, so the norms
  follow the page table the kernels read V through (``SantaPlan(eps=...)`` on the GPU
  reads them there).

Every norm is the sum of float(v_d)^2 over the D elements, accumulated in float64 and
rounded once to float32: the host and the GPU agree to the last bit except where the two
float64 sums (NumPy's order, a warp's xor tree) round to different float32 neighbours
(a relative 2**-24, rare). Inputs: float16, bfloat16 (GPU; on the host through
``ml_dtypes`` if NumPy has it) or float32 (and float64 on the host).

:func:`value_sqnorms` computes them all (``out=``: written in place, no allocation on the
GPU); :func:`append_value_sqnorms` recomputes those of the tokens an engine has just
written (``start[b] .. start[b] + count - 1`` of every sequence b, every KV head). On the
GPU with ``out`` given and ``start`` an integer or a device int32 / int64 array, neither
allocates, copies between host and device nor synchronises: both can be captured in a
CUDA graph (an integer ``start`` is then fixed at its captured value; a device array is
read at each replay). Each configuration's launch is packed once (the runtime's plan
cache), so a call's host work is the inputs' checks and the launch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["value_sqnorms", "append_value_sqnorms", "sqnorms_shape"]

_DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}


def _is_paged(a) -> bool:
    return type(a).__name__ == "PagedKV" and type(a).__module__ == "stochattn.paged"


def _on_host(a) -> bool:
    return isinstance(a, np.ndarray)


def sqnorms_shape(v) -> tuple:
    """The shape of the norms of ``v``: ``v.shape[:-1]`` for a contiguous cache or a pool,
    the V pool's without D for a :class:`~stochattn.paged.PagedKV`."""
    pool = v.v_pages if _is_paged(v) else v
    return tuple(int(s) for s in pool.shape[:-1])


def _pool(name, v):
    """(array, layout or None, cache or None) of ``v``: a PagedKV gives its V pool."""
    if _is_paged(v):
        return v.v_pages, v.layout, v
    if not hasattr(v, "shape") or len(v.shape) != 4:
        raise ValueError(f"`{name}` must be a (B, Hkv, N, D) cache, a (num_pages, ...) V pool "
                         f"of 4 axes or a PagedKV, got "
                         f"{getattr(v, 'shape', type(v).__name__)}")
    return v, None, None


def _host_sqnorms(a: np.ndarray) -> np.ndarray:
    a64 = np.asarray(a, dtype=np.float64)
    return np.einsum("...d,...d->...", a64, a64).astype(np.float32)


def value_sqnorms(v, *, out=None):
    """||v_j||^2 of every row of a V cache, float32, of shape :func:`sqnorms_shape`.

    Parameters
    ----------
    v : array (B, Hkv, N, D), a V pool (num_pages, ...,  D) or a PagedKV
        NumPy (the reference) or GPU (CuPy, or PyTorch / any ``__dlpack__`` CUDA array).
        Rows past a sequence's length (or unused pages) get norms too; they are never read.
    out : array, optional
        float32, contiguous, of the norms' shape, on v's device and framework: written
        and returned (on the GPU the launch then allocates nothing).

    Returns
    -------
    array of float32 in v's framework.
    """
    a, _, _ = _pool("v", v)
    shape = tuple(int(s) for s in a.shape[:-1])
    if _on_host(a):
        res = _host_sqnorms(a)
        if out is None:
            return res
        _check_host_out(out, shape)
        out[...] = res
        return out
    return _gpu_launch(a, out, shape, mode=0)


def append_value_sqnorms(v, sqnorms, start, count: int = 1):
    """Recompute, in place, the norms of the tokens ``start[b] .. start[b] + count - 1`` of
    every sequence b and KV head (the rows an engine has just written into V).

    Parameters
    ----------
    v : array (B, Hkv, N, D) or PagedKV
        The cache, already holding the new rows (for a PagedKV, its page table already
        covering them: a token past the sequence's pages is skipped).
    sqnorms : array
        The norms (:func:`value_sqnorms`'s shape and framework), updated in place.
    start : int or integer array (B,)
        First new token of each sequence (the old length). On the GPU an integer is passed
        to the kernel as it is, and a device int32 or int64 array is read by the kernel
        (neither allocates nor copies; the array is graph-safe); host arrays and other
        dtypes are copied or converted to int32 first.
    count : int
        New tokens per sequence (>= 1). Tokens outside [0, N) (contiguous) are skipped.

    Returns
    -------
    ``sqnorms``.
    """
    a, layout, cache = _pool("v", v)
    shape = tuple(int(s) for s in a.shape[:-1])
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"`count` must be an integer >= 1, got {count!r}")
    count = int(count)
    if cache is not None:
        B, H = cache.batch, cache.kv_heads
    else:
        B, H = shape[0], shape[1]
    if _on_host(a):
        _check_host_out(sqnorms, shape, name="sqnorms")
        st = np.broadcast_to(np.asarray(start, dtype=np.int64), (B,))
        for b in range(B):
            toks = st[b] + np.arange(count)
            if cache is None:
                toks = toks[(toks >= 0) & (toks < shape[2])]
                sqnorms[b][:, toks] = _host_sqnorms(a[b][:, toks])
                continue
            indptr = np.asarray(cache.kv_indptr, dtype=np.int64)
            pages = np.asarray(cache.kv_indices, dtype=np.int64)[indptr[b]:indptr[b + 1]]
            P = cache.page_size
            toks = toks[(toks >= 0) & (toks // P < pages.size)]
            for t in toks:
                page, slot = pages[t // P], t % P
                at = (page, slot) if layout == "NHD" else (page, slice(None), slot)
                sqnorms[at] = _host_sqnorms(a[at])
        return sqnorms
    return _gpu_launch(a, sqnorms, shape, mode=1 if cache is None else 2, start=start,
                       count=count, cache=cache, B=B, H=H, name="sqnorms")


def _check_host_out(out, shape, name="out"):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"`{name}` must be a NumPy array for NumPy input, got "
                        f"{type(out).__name__}")
    if out.dtype != np.float32:
        raise TypeError(f"`{name}` must have dtype float32, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"`{name}` must have shape {shape}, got {tuple(out.shape)}")


def _strides(ops, a) -> tuple:
    from .cuda.runtime import arrays

    if ops is arrays.TORCH:
        return tuple(int(s) for s in a.stride())
    return tuple(int(s) // a.itemsize for s in a.strides)


def _gpu_launch(a, out, shape, *, mode, start=None, count=1, cache=None, B=0, H=0, name="out"):
    """Launch value_sqnorms_rows on the current stream of a's framework.

    Per call: the inputs' checks, the plan's key, the pointers and the launch; the typed
    arguments, grid and compiled kernel of each configuration are packed once
    (:class:`_NormsPlan`, in the runtime's plan cache)."""
    from ._backend import require_cupy

    require_cupy("value_sqnorms")
    from .cuda.config import get_config
    from .cuda.runtime import arrays, inputs
    from .cuda.runtime import workspace as _workspace

    ops = arrays.ops_for("v", a)
    if ops is not arrays.TORCH and ops is not arrays.CUPY:
        a, ops = arrays.to_cupy("v", a), arrays.CUPY
    dtype, _, device = ops.meta(a)
    dname = ops.dtype_name(dtype)
    if dname not in _DTYPE_CODES:
        raise TypeError(f"`v` must be float16, bfloat16 or float32 on the GPU, got {dname}")
    vs = _strides(ops, a)
    if vs[-1] != 1:
        raise ValueError("`v` must have its last axis (D) contiguous")
    if len(shape) != 3:
        raise ValueError(f"`v` must have 4 axes, got shape {shape + (a.shape[-1],)}")
    keep = []
    with inputs.device_scope(device):
        if out is None:
            if mode != 0:
                raise ValueError(f"`{name}` is required")
            out = ops.empty(a, shape, "float32")
        else:
            _workspace._check_array(name, ops, out, shape, "float32", device, align=4)
        os_ = _strides(ops, out)
        startp = indptr = indices = start0 = start_int64 = 0
        page_size = hnd = 0
        if mode == 0:
            rows = shape[0] * shape[1] * shape[2]
        else:
            rows = B * H * count
            startp, start_int64, start0 = _start_arg(start, B, ops, a, device, keep)
            if mode == 2:
                indptr = ops.ptr(_device_int32("kv_indptr", cache.kv_indptr, B + 1, ops, a,
                                               device, keep, exact=True))
                indices = ops.ptr(_device_int32("kv_indices", cache.kv_indices, None, ops, a,
                                                device, keep, exact=True))
                page_size, hnd = cache.page_size, int(cache.layout == "HND")
                if int(cache.kv_indices.shape[0]) * page_size >= 2**31:
                    raise ValueError("the page table must hold fewer than 2**31 token slots on "
                                     f"the GPU (kv_rows.cuh's 32-bit token index), got "
                                     f"{int(cache.kv_indices.shape[0])} pages of {page_size}")
        if rows == 0:
            return out
        cfg = get_config(device)
        conf = (_DTYPE_CODES[dname], int(a.shape[-1]), rows, mode, shape, vs[:3], os_,
                start_int64, count, page_size, hnd, H)
        plan = inputs.cached_plan(("value_sqnorms_rows", ops.name, device, cfg) + conf,
                                  lambda: _NormsPlan(cfg, *conf))
        plan.packed(arrays.launch_stream(ops, device), ops.ptr(a), ops.ptr(out), startp,
                    np.int64(start0), indptr, indices)
    return out


class _NormsPlan:
    """One configuration of value_sqnorms_rows: its kernel on the current device, grid and
    typed arguments packed once (:class:`stochattn.cuda.runtime.launch.Packed`); a call
    passes only the pointers and the scalar start."""

    __slots__ = ("packed",)
    VARIABLE = ("v", "out", "start", "start0", "kv_indptr", "kv_indices")

    def __init__(self, cfg, dtype, D, rows, mode, shape, vs, os_, start_int64, count, page_size,
                 hnd, H):
        from .cuda.kernels import abi
        from .cuda.runtime import launch

        if mode == 2:
            _check_paged_strides(vs, os_, 4 if dtype == _DTYPE_CODES["float32"] else 2)
        decl = abi.kernel("santa_prop", "value_sqnorms_rows")
        threads = abi.constant("santa_prop", "kNormThreads")  # one warp per row
        args = decl.bind(self.VARIABLE, dtype=dtype, D=D, rows=rows, mode=mode, s0=shape[0],
                         s1=shape[1], s2=shape[2], vs0=vs[0], vs1=vs[1], vs2=vs[2], os0=os_[0],
                         os1=os_[1], os2=os_[2], start_int64=start_int64, count=count,
                         page_size=page_size, hnd=hnd, H=H)
        self.packed = launch.Packed(launch.launcher("santa_prop", decl.expr(), 0, cfg),
                                    (-(-rows // (threads // 32)),), (threads,), args)


def _check_paged_strides(vs, os_, itemsize):
    """The kernel reads a pool as the attention kernels do (kv_rows.cuh): the byte strides
    of a page's slot and head axes are 32-bit."""
    for what, strides, size in (("v", vs, itemsize), ("sqnorms", os_, 4)):
        if any(abs(s) * size >= 2**31 for s in strides[1:3]):
            raise ValueError(f"`{what}`: the strides of a page's slot and head axes must be "
                             f"below 2**31 bytes, got {strides} elements")


def _start_arg(start, B, ops, like, device, keep):
    """(pointer, int64 flag, scalar) of ``start`` for value_sqnorms_rows: an integer is the
    kernel's scalar start0 (no array, no copy); a device int32 or int64 array (B,) is read
    in place; host arrays and other dtypes are copied or converted to int32 first."""
    from .cuda.runtime import arrays

    value = None
    if isinstance(start, (int, np.integer)) and not isinstance(start, bool):
        value = int(start)
    elif not isinstance(start, bool):
        host = arrays.host_values("start", start)
        if host is not None and np.ndim(host) == 0:
            value = int(np.asarray(host))
    if value is not None:
        if not -2**63 <= value < 2**63:
            raise ValueError(f"`start` must fit in int64, got {value}")
        return 0, 0, value
    x = _device_int32("start", start, B, ops, like, device, keep, allow_int64=True)
    return ops.ptr(x), int(ops.dtype_name(ops.meta(x)[0]) == "int64"), 0


def _device_int32(name, x, n, ops, like, device, keep, exact=False, allow_int64=False):
    """``x`` as a contiguous int32 device array of ``ops``'s framework (copied from the host,
    or converted, when it is not one already; ``exact``: the page table must already be
    int32 on the device, as the kernels take it; ``allow_int64``: a device int64 array is
    kept as it is)."""
    from .cuda.runtime import arrays

    host = None
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        host = np.full(n, int(x), dtype=np.int32)
    else:
        host = arrays.host_values(name, x)
    if host is not None:
        if exact:
            raise TypeError(f"`{name}` must be a GPU array (the page table of a GPU cache)")
        host = np.asarray(host)
        if host.ndim == 0:
            host = np.full(n, int(host), dtype=np.int32)
        if n is not None and host.shape != (n,):
            raise ValueError(f"`{name}` must have shape ({n},), got {host.shape}")
        if host.size and (host.min() < -2**31 or host.max() >= 2**31):
            raise ValueError(f"`{name}` must fit in int32")
        h32 = np.ascontiguousarray(host, dtype=np.int32)
        d = ops.empty(like, (h32.size,), "int32")
        if ops is arrays.TORCH:
            import torch

            d.copy_(torch.from_numpy(h32))
        else:
            d.set(h32)
        keep.append(d)
        return d
    xo = arrays.ops_for(name, x)
    if xo is not ops:
        x = arrays.to_cupy(name, x)
        if ops is arrays.TORCH:
            import torch

            x = torch.from_dlpack(x)
    dt, shp, dev = ops.meta(x)
    if dev != device:
        raise ValueError(f"`{name}` must be on the GPU of `v` ({device}), got device {dev}")
    if n is not None and tuple(int(s) for s in shp) != (n,):
        raise ValueError(f"`{name}` must have shape ({n},), got {tuple(shp)}")
    if ops.dtype_name(dt) != "int32" and not (allow_int64 and ops.dtype_name(dt) == "int64"):
        if exact:
            raise TypeError(f"`{name}` must be int32 on the GPU, got {ops.dtype_name(dt)}")
        x = x.to(getattr(__import__("torch"), "int32")) if ops is arrays.TORCH \
            else x.astype(np.int32)
    x = ops.contiguous(name, x)
    keep.append(x)
    return x
