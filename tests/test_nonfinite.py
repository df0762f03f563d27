"""Non-finite input on the reference (docs/conventions.md): a NaN or an infinity in a query
or in a key a head reads turns that head's output row into NaN, as torch SDPA's does; never
a zero row, never a finite wrong answer. Heads that read nothing non-finite are unchanged
bit for bit, and keys past ``seq_lens`` are not read. A Double-P index is never built over
non-finite keys. Exact properties, asserted exactly."""

from __future__ import annotations

import numpy as np
import pytest

import stochattn

B, HKV, G, N, D = 2, 2, 2, 48, 8
LENS = np.array([48, 30])

ESTIMATORS = {
    "exact": lambda q, k, v: stochattn.exact_attention(q, k, v, LENS),
    "santa prop systematic": lambda q, k, v: stochattn.santa_attention(
        q, k, v, LENS, budget=16, tile_size=8, seed=3),
    "santa prop iid": lambda q, k, v: stochattn.santa_attention(
        q, k, v, LENS, budget=16, tile_size=8, sampler="iid", seed=3),
    "santa flash stratified": lambda q, k, v: stochattn.santa_attention(
        q, k, v, LENS, budget=16, tile_size=8, sampler="stratified", schedule="flash", seed=3),
    "santa bernoulli scores": lambda q, k, v: stochattn.santa_attention(
        q, k, v, LENS, budget=16, tile_size=8, scores="bernoulli", seed=3),
    "topk": lambda q, k, v: stochattn.topk_attention(q, k, v, LENS, k_tokens=8),
    "quest": lambda q, k, v: stochattn.quest_attention(q, k, v, LENS, k_tokens=16),
    "top_p": lambda q, k, v: stochattn.top_p_attention(q, k, v, LENS, p=0.9),
}


def _inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, HKV * G, D)), rng.standard_normal((B, HKV, N, D)),
            rng.standard_normal((B, HKV, N, D)))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["q", "k"])
def test_a_nonfinite_query_or_key_gives_nan_rows_of_the_heads_that_read_it(name, bad, where):
    f = ESTIMATORS[name]
    q, k, v = _inputs()
    clean = f(q, k, v)
    if where == "q":
        q[1, 3, 5] = bad  # one head of sequence 1
        hit = np.zeros((B, HKV * G), bool)
        hit[1, 3] = True
    else:
        k[1, 0, 7, 2] = bad  # a visible key of KV head 0 of sequence 1: heads 0 and 1
        hit = np.zeros((B, HKV * G), bool)
        hit[1, :G] = True
    out = f(q, k, v)
    assert np.isnan(out[hit]).all()
    np.testing.assert_array_equal(out[~hit], clean[~hit])


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_keys_and_values_past_seq_lens_are_not_read(name):
    f = ESTIMATORS[name]
    q, k, v = _inputs()
    clean = f(q, k, v)
    k[1, :, 35], v[1, :, 35] = np.nan, np.inf  # token 35 >= seq_lens[1] = 30
    np.testing.assert_array_equal(f(q, k, v), clean)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_exact_propagates_a_nonfinite_value_row_to_its_group(bad):
    q, k, v = _inputs()
    v[0, 1, 4, 0] = bad
    out = stochattn.exact_attention(q, k, v, LENS)
    assert not np.isfinite(out[0, G:2 * G, 0]).any()
    assert np.isfinite(out[0, :G]).all() and np.isfinite(out[1]).all()


def test_check_finite_still_raises_first():
    q, k, v = _inputs()
    k[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="k"):
        stochattn.exact_attention(q, k, v, LENS, check_finite=True)


def test_an_index_is_never_built_over_nonfinite_keys():
    q, k, v = _inputs()
    k[1, 1, 12, 3] = np.nan
    with pytest.raises(ValueError, match="sequence 1, head 1, token 12"):
        stochattn.build_doublep_index(k, v, LENS, n_clusters=4)
    k[1, 1, 12, 3] = 0.0
    k[1, 1, 40, 3] = np.inf  # past seq_lens[1]: not read
    stochattn.build_doublep_index(k, v, LENS, n_clusters=4)
