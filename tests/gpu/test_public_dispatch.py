"""The public functions route GPU arrays to the CUDA kernels and give the caller's type back."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn.cuda import exact_decode, flash_diagnostics, santa_flash, santa_prop  # noqa: E402

from gpu_helpers import peaked_inputs  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs(B=2, Hkv=2, G=4, N=300, D=64, seed=3):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed, temp=2.0)
    return (cupy.asarray(q, dtype=cupy.float16), cupy.asarray(k, dtype=cupy.float16),
            cupy.asarray(v, dtype=cupy.float16))


def test_exact_attention_on_cupy_equals_the_kernel():
    q, k, v = _inputs()
    lens = np.array([300, 17], dtype=np.int32)
    out = stochattn.exact_attention(q, k, v, lens)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16
    assert bool((out == exact_decode(q, k, v, lens)).all())


def test_santa_attention_on_cupy_equals_the_kernel_and_reports_rows_read():
    q, k, v = _inputs()
    lens = np.array([300, 0], dtype=np.int32)
    out, diag = stochattn.santa_attention(q, k, v, lens, budget=32, seed=5, offset=2,
                                          return_diagnostics=True)
    direct, idx = santa_prop(q, k, v, lens, budget=32, seed=5, offset=2, return_indices=True)
    assert bool((out == direct).all())
    idx = cupy.asnumpy(idx)
    expected = [len(np.unique(idx[0, h * 4:(h + 1) * 4])) for h in range(2)]
    assert diag.v_rows_read[0].tolist() == expected
    assert diag.v_rows_read[1].tolist() == [0, 0]  # empty sequence reads nothing
    assert diag.k_rows_read.tolist() == [[300, 300], [0, 0]]


def test_santa_attention_on_torch_returns_torch():
    torch = pytest.importorskip("torch")
    q, k, v = _inputs()
    tq, tk, tv = (torch.from_dlpack(x).to(torch.bfloat16) for x in (q, k, v))
    out = stochattn.santa_attention(tq, tk, tv, budget=16, seed=1)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_cuda


def test_santa_attention_flash_on_cupy_equals_the_kernel_with_waste():
    q, k, v = _inputs()
    lens = np.array([300, 0], dtype=np.int32)
    out, diag = stochattn.santa_attention(q, k, v, lens, budget=32, schedule="flash", seed=5,
                                          offset=2, return_diagnostics=True)
    direct, idx, stats = santa_flash(q, k, v, lens, budget=32, seed=5, offset=2,
                                     return_indices=True, return_tile_stats=True)
    assert bool((out == direct).all())
    idx = cupy.asnumpy(idx)
    expected = [len(np.unique(g[g >= 0])) for g in idx[0].reshape(2, -1)]
    assert diag.v_rows_read[0].tolist() == expected and diag.v_rows_read[1].tolist() == [0, 0]
    samples, waste = flash_diagnostics(stats, 32)
    assert np.array_equal(diag.samples_per_tile, samples)
    assert np.array_equal(diag.sample_waste, waste) and diag.sample_waste[1].tolist() == [0.0] * 8


def test_santa_attention_bernoulli_dispatches_to_prop():
    q, k, v = _inputs()
    lens = np.array([300, 0], dtype=np.int32)
    out, diag = stochattn.santa_attention(q, k, v, lens, budget=32, scores="bernoulli",
                                          bernoulli_draws=3, seed=5, offset=2,
                                          return_diagnostics=True)
    direct, idx, frac = santa_prop(q, k, v, lens, budget=32, seed=5, offset=2, scores="bernoulli",
                                   bernoulli_draws=3, return_indices=True,
                                   return_feature_fraction=True)
    assert bool((out == direct).all())
    assert np.array_equal(diag.k_feature_fraction, cupy.asnumpy(frac).astype(np.float64))


@pytest.mark.parametrize("kwargs, what", [
    (dict(schedule="global"), r"schedule='global'"),
    (dict(scores="bernoulli", schedule="flash"), r"the Bernoulli score stage with schedule='flash'"),
])
def test_missing_gpu_paths_say_what_is_missing(kwargs, what):
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match=rf"`santa_attention` has no CUDA kernel yet \({what}"):
        stochattn.santa_attention(q, k, v, budget=8, **kwargs)


def test_unchecked_gpu_seq_lens_are_clamped_not_read_out_of_bounds():
    q, k, v = _inputs(N=64)
    bad = cupy.asarray([1000, -5], dtype=cupy.int32)   # outside [0, N], not checked
    good = cupy.asarray([64, 0], dtype=cupy.int32)
    assert bool((exact_decode(q, k, v, bad) == exact_decode(q, k, v, good)).all())
    assert bool((santa_prop(q, k, v, bad, budget=8, seed=1)
                 == santa_prop(q, k, v, good, budget=8, seed=1)).all())
