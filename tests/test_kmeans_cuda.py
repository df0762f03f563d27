"""Numba-CUDA k-means prefill (stochattn/cuda/kmeans.py) against the NumPy reference.

Runs on the real GPU when there is one and under Numba's CUDA simulator otherwise
(tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1 before Numba is imported when no GPU is
present); the inputs are NumPy arrays either way, so no CuPy is needed.

Every property is exact; none is statistical:
- the seeding (Philox words, (key, position) order) equals the reference bit for bit;
- labels, sizes, value sums and live clusters are consistent with each other exactly;
- each label is the nearest live centroid of the *returned* centroids up to a proven bound
  on float32 rounding (the reference decides in float64);
- one more iteration is exactly one float32 Lloyd update of the previous result
  (sequential float32 sums in position order, IEEE division; empty clusters stay), or,
  with an early-stop tolerance, either that or the previous result;
- on fixed data (odd sizes included, several early-stop tolerances) the whole index
  equals the reference's (labels and sizes exactly, float statistics to float32
  rounding): fixed inputs, so these either always pass or always fail;
- the GEMM path (``method="gemm"``: float16 GEMM preselection plus exact float32 checks;
  under the simulator a NumPy emulation of the GEMM) gives the index of the plain float32
  scan (``method="scan"``) bit for bit, ties, non-finite keys, extreme scales, score
  chunks and multi-thread blocks included.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba.cuda")

from numba import cuda  # noqa: E402

from stochattn.cuda.kmeans import kernels as kk  # noqa: E402
from stochattn.cuda.kmeans import host as km  # noqa: E402
from stochattn import spec  # noqa: E402
from stochattn.cuda.kmeans import kmeans_gpu  # noqa: E402
from stochattn.reference.kmeans import DEFAULT_TOL, build_index, window_starts  # noqa: E402
from stochattn.reference.rng import PURPOSE_KMEANS_INIT, random_words  # noqa: E402

U32 = 2.0**-24  # unit roundoff of float32
FIELDS = ("centroids", "sizes", "value_sums", "labels", "window_start", "n_initialized")


# ---- checks shared with tests/gpu/test_cuda_kmeans.py ----------------------------------


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): relative bound of an n-term float32 sum/dot."""
    return n * U32 / (1 - n * U32)


def check_structure(out, keys, values, lens, *, n_clusters, n_sink, window):
    """Exact invariants of a GPU index (NumPy arrays): labels exactly on the middle tokens,
    each in a live cluster; live = min(C, M); sizes = label counts; non-live clusters zero;
    value sums = float32 sums of the members (to float32 rounding of an M-term sum)."""
    B, Hkv, N, D = keys.shape
    C = n_clusters
    assert out["centroids"].dtype == np.float32 and out["value_sums"].dtype == np.float32
    assert out["labels"].dtype == np.int32 and out["sizes"].dtype == np.int64
    assert out["centroids"].shape == (B, Hkv, C, D) and out["labels"].shape == (B, Hkv, N)
    ws = window_starts(lens, n_sink, window)
    np.testing.assert_array_equal(out["window_start"], ws)
    M = np.maximum(ws - n_sink, 0)
    np.testing.assert_array_equal(out["n_initialized"], np.minimum(M, C)[:, None].repeat(Hkv, 1))
    v64 = values.astype(np.float64)
    for b in range(B):
        middle = np.zeros(N, dtype=bool)
        middle[n_sink:ws[b]] = True
        for h in range(Hkv):
            lab = out["labels"][b, h]
            live = int(out["n_initialized"][b, h])
            np.testing.assert_array_equal(lab >= 0, middle)
            assert np.all(lab[middle] < live)
            counts = np.bincount(lab[middle], minlength=C)
            np.testing.assert_array_equal(out["sizes"][b, h], counts)
            assert not out["centroids"][b, h, live:].any()
            sums = np.zeros((C, D))
            mags = np.zeros((C, D))
            np.add.at(sums, lab[middle], v64[b, h, middle])
            np.add.at(mags, lab[middle], np.abs(v64[b, h, middle]))
            bound = gamma(int(M[b]) + 1) * mags
            assert np.all(np.abs(out["value_sums"][b, h].astype(np.float64) - sums) <= bound)


def score_bound(keys64, cent64):
    """Bound on |fl32(|c|^2 - 2 k.c) - (|c|^2 - 2 k.c)| per (token, cluster): both sums
    have D terms (sequential, with or without fused multiply-adds), plus the final
    subtraction: gamma_{D+2} (|c|^2 + 2 sum_d |k_d c_d|)."""
    D = keys64.shape[-1]
    mag = (cent64 * cent64).sum(-1)[None, :] + 2.0 * np.abs(keys64) @ np.abs(cent64).T
    return gamma(D + 2) * mag


