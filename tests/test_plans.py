"""Plan objects: options checked once, backends asked and refusing with every reason, calls
that equal the functions bit for bit, fixed return types, the functions' plan cache."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest

import stochattn
from stochattn import (BernoulliPlan, ClusterTopKPlan, Diagnostics, DoublePPlan, ExactPlan,
                       QuestPlan, SantaPlan, TopKPlan, TopPPlan)


def _inputs(B=2, Hq=4, Hkv=2, N=50, D=8, seed=0):
    rng = np.random.default_rng(seed)
    q = 2 * rng.standard_normal((B, Hq, D))
    k = rng.standard_normal((B, Hkv, N, D))
    v = rng.standard_normal((B, Hkv, N, D))
    return q, k, v, np.array([N, N // 2])


def _index(k, v, lens):
    return stochattn.build_doublep_index(k, v, lens, n_clusters=6, n_sink=2, window=8)


# Each row: plan, the function, the function's options, the call's extra arguments.
def _cases(k, v, lens):
    index = _index(k, v, lens)
    return [
        (SantaPlan(budget=16, sampler="stratified", schedule="flash", tile_size=16),
         stochattn.santa_attention,
         dict(budget=16, sampler="stratified", schedule="flash", tile_size=16), dict(seed=3, offset=1)),
        (SantaPlan(budget=8, scores="bernoulli", bernoulli_draws=2), stochattn.santa_attention,
         dict(budget=8, scores="bernoulli", bernoulli_draws=2), dict(seed=4, offset=0)),
        (ExactPlan(softmax_scale=0.5), stochattn.exact_attention, dict(softmax_scale=0.5), {}),
        (TopKPlan(k_tokens=5), stochattn.topk_attention, dict(k_tokens=5), {}),
        (QuestPlan(k_tokens=12, page_size=4), stochattn.quest_attention,
         dict(k_tokens=12, page_size=4), {}),
        (TopPPlan(p=0.8), stochattn.top_p_attention, dict(p=0.8), {}),
        (DoublePPlan(p1=0.9, p2=0.5), stochattn.doublep_attention, dict(p1=0.9, p2=0.5),
         dict(index=index)),
        (DoublePPlan(approx="sample", budget=6), stochattn.doublep_attention,
         dict(approx="sample", budget=6), dict(index=index, seed=2, offset=7)),
        (ClusterTopKPlan(k_clusters=2), stochattn.cluster_topk_attention, dict(k_clusters=2),
         dict(index=index)),
    ]


def test_a_plan_gives_what_its_function_gives_bit_for_bit():
    q, k, v, lens = _inputs()
    for plan, function, options, call in _cases(k, v, lens):
        want, want_diag = function(q, k, v, lens, **options, **call, return_diagnostics=True)
        got = plan.run(q, k, v, lens, **call)
        got2, diag = plan.diagnose(q, k, v, lens, **call)
        assert isinstance(got, np.ndarray) and isinstance(diag, Diagnostics), plan
        assert np.array_equal(got, want) and np.array_equal(got2, want), plan
        assert np.array_equal(diag.v_rows_read, want_diag.v_rows_read), plan


def test_bernoulli_plan_takes_q_and_k():
    q, k, _, lens = _inputs()
    plan = BernoulliPlan(bernoulli_draws=3, bernoulli_group_shared=True)
    want = stochattn.bernoulli_scores(q, k, lens, bernoulli_draws=3, bernoulli_group_shared=True,
                                      seed=9, offset=2)
    assert np.array_equal(plan.run(q, k, lens, seed=9, offset=2), want)
    scores, diag = plan.diagnose(q, k, lens, seed=9, offset=2)
    assert np.array_equal(scores, want) and diag.k_feature_fraction.shape == (2, 4)


@pytest.mark.parametrize("make, error, match", [
    (lambda: SantaPlan(budget=0), ValueError, r"`budget` must be >= 1, got 0"),
    (lambda: SantaPlan(budget=4, sampler="sobol"), ValueError, r"`sampler` must be one of"),
    (lambda: SantaPlan(budget=4, tile_size=1.5), TypeError, r"`tile_size` must be an integer"),
    (lambda: SantaPlan(budget=4, check_finite="yes"), TypeError, r"`check_finite` must be a bool"),
    (lambda: ExactPlan(softmax_scale=-1.0), ValueError, r"`softmax_scale` must be finite and > 0"),
    (lambda: DoublePPlan(p1=1.5), ValueError, r"`p1` must lie in \(0, 1\], got 1.5"),
    (lambda: DoublePPlan(approx="sample"), ValueError, r"`budget` is required with approx='sample'"),
    (lambda: ClusterTopKPlan(k_clusters=0), ValueError, r"`k_clusters` must be >= 1, got 0"),
    (lambda: TopPPlan(p=0), ValueError, r"`p` must lie in \(0, 1\]"),
    (lambda: SantaPlan(budget=4, device="tpu"), ValueError, r"`device` must be one of 'cpu', 'cuda', got 'tpu'"),
    (lambda: ExactPlan(q_heads=4, kv_heads=3, head_dim=8, dtype="float64"), ValueError,
     r"`q_heads` must be a multiple of `kv_heads` \(GQA\), got 4 and 3"),
    (lambda: ExactPlan(q_heads=4, head_dim=8), ValueError,
     r"pass `q_heads`, `kv_heads`, `head_dim` and `dtype`, or none of them; missing `kv_heads`, `dtype`"),
    (lambda: ExactPlan(q_heads=4, kv_heads=2, head_dim=8, dtype="int8"), NotImplementedError,
     r"`exact_attention` cannot run this plan on the reference: dtype int8"),
])
def test_options_are_checked_when_the_plan_is_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_backend_that_cannot_run_a_plan_lists_every_reason():
    """No GPU needed: the CUDA backend's declarations are read without CuPy."""
    with pytest.raises(NotImplementedError, match=r"`santa_attention` has no CUDA kernel yet "
                                                   r"\(schedule='global'; the GPU has 'prop'"):
        SantaPlan(budget=4, schedule="global", device="cuda")
    with pytest.raises(NotImplementedError, match=r"`topk_attention` has no CUDA kernel yet "
                                                   r"\(the oracle top-k decode kernel\)"):
        TopKPlan(k_tokens=4, device="cuda")
    with pytest.raises(NotImplementedError) as e:
        ExactPlan(device="cuda", q_heads=40, kv_heads=2, head_dim=96, dtype="float64")
    message = str(e.value)
    assert message.startswith("`exact_attention` cannot run this plan on the GPU: ")
    for reason in ("dtype float64", "head_dim 96", "GQA group 20"):
        assert reason in message
    assert SantaPlan(budget=4).not_supported_reasons("cuda") == []
    assert SantaPlan(budget=4, schedule="global").not_supported_reasons("reference") == []


