"""Double-P (decode, index append, index build) as a serving engine calls it, checked without
a GPU: ``out=`` / ``workspace=`` of DoublePPlan and ClusterTopKPlan on the reference, the
kernels' page-table arguments in the order the launches pass them, the public CUDA entry
points' keywords, and the append's scratch layout. The GPU half is
tests/gpu/test_paged_doublep.py.
"""

from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest

import stochattn
from stochattn import ClusterTopKPlan, DoublePPlan
from stochattn.cuda import doublep as dp
from stochattn.cuda import doublep_index as dpi
from stochattn.cuda import kernels
from stochattn.cuda.kernels import abi
from stochattn.cuda.runtime import launch
from stochattn.cuda.runtime.pages import PageArgs
from stochattn.paged import from_contiguous

PAGE_TYPES = (np.uint64,) * 3 + (np.int32, np.int64, np.int32, np.int32)


def _inputs(B=3, Hkv=2, G=2, N=40, D=8, seed=0):
    rng = np.random.default_rng(seed)
    q = 2 * rng.standard_normal((B, Hkv * G, D))
    k = rng.standard_normal((B, Hkv, N, D))
    v = rng.standard_normal((B, Hkv, N, D))
    return q, k, v, np.array([N, 0, 23])


def _index(k, v, lens):
    return stochattn.build_doublep_index(k, v, lens, n_clusters=5, n_sink=2, window=6)


PLANS = [
    ("double-p", lambda: DoublePPlan(p1=0.9, p2=0.6), {}),
    ("double-p sampled", lambda: DoublePPlan(approx="sample", budget=7), dict(seed=3, offset=2)),
    ("top-k clusters", lambda: ClusterTopKPlan(k_clusters=2), {}),
]
plans = pytest.mark.parametrize("name, make, stream", PLANS, ids=[p[0] for p in PLANS])


# ---- out= and workspace= on the reference ------------------------------------------------------

@plans
def test_reference_out_is_filled_and_returned(name, make, stream):
    q, k, v, lens = _inputs()
    index = _index(k, v, lens)
    plan = make()
    want = plan.run(q, k, v, lens, index=index, **stream)
    out = np.full_like(want, np.nan)
    got = plan.run(q, k, v, lens, index=index, out=out, **stream)
    assert got is out
    np.testing.assert_array_equal(out, want)
    out2 = np.empty_like(want)
    got, diag = plan.diagnose(q, k, v, lens, index=index, out=out2, **stream)
    assert got is out2
    np.testing.assert_array_equal(out2, want)
    np.testing.assert_array_equal(diag.seq_lens, lens)


@plans
def test_reference_paged_with_out_equals_contiguous(name, make, stream):
    q, k, v, lens = _inputs(seed=1)
    index = _index(k, v, lens)
    cache = from_contiguous(k, v, lens, page_size=3, layout="HND", shuffle_seed=2, extra_pages=2)
    plan = make()
    out = np.empty(q.shape)
    got = plan.run(q, cache, index=index, out=out, **stream)
    assert got is out
    np.testing.assert_array_equal(out, plan.run(q, k, v, lens, index=index, **stream))


@pytest.mark.parametrize("out, error, match", [
    (np.empty((3, 4, 7)), ValueError, r"`out` must have shape \(3, 4, 8\)"),
    (np.empty((3, 4, 8), dtype=np.float32), TypeError, "`out` must have dtype float64"),
    ([[0.0]], TypeError, "`out` must be a NumPy array"),
])
@plans
def test_reference_bad_out_names_it(name, make, stream, out, error, match):
    q, k, v, lens = _inputs()
    index = _index(k, v, lens)
    with pytest.raises(error, match=match):
        make().run(q, k, v, lens, index=index, out=out, **stream)


@plans
def test_reference_refuses_a_workspace(name, make, stream):
    q, k, v, lens = _inputs()
    index = _index(k, v, lens)
    with pytest.raises(TypeError, match="`workspace` is GPU scratch"):
        make().run(q, k, v, lens, index=index, workspace=np.empty(1024, dtype=np.uint8),
                   **stream)


