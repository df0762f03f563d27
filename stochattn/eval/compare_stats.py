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

A fourth step measures what Double-P (0.95, 0.7) reads, on real decode instances and on both
generators (``hardness="calibrated"`` and ``"spread"``)::

    python -m stochattn.eval.compare_stats --doublep-reads TRACES.npz --read-sizes 2048 4096 8192 32768

``TRACES.npz`` holds SmolLM2 decode instances (:mod:`stochattn.eval.budget_traces`); the
lengths in it are measured on real and generated inputs, the others on the generators only.
Writes ``benchmarks/results/generator_doublep_reads_<date>.json`` (``--reads-out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np

__all__ = ["MASS_LEVELS", "stats_from_logits", "quartiles", "fit_table", "compare", "doublep_reads",
           "real_doublep_reads", "generated_doublep_reads"]

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

def generated_stats(tokens, *, batch=16, q_heads=32, kv_heads=8, head_dim=128, seed=0,
                    hardness="calibrated"):
    """Statistics of one decode step of the calibrated generator, per (b, query head)."""
    from .calibrated import make_calibrated_inputs

    q, k, _ = make_calibrated_inputs(batch, q_heads, kv_heads, tokens, head_dim, seed=seed,
                                     hardness=hardness)
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


# ------------------------------------------------------------------- Double-P reads

READ_STATS = ("key_fraction_95", "key_fraction_99", "sink_mass", "window_mass")


def doublep_reads(q, k, v, seq_lens=None, *, p1=0.95, p2=0.7, tokens_per_cluster=32,
                  iterations=10, seed=0, index="full"):
    """What Double-P reads on a batch of decode instances, and how peaked they are.

    The index is :func:`stochattn.doublep.build_doublep_index` on the whole cache with
    ``max(seq_lens) // tokens_per_cluster`` clusters and ``iterations`` Lloyd rounds (the
    defaults of ``benchmarks/bench_doublep.py``: 32 tokens per cluster, 10 rounds; 4 sinks,
    window 64), then one :func:`stochattn.doublep.doublep_attention` call with diagnostics.
    ``index="decode"``: the accuracy harness's decode-faithful index instead
    (:func:`stochattn.eval.llm.evaluate.decode_index`: k-means of a prompt of
    ``min(seq_lens) // 2`` tokens with ``prompt // 16`` clusters, as many clusters as the
    full recipe, the later tokens appended to their nearest centroid), the index behind
    docs/accuracy.md's Double-P rows.

    Returns a dict of float64 arrays: ``k_read_fraction`` (B, Hkv), the K rows read per KV
    head (the union over its GQA group of sinks, window and exact clusters' tokens) over
    the sequence length; ``tokens_exact_fraction`` and ``true_mass`` (B, Hq), per query
    head; and the :data:`READ_STATS` of :func:`stats_from_logits` (B, Hq) over each row's
    own ``seq_lens[b]`` keys.
    """
    from stochattn.doublep import build_doublep_index, doublep_attention

    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    lens = np.full(B, N, dtype=np.int64) if seq_lens is None else np.asarray(seq_lens, np.int64)
    if index == "decode":
        from .llm.evaluate import decode_index

        prompt = int(lens.min()) // 2
        order = np.argsort(lens, kind="stable")
        if np.any(order != np.arange(B)):
            raise ValueError("`seq_lens`: index='decode' needs non-decreasing lengths")
        idx = decode_index(k, v, lens, prefill=prompt, n_clusters=max(1, prompt // 16),
                           iterations=iterations, seed=seed)
    elif index == "full":
        C = max(1, int(lens.max()) // tokens_per_cluster)
        idx = build_doublep_index(k, v, lens, n_clusters=C, iterations=iterations, seed=seed)
    else:
        raise ValueError(f"`index`: expected 'full' or 'decode', got {index!r}")
    _, d = doublep_attention(q, k, v, lens, index=idx, p1=p1, p2=p2, return_diagnostics=True)
    out = {"k_read_fraction": np.asarray(d.k_read_fraction, dtype=np.float64),
           "tokens_exact_fraction": d.tokens_exact / lens[:, None].astype(np.float64),
           "true_mass": np.asarray(d.true_mass, dtype=np.float64)}
    G = Hq // Hkv
    st = {key: np.empty((B, Hq)) for key in READ_STATS}
    for b in range(B):
        L = int(lens[b])
        kk = np.asarray(k[b, :, :L], dtype=np.float64)                 # (Hkv, L, D)
        x = np.einsum("hnd,hd->hn", np.repeat(kk, G, axis=0),
                      np.asarray(q[b], dtype=np.float64)) / np.sqrt(D)
        sb = stats_from_logits(x)
        for key in READ_STATS:
            st[key][b] = sb[key]
    out.update(st)
    return out


def _read_summary(parts):
    """Pool a list of :func:`doublep_reads` dicts: mean, std and quartiles per field."""
    out = {}
    for key in parts[0]:
        a = np.concatenate([np.asarray(p[key]).ravel() for p in parts])
        out[key] = dict(quartiles(a), mean=float(a.mean()), std=float(a.std()), n=int(a.size))
    return out


def real_doublep_reads(traces, lengths, *, span=512, **options):
    """:func:`doublep_reads` on real decode instances, per context length.

    ``traces``: a :class:`stochattn.eval.budget_traces.DecodeTraces` (or the path of its
    ``.npz``). For each length L, the instances whose sequence length lies in
    ``(L - span, L]`` (every layer), each attending over its own prefix. Returns
    ``{L: {"positions", "summary", "per_layer_k_read_mean"}}`` for the lengths present.
    """
    from .budget_traces import load_traces

    tr = load_traces(traces) if isinstance(traces, (str, os.PathLike)) else traces
    out = {}
    for L in lengths:
        sel = np.flatnonzero((tr.seq_lens > L - span) & (tr.seq_lens <= L))
        if sel.size == 0:
            continue
        n = int(tr.seq_lens[sel].max())
        parts, per_layer = [], []
        for layer in range(tr.n_layers):
            q = tr.q[layer, sel].astype(np.float64)
            k = np.broadcast_to(tr.k[layer, :, :n].astype(np.float64)[None],
                                (sel.size,) + tr.k.shape[1:2] + (n, tr.k.shape[3]))
            v = np.broadcast_to(tr.v[layer, :, :n].astype(np.float64)[None], k.shape)
            r = doublep_reads(q, np.ascontiguousarray(k), np.ascontiguousarray(v),
                              tr.seq_lens[sel], **options)
            parts.append(r)
            per_layer.append(float(r["k_read_fraction"].mean()))
        out[int(L)] = {"play": tr.play, "positions": tr.positions[sel].tolist(),
                       "layers": tr.n_layers, "q_heads": tr.q_heads, "kv_heads": tr.kv_heads,
                       "summary": _read_summary(parts),
                       "per_layer_k_read_mean": np.round(per_layer, 5).tolist()}
    return out


def generated_doublep_reads(tokens, *, hardness="calibrated", batch=8, q_heads=9, kv_heads=3,
                            head_dim=64, seed=0, **options):
    """:func:`doublep_reads` on one decode step of the generator (one query per head), one
    sequence at a time; default shape SmolLM2's (Hq 9, Hkv 3, D 64)."""
    from .calibrated import make_calibrated_inputs

    q, k, v = make_calibrated_inputs(batch, q_heads, kv_heads, tokens, head_dim, seed=seed,
                                     hardness=hardness)
    parts = [doublep_reads(q[b:b + 1], k[b:b + 1], v[b:b + 1], **options) for b in range(batch)]
    return {"shape": dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                          seed=seed, hardness=hardness),
            "summary": _read_summary(parts)}


def format_reads_table(doc):
    """Markdown table of a ``--doublep-reads`` document: per length and source."""
    def pct(s, key):
        e = s[key]
        return (f"{100 * e['median']:.1f}% [{100 * e['q1']:.1f}, {100 * e['q3']:.1f}]")

    lines = ["| context | source | Double-P K rows read, mean +- sd | median [q1, q3] | "
             "95% mass in | 99% mass in | sink mass |", "| --- " * 7 + "|"]
    for n, e in doc["sizes"].items():
        for name, r in e.items():
            s = r["summary"]
            kr = s["k_read_fraction"]
            lines.append(f"| {n} | {name} | {100 * kr['mean']:.1f}% +- {100 * kr['std']:.1f} | "
                         f"{pct(s, 'k_read_fraction')} | {pct(s, 'key_fraction_95')} | "
                         f"{pct(s, 'key_fraction_99')} | {pct(s, 'sink_mass')} |")
    return "\n".join(lines)


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


def doublep_reads_study(traces, sizes, *, batch=8, batch_long=4, bench_shape=False,
                        mass_sizes=(), mass_batch=2, decode_sizes=(), seed=0, path=None):
    """Real (where ``traces`` has the length) vs calibrated vs spread, per size; JSON.

    The generators run in SmolLM2's shape (Hq 9, Hkv 3, D 64), ``batch`` sequences up to
    8192 tokens and ``batch_long`` beyond; with ``bench_shape``, also one sequence in the
    benchmarks' shape (Hq 32, Hkv 8, D 128) at the sizes beyond 8192. ``mass_sizes``: the
    mass statistics only (no Double-P), ``mass_batch`` sequences in the benchmarks' shape,
    under ``"mass_only"``. ``decode_sizes``: real and both generators again with the
    decode-faithful index (:func:`doublep_reads` ``index="decode"``), under
    ``"decode_index"``.
    """
    import time

    date = str(datetime.date.today())
    path = path or os.path.join(RESULTS, f"generator_doublep_reads_{date}.json")
    real = real_doublep_reads(traces, sizes) if traces else {}
    doc = {"what": "Double-P (p1, p2) = (0.95, 0.7), centroid, index = build_doublep_index on "
                   "the whole cache, N // 32 clusters, 10 iterations, 4 sinks, window 64: "
                   "k_read_fraction = K rows read per KV head (union over its GQA group of "
                   "sinks + window + exact clusters' tokens) / N; tokens_exact_fraction and "
                   "true_mass per query head; key_fraction_95/99, sink_mass, window_mass of "
                   "the exact softmax per query head. Summaries over (instance, layer, head) "
                   "for real, over (sequence, head) for the generators",
           "made_by": "python -m stochattn.eval.compare_stats --doublep-reads",
           "date": date, "seconds": {}, "sizes": {}}
    for n in sizes:
        entry = {}
        if n in real:
            entry[f"real {real[n]['play']}"] = real[n]
        runs = [(h, h, dict(batch=batch if n <= 8192 else batch_long))
                for h in ("calibrated", "spread")]
        if bench_shape and n > 8192:
            runs += [(f"{h} (Hq 32, Hkv 8, D 128)", h,
                      dict(batch=1, q_heads=32, kv_heads=8, head_dim=128))
                     for h in ("calibrated", "spread")]
        for name, hardness, shape in runs:
            t0 = time.time()
            entry[name] = generated_doublep_reads(n, hardness=hardness, seed=seed, **shape)
            doc["seconds"][f"{n} {name}"] = round(time.time() - t0, 1)
            print(f"{n} {name}: {doc['seconds'][f'{n} {name}']} s", flush=True)
        doc["sizes"][str(n)] = entry
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
    for n in decode_sizes:
        entry = {}
        if traces:
            r = real_doublep_reads(traces, [n], index="decode")
            if n in r:
                entry[f"real {r[n]['play']}"] = r[n]
        for h in ("calibrated", "spread"):
            entry[h] = generated_doublep_reads(n, hardness=h, batch=batch, seed=seed,
                                               index="decode")
        doc.setdefault("decode_index", {})[str(n)] = entry
        print(f"{n} decode-index reads done", flush=True)
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
    for n in mass_sizes:
        doc.setdefault("mass_only", {})[str(n)] = {
            h: dict(_summary(generated_stats(n, batch=mass_batch, seed=seed, hardness=h), n),
                    shape=dict(batch=mass_batch, q_heads=32, kv_heads=8, head_dim=128, seed=seed))
            for h in ("calibrated", "spread")}
        print(f"{n} mass statistics done", flush=True)
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m stochattn.eval.compare_stats",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--measure", nargs="+", metavar="PLAY:TOKENS")
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--doublep-reads", metavar="TRACES.npz",
                    help="Double-P (0.95, 0.7) reads: real instances of TRACES.npz vs the "
                         "generators ('' for the generators only)")
    ap.add_argument("--read-sizes", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--read-batch", type=int, default=8,
                    help="generated sequences per size (SmolLM2's shape: Hq 9, Hkv 3, D 64)")
    ap.add_argument("--read-batch-long", type=int, default=4,
                    help="generated sequences per size beyond 8192 tokens")
    ap.add_argument("--bench-shape", action="store_true",
                    help="also one sequence in the benchmarks' shape (Hq 32, Hkv 8, D 128) "
                         "beyond 8192 tokens")
    ap.add_argument("--mass-sizes", type=int, nargs="*", default=[],
                    help="sizes for the generators' mass statistics only (benchmarks' shape)")
    ap.add_argument("--mass-batch", type=int, default=2)
    ap.add_argument("--decode-index-sizes", type=int, nargs="*", default=[],
                    help="sizes to measure again with the accuracy harness's decode-faithful "
                         "index")
    ap.add_argument("--reads-out", default=None)
    args = ap.parse_args(argv)
    if args.doublep_reads is not None:
        doc = doublep_reads_study(args.doublep_reads or None, args.read_sizes,
                                  batch=args.read_batch, batch_long=args.read_batch_long,
                                  bench_shape=args.bench_shape, mass_sizes=args.mass_sizes,
                                  mass_batch=args.mass_batch,
                                  decode_sizes=args.decode_index_sizes, path=args.reads_out)
        print(format_reads_table(doc))
        return 0
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
