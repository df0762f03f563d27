"""GPU Bernoulli qK^T as the score stage of S²ANTA-prop (stochattn/cuda/bernoulli.cuh and
santa_prop_logits<..., QHAT = true>) against the NumPy reference.

- the kept features are the reference's bit for bit (same Philox stream, exact float64
  decision), so the per-head feature fractions are asserted equal exactly;
- indices: equal to ``reference.santa.prop_indices`` on the reference's Bernoulli logits on
  >= 99.9% of draws (fp32 logits here, float64 there: only points within rounding of a
  CDF boundary may move), for token-major and feature-major K;
- output: the float64 mean of the V rows the kernel says it sampled, to one rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn.cuda.santa import santa_prop  # noqa: E402
from stochattn.reference import santa as ref_santa  # noqa: E402
from stochattn.reference.bernoulli import estimate_scores  # noqa: E402
from stochattn.reference.common import lengths  # noqa: E402

from gpu_helpers import peaked_inputs, to_device, to_host, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu

_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def _feature_major(kd, pad_to=8):
    """(B, Hkv, D, L) copy of k (CuPy or torch) with L = N rounded up to a multiple of
    ``pad_to``; the padding holds NaN, which must never be read."""
    B, Hkv, N, D = kd.shape
    L = -(-N // pad_to) * pad_to
    if type(kd).__module__.split(".")[0] == "torch":
        out = kd.new_full((B, Hkv, D, L), float("nan"))
        out[..., :N] = kd.transpose(2, 3)
        return out
    out = cupy.full((B, Hkv, D, L), cupy.nan, dtype=kd.dtype)
    out[..., :N] = kd.transpose(0, 1, 3, 2)
    return out


def _check(dtype, B, Hkv, G, N, D, S, sampler, tile_size, lens, draws, shared, fm, seed):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed, temp=2.0)
    qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
    q64, k64, v64 = to_host64(qd), to_host64(kd), to_host64(vd)
    lens_arr = None if lens is None else np.asarray(lens, dtype=np.int32)
    kfm = _feature_major(kd) if fm else None
    out, idx, frac = santa_prop(qd, kd, vd, lens_arr, budget=S, sampler=sampler,
                                tile_size=tile_size, seed=seed, offset=3, return_indices=True,
                                scores="bernoulli", bernoulli_draws=draws,
                                bernoulli_group_shared=shared, k_feature_major=kfm,
                                return_feature_fraction=True)
    full = lengths(lens_arr, B, N)
    s_hat, frac_ref = estimate_scores(q64, k64, full, draws=draws, group_shared=shared,
                                      seed=seed, offset=3)
    np.testing.assert_array_equal(to_host(frac).astype(np.float64), frac_ref)
    x = (1.0 / math.sqrt(D)) * s_hat
    J_ref, _, _ = ref_santa.prop_indices(x, sampler, S, tile_size, seed=seed, offset=3)
    J = to_host(idx).astype(np.int64)
    nonempty = full > 0
    same = (J == J_ref)[nonempty]
    assert same.size == 0 or same.mean() >= 0.999, f"only {same.mean():.5f} of indices match"
    want = ref_santa.gather_mean(v64, np.where(nonempty[:, None, None], J, 0), Hkv * G)
    want[~nonempty] = 0.0
    eps = _EPS[dtype]
    np.testing.assert_allclose(to_host64(out), want, rtol=eps, atol=eps * 1e-2 + 1e-6)
    return frac_ref


@pytest.mark.parametrize("fm", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("D,G", [(64, 1), (128, 4), (128, 3), (64, 8)])
def test_bernoulli_prop_matches_reference(fm, shared, D, G):
    frac = _check("float16", 2, 2, G, 1003, D, 256, "systematic", 64, None, 4, shared, fm,
                  seed=11 + D + G)
    assert 0.0 < frac.mean() < 1.0  # the test exercises skipped features


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fm", [False, True])
def test_bernoulli_prop_seq_lens_and_samplers(dtype, fm):
    for sampler in ("stratified", "iid"):
        _check(dtype, 4, 2, 4, 777, 128, 64, sampler, 32, [777, 0, 1, 100], 2, False, fm, seed=5)


def test_bernoulli_many_draws_reads_every_nonzero_feature():
    # With many draws every feature with q_j != 0 is kept with probability ~1: the fraction
    # is the reference's, and the output approaches the exact-score prop.
    frac = _check("float16", 1, 2, 4, 512, 64, 128, "systematic", 64, None, 64, True, True, seed=9)
    assert frac.min() > 0.9


def test_bernoulli_validation_messages():
    q = cupy.zeros((1, 4, 64), dtype=cupy.float16)
    k = cupy.zeros((1, 1, 100, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match="k_feature_major"):
        santa_prop(q, k, k, budget=4, k_feature_major=cupy.zeros((1, 1, 64, 100), cupy.float16))
    with pytest.raises(ValueError, match="multiple of 8"):
        santa_prop(q, k, k, budget=4, scores="bernoulli",
                   k_feature_major=cupy.zeros((1, 1, 64, 100), cupy.float16))
    with pytest.raises(ValueError, match="scores"):
        santa_prop(q, k, k, budget=4, scores="ternary")
    with pytest.raises(ValueError, match="bernoulli_draws"):
        santa_prop(q, k, k, budget=4, scores="bernoulli", bernoulli_draws=0)
