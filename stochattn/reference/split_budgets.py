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
- ``"auto"`` (a pilot sized per head, :func:`auto_pilot_plan`): per head the cheapest of
  three ways to bound ``||o||``, chosen before any draw from what is exact (``w_A``,
  ``m2_A``, ``||w_E o_E||``, the number ``n_A`` of tokens in A):
  (1) ``"bound"`` above (no draw, all of delta to the main draws);
  (2) a stratified pilot of ``1 <= S0 <= pilot`` draws (stream 0) with the bound of
  ``"pilot"``, but ``k = (1 / delta_pilot) / S0``, Markov's factor, whatever ``rule``: a
  theorem at every S0, even 1, as the stratified mean's squared error is at most
  ``sigma_A^2 / S0`` (the CLT factor is asymptotic, and a pilot of a few draws is not);
  L is the larger of this and the bound's;
  (3) reading A's ``n_A <= pilot`` values outright: L = ``||o||`` and ``V_A = sigma_A^2``
  exactly, all of delta to the main draws.
  ``pilot`` is thus the most a head reads before its main draws. S0 is a function of exact
  quantities only, so the pilot's event keeps its probability given S0, and the union
  bound gives delta per head. The sizing rule, least predicted total draws, is
  :func:`auto_pilot_plan`'s; S0 shrinks as w_A falls, down to no pilot.
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

__all__ = ["choose_split_budgets", "auto_pilot_plan", "AUTO_BOUND", "AUTO_EXACT", "AUTO_SAMPLED"]

# The three ways of norm="auto" (auto_pilot_plan's ``kind``).
AUTO_BOUND, AUTO_EXACT, AUTO_SAMPLED = 0, 1, 2


def _pilot_factor(delta_pilot, S0):
    """k of a stratified pilot of S0 draws under norm="auto": Markov's c = 1 / delta_pilot
    on its squared error (at most sigma_A^2 / S0), over S0. A theorem at every S0 >= 1,
    whichever ``rule`` the main draws use."""
    return (1.0 / delta_pilot) / S0