@pytest.mark.parametrize("make, match", [
    (lambda: SantaPlan(budget=4, tile_size=48, device="cuda"),
     r"`tile_size` must be one of \(32, 64, 128, 256\) on the GPU, got 48"),
    (lambda: SantaPlan(budget=2**30 + 1, device="cuda"), r"`budget` must be at most 2\*\*30 on the GPU"),
    (lambda: SantaPlan(budget=2**27 + 1, schedule="flash", device="cuda"),
     r"`budget` must be at most 2\*\*27 on the GPU"),
])
def test_gpu_value_limits_are_checked_when_the_plan_is_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_calls_are_checked_against_the_plan():
    q, k, v, lens = _inputs()
    plan = SantaPlan(budget=4, q_heads=4, kv_heads=2, head_dim=8, dtype="float64")
    assert plan.run(q, k, v, lens, seed=1).shape == q.shape
    with pytest.raises(ValueError, match=r"planned head_dim=8, got 4"):
        plan.run(q[..., :4], k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match=r"planned dtype='float64', got 'float32'"):
        plan.run(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) `budget`; a call takes the "
                                        r"arrays, `seed` and `offset`"):
        plan.run(q, k, v, budget=8)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) `seed`; a call takes the arrays only"):
        ExactPlan().run(q, k, v, seed=1)
    with pytest.raises(TypeError, match=r"`doublep_attention` needs `index`"):
        DoublePPlan().run(q, k, v)
    with pytest.raises(TypeError, match=r"`santa_attention` needs `v`, got None"):
        plan.run(q, k)


