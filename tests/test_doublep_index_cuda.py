"""The GPU Double-P index (stochattn/cuda/doublep_index.py) against the NumPy reference.

Runs the GPU code path on NumPy arrays: under Numba's CUDA simulator on machines without an
NVIDIA GPU (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1), on the real GPU otherwise. The
CuPy and PyTorch flavours run in tests/gpu/test_cuda_doublep_index.py, which imports the
checks below.

Every property is exact; none is statistical:
- structure (labels exactly on the middle tokens, live clusters, sizes = label counts,
  lengths and window starts), each label a nearest live centroid up to a proven float32
  bound, and each value sum the sequential float32 sum of its members in position order
  (the build's statistics and every append add in that order);
- on fixed inputs whose reference run has no near-tie (a precondition each test asserts:
  the best and the second-best distinct centroid differ by far more than float32 rounding
  at every assignment), the whole index equals the reference's: labels, sizes and integer
  fields exactly, centroids and value sums to float32 rounding. Fixed inputs, so these
  either always pass or always fail;
- on inputs that may hold near-ties (no Lloyd iteration, so no later step depends on one),
  labels equal the reference's except where the float64 distance gap between the two
  labels is within the float32 error bounds;
- (the append is a CUDA C++ kernel: tests/gpu/test_cuda_doublep_append.py checks it, with
  these helpers, on a GPU).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from stochattn.cuda import doublep_index as gpu  # noqa: E402
from stochattn.doublep import (DoublePIndex, build_doublep_index,  # noqa: E402
                               cluster_topk_attention, doublep_attention)
from stochattn.reference.kmeans import cluster_csr  # noqa: E402

from test_kmeans_cuda import U32, check_nearest, check_structure, gamma, score_bound  # noqa: E402

FIELDS = ("centroids", "sizes", "value_sums", "labels", "seq_lens", "window_start",
          "n_initialized")
GAP = 5e-5  # required relative gap of the fixed inputs: >> the float32 error (~1e-6)


# ---- checks shared with tests/gpu/test_cuda_doublep_index.py ----------------------------


def host(a) -> np.ndarray:
    """Any array (NumPy, CuPy, torch) as NumPy."""
    if isinstance(a, np.ndarray):
        return a
    if type(a).__module__.split(".")[0] == "torch":
        return a.detach().cpu().numpy()
    return a.get()


def fields(index) -> dict:
    """The arrays of an index (DoublePIndex or dict of fields), on the host."""
    get = index.get if isinstance(index, dict) else lambda name: getattr(index, name)
    return {name: host(get(name)) for name in FIELDS}


def points(B, Hkv, N, D, n_distinct, seed, dtype=np.float16):
    """Keys that are copies of ``n_distinct`` random points per (sequence, KV head), and
    Gaussian values. Few distinct keys make every distance gap large except exact ties
    between identical centroids, which both precisions break alike (lowest index)."""
    rng = np.random.default_rng(seed)
    pts = rng.standard_normal((B, Hkv, n_distinct, D))
    which = rng.integers(0, n_distinct, size=(B, Hkv, N))
    k = np.take_along_axis(pts, which[..., None], axis=2)
    v = rng.standard_normal((B, Hkv, N, D))
    return k.astype(dtype), v.astype(dtype)


def _scores(keys64, cent64):
    return (cent64 * cent64).sum(-1)[None, :] - 2.0 * keys64 @ cent64.T


def distinct_gap(ref: dict, keys) -> float:
    """Smallest relative gap, over the middle tokens of a reference index, between the
    best live centroid and the best live centroid that is a different vector (identical
    centroids tie exactly in any precision). inf when no token has two distinct choices."""
    k64 = np.asarray(keys, dtype=np.float64)
    worst = np.inf
    for b in range(k64.shape[0]):
        for h in range(k64.shape[1]):
            live = int(ref["n_initialized"][b, h])
            pos = np.flatnonzero(ref["labels"][b, h] >= 0)
            if live < 2 or pos.size == 0:
                continue
            c = np.asarray(ref["centroids"][b, h, :live], dtype=np.float64)
            kk = k64[b, h, pos]
            s = _scores(kk, c)
            mag = (c * c).sum(-1)[None, :] + 2.0 * np.abs(kk) @ np.abs(c).T
            best = np.argmin(s, axis=1)
            same = np.all(c[:, None, :] == c[None, :, :], axis=-1)
            others = np.where(same[best], np.inf, s)
            gap = (others.min(axis=1) - s[np.arange(pos.size), best]) / mag.max(axis=1)
            worst = min(worst, float(gap.min()))
    return worst


def run_gap(k, v, lens, kw) -> float:
    """:func:`distinct_gap` over every assignment of the reference build (after 0, 1, ...,
    ``iterations`` updates): no near-tie anywhere means the float32 run takes the same
    decisions at every step."""
    return min(distinct_gap(fields(build_doublep_index(k, v, lens, **dict(kw, iterations=t))), k)
               for t in range(kw["iterations"] + 1))


def check_sequential_sums(got: dict, values) -> None:
    """Each value sum is, bit for bit, the float32 sum of its members' values added one by
    one in position order (np.cumsum accumulates in order)."""
    v32 = np.asarray(values, dtype=np.float32)
    B, Hkv, C, D = got["value_sums"].shape
    for b in range(B):
        for h in range(Hkv):
            lab = got["labels"][b, h]
            for c in range(C):
                members = np.flatnonzero(lab == c)
                expected = (np.cumsum(v32[b, h, members], axis=0, dtype=np.float32)[-1]
                            if members.size else np.zeros(D, dtype=np.float32))
                np.testing.assert_array_equal(got["value_sums"][b, h, c], expected,
                                              err_msg=f"value sum of cluster {c} ({b}, {h})")


def check_index_exact(got: dict, keys, values, lens, *, n_clusters, n_sink, window) -> None:
    """Every exact property of a GPU index of (keys, values) at ``lens`` (host arrays;
    keys/values hold the values the kernels saw)."""
    lens = np.asarray(lens, dtype=np.int64)
    assert got["seq_lens"].dtype == np.int64 and got["window_start"].dtype == np.int64
    assert got["n_initialized"].dtype == np.int64
    np.testing.assert_array_equal(got["seq_lens"], lens)
    check_structure(got, keys, values, lens, n_clusters=n_clusters, n_sink=n_sink, window=window)
    check_nearest(got, keys)
    check_sequential_sums(got, values)


def centroid_atol(keys, lens, n_sink) -> float:
    """Float32 rounding of a cluster mean (sequential sum of at most M members, one
    division) relative to the float64 mean, per coordinate: (gamma_M + 2u) max|k|."""
    M = max(int(np.max(np.asarray(lens) - n_sink, initial=0)), 1)
    return (gamma(M) + 2 * U32) * float(np.abs(np.asarray(keys, dtype=np.float64)).max())


def check_equals_reference(got: dict, ref: dict, keys, lens, n_sink) -> None:
    """The whole index equals the reference's: integer fields exactly, centroids to the
    rounding of a float32 mean (value sums are checked exactly by check_index_exact)."""
    for name in ("labels", "sizes", "seq_lens", "window_start", "n_initialized"):
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    np.testing.assert_allclose(got["centroids"], ref["centroids"], rtol=0,
                               atol=centroid_atol(keys, lens, n_sink), err_msg="centroids")


def check_near_ties(got: dict, ref: dict, keys) -> int:
    """Labels equal the reference's except at near-ties; returns how many differ.

    The GPU picked g where the reference (float64, its own centroids c) picked r. With
    s(x) = |c_x|^2 - 2 k.c_x, the GPU's centroids c' giving s'(x) = s(x) + delta_x, and E_x
    the float32 error bound of s'(x) (score_bound), the GPU's choice implies
    s(g) - s(r) <= delta_r - delta_g + E_g + E_r: asserted for every differing token.
    """
    for name in ("seq_lens", "window_start", "n_initialized"):
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    np.testing.assert_array_equal(got["labels"] >= 0, ref["labels"] >= 0)
    k64 = np.asarray(keys, dtype=np.float64)
    differ = 0
    B, Hkv = k64.shape[:2]
    for b in range(B):
        for h in range(Hkv):
            pos = np.flatnonzero(got["labels"][b, h] != ref["labels"][b, h])
            if pos.size == 0:
                continue
            live = int(ref["n_initialized"][b, h])
            c = np.asarray(ref["centroids"][b, h, :live], dtype=np.float64)
            c32 = got["centroids"][b, h, :live].astype(np.float64)
            kk = k64[b, h, pos]
            s, s32 = _scores(kk, c), _scores(kk, c32)
            err = score_bound(kk, c32) + 1e-14 * (np.abs(s) + 1.0)
            g = got["labels"][b, h, pos].astype(np.int64)
            r = ref["labels"][b, h, pos].astype(np.int64)
            rows = np.arange(pos.size)
            delta = s32 - s
            slack = delta[rows, r] - delta[rows, g] + err[rows, g] + err[rows, r]
            assert np.all(s[rows, g] - s[rows, r] <= slack), "a label differs beyond a near-tie"
            differ += pos.size
    return differ


def check_csr(offsets, token_ids, got: dict, n_sink: int) -> None:
    """The GPU CSR equals the reference's cluster_csr of the same labels, with the token
    ids padded by -1 to the label axis."""
    ref_off, ref_ids = cluster_csr(got["labels"], got["sizes"], got["window_start"], n_sink)
    offsets, token_ids = host(offsets), host(token_ids)
    assert offsets.dtype == np.int64 and token_ids.dtype == np.int64
    np.testing.assert_array_equal(offsets, ref_off)
    M = ref_ids.shape[-1]
    assert token_ids.shape == got["labels"].shape
    np.testing.assert_array_equal(token_ids[..., :M], ref_ids)
    assert np.all(token_ids[..., M:] == -1)


# ---- helpers of this file --------------------------------------------------------------


def build_both(k, v, lens, kw):
    """(GPU-path index on NumPy arrays, reference index) of the same inputs."""
    got = DoublePIndex(**gpu.build_index_gpu(k, v, lens, **kw))
    ref = build_doublep_index(k, v, lens, **kw)
    return got, ref


CASES = {
    # name: (B, Hkv, N, D, lens, kw, dtype)
    "two sequences, one short": (2, 2, 120, 16, [120, 40],
                                 dict(n_clusters=6, iterations=3, n_sink=4, window=16, seed=3),
                                 np.float16),
    "fewer tokens than clusters + sinks + window": (3, 2, 40, 8, [40, 13, 2],
                                                    dict(n_clusters=5, iterations=3, n_sink=4,
                                                         window=6, seed=9), np.float16),
    "no middle tokens anywhere": (2, 1, 20, 8, [0, 20],
                                  dict(n_clusters=3, iterations=2, n_sink=4, window=16, seed=1),
                                  np.float32),
    "one cluster": (1, 2, 50, 8, [50],
                    dict(n_clusters=1, iterations=3, n_sink=2, window=4, seed=5), np.float16),
    "three KV heads, float32": (1, 3, 90, 8, [77],
                                dict(n_clusters=7, iterations=4, n_sink=0, window=0, seed=2**63),
                                np.float32),
}


def case_inputs(name):
    B, Hkv, N, D, lens, kw, dtype = CASES[name]
    k, v = points(B, Hkv, N, D, n_distinct=12, seed=len(name), dtype=dtype)
    return k, v, np.array(lens), kw


def empty_cluster_inputs(dtype=np.float32):
    """Fixed 1-D data and seed (tests/test_kmeans_cuda.py) where cluster 2 holds two tokens
    after the first assignment and none after the second."""
    x = [1.5, -5.8, -1.8, -2.0, -2.1, -4.3, 2.3, -1.2, 1.4, 1.6, 4.1]
    k = np.zeros((1, 1, len(x), 8), dtype=dtype)
    k[0, 0, :, 0] = x
    return k, k.copy(), np.array([len(x)]), dict(n_clusters=4, iterations=3, n_sink=0,
                                                 window=0, seed=21)


# ---- build -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_build_equals_reference_on_fixed_inputs(name):
    k, v, lens, kw = case_inputs(name)
    assert run_gap(k, v, lens, kw) > GAP  # precondition: no near-tie in the reference run
    got, ref = build_both(k, v, lens, kw)
    got, ref = fields(got), fields(ref)
    check_index_exact(got, k, v, lens, n_clusters=kw["n_clusters"], n_sink=kw["n_sink"],
                      window=kw["window"])
    check_equals_reference(got, ref, k, lens, kw["n_sink"])


def test_build_with_a_cluster_that_empties_during_iterations():
    k, v, lens, kw = empty_cluster_inputs()
    first = fields(build_doublep_index(k, v, lens, **dict(kw, iterations=0)))["sizes"][0, 0]
    assert first[2] > 0 and run_gap(k, v, lens, kw) > GAP  # the case this test is about
    got, ref = build_both(k, v, lens, kw)
    got, ref = fields(got), fields(ref)
    assert got["sizes"][0, 0, 2] == 0 and ref["sizes"][0, 0, 2] == 0
    check_index_exact(got, k, v, lens, **{n: kw[n] for n in ("n_clusters", "n_sink", "window")})
    check_equals_reference(got, ref, k, lens, kw["n_sink"])


def test_build_without_iterations_differs_only_at_near_ties():
    """Continuous keys, no Lloyd iteration: the centroids are the seeding (equal, bit for
    bit) and every label is the reference's unless a near-tie."""
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 2, 100, 16)).astype(np.float16)
    v = rng.standard_normal((2, 2, 100, 16)).astype(np.float16)
    lens = np.array([100, 61])
    kw = dict(n_clusters=9, iterations=0, n_sink=3, window=10, seed=44)
    got, ref = build_both(k, v, lens, kw)
    got, ref = fields(got), fields(ref)
    np.testing.assert_array_equal(got["centroids"], ref["centroids"].astype(np.float32))
    check_index_exact(got, k, v, lens, n_clusters=9, n_sink=3, window=10)
    check_near_ties(got, ref, k)


