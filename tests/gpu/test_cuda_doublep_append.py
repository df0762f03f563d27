"""The Double-P append kernel (stochattn/cuda/doublep_append.cu) on a real GPU, against the
NumPy reference and against itself, with the exact checks of tests/test_doublep_index_cuda.py
(its docstring states them):

- after every append the index is exact (structure, nearest centroid up to a proven float32
  bound, value sums equal bit for bit to the sequential float32 sums in position order) and,
  on fixed inputs asserted to hold no near-tie, equal to the reference's;
- appending one token at a time equals one bulk append, bit for bit (Hypothesis cases with
  exact duplicate keys, empty sequences, short prompts that seed clusters);
- bfloat16 keys and values give the index of their exact float32 values, bit for bit;
- lengths never shrink, None means the whole cache, bad host lengths raise;
- non-contiguous caches (a view of a larger cache) give the contiguous cache's index.

The index is built by the Numba-CUDA k-means (real GPU), then appended by the CUDA kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

cupy = pytest.importorskip("cupy")

from stochattn.cuda import doublep_index as gpu  # noqa: E402
from stochattn.doublep import DoublePIndex, build_doublep_index  # noqa: E402

from test_doublep_index_cuda import (  # noqa: E402
    FIELDS,
    GAP,
    check_equals_reference,
    check_index_exact,
    check_near_ties,
    distinct_gap,
    empty_cluster_inputs,
    fields,
    points,
    run_gap,
)

pytestmark = pytest.mark.gpu


def built(k, v, lens, kw) -> DoublePIndex:
    """A GPU index (CuPy arrays) of NumPy inputs."""
    return DoublePIndex(**gpu.build_index_gpu(cupy.asarray(k), cupy.asarray(v), lens, **kw))


def _appended(k, v, n0, L0, L1, kw) -> dict:
    """Fields of the reference index built on the first n0 positions at L0, then
    appended to L1 (the state whose assignments the preconditions examine)."""
    ref = build_doublep_index(k[:, :, :n0], v[:, :, :n0], np.asarray(L0), **kw)
    ref.append(k, v, np.asarray(L1))
    return fields(ref)


def _append_steps(got, ref, k, v, steps, kw):
    """Append the same lengths to both indexes; after each step the GPU index must be
    exact and equal the reference's."""
    dk, dv = cupy.asarray(k), cupy.asarray(v)
    for lens in steps:
        lens = np.array(lens)
        gpu.append_gpu(got, dk, dv, lens)
        ref.append(k, v, lens)
        g, r = fields(got), fields(ref)
        check_index_exact(g, k, v, lens, n_clusters=kw["n_clusters"], n_sink=kw["n_sink"],
                          window=kw["window"])
        check_equals_reference(g, r, k, lens, kw["n_sink"])


def test_append_equals_reference_over_several_steps():
    """Build on a shorter cache, then grow it: single tokens, a step with nothing new, a
    bulk step, and a sequence that stays empty."""
    kw = dict(n_clusters=6, iterations=2, n_sink=2, window=8, seed=17)
    k, v = points(3, 2, 90, 16, n_distinct=10, seed=7)
    L0 = np.array([40, 25, 0])
    got = built(k[:, :, :50], v[:, :, :50], L0, kw)
    ref = build_doublep_index(k[:, :, :50], v[:, :, :50], L0, **kw)
    steps = [[41, 25, 0], [42, 26, 0], [42, 26, 0], [60, 40, 0], [90, 41, 0]]
    assert run_gap(k[:, :, :50], v[:, :, :50], L0, kw) > GAP  # preconditions: no near-tie
    assert distinct_gap(_appended(k, v, 50, L0, steps[-1], kw), k) > GAP
    _append_steps(got, ref, k, v, steps, kw)
    assert got.labels.shape == (3, 2, 90)


def test_append_seeds_the_clusters_of_a_short_prompt():
    """A prompt with fewer middle tokens than clusters: the first tokens that leave the
    window seed the free clusters (centroid = key, bit for bit), later ones join."""
    kw = dict(n_clusters=5, iterations=1, n_sink=2, window=4, seed=3)
    k, v = points(2, 2, 40, 8, n_distinct=9, seed=8)
    L0 = np.array([8, 3])
    got, ref = built(k, v, L0, kw), build_doublep_index(k, v, L0, **kw)
    assert fields(got)["n_initialized"].tolist() == [[2, 2], [0, 0]]
    steps = [[9, 8], [12, 9], [30, 40], [40, 40]]
    assert distinct_gap(_appended(k, v, 40, L0, steps[-1], kw), k) > GAP  # no near-tie
    _append_steps(got, ref, k, v, steps, kw)
    g = fields(got)
    assert g["n_initialized"].tolist() == [[5, 5], [5, 5]]
    np.testing.assert_array_equal(g["centroids"][1, :, :5], k[1, :, 2:7].astype(np.float32))


