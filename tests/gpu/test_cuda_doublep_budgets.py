"""Double-P's sampled variant with error-targeted budgets on the GPU
(stochattn.cuda.doublep.doublep_decode(eps=...), santa_prop.cu's Double-P section,
docs/budgets.md) against the NumPy reference (stochattn.reference.split_budgets,
stochattn.reference.doublep) on the same index, inputs and float32 norms.

Written 2026-12-07 on a machine without a GPU, passed on an H100 the same day. What is
asserted, and the tolerances:

- **The rule, exactly**: S, capped and the error bound recomputed in float64 NumPy
  (budgets_from_variance) from the device's own variance bound and L^2 equal the device's
  bit for bit; under norm "auto" the way and the pilot size recomputed by auto_pilot_plan
  from the device's own (w_A, m2_A, ||w_E o_E||, n_A) equal the device's, except on rows
  whose s_opt lies within 1e-9 (relative) of an integer (CUDA's cbrt is within 1 ulp of
  libm's; tests/test_doublep_budgets_host.py proves the header equal to the reference on
  the host, bit for bit).
- **Against the reference** (rows whose selection equals the reference's, as
  test_cuda_doublep_sample.py): m2_A within a relative 5e-5, w_A within 1e-4, n_A equal;
  the reference's S inside the interval of S over the device's variance bound and L^2
  moved by a relative 1e-3 (fp32 logits and partials against float64; the pilot's fp32
  mean), and equal to the reference's on >= 90% of the rows; the pilot size of "auto"
  equal on >= 95% of the rows. Each share allows at least one row (these cases have 16-24
  rows).
- **Draws**: a row with S draws exactly what a fixed-budget GPU call with that S draws, and
  its output is that call's, bit for bit (the draws are the merge's last partial in both).
  Pilot draws as per-token counts equal sampler_counts on the Philox stream (purpose
  PURPOSE_BUDGET_PILOT, stream 0) over the reference's C_approx weights on all rows
  compared but one or 1% (fp32 CDF boundaries).
- Paged caches (NHD/HND, page sizes 1 and 16): output, indices, pilot indices and every
  budget field equal the contiguous call's bit for bit.
- Plans: diagnostics equal the device arrays; a warm call with ``out=`` and the plan's
  workspace allocates nothing; a captured torch CUDA graph replays the eager call.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import stochattn  # noqa: E402
from stochattn.cuda.doublep import SplitBudgets, doublep_decode, split_constants, \
    targeted_of  # noqa: E402
from stochattn.paged import from_contiguous  # noqa: E402
from stochattn.reference import doublep as ref_dp  # noqa: E402
from stochattn.reference.budgets import (budgets_from_variance, philox_uniform,  # noqa: E402
                                         sampler_counts)
from stochattn.reference.kmeans import cluster_csr  # noqa: E402
from stochattn.reference.split_budgets import auto_pilot_plan, choose_split_budgets  # noqa: E402
from stochattn.spec import PURPOSE_BUDGET_PILOT  # noqa: E402
from stochattn.value_norms import value_sqnorms  # noqa: E402

from gpu_helpers import to_host, to_host64  # noqa: E402
from paged_helpers import CountingAllocator, assert_bitwise, gpu_paged  # noqa: E402
from test_cuda_doublep import OUT_TOL, host_index, setup  # noqa: E402

pytestmark = pytest.mark.gpu

# m2_A relative, w_A absolute (fp32 sums of the exact part's weights over thousands of
# tokens), the variance bound and L^2 relative (the need's interval).
REL_M2, ABS_WA, REL_NEED = 5e-5, 1e-4, 1e-3
SEED, OFFSET = 11, 5
# (rule, norm, eps, delta, pilot, max_budget, p1, p2): capped and uncapped rows, every way.
CASES = [("clt", "pilot", 0.2, 0.1, 64, 2000, 0.95, 0.5),
         ("chebyshev", "bound", 0.3, 0.1, 64, 2000, 0.95, 0.7),
         ("clt", "auto", 0.1, 0.1, 512, 4000, 0.95, 0.5),
         ("chebyshev", "auto", 0.2, 0.05, 64, 1000, 0.99, 0.3)]
SHAPES = {  # (B, Hkv, G, N, D, lens, C)
    "group of 4": (2, 2, 4, 3000, 128, [3000, 2100], 96),
    "G=3, odd lengths": (3, 2, 3, 1777, 64, [1777, 1, 0], 50),
}


def _setup(shape, dtype="float16"):
    B, Hkv, G, N, D, lens, C = SHAPES[shape]
    dev, host, lens, index = setup(B, Hkv, G, N, D, lens, C=C, dtype=dtype, seed=len(shape))
    sq = value_sqnorms(dev[2])
    return dev, host, lens, index, sq


def _opts(case):
    rule, norm, eps, delta, pilot, mb, p1, p2 = case
    return dict(p1=p1, p2=p2, eps=eps, delta=delta, max_budget=mb, budget_rule=rule,
                budget_norm=norm, pilot=pilot, sampler="systematic", seed=SEED, offset=OFFSET)


def _host(b: SplitBudgets) -> dict:
    return {name: to_host(getattr(b, name)) for name in SplitBudgets._fields}


def reference_rows(host, lens, hix, sq64, case):
    """Per row (b, h) with a C_approx: the reference's C_approx (positions ascending), its
    weights, w_E, o_E and choose_split_budgets' choice, as doublep_attention computes them."""
    rule, norm, eps, delta, pilot, mb, p1, p2 = case
    q64, k64, v64 = host
    B, Hq, D = q64.shape
    G = Hq // k64.shape[1]
    scale = 1 / math.sqrt(D)
    offsets, token_ids = cluster_csr(hix.labels, hix.sizes, hix.window_start, hix.n_sink)
    rows = {}
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue
        ws = int(hix.window_start[b])
        base = np.concatenate([np.arange(min(hix.n_sink, L)), np.arange(ws, L)])
        for h in range(Hq):
            kvh = h // G
            x = (k64[b, kvh, :L] @ q64[b, h]) * scale
            ids, xbar = ref_dp.cluster_scores(q64[b, h], hix.centroids[b, kvh],
                                              hix.sizes[b, kvh], scale)
            order, n_p, n_e, _ = ref_dp.select_clusters(xbar, p1, p2)
            tok = lambda cs: np.concatenate([np.zeros(0, np.int64)] + [  # noqa: E731
                token_ids[b, kvh, offsets[b, kvh, c]:offsets[b, kvh, c + 1]] for c in cs])
            exact = np.concatenate([base, tok(ids[order[:n_e]])]).astype(np.int64)
            approx = np.sort(tok(ids[order[n_e:n_p]])).astype(np.int64)
            if approx.size == 0:
                continue
            xe, xa = x[exact], x[approx]
            m = max(xe.max(initial=-np.inf), xa.max())
            we, wa = np.exp(xe - m), np.exp(xa - m)
            V = v64[b, kvh, :L]
            den_e = we.sum()
            oe = (we @ V[exact]) / den_e if den_e > 0 else np.zeros(D)
            w_exact = den_e / (den_e + wa.sum())
            ch = choose_split_budgets(wa[None], V[approx][None], sq64[b, kvh, approx][None],
                                      np.array([w_exact]), oe[None], eps=eps, delta=delta,
                                      max_budget=mb, rule=rule, norm=norm, pilot=pilot,
                                      pilot_share=0.25, seed=SEED, offset=OFFSET,
                                      rows=np.array([b * Hq + h]), heads=Hq)
            rows[b, h] = dict(approx=approx, wa=wa, w_exact=w_exact, oe=oe, choice=ch,
                              n_p=n_p, n_e=n_e, G=float(np.linalg.norm(w_exact * oe)))
    return rows