def test_index_fields_types_and_seq_lens():
    """A GPU-path index holds the reference's dtypes but float32 statistics; seq_lens None
    means N; host lengths are checked like the reference's."""
    k, v, lens, kw = case_inputs("two sequences, one short")
    out = gpu.build_index_gpu(k, v, None, **kw)
    assert (out["n_sink"], out["window"], out["n_clusters"]) == (4, 16, 6)
    dtypes = {name: out[name].dtype for name in FIELDS}
    assert dtypes == dict(centroids=np.float32, sizes=np.int64, value_sums=np.float32,
                          labels=np.int32, seq_lens=np.int64, window_start=np.int64,
                          n_initialized=np.int64)
    np.testing.assert_array_equal(out["seq_lens"], [120, 120])
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 120\]"):
        gpu.build_index_gpu(k, v, np.array([121, 3]), **kw)
    with pytest.raises(ValueError, match=r"`n_clusters` must be <= 120 .*more clusters than tokens"):
        gpu.build_index_gpu(k, v, None, **dict(kw, n_clusters=121))
    with pytest.raises(TypeError, match="`k` dtype must be one of float16, bfloat16, float32, got float64"):
        gpu.build_index_gpu(k.astype(np.float64), v.astype(np.float64), None, **kw)
    with pytest.raises(ValueError, match="`window` must be >= 0, got -1"):
        gpu.build_index_gpu(k, v, None, **dict(kw, window=-1))