def test_plan_calls_still_refuse_unknown_arguments_and_need_an_index():
    q, k, v, lens = _inputs()
    index = _index(k, v, lens)
    with pytest.raises(TypeError, match="unexpected argument.*`sed`"):
        DoublePPlan().run(q, k, v, lens, index=index, sed=1)
    with pytest.raises(TypeError, match="needs `index`"):
        DoublePPlan().run(q, k, v, lens, out=np.empty(q.shape))


def test_reference_append_refuses_a_workspace_and_grows_from_pages():
    q, k, v, lens = _inputs(seed=4)
    short = np.minimum(lens, 30)
    a = _index(k, v, short)
    b = _index(k, v, short)
    with pytest.raises(TypeError, match="`workspace` is GPU scratch"):
        a.append(k, v, lens, workspace=np.empty(16, dtype=np.uint8))
    a.append(from_contiguous(k, v, lens, page_size=4, shuffle_seed=3, extra_pages=1))
    b.append(k, v, lens)
    for name in ("centroids", "sizes", "value_sums", "seq_lens", "window_start",
                 "n_initialized"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_cuda_plans_read_pages_in_place():
    """Centroid Double-P and top-k clusters read pages on the GPU; the sampled variant does
    where the S²ANTA-prop V gather (santa_prop_sample) takes the page table."""
    assert DoublePPlan(device="cuda")._paged_cuda_missing() == []
    assert ClusterTopKPlan(k_clusters=3, device="cuda")._paged_cuda_missing() == []
    sampled = DoublePPlan(approx="sample", budget=4, device="cuda")._paged_cuda_missing()
    takes = "kv_indptr" in abi.kernel("santa_prop", "santa_prop_sample").arg_names
    assert sampled == ([] if takes else dp._sample_pages_missing())
    assert takes or "santa_prop_sample" in sampled[0]


# ---- the kernels' page-table arguments ------------------------------------------------------

@pytest.mark.parametrize("family, name, after", [
    ("doublep_decode", "doublep_attend", ("q", "k", "v")),
    ("doublep_decode", "doublep_true_mass", ("q", "k")),
    ("doublep_decode", "doublep_rows", ("lens", "window_start")),
    ("doublep_append", "doublep_append_score", ("keys",)),
    ("doublep_append", "doublep_append", ("keys", "values")),
])
def test_kernels_take_the_page_table_after_their_cache_pointers(family, name, after):
    decl = abi.kernel(family, name)
    n = len(after)
    assert decl.arg_names[:n] == after
    assert decl.arg_names[n:n + 7] == PageArgs._fields
    types = {a.name: a.scalar for a in decl.args}
    for field, want in zip(PageArgs._fields, PAGE_TYPES):
        assert types[field] is want, field


def test_host_launches_bind_every_argument():
    """The packed launches' per-call names plus their fixed ones cover each kernel's
    arguments exactly (Kernel.bind raises otherwise), page arguments included."""
    k = lambda name: abi.kernel("doublep_decode", name)  # noqa: E731
    rows = k("doublep_rows").bind(dp._ROWS_VARIABLE, Hkv=1, G=1, cap=1, NL=1, C=1, slices=1,
                                  n_pad=0)
    attend = k("doublep_attend").bind(dp._ATTEND_VARIABLE, Hkv=1, G=1, N=1, C=1, slices=1,
                                      tok_chunks=1, cl_per_chunk=1, num_chunks=1, list_off=0,
                                      list_offs=16,
                                      scale_log2=1.0, n_pad=0)
    assert len(rows.variable) == len(dp._ROWS_VARIABLE)
    assert len(attend.variable) == len(dp._ATTEND_VARIABLE)
    for variable in (dp._ROWS_VARIABLE, dp._ATTEND_VARIABLE):
        i = variable.index("kv_indptr")
        assert variable[i:i + 7] == PageArgs._fields
    # The sampled variant's S²ANTA-prop launches: the same assembly as _DoublePPlan (the
    # page names the kernels take, whether or not santa.py's tuples list them).
    from stochattn.cuda.santa import _TILES_VARIABLE, SAMPLE_VARIABLE

    sample = abi.kernel("santa_prop", "santa_prop_sample")
    sample.bind(dp._with_pages(SAMPLE_VARIABLE, sample) + ("part_o", "part_ml"), Hq=1, G=1,
                N=1, n_pad=64, n_tiles=1, tile_size=64, S=1, sampler=0, purpose=0,
                num_parts=2, part=1)
    tiles = abi.kernel("santa_prop", "santa_prop_tiles")
    tiles.bind(dp._with_pages(_TILES_VARIABLE, tiles), Hq=1, N=1, n_pad=64, n_tiles=1,
               tile_size=64)


def test_append_launch_arguments_are_all_named():
    """append_gpu passes these names (common + per kernel); together they are each append
    kernel's arguments exactly (args_of raises otherwise)."""
    pages = dict(zip(PageArgs._fields, (0,) * 7))
    common = dict(keys=0, sb=0, sh=0, st=0, partial=0, staging=0, Hkv=1, C=1, D=8, NL=1, **pages)
    abi.kernel("doublep_append", "doublep_append_score").args_of(
        n_cache=1, new_lens=0, lens64=0, old_lens=0, window_start=0, n_init=0, centroids=0,
        n_sink=0, window=0, **common)
    abi.kernel("doublep_append", "doublep_append").args_of(
        values=0, lens=0, window_start=0, n_init=0, centroids=0, sizes=0, value_sums=0,
        labels=0, S=1, sub_centroids=0, sub_sizes=0, n_sub=0, **common)


def test_decode_kernels_read_rows_and_lengths_through_the_page_table():
    """No K/V address of Double-P bypasses kv_rows.cuh: the attention and true-mass kernels
    build KvRows for k (and v), the list loader reads `row(n)`, and every length that
    bounds a row id is clamped to the page table's (paged_length)."""
    text = (kernels.SOURCE_DIR / "doublep_decode.cu").read_text()
    assert len(re.findall(r"kv_rows<D>\((k|v), table", text)) == 3
    assert "* N * D" not in text and "pair * N + t" not in text
    assert "paged_length(table, b," in text  # doublep_true_mass
    assert "stream_length(nullptr, table, b, cap)" in text  # doublep_rows
    append = (kernels.SOURCE_DIR / "doublep_append.cu").read_text()
    assert append.count("token_rows(keys, pt") == 2 and "token_rows(values, pt" in append
    assert "stream_length(nullptr, pt, b, n_cache)" in append


# ---- public entry points --------------------------------------------------------------------

def test_cuda_entry_points_take_out_and_workspace():
    params = inspect.signature(dp.doublep_decode).parameters
    for kw in ("out", "workspace"):
        assert params[kw].kind is inspect.Parameter.KEYWORD_ONLY and params[kw].default is None
    assert "index" in inspect.signature(dp.workspace_bytes).parameters
    append = inspect.signature(stochattn.DoublePIndex.append).parameters
    assert append["workspace"].kind is inspect.Parameter.KEYWORD_ONLY
    assert append["v"].default is None and append["seq_lens"].default is None
    assert "workspace" in inspect.signature(dpi.append_gpu).parameters


@pytest.mark.parametrize("B, Hkv, C, sms", [(1, 1, 16, 132), (8, 8, 2048, 132),
                                            (32, 8, 8192, 78), (3, 2, 1, 1)])
def test_append_scratch_layout_follows_the_documented_formula(B, Hkv, C, sms):
    S, offsets, total = dpi._append_layout(B, Hkv, C, sms)
    fast = abi.constant("doublep_append", "kFastTokens")
    assert S == max(1, min(math.ceil(2 * sms / (B * Hkv)), math.ceil(C / 64)))
    assert offsets == (0, launch.align(32 * B))
    assert total == launch.align(32 * B) + launch.align(8 * B * Hkv * fast * S)


def test_decode_workspace_formula_is_documented():
    """The module docstring states the per-call scratch formula the plan lays out."""
    doc = dp.__doc__
    for piece in ("4 rows C", "8 pairs C", "4 rows total D + 8 rows total",
                  "5 pairs slices 2048 + 4 pairs slices", "4 rows n_pad"):
        assert piece in doc, piece
