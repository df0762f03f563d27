"""Non-finite input on the GPU (docs/conventions.md, "Non-finite input"): the cases of
tests/test_nonfinite.py on the CUDA kernels, contiguous and paged caches.

- A NaN or an infinity in a query, or in a key a head reads, makes that head's output row
  NaN (every kernel: exact on the CUDA and tensor cores, with one chunk and with a split
  merge; S²ANTA-prop with pass 1 on both core types and Bernoulli scores, token-major and
  feature-major; S²ANTA-flash on both core types; Double-P centroid, top-k clusters and
  the sampled variant). The reference's pattern (``reference.common.nonfinite_rows``) is
  the expected one; the other rows are finite, rows of other (sequence, KV head) groups
  equal the clean call bit for bit, and the other heads of a hit group equal it to a few
  output ulps (the flash and Double-P kernels share draws and row lists across a group,
  so their order of additions may change). The paged cache (same tokens, shuffled pages,
  NaN in unused pages and slots) gives the contiguous output bit for bit, NaN included.
  prop's NaN rows draw nothing (indices -1).
- Keys and values past ``seq_lens`` are not read: the output is the clean call's, bit for bit.
- A non-finite value row reaches exactly the heads that read it: exact and Double-P's
  window rows, the whole group; the sampled estimators, the heads that drew it (their
  returned indices, which the value does not move).

The bad key lies in the last (window) row of sequence 1, at the feature where head 0 of
its group has its largest |q| (a feature every Bernoulli pattern of that head keeps:
p = 1), so every estimator reads it. Sizes are small: the file runs in well under a
minute once the kernels are compiled.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn.cuda import doublep as dp  # noqa: E402
from stochattn.cuda.doublep import doublep_decode  # noqa: E402
from stochattn.cuda.exact import exact_decode  # noqa: E402
from stochattn.cuda.flash import santa_flash  # noqa: E402
from stochattn.cuda.santa import santa_prop  # noqa: E402
from stochattn.paged import from_contiguous  # noqa: E402
from stochattn.reference.common import nonfinite_rows  # noqa: E402

from gpu_helpers import peaked_inputs, to_device, to_host, to_host64  # noqa: E402
from paged_helpers import gpu_paged  # noqa: E402

pytestmark = pytest.mark.gpu

B, HKV, G, N, D = 2, 2, 2, 640, 128
LENS = np.array([640, 389], dtype=np.int32)
INDEX = dict(n_clusters=8, n_sink=4, window=32, seed=1)
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # one ulp at 1.0 of the output dtype
SAMPLE_PAGED = not dp._sample_pages_missing()


def _feature_major(kd):
    """(B, Hkv, D, L) copy of k, L = N rounded up to 8 (padding NaN: never read)."""
    Bk, Hk, Nk, Dk = kd.shape
    L = -(-Nk // 8) * 8
    if type(kd).__module__.split(".")[0] == "torch":
        out = kd.new_full((Bk, Hk, Dk, L), float("nan"))
        out[..., :Nk] = kd.transpose(2, 3)
        return out
    out = cupy.full((Bk, Hk, Dk, L), cupy.nan, dtype=kd.dtype)
    out[..., :Nk] = kd.transpose(0, 1, 3, 2)
    return out


_PROP = dict(budget=48, tile_size=64, seed=3, offset=5)
_FLASH = dict(budget=48, tile_size=64, seed=3, offset=5)
_DOUBLEP = {"centroid": dict(p1=0.9, p2=0.6), "topk": dict(clusters=3),
            "sample": dict(p1=0.95, p2=0.5, budget=24, seed=7, offset=3)}


def _run(name, q, k, v, cache, index):
    """``(out, indices or None)`` of estimator ``name`` as host arrays: on the contiguous
    cache (k, v) when ``cache`` is None, else on the paged one."""
    kv = (k, v, LENS) if cache is None else (cache, None, None)
    if name.startswith("exact"):
        kernel = name.split()[1]
        chunks = 3 if name.endswith("split") else None
        out = exact_decode(q, *kv, kernel=kernel, num_chunks=chunks)
        return to_host64(out), None
    if name.startswith("prop"):
        opts = dict(_PROP, return_indices=True)
        if name == "prop simt":
            opts["kernel"] = "simt"
        elif name.startswith("prop bernoulli"):
            opts.update(scores="bernoulli", bernoulli_draws=2)
            if name.endswith("fm"):
                opts["k_feature_major"] = _feature_major(k)
        out, idx = santa_prop(q, *kv, **opts)
        return to_host64(out), to_host(idx).astype(np.int64)
    if name.startswith("flash"):
        kernel = name.split()[1]
        chunks = 3 if name.endswith("split") else None
        out, idx = santa_flash(q, *kv, kernel=kernel, num_chunks=chunks, return_indices=True,
                               **_FLASH)
        return to_host64(out), to_host(idx).astype(np.int64)
    mode = name.split()[1]
    kk, vv = (k, v) if cache is None else (cache, None)
    if mode == "sample":
        out, idx = doublep_decode(q, kk, vv, index, return_indices=True, **_DOUBLEP[mode])
        return to_host64(out), to_host(idx).astype(np.int64)
    return to_host64(doublep_decode(q, kk, vv, index, **_DOUBLEP[mode])), None


ESTIMATORS = ("exact simt", "exact tc", "exact simt split", "exact tc split", "prop tc",
              "prop simt", "prop bernoulli", "prop bernoulli fm", "flash simt", "flash tc",
              "flash simt split", "doublep centroid", "doublep topk", "doublep sample")


def _paged_ok(name):
    if name.endswith("fm"):
        return False  # the feature-major keys have no paged form
    return not (name == "doublep sample" and not SAMPLE_PAGED)


_CLEAN: dict = {}


def _clean(dtype):
    """float64 host q, k, v (the values the GPU holds) and the Double-P index of the clean
    keys (cached per dtype)."""
    if dtype not in _CLEAN:
        q, k, v = peaked_inputs(B, HKV, G, N, D, seed=11)
        qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
        index = stochattn.build_doublep_index(kd, vd, LENS, **INDEX)
        _CLEAN[dtype] = (to_host64(qd), to_host64(kd), to_host64(vd), index)
    q, k, v, index = _CLEAN[dtype]
    return q.copy(), k.copy(), v.copy(), index


def _device(dtype, q, k, v, paged):
    qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
    cache = None
    if paged:
        host = from_contiguous(k.astype(np.float32), v.astype(np.float32), LENS, page_size=16,
                               layout="NHD", shuffle_seed=1, extra_pages=2)
        cache = gpu_paged(host, dtype)
    return qd, kd, vd, cache


def _call(name, dtype, q, k, v, index, paged=False):
    qd, kd, vd, cache = _device(dtype, q, k, v, paged)
    return _run(name, qd, kd, vd, cache, index)


def _groups(rows):
    """(B, Hq) bool: the rows whose (sequence, KV head) group holds a row of ``rows``."""
    return np.repeat(rows.reshape(B, HKV, G).any(axis=2), G, axis=1)


def _assert_rest(got, clean, hit, dtype):
    """Rows outside ``hit``: finite; other groups bit for bit the clean call's, the rest of
    a hit group within a few output ulps of it."""
    assert np.isfinite(got[~hit]).all()
    other = ~_groups(hit)
    np.testing.assert_array_equal(got[other], clean[other])
    near = _groups(hit) & ~hit
    eps = _EPS[dtype]
    np.testing.assert_allclose(got[near], clean[near], rtol=4 * eps, atol=4 * eps)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["q", "k"])
def test_a_nonfinite_query_or_key_gives_nan_rows_of_the_heads_that_read_it(dtype, name, bad,
                                                                           where):
    q, k, v, index = _clean(dtype)
    clean, _ = _call(name, dtype, q, k, v, index)
    if where == "q":
        q[1, 3, 5] = bad  # one head of sequence 1
    else:
        f = int(np.argmax(np.abs(q[1, 0])))  # head 0's largest feature: Bernoulli keeps it
        k[1, 0, LENS[1] - 1, f] = bad  # the window row of sequence 1, KV head 0: heads 0, 1
    hit = nonfinite_rows(q, k, LENS)
    assert hit.sum() == (1 if where == "q" else G)
    got, idx = _call(name, dtype, q, k, v, index)
    assert np.isnan(got[hit]).all(), (name, np.argwhere(~np.isnan(got) & hit[..., None])[:4])
    _assert_rest(got, clean, hit, dtype)
    if name.startswith("prop"):
        assert (idx[hit] == -1).all()  # a NaN row draws nothing
    if _paged_ok(name):
        paged, _ = _call(name, dtype, q, k, v, index, paged=True)
        np.testing.assert_array_equal(paged, got)  # NaN in the same places


@pytest.mark.parametrize("name", ESTIMATORS)
def test_keys_and_values_past_seq_lens_are_not_read(name):
    q, k, v, index = _clean("float16")
    clean, _ = _call(name, "float16", q, k, v, index)
    k[1, :, LENS[1] + 5], v[1, :, LENS[1] + 5] = np.nan, np.inf  # past seq_lens[1]
    got, _ = _call(name, "float16", q, k, v, index)
    np.testing.assert_array_equal(got, clean)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_value_row_reaches_the_heads_that_read_it(name, bad):
    q, k, v, index = _clean("float16")
    clean, clean_idx = _call(name, "float16", q, k, v, index)
    group = np.zeros((B, HKV * G), bool)
    group[0, G:2 * G] = True  # sequence 0, KV head 1: heads 2, 3
    sampled = not name.startswith(("exact", "doublep"))
    # Exact reads every row and Double-P every window row (the last one here); a sampled
    # estimator reads the rows it draws: the first draw of head 2 (a value moves no draw).
    row = int(clean_idx[0, G, 0]) if sampled else LENS[0] - 1
    v[0, 1, row, 0] = bad
    got, idx = _call(name, "float16", q, k, v, index)
    read = group.copy()
    if sampled:
        np.testing.assert_array_equal(idx, clean_idx)
        read[0, G:2 * G] = (idx[0, G:2 * G] == row).any(axis=-1)
        assert read[0, G]
    assert not np.isfinite(got[read][:, 0]).any()
    assert np.isfinite(got[~read]).all()
    np.testing.assert_array_equal(got[~group], clean[~group])  # other groups untouched
    if _paged_ok(name):
        paged, _ = _call(name, "float16", q, k, v, index, paged=True)
        np.testing.assert_array_equal(paged, got)