def test_a_gpu_plan_refuses_host_arrays_and_the_reverse():
    fake_cupy = type("ndarray", (), {"__module__": "cupy._core.core"})  # no CuPy needed
    q, k, v, _ = _inputs()
    with pytest.raises(TypeError, match=r"this plan runs on the cuda backend \(device='cuda'\), "
                                        r"got NumPy arrays"):
        ExactPlan(device="cuda").run(q, k, v)
    with pytest.raises(TypeError, match=r"this plan runs on the reference backend \(device='cpu'\), "
                                        r"got GPU arrays"):
        ExactPlan().run(fake_cupy(), fake_cupy(), fake_cupy())


def test_the_functions_share_one_plan_per_configuration():
    q, k, v, _ = _inputs()
    stochattn.clear_plan_cache()
    plan_module = importlib.import_module("stochattn._plan")
    stochattn.santa_attention(q, k, v, budget=8, seed=1)
    stochattn.santa_attention(q, k, v, budget=8, seed=2)
    assert plan_module.plan_cache_size() == 1
    stochattn.santa_attention(q, k, v, budget=9)
    stochattn.exact_attention(q, k, v)
    assert plan_module.plan_cache_size() == 3
    # 8 and 8.0 are not one configuration: the float is refused, not coerced.
    with pytest.raises(TypeError, match=r"`budget` must be an integer, got float"):
        stochattn.santa_attention(q, k, v, budget=8.0)
    stochattn.clear_plan_cache()
    assert plan_module.plan_cache_size() == 0


def test_return_diagnostics_is_a_bool():
    q, k, v, _ = _inputs()
    with pytest.raises(TypeError, match=r"`return_diagnostics` must be a bool, got str"):
        stochattn.exact_attention(q, k, v, return_diagnostics="yes")


@pytest.mark.parametrize("function, old, new", [
    ("quest_attention", dict(budget=12), dict(k_tokens=12)),
    ("cluster_topk_attention", dict(clusters=2), dict(k_clusters=2)),
])
def test_old_parameter_names_warn_and_give_the_same_result(function, old, new):
    q, k, v, lens = _inputs()
    extra = dict(index=_index(k, v, lens)) if function == "cluster_topk_attention" else {}
    fn = getattr(stochattn, function)
    with pytest.warns(DeprecationWarning, match=rf"`{list(old)[0]}` is now called `{list(new)[0]}`"):
        got = fn(q, k, v, lens, **old, **extra)
    assert np.array_equal(got, fn(q, k, v, lens, **new, **extra))
    with pytest.raises(ValueError, match=rf"`{list(old)[0]}` must be >= 1, got 0"):
        fn(q, k, v, lens, **{list(old)[0]: 0}, **extra)


def test_repr_shows_the_options_and_device():
    plan = SantaPlan(budget=8, q_heads=4, kv_heads=2, head_dim=8, dtype="float64")
    assert repr(plan).startswith("SantaPlan(budget=8, sampler='systematic', schedule='prop'")
    assert "device='cpu', q_heads=4, kv_heads=2, head_dim=8, dtype='float64')" in repr(plan)


