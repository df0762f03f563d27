"""stochattn.cuda._numba_launch.Bound: a Numba launch prepared once gives what the plain
launch gives, with its mutable scalar replaced at each call. Under the CUDA simulator (no
GPU) Bound takes the plain launch; on a GPU it hands the prepared arguments to the launch
call Numba itself makes. Exact assertions only."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

import stochattn.cuda.kmeans  # noqa: E402,F401  (patches NumPy for numba-cuda first)
from numba import cuda  # noqa: E402

from stochattn.cuda._numba_launch import Bound  # noqa: E402


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
