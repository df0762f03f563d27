"""Host-side parts of Double-P's sampled variant with error-targeted budgets on the GPU
(stochattn.cuda.doublep, santa_prop.cu's Double-P section; docs/budgets.md). No GPU needed.

- The device's scalar rules (kernels/split_rules.cuh: pilot_norm_lower, budget_from_variance,
  auto_pilot_choice), built for the host with a C++ compiler, equal the NumPy reference
  (reference/budgets.py pilot_norm_lower and budgets_from_variance, reference/split_budgets.py
  auto_pilot_plan) bit for bit on random and edge-case inputs: the header writes the
  reference's operations in its order, each rounded once.
- The options' checks name the argument; the GPU refuses the norms it lacks with the reason.
- The kernels' constants are the reference's; the scratch pieces follow the documented formula.
"""

from __future__ import annotations

import math
import shutil
import subprocess

import numpy as np
import pytest

from stochattn import budget_rules
from stochattn.cuda import doublep as cdp
from stochattn.cuda import kernels
from stochattn.reference.budgets import budgets_from_variance, pilot_norm_lower
from stochattn.reference.split_budgets import auto_pilot_plan

_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
using std::isfinite;
#define STOCHATTN_HD inline
#include "split_rules.cuh"
using namespace stochattn;
// stdin, one case a line: "p y m2 k" | "b var L2 c eps max_budget" |
// "a wA m2 G nA eps c_main c_full cp pilot" |
// "s norm way wA m2 G size y2 q2 a2 l2 c_main c_full k_pilot inv_dp eps max_budget"
// (doubles in C99 hex, integers in decimal).
int main() {
  char kind;
  while (scanf(" %c", &kind) == 1) {
    if (kind == 'p') {
      double y, m2, k;
      if (scanf("%la %la %la", &y, &m2, &k) != 3) return 1;
      printf("%a\n", pilot_norm_lower(y, m2, k));
    } else if (kind == 'b') {
      double var, L2, c, eps;
      int mb;
      if (scanf("%la %la %la %la %d", &var, &L2, &c, &eps, &mb) != 5) return 1;
      const RowBudget r = budget_from_variance(var, L2, c, eps, mb);
      printf("%d %d %a\n", r.S, r.capped ? 1 : 0, r.bound);
    } else if (kind == 's') {
      int norm, way, mb;
      long long size;
      double wA, m2, G, y2, q2, a2, l2, cm, cf, kp, idp, eps;
      if (scanf("%d %d %la %la %la %lld %la %la %la %la %la %la %la %la %la %d", &norm, &way,
                &wA, &m2, &G, &size, &y2, &q2, &a2, &l2, &cm, &cf, &kp, &idp, &eps, &mb) != 16)
        return 1;
      const SplitBound sb = split_bound(norm, way, wA, m2, G, size, y2, q2, a2, l2, cm, cf, kp,
                                        idp);
      const RowBudget r = budget_from_variance(sb.var, sb.L2, sb.c, eps, mb);
      printf("%a %a %d %d %a\n", sb.var, sb.L2, r.S, r.capped ? 1 : 0, r.bound);
    } else {
      double wA, m2, G, eps, cm, cf, cp;
      long long nA;
      int pilot;
      if (scanf("%la %la %la %lld %la %la %la %la %d", &wA, &m2, &G, &nA, &eps, &cm, &cf, &cp,
                &pilot) != 9) return 1;
      const AutoChoice c = auto_pilot_choice(wA, m2, G, nA, eps, cm, cf, cp, pilot);
      printf("%d %lld\n", c.way, c.size);
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def rules_host(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++, c++ or clang++) for the host build of "
                    "split_rules.cuh")
    d = tmp_path_factory.mktemp("split_rules")
    (d / "harness.cpp").write_text(_HARNESS)
    exe = d / "harness"
    # -ffp-contract=off: no FMA contraction, as the device's _rn intrinsics.
    subprocess.run([cxx, "-O1", "-std=c++17", "-ffp-contract=off", f"-I{kernels.SOURCE_DIR}",
                    "-D__host__=", "-D__device__=", "-D__forceinline__=",
                    str(d / "harness.cpp"), "-o", str(exe)], check=True, capture_output=True)
    return str(exe)


def _run(exe, lines):
    out = subprocess.run([exe], input="".join(lines), capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return [l.split() for l in out if l]


def _h(x) -> str:
    return float(x).hex()


def _values(rng, n):
    """Positive values over many scales, with exact zeros and repeats."""
    x = np.exp(rng.uniform(-12, 6, n))
    x[rng.random(n) < 0.05] = 0.0
    return x


def test_pilot_norm_lower_is_the_reference_bit_for_bit(rules_host):
    rng = np.random.default_rng(1)
    n = 4000
    m2 = _values(rng, n)
    k = np.exp(rng.uniform(-8, 3, n))
    y = np.sqrt(m2 * rng.uniform(0, 1.5 * (1 + k), n)) * rng.uniform(0, 1.2, n)
    got = np.array([float.fromhex(r[0]) for r in _run(
        rules_host, [f"p {_h(a)} {_h(b)} {_h(c)}\n" for a, b, c in zip(y, m2, k)])])
    want = np.array([pilot_norm_lower(np.array(a), np.array(b), float(c))
                     for a, b, c in zip(y, m2, k)])
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


def test_budget_from_variance_is_the_reference_bit_for_bit(rules_host):
    rng = np.random.default_rng(2)
    n = 4000
    var, L2 = _values(rng, n), _values(rng, n)
    c = np.exp(rng.uniform(0, 5, n))
    eps = np.exp(rng.uniform(-4, 1, n))
    mb = rng.integers(1, 2**30, n)
    mb[:50] = 1
    rows = _run(rules_host, [f"b {_h(a)} {_h(b)} {_h(cc)} {_h(e)} {m}\n"
                             for a, b, cc, e, m in zip(var, L2, c, eps, mb)])
    for i, r in enumerate(rows):
        S, cap, bound = budgets_from_variance(np.array([var[i]]), np.array([L2[i]]),
                                              float(c[i]), float(eps[i]), int(mb[i]),
                                              np.array([True]))
        assert (int(r[0]), bool(int(r[1]))) == (int(S[0]), bool(cap[0])), i
        assert float.fromhex(r[2]) == bound[0] or (math.isnan(bound[0])
                                                   and math.isnan(float.fromhex(r[2]))), i


@pytest.mark.parametrize("rule, eps, delta, share, pilot", [
    ("clt", 0.1, 0.1, 0.25, 4096), ("chebyshev", 0.05, 0.01, 0.25, 128),
    ("clt", 0.675, 0.1, 0.5, 64), ("chebyshev", 0.2, 0.1, 0.1, 1)])
def test_auto_pilot_choice_is_the_reference(rules_host, rule, eps, delta, share, pilot):
    """Way and size equal auto_pilot_plan's on every row (host cbrt is the libm cbrt that
    NumPy uses; on the GPU CUDA's cbrt may move S0 by one where s_opt is within an ulp of
    an integer, which the GPU test allows)."""
    rng = np.random.default_rng(3)
    n = 3000
    wA = np.concatenate([np.exp(rng.uniform(-9, 0, n - 6)), [0.0, 1.0, 0.5, 0.5, 1e-300, 0.3]])
    m2 = np.concatenate([_values(rng, n - 6), [1.0, 1.0, 0.0, 2.0, 1.0, 1.0]])
    G = np.concatenate([_values(rng, n - 6) * rng.uniform(0, 2, n - 6),
                        [1.0, 0.0, 1.0, 0.0, 1.0, 0.1]])
    nA = np.concatenate([rng.integers(0, 3 * pilot + 2, n - 6), [5, 5, 0, pilot, pilot + 1, 1]])
    k = cdp.split_constants(cdp.targeted_of(eps, delta, 10**6, rule, "auto", pilot, share))
    lines = [f"a {_h(a)} {_h(b)} {_h(g)} {int(m)} {_h(k['eps'])} {_h(k['c_main'])} "
             f"{_h(k['c_full'])} {_h(k['inv_dp'])} {pilot}\n"
             for a, b, g, m in zip(wA, m2, G, nA)]
    got = np.array([[int(x) for x in r] for r in _run(rules_host, lines)])
    way, size, _ = auto_pilot_plan(wA, m2, G, nA, eps=eps, delta=delta, rule=rule, pilot=pilot,
                                   pilot_share=share)
    np.testing.assert_array_equal(got[:, 0], way)
    np.testing.assert_array_equal(got[:, 1], size)
    assert len(set(way.tolist())) >= 2  # the cases reach more than one way


def _split_instance(rng, R=400, N=64, D=16):
    """Rows of a split head: weights of A (some zero), values, norms, w_E and o_E."""
    wa = np.exp(rng.normal(0, rng.uniform(0.1, 3, (R, 1)), (R, N)))
    wa[rng.random((R, N)) < 0.3] = 0.0
    wa[10:120, 6:] = 0.0  # short C_approx: the exact read fits small pilots
    wa[:, 0] = np.maximum(wa[:, 0], 1e-3)
    va = rng.normal(rng.normal(0, 1, (R, 1, D)), 1, (R, N, D))
    sq = np.einsum("rnd,rnd->rn", va, va)
    w_exact = np.clip(rng.beta(2, 1, R), 0, 1)
    w_exact[:10] = 0.0
    o_exact = rng.normal(0, 1.5, (R, D))
    return wa, va, sq, w_exact, o_exact


@pytest.mark.parametrize("norm", cdp.SPLIT_NORMS_GPU)
@pytest.mark.parametrize("rule, eps, delta, pilot", [("clt", 0.1, 0.1, 48),
                                                      ("chebyshev", 0.3, 0.05, 8)])
def test_split_bound_gives_the_references_budgets(rules_host, norm, rule, eps, delta, pilot):
    """split_bound then budget_from_variance, fed the squared norms NumPy forms as the
    reference does (the device forms them in its own order), give choose_split_budgets'
    L^2 and S, capped and bound, bit for bit, for every way of every GPU norm."""
    from stochattn.reference.budgets import philox_uniform, sampler_counts
    from stochattn.reference.split_budgets import AUTO_SAMPLED, choose_split_budgets
    from stochattn.spec import PURPOSE_BUDGET_PILOT

    rng = np.random.default_rng(7)
    wa, va, sq, we, oe = _split_instance(rng)
    R = wa.shape[0]
    rows, mb, seed, offset = np.arange(R), 10**5, 3, 1
    ch = choose_split_budgets(wa, va, sq, we, oe, eps=eps, delta=delta, max_budget=mb, rule=rule,
                              norm=norm, pilot=pilot, pilot_share=0.25, seed=seed,
                              offset=offset, rows=rows, heads=R)
    k = cdp.split_constants(cdp.targeted_of(eps, delta, mb, rule, norm, pilot, 0.25))
    # What the device holds for each row (the reference's operations).
    pa = wa / wa.sum(-1, keepdims=True)
    m2 = np.einsum("rn,rn->r", pa, sq)
    wA = 1.0 - we
    e = we[:, None] * np.where((we > 0)[:, None], oe, 0.0)
    G = np.sqrt(np.einsum("rd,rd->r", e, e))
    nA = np.count_nonzero(wa > 0, axis=-1)
    if norm == "auto":
        way, size, _ = auto_pilot_plan(wA, m2, G, nA, eps=eps, delta=delta, rule=rule,
                                       pilot=pilot, pilot_share=0.25)
    else:
        way = np.full(R, 2 if norm == "pilot" else 0)
        size = np.full(R, pilot if norm == "pilot" else 0)
    S0 = np.where(way == AUTO_SAMPLED, size, 0)
    counts = sampler_counts(wa, "stratified", np.maximum(S0, 1), philox_uniform(
        seed, offset, PURPOSE_BUDGET_PILOT, rows, R, stream=0)).astype(np.float64)
    o_p = np.einsum("rn,rnd->rd", counts, va) / np.maximum(S0, 1)[:, None]
    o_a = np.einsum("rn,rnd->rd", pa, va)
    n2 = lambda x: np.einsum("rd,rd->r", x, x)  # noqa: E731
    y2, q2 = n2(o_p), n2(e + wA[:, None] * o_p)
    a2, l2 = n2(o_a), n2(e + wA[:, None] * o_a)
    lines = [" ".join(["s", str(k["norm"]), str(int(way[r]))]
                      + [_h(x[r]) for x in (wA, m2, G)] + [str(int(size[r]))]
                      + [_h(x[r]) for x in (y2, q2, a2, l2)]
                      + [_h(k[n]) for n in ("c_main", "c_full", "k_pilot", "inv_dp", "eps")]
                      + [str(mb)]) + "\n" for r in range(R)]
    got = _run(rules_host, lines)
    L2 = np.array([float.fromhex(g[1]) for g in got])
    np.testing.assert_array_equal(L2.view(np.uint64), ch.norm_sq_lower.view(np.uint64))
    np.testing.assert_array_equal([int(g[2]) for g in got], ch.budget)
    np.testing.assert_array_equal([bool(int(g[3])) for g in got], ch.capped)
    bound = np.array([float.fromhex(g[4]) for g in got])
    np.testing.assert_array_equal(bound.view(np.uint64), ch.error_bound.view(np.uint64))
    if norm == "auto":
        assert len(set(way.tolist())) == 3, "the instance must reach every way"


def test_split_constants_are_the_references():
    t = cdp.targeted_of(0.1, 0.05, 1000, "clt", "pilot", 64, 0.25)
    k = cdp.split_constants(t)
    dp = 0.25 * 0.05
    assert k["c_main"] == budget_rules.tail_factor("clt", 0.05 - dp)
    assert k["c_full"] == budget_rules.tail_factor("clt", 0.05)
    assert k["inv_dp"] == 1.0 / dp
    assert k["k_pilot"] == budget_rules.tail_factor("clt", dp) / 64
    assert k["eps"] == 0.1 and k["norm"] == 0
    assert [cdp.split_constants(cdp.targeted_of(0.1, 0.1, 9, "chebyshev", n, 8, 0.25))["norm"]
            for n in cdp.SPLIT_NORMS_GPU] == [0, 1, 2]
    assert cdp.split_constants(cdp.targeted_of(0.1, 0.1, 9, "chebyshev", "auto", 8, 0.25))[
        "k_pilot"] == 0.0


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(delta=None), ValueError, "delta"),
    (dict(max_budget=None), ValueError, "max_budget"),
    (dict(eps=0.0), ValueError, "`eps`"),
    (dict(delta=0.3, rule="clt"), ValueError, "`delta`"),
    (dict(rule="bernstein"), ValueError, "`rule`"),
    (dict(norm="student"), ValueError, "studentised"),
    (dict(norm="oracle"), ValueError, "yardstick"),
    (dict(norm="exact"), ValueError, "`norm`"),
    (dict(pilot=0), ValueError, "`pilot`"),
    (dict(pilot=2**30 + 1), ValueError, "`pilot`"),
    (dict(max_budget=2**30 + 1), ValueError, "`budget`"),
    (dict(max_budget=2.5), TypeError, "`max_budget`"),
    (dict(pilot_share=1.0), ValueError, "`pilot_share`"),
])
def test_targeted_options_name_the_argument(kwargs, exc, match):
    opts = dict(eps=0.1, delta=0.1, max_budget=100, rule="chebyshev", norm="auto", pilot=64,
                pilot_share=0.25)
    opts.update(kwargs)
    with pytest.raises(exc, match=match):
        cdp.targeted_of(*opts.values())


