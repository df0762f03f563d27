"""k-means prefill time against the GEMM assignment's launch geometry: to choose ROW_TILE
and TILES_PER_BLOCK of stochattn/cuda/kmeans/kernels.py.

    python3 tools/tune_kmeans.py --geometries 4x4,8x2,2x8 --tokens 131072 --clusters 4096

Each geometry ``RxT`` (ROW_TILE x TILES_PER_BLOCK: rows read together, tiles per block)
runs in a fresh process, since Numba compiles the kernels with the module's constants at
the first launch. Keys: the calibrated generator (one sequence, 8 KV heads, D 128,
float16), as benchmarks/bench_kmeans.py; default early stop. Prints the median of ``--reps``
calls (CUDA events, after a compiling call) and whether the labels equal the default
geometry's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def run_one(rows: int, tiles: int, tokens: int, clusters: int, reps: int) -> dict:
    import numpy as np
    import torch

    from stochattn.cuda.kmeans import kernels as kk

    kk.ROW_TILE, kk.TILES_PER_BLOCK = rows, tiles  # before the first launch compiles them
    from benchmarks.bench_doublep import calibrated
    from stochattn.cuda.kmeans import kmeans_gpu

    _, k, v = calibrated(1, tokens, "float16")
    call = lambda: kmeans_gpu(k, v, n_clusters=clusters)  # noqa: E731
    out = call()
    ms = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        ms.append(start.elapsed_time(end))
    labels = torch.as_tensor(out["labels"]).cpu().numpy()
    return dict(rows=rows, tiles=tiles, ms=float(np.median(ms)),
                labels_sum=int(labels.astype(np.int64).sum()),
                labels_hash=int((labels.astype(np.int64) * 2654435761 % 1000003).sum()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometries", default="4x1,8x1,4x2,4x4,2x1,16x1")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--clusters", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        r, t = (int(x) for x in args.one.split("x"))
        print(json.dumps(run_one(r, t, args.tokens, args.clusters, args.reps)))
        return
    results = []
    for g in args.geometries.split(","):
        cmd = [sys.executable, __file__, "--one", g, "--tokens", str(args.tokens),
               "--clusters", str(args.clusters), "--reps", str(args.reps)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            print(f"{g}: failed\n{res.stderr[-2000:]}")
            continue
        results.append(json.loads(res.stdout.strip().splitlines()[-1]))
        r = results[-1]
        same = r["labels_hash"] == results[0]["labels_hash"]
        print(f"ROW_TILE {r['rows']} x TILES_PER_BLOCK {r['tiles']}: {r['ms']:8.2f} ms"
              f"  labels as the first: {same}", flush=True)


if __name__ == "__main__":
    main()
