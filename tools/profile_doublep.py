"""Where a Double-P decode call spends its time: run under Nsight Compute for the per-kernel
durations, and print the host time of one call (enqueue only, on a cache too small for the
GPU to be the bound).

    ncu --clock-control none -k regex:"doublep_|exact_decode_merge|santa_prop" --launch-skip 8 \
        --launch-count 4 --section SpeedOfLight \
        python3 tools/profile_doublep.py --batch 8 --tokens 131072 [--budget 64]

Inputs as benchmarks/bench_doublep.py (calibrated generator, one sequence copied over the batch,
``tokens / 32`` clusters); ``--iterations`` sets the k-means iterations of the index.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.bench_doublep import calibrated


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--p1", type=float, default=0.95)
    ap.add_argument("--p2", type=float, default=0.7)
    ap.add_argument("--budget", type=int, default=None,
                    help="profile the sampled variant with this budget (7 launches a call)")
    args = ap.parse_args(argv)
    kw = dict(p1=args.p1, p2=args.p2)
    if args.budget is not None:
        kw.update(approx="sample", budget=args.budget)
    import torch

    import stochattn
    from stochattn.doublep import DoublePIndex

    q, k, v = calibrated(args.batch, args.tokens, "float16")
    index = stochattn.build_doublep_index(k[:1], v[:1], n_clusters=args.tokens // 32,
                                          iterations=args.iterations)
    if args.batch > 1:
        index = DoublePIndex.stack([index] * args.batch)
    for _ in range(3):  # warm-up (plan, compile), then the profiled call
        stochattn.doublep_attention(q, k, v, index=index, **kw)
    torch.cuda.synchronize()

    qs, ks, vs = calibrated(1, 4096, "float16")
    small = stochattn.build_doublep_index(ks, vs, n_clusters=128, iterations=2)
    call = lambda: stochattn.doublep_attention(qs, ks, vs, index=small, **kw)  # noqa: E731
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / n * 1e6
    print(f"host time per call (enqueue, B=1 N=4096): {host_us:.1f} us; with the GPU: {wall_us:.1f} us")


if __name__ == "__main__":
    main()
