"""Exact decode: the CUDA-core chunk kernel ("simt"), the tensor-core one ("tc", every
compiled tiling of ``stochattn.cuda.config.TC_TILINGS``) and torch SDPA, at the
Llama-3.1-8B decode shape.

Shapes: Hq 32, Hkv 8, D 128; fp16 and bf16; batch 1, 8, 32; contexts 32768 and 131072
(Gaussian K/V made on the GPU, full sequences). Timing: 3 warm-up calls, then 5 batches of
20 back-to-back calls between CUDA events; the median of the per-call times. Floor: bytes of
K+V over 4.25e12 B/s (the H200's achievable HBM read bandwidth used across benchmarks/ and
tools/). SDPA: ``F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)`` on
(B, Hq, 1, D) / (B, Hkv, N, D). Each kernel's output is checked against SDPA's (max |ours -
sdpa| / max |sdpa| < 2e-2, else the row is marked WRONG).

Prints one row per (dtype, batch, context) with time and % of the floor for simt, the
default tc tiling, the fastest tc tiling, SDPA, and the default tc and SDPA once more with
the 20 calls captured in a CUDA graph and replayed (GPU time without the host's launch
overhead, which matters at batch 1), and the default tc with the chunks merged by a second
launch instead of inside the chunk launch (``config.using_config(merge_in_kernel=False)``;
"2-launch", plain and graphed); then the tc tilings by the geometric mean of time / floor.
``--json PATH`` writes every measurement.

Run: PYTHONPATH=. python3 tools/tune_exact_tc.py [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import numpy as np

from tools.tune_decode import time_steady  # 3 warm-ups, median of batches of back-to-back calls

HQ, HKV, D = 32, 8, 128
BANDWIDTH = 4.25e12  # B/s
BATCHES = (1, 8, 32)
CONTEXTS = (32768, 131072)
DTYPES = ("float16", "bfloat16")
TOL = 2e-2


def time_graph(fn, batches=5, calls=20):
    """The same, with the ``calls`` calls captured in one CUDA graph and replayed: the GPU
    time without the host's launch overhead."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # plans and allocator pools warm outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    us = time_steady(graph.replay, batches=batches, calls=1, warmup=2) / calls
    del graph
    return us


