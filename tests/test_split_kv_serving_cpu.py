"""The split-KV families (exact decode, S²ANTA-flash) as a serving engine calls them, checked
without a GPU: ExactPlan's ``out=`` / ``workspace=`` on the reference, the kernels' page-table
arguments in the order the launches pass them, the public CUDA entry points' keywords, and
the documented workspace formula and bound. The GPU half is tests/gpu/test_paged_exact_flash.py.
"""

from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stochattn import ExactPlan, exact_attention
from stochattn.cuda import kernels
from stochattn.cuda.kernels import abi
from stochattn.cuda.runtime import launch
from stochattn.cuda.runtime.pages import PageArgs
from stochattn.paged import from_contiguous

_CHUNKS = {"exact_decode": "exact_decode_chunk", "exact_decode_tc": "exact_decode_tc_chunk",
           "santa_flash": "santa_flash_chunk", "santa_flash_tc": "santa_flash_tc_chunk"}


def _inputs(B=3, Hkv=2, G=2, N=37, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hkv * G, D))
    k = rng.standard_normal((B, Hkv, N, D))
    v = rng.standard_normal((B, Hkv, N, D))
    return q, k, v


# ---- ExactPlan: out= and workspace= on the reference ----------------------------------------

def test_reference_out_is_filled_and_returned():
    q, k, v = _inputs()
    lens = np.array([37, 0, 11])
    plan = ExactPlan()
    want = plan.run(q, k, v, lens)
    out = np.full_like(want, np.nan)
    got = plan.run(q, k, v, lens, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    out2 = np.empty_like(want)
    got, diag = plan.diagnose(q, k, v, lens, out=out2)
    assert got is out2
    np.testing.assert_array_equal(out2, want)
    np.testing.assert_array_equal(diag.seq_lens, lens)


def test_reference_out_paged_equals_contiguous():
    q, k, v = _inputs(seed=1)
    lens = np.array([37, 0, 5])
    cache = from_contiguous(k, v, lens, page_size=3, layout="HND", shuffle_seed=2, extra_pages=2)
    plan = ExactPlan()
    out = np.empty((3, 4, 16))
    got = plan.run(q, cache, out=out)
    assert got is out
    np.testing.assert_array_equal(out, plan.run(q, k, v, lens))
    np.testing.assert_array_equal(out, exact_attention(q, cache))


@pytest.mark.parametrize("out, error, match", [
    (np.empty((3, 4, 15)), ValueError, r"`out` must have shape \(3, 4, 16\)"),
    (np.empty((3, 4, 16), dtype=np.float32), TypeError, "`out` must have dtype float64"),
    ([[0.0]], TypeError, "`out` must be a NumPy array"),
])
def test_reference_bad_out_names_it(out, error, match):
    q, k, v = _inputs()
    with pytest.raises(error, match=match):
        ExactPlan().run(q, k, v, out=out)


def test_reference_refuses_a_workspace():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="`workspace` is GPU scratch"):
        ExactPlan().run(q, k, v, workspace=np.empty(1024, dtype=np.uint8))


def test_other_call_arguments_are_refused():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="unexpected argument.*`seed`"):
        ExactPlan().run(q, k, v, seed=1)


def test_cuda_plan_reads_pages_in_place():
    """The GPU plan does not refuse a paged cache (its kernels read the page table)."""
    assert ExactPlan(device="cuda")._paged_cuda_missing() == []


def test_paged_call_refuses_v_and_seq_lens():
    q, k, v = _inputs()
    cache = from_contiguous(k, v, page_size=4)
    with pytest.raises(TypeError, match="a paged cache"):
        ExactPlan().run(q, cache, v)


# ---- the kernels' page-table arguments -----------------------------------------------------

@pytest.mark.parametrize("family", sorted(_CHUNKS))
def test_chunk_kernels_take_the_split_kv_arguments_in_launch_order(family):
    """Every split-KV chunk kernel starts with SPLIT_KV_VARIABLE (what SplitKVPlan.launch
    passes: inputs, the seven page-table arguments of kv_rows.cuh, output, partials), and
    the page arguments have the C types of runtime.pages.PageArgs."""
    decl = abi.kernel(family, _CHUNKS[family])
    n = len(launch.SPLIT_KV_VARIABLE)
    assert decl.arg_names[:n] == launch.SPLIT_KV_VARIABLE
    types = {a.name: a.scalar for a in decl.args}
    for name, want in zip(PageArgs._fields, (np.uint64,) * 3 + (np.int32, np.int64, np.int32,
                                                                 np.int32)):
        assert types[name] is want, name


