"""The host half of the GPU flash wrapper, without a GPU: the sample-waste bookkeeping
(``stochattn.cuda.flash.flash_diagnostics``) from per-tile statistics in the kernel's
layout equals the reference's, and importing the wrapper imports no CuPy."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from stochattn.cuda.flash import FlashTileStats, flash_diagnostics
from stochattn.reference import santa as ref_santa
from stochattn.reference.common import lengths, logits


def _kernel_layout_stats(x, lens, S, tile_size):
    """What santa_flash(..., return_tile_stats=True) returns, built from the reference:
    fp32 m_t and l_t, -inf / 0 past the sequence, and S_t per sequence."""
    st = ref_santa.tile_stats(x, tile_size)
    has = st.l > 0
    tm = np.where(has, st.m, -np.inf).astype(np.float32)
    tl = np.where(has, st.l, 0.0).astype(np.float32)
    TL = -(-np.asarray(lens) // tile_size)
    samples = np.where(TL > 0, -(-S // np.maximum(TL, 1)), 0).astype(np.int32)
    return FlashTileStats(tm, tl, samples)


@given(seed=st.integers(0, 2**32 - 1), S=st.integers(1, 600),
       tile_size=st.sampled_from([32, 64, 128, 256]),
       lens=st.lists(st.integers(0, 700), min_size=1, max_size=3))
def test_flash_diagnostics_match_reference(seed, S, tile_size, lens):
    """samples_per_tile equal exactly; sample_waste to fp32 rounding of m_t and l_t."""
    rng = np.random.default_rng(seed)
    B, Hkv, G, N, D = len(lens), 2, 2, 700, 16
    q = rng.standard_normal((B, Hkv * G, D)) * 2.0
    k = rng.standard_normal((B, Hkv, N, D))
    v = rng.standard_normal((B, Hkv, N, D))
    full = lengths(np.asarray(lens), B, N)
    x = logits(q, k, full, 0.25)
    samples, waste = flash_diagnostics(_kernel_layout_stats(x, full, S, tile_size), S)
    _, _, ref_samples, ref_waste = ref_santa.flash_estimate(x, v, full, "systematic", S, tile_size,
                                                            seed=seed, offset=0)
    np.testing.assert_array_equal(samples, ref_samples)
    np.testing.assert_allclose(waste, ref_waste, rtol=1e-5, atol=1e-6)
    assert np.all((waste >= 0) & (waste < 1))
    assert np.all(waste[full == 0] == 0) and np.all(samples[full == 0] == 0)


def test_flash_wrapper_imports_no_cupy():
    code = ("import sys, stochattn.cuda.flash as f, stochattn.cuda as c; "
            "assert c.santa_flash is f.santa_flash; assert 'cupy' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_flash_kernel_argument_is_checked_first():
    """An unknown ``kernel`` is a ValueError naming the argument, before any array is read."""
    import pytest

    from stochattn.cuda.flash import santa_flash

    q = np.zeros((1, 4, 64), np.float16)
    with pytest.raises(ValueError, match="`kernel` must be one of 'simt', 'tc' or None, got 'x'"):
        santa_flash(q, q, q, budget=4, kernel="x")


def test_flash_tc_shared_memory_fits_and_keeps_rings_aligned():
    """For every compiled tensor-core tiling, head dim, GMAX and tile size: the per-warp
    block of santa_flash_tc.cu (ring, padded logits, counts, row list) is a multiple of
    128 bytes, so every warp's ring starts where the first one does modulo 128 (16-byte
    cp.async, bank-conflict-free ldmatrix rows); the CTA's total fits sm_90's 227 KB and
    holds the cross-warp merge buffers."""
    from stochattn.cuda import config, kernels
    from stochattn.cuda.flash import TILE_SIZES

    for t in config.FLASH_TC_TILINGS:
        assert t.matrices == 1 and t.rows in (16, 32)  # the kernel's static_asserts
        for d in kernels.HEAD_DIMS:
            for gm in kernels.GROUP_MAXES:
                merge = (2 + d) * t.warps * gm * 4
                for ts in TILE_SIZES:
                    per_warp = t.stages * t.rows * d * 2 + ts * (8 * gm + 4) + 32 * gm
                    assert per_warp % 128 == 0, (t, d, gm, ts)
                    total = config.flash_tc_smem_bytes(t, d, gm, ts)
                    assert total == max(t.warps * per_warp, merge)
                    assert merge <= total <= config.smem_limit(), (t, d, gm, ts, total)


def test_flash_tc_tiling_is_settable_only_to_compiled_ones():
    import pytest

    from stochattn.cuda import config

    prev = config.set_config(flash_tc_tiling=config.FLASH_TC_TILINGS[-1]).flash_tc_tiling
    try:
        assert config.get_config().flash_tc_tiling == config.FLASH_TC_TILINGS[-1]
        with pytest.raises(ValueError, match="compiled"):
            config.set_config(flash_tc_tiling=config.TcTiling(2, 16, 2, 1))
    finally:
        config.set_config(flash_tc_tiling=prev)
    assert config.get_config().flash_tc_tiling == prev