def _at_most(bad, n, frac) -> bool:
    """``bad`` of ``n`` within the allowed share ``frac``, at least one row allowed."""
    return bad <= max(1, math.floor(frac * n))


def _need_interval(var, L2, c, eps, mb):
    lo, _, _ = budgets_from_variance(np.array([var * (1 - REL_NEED)]),
                                     np.array([L2 * (1 + REL_NEED)]), c, eps, mb, np.array([True]))
    hi, _, _ = budgets_from_variance(np.array([var * (1 + REL_NEED)]),
                                     np.array([max(L2 * (1 - REL_NEED), 0.0)]), c, eps, mb,
                                     np.array([True]))
    return int(lo[0]), int(hi[0])


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_budgets_draws_and_output_against_the_reference(shape, case):
    dev, host, lens, index, sq = _setup(shape)
    opts = _opts(case)
    rule, norm, eps, delta, pilot, mb = case[:6]
    out, J, PJ, bud, diag = doublep_decode(*dev, index, v_sqnorms=sq, return_indices=True,
                                           return_budgets=True, return_diagnostics=True, **opts)
    d = _host(bud)
    J = to_host(J).astype(np.int64)
    st = d["state"]
    B, Hq = d["budget"].shape
    k = split_constants(targeted_of(eps, delta, mb, rule, norm, pilot, 0.25))
    ok = st[..., 7] == 0
    # 1. The rule, bit for bit, from the device's own inputs.
    c = np.where(st[..., 5] == 2, k["c_main"], k["c_full"]) if norm == "auto" else (
        k["c_main"] if norm == "pilot" else k["c_full"])
    S, cap, bound = budgets_from_variance(d["variance"], d["norm_sq_lower"], c, eps, mb, ok)
    np.testing.assert_array_equal(d["budget"][ok], S[ok])
    np.testing.assert_array_equal(d["capped"][ok] != 0, cap[ok])
    np.testing.assert_array_equal(d["error_bound"][ok].view(np.uint64),
                                  bound[ok].view(np.uint64))
    assert np.all(d["budget"][st[..., 7] == 1] == 0)
    if norm == "auto":
        way, size, _ = auto_pilot_plan(st[..., 1][ok], st[..., 2][ok], st[..., 3][ok],
                                       st[..., 4][ok].astype(np.int64), eps=eps, delta=delta,
                                       rule=rule, pilot=pilot, pilot_share=0.25)
        same = (way == st[..., 5][ok]) & (size == st[..., 6][ok])
        assert _at_most((~same).sum(), same.size, 0.01), (
            f"{(~same).sum()} rows choose another way than the rule")
    # 2. Against the reference.
    rows = reference_rows(host, lens, host_index(index), to_host64(sq), case)
    compared = equal = way_equal = 0
    for (b, h), r in rows.items():
        if not ok[b, h] or diag["clusters_selected"][b, h] != r["n_p"] \
                or diag["clusters_exact"][b, h] != r["n_e"]:
            continue
        ch = r["choice"]
        compared += 1
        assert abs(st[b, h, 2] - ch.second_moment[0]) <= REL_M2 * ch.second_moment[0], (b, h)
        assert abs(st[b, h, 1] - (1 - r["w_exact"])) <= ABS_WA, (b, h)
        assert int(st[b, h, 4]) == r["approx"].size, (b, h)
        if norm != "auto":
            lo, hi = _need_interval(d["variance"][b, h], d["norm_sq_lower"][b, h], c, eps, mb)
            assert lo <= ch.budget[0] <= hi or d["budget"][b, h] == ch.budget[0], (b, h)
        else:
            way_equal += int(st[b, h, 6] == np.broadcast_to(ch.pilot, (1,))[0])
        equal += int(d["budget"][b, h] == ch.budget[0])
    assert compared >= 0.8 * len(rows), (
        f"only {compared} of {len(rows)} rows select as the reference")
    assert _at_most(compared - equal, compared, 0.1), (
        f"S equals the reference's on {equal} of {compared} rows")
    if norm == "auto":
        assert _at_most(compared - way_equal, compared, 0.05)
    # 3. Pilot draws as counts over the reference's C_approx.
    if PJ is not None:
        PJ = to_host(PJ).astype(np.int64)
        hits = total = 0
        for (b, h), r in rows.items():
            S0 = int(st[b, h, 6]) if norm == "auto" else pilot
            if not ok[b, h] or (norm == "auto" and st[b, h, 5] != 2) or S0 == 0:
                continue
            u = philox_uniform(SEED, OFFSET, PURPOSE_BUDGET_PILOT, np.array([b * Hq + h]), Hq, 0)
            want = sampler_counts(r["wa"][None], "stratified", S0, u)[0]
            drawn = PJ[b, h, :S0]
            assert np.all(PJ[b, h, S0:] == -1)
            got = np.array([np.count_nonzero(drawn == t) for t in r["approx"]])
            total += 1
            hits += int(np.array_equal(got, want))
        assert _at_most(total - hits, total, 0.01), f"pilot counts equal on {hits} of {total}"
    # 4. A row with S draws and outputs what a fixed-budget call with S does, bit for bit.
    out_h = to_host64(out)
    for S in np.unique(d["budget"][ok]):
        fixed, JF = doublep_decode(*dev, index, p1=opts["p1"], p2=opts["p2"], budget=int(S),
                                   sampler="systematic", seed=SEED, offset=OFFSET,
                                   return_indices=True)
        sel = ok & (d["budget"] == S)
        np.testing.assert_array_equal(J[sel][:, :S], to_host(JF).astype(np.int64)[sel])
        assert np.all(J[sel][:, S:] == -1)
        np.testing.assert_array_equal(out_h[sel].view(np.uint64),
                                      to_host64(fixed)[sel].view(np.uint64))
    # 5. The output against the reference's on rows whose draws equal its draws.
    want, wd = ref_dp.doublep_attention(*host, lens, host_index(index), p1=opts["p1"],
                                        p2=opts["p2"], approx="sample", budget=None,
                                        sampler="systematic", seed=SEED, offset=OFFSET,
                                        scale=1 / math.sqrt(host[0].shape[-1]), eps=eps,
                                        delta=delta, max_budget=mb, budget_rule=rule,
                                        budget_norm=norm, pilot=pilot, v_sqnorms=to_host64(sq))
    Jr = wd["sample_indices"]
    w = min(Jr.shape[-1], J.shape[-1])
    rows_ok = ok & (d["budget"] == wd["budget"]) & (J[..., :w] == Jr[..., :w]).all(axis=-1)
    tol = OUT_TOL["float16"] * max(1.0, np.abs(host[2]).max())
    err = np.abs(out_h - want).max(axis=-1)
    assert np.all(err[rows_ok] <= tol)
    assert np.all(diag["budget"] == d["budget"])
    assert np.all(diag["budget_capped"] == (d["capped"] != 0))


