"""Error-targeted budgets on the GPU (S²ANTA-prop; stochattn.cuda.santa.santa_prop_targeted,
docs/budgets.md "GPU") against the NumPy reference (stochattn.reference.budgets), and the
squared value norms kept beside the cache (stochattn.value_norms) on the GPU.

What is compared, and the one tolerance:

- **Norms**: the GPU's ||v_j||^2 equal the host's (float64 sums rounded once to float32) on
  >= 99.9% of the rows and within one float32 ulp everywhere (the two float64 sums run in
  different orders).
- **Pilot draws**: the GPU's pilot indices (stratified, purpose PURPOSE_BUDGET_PILOT; stream
  0, or streams 1 and 2 for the two sets of ``norm="student"``) as per-token counts equal
  the reference's ``sampler_counts`` on the Philox stream, except on
  rows where a point lies within fp32 rounding of a CDF boundary (the GPU's logits are
  fp32, the reference's float64): at most 1% of the rows, and those rows ("boundary rows")
  are left out of the budget comparison below.
- **Budgets, exactly as the device computes them**: S, capped and the error bound
  recomputed in float64 NumPy from the device's own m2 and L^2 (returned in
  ``DeviceBudgets``) with the reference's formula equal the device's bit for bit: the
  device applies ``choose_budgets``' rule with no other rounding.
- **Budgets against the reference**: m2 within a relative 5e-5 and L^2 within 5e-5 m2 of
  the reference's (fp32 logits against float64). S may then differ from the reference's
  only where the reference's need c (m2 - L^2) / (eps^2 L^2) lies so close to a ceil
  boundary (or to the cap) that perturbing m2 and L^2 by that relative 5e-5 moves
  ceil(need): the test computes need's interval under the perturbation and requires the
  device's S inside [S(need_lo), S(need_hi)]; outside such intervals S is equal. At least
  90% of the rows must agree exactly, so a systematic drift cannot hide in the intervals.
- **Main draws**: on rows whose S equals the reference's, the indices equal
  ``prop_indices`` at that S on >= 99.9% of the draws (the prop tests' rule); columns past
  a row's S are -1. The output equals the float64 mean of the V rows the kernel drew, to
  one rounding of the output dtype.
- Paged caches: the same budgets, indices and output as the contiguous call, bit for bit.
- Graph capture: a captured call replays the eager calls' outputs and budgets (device
  offset advanced on the device).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn.cuda.santa import KERNELS, santa_prop_targeted  # noqa: E402
from stochattn.paged import from_contiguous  # noqa: E402
from stochattn.reference import santa as ref_santa  # noqa: E402
from stochattn.reference.budgets import (budgets_from_moments, choose_budgets,  # noqa: E402
                                         philox_uniform, sampler_counts, student_split,
                                         tail_factor)
from stochattn.reference.common import lengths, logits, masked_weights  # noqa: E402
from stochattn.spec import PURPOSE_BUDGET_PILOT  # noqa: E402
from stochattn.value_norms import append_value_sqnorms, value_sqnorms  # noqa: E402

from gpu_helpers import peaked_inputs, to_device, to_host, to_host64  # noqa: E402
from paged_helpers import assert_bitwise, gpu_paged  # noqa: E402

pytestmark = pytest.mark.gpu

B, HKV, G, N, D = 3, 2, 4, 700, 128
LENS = np.array([700, 333, 0], dtype=np.int32)
_EPS_OUT = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # one ulp at 1.0 of the output dtype
# The relative error allowed in m2 and L^2 (L^2's relative to m2): fp32 logits against
# float64 move m2 by ~1e-6, the fp32 sum of the pilot's rows moves ||o_p|| by at most
# pilot * 2**-24 (1.5e-5 at 256 rows, ~1e-6 typically).
REL = 5e-5

# (rule, eps, delta, pilot, max_budget): a mix of capped and uncapped heads on these inputs
# (reference, CPU, norm "pilot": 0, 7 and 13 of 16 non-empty heads capped; "student": none,
# S from 89 to 1515).
CASES = [("clt", 0.2, 0.1, 256, 3000), ("chebyshev", 0.3, 0.1, 256, 3000),
         ("clt", 0.1, 0.05, 64, 3000)]


def _host_inputs(seed=5):
    q, k, v = peaked_inputs(B, HKV, G, N, D, seed=seed)
    # A per-KV-head mean makes ||o|| comparable to ||v_j||, so most heads get a finite S.
    v = v + np.random.default_rng(9).standard_normal((B, HKV, 1, D)) * 0.7
    return q, k, v


def _device_inputs(dtype, seed=5):
    q, k, v = _host_inputs(seed)
    qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
    return qd, kd, vd, to_host64(qd), to_host64(kd), to_host64(vd)


def _lens_like(qd):
    if type(qd).__module__.split(".")[0] == "torch":
        import torch

        return torch.as_tensor(LENS, device="cuda")
    return cupy.asarray(LENS)


def _reference(q64, k64, v64, sq64, rule, eps, delta, pilot, max_budget, seed, offset,
               norm="pilot"):
    x = logits(q64, k64, lengths(LENS, B, N), 1.0 / math.sqrt(D))
    ch = choose_budgets(x, sq64, v64, eps=eps, delta=delta, max_budget=max_budget, rule=rule,
                        norm=norm, pilot=pilot, seed=seed, offset=offset)
    return x, ch


def _formula(m2, L2, c, eps, max_budget, nonempty):
    """choose_budgets' S, capped and bound from m2 and L^2 (float64), as the device does."""
    return budgets_from_moments(m2, L2, c, eps, max_budget, nonempty)


