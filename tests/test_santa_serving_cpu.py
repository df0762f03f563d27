"""Serving arguments of SantaPlan and BernoulliPlan that need no GPU (issue 30 items 2, 3):
``out=`` and ``workspace=`` on the reference, paged host caches with ``out=``, the
S²ANTA-prop workspace formula, the kernels' page-table arguments and the host's argument
tuples, and the GPU refusals that stay (error-targeted budgets)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import stochattn
from stochattn.cuda import santa as cuda_santa
from stochattn.cuda.kernels import abi
from stochattn.cuda.runtime import pages
from stochattn.paged import from_contiguous

B, HKV, G, N, D = 3, 2, 2, 150, 64
LENS = np.array([N, 77, 0])


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((B, HKV * G, D))
    k = rng.standard_normal((B, HKV, N, D))
    v = rng.standard_normal((B, HKV, N, D))
    return q, k, v


# ---- out= and workspace= on the reference -------------------------------------------------

@pytest.mark.parametrize("schedule", ["prop", "flash", "global"])
def test_reference_out_is_written_and_returned(arrays, schedule):
    q, k, v = arrays
    plan = stochattn.SantaPlan(budget=16, schedule=schedule, tile_size=32)
    want = plan.run(q, k, v, LENS, seed=3, offset=1)
    out = np.full_like(want, np.nan)
    got = plan.run(q, k, v, LENS, seed=3, offset=1, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    out2 = np.full_like(want, np.nan)
    got2, diag = plan.diagnose(q, k, v, LENS, seed=3, offset=1, out=out2)
    assert got2 is out2
    np.testing.assert_array_equal(out2, want)
    assert diag.v_rows_read.shape == (B, HKV)


def test_reference_out_on_a_paged_host_cache(arrays):
    q, k, v = arrays
    plan = stochattn.SantaPlan(budget=16, sampler="stratified")
    want = plan.run(q, k, v, LENS, seed=9, offset=4)
    cache = from_contiguous(k, v, LENS, page_size=7, layout="HND", shuffle_seed=1,
                            extra_pages=2)
    out = np.zeros_like(want)
    assert plan.run(q, cache, seed=9, offset=4, out=out) is out
    np.testing.assert_array_equal(out, want)


def test_reference_out_checks_name_it(arrays):
    q, k, v = arrays
    plan = stochattn.SantaPlan(budget=4)
    with pytest.raises(ValueError, match="`out`"):
        plan.run(q, k, v, out=np.zeros((B, HKV * G, D + 1)))
    with pytest.raises(TypeError, match="`out`"):
        plan.run(q, k, v, out=np.zeros((B, HKV * G, D), dtype=np.float32))
    with pytest.raises(TypeError, match="`out`"):
        plan.run(q, k, v, out=[[0.0]])


def test_reference_refuses_a_workspace(arrays):
    q, k, v = arrays
    with pytest.raises(TypeError, match="`workspace`"):
        stochattn.SantaPlan(budget=4).run(q, k, v, workspace=np.zeros(1 << 20, np.uint8))
    with pytest.raises(TypeError, match="`workspace`"):
        stochattn.BernoulliPlan().run(q, k, workspace=np.zeros(1 << 20, np.uint8))


def test_bernoulli_reference_out(arrays):
    q, k, _ = arrays
    plan = stochattn.BernoulliPlan(bernoulli_draws=2)
    want = plan.run(q, k, LENS, seed=1, offset=2)
    out = np.zeros_like(want)
    assert plan.run(q, k, LENS, seed=1, offset=2, out=out) is out
    np.testing.assert_array_equal(out, want)
    out2 = np.zeros_like(want)
    got, diag = plan.diagnose(q, k, LENS, seed=1, offset=2, out=out2)
    assert got is out2 and diag.k_feature_fraction.shape == (B, HKV * G)
    with pytest.raises(ValueError, match="`out`"):
        plan.run(q, k, LENS, out=np.zeros((B, HKV * G, N - 1)))


def test_reference_advances_the_offset_with_out(arrays):
    q, k, v = arrays
    plan = stochattn.SantaPlan(budget=8, advance_offset=True)
    offset = np.array(5, dtype=np.int64)
    want = stochattn.SantaPlan(budget=8).run(q, k, v, seed=2, offset=5)
    out = np.zeros_like(want)
    plan.run(q, k, v, seed=2, offset=offset, out=out)
    np.testing.assert_array_equal(out, want)
    assert int(offset) == 6


# ---- what the GPU plans accept ---------------------------------------------------------

def test_gpu_plans_read_pages_in_place():
    assert stochattn.SantaPlan(budget=8, device="cuda")._paged_cuda_missing() == []
    assert stochattn.SantaPlan(budget=8, schedule="flash",
                               device="cuda")._paged_cuda_missing() == []
    assert stochattn.SantaPlan(budget=8, scores="bernoulli",
                               device="cuda")._paged_cuda_missing() == []
    assert stochattn.BernoulliPlan(device="cuda")._paged_cuda_missing() == []


def test_error_targeted_budgets_on_the_gpu_need_prop():
    with pytest.raises(NotImplementedError, match="schedule='flash'"):
        stochattn.SantaPlan(eps=0.1, delta=0.1, max_budget=64, schedule="flash", device="cuda")


# ---- the workspace formula ---------------------------------------------------------------

def _formula(Bn, Hq, Hkv, Nn, Dn, S, ts, sampler):
    rows, T = Bn * Hq, math.ceil(Nn / ts)
    pieces = [4 * rows * T * ts, 4 * rows * T, 4 * rows * T, 8 * rows * T,
              8 * rows * (S + 1) if sampler == "iid" else 8, 4 * rows * S,
              4 * rows * Dn, 4 * Bn * Hkv * Dn, 4 * Bn * Hkv, 4 * rows]
    return sum(-(-p // 256) * 256 for p in pieces)


@pytest.mark.parametrize("shape", [(1, 4, 1, 100, 64, 7, 32, "iid"),
                                   (32, 32, 8, 131072, 128, 256, 64, "systematic"),
                                   (3, 8, 2, 700, 128, 64, 256, "stratified")])
def test_prop_workspace_formula(shape):
    Bn, Hq, Hkv, Nn, Dn, S, ts, sampler = shape
    got = cuda_santa.workspace_bytes(Bn, Hq, Hkv, Nn, Dn, S, tile_size=ts, sampler=sampler)
    assert got == _formula(*shape)
    # The fp32 logit stash is most of it: 4 B Hq N (537 MB at 32 x 32 x 128k).
    assert got >= 4 * Bn * Hq * Nn
    if Nn >= 2**17:
        assert 4 * Bn * Hq * Nn == 536870912 and got < 1.1 * 4 * Bn * Hq * Nn


# ---- kernel arguments and the host's argument tuples ---------------------------------------

PROP_KERNELS = ["santa_prop_logits", "santa_prop_logits_tc", "santa_prop_tiles",
                "santa_prop_sample"]


@pytest.mark.parametrize("name", PROP_KERNELS)
def test_page_table_follows_seq_lens(name):
    args = abi.kernel("santa_prop", name).arg_names
    i = args.index("seq_lens")
    assert args[i + 1:i + 8] == pages.PageArgs._fields


def test_packed_argument_tuples_bind():
    """Every variable tuple names real arguments of its kernel once; the tiles launch keeps
    the four arguments it had first (Double-P's sampled variant passes only those, which
    leaves the page table at zero: lengths from its seq_lens)."""
    k = lambda n: abi.kernel("santa_prop", n)  # noqa: E731
    fixed1 = dict(Hkv=2, G=4, N=100, chunk_len=64, n_pad=128, scale=0.1)
    k("santa_prop_logits").bind(cuda_santa._LOGITS_VARIABLE, **fixed1)
    k("santa_prop_logits_tc").bind(cuda_santa._LOGITS_TC_VARIABLE, n_tiles=2, tile_size=64,
                                   **fixed1)
    assert cuda_santa._TILES_VARIABLE[:4] == ("logits", "seq_lens", "tile_m", "tile_l")
    bound = k("santa_prop_tiles").bind(cuda_santa._TILES_VARIABLE, Hq=8, N=100, n_pad=128,
                                       n_tiles=2, tile_size=64)
    assert all(int(bound.args[i]) == 0 for i in bound.variable)
    k("santa_prop_sample").bind(
        cuda_santa.SAMPLE_VARIABLE + cuda_santa.PAGE_VARIABLE, Hq=8, G=4, N=100, n_pad=128,
        n_tiles=2, tile_size=64, S=16, sampler=0, purpose=0, part_o=0, part_ml=0,
        num_parts=0, part=0)


def test_contiguous_page_args_are_zero():
    assert tuple(int(a) for a in pages.CONTIGUOUS) == (0,) * 7
