"""Attention statistics, real SmolLM2 vs :mod:`stochattn.eval.calibrated` (docs/generator.md).

Three steps, run from the repository root::

    python -m stochattn.eval.compare_stats --measure hamlet:2048 macbeth:2048 hamlet:8192   # ~5 min CPU
    python -m stochattn.eval.compare_stats --fit        # per-head fit -> stochattn/eval/calibrated_smollm2.json
    python -m stochattn.eval.compare_stats --batch 8    # -> benchmarks/results/attention_stats_compare.json

``--measure`` (needs the ``eval`` extra) runs the model on each ``play:tokens``, takes the
statistics of :func:`stochattn.eval.llm.attention_stats.query_stats` for the last 64 queries, and
writes ``benchmarks/results/attention_stats_real.json``: per run, per (layer, head) the mean over
the queries of the fraction of keys for 50/90/95/99% of the mass, the entropy, the sink
(first 4 tokens) and window (last 64) mass, with the median and quartiles over heads (and
over all (head, query) pairs). ``--fit`` fits ``(sigma, gamma1, gamma2, s)`` of the
calibrated model to every (layer, head) of the 2048-token runs by a grid search on a
simulation of the model's logits, and gamma3 (decay beyond 2k) per (layer, head) on the
8192-token run. The default step generates 2048 and 8192 token caches with
:func:`stochattn.eval.calibrated.make_calibrated_inputs` (one query per head) and prints the
side-by-side table of median [quartiles] over heads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np

__all__ = ["MASS_LEVELS", "stats_from_logits", "quartiles", "fit_table", "compare"]

MASS_LEVELS = (0.5, 0.9, 0.95, 0.99)
N_SINK, WINDOW = 4, 64
HERE = os.path.dirname(os.path.abspath(__file__))
# Results go to the checkout's benchmarks/results/ (run from the repository root); the
# fitted table is package data next to this module.
RESULTS = os.path.join("benchmarks", "results")
REAL_JSON = os.path.join(RESULTS, "attention_stats_real.json")
COMPARE_JSON = os.path.join(RESULTS, "attention_stats_compare.json")
TABLE_JSON = os.path.join(HERE, "calibrated_smollm2.json")
STATS = ("key_fraction_50", "key_fraction_90", "key_fraction_95", "key_fraction_99",
         "entropy", "sink_mass", "window_mass")


def stats_from_logits(x, *, n_sink=N_SINK, window=WINDOW):
    """Statistics of softmax rows: logits x (..., N) of a query over all its N keys.

    Same definitions as :func:`stochattn.eval.llm.attention_stats.query_stats` (the query is the last
    position, so the window is the last ``window`` keys). Returns a dict of float64 arrays
    of shape x.shape[:-1].
    """
    x = np.asarray(x, dtype=np.float64)
    N = x.shape[-1]
    x = x - x.max(axis=-1, keepdims=True)                   # max shift: exp <= 1
    w = np.exp(x)
    w /= w.sum(axis=-1, keepdims=True)
    cum = np.cumsum(-np.sort(-w, axis=-1), axis=-1)
    out = {}
    for m in MASS_LEVELS:
        # Fewest largest weights reaching the mass (1e-12 slack for the cumulative sum).
        out[f"key_fraction_{int(round(100 * m))}"] = np.minimum(
            ((cum < m - 1e-12).sum(axis=-1) + 1) / N, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["entropy"] = -np.where(w > 0, w * np.log(w), 0.0).sum(axis=-1)
    out["sink_mass"] = w[..., :n_sink].sum(axis=-1)
    out["window_mass"] = w[..., max(0, N - window):].sum(axis=-1)
    return out


def quartiles(a):
    """``{"q1", "median", "q3"}`` of a flattened array (plain floats)."""
    q1, med, q3 = np.percentile(np.asarray(a, dtype=np.float64).ravel(), [25, 50, 75])
    return {"q1": float(q1), "median": float(med), "q3": float(q3)}


def _summary(d, n_tokens):
    """Quartiles of every statistic; key fractions also as key counts (fraction * N)."""
    out = {}
    for key in STATS:
        out[key] = quartiles(d[key])
        if key.startswith("key_fraction"):
            out[key.replace("fraction", "count")] = quartiles(np.asarray(d[key]) * n_tokens)
    return out


# ---------------------------------------------------------------------------- measure

def measure(specs, path=REAL_JSON, n_queries=64):
    """Run SmolLM2 on ``play:tokens`` specs and write the compact real statistics."""
    from .llm.attention_stats import query_stats
    from .llm.evaluate import load_tokens
    from .llm.forward import forward
    from .llm.model import load_model
    from .llm.tokenizer import build_tokenizer

    weights, tok = load_model(), build_tokenizer()
    runs = []
    for spec in specs:
        play, T = spec.split(":")
        T = int(T)
        pos = np.arange(T - n_queries, T)
        pre = forward(weights, load_tokens(play, T, tokenizer=tok), keep_kv=True,
                      capture_q=pos)
        per = [query_stats(q, k, pos, n_sink=N_SINK, window=WINDOW)
               for q, k in zip(pre.q, pre.k)]
        runs.append(_run_record(play, T, per))
        print(f"measured {spec}", flush=True)
    _write_real(runs, path)
    return runs


def _run_record(play, n_tokens, per_layer):
    """Per (layer, head) means over queries + summaries, from per-layer query_stats dicts."""
    kf = np.stack([d["key_fraction"] for d in per_layer])         # (L, Q, H, 4)
    pq = {f"key_fraction_{int(round(100 * m))}": kf[..., i] for i, m in enumerate(MASS_LEVELS)}
    for key in ("entropy", "sink_mass", "window_mass"):
        pq[key] = np.stack([d[key] for d in per_layer])            # (L, Q, H)
    heads = {key: a.mean(axis=1) for key, a in pq.items()}         # (L, H)
    return {
        "play": play, "n_tokens": n_tokens, "n_queries": int(kf.shape[1]),
        "layers": int(kf.shape[0]), "heads": int(kf.shape[2]),
        "per_head": {key: np.round(a, 6).tolist() for key, a in heads.items()},
        "summary_over_heads": _summary(heads, n_tokens),
        "summary_over_head_queries": _summary(pq, n_tokens),
    }


def _write_real(runs, path):
    doc = {
        "what": "SmolLM2-135M-Instruct attention statistics, last 64 queries per run; "
                "per_head = mean over the queries per (layer, head), arrays (30, 9); "
                "key_fraction_X = fewest keys holding X% of the softmax mass / keys; "
                "sink = first 4 tokens, window = last 64 (query included); "
                "summary_over_heads = median/quartiles of the per-head means (270 pairs), "
                "summary_over_head_queries = over all (layer, head, query) triples",
        "made_by": "python -m stochattn.eval.compare_stats --measure",
        "date": str(datetime.date.today()),
        "runs": runs,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


def load_real(path=REAL_JSON):
    with open(path) as fh:
        return json.load(fh)["runs"]


# -------------------------------------------------------------------------------- fit

def _features(d, n_tokens):
    """Fit features: log key counts at the 4 levels, logits of sink and window mass."""
    f = [np.log(np.asarray(d[f"key_fraction_{int(round(100 * m))}"]) * n_tokens)
         for m in MASS_LEVELS]
    for key in ("sink_mass", "window_mass"):
        p = np.clip(np.asarray(d[key], dtype=np.float64), 1e-3, 1 - 1e-3)
        f.append(np.log(p / (1 - p)))
    return np.stack(f, axis=-1)


def fit_table(runs=None, *, n_tokens=2048, head_dim=64, n_sim=4, seed=12345, path=TABLE_JSON):
    """Grid-fit ``(sigma, gamma1, gamma2, s)`` per (layer, head) at ``n_tokens``, then gamma3.

    The model's logits at ``n_tokens`` (:func:`stochattn.eval.calibrated.unit_logit_components`,
    ``n_sim`` content directions, fixed seed) are evaluated on a grid; each real head takes
    the grid point whose mean features (log key counts at 50/90/95/99%, half the logit of
    the sink and window mass) are nearest in squared distance. Writes the table to ``path``.
    """
    from .calibrated import unit_logit_components

    all_runs = runs or load_real()
    runs = [r for r in all_runs if r["n_tokens"] == n_tokens]
    sig = np.geomspace(0.25, 8.0, 21)
    gam = np.linspace(0.0, 3.0, 13)
    ess = np.linspace(-8.0, 24.0, 33)
    comps = [unit_logit_components(n_tokens, head_dim, 1, seed=seed + i) for i in range(n_sim)]
    c = np.concatenate([t[0] for t in comps])            # (n_sim, N): independent caches
    a = np.stack([t[1] for t in comps], axis=1)          # (3, n_sim, N)
    s = np.stack([t[2] for t in comps])                  # (n_sim, N)
    # logits = sigma c + gamma1 a[0] + gamma2 a[1] + s sink, for every grid point.
    feats = np.empty((sig.size, gam.size, gam.size, ess.size, 6))
    for i, sg in enumerate(sig):
        for j, g1 in enumerate(gam):
            for l, g2 in enumerate(gam):
                x = (sg * c[None] + (g1 * a[0] + g2 * a[1])[None]
                     + ess[:, None, None] * s[None])
                st = stats_from_logits(x)              # (len(ess), n_sim)
                feats[i, j, l] = _features({k_: v_.mean(axis=-1) for k_, v_ in st.items()},
                                           n_tokens)
    grid = feats.reshape(-1, 6)
    params = np.stack(np.meshgrid(sig, gam, gam, ess, indexing="ij"), axis=-1).reshape(-1, 4)
    rows, groups, err = [], [], []
    for ri, run in enumerate(runs):
        target = _features({k_: np.asarray(v_) for k_, v_ in run["per_head"].items()},
                           n_tokens)                   # (L, H, 6)
        L, H = target.shape[:2]
        for layer in range(L):
            d2 = ((target[layer][:, None, :] - grid[None]) ** 2).sum(axis=-1)   # (H, grid)
            best = d2.argmin(axis=1)
            rows.extend(params[best].tolist())
            groups.extend([ri * L + layer] * H)
            err.extend(np.sqrt(d2[np.arange(H), best]).tolist())
    rows = np.asarray(rows)
    gamma3, long_run = _fit_far_decay(rows, runs, all_runs, n_tokens, head_dim, n_sim, seed)
    L, H = np.asarray(runs[0]["per_head"]["entropy"]).shape
    g3 = np.tile(gamma3.ravel(), len(runs))            # same (layer, head) -> same gamma3
    rows = np.concatenate([rows[:, :3], g3[:, None], rows[:, 3:]], axis=1)
    doc = {
        "what": "per real (play, layer, head): [sigma, gamma1, gamma2, gamma3, s] of "
                "stochattn.eval.calibrated; group = index of the real (play, layer); gamma3 fitted "
                "per (layer, head) on the long run",
        "long_run": long_run,
        "made_by": "python -m stochattn.eval.compare_stats --fit",
        "date": str(datetime.date.today()),
        "runs": [f"{r['play']}:{r['n_tokens']}" for r in runs],
        "fit_rms_distance": quartiles(err),
        "params": np.round(rows, 4).tolist(),
        "group": groups,
    }
    with open(path, "w") as fh:
        json.dump(doc, fh)
    return doc


def _fit_far_decay(rows, runs, all_runs, n_tokens, head_dim, n_sim, seed):
    """gamma3 per (layer, head): the far decay (beyond 2k) that fits the long run.

    The long run (same play as the first short run, e.g. hamlet at 8192) is simulated with
    that run's fitted (sigma, gamma1, gamma2, s) and gamma3 on a grid; each (layer, head)
    takes the gamma3 whose log key counts and window-mass logit are nearest.
    """
    from .calibrated import unit_logit_components

    long = [r for r in all_runs if r["n_tokens"] > n_tokens and r["play"] == runs[0]["play"]]
    L, H = np.asarray(runs[0]["per_head"]["entropy"]).shape
    if not long:
        return np.zeros((L, H)), None
    run = long[0]
    N = run["n_tokens"]
    target = _features({k_: np.asarray(v_) for k_, v_ in run["per_head"].items()}, N)
    target = target.reshape(L * H, 6)[:, [0, 1, 2, 3, 5]]
    comps = [unit_logit_components(N, head_dim, 1, seed=seed + 100 + i) for i in range(n_sim)]
    c = np.concatenate([t[0] for t in comps])
    a = np.stack([t[1] for t in comps], axis=1)          # (3, n_sim, N)
    s = np.stack([t[2] for t in comps])
    g3 = np.linspace(0.0, 3.0, 13)
    p = rows[:L * H]                                     # the first short run's heads
    best = np.empty(L * H)
    for i in range(L * H):
        sg, g1, g2, ss = p[i]
        x = (sg * c + g1 * a[0] + g2 * a[1] + ss * s)[None] + g3[:, None, None] * a[2][None]
        st = stats_from_logits(x)                        # (len(g3), n_sim)
        f = _features({k_: v_.mean(axis=-1) for k_, v_ in st.items()}, N)[:, [0, 1, 2, 3, 5]]
        best[i] = g3[((f - target[i]) ** 2).sum(axis=-1).argmin()]
    return best.reshape(L, H), f"{run['play']}:{N}"


# ---------------------------------------------------------------------------- compare

def generated_stats(tokens, *, batch=16, q_heads=32, kv_heads=8, head_dim=128, seed=0):
    """Statistics of one decode step of the calibrated generator, per (b, query head)."""
    from .calibrated import make_calibrated_inputs

    q, k, _ = make_calibrated_inputs(batch, q_heads, kv_heads, tokens, head_dim, seed=seed)
    G = q_heads // kv_heads
    x = np.empty((batch, q_heads, tokens))
    for b in range(batch):
        for h in range(q_heads):
            x[b, h] = k[b, h // G].astype(np.float64) @ q[b, h].astype(np.float64)
    x /= np.sqrt(head_dim)
    return stats_from_logits(x)


def compare(real=None, *, sizes=(2048, 8192), batch=16, seed=0, path=COMPARE_JSON):
    """Side-by-side table, real (per-head means) vs generated (one query per head)."""
    real = real or load_real()
    out = {"date": str(datetime.date.today()), "generator": {
        "function": "stochattn.eval.calibrated.make_calibrated_inputs", "batch": batch, "q_heads": 32,
        "kv_heads": 8, "head_dim": 128, "seed": seed}, "sizes": {}}
    for n in sizes:
        gen = generated_stats(n, batch=batch, seed=seed)
        entry = {"generated": _summary(gen, n),
                 "generated_fraction_diffuse_heads": float(np.mean(gen["key_fraction_95"] > 0.3)),
                 "real": {}}
        for r in real:
            if r["n_tokens"] == n:
                kf95 = np.asarray(r["per_head"]["key_fraction_95"])
                entry["real"][f"{r['play']} heads"] = dict(
                    r["summary_over_heads"], fraction_diffuse_heads=float(np.mean(kf95 > 0.3)))
                entry["real"][f"{r['play']} queries"] = dict(
                    r["summary_over_head_queries"], fraction_diffuse_heads=float("nan"))
        out["sizes"][str(n)] = entry
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    return out


def format_table(doc):
    """Markdown table: median [q1, q3] per statistic, real runs and generated, per size."""
    def cell(q, key):
        if key.startswith("key_count"):
            return f"{q['median']:.0f} [{q['q1']:.0f}, {q['q3']:.0f}]"
        if key == "entropy":
            return f"{q['median']:.2f} [{q['q1']:.2f}, {q['q3']:.2f}]"
        return f"{100 * q['median']:.1f}% [{100 * q['q1']:.1f}, {100 * q['q3']:.1f}]"

    keys = ["key_count_50", "key_count_90", "key_count_95", "key_count_99",
            "key_fraction_95", "key_fraction_99", "entropy", "sink_mass", "window_mass"]
    lines = []
    for n, e in doc["sizes"].items():
        cols = [f"real {p}" for p in e["real"]] + ["generated"]
        lines.append(f"\nN = {n}: median [q1, q3]; real 'heads' = over the 270 per-head means "
                     f"(64 queries each), real 'queries' = over all 17280 (head, query) pairs, "
                     f"generated = over {doc['generator']['batch'] * 32} query heads, one query "
                     f"each\n")
        lines.append("| statistic | " + " | ".join(cols) + " |")
        lines.append("| --- " * (len(cols) + 1) + "|")
        srcs = list(e["real"].values()) + [e["generated"]]
        for key in keys:
            lines.append(f"| {key} | " + " | ".join(cell(s[key], key) for s in srcs) + " |")
        diff = ["-" if np.isnan(s["fraction_diffuse_heads"])
                else f"{100 * s['fraction_diffuse_heads']:.0f}%" for s in e["real"].values()]
        diff.append(f"{100 * e['generated_fraction_diffuse_heads']:.0f}%")
        lines.append("| heads with > 30% of keys for 95% | " + " | ".join(diff) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m stochattn.eval.compare_stats",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--measure", nargs="+", metavar="PLAY:TOKENS")
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    if args.measure:
        measure(args.measure)
        return 0
    if args.fit:
        doc = fit_table()
        print(f"fitted {len(doc['params'])} heads, rms feature distance {doc['fit_rms_distance']}")
        return 0
    print(format_table(compare(sizes=args.sizes, batch=args.batch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