def _budget_interval(m2, L2, c, eps, max_budget, nonempty):
    """[S_lo, S_hi]: the S of every need reachable by moving m2 and L^2 by a relative REL
    (L^2 by REL m2), the float rounding of fp32 logits."""
    dm, dl = REL * m2, REL * m2
    lo_m2, hi_m2 = m2 - dm, m2 + dm
    lo_L2, hi_L2 = np.maximum(L2 - dl, 0.0), L2 + dl
    S_hi, _, _ = _formula(hi_m2, lo_L2, c, eps, max_budget, nonempty)
    S_lo, _, _ = _formula(lo_m2, hi_L2, c, eps, max_budget, nonempty)
    return S_lo, S_hi


def _pilot_boundary_rows(x, pilot_idx, pilot, seed, offset, norm="pilot"):
    """(B, Hq) bool: rows whose GPU pilot draws differ from the reference's (as per-token
    counts of each set: the pilot on stream 0, or the studentised sets A and B on streams 1
    and 2, side by side in ``pilot_idx``)."""
    Bn, Hq, Nn = x.shape
    w, _ = masked_weights(x)  # choose_budgets' weights
    rows = (np.arange(Bn)[:, None] * Hq + np.arange(Hq)[None, :]).reshape(-1)
    sets = tuple(zip(student_split(pilot), (1, 2))) if norm == "student" else ((pilot, 0),)
    nonempty = LENS > 0
    diff = np.zeros((Bn, Hq), dtype=bool)
    at = 0
    for n, stream in sets:
        want = sampler_counts(w.reshape(Bn * Hq, Nn), "stratified", n,
                              philox_uniform(seed, offset, PURPOSE_BUDGET_PILOT, rows, Hq,
                                             stream=stream)).reshape(Bn, Hq, Nn)
        got = np.zeros_like(want)
        for b in np.flatnonzero(nonempty):
            for h in range(Hq):
                got[b, h] = np.bincount(pilot_idx[b, h, at:at + n], minlength=Nn)[:Nn]
        diff |= np.any(got != want, axis=-1)
        at += n
    diff[~nonempty] = False
    return diff


def _run_targeted(dtype, sampler, rule, eps, delta, pilot, max_budget, *, seed=3, offset=11,
                  kernel=None, paged=None, norm="pilot"):
    qd, kd, vd, q64, k64, v64 = _device_inputs(dtype)
    sq = value_sqnorms(vd)
    sq64 = to_host(sq).astype(np.float64)
    if paged is None:
        res = santa_prop_targeted(qd, kd, vd, _lens_like(qd), v_sqnorms=sq, eps=eps, delta=delta,
                                  max_budget=max_budget, rule=rule, pilot=pilot,
                                  sampler=sampler, seed=seed, offset=offset, kernel=kernel,
                                  norm=norm, return_indices=True, return_budgets=True)
    else:
        cache = gpu_paged(from_contiguous(np.asarray(to_host64(kd)), np.asarray(v64), LENS,
                                          **paged), dtype)
        res = santa_prop_targeted(qd, cache, None, v_sqnorms=value_sqnorms(cache), eps=eps,
                                  delta=delta, max_budget=max_budget, rule=rule, pilot=pilot,
                                  sampler=sampler, seed=seed, offset=offset, kernel=kernel,
                                  norm=norm, return_indices=True, return_budgets=True)
    return res, (q64, k64, v64, sq64)


