"""Error-targeted budgets with an exact part (stochattn.reference.split_budgets; Double-P's
sampled variant): o = w_E o_E + w_A o_A with o_A the mean of S draws from p_A.

The claims and their tests follow tests/test_budgets.py (same pool of 320 generated heads,
same binomial statistic): coverage over REPS x 320 = 10240 (call, head) pairs per case,
one-sided exact binomial test at ALPHA / len(CASES) (ALPHA = 1e-6: the false-failure rate
of the whole parametrised coverage test); the oracle budget equals the independently
computed requirement (exact up to the ceil); a halved variance fails the same statistic;
with no exact part the budgets are S²ANTA's (choose_budgets) row for row. Each head of the
pool is split three ways (kind = h mod 3): no exact part; the exact part the top tokens up
to 70% of the mass (Double-P's C_exact: w_A small); a random 30% of the tokens (w_A large).
"""

from __future__ import annotations

import numpy as np
import pytest

from stochattn.eval.budget_study import binom_sf
from stochattn.reference import budgets as bd
from stochattn.reference.split_budgets import choose_split_budgets
from test_budgets import ALPHA, DELTAS, EPS, MAX_BUDGET, REPS, Pool, draw_counts

from stochattn.budget_rules import SPLIT_NORMS  # noqa: E402

CASES = ([("iid", rule, norm, e, d) for rule in bd.RULES for norm in SPLIT_NORMS
          for e in EPS for d in DELTAS]
         + [("stratified", "clt", "oracle", e, d) for e in EPS for d in DELTAS])
CASE_ALPHA = ALPHA / len(CASES)


class Split:
    """The pool's heads with an exact part E and a sampled part A (module docstring)."""

    def __init__(self, pool, seed=0):
        rng = np.random.default_rng(seed)
        H, N = pool.P.shape
        exact = np.zeros((H, N), dtype=bool)
        for h in range(H):
            if h % 3 == 1:
                order = np.argsort(-pool.P[h], kind="stable")
                n = int(np.searchsorted(np.cumsum(pool.P[h, order]), 0.7)) + 1
                exact[h, order[:min(n, N - 8)]] = True
            elif h % 3 == 2:
                exact[h, rng.permutation(N)[:int(0.3 * N)]] = True
        self.P, self.V, self.o, self.on2 = pool.P, pool.V, pool.o, pool.on2
        self.H = H
        self.wa = np.where(exact, 0.0, pool.P)             # unnormalised weights of A
        za = self.wa.sum(-1)
        self.w_exact = 1.0 - za
        pe = np.where(exact, pool.P, 0.0)
        self.o_exact = np.einsum("hn,hnd->hd", pe, pool.V) / np.maximum(pe.sum(-1), 1e-300)[:, None]
        self.pa = self.wa / za[:, None]
        self.o_a = np.einsum("hn,hnd->hd", self.pa, pool.V)
        # centred variance of one draw from p_A, independent of split_budgets' m2 - |o_A|^2
        self.var_a = np.einsum("hn,hn->h", self.pa, ((pool.V - self.o_a[:, None]) ** 2).sum(-1))
        self.sq = np.einsum("hnd,hnd->hn", pool.V, pool.V)
        self.wA = za

    def choose(self, rule, norm, eps, delta, seed, pilot=None, **kw):
        pilot = pilot or {"pilot": bd.pilot_size(eps, delta, rule, 2000), "student": 512}.get(norm, 1)
        return choose_split_budgets(self.wa, self.V, self.sq, self.w_exact, self.o_exact, eps=eps,
                                    delta=delta, max_budget=MAX_BUDGET, rule=rule, norm=norm,
                                    pilot=pilot, seed=seed, rows=np.arange(self.H), heads=self.H,
                                    **kw)


@pytest.fixture(scope="module")
def split():
    return Split(Pool())


def coverage(split, budgets, sampler, eps, reps=REPS):
    rng = np.random.default_rng(0)
    F = 0
    for r in range(reps):
        S = budgets(r)
        counts = draw_counts(rng, split.pa, S, sampler, seed=r).astype(np.float64)
        mean = np.einsum("hn,hnd->hd", counts, split.V) / S[:, None]
        o_hat = split.w_exact[:, None] * split.o_exact + split.wA[:, None] * mean
        F += int((((o_hat - split.o) ** 2).sum(-1) > eps * eps * split.on2).sum())
    return F, reps * split.H


