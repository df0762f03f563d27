"""Results in the caller's framework: GPU arrays of frameworks other than CuPy and PyTorch
(JAX, ...) reach the kernels as CuPy views and their results go back through the caller's
array-API namespace (CPU stand-ins for the three kinds of array here; the real JAX round
trip is tests/gpu/test_jax_dlpack.py)."""

from __future__ import annotations

import numpy as np

from stochattn._backend import callers_namespace, in_callers_framework, to_namespace


class _Namespace:
    def __init__(self):
        self.taken = []

    def from_dlpack(self, x):
        self.taken.append(x)
        return ("foreign", x)


class _Foreign:  # a GPU array of another framework, with an array-API namespace
    def __init__(self, xp):
        self.xp = xp

    def __array_namespace__(self):
        return self.xp

    def __dlpack__(self, stream=None):  # pragma: no cover - never called here
        raise AssertionError


def _cupy_like():
    cls = type("ndarray", (), {"__dlpack__": lambda self, stream=None: None})
    cls.__module__ = "cupy._core.core"
    return cls()


def _torch_like():
    cls = type("Tensor", (), {"__array_namespace__": lambda self: _Namespace()})
    cls.__module__ = "torch"
    return cls()


def test_native_frameworks_keep_their_results():
    assert callers_namespace(np.zeros(2)) is None
    assert callers_namespace(_cupy_like()) is None
    assert callers_namespace(_torch_like()) is None


def test_foreign_namespace_needs_from_dlpack():
    xp = _Namespace()
    assert callers_namespace(_Foreign(xp)) is xp
    assert callers_namespace(_Foreign(object())) is None  # no from_dlpack: stays CuPy
    assert callers_namespace(object()) is None


def test_to_namespace_converts_every_cupy_array_and_nothing_else():
    xp = _Namespace()
    a, b = _cupy_like(), _cupy_like()
    host = np.arange(3)
    out = to_namespace((a, [b, host], 7), xp)
    assert out == (("foreign", a), [("foreign", b), host], 7)
    assert xp.taken == [a, b]


def test_decorator_reads_q_at_its_position():
    xp = _Namespace()
    res = _cupy_like()

    @in_callers_framework(position=1)
    def gpu_path(function, q, k):
        return res, "diagnostics"

    out = gpu_path("f", _Foreign(xp), None)
    assert out == (("foreign", res), "diagnostics")
    assert gpu_path("f", np.zeros(1), None) == (res, "diagnostics")