def auto_pilot_plan(w_approx, m2, norm_exact, n_approx, *, eps, delta, rule, pilot,
                    pilot_share):
    """How ``norm="auto"`` bounds ``||o||`` per row, from exact quantities only.

    Parameters
    ----------
    w_approx, m2, norm_exact : ndarray (R,) float64
        ``w_A``, ``m2_A`` and ``||w_E o_E||``.
    n_approx : ndarray (R,) int
        Tokens of positive weight in A (0: nothing to draw).
    eps, delta, rule, pilot, pilot_share
        As :func:`choose_split_budgets` (checked there).

    Returns
    -------
    kind : ndarray (R,) int64
        :data:`AUTO_BOUND` (no pilot), :data:`AUTO_EXACT` (read A's values) or
        :data:`AUTO_SAMPLED` (a stratified pilot).
    size : ndarray (R,) int64
        Value rows the pilot reads: 0, ``n_A`` or S0.
    predicted : ndarray (R,) float64
        The predicted total draws (pilot + main, the main's requirement before its
        ceiling) of the way chosen (inf where every way's prediction is; the row then takes
        the largest pilot, below).

    The rule (least predicted total draws). The exact part gives the prediction
    ``||o|| ~ G = ||w_E o_E||`` (``||o|| - G <= w_A sqrt(m2_A)``: close where w_A is small,
    the case this serves; on SmolLM2 heads ``||o|| / G`` has median 1.02, which makes the
    prediction slightly pessimistic, a cost and never a risk). Write

        a = c_m w_A^2 m2_A / (eps^2 G^2)      (main draws if L were G, V_A = m2_A)
        b = w_A sqrt(c_p m2_A) / G            (the pilot's relative width at one draw)

    with ``c_m = c(delta - delta_pilot)`` of ``rule`` and ``c_p = 1 / delta_pilot``. A
    pilot of S0 draws, at its typical outcome ``o_p ~ o_A``, gives ``L ~ G (1 - b /
    sqrt(S0))`` and so costs ``T(S0) = S0 + a / (1 - b / sqrt(S0))^2`` in all. In
    ``x = sqrt(S0)`` this is ``x^2 + a x^2 / (x - b)^2``, convex on ``x > b``, with its
    minimum where ``(x - b)^3 = a b``: ``S0* = (b + (a b)^(1/3))^2``; T restricted to the
    integers is unimodal, so its least value over [1, ``pilot``] is at S0*'s floor or
    ceiling (clipped), and that is the S0 drawn. Both a and b grow with w_A (a as w_A^2, b
    as w_A), so S0* shrinks with w_A, as ``(a b)^(2/3)`` ~ w_A^2 when w_A is small.
    Against it:

    - the bound (no pilot, delta all to the main draws): its requirement exactly (no
      prediction), ``T_0 = c(delta) w_A^2 m2_A / (eps^2 (G - w_A sqrt(m2_A))^2)`` (inf
      where ``G <= w_A sqrt(m2_A)``), which is ``(c(delta) / c_m) a / (1 - b / sqrt(c_p))^2``:
      below ``a < T(S0*)`` once ``b`` is small (``c(delta) < c_m``), so the smallest w_A
      draw no pilot at all;
    - reading A's ``n_A`` values (only where ``n_A <= pilot``): ``T_ex = n_A + (c(delta) /
      c_m) a``, cheaper than any sampled pilot of ``S0 >= n_A``.

    Each is a non-decreasing function of w_A at fixed ``o_E``, ``p_A`` and values, and so is
    their minimum, the predicted total. Ties go to the bound, then to the exact read. Where
    no prediction is finite (no exact part, ``G = 0``, or ``b >= sqrt(pilot)`` with the
    bound void) the row reads A outright if ``n_A <= pilot`` and else takes a pilot of
    ``pilot`` draws (S²ANTA's pilot, with Markov's factor).
    """
    wA = np.asarray(w_approx, dtype=np.float64)
    m2 = np.asarray(m2, dtype=np.float64)
    G = np.asarray(norm_exact, dtype=np.float64)
    nA = np.asarray(n_approx, dtype=np.int64)
    dp = float(pilot_share) * float(delta)
    cp = _pilot_factor(dp, 1.0)
    cm, c0 = tail_factor(rule, float(delta) - dp), tail_factor(rule, float(delta))
    e2 = float(eps) * float(eps)
    var = wA * wA * m2                                   # w_A^2 m2_A: 0 needs one draw
    ok = G > 0
    Gs = np.where(ok, G, 1.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        a = np.where(ok, cm * var / (e2 * Gs * Gs), np.inf)
        b = np.where(ok, wA * np.sqrt(cp * m2) / Gs, np.inf)
        a = np.where(var > 0, a, 0.0)
        b = np.where(var > 0, b, 0.0)
        x = b + np.cbrt(a * b)
        s_opt = np.where(np.isfinite(x), x * x, float(pilot))

        def total(S0):
            r = b / np.sqrt(S0)
            return S0 + np.where(r < 1.0, a / (1.0 - r) ** 2, np.inf)

        cand = [np.clip(np.floor(s_opt), 1, pilot), np.clip(np.ceil(s_opt), 1, pilot)]
        t_cand = [total(s) for s in cand]
        lo = t_cand[1] < t_cand[0]
        s_samp = np.where(lo, cand[1], cand[0])
        t_samp = np.where(lo, t_cand[1], t_cand[0])
        slack = G - wA * np.sqrt(m2)
        t_bound = np.where(var > 0, np.where(slack > 0, c0 * var / (e2 * slack * slack), np.inf),
                           0.0)
        t_exact = np.where(nA <= pilot, nA + (c0 / cm) * a, np.inf)
    T = np.stack([t_bound, t_exact, t_samp])  # in the order AUTO_BOUND, AUTO_EXACT, AUTO_SAMPLED
    kind = np.argmin(T, axis=0).astype(np.int64)  # ties: the first
    predicted = T.min(axis=0)
    void = ~np.isfinite(predicted)
    kind = np.where(void, np.where(nA <= pilot, AUTO_EXACT, AUTO_SAMPLED), kind)
    s_samp = np.where(void, float(pilot), s_samp)
    size = np.select([kind == AUTO_EXACT, kind == AUTO_SAMPLED], [nA, s_samp], 0)
    empty = nA == 0
    kind = np.where(empty, AUTO_BOUND, kind)
    size = np.where(empty, 0, size).astype(np.int64)
    return kind, size, np.where(empty, 0.0, predicted)


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
        Shapes (R,); ``second_moment`` is m2_A, ``norm_sq_lower`` is L^2. Under
        ``norm="auto"`` ``pilot``, ``delta_main`` and ``delta_pilot`` are per row, arrays
        (R,): the value rows read before the main draws (0, ``n_A`` or S0) and the split of
        delta (all to the main draws where no pilot is drawn), so ``cost`` stays
        ``budget + pilot``.
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

    if norm == "auto":
        return _auto(wa, va, pa, m2, we, wA, oe, nonempty, counts, norm2, eps=eps, delta=delta,
                     max_budget=max_budget, rule=rule, pilot=pilot, pilot_share=pilot_share)
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


def _auto(wa, va, pa, m2, we, wA, oe, nonempty, counts, norm2, *, eps, delta, max_budget, rule,
          pilot, pilot_share) -> BudgetChoice:
    """``norm="auto"`` (module docstring, :func:`auto_pilot_plan`): each row's way, then the
    bound of that way."""
    e = we[:, None] * oe
    kind, size, _ = auto_pilot_plan(wA, m2, np.sqrt(norm2(e)), np.count_nonzero(wa > 0, axis=-1),
                                    eps=eps, delta=delta, rule=rule, pilot=pilot,
                                    pilot_share=pilot_share)
    sampled, exact = kind == AUTO_SAMPLED, kind == AUTO_EXACT
    delta_pilot = np.where(sampled, float(pilot_share) * float(delta), 0.0)
    delta_main = float(delta) - delta_pilot
    # The bound (every row; kept where no pilot is drawn).
    var_a = m2.copy()
    L = np.sqrt(norm2(e)) - wA * np.sqrt(m2)
    if sampled.any():
        S0 = np.where(sampled, size, 0)
        k = np.where(sampled, _pilot_factor(float(pilot_share) * float(delta),
                                            np.maximum(S0, 1)), 0.0)
        o_p = np.einsum("rn,rnd->rd", counts(S0, 0), va) / np.maximum(S0, 1)[:, None]
        la = pilot_norm_lower(np.sqrt(norm2(o_p)), m2, k)
        v_p = m2 - la * la
        L_p = np.sqrt(norm2(e + wA[:, None] * o_p)) - wA * np.sqrt(k * np.maximum(v_p, 0.0))
        var_a = np.where(sampled, v_p, var_a)
        L = np.where(sampled, np.maximum(L_p, L), L)  # the bound holds always: keep the larger
    L = np.where(nonempty, np.clip(L, 0.0, None), 0.0)
    L2 = L * L
    if exact.any():  # as norm="oracle" computes them, operation for operation
        o_a = np.einsum("rn,rnd->rd", pa, va)
        var_a = np.where(exact, m2 - norm2(o_a), var_a)
        L2 = np.where(exact, norm2(e + wA[:, None] * o_a), L2)
    c = np.where(sampled, tail_factor(rule, float(delta) - float(pilot_share) * float(delta)),
                 tail_factor(rule, float(delta)))
    S, capped, bound = budgets_from_variance(wA * wA * np.maximum(var_a, 0.0), L2, c, eps,
                                             max_budget, nonempty)
    return BudgetChoice(S, capped, bound, np.where(nonempty, L2, 0.0), m2,
                        np.where(nonempty, size, 0), rule, "auto", delta_main, delta_pilot)
