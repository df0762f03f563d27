"""Calibration of the statistical tests (issue 33 item 5: "statistical tests that never cry wolf").

Each check below runs one statistical test's own statistic (the helper the test itself calls,
imported from tests/) many times on the correct estimator with fresh seeds, and reports:

- ``failures``: runs that fail at the test's own bound (its stated false-failure rate is
  1e-6 or 1e-4, so 0 of 1000 is expected and says little on its own);
- ``test_level``: the tail of the test's statistic at looser levels. Each run gives the
  test's p-value (Bonferroni-adjusted where the test takes a max over elements: m times the
  smallest two-sided normal p-value, capped at 1; the test fails exactly when it is below
  its alpha); the fraction of runs with p <= 0.05, 0.01, 0.001 is reported with a 95%
  Clopper-Pearson interval, to compare with the level. Bonferroni over correlated
  elements makes this conservative (below the level) by construction;
- ``element_level`` (max-|z| tests): one element per run, chosen by the tool's generator
  independently of the draws, its signed z; the fraction beyond the two-sided normal
  quantile at each level (and each tail apart). This is the sharp check of the normal
  approximation the bound relies on;
- ``power``: where a test plants a bias (or asserts a true effect), how often the same
  statistic detects it over fresh seeds.

Verdict at level 0.01 (the issue's criterion): ``miscalibrated`` when the exceedance
fraction's interval lies above 0.01 or the fraction is 3x the level, ``conservative`` when
the interval at 0.05 lies below 0.05, else ``calibrated``.

Hypothesis-driven tests draw their instances from the test's own strategies (the module's
``*_EXAMPLES`` dict), through Hypothesis with a fixed seed, and their estimator seeds from
this tool's generator (fresh, uniform over the test's range), so runs are independent.

    PYTHONPATH=. python3 tools/calibrate_stat_tests.py --list
    PYTHONPATH=. python3 tools/calibrate_stat_tests.py --only bernoulli_variance --runs 200 \\
        --json benchmarks/results/tmp/stat_calibration.json

Without ``--runs`` each check runs its default count (chosen so that all checks together
take about 45 CPU-minutes on one core). ``--json`` merges the checks run into the file (one
key per check), so checks can be run one process at a time. CPU only, numpy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
# As tests/conftest.py: Numba's CUDA simulator where there is no GPU (test_doublep imports
# test_kmeans, which imports the Numba kernels).
if ("NUMBA_ENABLE_CUDASIM" not in os.environ and shutil.which("nvidia-smi") is None
        and not os.path.exists("/dev/nvidia0")):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from stochattn.eval.budget_study import binom_sf, clopper_pearson  # noqa: E402

LEVELS = (0.05, 0.01, 0.001)
SQRT2 = math.sqrt(2.0)


# ---------------------------------------------------------------------------------------
# Statistics of the statistics.
# ---------------------------------------------------------------------------------------

def p_two_sided(z: float) -> float:
    """2 P(Z > |z|) for a standard normal Z."""
    return math.erfc(abs(z) / SQRT2) if math.isfinite(z) else 0.0


def p_one_sided_upper(z: float) -> float:
    """2 P(Z > z), the two-sided scale of a one-sided test that fails when z > z*(alpha/2)."""
    return min(1.0, math.erfc(z / SQRT2)) if math.isfinite(z) else 0.0


def bonferroni(pmin: float, m: int) -> float:
    return min(1.0, m * pmin)


def z_quantile(level: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(1.0 - level / 2.0)


def proportion(k: int, n: int) -> dict:
    lo, hi = clopper_pearson(k, n) if n else (0.0, 1.0)
    return {"count": int(k), "runs": int(n), "fraction": k / n if n else None,
            "ci95": [round(lo, 6), round(hi, 6)]}


def tail_table(pvalues) -> dict:
    p = np.asarray(pvalues, dtype=np.float64)
    return {str(a): proportion(int((p <= a).sum()), p.size) for a in LEVELS}


def element_table(zs) -> dict:
    """Signed z of one element per run: both tails and each tail apart, at every level."""
    z = np.asarray(zs, dtype=np.float64)
    out = {}
    for a in LEVELS:
        q = z_quantile(a)
        out[str(a)] = dict(proportion(int((np.abs(z) > q).sum()), z.size),
                           upper=int((z > q).sum()), lower=int((z < -q).sum()))
    out["mean_z"] = float(np.mean(z[np.isfinite(z)])) if z.size else None
    out["sd_z"] = float(np.std(z[np.isfinite(z)], ddof=1)) if z.size > 1 else None
    return out


def verdict(table: dict) -> str:
    t01, t05 = table["0.01"], table["0.05"]
    if t01["ci95"][0] > 0.01 or (t01["fraction"] or 0) >= 0.03:
        return "miscalibrated"
    if t05["ci95"][1] < 0.05:
        return "conservative"
    return "calibrated"


def summarise(rec: dict) -> dict:
    """Adds the verdict of the test-level table and of the element-level one."""
    if "test_level" in rec:
        rec["test_level_verdict"] = verdict(rec["test_level"])
    if "element_level" in rec:
        rec["element_level_verdict"] = verdict(rec["element_level"])
    v = [rec.get("element_level_verdict"), rec.get("test_level_verdict")]
    rec["verdict"] = ("miscalibrated" if "miscalibrated" in v
                      else next(x for x in v + ["n/a"] if x is not None))
    return rec


def maxz_run(z, signs, m, bound, rng) -> dict:
    """One run of a max-|z| test: max z, its Bonferroni p-value, failure, one element's z."""
    z = np.asarray(z, dtype=np.float64).ravel()
    signs = np.asarray(signs, dtype=np.float64).ravel()
    zmax = float(z.max())
    i = int(rng.integers(z.size))
    return {"zmax": zmax, "m": int(m), "p": bonferroni(p_two_sided(zmax), m),
            "fail": zmax > bound, "ratio": zmax / bound, "z1": float(signs[i] * z[i])}


