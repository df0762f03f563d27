// The scalar rules of error-targeted budgets on the device, one home each, in the NumPy
// reference's operations and order (stochattn/reference/budgets.py, split_budgets.py): every
// operation rounded once (the _rn intrinsics keep nvcc from contracting a * b + c into an
// FMA), so a row's result is the bits NumPy computes from the same float64 inputs.
// Host-compilable (tests/test_doublep_budgets_host.py builds it with a host C++ compiler and
// checks it against the reference bit for bit): with STOCHATTN_HD defined as `inline` and
// <cmath> included first, the operations are the host's IEEE ones.
#pragma once

#ifndef STOCHATTN_HD
#define STOCHATTN_HD __host__ __device__ __forceinline__
#endif

namespace stochattn {

#ifdef __CUDA_ARCH__
STOCHATTN_HD double rn_add(double a, double b) { return __dadd_rn(a, b); }
STOCHATTN_HD double rn_sub(double a, double b) { return __dsub_rn(a, b); }
STOCHATTN_HD double rn_mul(double a, double b) { return __dmul_rn(a, b); }
STOCHATTN_HD double rn_div(double a, double b) { return __ddiv_rn(a, b); }
STOCHATTN_HD double rn_sqrt(double a) { return __dsqrt_rn(a); }
STOCHATTN_HD double inf_f64() { return __longlong_as_double(0x7ff0000000000000ll); }
#else
STOCHATTN_HD double rn_add(double a, double b) { return a + b; }
STOCHATTN_HD double rn_sub(double a, double b) { return a - b; }
STOCHATTN_HD double rn_mul(double a, double b) { return a * b; }
STOCHATTN_HD double rn_div(double a, double b) { return a / b; }
STOCHATTN_HD double rn_sqrt(double a) { return std::sqrt(a); }
STOCHATTN_HD double inf_f64() { return HUGE_VAL; }
#endif

// pilot_norm_lower: the L with ||o|| >= L on the pilot's good event, from y = ||o_p||, m2
// and k = c(delta_pilot) / S0 (the smaller root, written without cancellation; past the
// largest value of the bound the maximiser sqrt(m2 / (1 + k))).
STOCHATTN_HD double pilot_norm_lower(double y, double m2, double k) {
  const double yy = rn_mul(y, y);
  const double kp1 = rn_add(1.0, k);
  const double km2 = rn_mul(k, m2);
  const double disc = fmax(rn_mul(k, rn_sub(rn_mul(kp1, m2), yy)), 0.0);
  double root = rn_div(rn_sub(yy, km2), rn_add(y, rn_sqrt(disc)));
  if (yy > rn_mul(kp1, m2)) root = rn_sqrt(rn_div(m2, kp1));
  return yy > km2 ? root : 0.0;
}

struct RowBudget {
  int S;
  bool capped;
  double bound;
};

// budgets_from_variance for one non-empty row: S = min(max_budget, max(1, ceil(c var /
// (eps^2 L^2)))) compared in float64 before any int conversion, the capped flag and the
// error bound sqrt(c var / (S L^2)). `var` bounds the estimate's variance times S
// (m2 - L^2 for S²ANTA, w_A^2 V_A for Double-P's sampled variant).
STOCHATTN_HD RowBudget budget_from_variance(double var, double L2, double c, double eps,
                                            int max_budget) {
  const double cvar = rn_mul(c, var);
  double need = L2 > 0.0 ? rn_div(cvar, rn_mul(rn_mul(eps, eps), L2)) : inf_f64();
  if (!(var > 0.0)) need = 1.0;  // every draw equals o: one is enough
  RowBudget r;
  r.capped = need > (double)max_budget;  // float compare: inf never meets an int
  r.S = r.capped ? max_budget : (int)fmax(ceil(fmin(need, (double)max_budget)), 1.0);
  r.bound = var > 0.0 ? rn_sqrt(rn_div(cvar, rn_mul((double)(r.S > 1 ? r.S : 1), L2))) : 0.0;
  if (!(L2 > 0.0 || var == 0.0)) r.bound = inf_f64();
  return r;
}

// The ways of Double-P's norm "auto" (reference/split_budgets.py AUTO_BOUND, AUTO_EXACT,
// AUTO_SAMPLED).
enum SplitWay { SPLIT_WAY_BOUND = 0, SPLIT_WAY_EXACT = 1, SPLIT_WAY_SAMPLED = 2 };

// auto_pilot_plan's T(S0) = S0 + a / (1 - b / sqrt(S0))^2 (inf where b / sqrt(S0) >= 1).
STOCHATTN_HD double auto_total(double S0, double a, double b) {
  const double r = rn_div(b, rn_sqrt(S0));
  const double om = rn_sub(1.0, r);
  return rn_add(S0, r < 1.0 ? rn_div(a, rn_mul(om, om)) : inf_f64());
}

struct AutoChoice {
  int way;
  long long size;
};

// auto_pilot_plan for one row from w_A, m2_A, G = ||w_E o_E|| and n_A: the way of least
// predicted total draws (ties to the bound, then the exact read) and the value rows it reads
// before the main draws. c_main = c(delta - delta_pilot), c_full = c(delta), cp =
// 1 / delta_pilot. cbrt is the platform's (CUDA's is within 1 ulp; it moves S0 only where
// s_opt lies within that of an integer).
STOCHATTN_HD AutoChoice auto_pilot_choice(double wA, double m2, double G, long long nA,
                                          double eps, double c_main, double c_full, double cp,
                                          int pilot) {
  const double e2 = rn_mul(eps, eps);
  const double var = rn_mul(rn_mul(wA, wA), m2);
  const bool ok = G > 0.0;
  double a = ok ? rn_div(rn_mul(c_main, var), rn_mul(rn_mul(e2, G), G)) : inf_f64();
  double b = ok ? rn_div(rn_mul(wA, rn_sqrt(rn_mul(cp, m2))), G) : inf_f64();
  if (!(var > 0.0)) {
    a = 0.0;
    b = 0.0;
  }
  const double x = rn_add(b, cbrt(rn_mul(a, b)));
  const double P = (double)pilot;
  const double s_opt = isfinite(x) ? rn_mul(x, x) : P;
  const double f0 = fmin(fmax(floor(s_opt), 1.0), P), f1 = fmin(fmax(ceil(s_opt), 1.0), P);
  const double t0 = auto_total(f0, a, b), t1 = auto_total(f1, a, b);
  const bool lo = t1 < t0;
  double s_samp = lo ? f1 : f0;
  const double t_samp = lo ? t1 : t0;
  const double slack = rn_sub(G, rn_mul(wA, rn_sqrt(m2)));
  const double t_bound =
      var > 0.0 ? (slack > 0.0 ? rn_div(rn_mul(c_full, var), rn_mul(rn_mul(e2, slack), slack))
                               : inf_f64())
                : 0.0;
  const double t_exact = nA <= (long long)pilot
                             ? rn_add((double)nA, rn_mul(rn_div(c_full, c_main), a))
                             : inf_f64();
  int way = SPLIT_WAY_BOUND;  // argmin, ties to the first
  double best = t_bound;
  if (t_exact < best) { way = SPLIT_WAY_EXACT; best = t_exact; }
  if (t_samp < best) { way = SPLIT_WAY_SAMPLED; best = t_samp; }
  if (!isfinite(best)) {  // no finite prediction: read A if it fits, else the largest pilot
    way = nA <= (long long)pilot ? SPLIT_WAY_EXACT : SPLIT_WAY_SAMPLED;
    s_samp = P;
  }
  AutoChoice c;
  c.way = nA == 0 ? SPLIT_WAY_BOUND : way;
  c.size = nA == 0 ? 0
                   : (way == SPLIT_WAY_EXACT ? nA
                                             : (way == SPLIT_WAY_SAMPLED ? (long long)s_samp : 0));
  return c;
}

// Double-P's norms on the device (stochattn/cuda/doublep.py SPLIT_NORMS_GPU, in order).
enum SplitNorm { SPLIT_NORM_PILOT = 0, SPLIT_NORM_BOUND = 1, SPLIT_NORM_AUTO = 2 };

struct SplitBound {
  double var;  // w_A^2 max(V_A, 0): the estimate's variance bound times S
  double L2;   // L^2 <= ||o||^2
  double c;    // the tail factor of the main draws
};

// choose_split_budgets' (variance bound, L^2, c) of one row with C_approx, by its way, from
// the row's scalars and the squared norms the kernel reduces over d:
//   bound:   L = G - w_A sqrt(m2_A), V_A = m2_A, c = c(delta);
//   sampled: k = k_pilot (norm "pilot") or inv_dp / S0 (norm "auto", S0 = `size`),
//            L_A = pilot_norm_lower(sqrt(y2), m2_A, k), V_A = m2_A - L_A^2,
//            L = sqrt(q2) - w_A sqrt(k max(V_A, 0)) (under "auto" at least the bound's L),
//            c = c(delta - delta_pilot);  y2 = ||o_p||^2, q2 = ||w_E o_E + w_A o_p||^2;
//   exact:   V_A = m2_A - a2, L^2 = l2, c = c(delta);  a2 = ||o_A||^2,
//            l2 = ||w_E o_E + w_A o_A||^2;
// L clipped at 0 before squaring (not the exact read's L^2, as the reference).
STOCHATTN_HD SplitBound split_bound(int norm, int way, double wA, double m2, double G,
                                    long long size, double y2, double q2, double a2, double l2,
                                    double c_main, double c_full, double k_pilot, double inv_dp) {
  const double L_bound = rn_sub(G, rn_mul(wA, rn_sqrt(m2)));
  double L = L_bound, var_a = m2, c = c_full, L2;
  if (way == SPLIT_WAY_SAMPLED) {
    const double k = norm == SPLIT_NORM_AUTO ? rn_div(inv_dp, (double)(size > 1 ? size : 1))
                                             : k_pilot;
    const double la = pilot_norm_lower(rn_sqrt(y2), m2, k);
    var_a = rn_sub(m2, rn_mul(la, la));
    const double Lp = rn_sub(rn_sqrt(q2), rn_mul(wA, rn_sqrt(rn_mul(k, fmax(var_a, 0.0)))));
    L = norm == SPLIT_NORM_AUTO ? fmax(Lp, L_bound) : Lp;
    c = c_main;
  }
  if (way == SPLIT_WAY_EXACT) {
    var_a = rn_sub(m2, a2);
    L2 = l2;
  } else {
    L = fmax(L, 0.0);
    L2 = rn_mul(L, L);
  }
  SplitBound r;
  r.var = rn_mul(rn_mul(wA, wA), fmax(var_a, 0.0));
  r.L2 = L2;
  r.c = c;
  return r;
}

}  // namespace stochattn
