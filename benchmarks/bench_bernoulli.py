"""Does Bernoulli qK^T save time? The score stage of S²ANTA-prop with exact scores, with
Bernoulli scores on the usual token-major K, and with Bernoulli scores on a feature-major
copy of K, against torch SDPA in the same run (whether skipping features pays is for this benchmark to decide).

    python3 benchmarks/bench_bernoulli.py --cases 8:32768,8:131072,1:32768,32:32768 --draws 1,2,4

Inputs: the calibrated generator (stochattn/eval/calibrated.py, Llama-3.1-8B decode shape, fp16);
the feature-major copy is made once, outside the timings. Reports the whole prop call
(S = 256, systematic) and the fraction of key features read (mean over heads; with
``--shared`` one pattern per KV head). Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.bench_decode import Timing, time_steady
from benchmarks.bench_doublep import calibrated


def gpu_us(fn):
    return time_steady(fn, Timing(batches=15, calls=10))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="8:32768,8:131072,1:32768,32:32768")
    ap.add_argument("--draws", default="1,2,4")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--shared", action="store_true", help="mean group query patterns")
    ap.add_argument("--out", default="benchmarks/results/bench_bernoulli.json")
    args = ap.parse_args(argv)
    import torch

    from stochattn.cuda.santa import santa_prop

    rows = []
    for case in args.cases.split(","):
        B, N = (int(x) for x in case.split(":"))
        q, k, v = calibrated(B, N, "float16")
        kfm = k.transpose(-1, -2).contiguous()
        sdpa = gpu_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, enable_gqa=True))
        S = args.budget
        exact = gpu_us(lambda: santa_prop(q, k, v, budget=S, seed=1))
        print(f"B={B} N={N}: SDPA {sdpa:.1f} us; prop S={S} exact scores {exact:.1f} us "
              f"({sdpa / exact:.2f}x)", flush=True)
        row = dict(batch=B, tokens=N, sdpa_us=sdpa, prop_exact_us=exact, bernoulli=[])
        for d in (int(x) for x in args.draws.split(",")):
            common = dict(budget=S, seed=1, scores="bernoulli", bernoulli_draws=d,
                          bernoulli_group_shared=args.shared)
            _, frac = santa_prop(q, k, v, return_feature_fraction=True, **common)
            tm = gpu_us(lambda: santa_prop(q, k, v, **common))
            fm = gpu_us(lambda: santa_prop(q, k, v, k_feature_major=kfm, **common))
            f = float(frac.float().mean())
            print(f"  draws={d}: features read {100 * f:.1f}%  token-major {tm:.1f} us "
                  f"({sdpa / tm:.2f}x)  feature-major {fm:.1f} us ({sdpa / fm:.2f}x)", flush=True)
            row["bernoulli"].append(dict(draws=d, feature_fraction=f, token_major_us=tm,
                                         feature_major_us=fm))
        rows.append(row)
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                budget=args.budget, shared=args.shared, dtype="float16",
                inputs="stochattn/eval/calibrated.py (calibrated on SmolLM2 traces), Hq 32, Hkv 8, D 128")
    with open(args.out, "w") as fh:
        json.dump(dict(meta=meta, cases=rows), fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