def _check_against_reference(res, host, dtype, sampler, rule, eps, delta, pilot, max_budget,
                             seed, offset, norm="pilot"):
    out, idx, pidx, dev = res
    q64, k64, v64, sq64 = host
    x, ch = _reference(q64, k64, v64, sq64, rule, eps, delta, pilot, max_budget, seed, offset,
                       norm)
    nonempty = np.broadcast_to((LENS > 0)[:, None], ch.budget.shape)
    S = to_host(dev.budget).astype(np.int64)
    capped = to_host(dev.capped).astype(bool)
    bound = to_host(dev.error_bound)
    L2, m2 = to_host(dev.norm_sq_lower), to_host(dev.second_moment)
    J, PJ = to_host(idx).astype(np.int64), to_host(pidx).astype(np.int64)

    # 1. The device applies the rule exactly to its own m2 and L^2.
    c = tail_factor(rule, ch.delta_main)
    S_f, capped_f, bound_f = _formula(m2, L2, c, eps, max_budget, nonempty)
    np.testing.assert_array_equal(S, S_f)
    np.testing.assert_array_equal(capped, capped_f)
    np.testing.assert_array_equal(bound, bound_f)
    assert np.all(S[~nonempty] == 0) and np.all(J[~nonempty] == -1)

    # 2. m2 and the pilot against the reference.
    np.testing.assert_allclose(m2, ch.second_moment, rtol=REL, atol=0)
    boundary = _pilot_boundary_rows(x, PJ, pilot, seed, offset, norm)
    assert boundary.sum() <= max(1, int(0.01 * nonempty.sum())), boundary.sum()
    ok = nonempty & ~boundary
    assert np.all(np.abs(L2 - ch.norm_sq_lower)[ok] <= REL * ch.second_moment[ok]), "L^2"

    # 3. S against the reference: equal, except within the rounding interval of a ceil.
    S_lo, S_hi = _budget_interval(ch.second_moment, ch.norm_sq_lower, c, eps, max_budget,
                                  nonempty)
    inside = (S >= S_lo) & (S <= S_hi)
    assert np.all(inside[ok]), (S[ok & ~inside], ch.budget[ok & ~inside])
    same = (S == ch.budget)[ok]
    assert same.mean() >= 0.9, f"only {same.mean():.3f} of the budgets equal the reference's"

    # 4. Main draws: the fixed-S draws of each row's S; -1 past S.
    match = total = 0
    for s_val in np.unique(S[ok & (S == ch.budget)]):
        J_ref, _, _ = ref_santa.prop_indices(x, sampler, int(s_val), 64, seed=seed,
                                             offset=offset)
        rows = ok & (S == s_val)
        match += int((J[rows][:, :s_val] == J_ref[rows]).sum())
        total += int(rows.sum()) * int(s_val)
    assert total == 0 or match / total >= 0.999, f"{total - match} of {total} indices differ"
    for b, h in zip(*np.nonzero(nonempty)):
        assert np.all(J[b, h, S[b, h]:] == -1)
        got = J[b, h, :S[b, h]]
        assert got.min() >= 0 and got.max() < LENS[b] and np.all(np.diff(got) >= 0)

    # 5. Output: the float64 mean of the drawn rows, rounded once.
    got = to_host64(out)
    Hq = HKV * G
    want = np.zeros_like(got)
    for b, h in zip(*np.nonzero(nonempty)):
        want[b, h] = v64[b, h // G, J[b, h, :S[b, h]]].mean(axis=0)
    e = _EPS_OUT[dtype]
    np.testing.assert_allclose(got, want, rtol=e, atol=e * 1e-2 + 1e-6)
    assert np.all(got[~nonempty] == 0.0)
    assert Hq == got.shape[1]
    return S


@pytest.mark.parametrize("norm", ["pilot", "student"])
@pytest.mark.parametrize("sampler", ["systematic", "stratified", "iid"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-eps{c[1]}-d{c[2]}-p{c[3]}" for c in CASES])
def test_budgets_indices_and_output_match_reference(sampler, case, norm):
    rule, eps, delta, pilot, max_budget = case
    res, host = _run_targeted("float16", sampler, rule, eps, delta, pilot, max_budget, norm=norm)
    _check_against_reference(res, host, "float16", sampler, rule, eps, delta, pilot, max_budget,
                             3, 11, norm)


def test_student_with_a_set_b_not_a_multiple_of_four():
    """pilot 70: S_A 17, S_B 53, so the one-pass projections' last group of four draws is
    partly past S_B (its clamped loads must stay out of the sums)."""
    res, host = _run_targeted("float16", "systematic", "clt", 0.2, 0.1, 70, 3000,
                              norm="student")
    _check_against_reference(res, host, "float16", "systematic", "clt", 0.2, 0.1, 70, 3000,
                             3, 11, "student")


# Several of santa_prop_second_moment's 4096-token chunks: lengths across chunk edges, a
# row whose later chunks are past its length, one token, none.
_LONG_LENS = np.array([9000, 4097, 4096, 1, 0], dtype=np.int32)


@pytest.mark.parametrize("paged", [None, dict(layout="NHD", page_size=16, shuffle_seed=2),
                                   dict(layout="HND", page_size=64, shuffle_seed=3)])
@pytest.mark.parametrize("norm", ["pilot", "student"])
def test_second_moment_over_several_chunks(paged, norm):
    Bl, Nl = len(_LONG_LENS), int(_LONG_LENS.max())
    q, k, v = peaked_inputs(Bl, HKV, G, Nl, D, seed=8)
    v = v + np.random.default_rng(9).standard_normal((Bl, HKV, 1, D)) * 0.7
    qd, kd, vd = to_device(q, "float16"), to_device(k, "float16"), to_device(v, "float16")
    q64, k64, v64 = to_host64(qd), to_host64(kd), to_host64(vd)
    lens = cupy.asarray(_LONG_LENS) if type(qd).__module__.split(".")[0] != "torch" else \
        __import__("torch").as_tensor(_LONG_LENS, device="cuda")
    opts = dict(eps=0.2, delta=0.1, max_budget=3000, rule="clt", pilot=64, norm=norm,
                sampler="systematic", seed=3, offset=11, return_budgets=True)
    if paged is None:
        out, dev = santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=value_sqnorms(vd), **opts)
    else:
        cache = gpu_paged(from_contiguous(np.asarray(k64), np.asarray(v64), _LONG_LENS,
                                          extra_pages=1, **paged), "float16")
        out, dev = santa_prop_targeted(qd, cache, None, v_sqnorms=value_sqnorms(cache), **opts)
    sq64 = np.einsum("bknd,bknd->bkn", v64, v64)
    x = logits(q64, k64, lengths(_LONG_LENS, Bl, Nl), 1.0 / math.sqrt(D))
    ch = choose_budgets(x, sq64, v64, eps=0.2, delta=0.1, max_budget=3000, rule="clt",
                        norm=norm, pilot=64, seed=3, offset=11)
    nonempty = np.broadcast_to((_LONG_LENS > 0)[:, None], ch.budget.shape)
    m2, L2 = to_host(dev.second_moment), to_host(dev.norm_sq_lower)
    np.testing.assert_allclose(m2[nonempty], ch.second_moment[nonempty], rtol=1e-4, atol=0)
    assert np.all(m2[~nonempty] == 0.0) and np.all(to_host(dev.budget)[~nonempty] == 0)
    S_f, capped_f, _ = _formula(m2, L2, tail_factor("clt", ch.delta_main), 0.2, 3000, nonempty)
    np.testing.assert_array_equal(to_host(dev.budget), S_f)
    np.testing.assert_array_equal(to_host(dev.capped).astype(bool), capped_f)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_nan_key_gives_capped_nan_rows(kernel):
    """A NaN key: the rows of its (sequence, KV head) get S = 1, capped, NaN fields and a
    NaN output on both pass-1 kernels (the tensor cores' tile maxima drop a NaN, so the
    budget kernel sees it in the moment sums); every other row is untouched."""
    qd, kd, vd, *_ = _device_inputs("float16")
    k_host = to_host64(kd)
    k_host[0, 1, 5, 0] = np.nan
    kd = to_device(k_host, "float16")
    out, dev = santa_prop_targeted(qd, kd, vd, _lens_like(qd), v_sqnorms=value_sqnorms(vd),
                                   eps=0.2, delta=0.1, max_budget=3000, rule="clt", pilot=64,
                                   kernel=kernel, seed=3, offset=11, return_budgets=True)
    bad = np.zeros((B, HKV * G), dtype=bool)
    bad[0, G:2 * G] = True
    S, capped = to_host(dev.budget), to_host(dev.capped).astype(bool)
    assert np.all(S[bad] == 1) and np.all(capped[bad])
    for f in ("error_bound", "norm_sq_lower", "second_moment"):
        assert np.all(np.isnan(to_host(getattr(dev, f))[bad])), f
    assert np.all(np.isnan(to_host64(out)[bad]))
    ok = ~bad & (LENS > 0)[:, None]
    assert np.all(np.isfinite(to_host(dev.second_moment)[ok]))
    assert np.all(np.isfinite(to_host64(out)[ok]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_pass1_kernels_and_bfloat16(kernel):
    pytest.importorskip("torch")
    rule, eps, delta, pilot, max_budget = CASES[0]
    res, host = _run_targeted("bfloat16", "systematic", rule, eps, delta, pilot, max_budget,
                              kernel=kernel, seed=8, offset=2)
    _check_against_reference(res, host, "bfloat16", "systematic", rule, eps, delta, pilot,
                             max_budget, 8, 2)


@pytest.mark.parametrize("layout,page_size", [("NHD", 16), ("HND", 1), ("HND", 64)])
@pytest.mark.parametrize("sampler,norm", [("systematic", "pilot"), ("iid", "pilot"),
                                          ("stratified", "student")])
def test_paged_equals_contiguous_bitwise(layout, page_size, sampler, norm):
    rule, eps, delta, pilot, max_budget = CASES[1]
    cont, _ = _run_targeted("float16", sampler, rule, eps, delta, pilot, max_budget, norm=norm)
    paged, _ = _run_targeted("float16", sampler, rule, eps, delta, pilot, max_budget, norm=norm,
                             paged=dict(page_size=page_size, layout=layout, shuffle_seed=4,
                                        extra_pages=2))
    for a, b, what in zip(cont[:3], paged[:3], ("out", "indices", "pilot indices")):
        assert_bitwise(a, b, what)
    for f in cont[3]._fields:
        assert_bitwise(getattr(cont[3], f), getattr(paged[3], f), f)


def test_plan_diagnostics_and_fixed_budget_rows():
    """SantaPlan(eps=...) on the GPU (opt-in): Diagnostics carry the device's budgets, and
    every row equals a fixed-budget call with its own S (bit for bit)."""
    qd, kd, vd, *_ = _device_inputs("float16")
    sq = value_sqnorms(vd)
    lens = cupy.asarray(LENS)
    opts = dict(eps=0.2, delta=0.1, max_budget=3000, budget_rule="clt", pilot=256,
                sampler="stratified")
    plan = stochattn.SantaPlan(device="cuda", **opts)
    out, diag = plan.diagnose(qd, kd, vd, lens, seed=2, offset=3, v_sqnorms=sq)
    _, _, _, dev = santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=sq, eps=0.2, delta=0.1,
                                       max_budget=3000, rule="clt", pilot=256,
                                       sampler="stratified", seed=2, offset=3,
                                       return_indices=True, return_budgets=True)
    np.testing.assert_array_equal(diag.budget, to_host(dev.budget))
    np.testing.assert_array_equal(diag.budget_capped, to_host(dev.capped).astype(bool))
    np.testing.assert_array_equal(diag.error_bound, to_host(dev.error_bound))
    assert diag.budget.dtype == np.int64 and diag.budget_capped.dtype == bool
    assert np.all(diag.v_rows_read <= np.minimum(LENS, 8 * 3000)[:, None])
    run = plan.run(qd, kd, vd, lens, seed=2, offset=3, v_sqnorms=sq)
    assert cupy.array_equal(run, out)
    for b, h in [(0, 0), (0, 5), (1, 3)]:
        fixed = stochattn.SantaPlan(budget=int(diag.budget[b, h]), sampler="stratified",
                                    device="cuda").run(qd, kd, vd, lens, seed=2, offset=3)
        assert cupy.array_equal(fixed[b, h], out[b, h]), (b, h)


def test_graph_capture_replays_the_eager_calls():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.as_tensor(a, device="cuda").half() for a in _host_inputs())
    lens = torch.as_tensor(LENS, device="cuda")
    sq = value_sqnorms(v)
    opts = dict(eps=0.3, delta=0.1, max_budget=3000, budget_rule="chebyshev", pilot=256,
                sampler="systematic")
    eager = stochattn.SantaPlan(device="cuda", **opts)
    want = [eager.run(q, k, v, lens, seed=7, offset=o, v_sqnorms=sq) for o in range(20, 25)]
    assert not torch.equal(want[0], want[1])
    plan = stochattn.SantaPlan(device="cuda", advance_offset=True, **opts)
    offset = torch.tensor(20, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)
    s = torch.cuda.Stream()  # warm-up (plan, compile, workspace) outside the capture
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan.run(q, k, v, lens, seed=7, offset=offset, out=out, v_sqnorms=sq)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(out, want[0]) and int(offset) == 21
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q, k, v, lens, seed=7, offset=offset, out=out, v_sqnorms=sq)
    assert int(offset) == 21  # capturing runs nothing
    for i in (1, 2, 3, 4):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[i]), i
    assert int(offset) == 25


