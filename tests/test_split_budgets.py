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

norm="auto" (a pilot sized per head by w_A): in the coverage cases with a cap of AUTO_PILOT =
128 draws, which on this pool gives every way (bound, exact read, sampled pilot); its
pilot's event L <= ||o|| has its own binomial test against delta_pilot over the sampled
rows (TEST_ALPHA = 1e-6 for that test), which rejects the planted bound without its width;
the plan's S0 is the brute-force argmin of its predicted total, and the predicted total
is non-decreasing in w_A (exact); the mean draws fall as w_A falls.
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
AUTO_PILOT = 128  # norm="auto"'s cap in the coverage cases (module docstring)


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
        pilot = pilot or {"pilot": bd.pilot_size(eps, delta, rule, 2000), "student": 512,
                          "auto": AUTO_PILOT}.get(norm, 1)
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


@pytest.mark.parametrize("norm", bd.NORMS + ("auto",))
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
    # the pilot's draws per head: the plan's pilot on every drawing head (auto: per head,
    # within the cap), none where nothing is drawn
    P = d["budget_pilot"]
    assert P.shape == (2, 4) and P.dtype == np.int64 and np.all(P[S == 0] == 0)
    if norm == "auto":
        assert np.all((P >= 0) & (P <= 64))
    else:
        assert np.all(P[S > 0] == (0 if norm == "oracle" else 64))
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
    F, n, sum_s, _, capped, _, *ways = layer_failures(
        inst, rule="clt", norm="oracle", eps=0.2, delta=0.1, sampler="systematic", seed=0,
        max_budget=10**6, rng=np.random.default_rng(0))
    assert n == int(inst["live"].sum()) and sum_s >= n and capped == 0 and F <= n
    assert ways == [0, 0, 0]
    F, n, sum_s, sum_pilot, capped, _, *ways = layer_failures(
        inst, rule="clt", norm="auto", eps=0.2, delta=0.1, sampler="systematic", seed=0,
        max_budget=10**6, rng=np.random.default_rng(0), auto_pilot=256)
    assert sum(ways) == n and 0 <= sum_pilot <= 256 * n and F <= n


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
    assert np.array_equal(diag.budget_pilot, d["budget_pilot"])
    assert np.all(diag.budget_pilot[diag.budget > 0] == 64)
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
    (dict(approx="sample", eps=0.1, delta=0.1, max_budget=10, budget_norm="student",
          device="cuda"), NotImplementedError, "student"),
    (dict(approx="sample", eps=0.1, delta=0.1, max_budget=10, budget_norm="auto", pilot=0),
     ValueError, "pilot"),
    (dict(approx="sample", eps=0.1, delta=0.1, max_budget=10, budget_norm="automatic"),
     ValueError, "norm"),
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


# norm="auto": a pilot sized per head by w_A (split_budgets.auto_pilot_plan).

def _plan(split, rule, eps, delta, pilot=AUTO_PILOT, w_approx=None, w_exact=None):
    from stochattn.reference.split_budgets import auto_pilot_plan
    wA = split.wA if w_approx is None else w_approx
    we = split.w_exact if w_exact is None else w_exact
    m2 = np.einsum("hn,hn->h", split.pa, split.sq)
    G = np.sqrt((((we[:, None]) * split.o_exact) ** 2).sum(-1))
    return auto_pilot_plan(wA, m2, G, (split.wa > 0).sum(-1), eps=eps, delta=delta, rule=rule,
                           pilot=pilot, pilot_share=0.25), m2, G


def _auto_event(split, rule, eps, delta, reps):
    """Sampled rows and those among them whose L exceeds ||o|| (the pilot's event failed)."""
    n = F = 0
    for r in range(reps):
        ch = split.choose(rule, "auto", eps, delta, r)
        sampled = ch.delta_pilot > 0
        n += int(sampled.sum())
        F += int((sampled & (ch.norm_sq_lower > split.on2 * (1 + 1e-12))).sum())
    return F, n, ch