def test_append_to_the_cluster_that_emptied():
    """The empty live cluster of the fixed 1-D data keeps its centroid and takes the new
    tokens closest to it."""
    k0, _, lens, kw = empty_cluster_inputs()
    x = [-1.5, 3.0, -1.4, 0.1]
    k = np.zeros((1, 1, k0.shape[2] + len(x), 8), dtype=np.float32)
    k[:, :, :k0.shape[2]] = k0
    k[0, 0, k0.shape[2]:, 0] = x
    got, ref = built(k0, k0, lens, kw), build_doublep_index(k0, k0, lens, **kw)
    _append_steps(got, ref, k, k, [[12], [15]], kw)
    assert fields(got)["sizes"][0, 0, 2] > 0


@st.composite
def append_cases(draw):
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    N = draw(st.integers(2, 40))
    D = draw(st.sampled_from((4, 8, 33, 64)))  # 33: lanes without a coordinate
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from((np.float16, np.float32)))
    k = rng.standard_normal((B, Hkv, N, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, N, D)).astype(dtype)
    if draw(st.booleans()):  # exact duplicates: ties between equal centroids
        k[:, :, N // 2:] = k[:, :, : N - N // 2]
    L0 = np.array([draw(st.integers(0, N)) for _ in range(B)])
    L1 = np.array([draw(st.integers(int(l), N)) for l in L0])
    N0 = max(int(L0.max()), 1)
    kw = dict(n_clusters=draw(st.integers(1, min(N0, 6))), iterations=draw(st.integers(0, 2)),
              n_sink=draw(st.integers(0, 3)), window=draw(st.integers(0, 6)),
              seed=draw(st.integers(0, 2**64 - 1)))
    return k, v, L0, L1, N0, kw


@given(append_cases())
@settings(max_examples=30)
def test_append_one_by_one_equals_bulk_and_stays_exact(case):
    """Bulk append == token-by-token append, bit for bit; the result is exact (structure,
    nearest centroid, sequential sums); without iterations it equals the reference's
    except at near-ties."""
    k, v, L0, L1, N0, kw = case
    bulk, single = built(k[:, :, :N0], v[:, :, :N0], L0, kw), built(k[:, :, :N0], v[:, :, :N0], L0, kw)
    dk, dv = cupy.asarray(k), cupy.asarray(v)
    gpu.append_gpu(bulk, dk, dv, L1)
    for step in range(int((L1 - L0).max()) + 1):
        gpu.append_gpu(single, dk, dv, np.minimum(L0 + step, L1))
    b, s = fields(bulk), fields(single)
    for name in FIELDS:
        np.testing.assert_array_equal(s[name], b[name], err_msg=name)
    check_index_exact(b, k, v, L1, n_clusters=kw["n_clusters"], n_sink=kw["n_sink"],
                      window=kw["window"])
    if kw["iterations"] == 0:
        ref = build_doublep_index(k[:, :, :N0], v[:, :, :N0], L0, **kw)
        ref.append(k, v, L1)
        check_near_ties(b, fields(ref), k)


@pytest.mark.parametrize("D", [64, 128, 96])  # 96: D / 4 is no power of two, the scalar path
def test_split_scoring_seeding_and_bulk_joins_agree(D):
    """Many clusters (the scoring kernel splits them over blocks), prompts too short to seed
    them all (a bulk append seeds, then joins clusters seeded by that same append), and
    bulk appends longer than the kernel's fast joins: bulk equals token by token, bit for
    bit, and the index stays exact."""
    kw = dict(n_clusters=300, iterations=1, n_sink=4, window=16, seed=21)
    k, v = points(2, 2, 700, D, n_distinct=400, seed=D)
    L0, L1 = np.array([300, 250]), np.array([700, 650])
    bulk, single = built(k[:, :, :330], v[:, :, :330], L0, kw), built(k[:, :, :330], v[:, :, :330], L0, kw)
    assert (fields(bulk)["n_initialized"] < 300).all()
    dk, dv = cupy.asarray(k), cupy.asarray(v)
    gpu.append_gpu(bulk, dk, dv, L1)
    for step in range(1, int((L1 - L0).max()) + 1):
        gpu.append_gpu(single, dk, dv, np.minimum(L0 + step, L1))
    b, s = fields(bulk), fields(single)
    for name in FIELDS:
        np.testing.assert_array_equal(s[name], b[name], err_msg=name)
    check_index_exact(b, k, v, L1, n_clusters=300, n_sink=4, window=16)


def test_append_lengths_never_shrink_and_none_means_the_cache():
    """Host lengths below the index's are raised to them (the GPU path does not read
    device lengths, so it clamps instead of raising); None takes the whole cache."""
    k, v = points(2, 1, 30, 8, n_distinct=6, seed=2)
    kw = dict(n_clusters=3, iterations=1, n_sink=1, window=2, seed=0)
    index = built(k, v, np.array([10, 12]), kw)
    dk, dv = cupy.asarray(k), cupy.asarray(v)
    gpu.append_gpu(index, dk, dv, np.array([5, 15]))
    np.testing.assert_array_equal(index.seq_lens.get(), [10, 15])
    gpu.append_gpu(index, dk, dv, None)
    np.testing.assert_array_equal(index.seq_lens.get(), [30, 30])
    check_index_exact(fields(index), k, v, [30, 30], n_clusters=3, n_sink=1, window=2)
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 30\]"):
        gpu.append_gpu(index, dk, dv, np.array([31, 30]))
    with pytest.raises(ValueError, match="`k` must match the index"):
        gpu.append_gpu(index, dk[:, :, :, :4], dv[:, :, :, :4], None)