@pytest.mark.parametrize("module", ["stochattn.santa", "stochattn.exact", "stochattn.baselines",
                                    "stochattn.doublep", "stochattn.bernoulli"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ---- per-call random streams as arrays (docs/rng.md), on the reference ------------------

def _stochastic_calls(k, v, lens):
    """(name, call(q, seed, offset) -> output) of every stochastic estimator."""
    index = _index(k, v, lens)
    return [
        ("santa prop", lambda q, **c: stochattn.santa_attention(q, k, v, lens, budget=8, **c)),
        ("santa flash iid", lambda q, **c: stochattn.santa_attention(
            q, k, v, lens, budget=8, schedule="flash", sampler="iid", tile_size=16, **c)),
        ("bernoulli", lambda q, **c: stochattn.bernoulli_scores(q, k, lens, bernoulli_draws=2, **c)),
        ("double-p sampled", lambda q, **c: stochattn.doublep_attention(
            q, k, v, lens, index=index, approx="sample", budget=5, **c)),
    ]


def test_per_sequence_seeds_and_offsets_draw_what_each_sequence_would_draw_alone():
    """Sequence b of a call with arrays equals sequence b of a call with ints seed[b],
    offset[b]: exact."""
    q, k, v, lens = _inputs()
    seeds, offsets = np.array([3, 2**63 + 5], dtype=np.uint64), np.array([7, 2**32 - 1])
    for name, call in _stochastic_calls(k, v, lens):
        got = call(q, seed=seeds, offset=offsets)
        for b in range(2):
            want = call(q, seed=int(seeds[b]), offset=int(offsets[b]))
            assert np.array_equal(got[b], want[b]), (name, b)
        assert not np.array_equal(got[1], call(q, seed=3, offset=7)[1]), name
        same = call(q, seed=np.array(3), offset=np.array(7))  # shape (): one per call
        assert np.array_equal(same, call(q, seed=3, offset=7)), name


def test_advance_offset_makes_n_calls_draw_what_offsets_o_to_o_plus_n_minus_1_draw():
    q, k, v, lens = _inputs()
    plan = SantaPlan(budget=8, sampler="stratified", advance_offset=True)
    offset = np.array([5, 2**32 - 2], dtype=np.uint32)
    for step in range(3):
        want = [SantaPlan(budget=8, sampler="stratified").run(
            q, k, v, lens, seed=1, offset=int((o + step) % 2**32))[b]
            for b, o in enumerate((5, 2**32 - 2))]
        got = plan.run(q, k, v, lens, seed=1, offset=offset)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), step
    assert offset.tolist() == [8, 1]  # advanced in place, modulo 2**32
    with pytest.raises(TypeError, match=r"`advance_offset=True` needs `offset` as an integer "
                                        r"array \(it is advanced in place\), got an int"):
        plan.run(q, k, v, lens, offset=3)
    bern = BernoulliPlan(advance_offset=True)
    offset = np.zeros((), dtype=np.int64)
    first = bern.run(q, k, lens, offset=offset)
    assert int(offset) == 1 and not np.array_equal(bern.run(q, k, lens, offset=offset), first)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(offset=np.array([1, 2, 3])), ValueError, r"`offset` must have shape \(\) or \(2,\) "
                                                   r"\(one per sequence\), got \(3,\)"),
    (dict(offset=np.array([[1, 2]])), ValueError, r"`offset` must be an integer, or an array of "
                                                  r"shape \(\) or \(batch,\), got shape \(1, 2\)"),
    (dict(offset=np.array([1, 2**32])), ValueError, r"`offset` values must lie in \[0, 2\*\*32\)"),
    (dict(seed=np.array([1.0, 2.0])), TypeError, r"`seed` must be an integer, or an integer "
                                                 r"array, got an array of float64"),
    (dict(seed=np.array([-1, 2])), ValueError, r"`seed` values must lie in \[0, 2\*\*64\)"),
])
def test_stream_arrays_are_checked(kwargs, error, match):
    q, k, v, lens = _inputs()
    with pytest.raises(error, match=match):
        stochattn.santa_attention(q, k, v, lens, budget=4, **kwargs)


def test_gpu_stream_words_are_checked_without_a_gpu():
    """The GPU path takes ints and GPU arrays; a per-sequence NumPy array is refused (it would
    be copied to the device on every call), and advance_offset needs a GPU array."""
    from stochattn._plan import check_stream_arrays
    from stochattn.cuda.runtime.inputs import check_stream_words

    assert check_stream_words(3, np.array(7)) == (3, 7)
    with pytest.raises(TypeError, match=r"`offset` as a per-sequence array must live on the GPU"):
        check_stream_words(0, np.array([1, 2]))
    with pytest.raises(TypeError, match=r"`advance_offset=True` needs `offset` as a GPU integer "
                                        r"array .*, got a NumPy array"):
        check_stream_arrays("cuda", 0, np.array([1, 2]), 2, True)
    check_stream_arrays("cuda", 0, 5, 2, False)  # ints: fine


