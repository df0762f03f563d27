"""The exact reference against a direct float64 softmax, and every input check.

The direct computation below is written with loops and no shared helper, so that a bug in
stochattn.reference.common cannot hide in both. Every error message of
stochattn/_validation.py and stochattn/_backend.py is pinned through the public
exact_attention where it can be reached, and by calling the check directly where no
exact_attention input reaches it (checks of parameters exact_attention does not have).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stochattn._validation as val
from stochattn.exact import exact_attention

from strategies import decode_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def direct_attention(q, k, v, seq_lens, scale):
    """o[b, h] = sum_j softmax(scale q.k_j)_j v_j by plain loops in float64."""
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = np.zeros((B, Hq, D))
    for b in range(B):
        L = N if seq_lens is None else int(seq_lens[b])
        for h in range(Hq):
            if L == 0:
                continue
            g = h // G
            x = []
            for j in range(L):
                dot = 0.0
                for d in range(D):
                    dot += float(q[b, h, d]) * float(k[b, g, j, d])
                x.append(scale * dot)
            m = max(x)
            w = [math.exp(xj - m) for xj in x]
            z = sum(w)
            for d in range(D):
                out[b, h, d] = sum(w[j] * float(v[b, g, j, d]) for j in range(L)) / z
    return out


# ----------------------------------------------------------------------------- values


@settings(max_examples=60)
@given(decode_inputs(min_len=0, max_tokens=120), st.one_of(st.none(), st.floats(0.01, 3.0)))
def test_exact_matches_direct_softmax(inputs, softmax_scale):
    """Hypothesis inputs with GQA (group 1-4), seq_lens (empty sequences included) and a
    spread of peakedness; float64 agreement to 1e-10 relative."""
    q, k, v, seq_lens = inputs
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    out = exact_attention(q, k, v, seq_lens, softmax_scale=softmax_scale)
    np.testing.assert_allclose(out, direct_attention(q, k, v, seq_lens, scale),
                               rtol=1e-10, atol=1e-12)


def test_float16_inputs_with_logits_near_1e4_do_not_overflow():
    """q = k = 60 in 64 dims: the raw dot product 230400 overflows float16 (max 65504) and
    the logits (28800 - 7.5 delta_j) overflow exp in any precision without the max shift.
    Key perturbations give logit gaps of 0.47 to 1.9, so the softmax is not one-hot."""
    D, N = 64, 6
    q = np.full((1, 1, D), 60.0, dtype=np.float16)
    k = np.full((1, 1, N, D), 60.0, dtype=np.float16)
    k[0, 0, :, 0] -= np.array([0.0, 0.0625, 0.125, 0.25, 0.0625, 0.03125], dtype=np.float16)
    v = np.random.default_rng(0).standard_normal((1, 1, N, D)).astype(np.float16)
    with np.errstate(all="raise"):
        out = exact_attention(q, k, v)
    assert out.dtype == np.float16 and np.isfinite(out).all()
    expect = direct_attention(q, k, v, None, 1 / 8)
    assert abs(expect).max() > 0.1  # several tokens share the mass: a real check
    np.testing.assert_allclose(out.astype(np.float64), expect, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_float64_logits_of_plus_minus_1e4(sign):
    """Logits sign * 1e4 - j: exp would overflow (sign +) or underflow to 0/0 (sign -)
    without the max shift; the answer is softmax(-j)."""
    N = 8
    q = np.array([[[sign * 100.0]]])
    k = (100.0 - sign * 0.01 * np.arange(N)).reshape(1, 1, N, 1)
    v = np.arange(N, dtype=np.float64).reshape(1, 1, N, 1)
    with np.errstate(all="raise"):
        out = exact_attention(q, k, v, softmax_scale=1.0)
    w = np.exp(-np.arange(N) * 1.0)
    x_direct = direct_attention(q, k, v, None, 1.0)
    np.testing.assert_allclose(out[0, 0, 0], (w * np.arange(N)).sum() / w.sum(), rtol=1e-9)
    np.testing.assert_allclose(out, x_direct, rtol=1e-9)


def test_empty_sequence_gives_exact_zero_row_without_warnings():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 4, 8))
    k = rng.standard_normal((3, 2, 10, 8))
    v = rng.standard_normal((3, 2, 10, 8))
    with np.errstate(all="raise"):
        out, diag = exact_attention(q, k, v, np.array([0, 10, 0], dtype=np.int64),
                                    return_diagnostics=True)
    assert (out[0] == 0).all() and (out[2] == 0).all() and (np.abs(out[1]) > 0).any()
    assert diag.k_rows_read.tolist() == [[0, 0], [10, 10], [0, 0]]
    assert diag.true_mass.tolist() == [[0.0] * 4, [1.0] * 4, [0.0] * 4]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_output_dtype_is_input_dtype(dtype):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, 33, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 33, 16)).astype(dtype)
    out = exact_attention(q, k, v, np.array([5, 33], dtype=np.uint16))
    assert out.dtype == dtype and out.shape == (2, 4, 16)
    expect = direct_attention(q, k, v, [5, 33], 0.25)
    tol = {np.float16: 1e-3, np.float32: 1e-6, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), expect, rtol=tol, atol=tol)


def test_import_does_not_import_cupy_or_numba(tmp_path):
    """Fake cupy/numba packages are put first on the path, so that an eager import would
    succeed and show up in sys.modules even on a machine without them. Besides
    ``import stochattn``, every module outside ``stochattn.cuda`` is imported too."""
    for name in ("cupy", "cupyx", "numba", "numba_cuda"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    code = textwrap.dedent("""
        import sys
        import importlib, pkgutil
        import stochattn
        before = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx', 'numba', 'numba_cuda'))
        print('AFTER_INIT', before)
        for mod in pkgutil.walk_packages(stochattn.__path__, 'stochattn.'):
            if not mod.name.startswith('stochattn.cuda'):
                importlib.import_module(mod.name)
        bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx', 'numba', 'numba_cuda'))
        print('LOADED', bad)
        assert stochattn.__file__.startswith(sys.argv[1]), stochattn.__file__
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    res = subprocess.run([sys.executable, "-c", code, REPO], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "AFTER_INIT []" in res.stdout, res.stdout
    assert "LOADED []" in res.stdout, res.stdout


# ----------------------------------------------------------------------------- errors


class FakeCPUTensor:
    """A CPU tensor of another library (PyTorch-like): has __dlpack__, lives on the CPU."""

    def __dlpack__(self, stream=None):  # pragma: no cover - never called
        raise AssertionError

    def __dlpack_device__(self):
        return (1, 0)


class FakeGPUTensor(FakeCPUTensor):
    def __dlpack_device__(self):
        return (2, 0)


class FakeOpenCLTensor(FakeCPUTensor):
    def __dlpack_device__(self):
        return (4, 0)


FakeCupyArray = type("ndarray", (), {"__module__": "cupy._core.core"})


def _ok(B=1, Hq=2, Hkv=1, N=6, D=4, dtype=np.float64):
    rng = np.random.default_rng(3)
    return (rng.standard_normal((B, Hq, D)).astype(dtype),
            rng.standard_normal((B, Hkv, N, D)).astype(dtype),
            rng.standard_normal((B, Hkv, N, D)).astype(dtype))


def _nan(where, value=np.nan):
    q, k, v = _ok()
    arrays = {"q": q, "k": k, "v": v}
    arrays[where].flat[3] = value
    return arrays["q"], arrays["k"], arrays["v"]


q0, k0, v0 = _ok()
z = np.zeros

VALUE_ERRORS = [
    # shapes
    ((z((2, 4)), k0, v0), {}, r"`q` must have 3 dimensions \(batch, q_heads, head_dim\), got shape \(2, 4\)"),
    ((q0, z((1, 6, 4)), v0), {}, r"`k` must have 4 dimensions \(batch, kv_heads, seq, head_dim\), got shape \(1, 6, 4\)"),
    ((q0, k0, z((1, 1, 1, 6, 4))), {}, r"`v` must have 4 dimensions \(batch, kv_heads, seq, head_dim\), got shape \(1, 1, 1, 6, 4\)"),
    ((q0, k0, z((1, 1, 5, 4))), {}, r"`v` must have the shape of `k` \(1, 1, 6, 4\), got \(1, 1, 5, 4\)"),
    ((q0, z((2, 1, 6, 4)), z((2, 1, 6, 4))), {}, r"`k` must have batch 1 \(from `q`\), got 2"),
    ((q0, z((1, 1, 6, 8)), z((1, 1, 6, 8))), {}, r"`k` must have head_dim 4 \(from `q`\), got 8"),
    ((z((0, 2, 4)), z((0, 1, 6, 4)), z((0, 1, 6, 4))), {}, r"`q` and `k` must have non-zero batch, heads and head_dim, got q \(0, 2, 4\) and k \(0, 1, 6, 4\)"),
    ((z((1, 2, 4)), z((1, 0, 6, 4)), z((1, 0, 6, 4))), {}, r"`q` and `k` must have non-zero batch, heads and head_dim"),
    ((z((1, 3, 4)), z((1, 2, 6, 4)), z((1, 2, 6, 4))), {}, r"`q` heads must be a multiple of `k` heads \(GQA\), got Hq=3 and Hkv=2"),
    ((q0, z((1, 1, 0, 4)), z((1, 1, 0, 4))), {}, r"`k` must hold at least one token \(seq axis 2\), got shape \(1, 1, 0, 4\)"),
    # seq_lens
    ((q0, k0, v0, np.array([3, 3])), {}, r"`seq_lens` must have shape \(1,\), got \(2,\)"),
    ((q0, k0, v0, np.array([[3]])), {}, r"`seq_lens` must have shape \(1,\), got \(1, 1\)"),
    ((q0, k0, v0, np.array([-1])), {}, r"`seq_lens` values must lie in \[0, 6\] \(the seq axis of `k`\), got min -1 and max -1"),
    ((q0, k0, v0, np.array([7])), {}, r"`seq_lens` values must lie in \[0, 6\] \(the seq axis of `k`\), got min 7 and max 7"),
    # softmax_scale
    ((q0, k0, v0), {"softmax_scale": 0.0}, r"`softmax_scale` must be finite and > 0, got 0.0"),
    ((q0, k0, v0), {"softmax_scale": -0.5}, r"`softmax_scale` must be finite and > 0, got -0.5"),
    ((q0, k0, v0), {"softmax_scale": float("inf")}, r"`softmax_scale` must be finite and > 0, got inf"),
    ((q0, k0, v0), {"softmax_scale": float("nan")}, r"`softmax_scale` must be finite and > 0, got nan"),
    # check_finite
    (_nan("q"), {"check_finite": True}, r"`q` must hold only finite values \(check_finite=True\), got NaN or inf"),
    (_nan("k"), {"check_finite": True}, r"`k` must hold only finite values \(check_finite=True\), got NaN or inf"),
    (_nan("v", np.inf), {"check_finite": True}, r"`v` must hold only finite values \(check_finite=True\), got NaN or inf"),
]


@pytest.mark.parametrize("args, kwargs, match", VALUE_ERRORS)
def test_value_errors_are_pinned(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        exact_attention(*args, **kwargs)


TYPE_ERRORS = [
    # dtypes
    ((q0.astype(np.int64), k0, v0), {}, r"`q` dtype must be one of float16, float32, float64, got int64"),
    ((q0, k0.astype(np.complex128), v0), {}, r"`k` dtype must be one of float16, float32, float64, got complex128"),
    ((q0, k0, v0.astype(object)), {}, r"`v` dtype must be one of float16, float32, float64, got object"),
    ((q0.astype(np.float32), k0, v0), {}, r"`q`, `k` and `v` must share one dtype, got float32, float64 and float64"),
    ((q0, k0, v0.astype(np.float16)), {}, r"`q`, `k` and `v` must share one dtype, got float64, float64 and float16"),
    ((q0, k0, v0, np.array([3.0])), {}, r"`seq_lens` must have an integer dtype, got float64"),
    ((q0, k0, v0, np.array([True])), {}, r"`seq_lens` must have an integer dtype, got bool"),
    ((q0, k0, v0), {"softmax_scale": "0.5"}, r"`softmax_scale` must be a real number, got str"),
    ((q0, k0, v0), {"softmax_scale": True}, r"`softmax_scale` must be a real number, got bool"),
    # types and devices (_backend)
    ((q0.tolist(), k0, v0), {}, r"`q` must be a NumPy array, a CuPy array or a GPU array with `__dlpack__`, got list"),
    ((q0, k0, v0, [3]), {}, r"`seq_lens` must be a NumPy array, a CuPy array or a GPU array with `__dlpack__`, got list"),
    ((q0, 1.5, v0), {}, r"`k` must be a NumPy array, a CuPy array or a GPU array with `__dlpack__`, got float"),
    ((q0, k0, FakeCPUTensor()), {}, r"`v` is a CPU FakeCPUTensor; pass NumPy arrays for the CPU reference"),
    ((FakeOpenCLTensor(), k0, v0), {}, r"`q` must be a NumPy array, a CuPy array or a GPU array with `__dlpack__`, got FakeOpenCLTensor"),
    ((FakeGPUTensor(), k0, v0), {}, r"all arrays must live on one device, got `q` on GPU, `k` on host \(NumPy\), `v` on host \(NumPy\)"),
    ((q0, k0, v0, FakeGPUTensor()), {}, r"all arrays must live on one device, got `q` on host \(NumPy\), `k` on host \(NumPy\), `v` on host \(NumPy\), `seq_lens` on GPU"),
]


@pytest.mark.parametrize("args, kwargs, match", TYPE_ERRORS)
def test_type_errors_are_pinned(args, kwargs, match):
    with pytest.raises(TypeError, match=match):
        exact_attention(*args, **kwargs)


@pytest.mark.parametrize("make", [FakeGPUTensor, FakeCupyArray])
def test_gpu_arrays_raise_not_implemented_naming_the_function(make):
    from stochattn.baselines import top_p_attention

    with pytest.raises(NotImplementedError,
                       match=r"`top_p_attention` has no CUDA kernel yet \(.*\); pass NumPy arrays "
                             r"to run the reference implementation"):
        top_p_attention(make(), make(), make(), p=0.9)


def test_gpu_arrays_without_cupy_name_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(ImportError, match=r"`exact_attention` got GPU arrays, and the CUDA backend "
                                          r"needs CuPy: install stochattn\[cuda13\]"):
        exact_attention(FakeGPUTensor(), FakeGPUTensor(), FakeGPUTensor())


# Checks that no input of exact_attention reaches (exact_attention has no such parameter,
# or _backend rejects the input first); pinned here on the checks themselves.
DIRECT_ERRORS = [
    (lambda: val.check_attention_inputs([1.0], k0, v0), TypeError, r"`q` must be an array, got list"),
    (lambda: val.check_seq_lens([3], 1, 6), TypeError, r"`seq_lens` must be an integer array, got list"),
    (lambda: val.check_positive_int("n_clusters", 0), ValueError, r"`n_clusters` must be >= 1, got 0"),
    (lambda: val.check_positive_int("n_clusters", 2.0), TypeError, r"`n_clusters` must be an integer, got float"),
    (lambda: val.check_nonnegative_int("window", -1), ValueError, r"`window` must be >= 0, got -1"),
    (lambda: val.check_nonnegative_int("window", "4"), TypeError, r"`window` must be an integer, got str"),
    (lambda: val.check_budget("budget", 0), ValueError, r"`budget` must be >= 1, got 0"),
    (lambda: val.check_budget("budget", False), TypeError, r"`budget` must be an integer, got bool"),
    (lambda: val.check_probability("p1", 0.0), ValueError, r"`p1` must lie in \(0, 1\], got 0.0"),
    (lambda: val.check_probability("p1", 1.5), ValueError, r"`p1` must lie in \(0, 1\], got 1.5"),
    (lambda: val.check_probability("p1", None), TypeError, r"`p1` must be a real number, got NoneType"),
    (lambda: val.check_choice("sampler", "sobol", ("iid", "systematic")), ValueError,
     r"`sampler` must be one of 'iid', 'systematic', got 'sobol'"),
    (lambda: val.check_seed_offset(-1, 0), ValueError, r"`seed` must lie in \[0, 2\*\*64\), got -1"),
    (lambda: val.check_seed_offset(2**64, 0), ValueError, r"`seed` must lie in \[0, 2\*\*64\), got 18446744073709551616"),
    (lambda: val.check_seed_offset(1.0, 0), TypeError, r"`seed` must be an integer, got float"),
    (lambda: val.check_seed_offset(0, 2**32), ValueError, r"`offset` must lie in \[0, 2\*\*32\), got 4294967296"),
    (lambda: val.check_seed_offset(0, "0"), TypeError, r"`offset` must be an integer, got str"),
    (lambda: val.check_bool("group_shared", 1), TypeError, r"`group_shared` must be a bool, got int"),
    # check_score_inputs (functions without v): its own dtype message, then the shared checks
    (lambda: val.check_score_inputs(q0.astype(np.float32), k0), TypeError,
     r"`q` and `k` must share one dtype, got float32 and float64"),
    (lambda: val.check_score_inputs(z((1, 3, 4)), z((1, 2, 6, 4))), ValueError,
     r"`q` heads must be a multiple of `k` heads \(GQA\), got Hq=3 and Hkv=2"),
    # check_kv_inputs (prefill / append: the cache alone)
    (lambda: val.check_kv_inputs([1.0], v0), TypeError, r"`k` must be an array, got list"),
    (lambda: val.check_kv_inputs(k0, z((1, 6, 4))), ValueError,
     r"`v` must have 4 dimensions \(batch, kv_heads, seq, head_dim\), got shape \(1, 6, 4\)"),
    (lambda: val.check_kv_inputs(k0, z((1, 1, 5, 4))), ValueError,
     r"`v` must have the shape of `k` \(1, 1, 6, 4\), got \(1, 1, 5, 4\)"),
    (lambda: val.check_kv_inputs(z((1, 0, 6, 4)), z((1, 0, 6, 4))), ValueError,
     r"`k` must have non-zero batch, heads and head_dim, got shape \(1, 0, 6, 4\)"),
    (lambda: val.check_kv_inputs(z((1, 1, 0, 4)), z((1, 1, 0, 4))), ValueError,
     r"`k` must hold at least one token \(seq axis 2\), got shape \(1, 1, 0, 4\)"),
    (lambda: val.check_kv_inputs(k0.astype(np.int32), v0), TypeError,
     r"`k` dtype must be one of float16, float32, float64, got int32"),
    (lambda: val.check_kv_inputs(k0, v0.astype(np.float32)), TypeError,
     r"`k` and `v` must share one dtype, got float64 and float32"),
    (lambda: val.check_kv_inputs(k0, v0, np.array([9])), ValueError,
     r"`seq_lens` values must lie in \[0, 6\] \(the seq axis of `k`\), got min 9 and max 9"),
]


@pytest.mark.parametrize("call, exc, match", DIRECT_ERRORS)
def test_generic_checks_are_pinned(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_valid_edge_inputs_are_accepted():
    """Boundary values that must pass: seq_lens 0 and N, unsigned seq_lens, numpy scalars."""
    assert val.check_seed_offset(2**64 - 1, 2**32 - 1) == (2**64 - 1, 2**32 - 1)
    assert val.check_probability("p", 1) == 1.0
    assert val.check_positive_int("n", np.int32(3)) == 3
    assert val.check_bool("flag", np.bool_(True)) is True
    out = exact_attention(q0, k0, v0, np.array([6], dtype=np.uint8), softmax_scale=np.float32(0.5))
    assert out.shape == q0.shape


def test_gpu_budget_limits_are_pinned():
    """The GPU kernels count draws in int32: budgets above 2**30 (S²ANTA-flash: 2**27, its
    G * S_t draws of a tile share one counter) get a clear error before any launch."""
    from stochattn.cuda.runtime import inputs as _inputs
    from stochattn.cuda.flash import FLASH_MAX_BUDGET

    assert _inputs.check_gpu_budget(2**30) == 2**30
    assert 8 * FLASH_MAX_BUDGET + 64 <= 2**31 - 1
    with pytest.raises(ValueError, match=r"`budget` must be at most 2\*\*30 on the GPU, got "
                                         r"1073741825"):
        _inputs.check_gpu_budget(2**30 + 1)
    with pytest.raises(ValueError, match=r"`budget` must be at most 2\*\*27 on the GPU"):
        _inputs.check_gpu_budget(FLASH_MAX_BUDGET + 1, FLASH_MAX_BUDGET)
    with pytest.raises(ValueError, match="`budget` must be >= 1"):
        _inputs.check_gpu_budget(0)
