"""GPU exact decode (stochattn/cuda/exact_decode.cu, and the tensor-core variant
exact_decode_tc.cu: every test runs for both chunk kernels) against the float64 reference.

Tolerance rule (flash-attention's): the kernel's max error against float64 must be at most
twice the max error of a naive attention computed in the input precision, plus 1e-5.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn.cuda import config  # noqa: E402
from stochattn.cuda.exact import KERNELS, exact_decode  # noqa: E402
from stochattn.reference.exact import exact_attention as ref_exact  # noqa: E402

from gpu_helpers import naive_attention, peaked_inputs, to_device, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu

kernels = pytest.mark.parametrize("kernel", KERNELS)


def _check(dtype, B, Hkv, G, N, D, lens, *, seed, kernel, num_chunks=None, temp=2.0):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed, temp=temp)
    qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
    # The reference sees exactly the rounded inputs the kernel sees.
    q64, k64, v64 = to_host64(qd), to_host64(kd), to_host64(vd)
    scale = 1.0 / math.sqrt(D)
    lens_arr = None if lens is None else np.asarray(lens, dtype=np.int32)
    out = exact_decode(qd, kd, vd, lens_arr, num_chunks=num_chunks, kernel=kernel)
    assert tuple(out.shape) == (B, Hkv * G, D)
    assert str(out.dtype).replace("torch.", "") == dtype
    got = to_host64(out)
    ref = ref_exact(q64, k64, v64, lens_arr, scale)
    full = np.full(B, N) if lens is None else np.asarray(lens)
    naive = naive_attention(q64, k64, v64, full, scale, dtype)
    err, err_naive = np.abs(got - ref).max(), np.abs(naive - ref).max()
    assert err <= 2 * err_naive + 1e-5, f"kernel error {err:.3g} vs naive {err_naive:.3g}"
    empty = full == 0
    assert np.all(got[empty] == 0), "seq_len 0 must give exact zeros"
    return got, ref


@kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("N", [1, 13, 257, 1999])
def test_exact_matches_reference(dtype, D, G, N, kernel):
    _check(dtype, 2, 2, G, N, D, None, seed=N * 131 + G * 7 + D, kernel=kernel)


@kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("num_chunks", [None, 1, 3, 64])
def test_exact_seq_lens_and_chunks(dtype, num_chunks, kernel):
    """Per-sequence lengths, including 0 (zero row) and 1 (output = v[0]); forced chunk
    counts exercise the single-chunk path, the merge and chunks past a sequence's end."""
    lens = [0, 1, 700, 517]
    got, ref = _check(dtype, 4, 2, 4, 700, 128, lens, seed=5, num_chunks=num_chunks, kernel=kernel)
    np.testing.assert_array_equal(got[0], 0.0)


@pytest.mark.parametrize("tiling", config.TC_TILINGS, ids=lambda t: t.label().replace(" ", "-"))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_exact_tc_tilings(dtype, tiling):
    """Every compiled tensor-core tiling (tools/tune_exact_tc.py times them): ragged lengths
    that end mid-tile, several chunks, head dims 128 and 64."""
    prev = config.set_config(tc_tiling=tiling)
    try:
        _check(dtype, 3, 2, 4, 1000, 128, [1000, 333, 0], seed=17, num_chunks=3, kernel="tc")
        _check(dtype, 2, 1, 6, 517, 64, [1, 517], seed=18, kernel="tc")
    finally:
        config.set_config(config=prev)


@kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_exact_in_kernel_merge_equals_merge_launch(dtype, kernel, monkeypatch):
    """The merge by the last CTA of each group inside the chunk launch gives the two-launch
    result bit for bit: empty and one-token sequences, G = 1, 3, 4, 8, D 64 and 128, 3 to
    64 chunks, and repeated calls with other lengths (the counters reset themselves)."""
    cases = [(4, 2, 4, 700, 128, 3), (3, 1, 8, 1999, 64, 64), (2, 3, 1, 257, 128, None),
             (2, 2, 3, 1000, 128, 17)]
    for B, Hkv, G, N, D, chunks in cases:
        q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=N + G)
        qd, kd, vd = (to_device(a, dtype) for a in (q, k, v))
        for lens in ([0, 1, N, N // 2][:B], [N, N - 1, 2, 0][:B], None):
            lens_arr = None if lens is None else np.asarray(lens, dtype=np.int32)
            got = {}
            for flag in (True, False, True):
                with config.using_config(merge_in_kernel=flag):
                    got.setdefault(flag, []).append(
                        to_host64(exact_decode(qd, kd, vd, lens_arr, num_chunks=chunks,
                                               kernel=kernel)))
            for a in got[True]:
                np.testing.assert_array_equal(a, got[False][0])


@kernels
def test_exact_in_kernel_merge_on_two_streams(kernel):
    """Calls of one plan on two torch streams at once keep separate arrival counters: 40
    interleaved calls on each stream all give that stream's single-call result."""
    torch = pytest.importorskip("torch")
    q1, k, v = peaked_inputs(2, 2, 4, 20000, 128, seed=21)
    q2 = np.random.default_rng(22).standard_normal(q1.shape)
    q1t, q2t, kt, vt = (torch.tensor(a, device="cuda").half() for a in (q1, q2, k, v))
    want1, want2 = exact_decode(q1t, kt, vt, kernel=kernel), exact_decode(q2t, kt, vt, kernel=kernel)
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(40):
        with torch.cuda.stream(streams[0]):
            o1 = exact_decode(q1t, kt, vt, kernel=kernel)
        with torch.cuda.stream(streams[1]):
            o2 = exact_decode(q2t, kt, vt, kernel=kernel)
        outs.append((o1, o2))
    torch.cuda.synchronize()
    assert all(torch.equal(o1, want1) and torch.equal(o2, want2) for o1, o2 in outs)


@kernels
def test_exact_large_logits_do_not_overflow(kernel):
    """|logits| ~ 1e4 in fp16: max-shifted exp, no inf/NaN, still within the rule."""
    got, ref = _check("float16", 1, 2, 4, 300, 64, None, seed=3, temp=400.0, kernel=kernel)
    assert np.isfinite(got).all()


def test_exact_kernel_argument():
    q = cupy.zeros((1, 4, 64), dtype=cupy.float16)
    k = cupy.zeros((1, 2, 10, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match="`kernel` must be one of 'simt', 'tc' or None, got 'wgmma'"):
        exact_decode(q, k, k, kernel="wgmma")


@kernels
def test_exact_torch_stream_and_roundtrip(kernel):
    """torch in -> torch out on torch's current stream (a side stream here)."""
    torch = pytest.importorskip("torch")
    q, k, v = peaked_inputs(2, 2, 2, 333, 128, seed=11)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        qt, kt, vt = (torch.tensor(a, device="cuda").half() for a in (q, k, v))
        out = exact_decode(qt, kt, vt, kernel=kernel)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    s.synchronize()
    ref = ref_exact(qt.double().cpu().numpy(), kt.double().cpu().numpy(), vt.double().cpu().numpy(),
                    None, 1 / math.sqrt(128))
    np.testing.assert_allclose(out.double().cpu().numpy(), ref, atol=2e-3, rtol=2e-3)


def test_exact_validation_messages():
    q = cupy.zeros((1, 4, 96), dtype=cupy.float16)
    k = cupy.zeros((1, 2, 10, 96), dtype=cupy.float16)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        exact_decode(q, k, k)
    q = cupy.zeros((1, 4, 64), dtype=cupy.float32)
    k = cupy.zeros((1, 2, 10, 64), dtype=cupy.float32)
    with pytest.raises(TypeError, match="`q` dtype must be one of float16, bfloat16"):
        exact_decode(q, k, k)
    q = cupy.zeros((1, 18, 64), dtype=cupy.float16)
    k = cupy.zeros((1, 2, 10, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match="GQA group"):
        exact_decode(q, k, k)
    q = cupy.zeros((1, 4, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 10\]"):
        exact_decode(q, k, k, np.array([11], dtype=np.int32))


@kernels
def test_exact_64bit_offsets(kernel):
    """One stream longer than 2**31 elements (N * D > 2**31): all keys 0 except a planted
    one past element 2**31 with logit 20; the output has a closed form."""
    D, N = 128, (1 << 31) // 128 + 4096
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 3 * N * D * 2 + (1 << 30):
        pytest.skip("needs about 13 GB of free GPU memory")
    k = cupy.zeros((1, 1, N, D), dtype=cupy.float16)
    v = cupy.empty((1, 1, N, D), dtype=cupy.float16)
    rs = cupy.random.RandomState(0)
    step = 1 << 22
    for s0 in range(0, N, step):  # fill in slices: a float32 temp of the whole is 8.6 GB
        v[0, 0, s0:s0 + step] = rs.standard_normal((min(step, N - s0), D), dtype=cupy.float32)
    p = N - 1000  # planted row: element offset p * D > 2**31
    q = cupy.zeros((1, 1, D), dtype=cupy.float16)
    q[0, 0, 0] = 1.0
    k[0, 0, p, 0] = 20.0 * math.sqrt(D)  # logit = scale * q.k = 20 (exact in fp16: 226.3 -> rounded)
    x = float(cupy.asnumpy(k[0, 0, p, 0]).astype(np.float64)) / math.sqrt(D)
    out = cupy.asnumpy(exact_decode(q, k, v, kernel=kernel)).astype(np.float64)[0, 0]
    vsum = cupy.asnumpy(v[0, 0].astype(cupy.float64).sum(axis=0))
    vp = cupy.asnumpy(v[0, 0, p]).astype(np.float64)
    ref = (vsum - vp + math.exp(x) * vp) / (N - 1 + math.exp(x))
    np.testing.assert_allclose(out, ref, atol=2e-3, rtol=2e-3)
