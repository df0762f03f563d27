"""Where a k-means prefill spends its time: run under Nsight Compute, which profiles only
the last call (bracketed by cudaProfilerStart/Stop), for the per-kernel durations of one
build; without ncu it prints the CUDA-event time of that call.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        python3 tools/profile_kmeans.py --tokens 131072 --clusters 4096

With ``--lineinfo`` the kernels carry a line table, for ``ncu --import-source yes`` and
``ncu -i REPORT --page source --print-source cuda`` (per-line instruction counts).

Keys and values: the calibrated generator (one sequence, 8 KV heads, D 128, float16), as
benchmarks/bench_kmeans.py.
"""

from __future__ import annotations

import argparse


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--clusters", type=int, default=4096)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--lineinfo", action="store_true",
                    help="compile the kernels with line info (ncu --print-source cuda)")
    args = ap.parse_args(argv)
    import torch

    if args.lineinfo:
        from numba.cuda.dispatcher import CUDADispatcher

        import stochattn.cuda.kmeans  # noqa: F401  (patches NumPy before the kernels load)
        from stochattn.cuda.kmeans import kernels

        for obj in vars(kernels).values():
            if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device"):
                obj.targetoptions["lineinfo"] = True

    from benchmarks.bench_doublep import calibrated
    from stochattn.cuda.kmeans import kmeans_gpu

    _, k, v = calibrated(1, args.tokens, "float16")
    call = lambda: kmeans_gpu(k, v, n_clusters=args.clusters,  # noqa: E731
                              iterations=args.iterations, tol=args.tol)
    for _ in range(2):  # compile, then a warm call
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.cudart().cudaProfilerStart()
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"kmeans_gpu N={args.tokens} C={args.clusters}: {start.elapsed_time(end):.2f} ms")


if __name__ == "__main__":
    main()
