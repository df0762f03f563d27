"""GPU S²ANTA-flash (stochattn/cuda/santa_flash.cu) against the NumPy reference.

- indices: equal to the reference's per-tile draws (``_ref_flash_indices`` below: the
  draws of ``reference.santa.flash_estimate``, sample_points with stream = tile inverted
  through the float64 tile-local CDF) on >= 99.9% of draws; they can differ only where a
  point falls within fp32 rounding of a CDF boundary (the kernel's logits are fp32);
- output: equal, to one ulp of the output dtype (relative) plus 1e-4 for the fp32 tile
  weights, to sum_t (W_t / Z) mean(v[J]) with the kernel's J and the reference's float64
  tile weights; against ``flash_estimate``
  itself (same seed) by the flash-attention rule, on the heads whose draws all match;
- tile statistics, S_t and the sample waste against the reference's;
- draws and tile statistics do not depend on the chunk split; outputs only by rounding;
- unbiasedness: tests/stats.assert_unbiased over many independent Philox rows
  (false-failure rate 1e-6 per call, stated there).

Every test runs for both kernels of step 1 (the ``kernel`` fixture: "simt", the CUDA-core
logits, and "tc", santa_flash_tc.cu's tensor-core logits, set as the wrapper's default);
``test_flash_tc_equals_simt`` compares the two directly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn.cuda import config  # noqa: E402
from stochattn.cuda import flash as flash_mod  # noqa: E402
from stochattn.cuda.flash import flash_diagnostics, santa_flash  # noqa: E402
from stochattn.reference import santa as ref_santa  # noqa: E402
from stochattn.reference.common import kv_head_of, lengths, logits  # noqa: E402
from stochattn.reference.exact import exact_attention as ref_exact  # noqa: E402
from stochattn.reference.samplers import invert_cdf, sample_points  # noqa: E402

from stats import assert_unbiased  # noqa: E402
from gpu_helpers import peaked_inputs, to_device, to_host, to_host64  # noqa: E402

pytestmark = pytest.mark.gpu

_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # one ulp at 1.0 of the output dtype


@pytest.fixture(autouse=True, params=flash_mod.KERNELS)
def kernel(request, monkeypatch):
    """Run every test of this module with each step-1 kernel as santa_flash's default."""
    monkeypatch.setattr(flash_mod, "DEFAULT_KERNEL", request.param)
    return request.param