def test_split_scratch_sizes_follow_the_formula():
    rows, D, pilot = 6, 128, 100
    for tokens, chunks in ((1, 1), (4096, 1), (4097, 2), (131072, 32)):
        sizes = cdp.split_scratch_sizes(rows, D, pilot, tokens)
        assert sizes == (32 * rows * chunks, 64 * rows, 8 * rows * D, 4 * rows * D, 8 * rows,
                         4 * rows * pilot, 4 * rows, 4 * rows, 4 * rows, 8 * rows, 8 * rows,
                         8 * rows, 8 * rows)
    # The pilot's scratch grows with `pilot` only; nothing grows with max_budget here (the
    # sampled variant's own pieces are sized by it).
    a, b = cdp.split_scratch_sizes(rows, D, 1, 10), cdp.split_scratch_sizes(rows, D, 2, 10)
    assert sum(b) - sum(a) == 4 * rows


def test_kernel_contracts_match_the_launches():
    """Every argument of the new kernels is bound by the plan (by name: a missing or extra
    name would raise at plan time on the GPU)."""
    from stochattn.cuda.kernels import abi

    prep = abi.kernel("santa_prop", "doublep_split_prep")
    bud = abi.kernel("santa_prop", "doublep_split_budgets")
    samp = abi.kernel("santa_prop", "santa_prop_sample_budgets")
    fixed_prep = {"num_parts", "n_exact", "n_chunks", "Hq", "N", "n_tiles", "tile_size", "D",
                  "norm", "eps", "c_main", "c_full", "inv_dp", "pilot"}
    assert set(prep.arg_names) == set(cdp._SPLIT_PREP_VARIABLE) | fixed_prep
    fixed_bud = {"Hq", "G", "N", "n_pad", "n_tiles", "tile_size", "D", "dtype", "norm", "eps",
                 "c_main", "c_full", "k_pilot", "inv_dp", "max_budget", "pilot"}
    assert set(bud.arg_names) == set(cdp._SPLIT_BUDGETS_VARIABLE) | fixed_bud
    fixed_samp = {"Hq", "G", "N", "n_pad", "n_tiles", "tile_size", "max_budget", "idx_ld",
                  "rng_stream", "sampler", "purpose", "num_parts", "part", "skip_zero"}
    assert set(samp.arg_names) == set(cdp._SPLIT_SAMPLE_VARIABLE) | fixed_samp
    assert abi.constant("santa_prop", "kMomentFields") == 4
    assert abi.enum("santa_prop", "SplitWay") == {"SPLIT_WAY_BOUND": 0, "SPLIT_WAY_EXACT": 1,
                                                  "SPLIT_WAY_SAMPLED": 2}


