"""GPU exact decode with ``return_lse=True`` (exact_decode.cu, exact_decode_tc.cu, merge.cuh)
against the float64 reference's log-sum-exp, on every path that writes a row: one chunk,
several chunks merged in the kernel or by the merge launch; CuPy and torch, paged and
contiguous, CUDA-graph capture, and a single-GPU context-parallel check.

Tolerance: lse is a natural log of a sum of fp32 (simt) or input-dtype-rounded (tc) weights
of logits of rounded inputs; |lse - ref| <= 1e-3 + 1e-3 |ref| (fp16) and 8e-3 + 1e-3 |ref|
(bf16: the tc kernel adds bf16-rounded weights, relative error <= 2^-8 each, so ln of their
sum is within ~4e-3).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn.context_parallel import merge_partials  # noqa: E402
from stochattn.cuda import config  # noqa: E402
from stochattn.cuda.exact import KERNELS, exact_decode  # noqa: E402
from stochattn.reference.exact import exact_attention as ref_exact  # noqa: E402

from gpu_helpers import peaked_inputs, to_device, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu
ATOL = {"float16": 1e-3, "bfloat16": 8e-3}


def _lse_check(lse, ref, dtype):
    assert lse.shape == ref.shape
    fin = np.isfinite(ref)
    assert (np.isneginf(lse) == np.isneginf(ref)).all() and (np.isnan(lse) == np.isnan(ref)).all()
    np.testing.assert_allclose(lse[fin], ref[fin], rtol=1e-3, atol=ATOL[dtype])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("chunks,in_kernel", [(1, True), (5, True), (5, False), (None, True)])
def test_lse_every_path(kernel, dtype, D, G, chunks, in_kernel):
    B, Hkv, N = 4, 2, 1500
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=G * 11 + D)
    qd, kd, vd = (to_device(a, dtype) for a in (q, k, v))  # float16: CuPy, bfloat16: torch
    q64, k64, v64 = to_host64(qd), to_host64(kd), to_host64(vd)
    lens = np.array([0, 1, N, 777], dtype=np.int32)
    with config.using_config(merge_in_kernel=in_kernel):
        out0 = exact_decode(qd, kd, vd, lens, num_chunks=chunks, kernel=kernel)
        out, lse = exact_decode(qd, kd, vd, lens, num_chunks=chunks, kernel=kernel,
                                return_lse=True)
    assert type(lse) is type(out) and str(lse.dtype).endswith("float32")
    np.testing.assert_array_equal(to_host64(out), to_host64(out0))  # the output is unchanged
    ref_o, ref_lse = ref_exact(q64, k64, v64, lens, 1 / math.sqrt(D), return_lse=True)
    _lse_check(to_host64(lse), ref_lse, dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunks", [1, 4])
def test_lse_nan_rows(kernel, chunks):
    q, k, v = peaked_inputs(2, 2, 4, 600, 128, seed=3)
    q[0, 1, 7] = np.nan
    k[1, 0, 100, 3] = np.inf
    qd, kd, vd = (to_device(a, "float16") for a in (q, k, v))
    _, lse = exact_decode(qd, kd, vd, num_chunks=chunks, kernel=kernel, return_lse=True)
    _, ref = ref_exact(to_host64(qd), to_host64(kd), to_host64(vd), None, 128 ** -0.5,
                       return_lse=True)
    _lse_check(to_host64(lse), ref, "float16")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lse_paged_and_contiguous(kernel, dtype):
    from paged_helpers import gpu_paged
    from stochattn.paged import from_contiguous

    q, k, v = peaked_inputs(3, 2, 4, 900, 128, seed=9)
    lens = np.array([900, 31, 0], dtype=np.int32)
    qd, kd, vd = (to_device(a, dtype) for a in (q, k, v))
    cache = gpu_paged(from_contiguous(to_host64(kd).astype(np.float32),
                                      to_host64(vd).astype(np.float32), lens, page_size=16), dtype)
    for chunks in (1, 3):
        a = exact_decode(qd, kd, vd, lens, num_chunks=chunks, kernel=kernel, return_lse=True)
        b = exact_decode(qd, cache, num_chunks=chunks, kernel=kernel, return_lse=True)
        _, ref = ref_exact(to_host64(qd), to_host64(kd), to_host64(vd), lens, 128 ** -0.5,
                           return_lse=True)
        _lse_check(to_host64(a[1]), ref, dtype)
        _lse_check(to_host64(b[1]), ref, dtype)  # paged: the chunk split may differ (N)


def test_lse_preallocated_checked_and_graph_capture():
    torch = pytest.importorskip("torch")
    q, k, v = peaked_inputs(2, 2, 4, 2000, 128, seed=1)
    qd, kd, vd = (to_device(a, "bfloat16") for a in (q, k, v))
    out = torch.empty_like(qd)
    lse = torch.empty((2, 8), dtype=torch.float32, device="cuda")
    with pytest.raises(TypeError, match="`lse` must have dtype float32"):
        exact_decode(qd, kd, vd, return_lse=True, lse=torch.empty((2, 8), dtype=torch.float16,
                                                                    device="cuda"))
    with pytest.raises(ValueError, match=r"`lse` must have shape \(2, 8\)"):
        exact_decode(qd, kd, vd, return_lse=True, lse=torch.empty((2, 9), device="cuda"))
    from stochattn.cuda.runtime.workspace import Workspace

    ws = Workspace()
    ref = exact_decode(qd, kd, vd, num_chunks=4, return_lse=True)
    o, l = exact_decode(qd, kd, vd, num_chunks=4, out=out, lse=lse, workspace=ws, return_lse=True)
    assert o is out and l is lse
    lse.fill_(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        exact_decode(qd, kd, vd, num_chunks=4, out=out, lse=lse, workspace=ws, return_lse=True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(lse, ref[1]) and torch.equal(out, ref[0])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("R", [2, 3])
def test_context_parallel_on_one_gpu(kernel, dtype, R):
    """R token shards, exact_decode(return_lse=True) on each, merge_partials: the whole
    cache's exact_decode within the flash tolerance (2x a naive attention's error)."""
    from gpu_helpers import naive_attention

    B, Hkv, G, N, D = 3, 2, 4, 3000, 128
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=R)
    qd, kd, vd = (to_device(a, dtype) for a in (q, k, v))
    q64, k64, v64 = to_host64(qd), to_host64(kd), to_host64(vd)
    lens = np.array([N, 1234, 0])
    bounds = np.linspace(0, N, R + 1).astype(int)
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        sl = np.clip(lens - a, 0, b - a).astype(np.int32)
        o, e = exact_decode(qd, kd[:, :, a:b].contiguous() if hasattr(kd, "contiguous") else
                            cupy.ascontiguousarray(kd[:, :, a:b]),
                            vd[:, :, a:b].contiguous() if hasattr(vd, "contiguous") else
                            cupy.ascontiguousarray(vd[:, :, a:b]), sl, kernel=kernel,
                            return_lse=True)
        e = to_host64(e)
        live = ~np.isneginf(e)
        parts.append((np.where(live, e, 0.0), live.astype(np.float64), to_host64(o)))
    m, l, acc = (np.stack(x) for x in zip(*parts))
    merged = merge_partials(m, l, acc)
    ref = ref_exact(q64, k64, v64, lens, D ** -0.5)
    err = np.abs(merged - ref).max()
    naive = naive_attention(q64, k64, v64, lens, D ** -0.5, dtype)
    assert err <= 2 * np.abs(naive - ref).max() + 1e-5
    whole = to_host64(exact_decode(qd, kd, vd, lens.astype(np.int32), kernel=kernel))
    assert np.abs(merged - whole).max() <= 2 * np.abs(naive - ref).max() + 1e-5
