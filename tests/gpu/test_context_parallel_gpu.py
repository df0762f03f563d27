"""Context-parallel exact decode with GPU shards (issue 35), ranks simulated on one GPU:
``cp_exact_attention`` over CuPy / torch shards runs each rank's partial through the GPU
kernels (``exact_attention(..., return_lse=True)``, ``core.exact_partial_lse``) and merges
them; the result equals the reference within the flash-attention rule (2x a naive
attention's error in the input dtype), and non-finite rows stay confined to their group."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn import context_parallel as cp  # noqa: E402
from stochattn.reference.exact import exact_attention as ref_exact  # noqa: E402

from gpu_helpers import naive_attention, peaked_inputs, to_device, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("R, bounds", [(2, None), (3, None), (4, [0, 0, 1000, 1001, 3000])])
def test_gpu_shards_equal_the_unsplit_attention(dtype, R, bounds):
    B, Hkv, G, N, D = 3, 2, 4, 3000, 128
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=R)
    qd, kd, vd = (to_device(a, dtype) for a in (q, k, v))  # float16: CuPy, bfloat16: torch
    q64, k64, v64 = to_host64(qd), to_host64(kd), to_host64(vd)
    lens = np.array([N, 1234, 0])
    b = cp.shard_bounds(N, R, boundaries=bounds)
    comm = cp.SimulatedCollectives(R)
    res = cp.cp_exact_attention(qd, cp.split_cache(kd, vd, lens, b), comm, D ** -0.5)
    ref = ref_exact(q64, k64, v64, lens, D ** -0.5)
    naive = naive_attention(q64, k64, v64, lens, D ** -0.5, dtype)
    assert np.abs(res.out - ref).max() <= 2 * np.abs(naive - ref).max() + 1e-5
    assert all(np.array_equal(o, res.out) for o in res.outs)
    assert not res.out[2].any()  # an empty sequence: zero rows


def test_gpu_shards_non_finite_key_reaches_its_group_only():
    B, Hkv, G, N, D = 2, 2, 2, 1000, 64
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=5)
    k[1, 0, 700, 3] = np.nan  # rank 2 of 3: heads 0 and 1 of sequence 1
    qd, kd, vd = (to_device(a, "float16") for a in (q, k, v))
    res = cp.cp_exact_attention(qd, cp.split_cache(kd, vd, None, cp.shard_bounds(N, 3)),
                                cp.SimulatedCollectives(3), D ** -0.5)
    bad = np.isnan(res.out).any(axis=-1)
    want = np.zeros((B, Hkv * G), bool)
    want[1, :G] = True
    np.testing.assert_array_equal(bad, want)