def requirement(split, rule, eps, delta, factor=1.0):
    c = bd.tail_factor(rule, delta)
    return np.maximum(np.ceil(c * split.wA**2 * factor * split.var_a / (eps**2 * split.on2)), 1)


@pytest.mark.parametrize("sampler, rule, norm, eps, delta", CASES)
def test_coverage(split, sampler, rule, norm, eps, delta):
    F, n = coverage(split, lambda r: split.choose(rule, norm, eps, delta, r).budget, sampler, eps)
    p = binom_sf(F, n, delta)
    assert p >= CASE_ALPHA, f"{sampler}/{rule}/{norm} eps={eps} delta={delta}: {F}/{n}, P = {p:.1e}"


@pytest.mark.parametrize("eps, delta", [(e, d) for e in EPS for d in DELTAS])
def test_halved_variance_fails_coverage(split, eps, delta):
    """The same statistic rejects the CLT budgets from half the variance (iid): planted."""
    S = requirement(split, "clt", eps, delta, factor=0.5).astype(np.int64)
    F, n = coverage(split, lambda r: S, "iid", eps)
    assert binom_sf(F, n, delta) < CASE_ALPHA, f"planted bug not detected: {F}/{n}"


@pytest.mark.parametrize("rule", bd.RULES)
@pytest.mark.parametrize("eps, delta", [(0.1, 0.1), (0.05, 0.01)])
def test_oracle_budget_is_the_requirement(split, rule, eps, delta):
    """Exact up to the ceil: S = ceil(c w_A^2 var_A / (eps^2 |o|^2)); dropping w_A^2 (or
    squaring it once only) is caught on the heads with an exact part."""
    ch = split.choose(rule, "oracle", eps, delta, 0)
    need = requirement(split, rule, eps, delta)
    assert (np.abs(ch.budget - need) <= 1 + 1e-6 * need).all() and not ch.capped.any()
    for wrong in (split.wA, 1.0 / split.wA):  # w_A once, or not at all
        bad = requirement(split, rule, eps, delta, factor=wrong)
        assert not (np.abs(ch.budget - bad) <= 1 + 1e-6 * bad).all()