@pytest.mark.parametrize("rule, delta", [("chebyshev", 0.1), ("clt", 0.01)])
def test_auto_pilot_bound_holds_and_a_dropped_width_is_caught(split, rule, delta, monkeypatch):
    """The pilot's event: over the rows that draw a pilot, P(L > ||o||) <= delta_pilot (one-
    sided exact binomial test at TEST_ALPHA / 2 per case); rows without a pilot have
    L <= ||o|| always (exact). The planted bound without its width (k = 0: L the norm of the
    pilot's point estimate) fails the same statistic."""
    import stochattn.reference.split_budgets as sbm
    test_alpha, eps = 1e-6, 0.1
    F, n, ch = _auto_event(split, rule, eps, delta, 16)
    dp = 0.25 * delta
    assert n > 1000 and binom_sf(F, n, dp) >= test_alpha / 2, f"{F}/{n} at delta_pilot {dp}"
    quiet = ch.delta_pilot == 0
    assert (ch.norm_sq_lower[quiet] <= split.on2[quiet] * (1 + 1e-12)).all()
    monkeypatch.setattr(sbm, "_pilot_factor", lambda delta_pilot, S0: 0.0 * S0)
    Fb, nb, _ = _auto_event(split, rule, eps, delta, 16)
    assert binom_sf(Fb, nb, dp) < test_alpha / 2, f"planted dropped width passed: {Fb}/{nb}"


@pytest.mark.parametrize("rule, eps, delta", [("clt", 0.1, 0.1), ("chebyshev", 0.05, 0.01)])
def test_auto_plan_is_the_least_predicted_total(split, rule, eps, delta):
    """Exact: the sampled S0 is the argmin over every S0 in [1, pilot] of the predicted
    total S0 + a / (1 - b / sqrt(S0))^2, computed here from its definition; the way chosen
    is the least of bound, exact read and sampled pilot; each way's rows get that way's
    budgets (bound rows the "bound" norm's, exact-read rows the oracle's, bit for bit)."""
    from stochattn.reference.split_budgets import AUTO_BOUND, AUTO_EXACT, AUTO_SAMPLED
    (kind, size, pred), m2, G = _plan(split, rule, eps, delta)
    dp = 0.25 * delta
    cp, cm, c0 = 1 / dp, bd.tail_factor(rule, delta - dp), bd.tail_factor(rule, delta)
    S0 = np.arange(1, AUTO_PILOT + 1)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        a = (cm * split.wA**2 * m2 / (eps**2 * G**2))[:, None]
        b = (split.wA * np.sqrt(cp * m2) / G)[:, None]
        r = b / np.sqrt(S0)
        T = np.where(r < 1, S0 + a / (1 - r) ** 2, np.inf)
        t_bound = c0 * split.wA**2 * m2 / (eps**2 * (G - split.wA * np.sqrt(m2)) ** 2)
    t_bound = np.where(G > split.wA * np.sqrt(m2), t_bound, np.inf)
    n_a = (split.wa > 0).sum(-1)
    t_exact = np.where(n_a <= AUTO_PILOT, n_a + (c0 / cm) * a[:, 0], np.inf)
    best = np.min(np.stack([t_bound, t_exact, T.min(1)]), axis=0)
    finite = np.isfinite(best)
    assert finite.sum() > 50 and (kind[finite] != AUTO_BOUND).any()
    np.testing.assert_allclose(pred[finite], best[finite], rtol=1e-12)
    samp = kind == AUTO_SAMPLED
    assert samp.any()
    np.testing.assert_allclose(T[samp, size[samp] - 1], T[samp].min(1), rtol=1e-12)
    assert (size[kind == AUTO_BOUND] == 0).all()
    assert (size[kind == AUTO_EXACT] == n_a[kind == AUTO_EXACT]).all()
    assert (size <= AUTO_PILOT).all()
    # no exact part: no prediction; the cap (or the exact read where A fits in it)
    none = split.w_exact == 0
    assert (kind[none] == np.where(n_a[none] <= AUTO_PILOT, AUTO_EXACT, AUTO_SAMPLED)).all()
    ch = split.choose(rule, "auto", eps, delta, 0)
    for way, norm in ((AUTO_BOUND, "bound"), (AUTO_EXACT, "oracle")):
        ref = split.choose(rule, norm, eps, delta, 0)
        m = kind == way
        assert m.any() and np.array_equal(ch.budget[m], ref.budget[m])
        assert np.array_equal(ch.norm_sq_lower[m], ref.norm_sq_lower[m])
    assert np.array_equal(ch.pilot, size) and np.array_equal(ch.cost, ch.budget + size)
    assert (ch.delta_pilot[samp] == 0.25 * delta).all() and (ch.delta_pilot[~samp] == 0).all()


