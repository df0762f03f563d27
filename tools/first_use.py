"""How long a fresh process waits for its first results (issue "Serving-grade decode",
item 4): the first call of each GPU estimator (compile included) against its second call.

Run twice in a row from the repository root, each in a fresh process: the first run fills
CuPy's kernel cache and the k-means kernels' disk cache (stochattn/cuda/kmeans/diskcache.py),
the second shows what a later process waits.

    python -m tools.first_use [--out FILE.json] [--no-index-processes | --index-processes-only]

It also runs the Double-P index build alone in three more fresh processes that share an
empty temporary ``NUMBA_CACHE_DIR`` (row ``doublep_index_processes``): "cold", which
compiles the k-means kernels and saves them (Numba's cache and the raw entries of
stochattn/cuda/kmeans/raw.py), "warm", which launches the raw entries without importing
Numba, and "warm_numba" (``STOCHATTN_KMEANS_RAW=0``), which loads Numba's cache; each
reports its first and second build, its path ("raw" or "numba"), whether Numba was
imported, and (where it was) how many kernels it loaded from disk and compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

B, HQ, HKV, N, D = 1, 32, 8, 4096, 128


def _inputs(cp):
    rng = cp.random.default_rng(0)
    q = rng.standard_normal((B, HQ, D), dtype=cp.float32).astype(cp.float16)
    k = rng.standard_normal((B, HKV, N, D), dtype=cp.float32).astype(cp.float16)
    v = rng.standard_normal((B, HKV, N, D), dtype=cp.float32).astype(cp.float16)
    cp.cuda.Device().synchronize()
    return q, k, v


def _twice(call, cp) -> dict:
    times = []
    for _ in range(2):
        t = time.perf_counter()
        call()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t)
    return {"first_s": round(times[0], 3), "second_s": round(times[1], 4)}


def index_only() -> dict:
    """The Double-P index build alone (the ``--index-only`` child process)."""
    t_import = time.perf_counter()
    import cupy as cp

    import stochattn
    from stochattn.cuda.kmeans import rawplan

    _, k, v = _inputs(cp)
    row = {"import_and_inputs_s": round(time.perf_counter() - t_import, 3)}
    row.update(_twice(lambda: stochattn.build_doublep_index(k, v, n_clusters=N // 32), cp))
    counts = rawplan.counts()
    row["path"] = "raw" if counts["plans"] else "numba"  # raw: cubins launched without Numba
    row["raw_launches"] = counts["launches"]
    row["numba_imported"] = "numba" in sys.modules
    if "stochattn.cuda.kmeans.raw" in sys.modules:  # what the export wrote, or why not
        row["raw_export"] = sys.modules["stochattn.cuda.kmeans.raw"].export_report()
    if row["numba_imported"]:  # (importing the kernels here would import Numba)
        from stochattn.cuda.kmeans import diskcache, kernels

        row["kernels_loaded"], row["kernels_compiled"] = diskcache.counts(kernels)
    return row


def index_processes() -> dict:
    """Cold and warm first index builds: child processes sharing one empty cache directory:
    "cold" (compiles through Numba, writes the disk cache and the raw entries), "warm" (the
    raw entries: no Numba) and "warm_numba" (``STOCHATTN_KMEANS_RAW=0``: Numba's loads)."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="stochattn-first-use-") as tmp:
        env = {k: v for k, v in os.environ.items()
               if k not in ("STOCHATTN_KMEANS_CACHE", "STOCHATTN_KMEANS_RAW",
                            "NUMBA_ENABLE_CUDASIM")}
        env["NUMBA_CACHE_DIR"] = tmp
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        for name in ("cold", "warm", "warm_numba"):
            child = dict(env, STOCHATTN_KMEANS_RAW="0") if name == "warm_numba" else env
            proc = subprocess.run([sys.executable, "-m", "tools.first_use", "--index-only"],
                                  cwd=root, env=child, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"the {name} index process failed:\n{proc.stderr[-4000:]}")
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-index-processes", action="store_true",
                    help="skip the cold and warm index builds in child processes")
    ap.add_argument("--index-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index-processes-only", action="store_true",
                    help="only the cold and warm index builds in child processes")
    args = ap.parse_args(argv)
    if args.index_only:
        row = index_only()
        print(json.dumps(row))
        return row
    if args.index_processes_only:
        rows = {"doublep_index_processes": index_processes()}
        print(json.dumps(rows, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return rows
    t_import = time.perf_counter()
    import cupy as cp

    import stochattn

    q, k, v = _inputs(cp)
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
        rows[name] = _twice(call, cp)
    rows["total_first_s"] = round(sum(r["first_s"] for r in rows.values()
                                      if isinstance(r, dict)), 2)
    if not args.no_index_processes:
        rows["doublep_index_processes"] = index_processes()
    print(json.dumps(rows, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