@pytest.mark.parametrize("norm", bd.NORMS)
def test_no_exact_part_is_santas_rule(split, norm):
    """w_E = 0: the budgets of choose_budgets on the same weights, row for row (the pilot's
    L agrees where its good event can hold, which is every row here)."""
    pool = Pool()
    eps, delta, rule = 0.1, 0.1, "clt"
    pilot = {"pilot": 400, "student": 256}.get(norm, 1)
    a = bd.choose_budgets(pool.x, pool.sq, pool.v, eps=eps, delta=delta, max_budget=MAX_BUDGET,
                          rule=rule, norm=norm, pilot=pilot, seed=3)
    b = choose_split_budgets(pool.P, pool.V, pool.sq[0], np.zeros(pool.H), np.zeros_like(pool.o),
                             eps=eps, delta=delta, max_budget=MAX_BUDGET, rule=rule, norm=norm,
                             pilot=pilot, seed=3, rows=np.arange(pool.H), heads=pool.H)
    np.testing.assert_allclose(b.norm_sq_lower, a.norm_sq_lower[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(b.second_moment, a.second_moment[0], rtol=1e-12)
    assert (np.abs(b.budget - a.budget[0]) <= 1).all()
    assert np.mean(b.budget == a.budget[0]) > 0.99


def test_empty_sampled_part_draws_nothing_and_errors_are_named():
    wa = np.zeros((2, 5))
    wa[1, 2] = 1.0
    v = np.ones((2, 5, 3))
    ch = choose_split_budgets(wa, v, (v * v).sum(-1), np.array([1.0, 0.5]), np.ones((2, 3)),
                              eps=0.1, delta=0.1, max_budget=100, norm="oracle",
                              rows=np.arange(2), heads=2)
    assert ch.budget.tolist() == [0, 1] and not ch.capped.any()  # one token: one draw
    assert ch.error_bound.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="eps"):
        choose_split_budgets(wa, v, (v * v).sum(-1), np.zeros(2), np.zeros((2, 3)), eps=0.0,
                             delta=0.1, max_budget=10, rows=np.arange(2), heads=2)


def _doublep_instance(seed=0):
    from stochattn.doublep import build_doublep_index
    from stochattn.eval.calibrated import make_calibrated_inputs
    q, k, v = make_calibrated_inputs(2, 4, 2, 300, 16, seed=seed)
    lens = np.array([300, 260])
    index = build_doublep_index(k, v, lens, n_clusters=12, window=32)
    return q, k, v, lens, index


@pytest.mark.parametrize("norm", bd.NORMS)
def test_doublep_heads_draw_what_a_fixed_budget_call_draws(norm):
    """Each head's draws and output are those of the fixed-budget call with its S, bit for
    bit (the points of a row depend on that row's S only)."""
    from stochattn.reference.doublep import doublep_attention
    q, k, v, lens, index = _doublep_instance()
    opts = dict(p1=0.95, p2=0.5, approx="sample", sampler="systematic", seed=5, offset=2,
                scale=0.25)
    out, d = doublep_attention(q, k, v, lens, index, budget=None, eps=0.2, delta=0.1,
                               max_budget=4000, budget_norm=norm, pilot=64, **opts)
    S = d["budget"]
    assert S.shape == (2, 4) and (S > 0).any() and (S <= 4000).all()
    assert np.isfinite(d["error_bound"]).all() or d["budget_capped"].any()
    for s in np.unique(S[S > 0]):
        ref, rd = doublep_attention(q, k, v, lens, index, budget=int(s), **opts)
        for b, h in zip(*np.nonzero(S == s)):
            assert np.array_equal(out[b, h], ref[b, h])
            assert np.array_equal(d["sample_indices"][b, h, :s], rd["sample_indices"][b, h])
            assert (d["sample_indices"][b, h, s:] == -1).all()


def test_doublep_budget_options_are_checked():
    from stochattn.reference.doublep import doublep_attention
    q, k, v, lens, index = _doublep_instance(1)
    base = dict(p1=0.95, p2=0.5, sampler="systematic", seed=0, offset=0, scale=0.25)
    with pytest.raises(ValueError, match="eps"):
        doublep_attention(q, k, v, lens, index, approx="centroid", budget=None, eps=0.1,
                          delta=0.1, max_budget=10, **base)
    with pytest.raises(ValueError, match="eps"):
        doublep_attention(q, k, v, lens, index, approx="sample", budget=8, eps=0.1,
                          delta=0.1, max_budget=10, **base)
    with pytest.raises(ValueError, match="delta"):
        doublep_attention(q, k, v, lens, index, approx="sample", budget=None, eps=0.1,
                          max_budget=10, **base)
    with pytest.raises(ValueError, match="delta"):
        doublep_attention(q, k, v, lens, index, approx="sample", budget=None, eps=0.1,
                          delta=1.5, max_budget=10, **base)


def _shared_cache_call(seed=0, P=3, Hkv=2, G=2, N=400, D=16):
    rng = np.random.default_rng(seed)
    k0 = rng.standard_normal((Hkv, N, D))
    v0 = rng.standard_normal((Hkv, N, D)) + 0.5
    q = 1.5 * rng.standard_normal((P, Hkv * G, D))
    k = np.broadcast_to(k0[None], (P, Hkv, N, D))
    v = np.broadcast_to(v0[None], (P, Hkv, N, D))
    return q, k, v, np.array([300, 350, 400])


def test_study_split_is_doublep_target():
    """The study's target over the selected tokens: with p2 = p1 (no C_approx) it is the
    reference Double-P output; with p2 < p1 it is w_E o_E + w_A o_A."""
    from stochattn.doublep import build_doublep_index
    from stochattn.eval.split_budget_study import layer_failures, split_instances
    from stochattn.reference.doublep import doublep_attention
    q, k, v, lens = _shared_cache_call()
    inst = split_instances(q, k, v, lens, p1=0.9, p2=0.9, cluster_ratio=16)
    assert not inst["live"].any()
    index = build_doublep_index(k, v, lens, n_clusters=max(4, int(lens.min()) // 16))
    ref, _ = doublep_attention(q, k, v, lens, index, p1=0.9, p2=0.9, approx="centroid",
                               budget=None, sampler="systematic", seed=0, offset=0, scale=0.25)
    np.testing.assert_allclose(inst["o"], ref.reshape(inst["o"].shape), rtol=1e-10, atol=1e-12)
    inst = split_instances(q, k, v, lens, p1=0.95, p2=0.5, cluster_ratio=16)
    assert inst["live"].any()
    pa = inst["wa"] / np.maximum(inst["wa"].sum(-1, keepdims=True), 1e-300)
    o_a = np.einsum("rn,rnd->rd", pa, inst["V"])
    we = inst["w_exact"][:, None]
    np.testing.assert_allclose(we * inst["o_exact"] + (1 - we) * o_a, inst["o"], rtol=1e-10,
                               atol=1e-12)
    F, n, sum_s, _, capped, _ = layer_failures(inst, rule="clt", norm="oracle", eps=0.2,
                                               delta=0.1, sampler="systematic", seed=0,
                                               max_budget=10**6, rng=np.random.default_rng(0))
    assert n == int(inst["live"].sum()) and sum_s >= n and capped == 0 and F <= n


def test_public_doublep_with_eps_is_the_reference():
    from stochattn import DoublePPlan
    from stochattn.doublep import doublep_attention as public
    from stochattn.reference.doublep import doublep_attention
    q, k, v, lens, index = _doublep_instance(2)
    opts = dict(p1=0.95, p2=0.5, sampler="systematic", seed=3, offset=1)
    out, diag = public(q, k, v, lens, index=index, approx="sample", eps=0.2, delta=0.1,
                       max_budget=500, budget_norm="student", pilot=64, return_diagnostics=True,
                       **opts)
    ref, d = doublep_attention(q, k, v, lens, index, approx="sample", budget=None, eps=0.2,
                               delta=0.1, max_budget=500, budget_norm="student", pilot=64,
                               scale=0.25, **opts)
    assert np.array_equal(out, ref.astype(q.dtype))
    assert np.array_equal(diag.budget, d["budget"]) and (diag.budget > 0).any()
    assert np.array_equal(diag.budget_capped, d["budget_capped"])
    assert np.array_equal(diag.error_bound, d["error_bound"])
    plan = DoublePPlan(approx="sample", eps=0.2, delta=0.1, max_budget=500, p1=0.95, p2=0.5)
    sq = bd.value_sqnorms(v)
    a = plan.run(q, k, v, lens, index=index, seed=3, offset=1, v_sqnorms=sq)
    b = plan.run(q, k, v, lens, index=index, seed=3, offset=1)
    assert np.array_equal(a, b)
    assert plan.options()["eps"] == 0.2 and plan.options()["max_budget"] == 500


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(approx="centroid", eps=0.1, delta=0.1, max_budget=10), ValueError, "approx"),
    (dict(approx="sample", budget=8, eps=0.1, delta=0.1, max_budget=10), ValueError, "either"),
    (dict(approx="sample", eps=0.1, max_budget=10), ValueError, "delta"),
    (dict(approx="sample", eps=0.1, delta=0.1, max_budget=10, budget_norm="oracle"),
     ValueError, "budget_norm"),
    (dict(approx="sample", eps=-1.0, delta=0.1, max_budget=10), ValueError, "eps"),
    (dict(approx="sample", eps=0.1, delta=0.1, max_budget=10, device="cuda"),
     NotImplementedError, "eps"),
])
def test_doublep_plan_budget_errors_name_the_argument(kwargs, exc, match):
    from stochattn import DoublePPlan
    with pytest.raises(exc, match=match):
        DoublePPlan(**kwargs)


def test_v_sqnorms_without_eps_is_refused():
    from stochattn.doublep import doublep_attention as public
    q, k, v, lens, index = _doublep_instance(3)
    with pytest.raises(TypeError, match="v_sqnorms"):
        public(q, k, v, lens, index=index, approx="sample", budget=4, v_sqnorms=bd.value_sqnorms(v))


def test_bound_norm_is_a_lower_bound_and_needs_no_pilot(split):
    """Exact: the pilot-free L is <= ||o|| on every head, L = 0 (capped) without an exact
    part, and no draw is spent on a pilot."""
    ch = split.choose("clt", "bound", 0.1, 0.1, 0)
    assert (ch.norm_sq_lower <= split.on2 * (1 + 1e-12)).all() and ch.pilot == 0
    none = split.w_exact == 0
    assert (ch.norm_sq_lower[none] == 0).all() and ch.capped[none].all()
    assert (ch.cost == ch.budget).all()
    assert (~ch.capped[split.w_exact > 0.9]).any()
