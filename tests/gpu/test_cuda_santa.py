"""GPU S²ANTA-prop (stochattn/cuda/santa_prop.cu) against the NumPy reference.

- indices: equal to ``reference.santa.prop_indices`` (which equals sample_points +
  invert_cdf on the float64 weights) on >= 99.9% of draws; they can differ only where a
  point falls within fp32 rounding of a CDF boundary (the kernel's logits are fp32);
- output: equal, to one rounding of the output dtype, to the float64 mean of the V rows
  the kernel says it sampled;
- unbiasedness: tests/stats.assert_unbiased over many independent Philox rows
  (false-failure rate 1e-6 per call, stated there).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn.cuda import config  # noqa: E402
from stochattn.cuda.santa import KERNELS, santa_prop  # noqa: E402
from stochattn.reference import santa as ref_santa  # noqa: E402
from stochattn.reference.common import lengths, logits  # noqa: E402
from stochattn.reference.exact import exact_attention as ref_exact  # noqa: E402

from stats import assert_unbiased  # noqa: E402
from gpu_helpers import peaked_inputs, to_device, to_host, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu

_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # one ulp at 1.0 of the output dtype


def _run(dtype, B, Hkv, G, N, D, S, sampler, tile_size, lens, *, seed, offset=7, temp=2.0,
         num_chunks=None, kernel=None):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed % 2**32, temp=temp)
    qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
    q64, k64, v64 = to_host64(qd), to_host64(kd), to_host64(vd)
    lens_arr = None if lens is None else np.asarray(lens, dtype=np.int32)
    out, idx = santa_prop(qd, kd, vd, lens_arr, budget=S, sampler=sampler, tile_size=tile_size,
                          seed=seed, offset=offset, return_indices=True, num_chunks=num_chunks,
                          kernel=kernel)
    got, J = to_host64(out), to_host(idx).astype(np.int64)
    scale = 1.0 / math.sqrt(D)
    x = logits(q64, k64, lengths(lens_arr, B, N), scale)
    J_ref, _, _ = ref_santa.prop_indices(x, sampler, S, tile_size, seed=seed, offset=offset)
    return q64, k64, v64, lens_arr, got, J, J_ref


def _assert_indices_and_output(dtype, v64, lens_arr, got, J, J_ref, Hq):
    B, N = v64.shape[0], v64.shape[2]
    full = lengths(lens_arr, B, N)
    nonempty = full > 0
    same = (J == J_ref)[nonempty]
    assert same.size == 0 or same.mean() >= 0.999, f"only {same.mean():.5f} of indices match"
    mism = same.size - int(same.sum())
    assert mism <= max(0, int(0.001 * same.size)), f"{mism} of {same.size} indices differ"
    # Indices lie in the sequence and are sorted along S (sorted points).
    for b in np.flatnonzero(nonempty):
        assert J[b].min() >= 0 and J[b].max() < full[b]
        assert np.all(np.diff(J[b], axis=-1) >= 0)
    # Output = float64 mean of the sampled rows, rounded once to the output dtype.
    want = ref_santa.gather_mean(v64, np.where(nonempty[:, None, None], J, 0), Hq)
    want[~nonempty] = 0.0
    eps = _EPS[dtype]
    np.testing.assert_allclose(got, want, rtol=eps, atol=eps * 1e-2 + 1e-6)
    assert np.all(got[~nonempty] == 0.0)
    assert np.all(J[~nonempty] == 0)


kernels = pytest.mark.parametrize("kernel", KERNELS)  # pass 1: CUDA cores, tensor cores


@kernels
@pytest.mark.parametrize("sampler", ["systematic", "stratified", "iid"])
@pytest.mark.parametrize("S,tile_size", [(1, 64), (7, 32), (256, 64), (2048, 256), (300, 128)])
@pytest.mark.parametrize("D", [64, 128])
def test_prop_indices_match_reference(sampler, S, tile_size, D, kernel):
    dtype = "float16"
    B, Hkv, G, N = 2, 2, 4, 1000 + D // 64  # N not a multiple of any tile
    q64, k64, v64, lens, got, J, J_ref = _run(dtype, B, Hkv, G, N, D, S, sampler, tile_size, None,
                                              seed=1234 + S + D, kernel=kernel)
    _assert_indices_and_output(dtype, v64, lens, got, J, J_ref, Hkv * G)


@kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("num_chunks", [None, 1, 5])
def test_prop_seq_lens_groups_dtypes(dtype, G, num_chunks, kernel):
    """Lengths 0 (zero row, indices 0), 1 (every index 0), N < tile, odd N."""
    lens = [0, 1, 37, 517]
    q64, k64, v64, lens_arr, got, J, J_ref = _run(dtype, 4, 2, G, 517, 128, 256, "systematic", 64,
                                                  lens, seed=99 + G, num_chunks=num_chunks,
                                                  kernel=kernel)
    _assert_indices_and_output(dtype, v64, lens_arr, got, J, J_ref, 2 * G)
    assert np.all(J[1] == 0)
    np.testing.assert_allclose(got[1], np.broadcast_to(v64[1, np.arange(2 * G) // G, 0], got[1].shape),
                               rtol=_EPS[dtype], atol=1e-6)


@kernels
def test_prop_large_logits(kernel):
    """|logits| ~ 1e4: max shift keeps the CDF finite; indices still match."""
    q64, k64, v64, lens, got, J, J_ref = _run("float16", 1, 2, 4, 400, 64, 128, "systematic", 64,
                                              None, seed=5, temp=400.0, kernel=kernel)
    assert np.isfinite(got).all()
    _assert_indices_and_output("float16", v64, lens, got, J, J_ref, 8)


def test_prop_deterministic_and_offset_changes_draws():
    q, k, v = peaked_inputs(2, 2, 4, 800, 128, seed=3, temp=1.0)
    qd, kd, vd = (to_device(a, "float16") for a in (q, k, v))
    a = santa_prop(qd, kd, vd, budget=64, seed=42, offset=1, return_indices=True)
    b = santa_prop(qd, kd, vd, budget=64, seed=42, offset=1, return_indices=True)
    c = santa_prop(qd, kd, vd, budget=64, seed=42, offset=2, return_indices=True)
    assert bool((a[0] == b[0]).all()) and bool((a[1] == b[1]).all()), "same seed must be bit-identical"
    assert not bool((a[1] == c[1]).all()), "a new offset must give new draws"


@pytest.mark.parametrize("tiling", config.PROP_TC_TILINGS[1:], ids=lambda t: t.label())
@pytest.mark.parametrize("tile_size", [32, 256])
def test_prop_tc_tilings_match_reference(tiling, tile_size):
    """The non-default tensor-core tilings (tuning) on odd lengths and forced chunks."""
    prev = config.set_config(prop_tc_tiling=tiling)
    try:
        lens = [0, 1, 37, 1517]
        q64, k64, v64, lens_arr, got, J, J_ref = _run("bfloat16", 4, 2, 4, 1517, 128, 300, "iid",
                                                      tile_size, lens, seed=7, num_chunks=3,
                                                      kernel="tc")
    finally:
        config.set_config(config=prev)
    _assert_indices_and_output("bfloat16", v64, lens_arr, got, J, J_ref, 8)


@pytest.mark.parametrize("sampler", ["systematic", "stratified", "iid"])
def test_prop_unbiased_on_gpu(sampler):
    """Mean over R = 600 independent rows (batch entries holding the same sequence; each
    row has its own Philox stream) equals the exact output. False-failure rate 1e-6."""
    R, Hkv, G, N, D, S = 600, 1, 2, 150, 64, 4
    q1, k1, v1 = peaked_inputs(1, Hkv, G, N, D, seed=17, temp=1.5)
    q, k, v = (np.repeat(a, R, axis=0) for a in (q1, k1, v1))
    qd, kd, vd = (to_device(a, "float16") for a in (q, k, v))
    out = to_host64(santa_prop(qd, kd, vd, budget=S, sampler=sampler, tile_size=32, seed=2024))
    q64, k64, v64 = (to_host64(a)[:1] for a in (qd, kd, vd))
    truth = ref_exact(q64, k64, v64, None, 1.0 / math.sqrt(D))[0]
    assert_unbiased(out, truth, alpha=1e-6, what=f"GPU santa_prop ({sampler})")


def test_prop_validation_messages():
    q = cupy.zeros((1, 4, 64), dtype=cupy.float16)
    k = cupy.zeros((1, 2, 10, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match="`tile_size` must be one of"):
        santa_prop(q, k, k, budget=4, tile_size=48)
    with pytest.raises(ValueError, match="`budget` must be >= 1"):
        santa_prop(q, k, k, budget=0)
    with pytest.raises(ValueError, match="`budget` must be at most 2\\*\\*30 on the GPU"):
        santa_prop(q, k, k, budget=2**30 + 1)
    with pytest.raises(ValueError, match="`sampler` must be one of"):
        santa_prop(q, k, k, budget=4, sampler="gumbel")
    with pytest.raises(ValueError, match="`seed` must lie in"):
        santa_prop(q, k, k, budget=4, seed=-1)
    with pytest.raises(ValueError, match="`kernel` must be one of 'simt', 'tc' or None, got 'x'"):
        santa_prop(q, k, k, budget=4, kernel="x")
    with pytest.raises(ValueError, match="needs scores='exact'"):
        santa_prop(q, k, k, budget=4, kernel="tc", scores="bernoulli")