def test_warm_call_with_out_and_workspace_allocates_nothing():
    from paged_helpers import CountingAllocator

    qd, kd, vd, *_ = _device_inputs("float16")
    sq = value_sqnorms(vd)
    lens = cupy.asarray(LENS)
    from stochattn.cuda.runtime.workspace import Workspace

    ws, out = Workspace(), cupy.empty((B, HKV * G, D), dtype=cupy.float16)
    call = dict(v_sqnorms=sq, eps=0.2, delta=0.1, max_budget=3000, rule="clt", pilot=256,
                seed=1, offset=2, out=out, workspace=ws)
    santa_prop_targeted(qd, kd, vd, lens, **call)
    with CountingAllocator() as counter:
        santa_prop_targeted(qd, kd, vd, lens, **call)
    assert counter.count == 0, counter.count


def test_bad_inputs_name_the_argument():
    qd, kd, vd, *_ = _device_inputs("float16")
    lens = cupy.asarray(LENS)
    sq = value_sqnorms(vd)
    common = dict(eps=0.2, delta=0.1, max_budget=3000, rule="clt", pilot=256)
    with pytest.raises(ValueError, match="`v_sqnorms` is required"):
        santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=None, **common)
    with pytest.raises(TypeError, match="`v_sqnorms`"):
        santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=sq.astype(cupy.float64), **common)
    with pytest.raises(ValueError, match="`v_sqnorms`"):
        santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=sq[:, :, :-1], **common)
    with pytest.raises(ValueError, match="`v_sqnorms`"):
        santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=sq[:, :, ::2].copy()[:, :, :N // 2],
                            **common)
    with pytest.raises(ValueError, match="`norm`"):
        santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=sq, norm="oracle", **common)
    with pytest.raises(ValueError, match="`pilot`"):
        santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=sq, norm="student",
                            **dict(common, pilot=3))
    with pytest.raises(ValueError, match="`eps`"):
        santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=sq, **dict(common, eps=-1.0))
    with pytest.raises(ValueError, match="`max_budget`"):
        santa_prop_targeted(qd, kd, vd, lens, v_sqnorms=sq, **dict(common, max_budget=0))
    cache = gpu_paged(from_contiguous(to_host64(kd), to_host64(vd), LENS, page_size=16),
                      "float16")
    with pytest.raises(ValueError, match="`v_sqnorms`"):  # contiguous norms for a paged cache
        santa_prop_targeted(qd, cache, None, v_sqnorms=sq, **common)
    # Through the plan: the refusals that stay.
    with pytest.raises(NotImplementedError, match="schedule='flash'"):
        stochattn.SantaPlan(eps=0.1, delta=0.1, max_budget=64, schedule="flash", device="cuda")
    stochattn.SantaPlan(eps=0.1, delta=0.1, max_budget=64, budget_norm="student", device="cuda")
    plan = stochattn.SantaPlan(eps=0.1, delta=0.1, max_budget=64, device="cuda")
    with pytest.raises(ValueError, match="`v_sqnorms` is required"):
        plan.run(qd, kd, vd, lens)
    with pytest.raises(TypeError, match="`v_sqnorms`"):
        stochattn.SantaPlan(budget=8, device="cuda").run(qd, kd, vd, lens, v_sqnorms=sq)