def test_a_strided_cache_appends_like_a_contiguous_one():
    """Keys and values that are views of a larger cache (every other KV head, a prefix of
    the token axis): the kernel reads them through their strides."""
    kw = dict(n_clusters=4, iterations=1, n_sink=1, window=3, seed=5)
    k, v = points(2, 4, 48, 16, n_distinct=7, seed=11)
    dk, dv = cupy.asarray(k), cupy.asarray(v)
    kv, vv = dk[:, ::2, :40], dv[:, ::2, :40]
    kc, vc = k[:, ::2, :40].copy(), v[:, ::2, :40].copy()
    L0, L1 = np.array([20, 30]), np.array([40, 37])
    a, b = built(kc, vc, L0, kw), built(kc, vc, L0, kw)
    gpu.append_gpu(a, kv, vv, L1)
    gpu.append_gpu(b, cupy.asarray(kc), cupy.asarray(vc), L1)
    fa, fb = fields(a), fields(b)
    for name in FIELDS:
        np.testing.assert_array_equal(fa[name], fb[name], err_msg=name)


def _bf16(x):
    """float32 values rounded down to bfloat16 (truncation: exact bfloat16 values) and
    their bit patterns as int16."""
    bits = (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32), bits.view(np.int16)


def test_bfloat16_appends_like_its_float32_values():
    """The bf16 kernel widens the 16-bit patterns exactly: the same index, bit for bit, as
    the float32 kernel on the widened values (negative values, a zero, and a short prompt
    so that both the seeding and the nearest-centroid branch run). torch tensors."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    k32, kbits = _bf16(rng.standard_normal((2, 2, 40, 8)) * 3.0)
    v32, vbits = _bf16(rng.standard_normal((2, 2, 40, 8)))
    k32[0, 0, 20], kbits[0, 0, 20] = 0.0, 0
    kw = dict(n_clusters=4, iterations=1, n_sink=2, window=4, seed=12)
    L0, L1 = np.array([30, 8]), np.array([40, 33])
    t32 = [torch.tensor(x, device="cuda") for x in (k32, v32)]
    t16 = [torch.tensor(x, device="cuda").view(torch.bfloat16) for x in (kbits, vbits)]
    a = DoublePIndex(**gpu.build_index_gpu(*t32, L0, **kw))
    b = DoublePIndex(**gpu.build_index_gpu(*t16, L0, **kw))
    gpu.append_gpu(a, *t32, L1)
    gpu.append_gpu(b, *t16, L1)
    fa, fb = fields(a), fields(b)
    for name in FIELDS:
        np.testing.assert_array_equal(fb[name], fa[name], err_msg=name)