def _ref_flash_indices(x, lens, sampler, S, tile_size, *, seed, offset):
    """The reference flash draws in the kernel's layout: (B, Hq, S + T - 1) int64, tile t's
    S_t draws at [t S_t, (t + 1) S_t), -1 elsewhere (as flash_estimate draws them)."""
    B, Hq, N = x.shape
    T = -(-N // tile_size)
    st = ref_santa.tile_stats(x, tile_size)
    J = np.full((B, Hq, S + T - 1), -1, dtype=np.int64)
    rows = np.arange(B)[:, None] * Hq + np.arange(Hq)[None, :]
    for b in range(B):
        TL = -(-int(lens[b]) // tile_size)
        if TL == 0:
            continue
        St = -(-S // TL)
        pts = sample_points(sampler, St, seed=seed, offset=offset, row=rows[b][:, None],
                            stream=np.arange(TL)[None, :])
        local = invert_cdf(st.local[b, :, :TL], pts)
        J[b, :, :TL * St] = (local + (np.arange(TL) * tile_size)[None, :, None]).reshape(Hq, -1)
    return J, st


def _weighted_mean(v64, J, st, lens, S, tile_size, Hq):
    """sum_t (W_t / Z) mean_m v[J_tm] in float64, J in the kernel's layout, W / Z the
    reference's (0 rows for empty sequences)."""
    B, Hkv, _, D = v64.shape
    kv = kv_head_of(Hq, Hkv)
    want = np.zeros((B, Hq, D))
    for b in range(B):
        TL = -(-int(lens[b]) // tile_size)
        if TL == 0:
            continue
        St = -(-S // TL)
        Jb = J[b, :, :TL * St].reshape(Hq, TL, St)
        assert (Jb >= 0).all() and (Jb < lens[b]).all(), "a draw outside the sequence"
        mu = v64[b][kv[:, None, None], Jb].mean(axis=2)
        share = st.W[b, :, :TL] / st.Z[b][:, None]
        want[b] = np.einsum("ht,htd->hd", share, mu)
    return want


def _run(dtype, B, Hkv, G, N, D, S, sampler, tile_size, lens, *, seed, offset=7, temp=2.0,
         num_chunks=None):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed % 2**32, temp=temp)
    qd, kd, vd = to_device(q, dtype), to_device(k, dtype), to_device(v, dtype)
    q64, k64, v64 = to_host64(qd), to_host64(kd), to_host64(vd)
    lens_arr = None if lens is None else np.asarray(lens, dtype=np.int32)
    out, idx, stats = santa_flash(qd, kd, vd, lens_arr, budget=S, sampler=sampler,
                                  tile_size=tile_size, seed=seed, offset=offset,
                                  return_indices=True, return_tile_stats=True,
                                  num_chunks=num_chunks)
    assert tuple(out.shape) == (B, Hkv * G, D)
    assert str(out.dtype).replace("torch.", "") == dtype
    full = lengths(lens_arr, B, N)
    x = logits(q64, k64, full, 1.0 / math.sqrt(D))
    J_ref, st = _ref_flash_indices(x, full, sampler, S, tile_size, seed=seed, offset=offset)
    return dict(q64=q64, k64=k64, v64=v64, lens=lens_arr, full=full, x=x, out=to_host64(out),
                J=to_host(idx).astype(np.int64), J_ref=J_ref, st=st, stats=stats, S=S,
                tile_size=tile_size, sampler=sampler, seed=seed, offset=offset, dtype=dtype)


def _assert_indices_and_output(r):
    J, J_ref, full = r["J"], r["J_ref"], r["full"]
    Hq = J.shape[1]
    same = J == J_ref  # padding (-1) included: it must sit exactly where the reference's does
    assert same.mean() >= 0.999, f"only {same.mean():.5f} of indices match"
    drawn = J_ref >= 0
    mism = int((~same & drawn).sum())
    assert mism <= int(0.001 * max(int(drawn.sum()), 1)), f"{mism} of {int(drawn.sum())} draws differ"
    assert np.array_equal(J >= 0, drawn), "the kernel's draw layout differs from the reference's"
    want = _weighted_mean(r["v64"], J, r["st"], full, r["S"], r["tile_size"], Hq)
    eps = _EPS[r["dtype"]]
    np.testing.assert_allclose(r["out"], want, rtol=eps, atol=1e-4)
    empty = full == 0
    assert np.all(r["out"][empty] == 0.0), "seq_len 0 must give exact zeros"
    assert np.all(J[empty] == -1)


def _assert_tile_stats(r):
    st, stats = r["st"], r["stats"]
    tm, tl = to_host(stats.tile_max).astype(np.float64), to_host(stats.tile_sum).astype(np.float64)
    has = st.l > 0  # tiles holding tokens of the sequence
    assert np.array_equal(np.isneginf(tm), ~has) and np.all(tl[~has] == 0.0)
    np.testing.assert_allclose(tm[has], st.m[has], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tl[has], st.l[has], rtol=1e-5, atol=1e-6)
    samples, waste = flash_diagnostics(stats, r["S"])
    _, _, ref_samples, ref_waste = ref_santa.flash_estimate(
        r["x"], r["v64"], r["full"], r["sampler"], r["S"], r["tile_size"], seed=r["seed"],
        offset=r["offset"])
    np.testing.assert_array_equal(samples, ref_samples)
    np.testing.assert_allclose(waste, ref_waste, rtol=1e-5, atol=1e-6)
    TL = -(-r["full"] // r["tile_size"])
    want_st = np.where(TL > 0, -(-r["S"] // np.maximum(TL, 1)), 0)
    np.testing.assert_array_equal(to_host(stats.samples), want_st)


@pytest.mark.parametrize("sampler", ["systematic", "stratified", "iid"])
@pytest.mark.parametrize("S,tile_size", [(1, 64), (7, 32), (256, 64), (2048, 256), (300, 128), (5, 256)])
@pytest.mark.parametrize("D", [64, 128])
def test_flash_indices_match_reference(sampler, S, tile_size, D):
    """S below and above T_L, every tile size, N not a multiple of any tile."""
    r = _run("float16", 2, 2, 4, 1000 + D // 64, D, S, sampler, tile_size, None, seed=1234 + S + D)
    _assert_indices_and_output(r)
    _assert_tile_stats(r)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("num_chunks", [None, 1, 5])
def test_flash_seq_lens_groups_dtypes(dtype, G, num_chunks):
    """Lengths 0 (zero row, no draws), 1 (every draw 0), N < tile, odd N; G = 1, 3, 8."""
    r = _run(dtype, 4, 2, G, 517, 128, 256, "systematic", 64, [0, 1, 37, 517], seed=99 + G,
             num_chunks=num_chunks)
    _assert_indices_and_output(r)
    _assert_tile_stats(r)
    J1 = r["J"][1]
    assert np.all(J1[:, :256] == 0) and np.all(J1[:, 256:] == -1)  # one tile, S_t = 256 draws
    v1 = r["v64"][1, np.arange(2 * G) // G, 0]
    np.testing.assert_allclose(r["out"][1], v1, rtol=_EPS[dtype], atol=1e-6)


def test_flash_sequence_shorter_than_tile():
    """N = 20 < tile_size = 64: one partial tile holding every draw."""
    r = _run("float16", 2, 1, 3, 20, 64, 50, "iid", 64, None, seed=31)
    _assert_indices_and_output(r)
    _assert_tile_stats(r)


def _naive_flash(r, J):
    """The flash estimator with draws J, every intermediate rounded to the input dtype
    (torch on the GPU): the yardstick of the flash-attention tolerance rule."""
    torch = pytest.importorskip("torch")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[r["dtype"]]
    q64, k64, v64, full, ts, S = r["q64"], r["k64"], r["v64"], r["full"], r["tile_size"], r["S"]
    B, Hq, D = q64.shape
    Hkv, N = k64.shape[1], k64.shape[2]
    G = Hq // Hkv
    T = -(-N // ts)
    qt = torch.tensor(q64, device="cuda").to(tdt).view(B, Hkv, G, D)
    kt = torch.tensor(k64, device="cuda").to(tdt)
    vt = torch.tensor(v64, device="cuda").to(tdt)
    scale = torch.tensor(1 / math.sqrt(D), dtype=tdt, device="cuda")
    x = torch.matmul(qt, kt.transpose(-1, -2)).reshape(B, Hq, N) * scale
    mask = torch.arange(N, device="cuda")[None, :] < torch.tensor(full, device="cuda")[:, None]
    x = x.masked_fill(~mask[:, None, :], float("-inf"))
    x = torch.nn.functional.pad(x, (0, T * ts - N), value=float("-inf")).view(B, Hq, T, ts)
    m = x.amax(-1)
    has = torch.isfinite(m)  # tiles holding tokens of the sequence
    m = torch.where(has, m, torch.zeros_like(m))
    l = torch.exp(x - m[..., None]).sum(-1)  # in the input dtype
    mstar = torch.where(has, m, torch.full_like(m, float("-inf"))).amax(-1, keepdim=True)
    W = torch.where(has, torch.exp(m - mstar) * l, torch.zeros_like(l))
    share = torch.nan_to_num(W / W.sum(-1, keepdim=True))  # empty rows: 0 / 0 -> 0
    out = torch.zeros((B, Hq, D), dtype=tdt, device="cuda")
    kv = torch.tensor(kv_head_of(Hq, Hkv), device="cuda")
    for b in range(B):
        TL = -(-int(full[b]) // ts)
        if TL == 0:
            continue
        St = -(-S // TL)
        Jb = torch.tensor(J[b, :, :TL * St].reshape(Hq, TL, St), device="cuda")
        mu = vt[b][kv[:, None, None], Jb].mean(dim=2)  # in the input dtype
        out[b] = (share[b, :, :TL, None] * mu).sum(dim=1)
    return out.double().cpu().numpy()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sampler", ["systematic", "iid"])
def test_flash_matches_flash_estimate(dtype, sampler):
    """Against reference.santa.flash_estimate on the same seed: on every head whose draws
    all equal the reference's, the kernel's error is at most twice that of the same
    estimator computed naively in the input precision (flash-attention's rule), + 1e-5."""
    r = _run(dtype, 3, 2, 4, 900, 128, 512, sampler, 64, [900, 333, 0], seed=77)
    ref_out, _, _, _ = ref_santa.flash_estimate(r["x"], r["v64"], r["full"], sampler, r["S"], 64,
                                                seed=r["seed"], offset=r["offset"])
    heads = (r["J"] == r["J_ref"]).all(axis=-1)  # (B, Hq): every draw equal
    assert heads.mean() >= 0.9, "too few heads with identical draws to compare"
    naive = _naive_flash(r, r["J_ref"])
    err = np.abs(r["out"] - ref_out)[heads].max()
    err_naive = np.abs(naive - ref_out)[heads].max()
    assert err <= 2 * err_naive + 1e-5, f"kernel error {err:.3g} vs naive {err_naive:.3g}"


@pytest.mark.parametrize("tiling", config.FLASH_TC_TILINGS, ids=lambda t: t.label())
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D,G,tile_size", [(128, 4, 64), (64, 8, 32), (128, 3, 256)])
def test_flash_tc_equals_simt(kernel, tiling, dtype, D, G, tile_size):
    """The two step-1 kernels on the same inputs and seed, every compiled tensor-core tiling
    (the other flash tests run the default one): the draws agree on >= 99.9% (their logits
    differ by fp32 rounding only, so a draw can move only at a CDF boundary), the tile
    maxima to fp32 rounding of the logits, the tile sums to 1e-4 relative, and the outputs
    of heads whose draws all agree to two roundings of the output dtype."""
    if kernel != "tc":
        pytest.skip("compares both kernels itself: run once, under the tc default")
    B, Hkv, N = 2, 2, 5000
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=D + G)
    qd, kd, vd = (to_device(a, dtype) for a in (q, k, v))
    lens = np.asarray([N, 2345], dtype=np.int32)
    res = {}
    prev = config.set_config(flash_tc_tiling=tiling)
    try:
        for kern in flash_mod.KERNELS:
            out, idx, st = santa_flash(qd, kd, vd, lens, budget=700, tile_size=tile_size,
                                       seed=11, return_indices=True, return_tile_stats=True,
                                       kernel=kern)
            res[kern] = (to_host64(out), to_host(idx), [to_host(a) for a in st])
    finally:
        config.set_config(config=prev)
    (o_s, j_s, st_s), (o_t, j_t, st_t) = res["simt"], res["tc"]
    assert (j_s == j_t).mean() >= 0.999
    np.testing.assert_array_equal(st_s[2], st_t[2])  # S_t
    finite = np.isfinite(st_s[0])
    np.testing.assert_array_equal(finite, np.isfinite(st_t[0]))
    np.testing.assert_allclose(st_t[0][finite], st_s[0][finite], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(st_t[1], st_s[1], rtol=1e-4, atol=0)
    same = (j_s == j_t).all(axis=-1)
    np.testing.assert_allclose(o_t[same], o_s[same], rtol=2 * _EPS[dtype], atol=1e-4)


def test_flash_chunks_agree():
    """The chunk split changes nothing but fp32 merge rounding: draws and tile statistics
    are bit-identical (each tile lies in one chunk and its logits are computed by the same
    lanes in the same order), outputs agree to a rounding of the output dtype."""
    runs = [_run("float16", 2, 2, 4, 3000, 64, 600, "stratified", 32, [3000, 1234], seed=8,
                 num_chunks=c) for c in (1, 3, 11, None)]
    base = runs[0]
    for r in runs[1:]:
        np.testing.assert_array_equal(r["J"], base["J"])
        for a, b in zip(r["stats"], base["stats"]):
            np.testing.assert_array_equal(to_host(a), to_host(b))
        np.testing.assert_allclose(r["out"], base["out"], rtol=_EPS["float16"], atol=1e-5)
    _assert_indices_and_output(base)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flash_in_kernel_merge_equals_merge_launch(dtype, monkeypatch):
    """The chunk merge by each group's last CTA inside the flash launch gives the
    two-launch result bit for bit (empty and one-token sequences, G = 3 and 8, forced and
    default chunk counts), call after call (the arrival counters reset themselves)."""
    for B, Hkv, G, N, D, chunks in [(4, 2, 3, 3000, 128, 7), (2, 1, 8, 1999, 64, None)]:
        q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=G)
        qd, kd, vd = (to_device(a, dtype) for a in (q, k, v))
        lens = np.asarray([0, 1, N, N // 3][:B], dtype=np.int32)
        got = {}
        for flag in (True, False, True):
            with config.using_config(merge_in_kernel=flag):
                got.setdefault(flag, []).append(to_host64(santa_flash(
                    qd, kd, vd, lens, budget=300, seed=5, num_chunks=chunks)))
        for a in got[True]:
            np.testing.assert_array_equal(a, got[False][0])


def test_flash_large_logits():
    """|logits| ~ 1e4: max-shifted tiles and merge keep everything finite; draws match."""
    r = _run("float16", 1, 2, 4, 400, 64, 128, "systematic", 64, None, seed=5, temp=400.0)
    assert np.isfinite(r["out"]).all()
    _assert_indices_and_output(r)


def test_flash_deterministic_and_offset_changes_draws():
    q, k, v = peaked_inputs(2, 2, 4, 800, 128, seed=3, temp=1.0)
    qd, kd, vd = (to_device(a, "float16") for a in (q, k, v))
    a = santa_flash(qd, kd, vd, budget=64, seed=42, offset=1, return_indices=True)
    b = santa_flash(qd, kd, vd, budget=64, seed=42, offset=1, return_indices=True)
    c = santa_flash(qd, kd, vd, budget=64, seed=42, offset=2, return_indices=True)
    assert bool((a[0] == b[0]).all()) and bool((a[1] == b[1]).all()), "same seed must be bit-identical"
    assert not bool((a[1] == c[1]).all()), "a new offset must give new draws"
    only = santa_flash(qd, kd, vd, budget=64, seed=42, offset=1)  # no optional outputs
    assert bool((only == a[0]).all())


def test_flash_torch_matches_cupy_on_a_side_stream():
    """torch in -> torch out, launched on torch's current stream, same bits as CuPy."""
    torch = pytest.importorskip("torch")
    q, k, v = peaked_inputs(2, 2, 2, 333, 128, seed=11)
    qc, kc, vc = (to_device(a, "float16") for a in (q, k, v))
    want = cupy.asnumpy(santa_flash(qc, kc, vc, budget=32, seed=9))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        qt, kt, vt = (torch.as_tensor(np.asarray(a, dtype=np.float16), device="cuda") for a in (q, k, v))
        out = santa_flash(qt, kt, vt, budget=32, seed=9)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    s.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), want)


@pytest.mark.parametrize("sampler", ["systematic", "stratified", "iid"])
def test_flash_unbiased_on_gpu(sampler):
    """Mean over R = 600 independent rows (batch entries holding the same sequence; each row
    has its own Philox streams) equals the exact output. N = 150, tile 32: T_L = 5 tiles,
    S = 10, so S_t = 2 draws per tile. False-failure rate 1e-6 (nominal). The variance
    passed (used as a floor under the sample variance, see stats.unbiased_zscores) is that
    of iid draws inside each tile: exact for iid, an upper bound for stratified (the test is
    conservative there), a floor of the usual size for systematic."""
    R, Hkv, G, N, D, S, ts = 600, 1, 2, 150, 64, 10, 32
    q1, k1, v1 = peaked_inputs(1, Hkv, G, N, D, seed=17, temp=1.5)
    q, k, v = (np.repeat(a, R, axis=0) for a in (q1, k1, v1))
    qd, kd, vd = (to_device(a, "float16") for a in (q, k, v))
    out = to_host64(santa_flash(qd, kd, vd, budget=S, sampler=sampler, tile_size=ts, seed=2024))
    q64, k64, v64 = (to_host64(a)[:1] for a in (qd, kd, vd))
    scale = 1.0 / math.sqrt(D)
    truth = ref_exact(q64, k64, v64, None, scale)[0]
    # Var of one estimate with iid draws in each tile: sum_t share_t^2 Var_t(v) / S_t.
    st = ref_santa.tile_stats(logits(q64, k64, lengths(None, 1, N), scale), ts)
    TL, St = -(-N // ts), -(-S // (-(-N // ts)))
    p = st.local[0] / st.l[0][..., None]  # (Hq, T, ts) local distributions
    vt = np.pad(v64[0, 0], ((0, TL * ts - N), (0, 0))).reshape(TL, ts, D)
    mu, m2 = np.einsum("htj,tjd->htd", p, vt), np.einsum("htj,tjd->htd", p, vt**2)
    share = st.W[0] / st.Z[0][:, None]
    var = np.einsum("ht,htd->hd", share**2, (m2 - mu**2) / St)
    assert_unbiased(out, truth, alpha=1e-6, what=f"GPU santa_flash ({sampler})", variance=var)


def test_flash_64bit_offsets():
    """One stream longer than 2**31 elements: all keys 0 except a planted one past element
    2**31 with logit 20. Its tile draws only the planted row; the output equals the
    closed-form tile weights applied to the means of the rows the kernel drew."""
    D, N, ts = 128, (1 << 31) // 128 + 4096, 64
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 3 * N * D * 2 + (1 << 30):
        pytest.skip("needs about 13 GB of free GPU memory")
    k = cupy.zeros((1, 1, N, D), dtype=cupy.float16)
    v = cupy.empty((1, 1, N, D), dtype=cupy.float16)
    rs = cupy.random.RandomState(0)
    step = 1 << 22
    for s0 in range(0, N, step):
        v[0, 0, s0:s0 + step] = rs.standard_normal((min(step, N - s0), D), dtype=cupy.float32)
    p = N - 1000  # planted row: element offset p * D > 2**31
    q = cupy.zeros((1, 1, D), dtype=cupy.float16)
    q[0, 0, 0] = 1.0
    k[0, 0, p, 0] = 20.0 * math.sqrt(D)
    x = float(cupy.asnumpy(k[0, 0, p, 0]).astype(np.float64)) / math.sqrt(D)
    out, idx = santa_flash(q, k, v, budget=1, tile_size=ts, seed=3, return_indices=True)
    T = -(-N // ts)
    J = idx[0, 0, :T]  # S_t = 1: one draw per tile
    tp = p // ts
    assert int(J[tp]) == p
    assert bool((J // ts == cupy.arange(T)).all())
    # Tile masses relative to exp(0): every tile has l_t = its size; the planted tile has
    # exp(x) + (ts - 1) (scaled by exp(-x) in the kernel's max shift, the same ratio).
    sizes = np.full(T, ts, dtype=np.float64)
    sizes[-1] = N - (T - 1) * ts
    W = sizes.copy()
    W[tp] = math.exp(x) + (ts - 1)
    rows = cupy.asnumpy(v[0, 0][J].astype(cupy.float64))  # (T, D)
    want = (W[:, None] * rows).sum(axis=0) / W.sum()
    got = cupy.asnumpy(out).astype(np.float64)[0, 0]
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)


def test_flash_validation_messages():
    q = cupy.zeros((1, 4, 64), dtype=cupy.float16)
    k = cupy.zeros((1, 2, 10, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match="`tile_size` must be one of"):
        santa_flash(q, k, k, budget=4, tile_size=48)
    with pytest.raises(ValueError, match="`budget` must be >= 1"):
        santa_flash(q, k, k, budget=0)
    with pytest.raises(ValueError, match="`budget` must be at most 2\\*\\*27 on the GPU"):
        santa_flash(q, k, k, budget=2**27 + 1)
    with pytest.raises(ValueError, match="`sampler` must be one of"):
        santa_flash(q, k, k, budget=4, sampler="gumbel")
    with pytest.raises(ValueError, match="`seed` must lie in"):
        santa_flash(q, k, k, budget=4, seed=-1)
    with pytest.raises(TypeError, match="`return_indices` must be a bool"):
        santa_flash(q, k, k, budget=4, return_indices=1)