@pytest.mark.parametrize("layout, page_size", [("NHD", 16), ("HND", 1), ("HND", 16)])
@pytest.mark.parametrize("norm", ["pilot", "auto"])
def test_paged_equals_contiguous_bit_for_bit(layout, page_size, norm):
    dev, host, lens, index, sq = _setup("group of 4")
    case = next(c for c in CASES if c[1] == norm)
    k32, v32 = host[1].astype(np.float32), host[2].astype(np.float32)
    hostc = from_contiguous(k32, v32, lens, page_size=page_size, layout=layout,
                            shuffle_seed=page_size, extra_pages=2)
    cache = gpu_paged(hostc, "float16")
    sq_paged = value_sqnorms(cache)
    a = doublep_decode(*dev, index, v_sqnorms=sq, return_indices=True, return_budgets=True,
                       **_opts(case))
    b = doublep_decode(dev[0], cache, None, index, v_sqnorms=sq_paged, return_indices=True,
                       return_budgets=True, **_opts(case))
    for x, y, what in zip(a[:3], b[:3], ("output", "indices", "pilot indices")):
        if x is not None:
            assert_bitwise(x, y, what)
    for name in SplitBudgets._fields:
        assert_bitwise(getattr(a[3], name), getattr(b[3], name), name)


def test_empty_approx_and_short_rows_draw_nothing():
    """p2 = 1: no C_approx, so S = 0, no pilot, no draw, and the output is the fixed-budget
    call's (every selected cluster exact)."""
    dev, host, lens, index, sq = _setup("G=3, odd lengths")
    opts = dict(_opts(CASES[2]), p2=1.0)
    out, J, PJ, bud = doublep_decode(*dev, index, v_sqnorms=sq, return_indices=True,
                                     return_budgets=True, **opts)
    d = _host(bud)
    assert np.all(d["budget"] == 0) and np.all(d["capped"] == 0)
    assert np.all(d["error_bound"] == 0)
    assert np.all(to_host(J) == -1) and np.all(to_host(PJ) == -1)
    fixed = doublep_decode(*dev, index, p1=opts["p1"], p2=1.0, budget=4, seed=SEED,
                           offset=OFFSET)
    assert_bitwise(out, fixed, "output without C_approx")
    assert np.all(to_host64(out)[lens == 0] == 0)


