"""How long a fresh process waits for its first results (issue "Serving-grade decode",
item 4): the first call of each GPU estimator (compile included) against its second call.

Run twice in a row from the repository root, each in a fresh process: the first run fills
CuPy's kernel cache on disk, the second shows what a later process waits.

    python -m tools.first_use [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t_import = time.perf_counter()
    import cupy as cp

    import stochattn

    B, Hq, Hkv, N, D = 1, 32, 8, 4096, 128
    rng = cp.random.default_rng(0)
    q = rng.standard_normal((B, Hq, D), dtype=cp.float32).astype(cp.float16)
    k = rng.standard_normal((B, Hkv, N, D), dtype=cp.float32).astype(cp.float16)
    v = rng.standard_normal((B, Hkv, N, D), dtype=cp.float32).astype(cp.float16)
    cp.cuda.Device().synchronize()
    rows = {"import_and_inputs_s": time.perf_counter() - t_import}
    index = {}

    def build():
        index["ix"] = stochattn.build_doublep_index(k, v, n_clusters=N // 32)
        return index["ix"]

    calls = {
        "exact": lambda: stochattn.exact_attention(q, k, v),
        "santa_prop": lambda: stochattn.santa_attention(q, k, v, budget=256),
        "santa_flash": lambda: stochattn.santa_attention(q, k, v, budget=2048, schedule="flash"),
        "doublep_index": build,
        "doublep_decode": lambda: stochattn.doublep_attention(q, k, v, index=index["ix"]),
    }
    for name, call in calls.items():
        times = []
        for _ in range(2):
            t = time.perf_counter()
            call()
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - t)
        rows[name] = {"first_s": round(times[0], 3), "second_s": round(times[1], 4)}
    rows["total_first_s"] = round(sum(r["first_s"] for r in rows.values() if isinstance(r, dict)), 2)
    print(json.dumps(rows, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
