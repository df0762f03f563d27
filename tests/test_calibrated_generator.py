"""stochattn.eval.calibrated: shapes, dtypes, determinism, and the calibrated statistics at 2k.

The statistics test is not a statistical test: the generator is deterministic given its
seed (fixed here), so the figures are fixed numbers, checked against stated ranges around
the real SmolLM2 values (docs/generator.md); it fails only if the generator or its fitted
table changes.
"""

import numpy as np
import pytest

from stochattn.eval.calibrated import make_calibrated_inputs
from stochattn.eval.compare_stats import stats_from_logits


def _stats(q, k):
    G = q.shape[1] // k.shape[1]
    kk = np.repeat(k, G, axis=1).astype(np.float64)
    x = np.einsum("bhnd,bhd->bhn", kk, q.astype(np.float64)) / np.sqrt(q.shape[-1])
    return stats_from_logits(x)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_shapes_dtypes(dtype):
    q, k, v = make_calibrated_inputs(2, 6, 3, 100, 16, seed=1, dtype=dtype)
    assert q.shape == (2, 6, 16) and k.shape == v.shape == (2, 3, 100, 16)
    assert q.dtype == k.dtype == v.dtype == np.dtype(dtype)
    assert all(np.isfinite(a).all() for a in (q, k, v))


def test_determinism_by_seed():
    a = make_calibrated_inputs(1, 4, 2, 300, 32, seed=7)
    b = make_calibrated_inputs(1, 4, 2, 300, 32, seed=7)
    c = make_calibrated_inputs(1, 4, 2, 300, 32, seed=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[1], c[1])


def test_tiny_context_and_errors():
    q, k, v = make_calibrated_inputs(1, 2, 1, 1, 8, seed=0)     # one token: the sink
    assert k.shape == (1, 1, 1, 8)
    with pytest.raises(ValueError, match="`q_heads` must be a multiple of `kv_heads`"):
        make_calibrated_inputs(1, 3, 2, 10, 8, seed=0)
    with pytest.raises(ValueError, match="`head_dim` must be >= 4"):
        make_calibrated_inputs(1, 2, 1, 10, 2, seed=0)
    with pytest.raises(ValueError, match="`tokens` must be >= 1"):
        make_calibrated_inputs(1, 2, 1, 0, 8, seed=0)
    with pytest.raises(ValueError, match="`profile`"):
        make_calibrated_inputs(1, 2, 1, 10, 8, seed=0, profile="llama")


def test_statistics_at_2k_in_calibrated_ranges():
    """64 heads (B 8, Hq 8, Hkv 2, N 2048, D 64, seed 2026): median over heads.

    Real SmolLM2 at 2048 tokens (hamlet / macbeth, per-head means): keys for 50% 5 / 4,
    for 95% 119 / 108, for 99% 402 / 372, sink mass 22% / 28%, window mass 31% / 32%.
    Ranges: within a factor 2 for counts, +-0.15 absolute for masses (window, which the
    model underestimates, down to 0.15). This seed gives 4, 87.5, 287, 0.32, 0.185.
    """
    q, k, _ = make_calibrated_inputs(8, 8, 2, 2048, 64, seed=2026)
    st = _stats(q, k)
    med = {key: float(np.median(a)) for key, a in st.items()}
    assert 2 <= med["key_fraction_50"] * 2048 <= 10
    assert 55 <= med["key_fraction_95"] * 2048 <= 240
    assert 190 <= med["key_fraction_99"] * 2048 <= 800
    assert 0.07 <= med["sink_mass"] <= 0.43
    assert 0.15 <= med["window_mass"] <= 0.47
    # Spread over heads: the quartiles of keys for 95% straddle a factor >= 4 (real: ~10).
    q1, q3 = np.percentile(st["key_fraction_95"], [25, 75])
    assert q3 / q1 >= 4
