"""Bernoulli qK^T (docs/estimators.md): unbiased scores from a random subset of key features.

Statistical tests state their false-failure rate (``alpha``) per test call; Hypothesis
runs at most 25 examples per test (tests/conftest.py), so a Hypothesis test fails falsely
with probability at most 25 * alpha. Seeds are drawn by Hypothesis or fixed and written
down, so every failure replays.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stochattn.bernoulli import bernoulli_scores
from stochattn.reference.bernoulli import estimate_scores
from stochattn.reference.common import lengths, logits, valid_mask
from stochattn.reference.rng import PURPOSE_BERNOULLI, uniforms

from stats import assert_unbiased, z_bound
from strategies import decode_inputs

ALPHA = 1e-6  # false-failure rate of each statistical assertion below
R = 400  # seeds per unbiasedness check

seeds = st.integers(0, 2**63)
offsets = st.integers(0, 2**32 - 1)


def exact_scores(q, k, seq_lens=None):
    """q . k in float64, -inf past seq_lens (the truth)."""
    return logits(q, k, lengths(seq_lens, q.shape[0], k.shape[2]), 1.0)


def many(q, k, seq_lens, *, R, seed, **kw):
    """R estimates for seeds seed, seed + 1, ... stacked on a leading axis (float64);
    ``draws`` and ``group_shared`` are passed by their public names."""
    kw = {{"draws": "bernoulli_draws", "group_shared": "bernoulli_group_shared"}.get(n, n): x
          for n, x in kw.items()}
    return np.stack([bernoulli_scores(q, k, seq_lens, seed=(seed + r) % 2**64, **kw)
                     for r in range(R)]).astype(np.float64)


def manual_estimate(q, k, *, draws, seed, offset, group_shared, bug=None):
    """A loop-by-loop restatement of the estimator (docs/estimators.md), with an optional planted bug.

    bug=None is the correct estimator (checked against the library below); "no_importance"
    shares the group pattern but weights it like the per-head estimator, alpha_h sign(q_hj)
    (the importance weights forgotten); "no_inverse_p" weights kept features by q_j
    instead of q_j / p_j.
    """
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q = q.astype(np.float64)
    k = k.astype(np.float64)
    out = np.zeros((B, Hq, N))
    for b in range(B):
        for h in range(Hq):
            kvh = h // G
            if group_shared:
                a = np.abs(q[b, kvh * G:(kvh + 1) * G]).mean(axis=0)
                row = b * Hkv + kvh
            else:
                a = np.abs(q[b, h])
                row = b * Hq + h
            p = a / a.max() if a.max() > 0 else np.zeros(D)
            for i in range(draws):
                for j in range(D):
                    if not uniforms(seed, offset, PURPOSE_BERNOULLI, row, 0, i * D + j) < p[j]:
                        continue
                    if bug == "no_importance":
                        w = np.abs(q[b, h]).max() * np.sign(q[b, h, j])
                    elif bug == "no_inverse_p":
                        w = q[b, h, j]
                    else:
                        w = q[b, h, j] / p[j]
                    out[b, h] += w * k[b, kvh, :, j] / draws
    return out


# ----------------------------------------------------------------------------------------
# 1. Unbiasedness


# The examples of test_scores_are_unbiased (also drawn by tools/calibrate_stat_tests.py).
UNBIASED_EXAMPLES = dict(inputs=decode_inputs(max_tokens=12, head_dims=(4, 8, 16)),
                         draws=st.integers(1, 4), group_shared=st.booleans(), seed=seeds,
                         offset=offsets)


def unbiased_case(inputs, draws, group_shared, seed, offset):
    """The statistic's inputs of test_scores_are_unbiased: the R estimates (R, B, Hq, N),
    the truth, the valid mask and the exact variance of one estimate."""
    q, k, _, seq_lens = inputs
    est = many(q, k, seq_lens, R=R, seed=seed, draws=draws, group_shared=group_shared,
               offset=offset)
    truth = exact_scores(q, k, seq_lens)
    valid = np.broadcast_to(valid_mask(lengths(seq_lens, q.shape[0], k.shape[2]), k.shape[2]),
                            truth.shape)
    exact_var = variance_formula(q.astype(np.float64), k.astype(np.float64), draws=draws,
                                 group_shared=group_shared)
    return est, truth, valid, exact_var


@given(**UNBIASED_EXAMPLES)
def test_scores_are_unbiased(inputs, draws, group_shared, seed, offset):
    """mean over R = 400 seeds of s_hat -> q . k on every valid (b, h, n); GQA and seq_lens.

    False-failure rate: ALPHA = 1e-6 per example (Bonferroni over the valid elements). The
    standard error uses max(sample variance, the exact variance of variance_formula): a
    feature with a small p_j enters an estimate rarely and with a large weight, so 400 seeds
    can miss it, leaving the sample variance too small and the mean off by more than it
    allows (a false failure at max |z| 5.60 against 5.58 was seen; the same case gives
    z = 2.3 over 20,000 seeds). See tests/stats.py.
    """
    est, truth, valid, exact_var = unbiased_case(inputs, draws, group_shared, seed, offset)
    assert np.all(est[:, ~valid] == -np.inf)
    assert np.all(np.isfinite(est[:, valid]))
    assert_unbiased(est[:, valid], truth[valid], alpha=ALPHA, variance=exact_var[valid],
                    what=f"bernoulli_scores(bernoulli_group_shared={group_shared}, bernoulli_draws={draws})")


def test_manual_restatement_matches_library():
    """The loop-by-loop estimator of docs/estimators.md equals the library (to rounding)."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 8))
    q[1, 2, 3] = 0.0  # a zero feature in one head
    k = rng.standard_normal((2, 2, 5, 8))
    for group_shared in (False, True):
        for seed, offset in ((0, 0), (3, 17)):
            got = bernoulli_scores(q, k, bernoulli_draws=3, bernoulli_group_shared=group_shared, seed=seed,
                                   offset=offset)
            want = manual_estimate(q, k, draws=3, seed=seed, offset=offset,
                                   group_shared=group_shared)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------
