"""The project's main job: every estimator against exact attention on one peaked instance.

Run from the repository root::

    python -m benchmarks.demo                 # prints the table (NumPy reference, CPU, < 1 min)
    python -m benchmarks.demo --json out.json # also writes the rows as JSON

One decode step of B=1, Hq=8, Hkv=2, N=4096, D=64 (float32) from
:func:`stochattn.eval.synthetic.make_decode_inputs`, whose attention is as peaked as a real LLM's.
For every estimator and baseline at a few budgets the table gives:

- ``rel. L2 err``: ``||o_hat - o|| / ||o||`` per (sequence, query head) against exact
  attention computed in float64, averaged over the heads, and for stochastic estimators
  also over ``--seeds`` seeds (seed = 0, 1, ...; offset 0); ``+-`` is the standard error
  of that mean over seeds.
- ``K rows`` / ``V rows``: the fraction of the sequence's K and V rows read per KV head
  (union over the GQA group), from the estimator's own diagnostics, averaged.
- ``mass``: the exact softmax mass of the tokens the method computes or samples.

Estimators of other modules are imported lazily; one whose module cannot be imported is
listed as "(not available)".
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import numpy as np

from stochattn.eval.synthetic import keys_for_mass, make_decode_inputs

INSTANCE = dict(batch=1, q_heads=8, kv_heads=2, tokens=4096, head_dim=64, seed=0)
N_CLUSTERS = 256  # Double-P index: about 16 middle tokens per cluster at N = 4096


def rel_l2_error(out, exact):
    """||out - exact|| / ||exact|| per (b, h), float64 (B, Hq); 0/0 counts as 0."""
    diff = np.linalg.norm(np.asarray(out, dtype=np.float64) - exact, axis=-1)
    norm = np.linalg.norm(exact, axis=-1)
    return np.divide(diff, norm, out=np.zeros_like(diff), where=norm > 0)


class Config:
    """One row: a name, a setting, and ``run(seed) -> (out, diagnostics)``."""

    def __init__(self, method, setting, run, stochastic=False):
        self.method, self.setting, self.run, self.stochastic = method, setting, run, stochastic


def _setting_text(setting: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items())


def _configs(q, k, v, unavailable: list):
    """Every configuration of the table, in order; modules that fail to import are skipped."""
    rows = []
    from stochattn.exact import exact_attention

    rows.append(Config("exact", {}, lambda s: exact_attention(q, k, v, return_diagnostics=True)))

    try:
        from stochattn.santa import santa_attention
    except ImportError as err:
        unavailable.append(("santa_attention", repr(err)))
    else:
        def santa(**kw):
            return lambda s: santa_attention(q, k, v, seed=s, offset=0, return_diagnostics=True, **kw)

        for sampler in ("systematic", "stratified", "iid"):
            for S in (16, 64, 256):
                rows.append(Config(f"santa {sampler}", {"schedule": "prop", "S": S},
                                   santa(budget=S, sampler=sampler, schedule="prop"), True))
        for S in (256, 2048):
            rows.append(Config("santa systematic", {"schedule": "flash", "S": S},
                               santa(budget=S, sampler="systematic", schedule="flash"), True))
        rows.append(Config("santa systematic", {"schedule": "prop", "S": 256, "scores": "bernoulli"},
                           santa(budget=256, sampler="systematic", schedule="prop",
                                 scores="bernoulli"), True))

    try:
        from stochattn.doublep import build_doublep_index, cluster_topk_attention, doublep_attention
    except ImportError as err:
        unavailable.append(("doublep_attention, cluster_topk_attention", repr(err)))
    else:
        index = build_doublep_index(k, v, n_clusters=N_CLUSTERS, iterations=10, n_sink=4,
                                    window=64, seed=0)
        for p1, p2 in ((0.9, 0.6), (0.95, 0.7), (0.99, 0.8)):
            rows.append(Config("double-p centroid", {"p1": p1, "p2": p2},
                               lambda s, p1=p1, p2=p2: doublep_attention(
                                   q, k, v, index=index, p1=p1, p2=p2, approx="centroid",
                                   return_diagnostics=True)))
        rows.append(Config("double-p sample", {"p1": 0.95, "p2": 0.7, "S": 256},
                           lambda s: doublep_attention(q, k, v, index=index, p1=0.95, p2=0.7,
                                                       approx="sample", budget=256, seed=s,
                                                       offset=0, return_diagnostics=True),
                           True))
        for c in (8, 32):
            rows.append(Config("cluster top-k", {"clusters": c},
                               lambda s, c=c: cluster_topk_attention(
                                   q, k, v, index=index, k_clusters=c, return_diagnostics=True)))

    from stochattn.baselines import quest_attention, top_p_attention, topk_attention

    for kt in (64, 256):
        rows.append(Config("oracle top-k", {"k": kt}, lambda s, kt=kt: topk_attention(
            q, k, v, k_tokens=kt, return_diagnostics=True)))
    for budget in (256, 1024):
        rows.append(Config("quest", {"budget": budget, "page": 16},
                           lambda s, b=budget: quest_attention(q, k, v, k_tokens=b, page_size=16,
                                                               return_diagnostics=True)))
    for p in (0.9, 0.95, 0.99):
        rows.append(Config("oracle top-p", {"p": p}, lambda s, p=p: top_p_attention(
            q, k, v, p=p, return_diagnostics=True)))
    return rows


def evaluate(config: Config, exact: np.ndarray, seeds: int) -> dict:
    """Mean error and read fractions of one configuration over its seeds."""
    runs = range(seeds) if config.stochastic else range(1)
    errors, k_frac, v_frac, mass, notes = [], [], [], [], {}
    for s in runs:
        out, diag = config.run(s)
        errors.append(float(rel_l2_error(out, exact).mean()))
        k_frac.append(float(diag.k_read_fraction.mean()))
        v_frac.append(float(diag.v_read_fraction.mean()))
        if diag.true_mass is not None:
            mass.append(float(diag.true_mass.mean()))
        for name in ("sample_waste", "k_feature_fraction", "clusters_selected", "clusters_exact"):
            value = getattr(diag, name)
            if value is not None and (name != "sample_waste" or float(np.mean(value)) > 0):
                notes.setdefault(name, []).append(float(np.mean(value)))
    n = len(errors)
    return {
        "method": config.method,
        "setting": config.setting,
        "seeds": n,
        "rel_l2_error": float(np.mean(errors)),
        "rel_l2_error_se": float(np.std(errors, ddof=1) / math.sqrt(n)) if n > 1 else None,
        "k_read_fraction": float(np.mean(k_frac)),
        "v_read_fraction": float(np.mean(v_frac)),
        "true_mass": float(np.mean(mass)) if mass else None,
        **{name: float(np.mean(vals)) for name, vals in notes.items()},
    }


# What every printed column and note means (printed under the table).
LEGEND = """
columns:
  rel. L2 err  ||o_hat - o|| / ||o|| per (sequence, query head) against exact attention in
               float64, mean over heads (and over seeds for stochastic rows, +- its standard error)
  K rows       fraction of the sequence's key rows read per KV head (union over the GQA group)
  V rows       the same for value rows
  mass         exact softmax mass of the tokens the method computes or samples (1 = all of it)
