"""Programmatic dependent launch on and off, alternated in one run: S²ANTA-prop (S = 256,
its two launches) and Double-P (0.95, 0.7; five launches) at the decode shape of the
benchmarks (Hq 32, Hkv 8, D 128, fp16, calibrated inputs).

    python3 tools/pdl_ab.py --json out.json

Per case and setting: the steady-state median of back-to-back calls (bench_decode's
``time_steady``: CUDA events around 20 calls, median of 5 batches) and the median of
CUDA-graph replays of one call, in the order off, on, off, on (so drift shows), next to
SDPA in the same run. Prediction (2026-12-05): the gain is the launch gap per dependent
kernel, ~1-3 us each: prop 2-5 us, Double-P 5-12 us per call, more at batch 1 than at
batch 32.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.bench_decode import Timing, time_steady
from benchmarks.bench_doublep import calibrated


def graph_us(fn, replays=50):
    """Median CUDA-event time of one replay of a graph that captured ``fn`` once."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # plans and compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prop-cases", default="1:32768,8:32768,32:32768,8:131072")
    ap.add_argument("--doublep-cases", default="1:32768,8:131072,32:32768")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    import torch

    from stochattn.cuda import config
    from stochattn.cuda.doublep import doublep_decode
    from stochattn.cuda.santa import santa_prop
    from stochattn.doublep import build_doublep_index

    base = config.get_config()
    rows = []

    def ab(label, fn, B, N, sdpa):
        for rnd in range(2):
            for pdl in (False, True):
                prev = config.set_config(config=base.replace(pdl=pdl))
                try:
                    eager = time_steady(fn, Timing(batches=5, calls=20))
                    try:
                        graphed = graph_us(fn)
                    except Exception as exc:  # noqa: BLE001 - report, keep timing the rest
                        print(f"  graph capture failed: {exc!r}", flush=True)
                        graphed = float("nan")
                finally:
                    config.set_config(config=prev)
                rows.append(dict(kernel=label, batch=B, context=N, pdl=pdl, round=rnd,
                                 eager_us=eager, graph_us=graphed, sdpa_us=sdpa))
                print(f"{label} B={B} N={N} pdl={'on ' if pdl else 'off'} round {rnd}: eager "
                      f"{eager:7.1f} us, graph {graphed:7.1f} us (SDPA {sdpa:.1f})", flush=True)

    def sdpa_us(q, k, v):
        return time_steady(lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, enable_gqa=True), Timing(batches=5, calls=20))

    for case in args.prop_cases.split(","):
        B, N = (int(x) for x in case.split(":"))
        q, k, v = calibrated(B, N, "float16")
        ab("prop S=256", lambda: santa_prop(q, k, v, budget=256, seed=1), B, N, sdpa_us(q, k, v))
        del q, k, v
        torch.cuda.empty_cache()
    for case in args.doublep_cases.split(","):
        B, N = (int(x) for x in case.split(":"))
        q, k, v = calibrated(B, N, "float16")
        index = build_doublep_index(k, v, n_clusters=N // 32, seed=0)
        ab("doublep (0.95, 0.7)", lambda: doublep_decode(q, k, v, index, p1=0.95, p2=0.7), B, N,
           sdpa_us(q, k, v))
        del q, k, v, index
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