def test_nonfinite_sampled_key_gives_a_nan_row_and_a_capped_budget():
    dev, host, lens, index, sq = _setup("group of 4")
    opts = _opts(CASES[0])
    _, _, _, bud = doublep_decode(*dev, index, v_sqnorms=sq, return_indices=True,
                                  return_budgets=True, **opts)
    d = _host(bud)
    b, h = map(int, np.argwhere(d["state"][..., 7] == 0)[0])
    rows = reference_rows(host, lens, host_index(index), to_host64(sq), CASES[0])
    t = int(rows[b, h]["approx"][0])
    k = dev[1].copy()
    G = dev[0].shape[1] // k.shape[1]
    k[b, h // G, t, 0] = np.nan
    out, bud2 = doublep_decode(dev[0], k, dev[2], index, v_sqnorms=sq, return_budgets=True,
                               **opts)
    d2 = _host(bud2)
    assert d2["state"][b, h, 7] == 2 and d2["budget"][b, h] == 1 and d2["capped"][b, h] == 1
    assert math.isnan(d2["error_bound"][b, h]) and np.isnan(to_host64(out)[b, h]).all()


def test_plan_diagnostics_workspace_and_no_allocation():
    dev, host, lens, index, sq = _setup("group of 4")
    opts = _opts(CASES[2])
    kw = {k: opts.pop(k) for k in ("seed", "offset")}
    plan = stochattn.DoublePPlan(approx="sample", device="cuda", **opts)
    out, diag = plan.diagnose(*dev, index=index, v_sqnorms=sq, **kw)
    _, _, _, bud = doublep_decode(*dev, index, v_sqnorms=sq, return_indices=True,
                                  return_budgets=True, **opts, **kw)
    d = _host(bud)
    np.testing.assert_array_equal(diag.budget, d["budget"])
    np.testing.assert_array_equal(diag.budget_capped, d["capped"] != 0)
    np.testing.assert_array_equal(diag.error_bound.view(np.uint64),
                                  d["error_bound"].view(np.uint64))
    np.testing.assert_array_equal(diag.budget_pilot, np.where(d["state"][..., 7] == 0,
                                                              d["state"][..., 6], 0))
    o = cupy.empty_like(dev[0])
    plan.run(*dev, index=index, v_sqnorms=sq, out=o, **kw)
    with CountingAllocator() as counter:
        plan.run(*dev, index=index, v_sqnorms=sq, out=o, **kw)
    assert counter.count == 0
    assert_bitwise(o, out, "plan run")


def test_graph_capture_replays_the_eager_call():
    torch = pytest.importorskip("torch")
    from paged_helpers import warm

    dev, host, lens, index, sq = _setup("group of 4", dtype="bfloat16")  # torch tensors
    assert isinstance(dev[0], torch.Tensor)
    opts = _opts(CASES[3])
    kw = {k: opts.pop(k) for k in ("seed", "offset")}
    plan = stochattn.DoublePPlan(approx="sample", device="cuda", **opts)
    out = torch.empty_like(dev[0])
    warm(lambda: plan.run(*dev, index=index, v_sqnorms=sq, out=out, **kw))
    eager = plan.run(*dev, index=index, v_sqnorms=sq, **kw).clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(*dev, index=index, v_sqnorms=sq, out=out, **kw)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_bad_inputs_name_the_argument():
    dev, host, lens, index, sq = _setup("group of 4")
    opts = _opts(CASES[0])
    with pytest.raises(ValueError, match="`v_sqnorms` is required"):
        doublep_decode(*dev, index, **opts)
    with pytest.raises(TypeError, match="`v_sqnorms` must have dtype float32"):
        doublep_decode(*dev, index, v_sqnorms=sq.astype(cupy.float64), **opts)
    with pytest.raises(ValueError, match="`v_sqnorms` must have shape"):
        doublep_decode(*dev, index, v_sqnorms=sq[:, :, :-1].copy(), **opts)
    with pytest.raises(ValueError, match="studentised"):
        doublep_decode(*dev, index, v_sqnorms=sq, **dict(opts, budget_norm="student"))
    with pytest.raises(NotImplementedError, match="student"):
        stochattn.doublep_attention(*dev, index=index, approx="sample", eps=0.1, delta=0.1,
                                    max_budget=64, budget_norm="student", v_sqnorms=sq)


def test_sub_mass_rows_draw_and_output_what_fixed_budget_sub_calls_do():
    """Error-targeted budgets over a sub-centroid index (``mass="sub"``, which only changes
    the cluster scores of stage 1): every row selects what a fixed-budget sub call selects,
    and a row with S draws and outputs what that call with S does, bit for bit."""
    from test_cuda_doublep_sub import setup as sub_setup

    B, Hkv, G, N, D, lens, C = SHAPES["group of 4"]
    dev, _, _, index = sub_setup(B, Hkv, G, N, D, lens, C=C, seed=7)
    sq = value_sqnorms(dev[2])
    opts = _opts(("clt", "pilot", 0.2, 0.1, 64, 2000, 0.95, 0.5))
    out, J, _, bud, diag = doublep_decode(*dev, index, v_sqnorms=sq, return_indices=True,
                                          return_budgets=True, return_diagnostics=True,
                                          mass="sub", **opts)
    d = _host(bud)
    ok = d["state"][..., 7] == 0
    assert ok.sum() >= 8
    J = to_host(J).astype(np.int64)
    out_h = to_host64(out)
    for S in np.unique(d["budget"][ok]):
        fixed, JF, fd = doublep_decode(*dev, index, p1=opts["p1"], p2=opts["p2"], budget=int(S),
                                       sampler="systematic", seed=SEED, offset=OFFSET,
                                       mass="sub", return_indices=True,
                                       return_diagnostics=True)
        sel = ok & (d["budget"] == S)
        for name in ("clusters_selected", "clusters_exact"):
            np.testing.assert_array_equal(to_host(diag[name])[sel], to_host(fd[name])[sel])
        np.testing.assert_array_equal(J[sel][:, :S], to_host(JF).astype(np.int64)[sel])
        np.testing.assert_array_equal(out_h[sel].view(np.uint64),
                                      to_host64(fixed)[sel].view(np.uint64))
    # The sub scores are in use: the paper index's selection differs on some row.
    _, _, _, _, paper_diag = doublep_decode(*dev, index, v_sqnorms=sq, return_indices=True,
                                            return_budgets=True, return_diagnostics=True,
                                            **opts)
    assert any(np.any(to_host(paper_diag[n]) != to_host(diag[n]))
               for n in ("clusters_selected", "clusters_exact"))
