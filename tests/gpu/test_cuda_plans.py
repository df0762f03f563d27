"""The host side of the CUDA wrappers: the per-configuration plan cache, seq_lens on the
GPU (trusted unless ``check_seq_lens=True``), non-contiguous inputs, framework mixing, and
capture of a call in a CUDA graph (torch inputs allocate through torch only)."""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn.cuda.runtime import inputs as _inputs  # noqa: E402
from stochattn.cuda.exact import exact_decode  # noqa: E402
from stochattn.cuda.santa import santa_prop  # noqa: E402
from stochattn.reference.exact import exact_attention as ref_exact  # noqa: E402

from gpu_helpers import peaked_inputs, to_device, to_host, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs_f16(B=3, Hkv=2, G=4, N=300, D=64, seed=0):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed)
    return tuple(to_device(a, "float16") for a in (q, k, v))


def test_plan_cache_reuses_and_separates_configurations():
    _inputs.clear_plan_cache()
    q, k, v = _inputs_f16()
    a = exact_decode(q, k, v)
    assert _inputs.plan_cache_size() == 1
    b = exact_decode(q, k, v)
    assert _inputs.plan_cache_size() == 1, "a repeated configuration must hit the cache"
    assert bool((a == b).all())
    exact_decode(q, k, v, softmax_scale=0.1)
    exact_decode(q[:2], k[:2], v[:2])
    santa_prop(q, k, v, budget=16)
    santa_prop(q, k, v, budget=16, seed=5)  # seed is per call: same plan
    santa_prop(q, k, v, budget=32)
    assert _inputs.plan_cache_size() == 5


def test_cached_plan_still_rejects_bad_arguments():
    """Arguments outside the key (seed, offset, seq_lens) are checked on every call, and a
    bad keyed argument never reaches a cached plan (True is not the budget 1)."""
    q, k, v = _inputs_f16()
    santa_prop(q, k, v, budget=1)
    with pytest.raises(TypeError, match="`budget` must be an integer"):
        santa_prop(q, k, v, budget=True)
    with pytest.raises(ValueError, match="`seed` must lie in"):
        santa_prop(q, k, v, budget=1, seed=-1)
    exact_decode(q, k, v, softmax_scale=1.0)
    with pytest.raises(TypeError, match="`softmax_scale` must be a real number"):
        exact_decode(q, k, v, softmax_scale=True)
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 300\]"):
        exact_decode(q, k, v, np.array([1, 2, 301]))
    with pytest.raises(ValueError, match="`num_chunks` must be >= 1"):
        exact_decode(q, k, v, num_chunks=0)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_gpu_seq_lens_checked_on_request(framework):
    """GPU seq_lens: shape, dtype and device always checked (no sync); values only with
    ``check_seq_lens=True``, where an out-of-range value raises the host message."""
    q, k, v = peaked_inputs(3, 2, 4, 300, 64, seed=1)
    bad = np.array([5, 301, 7])
    if framework == "cupy":
        qd, kd, vd = (to_device(a, "float16") for a in (q, k, v))
        lens_bad = cupy.asarray(bad)
        lens_shape = cupy.asarray(np.array([5, 6]))
        lens_float = cupy.asarray(np.array([5.0, 6.0, 7.0]))
    else:
        torch = pytest.importorskip("torch")
        qd, kd, vd = (torch.tensor(a, device="cuda").half() for a in (q, k, v))
        lens_bad = torch.tensor(bad, device="cuda")
        lens_shape = torch.tensor([5, 6], device="cuda")
        lens_float = torch.tensor([5.0, 6.0, 7.0], device="cuda")
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 300\].*max 301"):
        exact_decode(qd, kd, vd, lens_bad, check_seq_lens=True)
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 300\].*max 301"):
        santa_prop(qd, kd, vd, lens_bad, budget=8, check_seq_lens=True)
    with pytest.raises(ValueError, match=r"`seq_lens` must have shape \(3,\)"):
        exact_decode(qd, kd, vd, lens_shape)
    with pytest.raises(TypeError, match="`seq_lens` must have an integer dtype"):
        exact_decode(qd, kd, vd, lens_float)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_gpu_int64_seq_lens_equal_host_seq_lens(framework):
    """GPU int64 lengths (converted to int32 on the device) give the host-lengths result."""
    lens = np.array([0, 1, 250])
    q, k, v = peaked_inputs(3, 2, 4, 300, 64, seed=2)
    if framework == "cupy":
        qd, kd, vd = (to_device(a, "float16") for a in (q, k, v))
        lens_dev = cupy.asarray(lens.astype(np.int64))
    else:
        torch = pytest.importorskip("torch")
        qd, kd, vd = (torch.tensor(a, device="cuda").half() for a in (q, k, v))
        lens_dev = torch.tensor(lens, dtype=torch.int64, device="cuda")
    a = to_host(exact_decode(qd, kd, vd, lens))
    b = to_host(exact_decode(qd, kd, vd, lens_dev, check_seq_lens=True))
    c = to_host(exact_decode(qd, kd, vd, lens_dev))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    sa = santa_prop(qd, kd, vd, lens, budget=32, seed=3, return_indices=True)
    sb = santa_prop(qd, kd, vd, lens_dev, budget=32, seed=3, return_indices=True)
    np.testing.assert_array_equal(to_host(sa[0]), to_host(sb[0]))
    np.testing.assert_array_equal(to_host(sa[1]), to_host(sb[1]))


