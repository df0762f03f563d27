"""Does the order of C_approx's tokens under the draws' CDF matter for Double-P's sampled
variant? Position order (the library's, the order the GPU walks the cache) against cluster
order (clusters in selection order; the reference's order before 2026-12-03).

Both are unbiased for the p2 = 1 output; only the stratified and systematic points see
the order (iid does not: it is the control). For each sampler, order and budget: the mean
over R seeds and all heads of ||o_hat - o_{p2=1}||^2 / ||o_{p2=1}||^2 (the relative
variance), on the NumPy reference, with K/V from the calibrated generator
(``stochattn.eval.calibrated``, SmolLM2 profile, Hq 9 / Hkv 3 / D 64) and an index of one cluster per
16 tokens (as the accuracy harness builds it).

Run: python3 -m tools.studies.doublep_sample_order [--tokens 8192] [--seeds 200]
Writes benchmarks/results/doublep_sample_order.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

SAMPLERS = ("systematic", "stratified", "iid")
ORDERS = ("position", "cluster")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--p1", type=float, default=0.95)
    ap.add_argument("--p2", type=float, default=0.7)
    args = ap.parse_args(argv)

    from stochattn.eval.calibrated import make_calibrated_inputs
    from stochattn.doublep import build_doublep_index
    from stochattn.reference import doublep as ref

    N, D = args.tokens, 64
    q, k, v = make_calibrated_inputs(1, 9, 3, N, D, seed=0, dtype=np.float64)
    index = build_doublep_index(k, v, n_clusters=N // 16, iterations=10, seed=0)
    lens = np.array([N])
    common = dict(p1=args.p1, scale=1 / math.sqrt(D), offset=0)
    truth, d = ref.doublep_attention(q, k, v, lens, index, p2=1.0, approx="centroid", budget=None,
                                     sampler="iid", seed=0, **common)
    norm2 = (truth ** 2).sum(axis=-1)
    t0 = time.time()
    rows = []
    for S in (int(x) for x in args.budgets.split(",")):
        for sampler in SAMPLERS:
            rel = {}
            for order in ORDERS:
                err = [((ref.doublep_attention(q, k, v, lens, index, p2=args.p2, approx="sample",
                                               budget=S, sampler=sampler, seed=1 + r,
                                               sample_order=order, **common)[0] - truth) ** 2
                        ).sum(axis=-1) / norm2 for r in range(args.seeds)]
                err = np.stack(err)  # (R, 1, Hq)
                rel[order] = dict(mean=float(err.mean()),
                                  se=float(err.mean(axis=(1, 2)).std(ddof=1) / math.sqrt(args.seeds)))
            rows.append(dict(budget=S, sampler=sampler, **{o: rel[o] for o in ORDERS},
                             ratio_cluster_over_position=rel["cluster"]["mean"] / rel["position"]["mean"]))
            r = rows[-1]
            print(f"S={S:4d} {sampler:10s} relative variance: position {r['position']['mean']:.4g} "
                  f"+- {r['position']['se']:.2g}, cluster {r['cluster']['mean']:.4g} "
                  f"+- {r['cluster']['se']:.2g}, cluster / position "
                  f"{r['ratio_cluster_over_position']:.3f}", flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), tokens=N, shape=dict(Hq=9, Hkv=3, D=D),
                clusters=N // 16, p1=args.p1, p2=args.p2, seeds=args.seeds,
                tokens_exact_fraction=float(d["tokens_exact"].mean() / N),
                inputs="stochattn.eval.calibrated.make_calibrated_inputs (smollm2), seed 0",
                seconds=time.time() - t0)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks",
                       "results", "doublep_sample_order.json")
    with open(out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
