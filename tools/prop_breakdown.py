"""Where S2ANTA-prop spends its time, per pass-1 kernel and tiling, against torch SDPA
(GPU machine).

At the Llama-3.1-8B decode shape (Hq 32, Hkv 8, D 128, fp16, Gaussian K/V made on the GPU,
full sequences), for S = 256 (systematic, tile 64), times:

- the whole call for pass 1 on the CUDA cores ("simt": logits, then the tile-statistics
  launch) and on the tensor cores ("tc", every compiled tiling of
  ``stochattn.cuda.config.PROP_TC_TILINGS``: logits and tile statistics in one launch);
- the whole call and each launch of the cached plan alone (the others replaced by no-ops)
  under CUDA-graph replay (tools.tune_exact_tc.time_graph: GPU time without the host's);
- torch SDPA (``enable_gqa=True``) in the same run, and the K-only bandwidth floor (bytes of
  K over the measured copy bandwidth).

Timing: tools.tune_decode.time_steady (3 warm-ups, median over 5 batches of 20
back-to-back calls between CUDA events). ``--json PATH`` writes every row.
Run: PYTHONPATH=. python3 tools/prop_breakdown.py [--json PATH] [--cases 8:32768,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time

from benchmarks.bench_decode import launches_alone, plan_of as _plan_of
from tools.tune_decode import time_steady
from tools.tune_exact_tc import time_graph

HQ, HKV, D, S, TILE = 32, 8, 128, 256, 64
CASES = ((1, 32768), (1, 131072), (8, 32768), (8, 131072), (32, 32768))


def _launches_alone(call, plan):
    """GPU time of each launch of ``plan`` (CUDA-graph replay) with the others replaced by
    no-ops."""
    names = [n for n in ("logits", "tiles", "sample") if getattr(plan, n) is not None]
    return launches_alone(lambda: time_graph(call), [(n, plan, n, None) for n in names])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default=",".join(f"{b}:{n}" for b, n in CASES))
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from stochattn.cuda import config
    from stochattn.cuda.santa import santa_prop

    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / (time_steady(lambda: y.copy_(x), batches=3, calls=5) * 1e-6)
    del x, y
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); S = {S}, tile {TILE}, fp16")
    variants = [("simt", None)] + [("tc", t) for t in config.PROP_TC_TILINGS]
    rows = []
    for case in args.cases.split(","):
        B, N = (int(a) for a in case.split(":"))
        torch.manual_seed(0)
        q = torch.randn(B, HQ, D, device="cuda", dtype=torch.float16)
        k = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        floor_k = k.numel() * 2 / bw * 1e6
        sdpa = time_steady(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                                  enable_gqa=True))
        ref = santa_prop(q, k, v, budget=S, tile_size=TILE, seed=1, kernel="simt",
                         return_indices=True)[1]
        for kernel, tiling in variants:
            prev = config.set_config(prop_tc_tiling=tiling) if tiling else None
            try:
                call = lambda: santa_prop(q, k, v, budget=S, tile_size=TILE, seed=1,  # noqa: E731
                                          kernel=kernel)
                plan = _plan_of(call)  # builds this variant's plan
                total = time_steady(call)
                graph = time_graph(call)
                idx = santa_prop(q, k, v, budget=S, tile_size=TILE, seed=1, kernel=kernel,
                                 return_indices=True)[1]
                same = float((idx == ref).float().mean())
                alone = _launches_alone(call, plan)
            finally:
                if prev is not None:
                    config.set_config(config=prev)
            label = kernel if tiling is None else tiling.label()
            row = dict(batch=B, tokens=N, kernel=kernel, tiling=label, total_us=total, graph_us=graph,
                       sdpa_us=sdpa, speedup=sdpa / total, k_floor_us=floor_k,
                       chunks=plan.chunks, indices_equal_simt=same,
                       **{f"{n}_us": t for n, t in alone.items()})
            rows.append(row)
            print(f"B={B:3d} N={N:6d} {label:16s}: all {total:7.1f} us ({sdpa / total:4.2f}x "
                  f"SDPA {sdpa:7.1f}) graph {graph:7.1f} | " + " | ".join(f"{n} {t:7.1f}" for n, t in alone.items())
                  + f" | K floor {floor_k:6.1f} | chunks {plan.chunks} | idx = simt {same:.4f}")
        del q, k, v
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        meta = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(),
                    torch=torch.__version__, python=platform.python_version(),
                    copy_bandwidth=bw, S=S, tile_size=TILE)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