# ---- the norms on the GPU ---------------------------------------------------------------------

def _host_norms(a):
    a = np.asarray(a, dtype=np.float64)
    return np.einsum("...d,...d->...", a, a).astype(np.float32)


def _assert_norms(got, want):
    got = to_host(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2.0**-23, atol=0)
    assert (got[finite] == want[finite]).mean() >= 0.999


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_value_norms_match_the_host(dtype):
    _, _, v = _host_inputs()
    if dtype == "float32":
        vd = cupy.asarray(v.astype(np.float32))
    else:
        vd = to_device(v, dtype)
    want = _host_norms(to_host64(vd))
    _assert_norms(value_sqnorms(vd), want)
    out = cupy.full((B, HKV, N), -1.0, dtype=cupy.float32) if dtype != "bfloat16" else None
    if out is not None:
        assert value_sqnorms(vd, out=out) is out
        _assert_norms(out, want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
def test_value_norms_of_paged_pools_and_append(layout, combined):
    _, k, v = _host_inputs()
    host_cache = from_contiguous(k, v, LENS, page_size=16, layout=layout, shuffle_seed=1)
    cache = gpu_paged(host_cache, "float16", combined=combined)
    sq = value_sqnorms(cache)
    want = _host_norms(to_host64(cache.v_pages))
    _assert_norms(sq, want)
    # Append: overwrite the last token of each sequence on the device, then update.
    pool = cache.v_pages
    start = np.maximum(LENS - 1, 0)
    indptr, idx = np.asarray(host_cache.kv_indptr), np.asarray(host_cache.kv_indices)
    for b in range(B):
        if LENS[b] == 0:
            continue
        page, slot = idx[indptr[b] + start[b] // 16], start[b] % 16
        if layout == "NHD":
            pool[int(page), int(slot)] = 3.0
        else:
            pool[int(page), :, int(slot)] = 3.0
    append_value_sqnorms(cache, sq, cupy.asarray(start.astype(np.int32)), count=1)
    _assert_norms(sq, _host_norms(to_host64(cache.v_pages)))


def test_value_norms_append_contiguous_on_the_device():
    _, _, v = _host_inputs()
    vd = to_device(v, "float16")
    sq = value_sqnorms(vd)
    vd[:, :, 100:103] = 2.0
    start = cupy.asarray(np.array([100, 100, 698], dtype=np.int32))
    append_value_sqnorms(vd, sq, start, count=3)  # b = 2: tokens 698, 699 (700 is past N)
    want = _host_norms(to_host64(vd))
    stale = _host_norms(v.astype(np.float16))
    want[2, :, 100:103] = stale[2, :, 100:103]  # not announced for b = 2
    _assert_norms(sq, want)


@pytest.mark.parametrize("form", ["int", "int64", "host"])
def test_value_norms_append_start_forms(form):
    """An integer start (the kernel's scalar, no array), a device int64 array and a host
    array recompute the same rows as a device int32 start."""
    _, _, v = _host_inputs()
    vd = to_device(v, "float16")
    sq = value_sqnorms(vd)
    vd[:, :, 200:202] = -1.5
    B = v.shape[0]
    start = {"int": 200, "int64": cupy.full(B, 200, dtype=cupy.int64),
             "host": np.full(B, 200, dtype=np.int64)}[form]
    append_value_sqnorms(vd, sq, start, count=2)
    _assert_norms(sq, _host_norms(to_host64(vd)))


def test_value_norms_append_int_start_captures_in_a_graph():
    """An integer start allocates nothing and copies nothing: the append can be captured,
    and a replay recomputes the rows of the captured start."""
    _, _, v = _host_inputs()
    vd = to_device(v, "float16")
    sq = value_sqnorms(vd)
    append_value_sqnorms(vd, sq, 300, count=1)  # warm: compile and plan outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        graph_stream = stream
        graph_stream.begin_capture()
        append_value_sqnorms(vd, sq, 300, count=1)
        graph = graph_stream.end_capture()
    vd[:, :, 300] = 3.0
    graph.launch(stream)
    stream.synchronize()
    _assert_norms(sq, _host_norms(to_host64(vd)))
