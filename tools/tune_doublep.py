"""Double-P decode time against the number of token CTAs per (sequence, KV head), and the
host time of one call: to choose the default split of stochattn/cuda/doublep.py.

    python3 tools/tune_doublep.py --cases 8:131072,1:32768,32:32768 --chunks 0,2,4,8,16

``0`` is the default rule. Inputs as benchmarks/bench_doublep.py (calibrated generator, N/32
clusters; ``--iterations`` k-means rounds for the index). Prints the median of 15 batches
of 10 back-to-back calls (CUDA events) per setting, and the host time per call (enqueue
only, median of 5 loops of 20 calls, which the GPU time hides unless the host is the
bound).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.bench_decode import Timing, time_steady
from benchmarks.bench_doublep import calibrated


def gpu_us(fn, torch):
    return time_steady(fn, Timing(batches=15, calls=10))


def host_us(fn, torch, loops=5, calls=20):
    per = []
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return float(np.median(per))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="8:131072,1:32768,32:32768")
    ap.add_argument("--chunks", default="0,2,4,8,16")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--p1", type=float, default=0.95)
    ap.add_argument("--p2", type=float, default=0.7)
    args = ap.parse_args(argv)
    import torch

    import stochattn
    from stochattn.cuda.doublep import doublep_decode
    from stochattn.doublep import DoublePIndex

    for case in args.cases.split(","):
        B, N = (int(x) for x in case.split(":"))
        q, k, v = calibrated(B, N, "float16")
        index = stochattn.build_doublep_index(k[:1], v[:1], n_clusters=N // 32,
                                              iterations=args.iterations)
        if B > 1:
            index = DoublePIndex.stack([index] * B)
        line = []
        for c in (int(x) for x in args.chunks.split(",")):
            fn = lambda c=c: doublep_decode(q, k, v, index, p1=args.p1, p2=args.p2,  # noqa: E731
                                            num_chunks=c or None)
            line.append(f"{c or 'default'}: {gpu_us(fn, torch):.1f}")
        public = lambda: stochattn.doublep_attention(q, k, v, index=index, p1=args.p1,  # noqa: E731
                                                     p2=args.p2)
        print(f"B={B} N={N}: us by token CTAs per pair  " + "  ".join(line)
              + f"  | public call {gpu_us(public, torch):.1f} us, host {host_us(public, torch):.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
