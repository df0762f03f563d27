"""Statistical assertions with a stated false-failure rate.

``assert_unbiased`` compares the mean of R independent estimates with the truth, element
by element, with a z-bound Bonferroni-corrected over the elements compared. Its nominal
false-failure rate is ``alpha`` per call (the normal approximation of the mean of R >= 200
bounded draws; elements whose estimates never vary must equal the truth to rounding).

Limit of the normal approximation: it needs every outcome that can move the mean by more
than a standard error to be expected several times among the R draws. Sampling from a
very peaked distribution breaks that (a token of mass 1e-4 hit ~0 times in R*S draws
shifts the mean while the sample variance misses it), and the nominal rate is then far too
small (about 11% false failures were measured at alpha = 1e-6 on peaked SANTA rows). Such
tests must compare only the elements where rare outcomes cannot dominate, chosen from the
instance and never from the draws: see ``valid_elements`` in tests/test_santa.py.

Calibration: tools/calibrate_stat_tests.py runs each statistical test's own statistic over
fresh seeds and measures its tail against the nominal levels (docs/testing.md).
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np


def z_bound(alpha: float, comparisons: int) -> float:
    """Two-sided normal bound with total false-failure rate ``alpha`` over ``comparisons``."""
    return NormalDist().inv_cdf(1.0 - alpha / (2.0 * max(comparisons, 1)))


def unbiased_zscores(estimates: np.ndarray, truth: np.ndarray, variance=None):
    """z-scores of mean(estimates) - truth over the leading (seed) axis, and the count used.

    ``variance``, when known, is the exact variance of one estimate per element; the
    standard error then uses max(sample variance, exact variance), so a rare outcome that
    none of the R draws hit (sample variance 0, mean off by a hair) cannot fake a bias.
    Elements whose variance is zero get z = 0 when they equal the truth to 1e-9 relative
    and z = inf otherwise.
    """
    estimates = np.asarray(estimates, dtype=np.float64)
    truth = np.broadcast_to(np.asarray(truth, dtype=np.float64), estimates.shape[1:])
    R = estimates.shape[0]
    mean = estimates.mean(axis=0)
    var = estimates.var(axis=0, ddof=1)
    if variance is not None:
        var = np.maximum(var, np.broadcast_to(np.asarray(variance, dtype=np.float64), var.shape))
    se = np.sqrt(var / R)
    diff = np.abs(mean - truth)
    scale = 1e-9 * (1.0 + np.abs(truth))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(se > 1e-12 * (1.0 + np.abs(truth)), diff / se, np.where(diff <= scale, 0.0, np.inf))
    return z, z.size


def assert_unbiased(estimates, truth, alpha: float = 1e-6, what: str = "estimator",
                    variance=None) -> float:
    """Assert mean(estimates, axis 0) == truth within a Bonferroni z-bound; return max z.

    False-failure rate: ``alpha`` (nominal) for an unbiased estimator. ``variance``: the
    exact per-element variance of one estimate, when known (see ``unbiased_zscores``).
    """
    z, m = unbiased_zscores(estimates, truth, variance)
    bound = z_bound(alpha, m)
    worst = float(np.max(z))
    assert worst <= bound, (
        f"{what} looks biased: max |z| = {worst:.2f} > {bound:.2f} "
        f"(alpha={alpha}, {m} elements, {np.asarray(estimates).shape[0]} seeds)"
    )
    return worst