def test_auto_draws_fall_with_the_sampled_mass(split):
    """The same heads (o_E, p_A, values fixed) with the sampled part's weight w_A scaled
    down from 0.5 to 0.002, under a cap of 4096 draws: the predicted total is non-decreasing
    in w_A on every head (exact) and a sampled pilot's S0 shrinks with it; the mean draws
    (pilot + main) fall, strictly down to w_A 0.01 on the heads whose exact part is not
    tiny (||o_E|| >= sqrt(m2_A) / 10; with o_E = 0, ||o|| is w_A ||o_A||, so the relative
    target costs the same whatever w_A), and
    stay below the studentised pilot's (512 + main); at w_A 0.002 those heads draw no
    pilot at all."""
    from stochattn.reference.split_budgets import AUTO_BOUND, AUTO_SAMPLED
    has = split.w_exact > 0
    rule, eps, delta, cap = "clt", 0.1, 0.1, 4096
    grid = (0.5, 0.2, 0.05, 0.01, 0.002)
    preds, sizes, kinds, costs, clear_costs = [], [], [], [], []
    for w in grid:
        wA = np.where(has, w, 1.0)
        (kind, size, pred), m2, G = _plan(split, rule, eps, delta, pilot=cap, w_approx=wA,
                                          w_exact=1 - wA)
        clear = has & (G >= 0.1 * np.sqrt(m2) * (1 - w))
        preds.append(pred), sizes.append(size), kinds.append(kind)
        ch, st = (choose_split_budgets(wA[:, None] * split.pa, split.V, split.sq, 1 - wA,
                                       split.o_exact, eps=eps, delta=delta,
                                       max_budget=MAX_BUDGET, rule=rule, norm=norm,
                                       pilot=pilot, seed=0, rows=np.arange(split.H),
                                       heads=split.H)
                  for norm, pilot in (("auto", cap), ("student", 512)))
        assert np.array_equal(ch.pilot, size) and not ch.capped[has].any()
        costs.append(ch.cost[has].mean())
        clear_costs.append(ch.cost[clear].mean())
        assert costs[-1] < st.cost[has].mean()
    for hi, lo in zip(range(len(grid) - 1), range(1, len(grid))):
        assert (preds[lo][has] <= preds[hi][has]).all()
        both = (kinds[hi] == AUTO_SAMPLED) & (kinds[lo] == AUTO_SAMPLED)
        assert (sizes[lo][both] <= sizes[hi][both]).all()
    assert all(c1 <= c0 for c0, c1 in zip(costs, costs[1:])), costs
    assert all(c1 < c0 for c0, c1 in zip(clear_costs[:-1], clear_costs[1:-1])), clear_costs
    assert clear.mean() > 0.5, clear.mean()
    assert (kinds[-1][clear] == AUTO_BOUND).all() and (kinds[0][has] != AUTO_BOUND).any()


def test_auto_options_are_checked(split):
    with pytest.raises(ValueError, match="pilot"):
        split.choose("clt", "auto", 0.1, 0.1, 0, pilot=-3)
    with pytest.raises(ValueError, match="norm"):
        split.choose("clt", "Auto", 0.1, 0.1, 0)
    with pytest.raises(TypeError, match="pilot"):
        split.choose("clt", "auto", 0.1, 0.1, 0, pilot=1.5)
    with pytest.raises(ValueError, match="delta"):
        split.choose("clt", "auto", 0.1, 0.3, 0)
    from stochattn import DoublePPlan, SantaPlan
    with pytest.raises(ValueError, match="budget_norm.*'auto'"):
        DoublePPlan(approx="sample", eps=0.1, delta=0.1, max_budget=10, budget_norm="oracle")
    assert DoublePPlan(approx="sample", eps=0.1, delta=0.1, max_budget=10,
                       budget_norm="auto").options()["budget_norm"] == "auto"
    with pytest.raises(ValueError, match="norm"):  # S²ANTA has no exact part
        SantaPlan(eps=0.1, delta=0.1, max_budget=10, budget_norm="auto")
