"""The Double-P index on a real GPU (stochattn/cuda/doublep_index.py) through the public API,
with CuPy arrays and PyTorch CUDA tensors (float16 and bfloat16), against the float64
NumPy reference built from the values the GPU saw (fp16/bf16 widen exactly).

The checks are those of tests/test_doublep_index_cuda.py (which runs the same code path on
NumPy arrays under Numba's simulator; its docstring states them): exact structure,
nearest-centroid labels up to a proven float32 bound, value sums equal bit for bit to the
sequential float32 sums in position order, and, on fixed inputs asserted to hold no
near-tie, the whole index equal to the reference's (labels and sizes exactly, centroids to
float32 rounding). Odd sizes: fewer tokens than clusters + sinks + window, a sequence of
length 0, no middle token at all, one cluster, a cluster that empties during the
iterations, three KV heads, more clusters than threads per block (the tie rule across and
within threads). The Double-P index has no query, so the GQA group plays no part here.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn.cuda import doublep_index as gpu  # noqa: E402
from stochattn.doublep import DoublePIndex, build_doublep_index  # noqa: E402

from test_doublep_index_cuda import (  # noqa: E402
    CASES,
    FIELDS,
    GAP,
    case_inputs,
    check_csr,
    check_equals_reference,
    check_index_exact,
    distinct_gap,
    empty_cluster_inputs,
    fields,
    host,
    points,
    run_gap,
    tie_case,
)

pytestmark = pytest.mark.gpu

DTYPES = dict(centroids="float32", sizes="int64", value_sums="float32", labels="int32",
              seq_lens="int64", window_start="int64", n_initialized="int64")


class Framework:
    """A GPU array framework and dtype: arrays in, exact float32 copies out."""

    def __init__(self, name: str, dtype: str):
        self.name, self.dtype = name, dtype

    def __repr__(self) -> str:
        return f"{self.name}-{self.dtype}"

    def _torch(self):
        return pytest.importorskip("torch")

    def array(self, x):
        x = np.asarray(x, dtype=np.float32)
        if self.name == "cupy":
            return cupy.asarray(x.astype(self.dtype))
        torch = self._torch()
        return torch.tensor(x, device="cuda").to(getattr(torch, self.dtype))

    def lens(self, x):
        """Lengths as an int32 GPU array."""
        x = np.asarray(x, dtype=np.int32)
        if self.name == "cupy":
            return cupy.asarray(x)
        torch = self._torch()
        return torch.tensor(x, device="cuda")

    def seen(self, a) -> np.ndarray:
        """The values the kernels read, as float32 NumPy (exact for fp16 and bf16)."""
        if self.name == "cupy":
            return cupy.asnumpy(a).astype(np.float32)
        return a.float().cpu().numpy()

    def native(self, a) -> bool:
        if self.name == "cupy":
            return isinstance(a, cupy.ndarray)
        torch = self._torch()
        return isinstance(a, torch.Tensor) and a.is_cuda

    def dtype_name(self, a) -> str:
        return str(a.dtype).replace("torch.", "")


CUPY16 = Framework("cupy", "float16")
TORCH16 = Framework("torch", "float16")
TORCHBF16 = Framework("torch", "bfloat16")
FRAMEWORKS = [pytest.param(fw, id=repr(fw)) for fw in (CUPY16, TORCH16, TORCHBF16)]


def check_types(index, fw, shape_bhcdn):
    """Every array of the index is a GPU array of the input's framework with the index's
    dtype and shape."""
    B, Hkv, C, D, N = shape_bhcdn
    shapes = dict(centroids=(B, Hkv, C, D), sizes=(B, Hkv, C), value_sums=(B, Hkv, C, D),
                  labels=(B, Hkv, N), seq_lens=(B,), window_start=(B,), n_initialized=(B, Hkv))
    for name in FIELDS:
        a = getattr(index, name)
        assert fw.native(a), f"{name} is a {type(a).__name__}"
        assert fw.dtype_name(a) == DTYPES[name], name
        assert tuple(a.shape) == shapes[name], name


def _inputs(fw, k, v):
    kd, vd = fw.array(k), fw.array(v)
    return kd, vd, fw.seen(kd), fw.seen(vd)


# ---- build --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES) + ["a cluster empties during the iterations"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_build_equals_reference(fw, name):
    if name in CASES:
        k, v, lens, kw = case_inputs(name)
    else:
        k, v, lens, kw = empty_cluster_inputs()
    kd, vd, k32, v32 = _inputs(fw, k, v)
    assert run_gap(k32, v32, lens, kw) > GAP  # precondition: no near-tie in the reference run
    index = build_doublep_index(kd, vd, fw.lens(lens), **kw)
    check_types(index, fw, (k.shape[0], k.shape[1], kw["n_clusters"], k.shape[3], k.shape[2]))
    got = fields(index)
    check_index_exact(got, k32, v32, lens, n_clusters=kw["n_clusters"], n_sink=kw["n_sink"],
                      window=kw["window"])
    ref = fields(build_doublep_index(k32, v32, lens, **kw))
    check_equals_reference(got, ref, k32, lens, kw["n_sink"])
    if name not in CASES:
        assert got["sizes"][0, 0, 2] == 0  # the empty live cluster
    offsets, token_ids = index.csr()
    assert fw.native(offsets) and fw.native(token_ids)
    check_csr(offsets, token_ids, got, kw["n_sink"])


@pytest.mark.parametrize("fw", [pytest.param(CUPY16, id="cupy-float16"),
                                pytest.param(TORCHBF16, id="torch-bfloat16")])
def test_realistic_size_build_and_append(fw):
    """8 (sequence, KV head) problems of up to 4096 tokens, D = 128, 300 clusters (more
    than the append kernel's 256 threads; with 100 distinct keys many clusters are
    identical or empty): build, append token by token (host, GPU and None lengths), then a
    bulk append; the index equals the reference's after every step, and one bulk append
    equals the steps bit for bit."""
    k, v = points(2, 4, 4096, 128, n_distinct=100, seed=3, dtype=np.float32)
    kw = dict(n_clusters=300, iterations=3, n_sink=4, window=64, seed=11)
    kd, vd, k32, v32 = _inputs(fw, k, v)
    L0 = np.array([3000, 2000])
    assert run_gap(k32[:, :, :3072], v32[:, :, :3072], L0, kw) > GAP  # precondition
    # The prompt's cache: a contiguous copy of the first 3072 positions.
    index = build_doublep_index(fw.array(k32[:, :, :3072]), fw.array(v32[:, :, :3072]), L0, **kw)
    bulk = DoublePIndex.stack([index])
    ref = build_doublep_index(k32[:, :, :3072], v32[:, :, :3072], L0, **kw)
    got = fields(index)
    check_index_exact(got, k32[:, :, :3072], v32[:, :, :3072], L0, n_clusters=300, n_sink=4,
                      window=64)
    check_equals_reference(got, fields(ref), k32, L0, 4)
    steps = [np.array([3001, 2001]), fw.lens([3002, 2001]), np.array([3002, 2002]),
             fw.lens([3500, 2600]), None]
    for lens in steps:
        index.append(kd, vd, lens)
        ref.append(k32, v32, None if lens is None else host(lens))
        got, r = fields(index), fields(ref)
        for name in ("labels", "sizes", "seq_lens", "window_start", "n_initialized"):
            np.testing.assert_array_equal(got[name], r[name], err_msg=name)
    L1 = np.array([4096, 4096])
    assert distinct_gap(fields(ref), k32) > GAP  # precondition of the appended tokens
    check_index_exact(got, k32, v32, L1, n_clusters=300, n_sink=4, window=64)
    check_equals_reference(got, fields(ref), k32, L1, 4)
    bulk.append(kd, vd, None)
    b = fields(bulk)
    for name in FIELDS:
        np.testing.assert_array_equal(b[name], got[name], err_msg=name)


# ---- append -------------------------------------------------------------------------------


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_append_seeds_a_short_prompt_then_joins(fw):
    """A prompt with fewer middle tokens than clusters; the cache grows past the N the
    index was built with; a sequence stays empty; GPU lengths each step."""
    kw = dict(n_clusters=5, iterations=1, n_sink=2, window=4, seed=3)
    k, v = points(3, 2, 40, 8, n_distinct=9, seed=8)
    kd, vd, k32, v32 = _inputs(fw, k, v)
    L0 = np.array([8, 3, 0])
    index = build_doublep_index(fw.array(k32[:, :, :20]), fw.array(v32[:, :, :20]), fw.lens(L0),
                                **kw)
    ref = build_doublep_index(k32[:, :, :20], v32[:, :, :20], L0, **kw)
    steps = [[9, 8, 0], [12, 9, 0], [30, 40, 0], [40, 40, 0]]
    final = build_doublep_index(k32[:, :, :20], v32[:, :, :20], L0, **kw)
    final.append(k32, v32, np.array(steps[-1]))
    assert distinct_gap(fields(final), k32) > GAP  # precondition: no near-tie in the appends
    for lens in steps:
        index.append(kd, vd, fw.lens(lens))
        ref.append(k32, v32, np.array(lens))
        got = fields(index)
        check_index_exact(got, k32, v32, lens, n_clusters=5, n_sink=2, window=4)
        check_equals_reference(got, fields(ref), k32, lens, 2)
    check_types(index, fw, (3, 2, 5, 8, 40))
    np.testing.assert_array_equal(got["centroids"][1, :, :5], k32[1, :, 2:7])


def test_ties_go_to_the_lowest_cluster_on_the_gpu():
    """More clusters than threads, many identical: the kernel's tie rule is the argmin's."""
    f, k, v, lens, expected = tie_case(gpu._APPEND_THREADS)
    index = DoublePIndex(**{n: cupy.asarray(a) if isinstance(a, np.ndarray) else a
                            for n, a in f.items()})
    index.append(cupy.asarray(k), cupy.asarray(v), lens)
    np.testing.assert_array_equal(cupy.asnumpy(index.labels[0, 0]), expected)
    sizes = cupy.asnumpy(index.sizes[0, 0])
    assert sizes[5] == 1 and sizes[expected[0]] == len(expected) - 1


# ---- lengths, streams, views, errors ----------------------------------------------------------


@pytest.mark.parametrize("fw", [pytest.param(CUPY16, id="cupy"), pytest.param(TORCH16, id="torch")])
def test_gpu_lengths_are_clamped_host_lengths_checked(fw):
    k, v, _, kw = case_inputs("two sequences, one short")
    kd, vd, _, _ = _inputs(fw, k, v)
    N = k.shape[2]
    bad = build_doublep_index(kd, vd, fw.lens([N + 100, -5]), **kw)
    good = build_doublep_index(kd, vd, np.array([N, 0]), **kw)
    for name in FIELDS:
        np.testing.assert_array_equal(fields(bad)[name], fields(good)[name], err_msg=name)
    with pytest.raises(ValueError, match=rf"`seq_lens` values must lie in \[0, {N}\]"):
        build_doublep_index(kd, vd, fw.lens([N + 100, 3]), check_finite=True, **kw)
    with pytest.raises(ValueError, match=rf"`seq_lens` values must lie in \[0, {N}\]"):
        build_doublep_index(kd, vd, np.array([N + 1, 3]), **kw)
    full = build_doublep_index(kd, vd, None, **kw)
    assert fields(full)["seq_lens"].tolist() == [N, N]
    # An append never shrinks a sequence: lower GPU lengths are raised to the index's.
    good.append(kd, vd, fw.lens([N, 0]))
    before = fields(good)
    good.append(kd, vd, fw.lens([3, 0]))
    after = fields(good)
    for name in FIELDS:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_cupy_runs_on_the_current_stream():
    """Build and append on a non-blocking stream give the default stream's index."""
    k, v, lens, kw = case_inputs("two sequences, one short")
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    ref = build_doublep_index(kd, vd, np.array([100, 30]), **kw)
    ref.append(kd, vd, lens)
    cupy.cuda.Device().synchronize()  # a non-blocking stream does not wait for the null stream
    with cupy.cuda.Stream(non_blocking=True) as s:
        index = build_doublep_index(kd, vd, np.array([100, 30]), **kw)
        index.append(kd, vd, cupy.asarray(lens))
        got = fields(index)  # copies on s, after the kernels
        s.synchronize()
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], fields(ref)[name], err_msg=name)


