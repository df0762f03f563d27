"""Error-targeted budgets when part of the output is computed exactly (Double-P's sampled
variant; docs/budgets.md).

A row's output is ``o = w_E o_E + w_A o_A``: the exact part ``o_E`` (the tokens read
exactly, weight ``w_E = Z_E / Z``) and the sampled part ``o_A = E_{p_A}[v]`` over the set A
(Double-P's C_approx, weight ``w_A = Z_A / Z = 1 - w_E``; both masses are exact, the keys of
A are read). The estimate replaces ``o_A`` by the mean of S draws from ``p_A``, so
``o_hat - o = w_A (mean - o_A)`` and ``E||o_hat - o||^2 <= w_A^2 sigma_A^2 / S`` (iid;
stratified never exceeds it) with ``sigma_A^2 = m2_A - ||o_A||^2``, ``m2_A = sum_A p_j
||v_j||^2`` (the per-token ``||v_j||^2`` kept beside the cache). The smallest S with
P(||o_hat - o|| > eps ||o||) <= delta is then

    S = ceil(c(delta_main) w_A^2 V_A / (eps^2 L^2)),   V_A >= sigma_A^2,  L <= ||o||,

through :func:`stochattn.reference.budgets.budgets_from_variance` (capped at ``max_budget``).
The bounds, per ``norm`` (the pilot draws come from ``p_A`` on purpose
:data:`~stochattn.spec.PURPOSE_BUDGET_PILOT`, row ``b * Hq + h``, streams as S²ANTA's):

- ``"pilot"``: S0 stratified draws (stream 0), ``o_p`` their mean, ``k = c(delta_pilot) / S0``.
  On the pilot's good event ``||o_p - o_A||^2 <= k sigma_A^2``: ``||o_A|| >= L_A`` (the
  S²ANTA pilot bound :func:`~stochattn.reference.budgets.pilot_norm_lower` on ``||o_p||``),
  so ``V_A = m2_A - L_A^2``, and ``||o|| >= ||w_E o_E + w_A o_p|| - w_A sqrt(k V_A) = L``.
- ``"student"``: sets A' (``S_A`` draws, stream 1) and B' (``S_B``, stream 2) as S²ANTA's;
  the direction ``u`` of ``w_E o_E + w_A mean_A'``; B' estimates ``u . o_A`` by ``t`` with
  the studentised width of :func:`~stochattn.reference.budgets.student_norm_lower`, so
  ``L_A = max(0, t - width)`` bounds ``||o_A|| >= u . o_A`` and
  ``L = max(0, w_E u . o_E + w_A (t - width))`` bounds ``||o|| >= u . o``.
- ``"bound"`` (no pilot, no draw; only with an exact part): ``||o_A|| <= sqrt(m2_A)``
  (Jensen), so ``||o|| >= ||w_E o_E|| - w_A sqrt(m2_A) = L`` and ``V_A = m2_A``; all of
  delta goes to the main draws. Useful where C_exact carries most of the mass (w_A small);
  L = 0 (S = max_budget, capped) where it does not.
- ``"oracle"``: the exact ``o_A`` and ``o`` (a yardstick, reads every value of A).

With no exact part (``w_E = 0``) every rule is S²ANTA's (:func:`choose_budgets`): the
pilot's L_A solves ``L_A + sqrt(k (m2 - L_A^2)) = ||o_p||``, which is the formula for L
above. A row whose A is empty draws nothing (S = 0, not capped, error bound 0).
"""

from __future__ import annotations

import numpy as np

from ..budget_rules import SPLIT_NORMS, check_options, student_split, student_z, tail_factor
from ..spec import PURPOSE_BUDGET_PILOT
from .budgets import (BudgetChoice, budgets_from_variance, philox_uniform, pilot_norm_lower,
                      sampler_counts)

__all__ = ["choose_split_budgets"]