def warm_up_gpu(seconds=1.0):
    """Back-to-back 1 GB copies so the clocks are up before the first timed shape."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
    del a, b
    torch.cuda.empty_cache()


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--quick", action="store_true", help="fp16 only, default tc tiling only")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from stochattn.cuda import config
    from stochattn.cuda.exact import exact_decode

    dtypes = DTYPES[:1] if args.quick else DTYPES
    tilings = config.TC_TILINGS[:1] if args.quick else config.TC_TILINGS
    default_tiling = config.get_config().tc_tiling
    t0 = time.time()
    q0 = torch.zeros(1, HQ, D, device="cuda", dtype=torch.float16)
    k0 = torch.zeros(1, HKV, 64, D, device="cuda", dtype=torch.float16)
    exact_decode(q0, k0, k0, kernel="simt")
    exact_decode(q0, k0, k0, kernel="tc")  # compiles every tiling
    print(f"device {torch.cuda.get_device_name()}; compiled in {time.time() - t0:.0f} s", flush=True)

    warm_up_gpu()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for dname in dtypes:
        tdt = getattr(torch, dname)
        for n in CONTEXTS:
            for b in BATCHES:
                q = torch.randn(b, HQ, D, device="cuda", generator=g, dtype=torch.float32).to(tdt)
                k = torch.randn(b, HKV, n, D, device="cuda", generator=g, dtype=tdt)
                v = torch.randn(b, HKV, n, D, device="cuda", generator=g, dtype=tdt)
                nbytes = 2 * k.numel() * k.element_size()
                floor_us = nbytes / BANDWIDTH * 1e6
                q4 = q[:, :, None]

                def sdpa():
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

                ref = sdpa()[:, :, 0]
                row = {"dtype": dname, "batch": b, "context": n, "q_heads": HQ, "kv_heads": HKV,
                       "head_dim": D, "kv_bytes": nbytes, "floor_us": floor_us,
                       "floor_formula": "2 * B * Hkv * N * D * itemsize / 4.25e12 B/s"}
                row["sdpa_us"] = time_steady(sdpa)
                row["simt_err"] = rel_err(exact_decode(q, k, v, kernel="simt"), ref)
                row["simt_us"] = time_steady(lambda: exact_decode(q, k, v, kernel="simt"))
                row["tc"] = {}
                for t in tilings:
                    with config.using_config(tc_tiling=t):
                        err = rel_err(exact_decode(q, k, v, kernel="tc"), ref)
                        us = time_steady(lambda: exact_decode(q, k, v, kernel="tc"))
                    row["tc"][t.label()] = {"us": us, "err": err}
                # GPU time alone (CUDA graph replay): what the host's launch overhead hides
                # at batch 1.
                row["tc_graph_us"] = time_graph(lambda: exact_decode(q, k, v, kernel="tc"))
                row["sdpa_graph_us"] = time_graph(sdpa)
                with config.using_config(merge_in_kernel=False):
                    row["tc_two_launch_us"] = time_steady(lambda: exact_decode(q, k, v, kernel="tc"))
                    row["tc_two_launch_graph_us"] = time_graph(
                        lambda: exact_decode(q, k, v, kernel="tc"))
                rows.append(row)
                del q, k, v, q4, ref
                torch.cuda.empty_cache()
                _print_row(row, default_tiling.label())

    print("\ntc tilings by the geometric mean of time / floor over all shapes:")
    scores = {}
    for t in tilings:
        lab = t.label()
        scores[lab] = math.exp(np.mean([math.log(r["tc"][lab]["us"] / r["floor_us"]) for r in rows]))
    for lab, sc in sorted(scores.items(), key=lambda x: x[1]):
        print(f"  {lab:18s} {100 / sc:5.1f}% of floor (geomean)")
    simt = math.exp(np.mean([math.log(r["simt_us"] / r["floor_us"]) for r in rows]))
    sdpa = math.exp(np.mean([math.log(r["sdpa_us"] / r["floor_us"]) for r in rows]))
    print(f"  {'simt':18s} {100 / simt:5.1f}%\n  {'sdpa':18s} {100 / sdpa:5.1f}%")
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "bandwidth_Bps": BANDWIDTH, "timing": "median of 5 batches of 20 calls",
                "tile_config": config.get_config().tiling.label(),
                "default_tc_tiling": default_tiling.label(),
                "geomean_pct_of_floor": {**{k: 100 / s for k, s in scores.items()},
                                         "simt": 100 / simt, "sdpa": 100 / sdpa}}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


def _print_row(r, default_label):
    fl = r["floor_us"]

    def cell(us, err=None):
        bad = " WRONG" if err is not None and not err < TOL else ""
        return f"{us:8.1f} {100 * fl / us:5.1f}%{bad}"

    best = min(r["tc"], key=lambda lab: r["tc"][lab]["us"])
    tcd = r["tc"].get(default_label) or r["tc"][best]
    if not _print_row.header:
        print(f"{'dtype':8s} {'B':>3s} {'N':>7s} {'floor us':>9s} | {'simt us':>8s} {'%fl':>6s} | "
              f"{'tc us':>8s} {'%fl':>6s} | {'best tc':>8s} {'%fl':>6s} {'(tiling)':18s} | "
              f"{'sdpa us':>8s} {'%fl':>6s} | graphed: {'tc':>8s} {'%fl':>6s} {'sdpa':>8s} {'%fl':>6s}"
              f" | 2-launch: {'tc':>8s} {'%fl':>6s} graphed {'tc':>8s} {'%fl':>6s}")
        _print_row.header = True
    print(f"{r['dtype']:8s} {r['batch']:3d} {r['context']:7d} {fl:9.1f} | {cell(r['simt_us'], r['simt_err'])} | "
          f"{cell(tcd['us'], tcd['err'])} | {cell(r['tc'][best]['us'], r['tc'][best]['err'])} "
          f"({best:16s}) | {cell(r['sdpa_us'])} |          {cell(r['tc_graph_us'])} "
          f"{cell(r['sdpa_graph_us'])} |           {cell(r['tc_two_launch_us'])}         "
          f"{cell(r['tc_two_launch_graph_us'])}", flush=True)


_print_row.header = False

if __name__ == "__main__":
    main()