def test_non_contiguous_inputs_are_copied():
    """A transposed view (B, Hkv, N, D) of an (B, N, Hkv, D) buffer gives the result of
    its contiguous copy."""
    q, k, v = peaked_inputs(2, 2, 2, 200, 64, seed=4)
    qd = to_device(q, "float16")
    k_nhd = to_device(np.ascontiguousarray(k.transpose(0, 2, 1, 3)), "float16")
    v_nhd = to_device(np.ascontiguousarray(v.transpose(0, 2, 1, 3)), "float16")
    kv, vv = k_nhd.transpose(0, 2, 1, 3), v_nhd.transpose(0, 2, 1, 3)
    assert not kv.flags.c_contiguous
    got = to_host(exact_decode(qd, kv, vv))
    want = to_host(exact_decode(qd, cupy.ascontiguousarray(kv), cupy.ascontiguousarray(vv)))
    np.testing.assert_array_equal(got, want)


def test_mixed_frameworks_rejected():
    torch = pytest.importorskip("torch")
    q, k, v = _inputs_f16()
    with pytest.raises(TypeError, match="must come from one framework"):
        exact_decode(torch.from_dlpack(q), k, v)


def test_torch_calls_capture_in_a_cuda_graph():
    """A torch-input call captured in a CUDA graph and replayed gives the eager result
    (outputs and scratch come from torch's allocator, launches go to the capture stream);
    replaying after new q values are copied in gives the new result."""
    torch = pytest.importorskip("torch")
    q, k, v = peaked_inputs(2, 2, 4, 700, 128, seed=6)
    qt, kt, vt = (torch.tensor(a, device="cuda").half() for a in (q, k, v))
    eager = exact_decode(qt, kt, vt).clone()
    eager_s = santa_prop(qt, kt, vt, budget=64, seed=9).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch asks
        exact_decode(qt, kt, vt)
        santa_prop(qt, kt, vt, budget=64, seed=9)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = exact_decode(qt, kt, vt)
        out_s = santa_prop(qt, kt, vt, budget=64, seed=9)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(out_s, eager_s)
    q2 = np.random.default_rng(7).standard_normal(q.shape)
    qt.copy_(torch.tensor(q2, device="cuda").half())
    g.replay()
    torch.cuda.synchronize()
    ref = ref_exact(qt.double().cpu().numpy(), kt.double().cpu().numpy(), vt.double().cpu().numpy(),
                    None, 1 / math.sqrt(128))
    np.testing.assert_allclose(out.double().cpu().numpy(), ref, atol=2e-3, rtol=2e-3)
    assert torch.equal(out, exact_decode(qt, kt, vt))


def test_bfloat16_torch_output_dtype_and_values():
    """bf16 tensors go in as raw pointers and come out as torch.bfloat16."""
    torch = pytest.importorskip("torch")
    q, k, v = peaked_inputs(1, 2, 2, 130, 64, seed=8)
    qd, kd, vd = (to_device(a, "bfloat16") for a in (q, k, v))
    out = exact_decode(qd, kd, vd)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (1, 4, 64)
    ref = ref_exact(to_host64(qd), to_host64(kd), to_host64(vd), None, 1 / math.sqrt(64))
    np.testing.assert_allclose(to_host64(out), ref, atol=2e-2, rtol=2e-2)


def test_packed_launches_go_straight_to_the_driver():
    """The hot-path launches of exact_decode and santa_prop use the packed driver call
    (stochattn.cuda.runtime.launch.Packed), not the fallback through CuPy's Function call."""
    from stochattn.cuda.runtime import launch as _module

    _inputs.clear_plan_cache()
    q, k, v = _inputs_f16(N=2000)
    exact_decode(q, k, v, num_chunks=3)
    santa_prop(q, k, v, budget=16)
    santa_prop(q, k, v, budget=16, kernel="simt")
    packed = [x for plan in _inputs._plans.values() for x in vars(plan).values()
              if isinstance(x, _module.Packed)]
    assert len(packed) >= 1 + 2 + 3  # exact merges its chunks inside the chunk launch
    assert all(p.fptr is not None for p in packed)


def test_concurrent_calls_from_threads_on_their_own_streams():
    """Two threads share one plan (one packed argument buffer) and launch on their own
    torch streams: every result equals the single-threaded one."""
    torch = pytest.importorskip("torch")
    import threading

    q, k, v = (torch.from_dlpack(a) for a in _inputs_f16(N=3000, seed=4))
    qs = [q * (1 + 0.01 * i) for i in range(2)]
    want = [exact_decode(x, k, v).clone() for x in qs]
    want_s = [santa_prop(x, k, v, budget=32, seed=3).clone() for x in qs]
    errors = []

    def work(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(50):
                    a = exact_decode(qs[i], k, v)
                    b = santa_prop(qs[i], k, v, budget=32, seed=3)
                    s.synchronize()
                    if not (bool((a == want[i]).all()) and bool((b == want_s[i]).all())):
                        errors.append(i)
                        return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