# 2. A planted bias is caught by the same check


def _power(q, k, *, draws, group_shared, bug, bound):
    """Probability that the z-check of assert_unbiased catches ``bug`` with R seeds.

    Counts c_j ~ Binomial(draws, p_j) are independent across features, so the buggy
    estimator sum_j (c_j / draws) w_j k_nj has mean sum_j p_j w_j k_nj and variance
    (1 / draws) sum_j p_j (1 - p_j) w_j^2 k_nj^2; its mean over R seeds is taken as normal.
    The check fails when any element has |z| > bound; the power is at least the best
    single element's.
    """
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    best = 0.0
    for b in range(B):
        for h in range(Hq):
            a = (np.abs(q[b, (h // G) * G:(h // G + 1) * G]).mean(axis=0) if group_shared
                 else np.abs(q[b, h]))
            p = a / a.max()
            w = (np.abs(q[b, h]).max() * np.sign(q[b, h]) if bug == "no_importance" else q[b, h])
            kk = k[b, h // G]
            mean = kk @ (p * w)
            sd = np.sqrt((kk**2) @ (p * (1 - p) * w**2) / draws)
            delta = np.abs(mean - kk @ q[b, h]) / (sd / np.sqrt(R))
            cdf = NormalDist().cdf
            best = max([best] + [cdf(d - bound) + cdf(-d - bound) for d in delta])
    return best


def planted_case(bug, group_shared, seed0=1000):
    """test_planted_bias_is_detected's truth, computed power and R buggy estimates
    (seeds seed0, seed0 + 1, ...; the test uses 1000)."""
    rng = np.random.default_rng(2024)
    q = rng.standard_normal((1, 4, 8))
    k = rng.standard_normal((1, 1, 6, 8))
    draws = 2
    truth = exact_scores(q, k)
    bound = z_bound(ALPHA, truth.size)
    power = _power(q, k, draws=draws, group_shared=group_shared, bug=bug, bound=bound)
    buggy = np.stack([manual_estimate(q, k, draws=draws, seed=seed0 + r, offset=0,
                                      group_shared=group_shared, bug=bug) for r in range(R)])
    return truth, power, buggy


PLANTED_BUGS = [("no_importance", True), ("no_inverse_p", False)]


@pytest.mark.parametrize("bug,group_shared", PLANTED_BUGS)
def test_planted_bias_is_detected(bug, group_shared):
    """The unbiasedness check (R = 400, ALPHA = 1e-6) rejects a planted bug.

    Fixed instance (rng 2024, B=1, Hq=4, Hkv=1, N=6, D=8, draws=2, seed 1000). Power,
    computed below from the exact mean and variance of the buggy estimator: at least
    1 - 1e-9 for both bugs, i.e. the test misses the bug with probability < 1e-9.
    """
    truth, power, buggy = planted_case(bug, group_shared)
    assert power >= 1 - 1e-9, f"planted-bias instance too weak: power {power}"
    with pytest.raises(AssertionError, match="looks biased"):
        assert_unbiased(buggy, truth, alpha=ALPHA)


# ----------------------------------------------------------------------------------------
# 3. Exact properties


@given(data=st.data(), group_shared=st.booleans(), draws=st.integers(1, 5), seed=seeds,
       offset=offsets, dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_one_hot_query_gives_the_exact_dot_product(data, group_shared, draws, seed, offset, dtype):
    """q one-hot (per head; per group for the shared pattern): s_hat = q_j0 k_j0 exactly."""
    B, Hkv, G = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    N, D = data.draw(st.integers(1, 6)), data.draw(st.sampled_from([1, 4, 16]))
    Hq = Hkv * G
    heads_sharing = G if group_shared else 1  # heads that must be one-hot on the same j
    j0 = np.repeat(data.draw(st.lists(st.integers(0, D - 1), min_size=B * Hq // heads_sharing,
                                      max_size=B * Hq // heads_sharing)), heads_sharing)
    values = data.draw(st.lists(st.floats(0.01, 100.0) | st.floats(-100.0, -0.01),
                                min_size=B * Hq, max_size=B * Hq))
    q = np.zeros((B * Hq, D))
    q[np.arange(B * Hq), j0] = values
    q = q.reshape(B, Hq, D).astype(dtype)
    k = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).standard_normal(
        (B, Hkv, N, D)).astype(dtype)
    got = bernoulli_scores(q, k, bernoulli_draws=draws, bernoulli_group_shared=group_shared, seed=seed, offset=offset)
    want = exact_scores(q, k).astype(dtype)
    assert got.dtype == dtype
    assert np.array_equal(got, want)


@pytest.mark.parametrize("group_shared", [False, True])
def test_zero_query_gives_zero_and_reads_nothing(group_shared):
    """q = 0: s_hat = 0 exactly on valid tokens, -inf past seq_lens, no feature read.

    With the shared pattern, a zero head inside a non-zero group also gets exactly 0.
    """
    rng = np.random.default_rng(3)
    q = np.zeros((2, 4, 8))
    q[1, 1] = rng.standard_normal(8)  # batch 1, group 0: head 0 zero, head 1 not
    k = rng.standard_normal((2, 2, 5, 8))
    seq_lens = np.array([3, 5])
    for seed in range(5):
        s, diag = bernoulli_scores(q, k, seq_lens, bernoulli_group_shared=group_shared, seed=seed,
                                   return_diagnostics=True)
        assert np.all(s[0, :, :3] == 0.0) and np.all(s[0, :, 3:] == -np.inf)
        assert np.all(s[1, [0, 2, 3]] == 0.0)
        assert np.all(diag.k_feature_fraction[0] == 0.0)
        assert np.all(diag.k_feature_fraction[1, 2:] == 0.0)
        assert diag.k_feature_fraction[1, 1] > 0
        # The zero head of a non-zero group: the group's pattern when shared, else nothing.
        want = diag.k_feature_fraction[1, 1] if group_shared else 0.0
        assert diag.k_feature_fraction[1, 0] == want


@given(inputs=decode_inputs(max_tokens=20, head_dims=(4, 8), min_len=0), draws=st.integers(1, 4),
       group_shared=st.booleans(), seed=seeds, offset=offsets)
def test_masked_positions_and_reproducibility(inputs, draws, group_shared, seed, offset):
    """-inf exactly past seq_lens (all of an empty sequence), finite before; same
    (seed, offset) gives bit-identical output and diagnostics."""
    q, k, _, seq_lens = inputs
    kw = dict(bernoulli_draws=draws, bernoulli_group_shared=group_shared, seed=seed, offset=offset,
              return_diagnostics=True)
    s1, d1 = bernoulli_scores(q, k, seq_lens, **kw)
    s2, d2 = bernoulli_scores(q, k, seq_lens, **kw)
    valid = np.broadcast_to(valid_mask(lengths(seq_lens, q.shape[0], k.shape[2]), k.shape[2]),
                            s1.shape)
    assert np.all(s1[~valid] == -np.inf) and np.all(np.isfinite(s1[valid]))
    assert s1.tobytes() == s2.tobytes()
    assert d1.k_feature_fraction.tobytes() == d2.k_feature_fraction.tobytes()


def test_seed_offset_and_row_select_independent_patterns():
    """Fixed instance: another seed or offset changes the output; per-head patterns differ
    between two heads with the same q, the shared pattern does not."""
    rng = np.random.default_rng(11)
    q = np.repeat(rng.standard_normal((1, 1, 16)), 2, axis=1)  # two identical heads
    k = rng.standard_normal((1, 1, 7, 16))
    base = bernoulli_scores(q, k, seed=5, offset=9)
    for other in (dict(seed=6, offset=9), dict(seed=5, offset=10), dict(seed=5 + 2**32, offset=9)):
        assert not np.array_equal(bernoulli_scores(q, k, **other), base)
    assert not np.array_equal(base[0, 0], base[0, 1])  # rows b * Hq + h are independent
    shared = bernoulli_scores(q, k, seed=5, offset=9, bernoulli_group_shared=True)
    assert np.array_equal(shared[0, 0], shared[0, 1])


@given(q=st.lists(st.floats(-10, 10, allow_subnormal=False), min_size=1, max_size=12).filter(lambda v: any(v)),
       draws=st.integers(1, 4), seed=seeds, offset=offsets)
def test_shared_pattern_of_a_single_head_group_is_the_per_head_pattern(q, draws, seed, offset):
    """G = 1: the mean group query is the head's own |q| and row b * Hkv + kvh = b * Hq + h,
    so both variants keep the same features and agree to rounding of the weights."""
    q = np.array(q)[None, None, :]
    k = np.random.default_rng(seed % 2**32).standard_normal((1, 1, 5, q.shape[-1]))
    kw = dict(bernoulli_draws=draws, seed=seed, offset=offset, return_diagnostics=True)
    a, da = bernoulli_scores(q, k, **kw)
    b, db = bernoulli_scores(q, k, bernoulli_group_shared=True, **kw)
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13 * np.abs(q).max())
    assert np.array_equal(da.k_feature_fraction, db.k_feature_fraction)


def counts_from_identity_keys(q, *, draws, seed, offset=0):
    """Per-head draw counts c_j of every feature, read off the output for k = identity.

    With k_n = e_n (N = D) the per-head estimate is s_hat_n = alpha sign(q_n) c_n / draws.
    """
    D = q.shape[-1]
    k = np.eye(D)[None, None].repeat(q.shape[1], axis=1)
    s, diag = bernoulli_scores(q, k, bernoulli_draws=draws, seed=seed, offset=offset,
                               return_diagnostics=True)
    alpha = np.abs(q).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(q != 0, s * draws / (alpha * np.sign(q)), 0.0)
    counts = np.rint(c)
    assert np.all(np.abs(c - counts) < 1e-9)
    return counts.astype(np.int64), diag


def _binom_two_sided_p(x: int, n: int, p: float) -> float:
    """Exact two-sided binomial p-value 2 min(P(X <= x), P(X >= x)), capped at 1."""
    logpmf = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
              + i * math.log(p) + (n - i) * math.log1p(-p) for i in range(n + 1)]
    pmf = np.exp(np.array(logpmf))
    return min(1.0, 2 * min(pmf[: x + 1].sum(), pmf[x:].sum()))


def test_inclusion_frequencies_match_the_bernoulli_probabilities():
    """Per head, fixed q (D = 8) and seeds 0..1999, draws = 4: over the 2000 seeds, the
    number of seeds that read feature j is Binomial(2000, 1 - (1 - p_j)^4), and the total
    count over all draws is Binomial(8000, p_j). Exact binomial tests, Bonferroni over
    the 2 x 6 features with 0 < p_j < 1: false-failure rate ALPHA = 1e-6. The p_j = 1
    feature is read by every draw and the p_j = 0 feature by none: asserted exactly.
    """
    counts, pvalues = inclusion_pvalues()
    assert np.all(counts[:, 0] == 4) and np.all(counts[:, 7] == 0)
    assert min(pvalues) > ALPHA / len(pvalues), pvalues


def inclusion_pvalues(seed0=0):
    """test_inclusion_frequencies_match_the_bernoulli_probabilities' counts (Rf, D) and its
    12 exact binomial p-values, for seeds seed0 .. seed0 + 1999 (the test uses 0)."""
    q = np.array([[[1.0, -0.8, 0.5, -0.3, 0.1, 0.05, -0.02, 0.0]]])
    p = np.abs(q[0, 0]) / 1.0
    draws, Rf = 4, 2000
    counts = np.stack([counts_from_identity_keys(q, draws=draws, seed=s)[0][0, 0]
                       for s in range(seed0, seed0 + Rf)])  # (Rf, D)
    inner = [j for j in range(8) if 0 < p[j] < 1]
    pvalues = []
    for j in inner:
        pvalues.append(_binom_two_sided_p(int((counts[:, j] > 0).sum()), Rf, 1 - (1 - p[j]) ** draws))
        pvalues.append(_binom_two_sided_p(int(counts[:, j].sum()), Rf * draws, p[j]))
    return counts, pvalues


# ----------------------------------------------------------------------------------------
# 4. Variance


def variance_formula(q, k, *, draws, group_shared):
    """Var(s_hat_hn) = (1 / draws) sum_f k_nf^2 q_hf^2 (1 - p_f) / p_f (p of the pattern)."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    a = np.abs(q)
    if group_shared:
        a = np.repeat(a.reshape(B, -1, G, D).mean(axis=2), G, axis=1)
    p = a / a.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_feature = np.where(p > 0, q**2 * (1 - p) / p, 0.0)  # (B, Hq, D)
    kk = np.repeat(k, G, axis=1)  # (B, Hq, N, D)
    return np.einsum("bhnd,bhd->bhn", kk**2, per_feature) / draws


@pytest.mark.parametrize("group_shared", [False, True])
def test_variance_matches_the_formula(group_shared):
    """Fixed instance (rng 99, B=1, Hq=2, Hkv=1, N=5, D=8, draws=3), seeds 0..2999.

    E[(s_hat - q.k)^2] = Var(s_hat), so the squared errors are an unbiased estimate of
    the formula; checked with assert_unbiased (false-failure rate ALPHA = 1e-6). Its power:
    a formula off by the draws factor (variance as for draws = 2 instead of 3, 50% too
    high) must be rejected on the same data, which also shows the check can fail.
    The standard error uses max(sample, exact) variance of one squared error
    (squared_error_variance): squared errors are skewed (skewness about 3 here), so the
    sample variance is small exactly when the mean is, and the studentised mean has a
    heavy lower tail; a one-term Edgeworth expansion puts the rate at the 1e-6 bound
    about 2-4x the nominal with the sample variance alone (calibrated at 0.01 either
    way: docs/testing.md).
    """
    sq, formula, wrong, sq_var = variance_case(group_shared)
    assert_unbiased(sq, formula, alpha=ALPHA, what="squared error vs variance formula",
                    variance=sq_var)
    with pytest.raises(AssertionError, match="looks biased"):
        assert_unbiased(sq, wrong, alpha=ALPHA, variance=sq_var)


def variance_case(group_shared, seed0=0):
    """test_variance_matches_the_formula's squared errors (3000, 1, 2, 5) for seeds seed0,
    seed0 + 1, ... (the test uses 0), the formula, the planted formula (draws = 2) and
    the exact variance of one squared error."""
    rng = np.random.default_rng(99)
    q = rng.standard_normal((1, 2, 8))
    k = rng.standard_normal((1, 1, 5, 8))
    draws, Rv = 3, 3000
    est = many(q, k, None, R=Rv, seed=seed0, draws=draws, group_shared=group_shared)
    sq = (est - exact_scores(q, k)) ** 2
    return (sq, variance_formula(q, k, draws=draws, group_shared=group_shared),
            variance_formula(q, k, draws=2, group_shared=group_shared),
            squared_error_variance(q, k, draws=draws, group_shared=group_shared))


def squared_error_variance(q, k, *, draws, group_shared):
    """Var((s_hat_hn - q.k_n)^2), exactly. The error is sum_f a_f (c_f / draws - p_f) with
    a_f = q_hf k_nf / p_f and independent counts c_f ~ Binomial(draws, p_f); with m2_f and
    m4_f the second and fourth central moments of one term (binomial: d p q and
    d p q (1 + 3 (d - 2) p q), over d^2 and d^4), Var(X^2) = E X^4 - (E X^2)^2 =
    sum m4_f - 3 sum m2_f^2 + 2 (sum m2_f)^2."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    a = np.abs(q)
    if group_shared:
        a = np.repeat(a.reshape(B, -1, G, D).mean(axis=2), G, axis=1)
    p = a / a.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        weight = np.where(p > 0, q / p, 0.0)
    c = np.repeat(k, G, axis=1) * weight[:, :, None, :]  # (B, Hq, N, D)
    pq = (p * (1 - p))[:, :, None, :]
    m2 = c**2 * pq / draws
    m4 = c**4 * pq * (1 + 3 * (draws - 2) * pq) / draws**3
    return m4.sum(-1) - 3 * (m2**2).sum(-1) + 2 * m2.sum(-1) ** 2


# ----------------------------------------------------------------------------------------
# 5. Diagnostics


@given(data=st.data(), group_shared=st.booleans(), draws=st.integers(1, 6), seed=seeds)
def test_feature_fraction_is_the_fraction_of_features_read(data, group_shared, draws, seed):
    """k_feature_fraction in (0, 1] equals the fraction of features with a non-zero weight
    (read off the output with identity keys); shared within a group when group_shared;
    k_rows_read = seq_lens per KV head; v_rows_read = 0."""
    B, Hkv, G = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    D = data.draw(st.sampled_from([1, 4, 8, 16]))
    q = np.random.default_rng(seed % 2**32).standard_normal((B, Hkv * G, D))
    q[q == 0] = 1.0  # every feature non-zero, so weight 0 <=> feature not drawn
    k = np.broadcast_to(np.eye(D), (B, Hkv, D, D))
    seq_lens = np.full(B, D)
    s, diag = bernoulli_scores(q, k, seq_lens, bernoulli_draws=draws, bernoulli_group_shared=group_shared,
                               seed=seed, return_diagnostics=True)
    fraction = diag.k_feature_fraction
    assert fraction.shape == (B, Hkv * G) and fraction.dtype == np.float64
    assert np.all(fraction > 0) and np.all(fraction <= 1)
    assert np.array_equal(fraction, (s != 0).sum(axis=-1) / D)
    if group_shared:
        nonzero = (s != 0).reshape(B, Hkv, G, D)
        assert np.all(nonzero == nonzero[:, :, :1])
    assert np.array_equal(diag.k_rows_read, np.full((B, Hkv), D))
    assert np.array_equal(diag.v_rows_read, np.zeros((B, Hkv), dtype=np.int64))
    assert np.array_equal(diag.seq_lens, seq_lens)


def test_reference_and_public_function_agree_for_each_dtype():
    """The public function is the float64 reference cast to q.dtype, bit for bit."""
    rng = np.random.default_rng(5)
    for dtype in (np.float16, np.float32, np.float64):
        q = rng.standard_normal((2, 4, 8)).astype(dtype)
        k = rng.standard_normal((2, 2, 6, 8)).astype(dtype)
        seq_lens = np.array([6, 2], dtype=np.int32)
        for group_shared in (False, True):
            got, diag = bernoulli_scores(q, k, seq_lens, bernoulli_draws=3, bernoulli_group_shared=group_shared,
                                         seed=8, offset=2, return_diagnostics=True)
            ref, fraction = estimate_scores(q, k, np.array([6, 2]), draws=3,
                                            group_shared=group_shared, seed=8, offset=2)
            assert got.dtype == dtype
            assert np.array_equal(got, ref.astype(dtype))
            assert np.array_equal(diag.k_feature_fraction, fraction)


# ----------------------------------------------------------------------------------------
# 6. Errors


def _qk(dtype=np.float64):
    rng = np.random.default_rng(0)
    return rng.standard_normal((1, 2, 4)).astype(dtype), rng.standard_normal((1, 1, 3, 4)).astype(dtype)


def test_old_parameter_names_still_work_and_warn():
    q, k = Q[:, :1], K
    new = bernoulli_scores(q, k, bernoulli_draws=2, bernoulli_group_shared=True, seed=3)
    with pytest.warns(DeprecationWarning, match=r"`draws` is now called `bernoulli_draws`"):
        old = bernoulli_scores(q, k, draws=2, group_shared=True, seed=3)
    assert np.array_equal(old, new)
    with pytest.raises(TypeError, match=r"got both `bernoulli_draws` and its old name `draws`"):
        bernoulli_scores(q, k, draws=2, bernoulli_draws=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'drawz'"):
        bernoulli_scores(q, k, drawz=2)


Q, K = _qk()


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((Q, K), dict(draws=0), ValueError, r"`draws` must be >= 1, got 0"),
    ((Q, K), dict(draws=-3), ValueError, r"`draws` must be >= 1, got -3"),
    ((Q, K), dict(draws=2.0), TypeError, r"`draws` must be an integer, got float"),
    ((Q, K), dict(draws=True), TypeError, r"`draws` must be an integer, got bool"),
    ((Q, K), dict(draws=None), TypeError, r"`draws` must be an integer, got NoneType"),
    ((Q, K), dict(group_shared="yes"), TypeError, r"`group_shared` must be a bool, got str"),
    ((Q, K), dict(group_shared=1), TypeError, r"`group_shared` must be a bool, got int"),
    ((Q, K), dict(seed=-1), ValueError, r"`seed` must lie in \[0, 2\*\*64\)"),
    ((Q, K), dict(offset=2**32), ValueError, r"`offset` must lie in \[0, 2\*\*32\)"),
    ((Q[0], K), {}, ValueError, r"`q` must have 3 dimensions .* got shape \(2, 4\)"),
    ((Q, K[0]), {}, ValueError, r"`k` must have 4 dimensions .* got shape \(1, 3, 4\)"),
    ((Q, K[..., :3]), {}, ValueError, r"`k` must have head_dim 4 \(from `q`\), got 3"),
    ((Q[:, :1].repeat(3, axis=1), K.repeat(2, axis=1)), {}, ValueError,
     r"`q` heads must be a multiple of `k` heads \(GQA\), got Hq=3 and Hkv=2"),
    ((Q.astype(np.int32), K.astype(np.int32)), {}, TypeError,
     r"`q` dtype must be one of float16, float32, float64, got int32"),
    ((Q.astype(np.float32), K), {}, TypeError,
     r"`q` and `k` must share one dtype, got float32 and float64"),
    ((Q, K, np.array([4])), {}, ValueError, r"`seq_lens` values must lie in \[0, 3\]"),
    ((Q, K, np.array([1.0])), {}, TypeError, r"`seq_lens` must have an integer dtype"),
    ((Q.tolist(), K), {}, TypeError, r"`q` must be a NumPy array"),
])
def test_bad_input_is_rejected_with_a_clear_message(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        bernoulli_scores(*args, **kwargs)


def test_check_finite_is_opt_in():
    q, k = _qk()
    k[0, 0, 1, 2] = np.nan
    bernoulli_scores(q, k)  # no data check by default
    with pytest.raises(ValueError, match=r"`k` must hold only finite values"):
        bernoulli_scores(q, k, check_finite=True)