def test_torch_runs_on_the_current_stream():
    torch = pytest.importorskip("torch")
    k, v, lens, kw = case_inputs("two sequences, one short")
    kd, vd = TORCH16.array(k), TORCH16.array(v)
    ref = build_doublep_index(kd, vd, np.array([100, 30]), **kw)
    ref.append(kd, vd, lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        index = build_doublep_index(kd, vd, TORCH16.lens([100, 30]), **kw)
        index.append(kd, vd, TORCH16.lens(lens))
        got = {name: getattr(index, name).clone() for name in FIELDS}
    side.synchronize()
    for name in FIELDS:
        np.testing.assert_array_equal(got[name].cpu().numpy(), fields(ref)[name], err_msg=name)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_views_stack_repr_and_errors(fw):
    k, v, lens, kw = case_inputs("fewer tokens than clusters + sinks + window")
    kd, vd, k32, v32 = _inputs(fw, k, v)
    index = build_doublep_index(kd, vd, fw.lens(lens), **kw)
    got = fields(index)
    means = index.value_means
    assert fw.native(means) and fw.dtype_name(means) == "float32"
    s = got["sizes"][..., None].astype(np.float32)
    np.testing.assert_allclose(host(means), np.where(s > 0, got["value_sums"] / np.maximum(s, 1), 0),
                               rtol=2.0**-23, atol=0)

    other = build_doublep_index(fw.array(k32[:2, :, :30]), fw.array(v32[:2, :, :30]),
                                np.array([30, 9]), **kw)
    stacked = DoublePIndex.stack([index, other])
    check_types(stacked, fw, (5, 2, 5, 8, 40))
    st_ = fields(stacked)
    np.testing.assert_array_equal(st_["labels"][:3], got["labels"])
    np.testing.assert_array_equal(st_["labels"][3:, :, :30], fields(other)["labels"])
    assert np.all(st_["labels"][3:, :, 30:] == -1)
    for name in FIELDS:
        if name != "labels":
            np.testing.assert_array_equal(st_[name][:3], got[name], err_msg=name)

    text = repr(index)
    assert text.startswith("DoublePIndex(batch=3, kv_heads=2, n_clusters=5, head_dim=8, n_sink=4, "
                           "window=6, seq_lens=[40, 13, 2], device=")
    assert ("'cupy:0'" in text) if fw.name == "cupy" else ("'torch:cuda:0'" in text)

    q = fw.array(np.ones((3, 4, 8)))
    # A GPU index decodes on the GPU (tests/gpu/test_cuda_doublep.py), whose kernels need
    # head_dim 64 or 128: this D = 8 cache gets the kernels' error.
    with pytest.raises(ValueError, match=r"`q` head_dim must be one of \(64, 128\) on the GPU"):
        stochattn.doublep_attention(q, kd, vd, fw.lens(lens), index=index)
    with pytest.raises(ValueError, match=r"`q` head_dim must be one of"):
        stochattn.cluster_topk_attention(q, kd, vd, index=index, k_clusters=2)
    with pytest.raises(TypeError, match=r"`index` must hold NumPy arrays to decode NumPy arrays"):
        stochattn.doublep_attention(np.ones((3, 4, 8), dtype=np.float32), k32, v32, lens,
                                    index=index)
    with pytest.raises(TypeError, match=r"`k` must be a .* like the index's arrays"):
        index.append(k32, v32, lens)
    with pytest.raises(TypeError, match="`indexes\\[1\\]` must hold"):
        DoublePIndex.stack([index, build_doublep_index(k32, v32, lens, **kw)])
    with pytest.raises(ValueError, match="`k` must match the index"):
        index.append(kd[:, :1], vd[:, :1], None)
