"""Where the wall time of one k-means prefill goes: GPU kernels against the gaps between
them (torch.profiler's CUDA activity trace, which sees Numba's and cuBLAS's kernels as well
as torch's), and the host functions that fill those gaps (cProfile).

    PYTHONPATH=. python3 tools/timeline_kmeans.py --tokens 32768 --clusters 1024

Prints, for one warm build (its plan cached by the calls before): its span (first kernel
start to last kernel end), the CUDA-event time around the call, the sum of kernel times, the
idle time between kernels (gaps over ``--gap-us`` listed with the kernel that follows), the
host time of a call with its plan cached and with the cache off (plan construction:
allocation, Numba views, launch preparation), of single launches (plain Numba against
prepared), and cProfile's top host functions by own time. Keys and values: the calibrated
generator, as benchmarks/bench_kmeans.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats


def _kernel_events(prof):
    """(name, start_us, duration_us) of every GPU kernel of the trace, in start order."""
    out = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        start = e.time_range.start
        out.append((e.name, float(start), float(e.time_range.end - start)))
    out.sort(key=lambda x: x[1])
    return out


def _host_costs(call, torch, k, reps=200):
    """Host time of one call's phases (no GPU waits in them), cached plan and uncached, and
    of single launches (plain Numba against prepared)."""
    import time

    import numpy as np

    from stochattn.cuda.kmeans import host as km  # BUILD_CACHE_SIZE is read from here
    from stochattn.cuda.kmeans import kernels as kk
    from stochattn.cuda.kmeans.build import BuildPlan

    keep = {}
    init, bind, run = BuildPlan.__init__, BuildPlan.bind, BuildPlan.run

    def timed(name, fn):
        def wrapped(self, *a, **kw):
            t0 = time.perf_counter()
            fn(self, *a, **kw)
            keep[name] = (time.perf_counter() - t0) * 1e6
            keep["plan"] = self
        return wrapped

    BuildPlan.__init__ = timed("init_us", init)
    BuildPlan.bind, BuildPlan.run = timed("bind_us", bind), timed("run_us", run)
    limit = km.BUILD_CACHE_SIZE
    try:
        for label, size in (("cached plan", limit), ("uncached (BUILD_CACHE_SIZE = 0)", 0)):
            km.BUILD_CACHE_SIZE = size
            keep.pop("init_us", None)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            total = (time.perf_counter() - t0) * 1e6
            torch.cuda.synchronize()
            init_us = f"{keep['init_us']:.0f} us" if "init_us" in keep else "none"
            print(f"host, {label}: whole call {total:.0f} us (returns before the GPU ends), "
                  f"plan construction {init_us}, bind {keep['bind_us']:.0f} us, run "
                  f"{keep['run_us']:.0f} us (includes its event waits)")
    finally:
        km.BUILD_CACHE_SIZE = limit
        BuildPlan.__init__, BuildPlan.bind, BuildPlan.run = init, bind, run
    p = keep["plan"]
    s, t = p.stream, np.int64(p.iterations + 1)
    launches = {
        "scan_fill (10 args), plain Numba": lambda: kk.scan_fill[p.H, kk.SCAN_TPB, s](
            p.co, p.pi, p.rd, p.ns, p.hkv, np.int64(p.C), t, np.int32(1), np.float64(p.tol),
            p.pf),
        "scan_fill (10 args), prepared": lambda: p.final_csr(int(t)),
    }
    if p.gemm:
        scratch = p.sizes.scratch("torch", k)
        p.gemm_call.rebind(*(scratch[n].data_ptr() for n in ("cent16", "keys16", "G")))
        launches["gemm (cuBLAS through CuPy)"] = lambda: p.gemm_call(0, 8)
    for name, fn in launches.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        us = (time.perf_counter() - t0) * 1e6 / reps
        torch.cuda.synchronize()
        print(f"host per launch: {name}: {us:.1f} us")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--clusters", type=int, default=1024)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--gap-us", type=float, default=15.0)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.bench_doublep import calibrated
    from stochattn.cuda.kmeans import kmeans_gpu

    _, k, v = calibrated(1, args.tokens, "float16")
    call = lambda: kmeans_gpu(k, v, n_clusters=args.clusters,  # noqa: E731
                              iterations=args.iterations, tol=args.tol)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        s.record()
        call()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    print(f"kmeans_gpu N={args.tokens} C={args.clusters}: event times {['%.2f' % t for t in times]} ms")

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        call()
        torch.cuda.synchronize()
    ks = _kernel_events(prof)
    if not ks:
        print("no kernels in the trace")
        return
    t0 = ks[0][1]
    span = ks[-1][1] + ks[-1][2] - t0
    busy = sum(d for _, _, d in ks)
    print(f"trace: {len(ks)} GPU activities, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
          f"idle {(span - busy) / 1e3:.2f} ms")
    per = {}
    for name, _, d in ks:
        short = name.split("[")[0].split("(")[0][-40:]
        n, tot = per.get(short, (0, 0.0))
        per[short] = (n + 1, tot + d)
    for name, (n, tot) in sorted(per.items(), key=lambda x: -x[1][1]):
        print(f"  {name:40s} x{n:3d} {tot:9.1f} us")
    print(f"gaps over {args.gap_us} us (start offset ms, gap us, next activity):")
    end = t0
    for name, st, d in ks:
        gap = st - end
        if gap > args.gap_us:
            short = name.split("[")[0].split("(")[0][-40:]
            print(f"  {(st - t0) / 1e3:7.3f} {gap:8.1f}  {short}")
        end = max(end, st + d)

    _host_costs(call, torch, k)

    pr = cProfile.Profile()
    pr.enable()
    call()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
    print(buf.getvalue())
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(args.top)
    print(buf.getvalue())


if __name__ == "__main__":
    main()