def test_decode_argument_errors_before_any_launch():
    q = np.zeros((1, 2, 64), np.float16)
    with pytest.raises(ValueError, match="`eps`.*budget=None"):
        cdp.doublep_decode(q, q, q, None, eps=0.1, delta=0.1, max_budget=8, budget=4)
    with pytest.raises(ValueError, match="`eps`.*clusters=None"):
        cdp.doublep_decode(q, q, q, None, eps=0.1, delta=0.1, max_budget=8, clusters=2)
    with pytest.raises(ValueError, match="`return_budgets` and `v_sqnorms` need `eps`"):
        cdp.doublep_decode(q, q, q, None, budget=4, return_budgets=True)
    with pytest.raises(ValueError, match="studentised"):
        cdp.doublep_decode(q, q, q, None, eps=0.1, delta=0.1, max_budget=8,
                           budget_norm="student")


def test_gpu_plan_takes_the_gpu_norms_and_refuses_student_naming_it():
    from stochattn import DoublePPlan

    for norm in cdp.SPLIT_NORMS_GPU:
        plan = DoublePPlan(approx="sample", eps=0.1, delta=0.1, max_budget=64, budget_norm=norm,
                           pilot=32)
        assert plan._cuda_missing() == []
        assert plan._kernel_options(1, 2)["budget_norm"] == norm
    with pytest.raises(NotImplementedError, match="student"):
        DoublePPlan(approx="sample", eps=0.1, delta=0.1, max_budget=64, budget_norm="student",
                    device="cuda")