# ---- append ------------------------------------------------------------------------------
# The append kernel is CUDA C++ (stochattn/cuda/doublep_append.cu): its tests run on a GPU, in
# tests/gpu/test_cuda_doublep_append.py; tie_case is shared with them. Here: an index of
# NumPy arrays (the simulator's) is not appended on the "GPU" path.


def tie_case(threads: int):
    """(index fields, keys, values, lens) for the tie rule of the append kernel: C > 2 *
    threads clusters, the first ``threads + 1`` at distinct far points, all the others at
    one point p; tokens at p must join the lowest of the identical clusters (which is not
    the first cluster of its thread: its thread also holds identical clusters with higher
    indices), the others their own far point. All live, nothing built yet."""
    C, D, T = 2 * threads + 7, 4, 12
    first = threads + 1
    rng = np.random.default_rng(9)
    cent = np.zeros((1, 1, C, D), dtype=np.float32)
    cent[0, 0, :first] = 8.0 + rng.integers(0, 64, size=(first, D))  # distinct, far from p
    cent[0, 0, first:] = [0.5, -1.0, 0.25, 2.0]                       # p, identical
    keys = np.zeros((1, 1, T, D), dtype=np.float32)
    keys[0, 0, :] = cent[0, 0, first]
    keys[0, 0, 3] = cent[0, 0, 5]  # one token at a far centroid
    values = rng.standard_normal((1, 1, T, D)).astype(np.float32)
    fields_ = dict(centroids=cent, sizes=np.zeros((1, 1, C), dtype=np.int64),
                   value_sums=np.zeros((1, 1, C, D), dtype=np.float32),
                   labels=np.full((1, 1, T), -1, dtype=np.int32),
                   seq_lens=np.zeros(1, dtype=np.int64), window_start=np.zeros(1, dtype=np.int64),
                   n_initialized=np.full((1, 1), C, dtype=np.int64), n_sink=0, window=0,
                   n_clusters=C)
    expected = np.full(T, first)
    expected[3] = 5
    return fields_, keys, values, np.array([T]), expected


