"""stochattn.cuda.kmeans.launch.Bound: a Numba launch prepared once gives what the plain
launch gives, with its mutable scalars replaced and its rebound arrays swapped at each
call. Under the CUDA simulator (no GPU) Bound takes the plain launch; on a GPU it hands the
prepared arguments to the launch call Numba itself makes (a rebound array: only its data
pointer changes). Exact assertions only."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

import stochattn.cuda.kmeans  # noqa: E402,F401  (patches NumPy for numba-cuda first)
from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from stochattn.cuda.kmeans.launch import Bound  # noqa: E402


@cuda.jit
def _write(out, rows, t, scale):
    """out[t, i] = scale * rows[i] + t for the threads of a (rows / 4, 1) grid."""
    i = cuda.grid(1)
    if i < rows.shape[0]:
        out[t, i] = scale * rows[i] + np.float32(t)


def test_bound_launch_equals_plain_launch_and_takes_the_mutable_scalar():
    rows = cuda.to_device(np.arange(10, dtype=np.float32))
    out = cuda.to_device(np.zeros((4, 10), np.float32))
    stream = cuda.default_stream()
    grid, block = 3, 4
    launch = Bound(_write, grid, block, stream, (out, rows, np.int64(0), np.float32(2.0)),
                   mutable=(2,))
    for t in (1, 3, 2):
        launch(t)
    launch()  # no value: the last one stays (row 2 again)
    stream.synchronize()
    got = out.copy_to_host()
    want = np.zeros((4, 10), np.float32)
    for t in (1, 2, 3):
        want[t] = 2.0 * np.arange(10) + t
    np.testing.assert_array_equal(got, want)
    plain = cuda.to_device(np.zeros((4, 10), np.float32))
    _write[grid, block, stream](plain, rows, np.int64(3), np.float32(2.0))
    stream.synchronize()
    np.testing.assert_array_equal(plain.copy_to_host()[3], got[3])


def test_bound_rebind_and_set_equal_plain_launches_with_the_new_arguments():
    """``rebind`` replaces an array argument (the data pointer of a prepared launch),
    ``set`` one mutable scalar: the launch then writes what a plain launch with those
    arguments writes."""
    stream = cuda.default_stream()
    rows = [cuda.to_device(np.arange(10, dtype=np.float32) * (i + 1)) for i in range(2)]
    outs = [cuda.to_device(np.zeros((4, 10), np.float32)) for _ in range(2)]
    launch = Bound(_write, 3, 4, stream, (outs[0], rows[0], np.int64(1), np.float32(2.0)),
                   mutable=(2,), rebind=(0, 1))
    if not numba_config.ENABLE_CUDASIM:  # a GPU: the prepared launch
        assert launch.prepared
    launch()  # outs[0][1] from rows[0]
    launch.rebind(0, outs[1])
    launch.rebind(1, rows[1])
    launch.set(2, 3)
    launch()  # outs[1][3] from rows[1]
    if launch.prepared:  # a trusted raw pointer: back to outs[0], row 2
        launch.rebind(0, ptr=outs[0].__cuda_array_interface__["data"][0])
    else:
        launch.rebind(0, outs[0])
    launch(2)
    stream.synchronize()
    want = [np.zeros((4, 10), np.float32) for _ in range(2)]
    want[0][1] = 2.0 * np.arange(10) + 1
    want[1][3] = 2.0 * 2 * np.arange(10) + 3
    want[0][2] = 2.0 * 2 * np.arange(10) + 2
    for got, w in zip(outs, want):
        np.testing.assert_array_equal(got.copy_to_host(), w)


def test_bound_rebind_errors():
    stream = cuda.default_stream()
    rows = cuda.to_device(np.arange(10, dtype=np.float32))
    out = cuda.to_device(np.zeros((4, 10), np.float32))
    launch = Bound(_write, 3, 4, stream, (out, rows, np.int64(0), np.float32(2.0)),
                   mutable=(2,), rebind=(1,))
    with pytest.raises(ValueError, match=r"`array` must have \(dtype, shape, strides\)"):
        launch.rebind(1, cuda.to_device(np.arange(12, dtype=np.float32)))
    with pytest.raises(ValueError, match=r"`array` must have \(dtype, shape, strides\)"):
        launch.rebind(1, cuda.to_device(np.arange(10, dtype=np.float64)))
    with pytest.raises(ValueError, match=r"`i` must be a rebind position \(1,\), got 0"):
        launch.rebind(0, out)
    with pytest.raises(ValueError, match=r"`i` must be a mutable position \(2,\), got 3"):
        launch.set(3, 1.0)
    if not launch.prepared:
        with pytest.raises(ValueError, match="`array` is required for a plain"):
            launch.rebind(1, ptr=1234)
        launch.release()  # drops the array; a rebind brings one back
        launch.rebind(1, rows)
    launch(1)
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host()[1], 2.0 * np.arange(10) + 1)
