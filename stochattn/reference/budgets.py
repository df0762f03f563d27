"""Error-targeted budgets (docs/budgets.md): the smallest S per query head for a tolerance.

The caller gives a relative tolerance ``eps``, a failure probability ``delta`` and a cap
``max_budget``; per (sequence b, query head h) :func:`choose_budgets` picks S so that

    P(||o_hat - o|| > eps ||o||) <= delta,

o the exact attention output and o_hat the S-point SANTA estimate drawn afterwards.

The math
--------
With weights p_j (the softmax) and value rows v_j, one iid draw J ~ p has
E v_J = o and E||v_J - o||^2 = sigma2 = m2 - ||o||^2, where m2 = sum_j p_j ||v_j||^2.
The mean of S iid draws has E||o_hat - o||^2 = sigma2 / S. Stratified sampling never
exceeds it (a theorem); systematic sampling does not in practice (it can, on contrived
rows: tests/test_santa.py::test_systematic_can_exceed_iid); the coverage tests measure both.
m2 needs one float per token, ||v_j||^2, kept beside the cache (``v_sqnorms``) and read with
the logits; ||o||^2 is what no one knows before sampling (below).

Write r2 = sigma2 / ||o||^2 (the relative variance of one draw) and c the rule's tail factor:

- ``rule="chebyshev"``: Markov's inequality on ||o_hat - o||^2 gives
  P(||o_hat - o||^2 > eps^2 ||o||^2) <= sigma2 / (S eps^2 ||o||^2), so c = 1 / delta.
  Safe for every sampler whose mean squared error is at most sigma2 / S.
- ``rule="clt"``: for large S, o_hat - o is close to N(0, Sigma / S), so
  ||o_hat - o||^2 ~ (1/S) sum_i lambda_i Z_i^2 with sum_i lambda_i = tr Sigma = sigma2. Only the
  trace is known, and Szekely & Bakirov (Probab. Theory Relat. Fields 126, 2003) show that
  with E Q = 1 the largest upper tail P(Q > x) of such a Gaussian quadratic form is the
  one-eigenvalue case P(Z^2 > x) whenever x > 1.5364. So c = z_{1 - delta/2}^2, the
  (1 - delta) quantile of chi-square with one degree of freedom (2.71 at delta = 0.1,
  6.63 at delta = 0.01; Chebyshev's 10 and 100), valid for delta <= 0.2 (where the
  quantile is above 1.5364). Asymptotic: the tests check it on generated inputs.

Then S = ceil(c r2 / eps^2), capped at ``max_budget`` (``capped`` reports it) and at least 1.

||o||^2: the modes
-----------------
- ``norm="pilot"`` (the real option): ``pilot`` = S0 stratified draws from p on their own
  stream (purpose :data:`PURPOSE_BUDGET_PILOT`, stream 0, row b * Hq + h, draws 0..S0-1),
  o_p their mean, y = ||o_p||. Their cost counts: a head reads S0 + S value rows. A part
  ``delta_pilot = pilot_share * delta`` of delta goes to the pilot, the rest
  ``delta_main`` to the main draws (union bound: P(fail) <= delta_pilot + delta_main).
  With k = c(delta_pilot) / S0 the pilot's good event is
  ||o_p - o||^2 <= k (m2 - ||o||^2) (Chebyshev or the one-eigenvalue bound again, on the
  S0-point mean, whose mean squared error is at most sigma2 / S0 since the pilot is
  stratified). On it, y <= a + sqrt(k (m2 - a^2)) with a = ||o||, so ||o|| >= L with
  L the smallest a in [0, sqrt m2] where f(a) = a + sqrt(k (m2 - a^2)) reaches y.
  f rises from f(0) = sqrt(k m2) to its maximum sqrt((1 + k) m2) at a = sqrt(m2 / (1 + k)),
  so L = 0 when y <= sqrt(k m2) (the pilot says nothing: S = max_budget, capped), and
  otherwise L is the smaller root of (1 + k) a^2 - 2 y a + y^2 - k m2 = 0. Then
  sigma2 <= m2 - L^2 and ||o||^2 >= L^2 give S = ceil(c(delta_main) (m2 - L^2) / (eps^2 L^2)).
  The main draws are independent of the pilot (another purpose), so given the pilot the
  main estimate keeps its fixed-S law: a head with S draws what a fixed-S call draws.
- ``norm="student"`` (a studentised pilot, docs/budgets.md): the ``pilot`` draws split in
  two stratified sets on purpose :data:`PURPOSE_BUDGET_PILOT`, row b * Hq + h: A, S_A =
  max(1, pilot // 4) draws on stream 1, and B, S_B = pilot - S_A draws on stream 2. A gives a
  direction u = o_A / ||o_A||; given A, u is fixed and ||o|| >= u . o, and u . o is the mean
  of the scalar u . v_J under p, which B estimates by its mean t_B with spread s_B (the
  sample standard deviation of u . v over B's draws).
  L = max(0, t_B - max(z s_B / sqrt(S_B), 2 vmax / S_B)), clipped at sqrt(m2), with
  z = z_{1 - delta_pilot} under either rule and vmax = max_j ||v_j|| over the sequence (from
  the per-token ||v_j||^2): the range guard covers heads whose draws show little spread (one
  token of mass 1 - 1e-4: every draw on it, s_B = 0, yet the tokens missed move u . o by up
  to their mass times the range of u . v; a stratified set misses less than a stratum's mass
  1 / S_B there). The error allowed is the
  spread along u only, not the whole sigma2 as in ``"pilot"``: on real heads the value
  variance is spread over many directions, so L is much tighter at equal draws. The price:
  the bound is asymptotic whichever rule (s_B is estimated; a one-sided studentised mean),
  so its level is checked empirically (tests/test_budget_norms.py). Then S as for the
  pilot. Needs ``pilot`` >= 4.
- ``norm="oracle"``: the exact ||o||^2 from v (``v`` read in full). NOT an estimator option:
  it is the upper bound of what any ||o|| handling can reach (the tests use it to measure
  what the pilot costs and to catch a budget formula that drifts above the optimum).

Everything is float64. The functions take validated NumPy arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..budget_rules import (CLT_MAX_DELTA, NORMS, RULES, check_options, student_split,
                            student_z, tail_factor)
from .common import kv_head_of, lengths, logits, masked_weights
from .rng import uniforms

__all__ = [
    "RULES",
    "NORMS",
    "PURPOSE_BUDGET_PILOT",
    "CLT_MAX_DELTA",
    "BudgetChoice",
    "tail_factor",
    "value_sqnorms",
    "second_moments",
    "pilot_norm_lower",
    "student_norm_lower",
    "student_split",
    "sampler_counts",
    "check_options",
    "choose_budgets",
    "budgets_from_moments",
    "budgets_from_variance",
    "pilot_size",
    "santa_attention_targeted",
]

# The pilot's draws: purpose 4 of the shared stream (stochattn.spec, docs/rng.md).
from ..spec import PURPOSE_BUDGET_PILOT  # noqa: E402


@dataclass(frozen=True)
class BudgetChoice:
    """Budgets chosen by :func:`choose_budgets` and what they rest on, per (b, h).

    Attributes
    ----------
    budget : ndarray of int64, shape (B, Hq)
        S of the main draws (0 for empty sequences).
    capped : ndarray of bool, shape (B, Hq)
        The rule asked for more than ``max_budget`` (or could not bound ||o||): the
        guarantee does not hold for this head; ``error_bound`` says what does.
    error_bound : ndarray of float64, shape (B, Hq)
        The relative tolerance the chosen S guarantees at ``delta`` under the rule:
        sqrt(c (m2 - L^2) / (S L^2)) (<= eps unless capped; inf when L = 0; 0 for empty
        sequences).
    norm_sq_lower : ndarray of float64, shape (B, Hq)
        L^2, the lower bound of ||o||^2 used (the exact ||o||^2 under ``norm="oracle"``).
    second_moment : ndarray of float64, shape (B, Hq)
        m2 = sum_j p_j ||v_j||^2.
    pilot : int, or ndarray of int64, shape (B, Hq)
        Pilot draws per head (0 under ``norm="oracle"``); their cost counts. Per head (an
        array) under Double-P's ``norm="auto"``
        (:func:`stochattn.reference.split_budgets.choose_split_budgets`), which sizes each
        head's pilot, or draws none.
    rule, norm : str
    delta_main, delta_pilot : float, or ndarray of float64, shape (B, Hq)
        How delta was split (per head under ``norm="auto"``).
    """

    budget: np.ndarray
    capped: np.ndarray
    error_bound: np.ndarray
    norm_sq_lower: np.ndarray
    second_moment: np.ndarray
    pilot: int | np.ndarray
    rule: str
    norm: str
    delta_main: float | np.ndarray
    delta_pilot: float | np.ndarray

    @property
    def cost(self) -> np.ndarray:
        """Value rows drawn per head, pilot included: budget + pilot (0 for empty rows)."""
        return self.budget + self.pilot * (self.second_moment > 0)


def value_sqnorms(v) -> np.ndarray:
    """||v_j||^2 per token, float64 (B, Hkv, N): the one float per token kept beside the cache."""
    v64 = np.asarray(v, dtype=np.float64)
    return np.einsum("bknd,bknd->bkn", v64, v64)


def second_moments(w: np.ndarray, v_sqnorms: np.ndarray) -> np.ndarray:
    """m2 = sum_j p_j ||v_j||^2 per (b, h), float64 (B, Hq), from weights w (B, Hq, N) >= 0
    (unnormalised; rows of zeros give 0) and ``v_sqnorms`` (B, Hkv, N)."""
    B, Hq, N = w.shape
    Hkv = v_sqnorms.shape[1]
    G = Hq // Hkv
    # Each KV head's norms are read once for its G query heads (the GQA view of logits()).
    num = np.einsum("bkgn,bkn->bkg", w.reshape(B, Hkv, G, N),
                    np.asarray(v_sqnorms, dtype=np.float64)).reshape(B, Hq)
    z = w.sum(axis=-1)
    return np.divide(num, z, out=np.zeros_like(num), where=z > 0)


def sampler_counts(w: np.ndarray, sampler: str, S, uniform) -> np.ndarray:
    """Per-token draw counts of the stratified or systematic sampler, in O(N) per row.

    Equal, count for count, to ``bincount(invert_cdf(w, sample_points(sampler, S, ...)))``
    when ``uniform`` returns the stream's uniforms, at a cost independent of S (the pilot
    and the coverage tests need S up to 1e7). Token j is selected by the points with
    C_{j-1} <= T_m Z < C_j (C the running sum of w, Z = C_{N-1}), so its count is
    n(C_j) - n(C_{j-1}) with n(c) = #{m : T_m Z < c}; points at or past Z go to the last
    positive-weight token, as in invert_cdf. T_m Z is non-decreasing in m, and
    T_m Z < c  <=>  m + u_m < S c / Z  up to rounding, so n(c) = m0 + [T_{m0} Z < c] with
    m0 = floor(S c / Z): one uniform per token. The predicate is always evaluated exactly
    as invert_cdf does, ((m + u) / S) * Z < c; the neighbours m0 - 1 (assumed below) and
    m0 + 1 (assumed above) are evaluated too where S c / Z lies within 1e-6 of an integer,
    the only places where rounding could move them (u is in [2**-24, 1 - 2**-24]).

    Parameters
    ----------
    w : ndarray of float64, shape (R, N)
        Non-negative weights; rows with zero total get zero counts.
    sampler : {"stratified", "systematic"}
    S : int or int ndarray (R,)
    uniform : callable (i, m) -> ndarray of float64
        The uniform of row i for stratum m (stratified) or the row's one uniform
        (systematic: ``m`` is then ignored); ``i`` and ``m`` are int64 arrays of one shape.

    Returns
    -------
    ndarray of int64, shape (R, N)
    """
    R, N = w.shape
    S = np.broadcast_to(np.asarray(S, dtype=np.int64), (R,))
    c = np.cumsum(w, axis=-1)  # the running mass, as invert_cdf forms it (same adds, same bits)
    Z = c[:, -1]
    ok = Z > 0
    Zs = np.where(ok, Z, 1.0)
    Sf = S[:, None].astype(np.float64)
    pos = Sf * c / Zs[:, None]  # S c / Z: where each boundary falls among the strata
    m0 = np.clip(np.floor(pos), 0, S[:, None]).astype(np.int64)
    frac = pos - m0
    rows = np.broadcast_to(np.arange(R)[:, None], c.shape)

    def below(m, where):
        """[T_m Z < c] at the entries ``where`` with 0 <= m < S, else 0."""
        hit = np.zeros(c.shape, dtype=bool)
        sel = where & (m >= 0) & (m < S[:, None])
        if sel.any():
            mm = m[sel]
            u = uniform(rows[sel], mm) if sampler == "stratified" else uniform(rows[sel], 0 * mm)
            hit[sel] = ((mm + u) / S[rows[sel]]) * Zs[rows[sel]] < c[sel]
        return hit

    if sampler not in ("stratified", "systematic"):
        raise ValueError(f"`sampler` must be 'stratified' or 'systematic', got {sampler!r}")
    every = np.ones(c.shape, dtype=bool)
    near_low, near_high = frac < 1e-6, frac > 1.0 - 1e-6
    # n = (m0 - 1 if m0 - 1 is below) + [m0 below] + [m0 + 1 below]; all m < m0 - 1 are below.
    n = (np.maximum(m0 - 1, 0) + np.where(near_low, below(m0 - 1, near_low), m0 >= 1)
         + below(m0, every) + below(m0 + 1, near_high))
    n = np.minimum(n, S[:, None])
    counts = np.diff(n, axis=-1, prepend=0)
    # Points at or past Z: invert_cdf gives them the last positive-weight token.
    last = np.where(ok, N - 1 - np.argmax((w > 0)[:, ::-1], axis=-1), 0)
    counts[np.arange(R), last] += S - n[:, -1]
    return np.where(ok[:, None], counts, 0)


def philox_uniform(seed, offset, purpose: int, rows: np.ndarray, heads: int, stream: int = 0):
    """The ``uniform`` of :func:`sampler_counts` for the shared stream: row ``rows[i]``,
    stream ``stream``, draw m."""
    def uniform(i, m):
        return uniforms(seed, offset, purpose, rows[i], stream, m, heads=heads)
    return uniform


def pilot_norm_lower(y: np.ndarray, m2: np.ndarray, k: float) -> np.ndarray:
    """L = the smallest a in [0, sqrt m2] with a + sqrt(k (m2 - a^2)) >= y (see the module
    docstring); 0 when y <= sqrt(k m2). Elementwise, float64.

    The smaller root of (1 + k) a^2 - 2 y a + (y^2 - k m2) = 0 is written
    (y^2 - k m2) / (y + sqrt(k ((1 + k) m2 - y^2))) (the product of the roots over the larger
    root), which has no cancellation when y is just above sqrt(k m2) and L is small. When
    y exceeds max f = sqrt((1 + k) m2) the pilot's good event has failed whatever ||o|| is
    (probability <= delta_pilot); L is then the maximiser sqrt(m2 / (1 + k)).
    """
    y2 = y * y
    disc = np.maximum(k * ((1.0 + k) * m2 - y2), 0.0)  # clipped: y past max f, see above
    with np.errstate(divide="ignore", invalid="ignore"):
        root = (y2 - k * m2) / (y + np.sqrt(disc))
    root = np.where(y2 > (1.0 + k) * m2, np.sqrt(m2 / (1.0 + k)), root)
    return np.where(y2 > k * m2, root, 0.0)


def student_norm_lower(counts_a: np.ndarray, counts_b: np.ndarray, v: np.ndarray, m2: np.ndarray,
                       z: float, vmax: np.ndarray) -> np.ndarray:
    """L of ``norm="student"`` (module docstring), float64 (B, Hq).

    ``counts_a``, ``counts_b`` (B, Hq, N): per-token draw counts of the two pilot sets
    (each row sums to S_A, S_B, or 0 for empty rows); ``v`` (B, Hkv, N, D) float64;
    ``vmax`` (B, Hq): the largest ||v_j|| over the tokens of positive weight (from the
    per-token ||v_j||^2, no V read). The spread is formed centred,
    sum_j c_j (u . v_j - t_B)^2 / (S_B - 1), not as a difference of second moments (which
    cancels when the values agree along u). The width is
    max(z s_B / sqrt(S_B), 2 vmax / S_B): the second, one stratum's range, guards the sets
    whose draws show little spread (below).
    """
    B, Hq, N = counts_a.shape
    Hkv = v.shape[1]
    G = Hq // Hkv
    ca = counts_a.reshape(B, Hkv, G, N).astype(np.float64)
    cb = counts_b.reshape(B, Hkv, G, N).astype(np.float64)
    sa = ca.sum(-1)
    sb = cb.sum(-1)
    o_a = np.einsum("bkgn,bknd->bkgd", ca, v) / np.maximum(sa, 1.0)[..., None]
    na = np.sqrt(np.einsum("bkgd,bkgd->bkg", o_a, o_a))
    u = o_a / np.where(na > 0, na, 1.0)[..., None]
    proj = np.einsum("bkgd,bknd->bkgn", u, v)                       # u . v_j per token
    t = np.einsum("bkgn,bkgn->bkg", cb, proj) / np.maximum(sb, 1.0)
    dev = proj - t[..., None]
    s2 = np.einsum("bkgn,bkgn->bkg", cb, dev * dev) / np.maximum(sb - 1.0, 1.0)
    # The width is the larger of the studentised one and one stratum's range of u . v
    # (|u . v_j| <= vmax, so the range is <= 2 vmax): a set whose draws show little spread
    # (a head with one token of mass 1 - 1e-4: every draw on it, s_B = 0) still errs by up
    # to the mass it missed times the range, and a stratified set misses less than a
    # stratum's mass 1 / S_B where it shows no spread.
    width = np.maximum(z * np.sqrt(s2 / np.maximum(sb, 1.0)),
                       2.0 * vmax.reshape(B, Hkv, G) / np.maximum(sb, 1.0))
    L = t - width
    # u . o <= ||o|| <= sqrt(m2) (Jensen); o_A = 0 gives no direction: L = 0.
    L = np.where((na > 0) & (sb > 1), np.clip(L, 0.0, None), 0.0).reshape(B, Hq)
    return np.minimum(L, np.sqrt(m2))


def pilot_size(eps: float, delta: float, rule: str, budget: int, pilot_share: float = 0.25,
               tightness: float = 25.0) -> int:
    """A pilot size S0 for heads whose oracle budget is about ``budget``.

    The pilot's bound is L ~ ||o|| (1 - sqrt(c_p (1 + r2) / S0)) (c_p = c(delta_pilot)), and
    the main budget grows as (m2 - L^2) / L^2, so S0 = ``tightness`` c_p (1 + r2) keeps L
    near 0.8 ||o|| (``tightness`` 25) and the main budget within about 1.6x of the
    oracle's. With r2 = budget eps^2 / c_m (the oracle budget's relative variance), that is
    S0 = tightness eps^2 (c_p / c_m) budget (+ tightness c_p). A head needing less pays the
    pilot anyway (it is fixed per call, which is what keeps the call graph-capturable); a
    head needing much more gets a looser L.
    """
    dp = pilot_share * delta
    cp, cm = tail_factor(rule, dp), tail_factor(rule, delta - dp)
    return int(math.ceil(tightness * cp * (eps * eps * budget / cm + 1.0)))


def budgets_from_moments(m2, L2, c: float, eps: float, max_budget: int, nonempty):
    """S, capped and the error bound per head from m2, the bound L^2 of ||o||^2 and the tail
    factor c (float64 arrays of one shape; ``nonempty``: the rows with tokens):
    S = min(max_budget, max(1, ceil(c (m2 - L^2) / (eps^2 L^2)))), the rule of
    :func:`choose_budgets`, which the GPU's santa_prop_budgets computes with the same
    float64 operations in the same order."""
    # sigma2 <= m2 - L^2 (equality under the oracle). m2 - ||o||^2 loses about 1e-16 m2 to
    # cancellation when the row is nearly deterministic; clipped at 0, S = 1 there.
    return budgets_from_variance(np.maximum(m2 - L2, 0.0), L2, c, eps, max_budget, nonempty)


def budgets_from_variance(var, L2, c: float, eps: float, max_budget: int, nonempty):
    """:func:`budgets_from_moments` from a bound ``var`` >= 0 of the estimate's variance
    times S (``m2 - L^2`` for S²ANTA; ``w_A^2 V_A`` when part of the output is exact,
    :mod:`.split_budgets`): S = min(max_budget, max(1, ceil(c var / (eps^2 L^2))))."""
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.where(L2 > 0, c * var / (eps * eps * L2), np.inf)  # float: may be inf
        need = np.where(var > 0, need, 1.0)  # every draw equals o: one is enough
    # Compare in float before converting: inf and 1e30 must not pass through int64.
    capped = nonempty & (need > max_budget)
    S = np.where(capped, max_budget, np.maximum(np.ceil(np.minimum(need, max_budget)), 1.0))
    S = np.where(nonempty, S, 0).astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.where(var > 0, np.sqrt(c * var / (np.maximum(S, 1) * L2)), 0.0)
    bound = np.where(nonempty, np.where((L2 > 0) | (var == 0), bound, np.inf), 0.0)
    return S, capped, bound


def choose_budgets(x: np.ndarray, v_sqnorms: np.ndarray, v, *, eps: float, delta: float,
                   max_budget: int, rule: str = "chebyshev", norm: str = "pilot",
                   pilot: int = 64, pilot_share: float = 0.25, seed=0, offset=0) -> BudgetChoice:
    """Per-head S with P(||o_hat - o|| > eps ||o||) <= delta (module docstring for the math).

    Parameters
    ----------
    x : ndarray of float64, shape (B, Hq, N)
        Logits, -inf past each sequence (:func:`.common.logits`).
    v_sqnorms : ndarray, shape (B, Hkv, N)
        ||v_j||^2 per token (:func:`value_sqnorms`); entries past a sequence are ignored.
    v : ndarray, shape (B, Hkv, N, D)
        Value cache: the pilot gathers ``pilot`` rows per head from it; ``norm="oracle"``
        reads it all.
    eps : float
        Relative tolerance, > 0.
    delta : float
        Failure probability per head, in (0, 1); <= 0.2 with ``rule="clt"``.
    max_budget : int
        Cap on S (>= 1). Capped heads are reported in ``capped``.
    rule : {"chebyshev", "clt"}
    norm : {"pilot", "student", "oracle"}
        How ||o||^2 is handled: ``"pilot"`` (default) the worst-case pilot bound,
        ``"student"`` the studentised pilot (asymptotic; much tighter on real heads);
        ``"oracle"`` uses the exact output and is a yardstick, not an estimator option.
    pilot : int
        S0, pilot draws per head (``norm="pilot"`` or ``"student"``; >= 4 for the latter).
    pilot_share : float
        Part of delta spent on the pilot's bound, in (0, 1). 0.25 gave lower total costs
        than 0.5 on the test pool (docs/budgets.md).
    seed, offset : int or integer ndarray (B,)
        Stream of the pilot (purpose :data:`PURPOSE_BUDGET_PILOT`), as for the estimators.

    Returns
    -------
    BudgetChoice
    """
    check_options(eps, delta, max_budget, rule, norm, pilot, pilot_share)
    B, Hq, N = x.shape
    w, _ = masked_weights(x)  # exp(x - max): the softmax up to its normaliser
    z = w.sum(axis=-1)
    nonempty = z > 0
    m2 = second_moments(w, v_sqnorms)
    kv = kv_head_of(Hq, v.shape[1])
    v64 = np.asarray(v, dtype=np.float64)
    if norm == "oracle":
        delta_main, delta_pilot, S0 = float(delta), 0.0, 0
        o = np.einsum("bhn,bhnd->bhd", w, v64[:, kv]) / np.where(nonempty, z, 1.0)[..., None]
        L2 = np.einsum("bhd,bhd->bh", o, o)
    elif norm == "student":
        delta_pilot = float(pilot_share) * float(delta)
        delta_main = float(delta) - delta_pilot
        S0 = int(pilot)
        sa, sb = student_split(S0)
        rows = np.arange(B)[:, None] * Hq + np.arange(Hq)[None, :]
        counts = [sampler_counts(w.reshape(B * Hq, N), "stratified", s,
                                 philox_uniform(seed, offset, PURPOSE_BUDGET_PILOT,
                                                rows.reshape(-1), Hq, stream=stream)
                                 ).reshape(B, Hq, N)
                  for s, stream in ((sa, 1), (sb, 2))]
        sqv = np.asarray(v_sqnorms, dtype=np.float64)[:, kv]              # (B, Hq, N)
        vmax = np.sqrt(np.where(w > 0, sqv, 0.0).max(axis=-1, initial=0.0))
        L = student_norm_lower(counts[0], counts[1], v64, m2, student_z(delta_pilot), vmax)
        L2 = L * L
    else:
        delta_pilot = float(pilot_share) * float(delta)
        delta_main = float(delta) - delta_pilot
        S0 = int(pilot)
        rows = np.arange(B)[:, None] * Hq + np.arange(Hq)[None, :]
        # The pilot's S0 stratified draws as per-token counts (O(N) whatever S0): the same
        # draws as invert_cdf of the S0 points; o_p = counts . V / S0 (the mean of the S0
        # gathered rows up to rounding).
        counts = sampler_counts(w.reshape(B * Hq, N), "stratified", S0,
                                philox_uniform(seed, offset, PURPOSE_BUDGET_PILOT,
                                               rows.reshape(-1), Hq)).reshape(B, Hq, N)
        G = Hq // v.shape[1]
        o_p = np.einsum("bkgn,bknd->bkgd", counts.reshape(B, v.shape[1], G, N).astype(np.float64),
                        v64).reshape(B, Hq, -1) / S0
        y = np.sqrt(np.einsum("bhd,bhd->bh", o_p, o_p))
        L = pilot_norm_lower(y, m2, tail_factor(rule, delta_pilot) / S0)
        L2 = L * L
    c = tail_factor(rule, delta_main)
    S, capped, bound = budgets_from_moments(m2, L2, c, eps, max_budget, nonempty)
    return BudgetChoice(S, capped, bound, np.where(nonempty, L2, 0.0), m2, S0, rule, norm,
                        delta_main, delta_pilot)


def santa_attention_targeted(q, k, v, seq_lens, scale: float, *, eps: float, delta: float,
                             max_budget: int, rule: str = "chebyshev", norm: str = "pilot",
                             pilot: int = 64, pilot_share: float = 0.25, sampler: str,
                             schedule: str, tile_size: int, seed, offset, v_sqnorms=None):
    """Choose per-head budgets, then run :func:`.santa.santa_attention_per_head` with them.

    ``v_sqnorms`` (B, Hkv, N) defaults to :func:`value_sqnorms` of ``v``. Exact scores only
    (the rule needs the softmax the draws come from). Returns ``(SantaResult, BudgetChoice)``.
    """
    from .santa import santa_attention_per_head  # santa does not import this module

    B, Hq, _ = q.shape
    lens = lengths(seq_lens, B, k.shape[2])
    x = logits(q, k, lens, scale)
    sq = value_sqnorms(v) if v_sqnorms is None else v_sqnorms
    choice = choose_budgets(x, sq, v, eps=eps, delta=delta, max_budget=max_budget, rule=rule,
                            norm=norm, pilot=pilot, pilot_share=pilot_share, seed=seed,
                            offset=offset)
    res = santa_attention_per_head(q, k, v, seq_lens, scale, budget=choice.budget,
                                   sampler=sampler, schedule=schedule, tile_size=tile_size,
                                   seed=seed, offset=offset)
    return res, choice