def test_the_reference_refuses_a_budget_that_would_exhaust_host_memory():
    """Issue 33: budget=10**7 at N=256 once asked for 19.1 GiB and was OOM-killed."""
    q, k, v, lens = _inputs(N=256, D=64)
    with pytest.raises(ValueError, match=r"`budget` = 10000000 would need about \d+\.\d GiB of host "
                                         r"memory in the reference .* use a smaller `budget`"):
        stochattn.santa_attention(q, k, v, budget=10**7)
    index = _index(k, v, np.array([256, 256]))
    with pytest.raises(ValueError, match=r"`budget` = 10000000 would need"):
        stochattn.doublep_attention(q, k, v, index=index, approx="sample", budget=10**7)
    assert stochattn.santa_attention(q, k, v, budget=4096).shape == q.shape  # 17 MiB: fine


def test_plans_and_functions_take_a_paged_cache_on_the_reference():
    """A PagedKV in place of k (v and seq_lens then None): the same output, bit for bit, as
    the contiguous cache it was made from (pages shuffled, NaN in the spare pages)."""
    from stochattn.paged import from_contiguous

    q, k, v, lens = _inputs()
    cache = from_contiguous(k, v, lens, page_size=4, layout="HND", shuffle_seed=3, extra_pages=2)
    for plan, function, options, call in _cases(k, v, lens):
        want = function(q, k, v, lens, **options, **call)
        assert np.array_equal(plan.run(q, cache, **call), want), plan
        assert np.array_equal(function(q, cache, **options, **call), want), plan
    scores = stochattn.bernoulli_scores(q, cache, seed=1)
    assert np.array_equal(scores, stochattn.bernoulli_scores(q, k, lens, seed=1))
    with pytest.raises(TypeError, match=r"with a paged cache \(`k` a PagedKV\) pass no `seq_lens`"):
        stochattn.exact_attention(q, cache, None, lens)
    with pytest.raises(TypeError, match=r"this plan runs on the cuda backend, got a paged cache of "
                                        r"NumPy arrays"):
        ExactPlan(device="cuda").run(q, cache)


def test_a_doublep_index_builds_and_grows_from_a_paged_cache():
    from stochattn.paged import from_contiguous

    q, k, v, lens = _inputs(N=80)
    kw = dict(n_clusters=6, n_sink=2, window=8)
    paged = stochattn.build_doublep_index(from_contiguous(k, v, lens - 20, page_size=8,
                                                          shuffle_seed=1), **kw)
    flat = stochattn.build_doublep_index(k, v, lens - 20, **kw)
    paged.append(from_contiguous(k, v, lens, page_size=8, shuffle_seed=2))
    flat.append(k, v, lens)
    for name in ("centroids", "sizes", "value_sums", "seq_lens", "n_initialized"):
        assert np.array_equal(getattr(paged, name), getattr(flat, name)), name
    assert np.array_equal(paged.labels[..., :80], flat.labels[..., :80])


def test_error_targeted_budgets_through_the_plan():
    """eps/delta/max_budget instead of budget (docs/budgets.md): per-head budgets in the
    diagnostics, each head the draws of a fixed-budget call with its own S; on the GPU with
    schedule='prop' only (flash: refused with the reason); budget and eps together are an
    error."""
    q, k, v, lens = _inputs()
    plan = SantaPlan(eps=0.2, delta=0.1, max_budget=512, budget_rule="clt", sampler="stratified")
    out, diag = plan.diagnose(q, k, v, lens, seed=2, offset=3)
    assert diag.budget.shape == (2, 4) and diag.budget.dtype == np.int64
    assert np.all((diag.budget >= 1) & (diag.budget <= 512))
    assert np.array_equal(diag.budget_pilot, np.full((2, 4), plan.pilot))  # every head drew
    b, h = 0, 1
    fixed = SantaPlan(budget=int(diag.budget[b, h]), sampler="stratified").run(q, k, v, lens, seed=2,
                                                                               offset=3)
    assert np.array_equal(out[b, h], fixed[b, h])
    assert SantaPlan(eps=0.1, delta=0.1, max_budget=64).not_supported_reasons("cuda") == []
    assert "error-targeted budgets" in SantaPlan(
        eps=0.1, delta=0.1, max_budget=64, schedule="flash").not_supported_reasons("cuda")[0]
    with pytest.raises(ValueError, match=r"give either `budget` or `eps`"):
        SantaPlan(budget=8, eps=0.1, delta=0.1, max_budget=64)
    with pytest.raises(ValueError, match=r"`eps` needs `delta` and `max_budget`"):
        SantaPlan(eps=0.1)