def choose_split_budgets(wa, va, sq_a, w_exact, o_exact, *, eps, delta, max_budget,
                         rule="chebyshev", norm="pilot", pilot=64, pilot_share=0.25, seed=0,
                         offset=0, rows, heads) -> BudgetChoice:
    """Per-row S for ``o = w_E o_E + w_A o_A`` with o_A sampled (module docstring).

    Parameters
    ----------
    wa : ndarray (R, N) float64 >= 0
        The unnormalised weights of A in the order the draws invert (0 off A).
    va : ndarray (R, N, D)
        The value rows under ``wa``.
    sq_a : ndarray (R, N)
        Their ``||v_j||^2`` (as kept beside the cache).
    w_exact : ndarray (R,)
        ``Z_E / (Z_E + Z_A)`` in [0, 1].
    o_exact : ndarray (R, D)
        The exact part's output (any value where ``w_exact`` is 0).
    rows, heads : ndarray (R,) int, int
        The stream rows ``b * Hq + h`` of the pilot draws and Hq (``seed``/``offset`` may be
        per-sequence arrays, as for the estimators).
    Other options as :func:`stochattn.reference.budgets.choose_budgets`.

    Returns
    -------
    BudgetChoice
        Shapes (R,); ``second_moment`` is m2_A, ``norm_sq_lower`` is L^2.
    """
    check_options(eps, delta, max_budget, rule, norm, pilot, pilot_share, SPLIT_NORMS)
    wa = np.asarray(wa, dtype=np.float64)
    va = np.asarray(va, dtype=np.float64)
    R, N = wa.shape
    za = wa.sum(axis=-1)
    nonempty = za > 0
    pa = wa / np.where(nonempty, za, 1.0)[:, None]
    m2 = np.einsum("rn,rn->r", pa, np.asarray(sq_a, dtype=np.float64))
    we = np.asarray(w_exact, dtype=np.float64)
    wA = 1.0 - we
    oe = np.where((we > 0)[:, None], np.asarray(o_exact, dtype=np.float64), 0.0)
    rows = np.asarray(rows, dtype=np.int64)

    def counts(S, stream):
        return sampler_counts(wa, "stratified", S, philox_uniform(
            seed, offset, PURPOSE_BUDGET_PILOT, rows, heads, stream=stream)).astype(np.float64)

    def norm2(x):
        return np.einsum("rd,rd->r", x, x)

    if norm == "oracle":
        delta_main, delta_pilot, S0 = float(delta), 0.0, 0
        o_a = np.einsum("rn,rnd->rd", pa, va)
        var_a = m2 - norm2(o_a)
        L2 = norm2(we[:, None] * oe + wA[:, None] * o_a)
    elif norm == "bound":
        delta_main, delta_pilot, S0 = float(delta), 0.0, 0
        var_a = m2
        L = np.where(nonempty, np.clip(np.sqrt(norm2(we[:, None] * oe)) - wA * np.sqrt(m2),
                                       0.0, None), 0.0)
        L2 = L * L
    else:
        delta_pilot = float(pilot_share) * float(delta)
        delta_main = float(delta) - delta_pilot
        S0 = int(pilot)
        if norm == "pilot":
            k = tail_factor(rule, delta_pilot) / S0
            o_p = np.einsum("rn,rnd->rd", counts(S0, 0), va) / S0
            la = pilot_norm_lower(np.sqrt(norm2(o_p)), m2, k)
            var_a = m2 - la * la
            L = np.sqrt(norm2(we[:, None] * oe + wA[:, None] * o_p)) \
                - wA * np.sqrt(k * np.maximum(var_a, 0.0))
        else:
            sa, sb = student_split(S0)
            ca, cb = counts(sa, 1), counts(sb, 2)
            mean_a = np.einsum("rn,rnd->rd", ca, va) / sa
            d = we[:, None] * oe + wA[:, None] * mean_a
            nd = np.sqrt(norm2(d))
            u = d / np.where(nd > 0, nd, 1.0)[:, None]
            proj = np.einsum("rd,rnd->rn", u, va)
            t = np.einsum("rn,rn->r", cb, proj) / sb
            dev = proj - t[:, None]
            s2 = np.einsum("rn,rn->r", cb, dev * dev) / max(sb - 1, 1)
            vmax = np.sqrt(np.where(wa > 0, sq_a, 0.0).max(axis=-1, initial=0.0))
            width = np.maximum(student_z(delta_pilot) * np.sqrt(s2 / sb), 2.0 * vmax / sb)
            ok = (nd > 0) & (sb > 1)
            la = np.where(ok, np.clip(t - width, 0.0, np.sqrt(m2)), 0.0)
            var_a = m2 - la * la
            L = np.where(ok, we * (u * oe).sum(-1) + wA * (t - width), 0.0)
        L = np.where(nonempty, np.clip(L, 0.0, None), 0.0)
        L2 = L * L
    c = tail_factor(rule, delta_main)
    S, capped, bound = budgets_from_variance(wA * wA * np.maximum(var_a, 0.0), L2, c, eps,
                                             max_budget, nonempty)
    return BudgetChoice(S, capped, bound, np.where(nonempty, L2, 0.0), m2, S0, rule, norm,
                        delta_main, delta_pilot)
