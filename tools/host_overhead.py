"""Host cost of one decode call (GPU machine): where the microseconds of a batch-1 call go.

For torch inputs at batch 1 (Hq 32, Hkv 8, D 128, fp16, 32k tokens), prints per call:
the host time (wall time of 2000 back-to-back calls before the final synchronisation,
over 2000) and the total (after it) of exact_decode, santa_prop (both pass-1 kernels) and
torch SDPA; the host cost of one kernel launch through CuPy's ``Function`` call and
straight through ``cupy.cuda.driver.launchKernel`` with a packed argument buffer; then
cProfile's top functions by own time for santa_prop.

Run: PYTHONPATH=. python3 tools/host_overhead.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time


def host_us(fn, n=2000):
    """(host us per call, total us per call) over n back-to-back calls."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return round((t1 - t0) / n * 1e6, 2), round((t2 - t0) / n * 1e6, 2)


def main():
    import numpy as np
    import torch
    import torch.nn.functional as F

    from stochattn.cuda.runtime import launch
    from stochattn.cuda.exact import exact_decode
    from stochattn.cuda.santa import santa_prop

    B, HQ, HKV, N, D = 1, 32, 8, 32768, 128
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    qq = q[:, :, None]
    calls = {
        "exact_decode tc": lambda: exact_decode(q, k, v),
        "santa_prop tc S=256": lambda: santa_prop(q, k, v, budget=256, seed=1),
        "santa_prop simt S=256": lambda: santa_prop(q, k, v, budget=256, seed=1, kernel="simt"),
        "torch SDPA": lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True),
        "torch.empty": lambda: q.new_empty((B, HQ, D)),
    }
    for name, fn in calls.items():
        print(f"{name:24s} host / total us per call: {host_us(fn)}")

    import cupy

    launcher = launch.launcher("exact_decode", "exact_decode_merge<stochattn::f16>")
    po = cupy.random.standard_normal(HQ * 2 * D, dtype=cupy.float32)
    pml = cupy.ones(HQ * 2 * 2, dtype=cupy.float32)  # (max, sum) = (1, 1)
    out = cupy.zeros(HQ * D, dtype=cupy.float16)
    args = (np.uint64(po.data.ptr), np.uint64(pml.data.ptr), np.uint64(out.data.ptr),
            np.int32(2), np.int32(D), np.uint64(0))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    print("CuPy Function call (5 args)", host_us(lambda: launcher((HQ,), (D,), args, stream)))
    drv = getattr(cupy.cuda.driver, "launchKernel", None)
    print("cupy.cuda.driver.launchKernel:", drv)
    if drv is not None:
        vals = np.zeros(len(args), dtype=np.uint64)
        for i, a in enumerate(args):
            vals[i] = np.uint64(np.asarray(a).view(np.uint32 if a.nbytes == 4 else np.uint64))
        ptrs = (vals.ctypes.data + 8 * np.arange(len(args), dtype=np.uint64)).astype(np.uint64)
        fptr, sptr, pp = launcher.fn.ptr, stream.ptr, ptrs.ctypes.data
        print("driver launchKernel (packed)",
              host_us(lambda: drv(fptr, HQ, 1, 1, D, 1, 1, 0, sptr, pp, 0)))
        got = out.copy()
        out.fill(0)
        drv(fptr, HQ, 1, 1, D, 1, 1, 0, sptr, pp, 0)
        torch.cuda.synchronize()
        print("packed launch gives the same output:", bool((got == out).all()))

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        santa_prop(q, k, v, budget=256, seed=1)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())


if __name__ == "__main__":
    main()
