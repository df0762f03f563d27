"""The log-sum-exp output of exact decode (``return_lse``) on the reference: its values
against a max-shifted NumPy log-sum-exp, empty and non-finite rows, the API's errors, and the identity
that makes it useful: exact attention over a cache is the merge of exact partials
``(m=lse, l=1, acc=out)`` over disjoint token sets (cascade, context-parallel decode)."""

import numpy as np
import pytest

import stochattn
from stochattn import ExactPlan
from stochattn.context_parallel import merge_partials
from stochattn.reference import exact as ref


def logsumexp(x, axis):
    """ln sum exp(x) along ``axis``, shifted by the max (float64; finite inputs)."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=axis, keepdims=True)
    return np.squeeze(m, axis) + np.log(np.exp(x - m).sum(axis=axis))


def _inputs(seed, B=3, Hq=8, Hkv=2, N=50, D=16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, D)), rng.standard_normal((B, Hkv, N, D)),
            rng.standard_normal((B, Hkv, N, D)))


def _partial(out, lse):
    """``(m, l, acc)`` of an exact output and its lse (l = 0 for an empty part)."""
    live = np.isfinite(lse) | np.isnan(lse)
    return np.where(live, lse, 0.0), live.astype(np.float64), out


def test_lse_matches_logsumexp():
    q, k, v = _inputs(0)
    lens = np.array([50, 17, 1])
    scale = 0.37
    _, lse = ref.exact_attention(q, k, v, lens, scale, return_lse=True)
    G = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        kb = np.repeat(k[b, :, :lens[b]], G, axis=0)  # (Hq, len, D)
        x = scale * np.einsum("hd,hnd->hn", q[b], kb)
        np.testing.assert_allclose(lse[b], logsumexp(x, axis=-1), rtol=1e-13, atol=1e-13)
    assert lse.dtype == np.float64 and lse.shape == (3, 8)


def test_lse_of_large_logits_does_not_overflow():
    q, k, v = _inputs(1)
    _, lse = ref.exact_attention(q * 1e3, k, v, None, 1.0, return_lse=True)
    assert np.isfinite(lse).all()


def test_empty_rows_are_minus_inf_and_nonfinite_rows_nan():
    q, k, v = _inputs(2)
    q[1, 3, 0] = np.nan  # one head of sequence 1
    k[2, 1, 4, 5] = np.inf  # a live key of KV head 1 of sequence 2: heads 4..7
    out, lse = ref.exact_attention(q, k, v, np.array([0, 50, 50]), 0.25, return_lse=True)
    assert np.isneginf(lse[0]).all() and (out[0] == 0).all()
    assert np.isnan(lse[1, 3]) and np.isfinite(np.delete(lse[1], 3)).all()
    assert np.isnan(lse[2, 4:]).all() and np.isfinite(lse[2, :4]).all()
    assert (np.isnan(lse) == np.isnan(out).all(axis=-1)).all()
    k[2, 1, 4, 5] = 0.0
    k[2, 1, 49, 0] = np.nan  # past seq_lens: never read
    _, lse = ref.exact_attention(q, k, v, np.array([0, 50, 49]), 0.25, return_lse=True)
    assert np.isfinite(lse[2]).all()


@pytest.mark.parametrize("cut", [1, 20, 49])
def test_merge_of_two_halves_is_the_whole(cut):
    """exact(all tokens) == merge_partials of (lse, 1, out) over tokens [0, cut) and
    [cut, N) (empty parts, l = 0: test_merge_of_token_shards_with_seq_lens)."""
    q, k, v = _inputs(3)
    scale = 0.3
    whole, lse = ref.exact_attention(q, k, v, None, scale, return_lse=True)
    parts = [ref.exact_attention(q, k[:, :, s], v[:, :, s], None, scale, return_lse=True)
             for s in (slice(0, cut), slice(cut, None))]
    m, l, acc = (np.stack(x) for x in zip(*(_partial(o, e) for o, e in parts)))
    np.testing.assert_allclose(merge_partials(m, l, acc), whole, rtol=1e-12, atol=1e-12)
    # and the merged lse is the whole's: ln sum_r exp(lse_r)
    np.testing.assert_allclose(logsumexp(np.stack([e for _, e in parts]), axis=0), lse,
                               rtol=1e-12, atol=1e-12)


def test_merge_of_token_shards_with_seq_lens():
    """R = 3 shards of a cache with per-sequence lengths: each shard's live tokens are the
    sequence's tokens that fall in it."""
    q, k, v = _inputs(4, N=60)
    lens = np.array([60, 25, 0])
    whole = ref.exact_attention(q, k, v, lens, 0.2)
    bounds = [0, 20, 40, 60]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        shard_lens = np.clip(lens - a, 0, b - a)
        parts.append(_partial(*ref.exact_attention(q, k[:, :, a:b], v[:, :, a:b], shard_lens, 0.2,
                                                   return_lse=True)))
    m, l, acc = (np.stack(x) for x in zip(*parts))
    np.testing.assert_allclose(merge_partials(m, l, acc), whole, rtol=1e-12, atol=1e-12)


def test_public_function_and_plan_return_lse():
    q, k, v = _inputs(5)
    out0 = stochattn.exact_attention(q, k, v)
    out, lse = stochattn.exact_attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, out0)
    np.testing.assert_array_equal(lse, ref.log_sum_exp(q, k, None, 1 / np.sqrt(16)))
    out, lse2, diag = stochattn.exact_attention(q, k, v, return_lse=True, return_diagnostics=True)
    np.testing.assert_array_equal(lse2, lse)
    assert diag.seq_lens.shape == (3,)
    plan = ExactPlan(q_heads=8, kv_heads=2, head_dim=16, dtype="float64")
    buf = np.empty_like(out0)
    o, lse3 = plan.run(q, k, v, out=buf, return_lse=True)
    assert o is buf
    np.testing.assert_array_equal(o, out0)
    np.testing.assert_array_equal(lse3, lse)


def test_api_errors_name_the_argument():
    q, k, v = _inputs(6)
    with pytest.raises(TypeError, match="`return_lse` must be a bool"):
        stochattn.exact_attention(q, k, v, return_lse=1)
    plan = ExactPlan(q_heads=8, kv_heads=2, head_dim=16, dtype="float64")
    with pytest.raises(ValueError, match="`lse` is an output of return_lse=True"):
        plan.run(q, k, v, lse=np.empty((3, 8), np.float32))
    with pytest.raises(TypeError, match="`lse` is a preallocated GPU output"):
        plan.run(q, k, v, return_lse=True, lse=np.empty((3, 8), np.float32))


def test_cuda_entry_checks_options_before_touching_the_gpu():
    """The GPU function refuses a non-bool ``return_lse`` and an ``lse`` without it before
    any array is read (so this runs without CuPy)."""
    from stochattn.cuda.exact import exact_decode

    with pytest.raises(TypeError, match="`return_lse` must be a bool"):
        exact_decode(None, None, return_lse="yes")
    with pytest.raises(ValueError, match="`lse` is an output of return_lse=True"):
        exact_decode(None, None, lse=object())
