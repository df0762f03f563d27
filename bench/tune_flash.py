"""S²ANTA-flash decode time against the sampling tile size, next to torch SDPA and our exact
kernel measured in the same run: to choose the flash defaults and to see where it stands.

    python3 bench/tune_flash.py --cases 8:32768,8:131072,1:32768,32:32768 --tiles 64,128,256

Inputs as bench/bench_doublep.py (calibrated generator, Llama-3.1-8B decode shape, fp16).
Prints the median of 15 batches of 10 back-to-back calls (CUDA events) per setting, the
speedup over SDPA, and the fraction of V rows read (distinct rows per KV head).
"""

from __future__ import annotations

import argparse

from bench.bench_decode import Timing, time_steady
from bench.bench_doublep import calibrated


def gpu_us(fn):
    return time_steady(fn, Timing(batches=15, calls=10))


def rows_read(idx, group, tokens):
    """Mean over (b, KV head) of the fraction of tokens drawn by some head of the group."""
    import torch

    B, Hq, _ = idx.shape
    j = idx.view(B, Hq // group, -1)
    frac = []
    for b in range(B):
        for h in range(Hq // group):
            u = torch.unique(j[b, h])
            frac.append(int((u >= 0).sum()) / tokens)
    return sum(frac) / len(frac)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="8:32768,8:131072,1:32768,32:32768")
    ap.add_argument("--tiles", default="64,128,256")
    ap.add_argument("--budgets", default="256,2048")
    args = ap.parse_args(argv)
    import torch

    from stochattn.cuda.exact import exact_decode
    from stochattn.cuda.flash import santa_flash

    for case in args.cases.split(","):
        B, N = (int(x) for x in case.split(":"))
        q, k, v = calibrated(B, N, "float16")
        group = q.shape[1] // k.shape[1]
        sdpa = gpu_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, enable_gqa=True))
        exact = gpu_us(lambda: exact_decode(q, k, v))
        print(f"B={B} N={N}: SDPA {sdpa:.1f} us, ours exact {exact:.1f} us", flush=True)
        for S in (int(x) for x in args.budgets.split(",")):
            for ts in (int(x) for x in args.tiles.split(",")):
                fn = lambda: santa_flash(q, k, v, budget=S, tile_size=ts, seed=1)  # noqa: E731
                t = gpu_us(fn)
                _, idx = santa_flash(q, k, v, budget=S, tile_size=ts, seed=1, return_indices=True)
                print(f"  flash S={S} tile={ts}: {t:.1f} us  speedup vs SDPA {sdpa / t:.2f}x  "
                      f"V rows read {100 * rows_read(idx, group, N):.2f}%", flush=True)


if __name__ == "__main__":
    main()
