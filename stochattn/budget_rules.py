"""The rules of error-targeted budgets shared by the reference and the GPU (docs/budgets.md:
the smallest S per head with P(||o_hat - o|| > eps ||o||) <= delta, from the variance bound
of the mean of S draws): the tail factor c(delta) of each rule, the split and factor of the
studentised pilot, and the options' checks. Both backends import them from here (they never
import each other); :mod:`stochattn.reference.budgets` re-exports them.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

__all__ = ["RULES", "NORMS", "SPLIT_NORMS", "CLT_MAX_DELTA", "tail_factor", "student_split", "student_z",
           "check_options", "check_plan_options"]

RULES = ("chebyshev", "clt")
NORMS = ("pilot", "oracle", "student")
# With an exact part (Double-P's sampled variant, reference.split_budgets) also "bound":
# ||o|| >= ||w_E o_E|| - w_A sqrt(m2_A) from the exact part and the norms alone, no pilot;
# and "auto": per head the cheapest of the bound, a pilot sized by w_A (at most `pilot`
# draws, Markov's factor at any size) and reading C_approx's values outright.
SPLIT_NORMS = NORMS + ("bound", "auto")
# Szekely-Bakirov: the one-eigenvalue tail is the largest for thresholds x > 1.5364 (times the
# mean), i.e. delta = P(Z^2 > x) < 0.2148; 0.2 keeps a margin.
CLT_MAX_DELTA = 0.2


def tail_factor(rule: str, delta: float) -> float:
    """c(delta): P(||o_hat - o||^2 > c E||o_hat - o||^2) <= delta under ``rule``.

    ``"chebyshev"``: 1 / delta (Markov). ``"clt"``: z_{1 - delta/2}^2, the one-degree
    chi-square quantile (Szekely-Bakirov worst case of a Gaussian quadratic form with known
    trace); delta must be <= 0.2.
    """
    if rule == "chebyshev":
        return 1.0 / delta
    if rule == "clt":
        if delta > CLT_MAX_DELTA:
            raise ValueError(f"`delta` must be <= {CLT_MAX_DELTA} with rule='clt' (the one-"
                             f"eigenvalue tail bound needs it), got {delta}")
        return NormalDist().inv_cdf(1.0 - delta / 2.0) ** 2
    raise ValueError(f"`rule` must be one of {', '.join(map(repr, RULES))}, got {rule!r}")


def student_split(pilot: int) -> tuple[int, int]:
    """(S_A, S_B) of ``norm="student"``: a quarter of the pilot (at least 1) for the
    direction, the rest for the scalar bound (64 / 192 gave lower costs than 128 / 128 on
    the SmolLM2 traces, docs/budgets.md)."""
    sa = max(1, int(pilot) // 4)
    return sa, int(pilot) - sa


def student_z(delta_pilot: float) -> float:
    """The one-sided factor of the studentised bound, z_{1 - delta_pilot}, under either rule:
    the spread is estimated, so the bound is asymptotic whatever the main draws' rule, and
    Cantelli's sqrt((1 - delta_pilot) / delta_pilot) would buy no guarantee (it needs the
    true spread) at 3-9x the width (measured: 50% of the heads capped at delta 0.01)."""
    return NormalDist().inv_cdf(1.0 - delta_pilot)


def check_options(eps, delta, max_budget, rule, norm, pilot, pilot_share, norms=NORMS):
    """The options of :func:`choose_budgets` (one set of rules, also for the plans):
    TypeError for types, ValueError for values; messages name the argument."""
    for name, value in (("eps", eps), ("delta", delta), ("pilot_share", pilot_share)):
        if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
            raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}")
    if not (0.0 < eps and math.isfinite(eps)):
        raise ValueError(f"`eps` must be finite and > 0, got {eps}")
    if not (0.0 < delta < 1.0):
        raise ValueError(f"`delta` must lie in (0, 1), got {delta}")
    if not (0.0 < pilot_share < 1.0):
        raise ValueError(f"`pilot_share` must lie in (0, 1), got {pilot_share}")
    for name, value in (("max_budget", max_budget), ("pilot", pilot)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"`{name}` must be an integer, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}")
    if rule not in RULES:
        raise ValueError(f"`rule` must be one of {', '.join(map(repr, RULES))}, got {rule!r}")
    if rule == "clt":
        tail_factor(rule, delta)  # delta <= CLT_MAX_DELTA, reported with the caller's delta
    if norm not in norms:
        raise ValueError(f"`norm` must be one of {', '.join(map(repr, norms))}, got {norm!r}")
    if norm == "student" and pilot < 4:
        raise ValueError(f"`pilot` must be >= 4 with norm='student' (two draw sets, a spread "
                         f"from at least 3 draws), got {pilot}")


def check_plan_options(budget, eps, delta, max_budget, rule, norm, pilot, pilot_share,
                       norms=NORMS):
    """The plans' error-targeted options (SantaPlan, DoublePPlan): either ``budget`` or
    ``eps``, ``eps`` with ``delta`` and ``max_budget``, :func:`check_options`, and no
    ``"oracle"`` norm (a yardstick of the reference). Returns ``(eps, delta, max_budget)``
    as float, float, int."""
    if budget is not None:
        raise ValueError("give either `budget` or `eps` (error-targeted budgets), "
                         f"not both; got budget={budget!r} and eps={eps!r}")
    if delta is None or max_budget is None:
        raise ValueError("`eps` needs `delta` and `max_budget`")
    check_options(eps, delta, max_budget, rule, norm, pilot, pilot_share, norms)
    if norm == "oracle":
        allowed = ", ".join(repr(n) for n in norms if n != "oracle")
        raise ValueError(f"`budget_norm` must be one of {allowed} ('oracle' reads "
                         "all of V: a yardstick of the reference, not an option)")
    return float(eps), float(delta), int(max_budget)
