"""JAX GPU arrays through DLPack: every estimator takes them zero-copy and hands back JAX
arrays, equal bit for bit to a CuPy call on the same buffers (same kernels, same draws)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with CuPy
cupy = pytest.importorskip("cupy")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import stochattn  # noqa: E402

from gpu_helpers import peaked_inputs  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


def _inputs(gpu, dtype, B=2, Hkv=2, G=4, N=700, D=64, seed=5):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed, temp=2.0)
    return tuple(jax.device_put(jnp.asarray(x, dtype=dtype), gpu) for x in (q, k, v))


def _as_cupy(x):
    return cupy.from_dlpack(x)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_exact_and_santa_return_jax_arrays(gpu, dtype):
    q, k, v = _inputs(gpu, getattr(jnp, dtype))
    lens = np.array([700, 33], dtype=np.int32)
    try:
        qc, kc, vc = (_as_cupy(x) for x in (q, k, v))
    except Exception as e:  # noqa: BLE001 - this CuPy may lack bfloat16
        if dtype == "bfloat16":
            pytest.skip(f"CuPy takes no bfloat16 through DLPack here: {e}")
        raise
    out = stochattn.exact_attention(q, k, v, lens)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and out.shape == q.shape
    assert bool((cupy.from_dlpack(out) == stochattn.exact_attention(qc, kc, vc, lens)).all())
    for schedule in ("prop", "flash"):
        kw = dict(budget=128, sampler="systematic", schedule=schedule, seed=3, offset=9)
        out, diag = stochattn.santa_attention(q, k, v, lens, return_diagnostics=True, **kw)
        ref = stochattn.santa_attention(qc, kc, vc, lens, **kw)
        assert isinstance(out, jax.Array) and out.dtype == q.dtype
        assert bool((cupy.from_dlpack(out) == ref).all())
        assert isinstance(diag.v_read_fraction, np.ndarray)


def test_inputs_are_read_in_place(gpu):
    """The CuPy view the kernels read is the JAX buffer itself (no copy on the way in)."""
    q, k, v = _inputs(gpu, jnp.float16)
    for x in (q, k, v):
        assert _as_cupy(x).data.ptr == x.unsafe_buffer_pointer()


def test_doublep_from_jax(gpu):
    q, k, v = _inputs(gpu, jnp.float16, N=900)
    index = stochattn.build_doublep_index(k, v, n_clusters=24, seed=0)
    out, diag = stochattn.doublep_attention(q, k, v, index=index, p1=0.95, p2=0.7,
                                            return_diagnostics=True)
    qc, kc, vc = (_as_cupy(x) for x in (q, k, v))
    ref = stochattn.doublep_attention(qc, kc, vc, index=index, p1=0.95, p2=0.7)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype
    assert bool((cupy.from_dlpack(out) == ref).all())
    assert (diag.clusters_selected >= 1).all()
    top = stochattn.cluster_topk_attention(q, k, v, index=index, k_clusters=4)
    assert isinstance(top, jax.Array)


def test_bernoulli_scores_from_jax(gpu):
    q, k, _ = _inputs(gpu, jnp.float16)
    s = stochattn.bernoulli_scores(q, k, bernoulli_draws=2, seed=1)
    ref = stochattn.bernoulli_scores(_as_cupy(q), _as_cupy(k), bernoulli_draws=2, seed=1)
    assert isinstance(s, jax.Array)
    assert bool((cupy.from_dlpack(s) == ref).all())