def test_append_gpu_needs_a_gpu_index():
    k, v = points(1, 1, 20, 4, n_distinct=4, seed=1)
    index = DoublePIndex(**gpu.build_index_gpu(k, v, np.array([12]), n_clusters=2, iterations=1,
                                               n_sink=1, window=2, seed=0))
    with pytest.raises(TypeError, match="`index` must hold GPU arrays to append on the GPU"):
        gpu.append_gpu(index, k, v, np.array([20]))
    index.append(k, v, np.array([20]))  # the public method runs the reference on the host
    np.testing.assert_array_equal(index.seq_lens, [20])


# ---- csr, value means, stack -------------------------------------------------------------


def test_csr_value_means_and_stack():
    k, v, lens, kw = case_inputs("fewer tokens than clusters + sinks + window")
    index = DoublePIndex(**gpu.build_index_gpu(k, v, lens, **kw))
    got = fields(index)
    check_csr(*gpu.csr_gpu(index), got, kw["n_sink"])
    means = gpu.value_means_gpu(index)
    assert means.dtype == np.float32
    sizes = got["sizes"][..., None].astype(np.float32)
    np.testing.assert_array_equal(means, np.where(sizes > 0, got["value_sums"] / np.maximum(sizes, 1), 0))

    other = DoublePIndex(**gpu.build_index_gpu(k[:2, :, :30], v[:2, :, :30], np.array([30, 9]), **kw))
    stacked = gpu.stack_gpu([index, other, index])
    parts = [got, fields(other), got]
    assert stacked["labels"].shape == (8, 2, 40)
    row = 0
    for part in parts:
        n, B = part["labels"].shape[-1], part["labels"].shape[0]
        np.testing.assert_array_equal(stacked["labels"][row:row + B, :, :n], part["labels"])
        assert np.all(stacked["labels"][row:row + B, :, n:] == -1)
        for name in FIELDS:
            if name != "labels":
                np.testing.assert_array_equal(stacked[name][row:row + B], part[name])
        row += B
    stacked["centroids"][0] += 1.0  # new arrays: the parts do not move
    np.testing.assert_array_equal(index.centroids, got["centroids"])


