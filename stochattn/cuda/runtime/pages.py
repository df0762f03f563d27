"""Paged KV caches (``stochattn.paged.PagedKV`` of GPU arrays) as kernel inputs, read in place.

:func:`paged_inputs` turns ``(q, cache)`` into :class:`PagedInputs`: ``k`` and ``v`` are the
page pools (never copied), and the plan sees the virtual contiguous shapes (B, Hkv, N, D)
with ``N = cache.token_bound`` (the host-known bound of the lengths). :func:`page_args`
gives the seven page-table arguments every K/V-reading kernel takes after its cache
pointers (kernels/kv_rows.cuh); :data:`CONTIGUOUS` is their value for contiguous caches.

Checks (attributes only, no values read): the pools are 16-byte aligned, share one set of
strides, hold D contiguous elements per row, and every stride is a multiple of 8 elements
(16 bytes); the index arrays are contiguous int32 on q's GPU; page sizes 1 to 128.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .arrays import CUPY, TORCH, ops_for, to_cupy

__all__ = ["PageArgs", "CONTIGUOUS", "PagedInputs", "paged_inputs", "page_args",
           "MAX_PAGE_SIZE"]

MAX_PAGE_SIZE = 128


class PageArgs(NamedTuple):
    """The page-table arguments of a kernel, typed (kernels/kv_rows.cuh, in this order)."""

    kv_indptr: np.uint64
    kv_indices: np.uint64
    kv_last_page_len: np.uint64
    page_size: np.int32
    page_stride: np.int64
    row_stride: np.int32
    head_stride: np.int32


CONTIGUOUS = PageArgs(np.uint64(0), np.uint64(0), np.uint64(0), np.int32(0), np.int64(0),
                      np.int32(0), np.int32(0))


def _strides(ops, a) -> tuple:
    """Strides in elements."""
    if ops is TORCH:
        return tuple(int(s) for s in a.stride())
    return tuple(int(s) // a.itemsize for s in a.strides)


class PagedInputs:
    """One call's q and paged cache, as :class:`.inputs.Inputs` is for contiguous ones:
    ``ops``, ``q``, ``k`` / ``v`` (the pools), ``key`` and :meth:`pointers`; plus ``cache``,
    ``tables`` (the three index arrays in ``ops``'s framework), ``layout`` (page size and
    strides, fixed by the key) and ``metas`` (q's, and the virtual (B, Hkv, N, D) of k, v)."""

    __slots__ = ("ops", "q", "k", "v", "key", "cache", "layout", "metas", "tables")

    def __init__(self, ops, q, k, v, tables, cache, layout, metas, key):
        self.ops, self.q, self.k, self.v, self.tables = ops, q, k, v, tables
        self.cache, self.layout, self.metas, self.key = cache, layout, metas, key

    @property
    def device(self) -> int:
        return self.key[1][2]

    def pointers(self):
        """(q, k pool, v pool) device pointers; copies q only if it is not contiguous and
        aligned (the pools were checked when the inputs were made)."""
        ops = self.ops
        self.q = ops.contiguous("q", self.q)
        return np.uint64(ops.ptr(self.q)), np.uint64(ops.ptr(self.k)), np.uint64(ops.ptr(self.v))


def _framework_array(ops, name, a):
    """``a`` in the framework ``ops`` (the index arrays may come through DLPack)."""
    if ops_for(name, a) is ops:
        return a
    a = to_cupy(name, a)
    if ops is TORCH:
        import torch

        return torch.from_dlpack(a)
    return a


def paged_inputs(q, cache) -> PagedInputs:
    """Classify ``q`` and a GPU :class:`~stochattn.paged.PagedKV`, check the pools' strides
    and the page table's attributes, and build the plan-cache key."""
    if cache.device != "cuda":
        raise TypeError("a paged cache of NumPy arrays runs on the reference; the GPU kernels "
                        "need GPU pages")
    ops = ops_for("q", q)
    if ops is not TORCH and ops is not CUPY:
        q, ops = to_cupy("q", q), CUPY
    k, v = (_framework_array(ops, n, a) for n, a in (("k_pages", cache.k_pages),
                                                     ("v_pages", cache.v_pages)))
    tables = [_framework_array(ops, n, getattr(cache, n))
              for n in ("kv_indptr", "kv_indices", "kv_last_page_len")]
    dtype, _, dev = ops.meta(q)
    for name, a in (("k_pages", k), ("v_pages", v)):
        pdtype, _, pdev = ops.meta(a)
        if pdev != dev:
            raise ValueError(f"`{name}` must be on the GPU of `q` ({dev}), got device {pdev}")
        if ops.dtype_name(pdtype) != ops.dtype_name(dtype):
            raise TypeError(f"`{name}` must have the dtype of `q` ({ops.dtype_name(dtype)}), got "
                            f"{ops.dtype_name(pdtype)}")
        if ops.ptr(a) % 16:
            raise ValueError(f"`{name}` must be 16-byte aligned (the kernels read 16-byte "
                             "pieces of rows)")
    ks, vs = _strides(ops, k), _strides(ops, v)
    if ks != vs:
        raise ValueError(f"`k_pages` and `v_pages` must share their strides (elements), got {ks} "
                         f"and {vs}")
    H, D, P = cache.kv_heads, cache.head_dim, cache.page_size
    if not 1 <= P <= MAX_PAGE_SIZE:
        raise ValueError(f"`page_size` must be in [1, {MAX_PAGE_SIZE}] on the GPU, got {P}")
    page_stride, a1, a2, last = ks
    # NHD pages are (page_size, Hkv, D): token stride a1, head stride a2; HND the reverse.
    row_stride, head_stride = (a1, a2) if cache.layout == "NHD" else (a2, a1)
    if last != 1 or any(s % 8 for s in (page_stride, row_stride, head_stride)):
        raise ValueError(f"the page pools must hold each row's {D} features contiguously with "
                         f"every stride a multiple of 8 elements (16 bytes), got strides {ks}")
    for name, a in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), tables):
        tdtype, _, tdev = ops.meta(a)
        if ops.dtype_name(tdtype) != "int32":
            raise TypeError(f"`{name}` must be int32 on the GPU (FlashInfer's dtype), got "
                            f"{ops.dtype_name(tdtype)}")
        if tdev != dev:
            raise ValueError(f"`{name}` must be on the GPU of `q` ({dev}), got device {tdev}")
        contiguous = a.is_contiguous() if ops is TORCH else a.flags.c_contiguous
        if not contiguous:
            raise ValueError(f"`{name}` must be contiguous")
    B, N = cache.batch, cache.token_bound
    if N >= 2**31:
        raise ValueError(f"`max_tokens` must be below 2**31, got {N}")
    virtual = (B, H, N, D)
    metas = {"q": ops.meta(q), "k": (dtype, virtual, dev), "v": (dtype, virtual, dev)}
    layout = (P, int(page_stride), int(row_stride), int(head_stride))
    key = (ops.name, ops.meta(q), metas["k"], metas["v"], ("paged",) + layout)
    return PagedInputs(ops, q, k, v, tables, cache, layout, metas, key)


def page_args(inp) -> PageArgs:
    """The page-table arguments of one call: :data:`CONTIGUOUS` for contiguous inputs."""
    if not isinstance(inp, PagedInputs):
        return CONTIGUOUS
    P, page_stride, row_stride, head_stride = inp.layout
    ptrs = [np.uint64(inp.ops.ptr(a)) for a in inp.tables]
    return PageArgs(*ptrs, np.int32(P), np.int64(page_stride), np.int32(row_stride),
                    np.int32(head_stride))