def maxz_record(runs: list[dict]) -> dict:
    ratios = [r["ratio"] for r in runs]
    return {
        "runs": len(runs),
        "failures": int(sum(r["fail"] for r in runs)),
        "max_zmax_over_bound": float(max(ratios)),
        "elements_per_run": [int(min(r["m"] for r in runs)), int(max(r["m"] for r in runs))],
        "test_level": tail_table([r["p"] for r in runs]),
        "element_level": element_table([r["z1"] for r in runs]),
    }


def signed_z(estimates, truth, variance=None):
    """|z| of tests/stats.unbiased_zscores (the statistic of assert_unbiased), and the sign."""
    from stats import unbiased_zscores

    z, m = unbiased_zscores(estimates, truth, variance)
    sign = np.sign(np.asarray(estimates, dtype=np.float64).mean(axis=0)
                   - np.broadcast_to(truth, np.shape(estimates)[1:]))
    return z, np.where(sign == 0, 1.0, sign), m


def hypothesis_runs(strategies: dict, n: int, hseed: int, body):
    """Runs ``body(**example)`` on n examples drawn by Hypothesis from the test's strategies
    (generate phase only, no database, seeded); ``body`` returns None to reject one."""
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import seed as hyp_seed

    out = []

    @hyp_seed(hseed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(**strategies)
    def run(**kw):
        r = body(**kw)
        assume(r is not None)
        out.append(r)

    run()
    return out


def fresh(rng, hi=2**63):
    return int(rng.integers(0, hi, dtype=np.uint64)) if hi > 2**63 else int(rng.integers(0, hi))


# ---------------------------------------------------------------------------------------
# The checks: name -> (default runs, function(runs, rng) -> record).
# ---------------------------------------------------------------------------------------

CHECKS = {}


def check(name, runs):
    def deco(f):
        CHECKS[name] = (runs, f)
        return f
    return deco


@check("bernoulli_unbiased", 1000)
def bernoulli_unbiased(n, rng):
    import test_bernoulli as tb
    from stats import z_bound

    def body(inputs, draws, group_shared, seed, offset):
        est, truth, valid, var = tb.unbiased_case(inputs, draws, group_shared, fresh(rng),
                                                  fresh(rng, 2**32))
        z, s, m = signed_z(est[:, valid], truth[valid], var[valid])
        return maxz_run(z, s, m, z_bound(tb.ALPHA, m), rng)

    runs = hypothesis_runs(tb.UNBIASED_EXAMPLES, n, 1, body)
    return dict(maxz_record(runs),
                test="tests/test_bernoulli.py::test_scores_are_unbiased",
                statistic="max |z| of mean(400 estimates) - q.k over the valid (b, h, n), "
                          "SE from max(sample, exact) variance",
                variance="analytic (variance_formula), max with the sample variance",
                bound="z_bound(1e-6, m) (Bonferroni)", stated_rate="1e-6 per example")


@check("bernoulli_inclusion", 300)
def bernoulli_inclusion(n, rng):
    import test_bernoulli as tb

    runs = []
    for _ in range(n):
        _, pv = tb.inclusion_pvalues(seed0=fresh(rng, 2**63 - 4000))
        i = int(rng.integers(len(pv)))
        runs.append({"p": bonferroni(min(pv), len(pv)), "p1": pv[i],
                     "fail": not min(pv) > tb.ALPHA / len(pv)})
    return {
        "test": "tests/test_bernoulli.py::test_inclusion_frequencies_match_the_bernoulli_probabilities",
        "statistic": "exact two-sided binomial p-values of 6 features x (seeds reading j, total "
                     "count of j), 2000 seeds; min p",
        "variance": "none (exact binomial law)",
        "bound": "min p > 1e-6 / 12 (Bonferroni)", "stated_rate": "1e-6",
        "runs": n, "failures": int(sum(r["fail"] for r in runs)),
        "test_level": tail_table([r["p"] for r in runs]),
        "one_pvalue_level": tail_table([r["p1"] for r in runs]),
        "note": "the two-sided exact binomial p-value (2 min tail) is conservative for a "
                "discrete law; one_pvalue_level: one of the 12 p-values per run, at random",
    }


def _bernoulli_variance(group_shared, n, rng):
    import test_bernoulli as tb
    from stats import z_bound

    runs, detected = [], 0
    for _ in range(n):
        sq, formula, wrong, sq_var = tb.variance_case(group_shared,
                                                      seed0=fresh(rng, 2**63 - 4000))
        z, s, m = signed_z(sq, formula, sq_var)
        runs.append(maxz_run(z, s, m, z_bound(tb.ALPHA, m), rng))
        zw, _, mw = signed_z(sq, wrong, sq_var)
        detected += bool(zw.max() > z_bound(tb.ALPHA, mw))
    return dict(maxz_record(runs),
                test=f"tests/test_bernoulli.py::test_variance_matches_the_formula[{group_shared}]",
                statistic="max |z| of mean(3000 squared errors) - variance_formula over the 10 "
                          "(h, n), SE from max(sample, exact) variance of one squared error",
                variance="analytic (squared_error_variance), max with the sample variance",
                bound="z_bound(1e-6, 10)", stated_rate="1e-6",
                power={"planted": "formula for draws = 2 (50% too high)",
                       **proportion(detected, n)})


@check("bernoulli_variance_per_head", 500)
def bernoulli_variance_per_head(n, rng):
    return _bernoulli_variance(False, n, rng)


@check("bernoulli_variance_shared", 500)
def bernoulli_variance_shared(n, rng):
    return _bernoulli_variance(True, n, rng)


@check("bernoulli_planted", 100)
def bernoulli_planted(n, rng):
    import test_bernoulli as tb
    from stats import z_bound

    power = {}
    for bug, gs in tb.PLANTED_BUGS:
        hits, zmin, computed = 0, math.inf, None
        for _ in range(n):
            truth, computed, buggy = tb.planted_case(bug, gs, seed0=fresh(rng, 2**63 - 1000))
            z, _, m = signed_z(buggy, truth)
            hits += bool(z.max() > z_bound(tb.ALPHA, m))
            zmin = min(zmin, float(z.max()))
        power[bug] = dict(proportion(hits, n), computed_power=computed, smallest_max_z=zmin)
    return {"test": "tests/test_bernoulli.py::test_planted_bias_is_detected",
            "statistic": "assert_unbiased's max |z| on 400 buggy estimates",
            "bound": "z_bound(1e-6, 24)", "runs": n, "power": power}


@check("santa_unbiased", 900)
def santa_unbiased(n, rng):
    import test_santa as ts
    from hypothesis import strategies as st
    from stats import z_bound

    strategies = dict(ts.UNBIASED_EXAMPLES, sampler=st.sampled_from(ts.SAMPLERS),
                      schedule=st.sampled_from(ts.SCHEDULES))

    def body(sampler, schedule, inputs, budget, tile_size, seed):
        case = ts.unbiased_case(sampler, schedule, inputs, budget, tile_size, fresh(rng))
        if case is None:
            return None
        est, truth, var = case
        z, s, m = signed_z(est, truth, var)
        return dict(maxz_run(z, s, m, z_bound(ts.ALPHA, m), rng), key=f"{sampler}/{schedule}")

    runs = hypothesis_runs(strategies, n, 2, body)
    per = {}
    for key in sorted({r["key"] for r in runs}):
        sub = [r for r in runs if r["key"] == key]
        per[key] = {"runs": len(sub), "failures": int(sum(r["fail"] for r in sub)),
                    "p<=0.01": int(sum(r["p"] <= 0.01 for r in sub)),
                    "element_p<=0.01": int(sum(abs(r["z1"]) > z_quantile(0.01) for r in sub))}
    return dict(maxz_record(runs),
                test="tests/test_santa.py::test_unbiased (9 sampler x schedule, drawn at random)",
                statistic="max |z| of mean(400 estimates) - exact attention over the valid "
                          "elements (valid_elements), SE from max(sample, exact) variance",
                variance="analytic (element_variance), max with the sample variance",
                bound="z_bound(1e-6, m)", stated_rate="1e-6 per example",
                per_sampler_schedule=per)


@check("santa_paper_prop", 200)
def santa_paper_prop(n, rng):
    import test_santa as ts
    from stats import z_bound
    from stochattn.reference.exact import exact_attention

    q, k, v = ts.planted_instance()
    truth = exact_attention(q, k, v, None, 1.0)
    runs, hits = [], 0
    for _ in range(n):
        paper, ours = ts.paper_prop_case(seed0=fresh(rng, 2**63 - 4000))
        z, s, m = signed_z(ours, truth)
        runs.append(maxz_run(z, s, m, z_bound(1e-6, m), rng))
        zp, _, mp = signed_z(paper, truth)
        hits += bool(zp.max() > z_bound(1e-6, mp))
    return dict(maxz_record(runs),
                test="tests/test_santa.py::test_paper_prop_bias_is_detected_and_ours_is_not",
                statistic="|z| of mean(2000 prop estimates) - truth, one element, SE from the "
                          "sample variance",
                variance="estimated (sample variance; the instance has no rare tokens)",
                bound="z_bound(1e-6, 1) = 4.89", stated_rate="1e-6",
                power={"planted": "the SANTA paper's prop (|bias|/SE about 38)",
                       **proportion(hits, n)})


@check("santa_variance_ordering", 300)
def santa_variance_ordering(n, rng):
    import test_santa as ts
    from stats import z_bound

    zstar = z_bound(1e-4, 60)
    runs, pooled = [], []
    for _ in range(n):
        base = fresh(rng, 2**63 - 10**4)
        exact, var, se = ts.variance_ordering_case(seeds=(base, base + 3000, base + 6000))
        zm = np.concatenate([((var[s] - exact[s]) / se[s]).ravel() for s in ts.SAMPLERS])
        zo = np.concatenate([((var[s] - var["iid"]) / np.sqrt(se[s] ** 2 + se["iid"] ** 2)).ravel()
                             for s in ("stratified", "systematic")])
        pmin = min(min(p_two_sided(z) for z in zm), min(p_one_sided_upper(z) for z in zo))
        fail = bool(np.abs(zm).max() > zstar or zo.max() > zstar)
        i = int(rng.integers(zm.size))
        runs.append({"p": bonferroni(pmin, 60), "fail": fail, "z1": float(zm[i]),
                     "ratio": float(np.abs(zm).max() / zstar), "zo_max": float(zo.max())})
        pooled.append(zm)
    pooled = np.concatenate(pooled)
    return {
        "test": "tests/test_santa.py::test_variance_ordering_empirical",
        "statistic": "per row and sampler z = (empirical row variance - exact) / SE (delta "
                     "method, SE = sd(Y)/sqrt(1000)), 36 two-sided; ordering z of strat - iid "
                     "and sys - iid, 24 one-sided; Bonferroni over 60",
        "variance": "estimated (SE of the variance estimate from the sample)",
        "bound": f"z_bound(1e-4, 60) = {zstar:.3f}", "stated_rate": "1e-4",
        "runs": n, "failures": int(sum(r["fail"] for r in runs)),
        "max_match_z_over_bound": max(r["ratio"] for r in runs),
        "largest_ordering_z": max(r["zo_max"] for r in runs),
        "test_level": tail_table([r["p"] for r in runs]),
        "element_level": element_table([r["z1"] for r in runs]),
        "pooled_match_z": {"elements": int(pooled.size), "mean": float(pooled.mean()),
                           "sd": float(pooled.std(ddof=1)),
                           **{f"|z|>{z_quantile(a):.2f}": float((np.abs(pooled) > z_quantile(a)).mean())
                              for a in LEVELS}},
    }


@check("santa_systematic_exceeds_iid", 50)
def santa_systematic_exceeds_iid(n, rng):
    import test_santa as ts
    from stats import z_bound

    margin_z = z_bound(2e-6, 1)
    zs = []
    for _ in range(n):
        base = fresh(rng, 2**63 - 10**4)
        var, se = ts.systematic_vs_iid_case(seeds=(base, base + 5000))
        zs.append(float((var["systematic"][0, 0] - var["iid"][0, 0])
                        / math.sqrt(se["iid"][0, 0] ** 2 + se["systematic"][0, 0] ** 2)))
    zs = np.array(zs)
    return {"test": "tests/test_santa.py::test_systematic_can_exceed_iid",
            "statistic": "z = (var_sys - var_iid) / sqrt(SE_sys^2 + SE_iid^2), true effect",
            "bound": f"z > z_bound(2e-6, 1) = {margin_z:.2f}", "stated_rate": "1e-6 (one-sided)",
            "runs": n, "failures": int((zs <= margin_z).sum()),
            "power": dict(proportion(int((zs > margin_z).sum()), n),
                          min_z=float(zs.min()), mean_z=float(zs.mean()))}


@check("doublep_unbiased", 500)
def doublep_unbiased(n, rng):
    import test_doublep as td
    from stats import z_bound

    skipped = [0]

    def body(data_seed, seed0):
        q, k, v, index, truth, d = td.sample_setup(data_seed)
        approx_heads = d.clusters_exact < d.clusters_selected
        if not approx_heads.any():
            skipped[0] += 1
            return None
        s0 = fresh(rng, 2**40)
        out = []
        for sampler in ("systematic", "stratified", "iid"):
            est = td.sample_variant_estimates(q, k, v, index, sampler, s0)
            var = td.sample_variance(q, k, v, index, td.P1, td.P2, td.BUDGET, sampler)
            z, s, m = signed_z(est, truth, var)
            out.append(dict(maxz_run(z, s, m, z_bound(1e-6, m), rng), key=sampler,
                            random=bool(est[:, approx_heads].std(axis=0).max() > 0)))
        return out

    runs = [r for group in hypothesis_runs(td.SAMPLE_EXAMPLES, n, 3, body) for r in group]
    per = {s: {"calls": sum(r["key"] == s for r in runs),
               "failures": int(sum(r["fail"] for r in runs if r["key"] == s)),
               "p<=0.01": int(sum(r["p"] <= 0.01 for r in runs if r["key"] == s)),
               "element_p<=0.01": int(sum(abs(r["z1"]) > z_quantile(0.01)
                                          for r in runs if r["key"] == s))}
           for s in ("systematic", "stratified", "iid")}
    return dict(maxz_record(runs),
                test="tests/test_doublep.py::test_sample_variant_is_unbiased (runs = "
                     "examples x 3 samplers)",
                statistic="max |z| of mean(300 estimates) - p2 = 1 output over B Hq D, SE from "
                          "max(sample, exact) variance",
                variance="analytic (sample_variance), max with the sample variance",
                bound="z_bound(1e-6, B Hq D)", stated_rate="1e-6 per sampler and example",
                examples_without_approx_clusters=skipped[0],
                not_random=int(sum(not r["random"] for r in runs)),
                per_sampler=per)


@check("doublep_planted", 100)
def doublep_planted(n, rng):
    import test_doublep as td
    from stats import z_bound

    q, k, v, index, truth, _ = td.sample_setup(12345, B=2)
    runs, hits = [], {p: 0 for p in td.PLANTS}
    for _ in range(n):
        s0 = fresh(rng, 2**63 - 1000)
        z, s, m = signed_z(td.reimplementation_estimates(q, k, v, index, seed0=s0), truth)
        runs.append(maxz_run(z, s, m, z_bound(1e-6, m), rng))
        for plant in td.PLANTS:
            zb, _, mb = signed_z(td.reimplementation_estimates(q, k, v, index, plant, s0), truth)
            hits[plant] += bool(zb.max() > z_bound(1e-6, mb))
    return dict(maxz_record(runs),
                test="tests/test_doublep.py::test_sample_matches_reimplementation_and_planted_"
                     "bias_is_detected (fixed seeds in the test; fresh here)",
                statistic="assert_unbiased's max |z| over 16 elements, 300 iid estimates of the "
                          "re-implementation, sample variance",
                variance="estimated (sample variance only)",
                bound="z_bound(1e-6, 16)", stated_rate="deterministic (seeds 0..299); 1e-6 "
                                                       "for a fresh seed",
                power={p: proportion(h, n) for p, h in hits.items()})


@check("doublep_sample_converges", 300)
def doublep_sample_converges(n, rng):
    import test_doublep as td

    ratios = np.array([float(np.divide(*td.sampled_and_centroid_errors(seed=fresh(rng, 2**63))))
                       for _ in range(n)])
    return {"test": "tests/test_doublep.py::test_centroid_variant_is_biased_sample_converges",
            "statistic": "max error of the sampled variant (4096 points) / max error of the "
                         "centroid variant", "bound": "ratio < 0.1",
            "stated_rate": "deterministic (seed 0); none stated for a fresh seed",
            "runs": n, "failures": int((ratios >= 0.1).sum()),
            "ratio": {"max": float(ratios.max()), "median": float(np.median(ratios)),
                      "mean": float(ratios.mean()), "sd": float(ratios.std(ddof=1))}}


def _chi2(name, test, n, rng, counts_of):
    import test_rng as tr

    ps, fails = [], 0
    for _ in range(n):
        p = tr.chi2_uniform_pvalue(counts_of(rng))
        ps.append(p)
        fails += not p > tr.ALPHA
    return {"test": test, "statistic": "Pearson chi-square p-value of bin counts against "
            "equal bins", "variance": "none (chi-square law of the counts)",
            "bound": "p > 1e-6", "stated_rate": "1e-6 per example", "runs": n,
            "failures": fails, "test_level": tail_table(ps)}


@check("rng_uniform_chi2", 1000)
def rng_uniform_chi2(n, rng):
    import test_rng as tr

    purposes = [tr.PURPOSE_VALUE_SAMPLER, tr.PURPOSE_BERNOULLI, tr.PURPOSE_KMEANS_INIT,
                tr.PURPOSE_CLUSTER_SAMPLER]
    return _chi2("rng_uniform_chi2", "tests/test_rng.py::test_uniforms_are_uniform_chi_square",
                 n, rng, lambda g: tr.uniform_bin_counts(fresh(g, 2**64), fresh(g, 2**32),
                                                         purposes[int(g.integers(4))]))


@check("rng_pairs_chi2", 1000)
def rng_pairs_chi2(n, rng):
    import test_rng as tr

    return _chi2("rng_pairs_chi2",
                 "tests/test_rng.py::test_consecutive_draws_are_independent_chi_square",
                 n, rng, lambda g: tr.pair_cell_counts(fresh(g, 2**64), fresh(g, 2**32)))


@check("rng_iid_points_chi2", 1000)
def rng_iid_points_chi2(n, rng):
    import test_rng as tr

    return _chi2("rng_iid_points_chi2",
                 "tests/test_rng.py::test_iid_points_are_marginally_uniform_chi_square",
                 n, rng, lambda g: tr.iid_point_counts(fresh(g, 2**64), fresh(g, 2**32),
                                                       (1, 7, 32)[int(g.integers(3))]))


def _budget_pool():
    import test_budgets as tb

    return tb, tb.Pool()


@check("budgets_coverage_tightest", 200)
def budgets_coverage_tightest(n, rng):
    tb, pool = _budget_pool()
    case = ("iid", "clt", "oracle", 0.1, 0.1)  # F/n closest to delta with seeds 0..31
    sampler, rule, norm, eps, delta = case
    F = []
    for _ in range(n):
        s0 = fresh(rng, 2**63 - 100)
        F.append(tb.coverage(pool, tb.shipped(pool, rule, norm, eps, delta), sampler, eps,
                             rng_seed=s0, seed0=s0)[0])
    nn = tb.REPS * pool.H
    ps = [binom_sf(f, nn, delta) for f in F]
    return {"test": "tests/test_budgets.py::test_coverage[iid-clt-oracle-0.1-0.1]",
            "statistic": "F failures of 10240 pairs, P(Bin(n, delta) >= F)",
            "variance": "none (exact binomial; composite null P(fail) <= delta)",
            "bound": "p >= 1e-6 / 42", "stated_rate": "1e-6 over the 42 cases", "runs": n,
            "failures": int(sum(p < tb.CASE_ALPHA for p in ps)), "test_level": tail_table(ps),
            "failure_fraction_over_delta": {"mean": float(np.mean(F) / nn / delta),
                                            "max": float(max(F) / nn / delta)}}


@check("budgets_coverage_all", 10)
def budgets_coverage_all(n, rng):
    tb, pool = _budget_pool()
    ps, worst = [], {}
    for _ in range(n):
        s0 = fresh(rng, 2**63 - 100)
        pm = 1.0
        for case in tb.CASES:
            sampler, rule, norm, eps, delta = case
            F, nn, _, _ = tb.coverage(pool, tb.shipped(pool, rule, norm, eps, delta), sampler,
                                      eps, rng_seed=s0, seed0=s0)
            pm = min(pm, binom_sf(F, nn, delta))
            key = "/".join(map(str, case))
            worst[key] = max(worst.get(key, 0.0), F / nn / delta)
        ps.append(bonferroni(pm, len(tb.CASES)))
    top = sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    return {"test": "tests/test_budgets.py::test_coverage (all 42 cases per run)",
            "statistic": "min over cases of P(Bin(n, delta) >= F), Bonferroni over 42",
            "variance": "none (exact binomial; composite null)",
            "bound": "each case p >= 1e-6 / 42", "stated_rate": "1e-6", "runs": n,
            "failures": int(sum(p < 1e-6 for p in ps)), "test_level": tail_table(ps),
            "largest_failure_fraction_over_delta": dict(top)}


@check("budgets_halved_power", 10)
def budgets_halved_power(n, rng):
    tb, pool = _budget_pool()
    cases = [(e, d) for e in tb.EPS for d in tb.DELTAS]
    hits, weakest = 0, math.inf
    for _ in range(n):
        s0 = fresh(rng, 2**63 - 100)
        for eps, delta in cases:
            F, nn, _, _ = tb.coverage(pool, tb.planted_halved_variance(pool, "clt", eps, delta),
                                      "iid", eps, rng_seed=s0, seed0=s0)
            p = binom_sf(F, nn, delta)
            hits += p < tb.CASE_ALPHA
            weakest = min(weakest, -math.log10(max(p, 1e-300)))
    return {"test": "tests/test_budgets.py::test_halved_variance_fails_coverage",
            "statistic": "the coverage statistic on CLT budgets with half the variance",
            "bound": "p < 1e-6 / 42", "runs": n * len(cases),
            "power": dict(proportion(hits, n * len(cases)),
                          weakest_minus_log10_p=weakest)}


@check("budgets_spread_rho", 1000)
def budgets_spread_rho(n, rng):
    import test_budgets as tb
    from statistics import NormalDist

    bound = NormalDist().inv_cdf(1 - 1e-6)
    fixed_data = np.array([tb.spread_rho(5, fresh(rng, 2**63 - 100))[0] for _ in range(n // 2)])
    fresh_data = np.array([tb.spread_rho(fresh(rng, 2**63), fresh(rng, 2**63 - 100))[0]
                           for _ in range(n - n // 2)])
    out = {}
    for name, rho in (("fresh_pilot_seeds", fixed_data), ("fresh_heads_and_seeds", fresh_data)):
        t = rho * math.sqrt(63)
        out[name] = {"runs": int(rho.size), "failures": int((t <= bound).sum()),
                     "t_min": float(t.min()), "t_mean": float(t.mean()), "t_sd": float(t.std(ddof=1)),
                     "margin_sds": float((t.mean() - bound) / t.std(ddof=1))}
    return {"test": "tests/test_budgets.py::test_budget_grows_with_attention_spread",
            "statistic": "Spearman rho sqrt(63) of mean pilot S against the 95%-mass key fraction",
            "bound": f"> z(1 - 1e-6) = {bound:.3f} (true effect)",
            "stated_rate": "deterministic (data seed 5, pilot seeds 0..7)", **out}


@check("cluster_mass_margin", 1000)
def cluster_mass_margin(n, rng):
    import test_cluster_mass as tc

    gaps, sub_fail = [], 0
    for _ in range(n):
        mae = tc.variance_correction_mae(seed=fresh(rng, 2**63))
        gaps.append(min(mae["paper"] - mae[m] for m in ("diag-var", "pca", "pca-clip")))
        sub_fail += not mae["sub"] < mae["paper"]
    g = np.array(gaps)
    return {"test": "tests/test_cluster_mass.py::test_gaussian_clusters_variance_corrections_beat_paper",
            "statistic": "smallest MAE(paper) - MAE(corrected) over diag-var, pca, pca-clip",
            "bound": "> 0.2 nats (and MAE(sub) < MAE(paper))",
            "stated_rate": "< 1e-6 for a fresh seed (z > 7)", "runs": n,
            "failures": int((g <= 0.2).sum() + sub_fail),
            "gap": {"mean": float(g.mean()), "sd": float(g.std(ddof=1)), "min": float(g.min()),
                    "margin_sds": float((g.mean() - 0.2) / g.std(ddof=1))}}


# ---------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--runs", type=int, default=None, help="runs per check (default: each "
                    "check's own)")
    ap.add_argument("--seed", type=int, default=20261206, help="the tool's generator seed")
    ap.add_argument("--json", default=None, help="merge the records into this JSON file")
    ap.add_argument("--list", action="store_true", help="list the checks and their runs")
    args = ap.parse_args(argv)
    if args.list:
        for name, (runs, f) in CHECKS.items():
            print(f"{name:32s} {runs:5d}")
        return
    names = [s for s in args.only.split(",") if s] or list(CHECKS)
    unknown = [s for s in names if s not in CHECKS]
    if unknown:
        ap.error(f"unknown checks: {unknown}; --list shows them")
    results = {}
    for i, name in enumerate(names):
        runs, f = CHECKS[name]
        n = args.runs or runs
        rng = np.random.default_rng([args.seed, list(CHECKS).index(name)])
        t0 = time.process_time()
        rec = summarise(f(n, rng))
        rec["cpu_s"] = round(time.process_time() - t0, 1)
        rec["tool_seed"] = args.seed
        results[name] = rec
        line = (f"{name}: {rec.get('runs', n)} runs, {rec.get('failures', '-')} failures at the "
                f"bound")
        for key in ("test_level", "element_level"):
            if key in rec:
                t = rec[key]["0.01"]
                line += (f"; {key} p<=0.01: {t['count']}/{t['runs']} "
                         f"[{t['ci95'][0]:.4f}, {t['ci95'][1]:.4f}]")
        if "power" in rec:
            line += f"; power {json.dumps(rec['power'], default=str)[:160]}"
        print(line + f"; {rec['verdict']}; {rec['cpu_s']} s", flush=True)
        if args.json:
            path = Path(args.json)
            data = json.loads(path.read_text()) if path.exists() else {}
            data.setdefault("checks", {})[name] = rec
            data["machine"] = f"{platform.machine()} {platform.python_version()} numpy {np.__version__}"
            data["rerun"] = "PYTHONPATH=. python3 tools/calibrate_stat_tests.py --json FILE"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return results


if __name__ == "__main__":
    main()