def check_nearest(out, keys):
    """Each label is a nearest live centroid of the returned centroids, float32 rounding
    aside: its float64 score exceeds the float64 minimum by at most the two error bounds.
    Returns (tokens checked, tokens whose label differs from the float64 argmin)."""
    B, Hkv = keys.shape[:2]
    total = differ = 0
    for b in range(B):
        for h in range(Hkv):
            live = int(out["n_initialized"][b, h])
            pos = np.flatnonzero(out["labels"][b, h] >= 0)
            if pos.size == 0:
                continue
            k64 = keys[b, h, pos].astype(np.float64)
            c64 = out["centroids"][b, h, :live].astype(np.float64)
            s = (c64 * c64).sum(-1)[None, :] - 2.0 * k64 @ c64.T
            err = score_bound(k64, c64) + 1e-14 * (np.abs(s) + 1.0)  # + the float64 check's own rounding
            got = out["labels"][b, h, pos].astype(np.int64)
            best = np.argmin(s, axis=1)
            rows = np.arange(pos.size)
            assert np.all(s[rows, got] <= s[rows, best] + err[rows, got] + err[rows, best])
            total += pos.size
            differ += int(np.count_nonzero(got != best))
    return total, differ


def lloyd_update32(prev, keys):
    """One update of the GPU's arithmetic from a previous result: each live, non-empty
    cluster moves to the float32 mean of its members (sequential float32 sum in position
    order: np.cumsum accumulates in order), empty ones stay."""
    cent = prev["centroids"].copy()
    B, Hkv = keys.shape[:2]
    for b in range(B):
        for h in range(Hkv):
            lab = prev["labels"][b, h]
            for c in range(int(prev["n_initialized"][b, h])):
                members = keys[b, h, lab == c].astype(np.float32)
                if len(members):
                    total = np.cumsum(members, axis=0, dtype=np.float32)[-1]
                    cent[b, h, c] = total / np.float32(len(members))
    return cent


def check_against_reference(out, ref, *, rtol=1e-5):
    """Whole index equal to the reference: integer fields exactly, float fields to rtol
    of their scale."""
    for name in ("labels", "sizes", "window_start", "n_initialized"):
        np.testing.assert_array_equal(out[name], ref[name], err_msg=name)
    for name in ("centroids", "value_sums"):
        scale = max(1.0, float(np.abs(ref[name]).max(initial=0.0)))
        np.testing.assert_allclose(out[name], ref[name], rtol=0, atol=rtol * scale, err_msg=name)


# ---- Philox and seeding ------------------------------------------------------------------


@cuda.jit
def _words_kernel(seed_lo, seed_hi, rows, draws, out):
    i = cuda.grid(1)
    if i < out.size:
        word2 = np.uint64(PURPOSE_KMEANS_INIT << 28) | np.uint64(rows[i])
        out[i] = kk.philox_x0(np.uint64(draws[i]), np.uint64(0), word2, np.uint64(0),
                              seed_lo, seed_hi)


@pytest.mark.parametrize("seed", [0, 12345, 2**32 + 7, 2**64 - 1])
def test_philox_words_match_reference(seed):
    """The kernel's Philox-4x32-10 gives the reference's random_words bit for bit."""
    rows = np.array([0, 0, 1, 5, 2**28 - 1, 77, 3, 3], dtype=np.int64)
    draws = np.array([0, 1, 2, 4096, 17, 2**31 - 1, 100000, 9], dtype=np.int64)
    out = np.zeros(rows.size, dtype=np.uint64)
    _words_kernel[1, 32](np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32), rows, draws, out)
    ref = random_words(seed, 0, PURPOSE_KMEANS_INIT, row=rows, stream=0, draw=draws)
    np.testing.assert_array_equal(out, ref.astype(np.uint64))


