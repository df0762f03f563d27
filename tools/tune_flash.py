"""S²ANTA-flash decode time against the sampling tile size, next to torch SDPA and our exact
kernel measured in the same run: to choose the flash defaults and to see where it stands.

    python3 tools/tune_flash.py --cases 8:32768,8:131072,1:32768,32:32768 --tiles 64,128,256
    python3 tools/tune_flash.py --kernels simt,tc --tc-tilings all --tiles 64 --json out.json

Inputs as benchmarks/bench_doublep.py (calibrated generator, Llama-3.1-8B decode shape, fp16).
Prints the median of 15 batches of 10 back-to-back calls (CUDA events) per setting, the
speedup over SDPA, and the fraction of V rows read (distinct rows per KV head). Kernels:
"simt" (CUDA-core logits) and "tc" (tensor-core logits; ``--tc-tilings default`` times
the active tiling, ``all`` every one of ``stochattn.cuda.config.FLASH_TC_TILINGS``).
``--json`` writes every measurement.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.bench_decode import Timing, time_steady
from benchmarks.bench_doublep import calibrated


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
    ap.add_argument("--kernels", default="simt", help="comma list of simt, tc")
    ap.add_argument("--tc-tilings", choices=("default", "all"), default="default")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    import torch

    from stochattn.cuda import config
    from stochattn.cuda.exact import exact_decode
    from stochattn.cuda.flash import santa_flash

    variants = []  # (label, kernel, tc tiling or None)
    for kern in args.kernels.split(","):
        if kern == "tc":
            tilings = (config.FLASH_TC_TILINGS if args.tc_tilings == "all"
                       else (config.get_config().flash_tc_tiling,))
            variants += [(t.label(), "tc", t) for t in tilings]
        else:
            variants.append((kern, kern, None))
    default_tc = config.get_config().flash_tc_tiling
    rows = []
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
                for label, kern, tiling in variants:
                    with config.using_config(flash_tc_tiling=tiling or default_tc):
                        def fn():
                            return santa_flash(q, k, v, budget=S, tile_size=ts, seed=1,
                                               kernel=kern)
                        t = gpu_us(fn)
                        _, idx = santa_flash(q, k, v, budget=S, tile_size=ts, seed=1,
                                             return_indices=True, kernel=kern)
                    frac = rows_read(idx, group, N)
                    rows.append({"batch": B, "context": N, "budget": S, "tile_size": ts,
                                 "kernel": label, "us": t, "sdpa_us": sdpa, "exact_us": exact,
                                 "speedup_vs_sdpa": sdpa / t, "v_rows_read": frac})
                    print(f"  flash {label:14s} S={S} tile={ts}: {t:.1f} us  speedup vs SDPA "
                          f"{sdpa / t:.2f}x  V rows read {100 * frac:.2f}%", flush=True)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "timing": "median of 15 batches of 10 calls", "inputs": "bench_doublep.calibrated fp16",
                "default_flash_tc_tiling": default_tc.label()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