notes:
  waste        S2ANTA-flash: fraction of draws in excess of each tile's proportional share (every
               tile draws ceil(S/T) points without a global sync; the merge reweights them, so
               the estimate stays unbiased but those draws add little; docs/estimators.md)
  K feat       Bernoulli scores: fraction of key features read to estimate q.k
  |Cp|         Double-P / top-k clusters: clusters selected by the first top-p (p1), mean per head
  |Cex|        Double-P: of those, clusters computed token by token (the second top-p, p2);
               the others are read through their centroid summary
"""

NOTE_LABELS = {"sample_waste": "waste", "k_feature_fraction": "K feat",
               "clusters_selected": "|Cp|", "clusters_exact": "|Cex|"}


def format_row(row: dict) -> str:
    err = f"{row['rel_l2_error']:.4f}"
    err += f" +-{row['rel_l2_error_se']:.4f}" if row["rel_l2_error_se"] is not None else " " * 9
    mass = f"{row['true_mass']:.3f}" if row["true_mass"] is not None else "-"
    notes = " ".join(f"{NOTE_LABELS[n]} {row[n]:.3g}" for n in NOTE_LABELS if n in row)
    return (f"{row['method']:<18} {_setting_text(row['setting']):<36} {err:<16} "
            f"{row['k_read_fraction']:>7.3f} {row['v_read_fraction']:>7.3f} {mass:>6}  {notes}")


HEADER = (f"{'method':<18} {'setting':<36} {'rel. L2 err':<16} {'K rows':>7} {'V rows':>7} "
          f"{'mass':>6}  notes")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds per stochastic estimator (default 3)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")

    t0 = time.perf_counter()
    from stochattn.exact import exact_attention

    q, k, v = make_decode_inputs(**INSTANCE, dtype=np.float32)
    # Ground truth in float64 from the same (float32) inputs.
    exact = exact_attention(*(a.astype(np.float64) for a in (q, k, v)))
    frac95 = keys_for_mass(q, k).ravel()
    print("stochattn demo: exact vs approximate attention, one decode step, NumPy reference")
    print(f"instance: B={INSTANCE['batch']} Hq={INSTANCE['q_heads']} Hkv={INSTANCE['kv_heads']} "
          f"N={INSTANCE['tokens']} D={INSTANCE['head_dim']} float32, stochattn.eval.synthetic seed "
          f"{INSTANCE['seed']}; keys holding 95% of the mass per head: median "
          f"{np.median(frac95):.2%} (range {frac95.min():.2%}-{frac95.max():.2%})")
    print(f"error: mean over heads of ||o_hat - o|| / ||o||; stochastic rows: mean over "
          f"{args.seeds} seeds +- standard error; K/V rows: fraction read per KV head\n")

    unavailable: list = []
    configs = _configs(q, k, v, unavailable)
    print(HEADER)
    print("-" * len(HEADER.rstrip()) + "-" * 20)
    rows, last = [], None
    for config in configs:
        row = evaluate(config, exact, args.seeds)
        family = row["method"].split()[0]
        if last is not None and family != last:
            print()
        last = family
        print(format_row(row), flush=True)
        rows.append(row)
    for name, why in unavailable:
        print(f"{name:<18} (not available: {why})")
    elapsed = time.perf_counter() - t0
    print(LEGEND)
    print(f"{len(rows)} rows in {elapsed:.1f} s")

    if args.json:
        doc = {
            "instance": {**INSTANCE, "dtype": "float32", "generator": "stochattn.eval.synthetic.make_decode_inputs"},
            "keys_for_95pct_mass": frac95.tolist(),
            "error": "mean over (b, h) of ||o_hat - o||_2 / ||o||_2, o exact in float64; "
                     "stochastic rows also averaged over seeds 0..seeds-1 (offset 0)",
            "double_p_index": {"n_clusters": N_CLUSTERS, "iterations": 10, "n_sink": 4,
                               "window": 64, "seed": 0},
            "rows": rows,
            "unavailable": [{"function": n, "error": w} for n, w in unavailable],
            "seconds": elapsed,
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "machine": platform.platform(),
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