# ---- public dispatch -----------------------------------------------------------------------


class FakeGPUArray:
    """Stands for a CUDA tensor: only its DLPack device says where it lives."""

    shape, dtype, ndim = (1, 2, 4), "float32", 3

    def __dlpack__(self, stream=None):  # pragma: no cover - never called
        raise AssertionError

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("fn, kwargs", [
    (doublep_attention, {}),
    (doublep_attention, dict(approx="sample", budget=4)),
    (cluster_topk_attention, dict(clusters=2)),
])
def test_decode_on_gpu_arrays_needs_a_gpu_index(fn, kwargs):
    gpu_array = FakeGPUArray()
    with pytest.raises(TypeError, match=r"`index` must be a DoublePIndex"):
        fn(gpu_array, gpu_array, gpu_array, np.array([3]), index=None, **kwargs)
    k = np.random.default_rng(1).standard_normal((1, 1, 12, 4))
    host_index = build_doublep_index(k, k, n_clusters=2, n_sink=1, window=2)
    with pytest.raises(TypeError, match=r"`index` must be a GPU index to decode GPU arrays"):
        fn(gpu_array, gpu_array, gpu_array, index=host_index, **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(budget=0), ValueError, r"`budget` must be >= 1"),
    (dict(budget=4, sampler="gumbel"), ValueError, r"`sampler` must be one of"),
    (dict(budget=4, seed=-1), ValueError, r"`seed` must lie in"),
    (dict(budget=4, offset=2**32), ValueError, r"`offset` must lie in"),
    (dict(budget=4, clusters=2), ValueError, r"`budget` \(the sampled variant\) and `clusters`"),
    (dict(return_indices=True), ValueError, r"`return_indices` needs `budget`"),
])
def test_gpu_decode_checks_the_sampled_variant_arguments_first(kwargs, error, match):
    """stochattn.cuda.doublep.doublep_decode validates before it touches the arrays."""
    from stochattn.cuda.doublep import doublep_decode

    with pytest.raises(error, match=match):
        doublep_decode(None, None, None, None, **kwargs)


def test_gpu_build_without_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(ImportError, match=r"`build_doublep_index` got GPU arrays, and the CUDA "
                                          r"backend needs CuPy"):
        build_doublep_index(FakeGPUArray(), FakeGPUArray(), n_clusters=2)


def test_host_index_rejects_gpu_arrays_and_host_repr_is_unchanged():
    k = np.random.default_rng(1).standard_normal((1, 1, 12, 4))
    index = build_doublep_index(k, k, n_clusters=2, n_sink=1, window=2)
    with pytest.raises(TypeError, match="`k` must be a NumPy array like the index's arrays"):
        index.append(FakeGPUArray(), FakeGPUArray(), None)
    assert repr(index) == ("DoublePIndex(batch=1, kv_heads=1, n_clusters=2, head_dim=4, "
                           "n_sink=1, window=2, seq_lens=[12])")