def test_host_modules_bind_every_argument():
    """The host modules' per-call names plus their fixed ones cover each kernel's
    arguments exactly (Kernel.bind raises otherwise)."""
    from stochattn.cuda import exact, flash

    for family, variable, fixed in (
            ("exact_decode", exact._CHUNK_VARIABLE, ("Hkv", "G", "N", "chunk_len", "num_chunks",
                                                     "scale_log2")),
            ("exact_decode_tc", exact._CHUNK_VARIABLE, ("Hkv", "G", "N", "chunk_len",
                                                        "num_chunks", "scale_log2")),
            ("santa_flash", flash._CHUNK_VARIABLE, ("Hkv", "G", "N", "chunk_len", "num_chunks",
                                                    "tile_size", "n_tiles", "idx_stride", "S",
                                                    "sampler", "scale")),
            ("santa_flash_tc", flash._CHUNK_VARIABLE, ("Hkv", "G", "N", "chunk_len",
                                                       "num_chunks", "tile_size", "n_tiles",
                                                       "idx_stride", "S", "sampler", "scale"))):
        bound = abi.kernel(family, _CHUNKS[family]).bind(variable, **{n: 1 for n in fixed})
        assert len(bound.variable) == len(variable)


@pytest.mark.parametrize("family", sorted(_CHUNKS))
def test_chunk_kernels_read_lengths_and_rows_through_the_page_table(family):
    """No K/V address or length of these families bypasses kv_rows.cuh: the kernels (and
    flash_tile.cuh) use stream_length and KvRows, never sequence_length or a stream offset
    computed from N."""
    text = (kernels.SOURCE_DIR / kernels.FAMILIES[family]).read_text()
    if family.startswith("santa_flash"):
        text += (kernels.SOURCE_DIR / "flash_tile.cuh").read_text()
    assert "sequence_length(" not in text
    assert "stream_length(" in text
    assert len(re.findall(r"kv_rows<D>\((k|v), table", text)) == 2
    assert "* N * D" not in text


# ---- public entry points ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["exact_decode", "santa_flash"])
def test_cuda_entry_points_take_out_workspace_and_a_paged_k(name):
    from stochattn.cuda import exact, flash

    fn = {"exact_decode": exact.exact_decode, "santa_flash": flash.santa_flash}[name]
    params = inspect.signature(fn).parameters
    assert params["v"].default is None  # a PagedKV k comes with v=None
    for kw in ("out", "workspace"):
        assert params[kw].kind is inspect.Parameter.KEYWORD_ONLY and params[kw].default is None
    ws = {"exact_decode": exact.workspace_bytes, "santa_flash": flash.workspace_bytes}[name]
    assert "v" in inspect.signature(ws).parameters


# ---- workspace formula and bound ---------------------------------------------------------------

@pytest.mark.parametrize("rows, chunks, D", [(1, 2, 64), (32 * 32, 5, 128), (7, 300, 128)])
def test_chunk_partials_bytes_follow_the_documented_formula(rows, chunks, D):
    merge = launch.ChunkMerge("exact_decode", "stochattn::f16", None, rows, chunks, D,
                              groups=rows, in_kernel=True)
    assert merge.scratch_bytes == launch.align(4 * rows * chunks * D) + 8 * rows * chunks
    assert merge.ml_offset % 256 == 0


@settings(max_examples=200, deadline=None)
@given(units=st.integers(1, 4096), tokens=st.integers(1, 2**20), slots=st.integers(1, 2048),
       align=st.sampled_from([16, 32, 64, 128, 256]))
def test_chunk_count_bound_keeps_the_workspace_independent_of_n(units, tokens, slots, align):
    """The documented bound: C <= ceil(N / max(256, align)) and C <= 4 slots / units + 1,
    so rows C <= 4 slots G + B Hq whatever N (units = B Hkv, rows = units G)."""
    chunks, chunk_len = launch.choose_chunks(units, tokens, align, slots)
    assert chunks * chunk_len >= tokens and chunk_len % align == 0
    assert chunks <= math.ceil(tokens / max(256, align))
    assert chunks <= 4 * slots // units + 1