@cuda.jit
def _blocks_kernel(c, k, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        w = kk._philox4x32_10(c[i, 0], c[i, 1], c[i, 2], c[i, 3], k[0], k[1])
        out[i, 0] = w[0]
        out[i, 1] = w[1]
        out[i, 2] = w[2]
        out[i, 3] = w[3]


def test_kernel_philox_is_the_spec_function():
    """One Philox in Python: the kernels' device Philox is stochattn.spec.philox4x32_10
    compiled, and run as a device function it gives the NumPy result, all four words."""
    assert kk._philox4x32_10.py_func is spec.philox4x32_10
    rs = np.random.default_rng(5)
    c = rs.integers(0, 2**32, size=(40, 4), dtype=np.uint64)
    c[:4] = 0xFFFFFFFF
    k = np.array([0xFFFFFFFF, 0x12345678], dtype=np.uint64)
    out = np.zeros((40, 4), dtype=np.uint64)
    _blocks_kernel[2, 32](c, k, out)
    expect = spec.philox4x32_10(c[:, 0], c[:, 1], c[:, 2], c[:, 3], k[0], k[1])
    np.testing.assert_array_equal(out, np.stack(expect, axis=1))


_PTX_SCRIPT = """
import numpy as np
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
from numba import cuda, types
from numba.cuda.cudadrv.error import NvvmSupportError
from stochattn.spec import philox4x32_10
try:
    ptx, res = cuda.compile_ptx(philox4x32_10, (types.uint64,) * 6, device=True, cc=(9, 0))
except NvvmSupportError as e:
    print("NO-NVVM", e)
else:
    print("RESULT", res)
    print(ptx)
"""


def test_spec_philox_compiles_to_ptx():
    """numba-cuda compiles the shared Philox for sm_90 (no GPU needed, only libNVVM; a
    subprocess, since this process may run the simulator): straight-line code, no calls."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if proc.stdout.startswith("NO-NVVM"):
        pytest.skip(f"libNVVM not available: {proc.stdout.strip()[:200]}")
    assert "RESULT UniTuple(uint64 x 4)" in proc.stdout
    assert ".target sm_90" in proc.stdout
    body = [ln.split()[0] for ln in proc.stdout.splitlines()
            if ln.strip() and not ln.strip().startswith(("//", ".", "{", "}", "(", ")", "$"))]
    assert not [op for op in body if op.startswith(("bra", "call"))]  # unrolled, inlined
    assert sum(op.startswith("mul") for op in body) >= 20  # 2 products x 10 rounds


def test_seeding_equals_reference_bit_for_bit():
    """iterations=0: the centroids are the keys of the first min(C, M) middle tokens in
    (random key, position) order, exactly the reference's; two sequences, one with M < C."""
    rng = np.random.default_rng(11)
    k = rng.standard_normal((2, 2, 40, 8)).astype(np.float32)
    lens = np.array([40, 13])
    out = kmeans_gpu(k, k, lens, n_clusters=6, iterations=0, n_sink=3, window=5, seed=2**40 + 3)
    ref = build_index(k, k, lens, 6, 0, 3, 5, 2**40 + 3)
    np.testing.assert_array_equal(out["centroids"], ref["centroids"].astype(np.float32))
    np.testing.assert_array_equal(out["n_initialized"], [[6, 6], [5, 5]])
    check_against_reference(out, ref)


# ---- fixed cases: whole index equals the reference ------------------------------------


def _run_both(k, v, lens, **kw):
    out = kmeans_gpu(k, v, lens, **kw)
    ref = build_index(k, v, lens, kw["n_clusters"], kw["iterations"], kw["n_sink"], kw["window"],
                      kw["seed"], kw.get("tol", DEFAULT_TOL))
    check_structure(out, k, v, np.asarray(lens, dtype=np.int64), n_clusters=kw["n_clusters"],
                    n_sink=kw["n_sink"], window=kw["window"])
    check_nearest(out, k)
    return out, ref


def test_fewer_middle_tokens_than_clusters_and_empty_sequences():
    """Sequence 0: M = 30 > C; sequence 1: M = 3 < C = 5 (clusters 3, 4 non-live, zero);
    sequence 2: L = 2 < n_sink (no middle token at all)."""
    rng = np.random.default_rng(12)
    k = rng.standard_normal((3, 2, 40, 12)).astype(np.float32)
    v = rng.standard_normal((3, 2, 40, 12)).astype(np.float32)
    lens = np.array([40, 13, 2])
    out, ref = _run_both(k, v, lens, n_clusters=5, iterations=3, n_sink=4, window=6, seed=9)
    check_against_reference(out, ref)
    np.testing.assert_array_equal(out["sizes"][1], [[1, 1, 1, 0, 0]] * 2)
    assert np.all(out["labels"][2] == -1) and not out["centroids"][2].any()


def test_no_middle_tokens_anywhere():
    """Every L <= n_sink + window: no label, no live cluster, all statistics zero."""
    k = np.random.default_rng(13).standard_normal((2, 1, 20, 8)).astype(np.float32)
    out, ref = _run_both(k, k, np.array([0, 20]), n_clusters=3, iterations=2, n_sink=4, window=16,
                         seed=1)
    check_against_reference(out, ref)
    assert np.all(out["labels"] == -1) and not out["sizes"].any() and not out["centroids"].any()


def test_one_cluster():
    """C = 1: every middle token in cluster 0, centroid = float32 mean of the keys."""
    rng = np.random.default_rng(14)
    k = rng.standard_normal((1, 2, 50, 8)).astype(np.float32)
    out, ref = _run_both(k, k, np.array([50]), n_clusters=1, iterations=3, n_sink=2, window=4, seed=5)
    check_against_reference(out, ref)
    np.testing.assert_array_equal(out["sizes"], [[[44], [44]]])
    mean = np.cumsum(k[0, :, 2:46], axis=1, dtype=np.float32)[:, -1] / np.float32(44)
    np.testing.assert_array_equal(out["centroids"][0, :, 0], mean)


def test_cluster_that_empties_during_iterations():
    """Fixed 1-D data and seed (found by a search with the reference) where cluster 2 holds
    two tokens after the first assignment and none after the second: the empty live cluster
    keeps its centroid, takes part in later assignments, and the GPU agrees."""
    x = [1.5, -5.8, -1.8, -2.0, -2.1, -4.3, 2.3, -1.2, 1.4, 1.6, 4.1]
    k = np.zeros((1, 1, len(x), 8), dtype=np.float32)
    k[0, 0, :, 0] = x
    lens = np.array([len(x)])
    kw = dict(n_clusters=4, n_sink=0, window=0, seed=21)
    first = build_index(k, k, lens, 4, 0, 0, 0, 21)["sizes"][0, 0]
    assert first[2] > 0  # the case this test is about (reference behaviour)
    for t in (1, 3):
        out, ref = _run_both(k, k, lens, iterations=t, **kw)
        assert ref["sizes"][0, 0, 2] == 0 and out["sizes"][0, 0, 2] == 0
        check_against_reference(out, ref)


def test_duplicate_keys_float16():
    """float16 keys with exact duplicates: equal centroids tie exactly in both precisions,
    the lowest index wins, the higher one stays empty and keeps its centroid."""
    rng = np.random.default_rng(15)
    base = rng.standard_normal((1, 1, 6, 8)).astype(np.float16)
    k = np.repeat(base, 8, axis=2)  # 48 tokens, 6 distinct keys, 8 copies each
    v = rng.standard_normal((1, 1, 48, 8)).astype(np.float16)
    out, ref = _run_both(k, v, np.array([48]), n_clusters=8, iterations=3, n_sink=0, window=0,
                         seed=3)
    check_against_reference(out, ref)
    assert np.count_nonzero(out["sizes"]) <= 6


# ---- random small problems: exact properties -------------------------------------------


@st.composite
def problems(draw):
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    N = draw(st.integers(1, 48))
    D = draw(st.sampled_from((8, 16)))
    dtype = draw(st.sampled_from((np.float16, np.float32)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k = rng.standard_normal((B, Hkv, N, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, N, D)).astype(dtype)
    if draw(st.booleans()):  # exact duplicates: ties between equal centroids
        k[:, :, N // 2:] = k[:, :, : N - N // 2]
    lens = np.array([draw(st.integers(0, N)) for _ in range(B)])
    kw = dict(n_clusters=draw(st.integers(1, min(8, N))), iterations=draw(st.integers(0, 3)),
              n_sink=draw(st.integers(0, 4)), window=draw(st.integers(0, 12)),
              seed=draw(st.integers(0, 2**64 - 1)), tol=draw(st.sampled_from((0.0, 0.05, 0.3))),
              method=draw(st.sampled_from(("scan", "gemm"))))
    return k, v, lens, kw


@given(problems())
@settings(max_examples=15)
def test_random_problems_exact_properties(problem):
    """Structure and nearest-centroid (float32 bound) for the result; with iterations = 0
    the centroids equal the reference seeding bit for bit; with iterations = t >= 1 the
    centroids are exactly one float32 Lloyd update of the t - 1 result (tol = 0), or
    either that update or the t - 1 centroids themselves (tol > 0: the problem may have
    stopped)."""
    k, v, lens, kw = problem
    out = kmeans_gpu(k, v, lens, **kw)
    check_structure(out, k, v, lens, n_clusters=kw["n_clusters"], n_sink=kw["n_sink"],
                    window=kw["window"])
    check_nearest(out, k)
    t = kw["iterations"]
    if t == 0:
        ref = build_index(k, v, lens, kw["n_clusters"], 0, kw["n_sink"], kw["window"], kw["seed"])
        np.testing.assert_array_equal(out["centroids"], ref["centroids"].astype(np.float32))
        return
    prev = kmeans_gpu(k, v, lens, **{**kw, "iterations": t - 1})
    update = lloyd_update32(prev, k)
    if kw["tol"] == 0.0:
        np.testing.assert_array_equal(out["centroids"], update)
    else:
        for b in range(k.shape[0]):  # per (sequence, KV head): moved once more, or stopped
            for h in range(k.shape[1]):
                got = out["centroids"][b, h]
                assert (np.array_equal(got, update[b, h])
                        or np.array_equal(got, prev["centroids"][b, h])), (b, h)


# ---- early stop ------------------------------------------------------------------------------


def _mixture(shape, n_centres, seed, dtype=np.float32):
    """Keys around a few random centres (unit noise): Lloyd needs several rounds."""
    rng = np.random.default_rng(seed)
    B, Hkv, N, D = shape
    centres = 3.0 * rng.standard_normal((B, Hkv, n_centres, D))
    which = rng.integers(0, n_centres, size=(B, Hkv, N))
    k = np.take_along_axis(centres, which[..., None], axis=2) + rng.standard_normal(shape)
    return k.astype(dtype), rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("tol", [0.0, 0.1, 0.3, 1.0])
def test_early_stop_equals_reference(tol):
    """Per (sequence, KV head) stop after the first round that changed at most
    floor(tol * M) labels: the GPU index equals the reference's with the same tol (fixed
    inputs without float32 near-ties); tol = 1 is exactly one update of the seeding."""
    k, v = _mixture((2, 2, 120, 8), 5, seed=31)
    lens = np.array([120, 77])
    out, ref = _run_both(k, v, lens, n_clusters=7, iterations=6, n_sink=2, window=6, seed=4,
                         tol=tol)
    check_against_reference(out, ref)
    if tol == 1.0:
        init = kmeans_gpu(k, v, lens, n_clusters=7, iterations=0, n_sink=2, window=6, seed=4)
        np.testing.assert_array_equal(out["centroids"], lloyd_update32(init, k))


def test_early_stop_ends_the_rounds():
    """Once every problem has stopped, more iterations change nothing (the host stops
    launching rounds one round late and reuses the assignment already made); the stop
    happens well before the cap here, and tol = 0 goes further."""
    k, v = _mixture((1, 2, 150, 8), 6, seed=32)
    kw = dict(n_clusters=8, n_sink=0, window=0, seed=5, tol=0.2)
    runs = [kmeans_gpu(k, v, None, iterations=t, **kw) for t in range(7)]
    same = [all(np.array_equal(r[n], runs[-1][n]) for n in FIELDS) for r in runs]
    first = same.index(True)
    assert 1 <= first <= 4 and all(same[first:]), same
    exact = kmeans_gpu(k, v, None, iterations=6, **dict(kw, tol=0.0))
    assert not np.array_equal(exact["centroids"], runs[-1]["centroids"])


# ---- the GEMM path gives the scan's labels ---------------------------------------------------


def _gemm_case(name):
    rng = np.random.default_rng(len(name))
    if name == "non-finite keys":
        k = rng.standard_normal((1, 2, 30, 8)).astype(np.float32)
        k[0, 0, 7, 3] = np.inf
        k[0, 1, 9, 0] = np.nan
        k[0, 1, 12:14] = np.nan
        return k, k, np.array([30]), dict(n_clusters=4, iterations=2, n_sink=1, window=2)
    if name == "huge keys":  # |k|^2 overflows float32 for one token
        k = rng.standard_normal((1, 1, 30, 8)).astype(np.float32)
        k[0, 0, 3] = 1e20
        return k, k, np.array([30]), dict(n_clusters=4, iterations=2, n_sink=1, window=2)
    if name == "far keys":  # finite in float16 once scaled, but |k^| |c^| is out of its range
        k = rng.standard_normal((1, 1, 40, 8)).astype(np.float32)
        k[0, 0, [9, 21]] *= 3000.0
        return k, k, np.array([40]), dict(n_clusters=4, iterations=2, n_sink=1, window=2)
    k, v = _mixture((2, 2, 48, 8), 4, seed=len(name), dtype=np.float16)
    lens = np.array([48, 15])
    kw = dict(n_clusters=6, iterations=3, n_sink=3, window=5)
    if name == "exact duplicates":
        k[:, :, 24:] = k[:, :, :24]
    elif name == "large common offset":  # the power-of-two scale shrinks the keys
        k = (k.astype(np.float32) * 30.0 + 2000.0).astype(np.float16)
    elif name == "tiny keys":  # the scale lifts them out of float16 subnormals
        k, v = k.astype(np.float32) * np.float32(1e-6), v.astype(np.float32)
    return k, v, lens, kw


GEMM_CASES = ["mixture, one short sequence", "exact duplicates", "large common offset",
              "tiny keys", "non-finite keys", "huge keys", "far keys"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", GEMM_CASES)
def test_gemm_path_gives_the_scan_index(name):
    k, v, lens, kw = _gemm_case(name)
    for tol in (0.0, 0.1):
        scan = kmeans_gpu(k, v, lens, method="scan", tol=tol, seed=9, **kw)
        gemm = kmeans_gpu(k, v, lens, method="gemm", tol=tol, seed=9, **kw)
        for field in FIELDS:
            np.testing.assert_array_equal(gemm[field], scan[field], err_msg=f"{field}, tol {tol}")


def test_gemm_path_in_chunks_with_multithread_blocks(monkeypatch):
    """Score chunks of 3 rows (several GEMMs per round) and, under the simulator, blocks of
    several threads for the reductions, scans and per-cluster loops (one thread per block
    elsewhere in these tests, for speed): the same index as the scan."""
    k, v = _mixture((1, 2, 40, 16), 4, seed=33)
    lens = np.array([40])
    kw = dict(n_clusters=5, iterations=2, n_sink=2, window=3, seed=8, tol=0.0)
    scan = kmeans_gpu(k, v, lens, method="scan", **kw)
    monkeypatch.setattr(km, "GEMM_SCRATCH_BYTES", 3 * 2 * 2 * 8)  # 3 rows of H = 2, Cp = 8
    if kk.SIM:
        monkeypatch.setattr(kk, "LANES", 4)
        monkeypatch.setattr(kk, "SCAN_TPB", 4)
        monkeypatch.setattr(kk, "DIM_TPB", 4)
        monkeypatch.setattr(kk, "ROW_TILE", 3)
    gemm = kmeans_gpu(k, v, lens, method="gemm", **kw)
    for field in FIELDS:
        np.testing.assert_array_equal(gemm[field], scan[field], err_msg=field)


def _geometry_case(name):
    if name == "C = 37, ragged rows":  # 9 words of 4 scores plus one, M not a tile multiple
        k, v = _mixture((1, 2, 61, 8), 12, seed=41)
        return k, v, np.array([61]), dict(n_clusters=37, iterations=2, n_sink=1, window=2)
    if name == "all-equal keys":  # every score ties: every label is the first live cluster
        k = np.full((1, 2, 17, 8), 0.375, dtype=np.float16)
        v = np.random.default_rng(3).standard_normal(k.shape).astype(np.float16)
        return k, v, np.array([17]), dict(n_clusters=6, iterations=2, n_sink=1, window=1)
    return _gemm_case(name)


# Simulator launch geometries (no effect on a GPU, whose kernels are compiled with the
# defaults): several lanes and rows per assignment block, tails of every kind, and the
# unstaged (global-memory) sums of keys_half and the per-cluster kernels.
SIM_GEOMETRIES = {
    "lanes 4, tiles 3 x 2": dict(LANES=4, ROW_TILE=3, TILES_PER_BLOCK=2, KH_TPB=8, KH_ROWS=3,
                                 DIM_TPB=4, SCAN_TPB=4, TPB=8),
    "lanes 2, tiles 1 x 3, unstaged": dict(LANES=2, ROW_TILE=1, TILES_PER_BLOCK=3, KH_TPB=4,
                                           KH_ROWS=4, KH_SHARED=8, DIM_SHARED=4, DIM_TPB=2),
}
_SCAN_CACHE = {}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name, geometry", [
    ("C = 37, ragged rows", "lanes 2, tiles 1 x 3, unstaged"),
    ("all-equal keys", "lanes 4, tiles 3 x 2"),
    ("non-finite keys", "lanes 4, tiles 3 x 2"),
    ("huge keys", "lanes 2, tiles 1 x 3, unstaged"),
])
def test_gemm_path_launch_geometries(name, geometry, monkeypatch):
    """The GEMM path's index equals the scan's under launch geometries that exercise every
    tail (clusters past the last whole word, rows past the last whole tile or chunk, lanes
    with fewer words) and both ways of summing norms."""
    k, v, lens, kw = _geometry_case(name)
    if name not in _SCAN_CACHE:
        _SCAN_CACHE[name] = kmeans_gpu(k, v, lens, method="scan", seed=4, **kw)
    scan = _SCAN_CACHE[name]
    monkeypatch.setattr(km, "GEMM_SCRATCH_BYTES", 2 * 2 * 40 * 23)  # 23-row chunks at C = 37
    if kk.SIM:
        for attr, value in SIM_GEOMETRIES[geometry].items():
            monkeypatch.setattr(kk, attr, value)
    gemm = kmeans_gpu(k, v, lens, method="gemm", seed=4, **kw)
    for field in FIELDS:
        np.testing.assert_array_equal(gemm[field], scan[field], err_msg=field)
    if name == "all-equal keys":
        middle = gemm["labels"] >= 0
        assert middle.sum() == 2 * (17 - 2) and not gemm["labels"][middle].any()


# ---- errors --------------------------------------------------------------------------------


def test_errors():
    k = np.zeros((1, 2, 10, 8), dtype=np.float32)
    with pytest.raises(ValueError, match=r"`n_clusters` must be <= 10 \(the seq axis of `k`\), got 11"):
        kmeans_gpu(k, k, n_clusters=11)
    with pytest.raises(ValueError, match="`n_clusters` must be >= 1, got 0"):
        kmeans_gpu(k, k, n_clusters=0)
    with pytest.raises(ValueError, match="`iterations` must be >= 0, got -1"):
        kmeans_gpu(k, k, n_clusters=2, iterations=-1)
    with pytest.raises(ValueError, match="`window` must be >= 0, got -2"):
        kmeans_gpu(k, k, n_clusters=2, window=-2)
    with pytest.raises(ValueError, match="`seed` must lie in"):
        kmeans_gpu(k, k, n_clusters=2, seed=2**64)
    with pytest.raises(TypeError, match="`k` dtype must be one of float16, bfloat16, float32, got float64"):
        kmeans_gpu(k.astype(np.float64), k.astype(np.float64), n_clusters=2)
    with pytest.raises(ValueError, match="`v` must have the shape of `k`"):
        kmeans_gpu(k, k[:, :1], n_clusters=2)
    with pytest.raises(ValueError, match=r"`seq_lens` values must lie in \[0, 10\]"):
        kmeans_gpu(k, k, np.array([11]), n_clusters=2)
    with pytest.raises(TypeError, match="`k` must be a NumPy array, a CuPy array or a CUDA tensor"):
        kmeans_gpu(k.tolist(), k, n_clusters=2)
    with pytest.raises(ValueError, match=r"`tol` must lie in \[0, 1\], got 1.5"):
        kmeans_gpu(k, k, n_clusters=2, tol=1.5)
    with pytest.raises(ValueError, match=r"`tol` must lie in \[0, 1\], got nan"):
        kmeans_gpu(k, k, n_clusters=2, tol=float("nan"))
    with pytest.raises(TypeError, match="`tol` must be a real number, got str"):
        kmeans_gpu(k, k, n_clusters=2, tol="0.1")
    with pytest.raises(ValueError, match="`method` must be one of 'auto', 'gemm', 'scan', got 'fast'"):
        kmeans_gpu(k, k, n_clusters=2, method="fast")


# ---- the build-plan cache -------------------------------------------------------------------


@pytest.fixture
def plans(monkeypatch):
    """An empty plan cache, and a list of the plans built while the test runs."""
    from stochattn.cuda.kmeans import cache as _kmeans_cache

    built = []

    class Counted(km._BuildPlan):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    km.clear_build_cache()
    monkeypatch.setattr(km, "_BuildPlan", Counted)
    monkeypatch.setattr(km, "BUILD_CACHE_SIZE", 8)
    yield built, _kmeans_cache
    km.clear_build_cache()


def _uncached(monkeypatch, *args, **kw):
    """kmeans_gpu with the cache off (and the plan class not counted by ``plans``)."""
    from stochattn.cuda.kmeans.build import BuildPlan as _BuildPlan

    with monkeypatch.context() as m:
        m.setattr(km, "BUILD_CACHE_SIZE", 0)
        m.setattr(km, "_BuildPlan", _BuildPlan)
        return kmeans_gpu(*args, **kw)


def _assert_same(got, want):
    for field in FIELDS:
        np.testing.assert_array_equal(got[field], want[field], err_msg=field)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("method", ["scan", "gemm"])
def test_cached_plan_gives_the_uncached_index(method, plans, monkeypatch):
    """Builds of one configuration (other keys, values, seq_lens, seeds) share one plan
    (two here: host seq_lens, then none) and give, each, the index of an uncached build
    bit for bit, and the reference's; the cache holds the two plans, none in use."""
    built, cache = plans
    kw = dict(n_clusters=6, iterations=3, n_sink=2, window=4, tol=0.05, method=method)
    calls = []
    for i, (lens, seed) in enumerate(((np.array([48, 20]), 3), (np.array([31, 48]), 2**63 + 9),
                                      (None, 0), (None, 5))):
        k, v = _mixture((2, 2, 48, 8), 4, seed=50 + i)
        calls.append((k, v, lens, seed))
    for k, v, lens, seed in calls:
        out = kmeans_gpu(k, v, lens, seed=seed, **kw)
        _assert_same(out, _uncached(monkeypatch, k, v, lens, seed=seed, **kw))
        full = np.full(2, 48) if lens is None else lens
        ref = build_index(k, v, full, kw["n_clusters"], kw["iterations"], kw["n_sink"],
                          kw["window"], seed, kw["tol"])
        check_against_reference(out, ref)
    assert len(built) == 2 and cache.size() == 2
    assert not any(plan.in_use for plan in built)


def test_cached_plan_with_gpu_seq_lens(plans, monkeypatch):
    """GPU seq_lens are rebound like the keys: two builds with other lengths."""
    built, cache = plans
    k, v = _mixture((2, 1, 40, 8), 4, seed=60)
    kw = dict(n_clusters=5, iterations=2, n_sink=1, window=3, seed=7, method="scan")
    for lens in (np.array([40, 12]), np.array([25, 40])):
        out = kmeans_gpu(k, v, cuda.to_device(lens), **kw)
        _assert_same(out, _uncached(monkeypatch, k, v, lens, **kw))
    assert len(built) == 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cached_scratch_is_zeroed_again(plans, monkeypatch):
    """The plan's scratch that a build accumulates into (pf, rd, co) is filled with garbage
    after a first build, and every buffer a build allocates starts as garbage: the second
    build still gives the uncached index (each buffer is written or zeroed before it is
    read)."""
    from stochattn.cuda.kmeans import build as kb

    built, _ = plans
    kw = dict(n_clusters=5, iterations=3, n_sink=1, window=2, seed=11, tol=0.0, method="gemm")
    k1, v1 = _mixture((1, 2, 40, 8), 3, seed=70)
    k2, v2 = _mixture((1, 2, 40, 8), 5, seed=71)
    want = _uncached(monkeypatch, k2, v2, np.array([33]), **kw)
    kmeans_gpu(k1, v1, np.array([40]), **kw)
    plan = built[0]
    for name in ("pf", "rd", "co", "pi", "cl", "clq", "mu"):
        a = getattr(plan, name)
        junk = np.full(a.shape, np.nan if a.dtype.kind == "f" else 12345, dtype=a.dtype)
        a.copy_to_device(junk)

    def garbage(kind, like, shape, dtype):
        dt = np.dtype(dtype)
        return cuda.to_device(np.full(shape, np.nan if dt.kind == "f" else 54321, dtype=dt))

    monkeypatch.setattr(kb, "_empty", garbage)
    monkeypatch.setattr(km, "_empty", garbage)
    _assert_same(kmeans_gpu(k2, v2, np.array([33]), **kw), want)
    assert len(built) == 1


def test_other_configurations_get_other_plans(plans):
    """Any change of shape, dtype, option or seq_lens kind builds a new plan; the cache
    keeps at most BUILD_CACHE_SIZE plans, and 0 turns it off."""
    built, cache = plans
    k, v = _mixture((1, 2, 30, 8), 3, seed=80)
    base = dict(n_clusters=4, iterations=2, n_sink=1, window=2, seed=1, method="scan")
    variants = [{}, dict(n_clusters=5), dict(iterations=1), dict(window=3), dict(tol=0.0),
                dict(method="gemm")]
    for change in variants:
        kmeans_gpu(k, v, None, **{**base, **change})
    kmeans_gpu(k, v, np.array([30]), **base)  # host seq_lens instead of none
    kmeans_gpu(k.astype(np.float16), v.astype(np.float16), None, **base)
    kmeans_gpu(k[:, :1], v[:, :1], None, **base)
    assert len(built) == 9 and cache.size() == 8  # the least recently used went first
    kmeans_gpu(k, v, np.array([30]), **base)
    assert len(built) == 9  # still cached
    km.BUILD_CACHE_SIZE = 0  # restored by the fixture's monkeypatch
    km.clear_build_cache()
    kmeans_gpu(k, v, None, **base)
    assert len(built) == 10 and cache.size() == 0


def test_plan_in_use_is_not_shared(plans):
    """A build that finds its configuration's plan lent out (another thread's build)
    builds with a plan of its own, uncached, and gives the same index."""
    built, cache = plans
    k, v = _mixture((1, 2, 30, 8), 3, seed=90)
    kw = dict(n_clusters=4, iterations=2, n_sink=1, window=2, seed=1, method="scan")
    first = kmeans_gpu(k, v, None, **kw)
    plan = built[0]
    plan.in_use = True  # as if another thread were building with it
    try:
        again = kmeans_gpu(k, v, None, **kw)
    finally:
        plan.in_use = False
    assert len(built) == 2 and cache.size() == 1 and not built[1].in_use
    _assert_same(again, first)
    kmeans_gpu(k, v, None, **kw)
    assert len(built) == 2  # the cached plan again
