"""Variance of the GPU SANTA kernels (prop and flash), per sampler, against the exact
formulas of tests/test_santa.py, and the ordering stratified, systematic <= iid.

The CPU suite proves the formulas on the reference (test_variance_ordering_empirical);
here the same statistics run on the CUDA kernels: R = 1000 copies of three instances in
one batch (each batch entry draws from its own Philox row, so the copies are independent
estimates), one call per sampler, a different seed per sampler.

- each sampler's empirical row variance (summed over D) matches the exact variance of the
  estimator on the fp16-rounded inputs (two-sided z on the delta-method standard error);
- stratified <= iid (a theorem) and systematic <= iid (true on these rows: the exact
  formulas give ratios <= 0.82, checked first), one-sided with the same margin as the CPU
  test, z* sqrt(SE_1^2 + SE_2^2).
False-failure rate: 1e-4 per schedule (Bonferroni over 12 rows x 5 comparisons), under the
normal approximation of the variance estimates (R = 1000). The fp16 rounding of the
outputs adds ~5e-6 per row to the variance, against exact variances >= 0.6.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402

from gpu_helpers import to_device, to_host64  # noqa: E402
from stats import z_bound  # noqa: E402
from test_santa import element_variance, llm_like, total_variance  # noqa: E402

pytestmark = pytest.mark.gpu

SAMPLERS = ("iid", "stratified", "systematic")


@pytest.mark.parametrize("schedule, S, tile_size", [("prop", 16, 32), ("flash", 64, 128)])
def test_variance_matches_exact_and_orders_on_gpu(schedule, S, tile_size):
    R = 1000
    batch = [llm_like(s, N=512, D=64) for s in range(3)]
    q, k, v = (to_device(np.concatenate(parts), "float16") for parts in zip(*batch))
    q64, k64, v64 = (to_host64(a) for a in (q, k, v))
    B, Hq = q64.shape[:2]
    kw = dict(budget=S, schedule=schedule, tile_size=tile_size)
    exact = {s: element_variance(q64, k64, v64, None, sampler=s, **kw).sum(axis=-1)
             for s in SAMPLERS}
    assert (exact["stratified"] <= exact["iid"]).all()
    assert (exact["systematic"] <= 0.82 * exact["iid"]).all()
    zstar = z_bound(1e-4, B * Hq * 5)
    qR, kR, vR = (cupy.tile(a, (R,) + (1,) * (a.ndim - 1)) for a in (q, k, v))
    var, se = {}, {}
    for i, s in enumerate(SAMPLERS):
        out = stochattn.santa_attention(qR, kR, vR, sampler=s, seed=7 + i, **kw)
        est = to_host64(out).reshape(R, B, Hq, -1)
        var[s], se[s] = total_variance(est)
        z = np.abs(var[s] - exact[s]) / se[s]
        assert z.max() <= zstar, (f"{schedule} {s}: empirical variance off its exact value, "
                                  f"z = {z.max():.2f} > {zstar:.2f}")
    for s in ("stratified", "systematic"):
        margin = zstar * np.sqrt(se[s] ** 2 + se["iid"] ** 2)
        assert (var[s] <= var["iid"] + margin).all(), f"{schedule} {s} variance above iid"
