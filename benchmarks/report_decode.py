"""Markdown tables of a decode benchmark run (benchmarks/results/bench_decode.json), as quoted in
docs/benchmarks.md: per (dtype, batch, context) the floors, the fastest exact baseline, our
exact kernel and the sampled estimators with their time ratio to that baseline.

    python3 benchmarks/report_decode.py [path/to/bench_decode.json]
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_decode.json")
BASELINES = ("torch_sdpa", "flashinfer")  # method name prefixes of the exact baselines
SAMPLED = (("ours_santa_prop_systematic", 256), ("ours_santa_prop_systematic", 2048),
           ("ours_santa_flash_systematic", 256), ("ours_santa_flash_systematic", 2048))


def table(rows) -> str:
    """One markdown table; speedup = fastest baseline time / method time (> 1: faster)."""
    by = defaultdict(dict)
    for r in rows:
        by[(r["dtype"], r["batch"], r["context"])][(r["method"], r["budget"])] = r
    head = ["dtype", "batch", "context", "K+V floor us", "fastest baseline us", "ours exact us (% of floor)"]
    head += [f"{m.replace('ours_santa_', '').replace('_systematic', '')} S={s} us (speedup)"
             for m, s in SAMPLED]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key in sorted(by):
        m = by[key]
        base = {k: r for k, r in m.items() if k[0].startswith(BASELINES)}
        if not base or (("ours_exact", None) not in m):
            continue
        (bname, _), b = min(base.items(), key=lambda kv: kv[1]["median_us"])
        ex = m[("ours_exact", None)]
        cells = [key[0], str(key[1]), str(key[2]), f"{ex['floor_kv_us']:.0f}",
                 f"{b['median_us']:.0f} ({bname})",
                 f"{ex['median_us']:.0f} ({100 * ex['floor_kv_us'] / ex['median_us']:.0f}%)"]
        for name, S in SAMPLED:
            r = m.get((name, S))
            cells.append("-" if r is None else
                         f"{r['median_us']:.0f} ({b['median_us'] / r['median_us']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(path=DEFAULT):
    with open(path) as f:
        data = json.load(f)
    print(table(data["rows"]))


if __name__ == "__main__":
    main(*sys.argv[1:2])
