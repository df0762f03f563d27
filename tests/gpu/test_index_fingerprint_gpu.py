"""The Double-P index's fingerprint on a real GPU (stochattn/cuda/doublep_index.py:
``fingerprint_gpu`` at build, ``fingerprint_rows_gpu`` at a checked decode; the rule is
docs/conventions.md's "An index knows what it indexes", the CPU half
tests/test_index_fingerprint.py).

- The build records, on the index's device and in its framework, the reference's positions
  and exact float32 copies of the key rows there (host or device lengths; a build from a
  paged cache records what the contiguous build records).
- With ``check_finite=True`` an index of other keys of the same shape is a ValueError naming
  ``index`` and the first differing (sequence, head, token), for the functions and the
  plans, contiguous and paged; its own index passes, with the unchecked call's output bit
  for bit, on paged caches with shuffled pages (moved between calls), after GPU appends
  (contiguous and paged, token by token) and stacked.
- With checks off nothing of it is read (check_keys and fingerprint_rows_gpu never called)
  and a warmed plan run with ``out`` still allocates nothing.
- An index whose arrays do not match the call's shapes (another batch, a hand-made index
  with one array cut) is a ValueError naming the attribute (`index.centroids`,
  `index.value_sums`, ...) with its shape and the expected one, from the functions and the
  plans, contiguous and paged (tests/test_index_fingerprint.py runs the same check's host
  code on NumPy stand-ins).

float16 runs on CuPy, bfloat16 on torch (gpu_helpers.to_device).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn import DoublePIndex  # noqa: E402
from stochattn.cuda import doublep_index as gpu  # noqa: E402
from stochattn.doublep import FINGERPRINT_ROWS, _fingerprint_positions  # noqa: E402
from stochattn.paged import from_contiguous  # noqa: E402

from gpu_helpers import peaked_inputs, to_device, to_host64  # noqa: E402
from paged_helpers import CountingAllocator, assert_bitwise, gpu_paged, host  # noqa: E402

pytestmark = pytest.mark.gpu

B, HKV, G, N, D = 3, 2, 4, 300, 64
LENS = np.array([N, 0, 171], dtype=np.int32)  # full, empty, odd
INDEX = dict(n_clusters=8, n_sink=4, window=16, iterations=3, seed=1)
DTYPES = ["float16", "bfloat16"]
DECODE = dict(p1=0.9, p2=0.6)
FOREIGN = r"`index` must be built from this cache"


def is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def device_lens(lens, like):
    if is_torch(like):
        import torch

        return torch.tensor(lens, device="cuda")
    return cupy.asarray(lens)


def cat(xs):
    if is_torch(xs[0]):
        import torch

        return torch.cat(list(xs), dim=0)
    return cupy.concatenate(xs, axis=0)


def clone(x):
    return x.clone() if is_torch(x) else x.copy()


def empty_out(q):
    if is_torch(q):
        import torch

        return torch.empty(tuple(q.shape), dtype=q.dtype, device=q.device)
    return cupy.empty(q.shape, dtype=q.dtype)


def inputs(dtype, seed=0):
    """GPU q, k, v of ``dtype`` and the float32 host values of k and v (exact)."""
    q, k, v = peaked_inputs(B, HKV, G, N, D, seed=seed)
    qd, kd, vd = (to_device(x, dtype) for x in (q, k, v))
    return qd, kd, vd, to_host64(kd).astype(np.float32), to_host64(vd).astype(np.float32)


def build(k, v, lens=LENS):
    return stochattn.build_doublep_index(k, v, lens, **INDEX)


def paged(k32, v32, lens, dtype, *, page_size=16, layout="NHD", combined=False, shuffle=1):
    return gpu_paged(from_contiguous(k32, v32, lens, page_size=page_size, layout=layout,
                                     shuffle_seed=shuffle, extra_pages=2), dtype, combined)


def expected_keys(k32, pos):
    rows = k32[np.arange(pos.shape[0])[:, None], :, np.maximum(pos, 0)]  # (B, S, Hkv, D)
    return np.where((pos >= 0)[:, None, :, None], rows.transpose(0, 2, 1, 3), 0)


# ---- what the build records ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens_on", ["host", "device"])
def test_build_records_the_fingerprint_on_the_device(dtype, lens_on):
    q, k, v, k32, v32 = inputs(dtype)
    lens = LENS if lens_on == "host" else device_lens(LENS, k)
    index = build(k, v, lens)
    for name in ("fingerprint_positions", "fingerprint_keys"):
        a = getattr(index, name)
        assert type(a) is type(index.centroids), name  # the index's framework and device
        assert (a.get_device() if is_torch(a) else a.data.device_id) == \
            (k.get_device() if is_torch(k) else k.data.device_id)
    pos, keys = host(index.fingerprint_positions), host(index.fingerprint_keys)
    np.testing.assert_array_equal(pos, _fingerprint_positions(LENS))
    assert keys.dtype == np.float32 and keys.shape == (B, HKV, FINGERPRINT_ROWS, D)
    np.testing.assert_array_equal(keys, expected_keys(k32, pos))
    # A build from the paged cache records the same (the prefix gathered by positions).
    from_pages = stochattn.build_doublep_index(paged(k32, v32, LENS, dtype, layout="HND",
                                                     combined=True), **INDEX)
    np.testing.assert_array_equal(host(from_pages.fingerprint_positions), pos)
    np.testing.assert_array_equal(host(from_pages.fingerprint_keys), keys)


# ---- a foreign index is an error with checks on -------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_foreign_index_of_the_same_shape_is_an_error(dtype):
    q, k, v, _, _ = inputs(dtype)
    _, k2, v2, _, _ = inputs(dtype, seed=1)
    own, foreign = build(k, v), build(k2, v2)
    want = stochattn.doublep_attention(q, k, v, LENS, index=own, **DECODE)
    got = stochattn.doublep_attention(q, k, v, LENS, index=own, check_finite=True, **DECODE)
    assert_bitwise(got, want, "checked vs unchecked")
    with pytest.raises(ValueError, match=FOREIGN + r".*at sequence 0, head 0, the key of token 0 "
                                        r"differs .*\(32 of 32 recorded key rows differ\)"):
        stochattn.doublep_attention(q, k, v, LENS, index=foreign, check_finite=True, **DECODE)
    with pytest.raises(ValueError, match=FOREIGN):
        stochattn.cluster_topk_attention(q, k, v, LENS, index=foreign, k_clusters=3,
                                         check_finite=True)
    for plan in (stochattn.DoublePPlan(device="cuda", check_finite=True, **DECODE),
                 stochattn.ClusterTopKPlan(k_clusters=3, device="cuda", check_finite=True)):
        with pytest.raises(ValueError, match=FOREIGN):
            plan.run(q, k, v, LENS, index=foreign)
        plan.run(q, k, v, LENS, index=own)
    # Unchecked (the default), the foreign index is used silently, as documented.
    stochattn.doublep_attention(q, k, v, LENS, index=foreign, **DECODE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_changed_key_and_a_short_cache_are_named(dtype):
    q, k, v, _, _ = inputs(dtype)
    index = build(k, v)
    last = int(LENS[2]) - 1
    bad = clone(k)
    bad[2, 1, last, 3] += 1
    with pytest.raises(ValueError, match=rf"at sequence 2, head 1, the key of token {last} "
                                         rf"differs .*\(1 of 32 recorded key rows differ\)"):
        stochattn.doublep_attention(q, bad, v, LENS, index=index, check_finite=True, **DECODE)
    with pytest.raises(ValueError, match=r"at sequence 0, head 0, token \d+ lies past the "
                                         r"cache's 200 tokens"):
        index.check_keys(k[:, :, :200])
    with pytest.raises(ValueError, match=r"`k` must match the index"):
        index.check_keys(k[:2])


# ---- paged caches, appends, stacks --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size, layout, combined", [(1, "NHD", False), (3, "HND", True),
                                                         (16, "NHD", True), (128, "HND", False)])
def test_paged_cache_with_shuffled_pages_passes(dtype, page_size, layout, combined):
    q, k, v, k32, v32 = inputs(dtype)
    index = build(k, v)
    want = stochattn.doublep_attention(q, k, v, LENS, index=index, **DECODE)
    plan = stochattn.DoublePPlan(device="cuda", check_finite=True, **DECODE)
    for shuffle in (1, 2):  # the pages move between calls: the index keeps positions
        cache = paged(k32, v32, LENS, dtype, page_size=page_size, layout=layout,
                      combined=combined, shuffle=shuffle + page_size)
        assert_bitwise(plan.run(q, cache, index=index), want, (page_size, layout, shuffle))
        index.check_keys(cache)
    stochattn.ClusterTopKPlan(k_clusters=3, device="cuda", check_finite=True).run(
        q, cache, index=index)
    _, _, _, k32b, v32b = inputs(dtype, seed=1)
    foreign = paged(k32b, v32b, LENS, dtype, page_size=page_size, layout=layout,
                    combined=combined)
    with pytest.raises(ValueError, match=FOREIGN + ".*at sequence 0, head 0"):
        plan.run(q, foreign, index=index)


@pytest.mark.parametrize("dtype", DTYPES)
def test_appends_keep_the_fingerprint(dtype):
    """Contiguous and paged GPU appends, token by token: the fingerprint arrays do not
    change and checked decodes pass all along."""
    q, k, v, k32, v32 = inputs(dtype)
    L0 = np.array([250, 0, 120], dtype=np.int32)
    L1 = np.array([N, 7, 171], dtype=np.int32)
    base = build(k, v, L0)
    pos0, keys0 = host(base.fingerprint_positions), host(base.fingerprint_keys)
    flat, pages = DoublePIndex.stack([base]), DoublePIndex.stack([base])
    plan = stochattn.DoublePPlan(device="cuda", check_finite=True, **DECODE)
    for step in range(1, int((L1 - L0).max()) + 1):
        lens = np.minimum(L0 + step, L1).astype(np.int32)
        flat.append(k, v, lens)
        cache = paged(k32, v32, lens, dtype, shuffle=step)
        pages.append(cache)
        if step % 10 == 1 or (lens == L1).all():
            want = plan.run(q, k, v, lens, index=flat)
            assert_bitwise(plan.run(q, cache, index=pages), want, ("step", step))
    for ix in (flat, pages):
        np.testing.assert_array_equal(host(ix.fingerprint_positions), pos0)
        np.testing.assert_array_equal(host(ix.fingerprint_keys), keys0)
    _, k2, v2, _, _ = inputs(dtype, seed=1)
    with pytest.raises(ValueError, match=FOREIGN):
        plan.run(q, k2, v2, L1, index=flat)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stack_keeps_the_fingerprints(dtype):
    q, k, v, _, _ = inputs(dtype)
    _, k2, v2, _, _ = inputs(dtype, seed=1)
    stacked = DoublePIndex.stack([build(k, v), build(k2, v2)])
    assert tuple(stacked.fingerprint_keys.shape) == (2 * B, HKV, FINGERPRINT_ROWS, D)
    lens = np.concatenate([LENS, LENS])
    qq, kk, vv = cat([q, q]), cat([k, k2]), cat([v, v2])
    stochattn.doublep_attention(qq, kk, vv, lens, index=stacked, check_finite=True, **DECODE)
    with pytest.raises(ValueError, match="at sequence 3, head 0, the key of token 0"):
        stochattn.doublep_attention(qq, cat([k, k]), vv, lens, index=stacked, check_finite=True,
                                    **DECODE)


# ---- checks off: nothing read, nothing allocated ------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_checks_off_read_no_fingerprint_and_allocate_nothing(dtype, monkeypatch):
    q, k, v, k32, v32 = inputs(dtype)
    index = build(k, v)
    cache = paged(k32, v32, LENS, dtype, layout="HND", combined=True)

    def never(*args, **kwargs):
        raise AssertionError("the fingerprint was read with checks off")

    monkeypatch.setattr(DoublePIndex, "check_keys", never)
    monkeypatch.setattr(gpu, "fingerprint_rows_gpu", never)
    plan = stochattn.DoublePPlan(device="cuda", **DECODE)
    out = empty_out(q)
    assert plan.run(q, cache, index=index, out=out) is out  # warm-up: the plan's workspace
    stochattn.doublep_attention(q, k, v, LENS, index=index, **DECODE)
    stochattn.cluster_topk_attention(q, cache, index=index, k_clusters=3)
    torch_before = None
    if is_torch(q):
        import torch

        torch.cuda.synchronize()
        torch_before = torch.cuda.memory_stats()["allocation.all.allocated"]
    with CountingAllocator() as counter:
        assert plan.run(q, cache, index=index, out=out) is out
    assert counter.count == 0
    if torch_before is not None:
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == torch_before


# ---- an index of other shapes names the attribute -----------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_index_of_other_shapes_names_the_attribute(dtype):
    """Checks off (the default; with check_finite=True check_keys reports the mismatch
    first, naming `k`, as on the reference): the GPU decode's plan checks every index array
    against the call and names the one that differs, with its shape and the expected one."""
    q, k, v, k32, v32 = inputs(dtype)
    index = build(k, v)
    C = int(index.centroids.shape[2])
    # A call of batch 2 with the batch-3 index: index.centroids is named first.
    other_batch = re.escape(f"`index.centroids` has shape {(B, HKV, C, D)}, expected (batch, "
                            f"kv_heads, clusters, head_dim) = {(2, HKV, C, D)}: batch 2, "
                            f"kv_heads {HKV} and head_dim {D} of this call's `q` and `k`")
    q2, k2, v2 = q[:2], k[:2], v[:2]
    with pytest.raises(ValueError, match=other_batch):
        stochattn.doublep_attention(q2, k2, v2, index=index, **DECODE)
    with pytest.raises(ValueError, match=other_batch):
        stochattn.doublep_attention(q2, k2, v2, index=index, approx="sample", budget=8, seed=1,
                                    p1=0.9, p2=0.6)
    with pytest.raises(ValueError, match=other_batch):
        stochattn.cluster_topk_attention(q2, k2, v2, index=index, k_clusters=3)
    cache2 = paged(k32[:2], v32[:2], LENS[:2], dtype, layout="HND", combined=True)
    with pytest.raises(ValueError, match=other_batch):
        stochattn.DoublePPlan(device="cuda", **DECODE).run(q2, cache2, index=index)
    # A hand-made index with one array cut: that array is named.
    for name, cut, got, want in (
            ("value_sums", lambda a: a[:, :, :-1], (B, HKV, C - 1, D), (B, HKV, C, D)),
            ("sizes", lambda a: a[:, :, :-1], (B, HKV, C - 1), (B, HKV, C)),
            ("labels", lambda a: a[:2], (2, HKV, int(index.labels.shape[2])),
             (B, HKV, int(index.labels.shape[2]))),
            ("window_start", lambda a: a[:2], (2,), (B,))):
        bad = dataclasses.replace(index, **{name: cut(getattr(index, name))})
        message = re.escape(f"`index.{name}` has shape {got}, expected ") + r"\(.*\) = " \
            + re.escape(f"{want}: ")
        with pytest.raises(ValueError, match=message):
            stochattn.doublep_attention(q, k, v, index=bad, **DECODE)
        with pytest.raises(ValueError, match=message):
            stochattn.DoublePPlan(device="cuda", **DECODE).run(
                q, paged(k32, v32, LENS, dtype), index=bad)
    stochattn.doublep_attention(q, k, v, index=index, **DECODE)  # its own index still runs
