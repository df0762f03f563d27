"""Helpers shared by the paged-cache GPU tests: host caches moved to the GPU, bitwise
comparison, a counting CuPy allocator and the side-stream warm-up before a graph capture.
float16 runs on CuPy, bfloat16 on torch (as gpu_helpers.to_device)."""

from __future__ import annotations

import numpy as np
import pytest

from stochattn.paged import paged_kv

cupy = pytest.importorskip("cupy")


def framework(dtype):
    return "cupy" if dtype == "float16" else "torch"


def to_gpu(a, dtype):
    """A host array (float32 pages or int index arrays) on the GPU: float pages in ``dtype``
    (float16: CuPy, bfloat16: torch), index arrays in that framework as they are."""
    if framework(dtype) == "cupy":
        return cupy.asarray(a.astype(np.float16) if a.dtype.kind == "f" else a)
    import torch

    t = torch.as_tensor(np.ascontiguousarray(a), device="cuda")
    return t.to(torch.bfloat16) if a.dtype.kind == "f" else t


def gpu_paged(host_cache, dtype, combined=False, *, index_dtype=None):
    """The host PagedKV (float32 pages) as a GPU one in ``dtype``'s framework, with the
    host's ``max_tokens``: one combined (num_pages, 2, ...) pool or two pools."""
    k, v = np.asarray(host_cache.k_pages), np.asarray(host_cache.v_pages)
    tables = {n: np.asarray(getattr(host_cache, n)) for n in ("kv_indptr", "kv_indices",
                                                               "kv_last_page_len")}
    if index_dtype is not None:
        tables = {n: a.astype(index_dtype) for n, a in tables.items()}
    tables = {n: to_gpu(a, dtype) for n, a in tables.items()}
    common = dict(layout=host_cache.layout, max_tokens=host_cache.max_tokens)
    if combined:
        return paged_kv(to_gpu(np.stack([k, v], axis=1), dtype), **tables, **common)
    return paged_kv(to_gpu(k, dtype), to_gpu(v, dtype), **tables, **common)


def host(x):
    """A GPU array (or None) as a NumPy array, bits kept (bf16 widened exactly)."""
    if x is None:
        return None
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().float().cpu().numpy() if x.is_floating_point() else x.cpu().numpy()
    return cupy.asnumpy(x)


def assert_bitwise(a, b, what):
    a, b = host(a), host(b)
    assert a.shape == b.shape, what
    assert np.array_equal(a, b, equal_nan=True), (what, float(np.nanmax(np.abs(a - b))))


class CountingAllocator:
    """CuPy allocations through the default pool, counted (``with CountingAllocator() as c:``
    then ``c.count``)."""

    def __enter__(self):
        self.pool, self.count = cupy.get_default_memory_pool(), 0

        def malloc(n):
            self.count += 1
            return self.pool.malloc(n)

        cupy.cuda.set_allocator(malloc)
        return self

    def __exit__(self, *exc):
        cupy.cuda.set_allocator(self.pool.malloc)
        return False


def warm(fn):
    """One eager call on a side stream (plans, compiles, workspaces, a stream's merge
    counters), as torch's CUDA-graph docs advise before a capture."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
