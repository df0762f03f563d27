"""Numba-CUDA kernels of the k-means prefill; :mod:`stochattn.cuda.kmeans` launches them and
its docstring says what each step computes. Import this module only after
``stochattn.cuda.kmeans`` (which patches NumPy for numba-cuda first).

Conventions: problem ``p = b * Hkv + h`` is a (sequence, KV head) pair; ``i`` indexes its
middle tokens (position ``j = n_sink + i``), ``0 <= i < M_p``; ``live = min(C, M_p)``.
Per-token kernels run on a grid ``(ceil(rows / TPB), H)``, per-cluster kernels on
``(C, H)`` with threads over D, per-problem kernels on ``H`` blocks. Every kernel only uses
block-wide shared memory and ``syncthreads`` (no warp intrinsics) so that the CUDA
simulator runs the same code in the CPU tests.

Scratch layout (few arrays, since every array argument costs host time at each launch):

- ``pi`` (H, 2) int32: M_p, non-finite-centroid flag;
- ``pf`` (H, 3) float32: squared scale radius, max |c^|^2, max |c|^2 (GEMM path);
- ``cl`` (H, 3, C) float32: |c|^2 (the scan's norm), |c^|^2 and |c^| of the float16
  centred copy c^ (original units);
- ``rd`` (3, rounds, H) int32: changed labels, stopped, update active, per round;
- ``co`` (H, 2, C + 1) int32: label histogram / scatter cursors, CSR offsets;
- ``bc`` (H, 2, R) int32: tokens bucketed by label (any order), then sorted (CSR);
- ``hb`` (H, 2, bins + 1) int32 and ``comp`` (H, R) uint64: the seeding's counting sort;
- ``rown`` (H, R, 2) float32: |k^| (original units) and |k| per middle token.
"""

from __future__ import annotations

import math

import numpy as np

# numba-cuda 0.30 still refers to ``np.row_stack``, which NumPy 2.5 removed (see
# stochattn/cuda/kmeans.py); restore the alias before numba-cuda is imported.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config as _numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from ..reference.rng import PURPOSE_KMEANS_INIT  # noqa: E402

# ---- launch geometry ------------------------------------------------------------------

# The simulator runs every thread of a block as a Python thread: keep blocks small there.
SIM = bool(_numba_config.ENABLE_CUDASIM)
TPB = 32 if SIM else 256  # threads per block of the per-token kernels
SCAN_TPB = 1 if SIM else 256  # threads of the per-problem scans (any size)
DIM_TPB = 1 if SIM else 256  # threads over D of the per-cluster kernels (a power of two)
LANES = 1 if SIM else 32  # threads of the GEMM assignment, one row at a time (power of 2)
LANES_MAX = 32  # shared-memory size of the GEMM assignment's reductions
ROWS_PER_BLOCK = 8 if SIM else 4  # rows per block of the GEMM assignment
UNROLL = 4  # the GEMM assignment's first pass reads UNROLL * LANES scores per step
SCAN_TPB_MAX = 256  # shared-memory size of the scans (tests may raise SCAN_TPB to this)
MU_SAMPLE = 256  # the centring vector is the mean of at most this many initial centroids

# ---- Philox-4x32-10 (bit for bit stochattn.reference.rng.philox4x32) -------------------

_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_WORD2_PURPOSE = np.uint64(PURPOSE_KMEANS_INIT << 28)
_F32 = np.float32
_U64 = np.uint64
_INF = np.float32(np.inf)


@cuda.jit(device=True)
def philox_x0(c0, c1, c2, c3, k0, k1):
    """First output word of Philox-4x32-10; every argument a uint32 value held in uint64.

    The 32x32 -> 64-bit products are exact in uint64; key bumps and words are masked back
    to 32 bits, exactly as the reference does.
    """
    for r in range(10):
        if r > 0:  # key schedule: Weyl bump before every round but the first
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        p0 = _M0 * c0
        p1 = _M1 * c2
        n0 = (p1 >> _S32) ^ c1 ^ k0
        c1 = p1 & _MASK32
        c2 = (p0 >> _S32) ^ c3 ^ k1
        c3 = p0 & _MASK32
        c0 = n0
    return c0


# ---- shared device functions ------------------------------------------------------------


@cuda.jit(device=True)
def _sync():
    """``syncthreads``, skipped by one-thread blocks (the simulator's barrier is slow, and
    its tests mostly run one-thread blocks; a uniform branch on the GPU)."""
    if cuda.blockDim.x > 1:
        cuda.syncthreads()


@cuda.jit(device=True)
def _exclusive_scan(a, p, n, shared):
    """Whole block: ``a[p, 1, :n + 1]`` = exclusive prefix sums of ``a[p, 0, :n]``, then
    ``a[p, 0, :n] = 0`` (ready to serve as scatter cursors). ``shared``: blockDim int64."""
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    seg = (n + nthr - 1) // nthr
    lo = tid * seg
    hi = min(lo + seg, n)
    s = 0
    for c in range(lo, hi):
        s += a[p, 0, c]
    shared[tid] = s
    _sync()
    if tid == 0:  # blockDim partial sums, sequentially
        run = 0
        for q in range(nthr):
            x = shared[q]
            shared[q] = run
            run += x
        a[p, 1, n] = run
    _sync()
    run = shared[tid]
    for c in range(lo, hi):
        a[p, 1, c] = run
        run += a[p, 0, c]
        a[p, 0, c] = 0
    _sync()


@cuda.jit(device=True)
def pow2_scale(k2):
    """(2**-e, 2**e) as float32 from the squared radius ``k2`` of a problem's sample of
    centred keys: e = ceil(log2 sqrt(k2)) - 4, so that sample keys scale to norms <= 16
    and products of scaled keys stay far inside float16 range (a key 4000 times farther
    out would overflow its row, which then scores every cluster exactly). Exact powers of
    two."""
    e = 0
    if math.isfinite(k2) and k2 > 0:
        e = int(math.ceil(0.5 * math.log2(k2))) - 4
        e = max(-60, min(60, e))
    return _F32(math.pow(2.0, -e)), _F32(math.pow(2.0, e))


@cuda.jit(device=True)
def exact_score(keys, cent, b, h, j, c, norm):
    """``|c|^2 - 2 k.c`` in float32 (``norm`` = |c|^2, a sequential sum), the dot product
    sequential over D: the arithmetic every label is decided by (the GEMM path only
    preselects the clusters to score)."""
    dot = _F32(0.0)
    for d in range(keys.shape[3]):
        dot += _F32(keys[b, h, j, d]) * cent[b, h, c, d]
    return norm - _F32(2.0) * dot


@cuda.jit(device=True)
def _prep_cluster(cent, b, h, p, c, mu, pf, pi, gemm, cent16, cl):
    """Whole block, after the centroid row is written: ``cl[p, 0, c] = |c|^2`` (sequential
    float32 sum over D) and, for the GEMM path, the scaled float16 centred copy, its squared
    norm and norm in original units, and the per-problem maxima / non-finite flag."""
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    D = cent.shape[3]
    down, up = pow2_scale(pf[p, 0])
    if gemm:
        for d in range(tid, D, nthr):
            cent16[p, c, d] = np.float16((cent[b, h, c, d] - mu[p, d]) * down)
    _sync()
    if tid == 0:
        n = _F32(0.0)
        for d in range(D):
            x = cent[b, h, c, d]
            n += x * x
        cl[p, 0, c] = n
        if gemm:
            n1 = _F32(0.0)
            for d in range(D):
                y = _F32(cent16[p, c, d])
                n1 += y * y
            n1 = n1 * (up * up)  # exact power-of-two rescaling to original units
            cl[p, 1, c] = n1
            cl[p, 2, c] = math.sqrt(n1)
            if math.isfinite(n) and math.isfinite(n1):
                cuda.atomic.max(pf, (p, 1), n1)
                cuda.atomic.max(pf, (p, 2), n)
            else:
                cuda.atomic.max(pi, (p, 1), np.int32(1))


# ---- setup and seeding ----------------------------------------------------------------------


@cuda.jit
def prepare(lens, n_sink, window, Hkv, ws, labels, pi):
    """window_start[b] = max(n_sink, L_b - window); M_p; labels = -1 everywhere."""
    j = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    if j == 0:
        w = np.int64(lens[b]) - window
        w = w if w > n_sink else n_sink
        pi[p, 0] = w - n_sink
        pi[p, 1] = 0
        if h == 0:
            ws[b] = w
    if j < labels.shape[2]:
        labels[b, h, j] = -1


@cuda.jit
def seed_keys(pi, n_sink, seed_lo, seed_hi, shift, comp, hb):
    """Composite ``word << 32 | j`` of each middle token and a histogram of the words' top
    bits (``word >> shift``) in ``hb[p, 0]``."""
    i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    if i >= pi[p, 0]:
        return
    j = n_sink + i
    # Counter (draw=j, stream=0, (purpose << 28) | row, offset=0), key = the seed words.
    x0 = philox_x0(np.uint64(j), np.uint64(0), _WORD2_PURPOSE | np.uint64(p), np.uint64(0),
                   seed_lo, seed_hi)
    comp[p, i] = (x0 << _S32) | np.uint64(j)
    cuda.atomic.add(hb, (p, 0, np.int64(x0 >> shift)), np.int32(1))


@cuda.jit
def seed_scan_fill(pi, nbins, shift, comp, hb, bc):
    """One block per problem: bin offsets of the composites (counting sort), then each
    middle token into its bin of ``bc[p, 0]`` (any order inside a bin)."""
    sh = cuda.shared.array(SCAN_TPB_MAX, np.int64)
    p = cuda.blockIdx.x
    _exclusive_scan(hb, p, nbins, sh)
    for i in range(cuda.threadIdx.x, pi[p, 0], cuda.blockDim.x):
        q = np.int64((comp[p, i] >> _S32) >> shift)
        slot = cuda.atomic.add(hb, (p, 0, q), np.int32(1))
        bc[p, 0, hb[p, 1, q] + slot] = i


@cuda.jit
def seed_rank(pi, shift, comp, hb, bc):
    """``bc[p, 1]``: middle tokens sorted by composite (the reference's (key, position)
    order); a token's place inside its bin is the number of smaller composites there."""
    i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    if i >= pi[p, 0]:
        return
    key = comp[p, i]
    q = np.int64((key >> _S32) >> shift)
    lo = hb[p, 1, q]
    hi = hb[p, 1, q + 1]
    r = 0
    for s in range(lo, hi):
        if comp[p, bc[p, 0, s]] < key:
            r += 1
    bc[p, 1, lo + r] = i


@cuda.jit
def centre(keys, bc, pi, n_sink, Hkv, C, mu, pf):
    """One block per problem, threads over D: mu = mean of the first min(live, MU_SAMPLE)
    initial centroids (any vector would do: it only centres the float16 GEMM), and
    ``pf[p, 0]`` = the largest squared distance of those to mu (it fixes the scale)."""
    p = cuda.blockIdx.x
    b = p // Hkv
    h = p - b * Hkv
    D = keys.shape[3]
    m = pi[p, 0]
    live = m if m < C else C
    cnt = live if live < MU_SAMPLE else MU_SAMPLE
    tid = cuda.threadIdx.x
    for d in range(tid, D, cuda.blockDim.x):
        acc = _F32(0.0)
        for r in range(cnt):
            acc += _F32(keys[b, h, n_sink + bc[p, 1, r], d])
        if cnt > 0:
            mu[p, d] = acc / _F32(cnt)
        else:
            mu[p, d] = _F32(0.0)
    if tid == 0:
        pf[p, 0] = _F32(0.0)
        pf[p, 1] = _F32(0.0)
        pf[p, 2] = _F32(0.0)
    _sync()
    for r in range(tid, cnt, cuda.blockDim.x):
        pos = n_sink + bc[p, 1, r]
        s = _F32(0.0)
        for d in range(D):
            x = _F32(keys[b, h, pos, d]) - mu[p, d]
            s += x * x
        if math.isfinite(s):
            cuda.atomic.max(pf, (p, 0), s)


@cuda.jit
def keys_half(keys, mu, pf, pi, n_sink, Hkv, keys16, rown):
    """One thread per row: keys16[p, i] = float16((k - mu) * 2**-e) (zero past the
    middle), and rown[p, i] = (|keys16 row| * 2**e, |k|) (inf when not finite)."""
    i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    D = keys.shape[3]
    if i >= keys16.shape[1]:
        return
    if i >= pi[p, 0]:
        for d in range(D):
            keys16[p, i, d] = np.float16(0.0)
        rown[p, i, 0] = _F32(0.0)
        rown[p, i, 1] = _F32(0.0)
        return
    down, up = pow2_scale(pf[p, 0])
    sa = _F32(0.0)
    sb = _F32(0.0)
    for d in range(D):
        x = _F32(keys[b, h, n_sink + i, d])
        y = np.float16((x - mu[p, d]) * down)
        keys16[p, i, d] = y
        z = _F32(y)
        sa += z * z
        sb += x * x
    rown[p, i, 0] = math.sqrt(sa) * up if math.isfinite(sa) else _INF
    rown[p, i, 1] = math.sqrt(sb) if math.isfinite(sb) else _INF


@cuda.jit
def seed_centroids(keys, bc, pi, n_sink, Hkv, mu, pf, gemm, cent, cent16, cl, n_init):
    """Block (cluster c, problem p): centroid c = key of the c-th token of the order (exact
    widening), zero for non-live clusters; then the cluster's norms (and GEMM copy)."""
    c = cuda.blockIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    C = cent.shape[2]
    D = cent.shape[3]
    m = pi[p, 0]
    live = m if m < C else C
    tid = cuda.threadIdx.x
    if c == 0 and tid == 0:
        n_init[b, h] = live
    if c >= live:
        for d in range(tid, D, cuda.blockDim.x):
            cent[b, h, c, d] = _F32(0.0)
        return
    pos = n_sink + bc[p, 1, c]
    for d in range(tid, D, cuda.blockDim.x):
        cent[b, h, c, d] = _F32(keys[b, h, pos, d])
    _sync()
    _prep_cluster(cent, b, h, p, c, mu, pf, pi, gemm, cent16, cl)


# ---- assignment -----------------------------------------------------------------------------


@cuda.jit
def assign_scan(keys, cent, cl, pi, n_sink, Hkv, t, labels, co, rd):
    """One thread per middle token: every live cluster scored by :func:`exact_score`,
    first minimum (strict ``<``: ties to the lowest index)."""
    i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    m = pi[p, 0]
    if i >= m:
        return
    C = cent.shape[2]
    live = m if m < C else C
    j = n_sink + i
    best = np.int32(0)
    best_score = _F32(0.0)
    for c in range(live):
        score = exact_score(keys, cent, b, h, j, c, cl[p, 0, c])
        if c == 0 or score < best_score:  # strict: ties stay with the lowest index
            best = np.int32(c)
            best_score = score
    if labels[b, h, j] != best:
        labels[b, h, j] = best
        cuda.atomic.add(rd, (0, t, p), np.int32(1))
    cuda.atomic.add(co, (p, 0, best), np.int32(1))


@cuda.jit(device=True)
def _first_pass(c, g, n1, q, g2, ca, cb, es, U, L1, i1, L2, chk):
    """One cluster of pass 1: filter score F = |c^|^2 - 2 g 4^e, bound e = ca |c^|^2 +
    cb |c^| + es; keeps min (F + e), the two smallest F - e and the index of the smallest
    (strict ``<``, clusters ascending per thread: ties to the lowest index), and the sum
    of F (non-finite iff some F is, or it overflowed)."""
    f = n1 - g2 * _F32(g)
    e = ca * n1 + cb * q + es
    chk += f
    hi = f + e
    lo = f - e
    U = min(U, hi)
    L2 = min(L2, max(L1, lo))
    if lo < L1:
        i1 = c
    L1 = min(L1, lo)
    return U, L1, i1, L2, chk


@cuda.jit
def assign_gemm(keys, keys16, G, r0, nrows, cent, cl, pf, pi, rown, n_sink, Hkv, t, alpha, beta,
                gs, abs1, abs0, safe, labels, co, rd):
    """LANES threads per block, rows r0 + blockIdx.x * ROWS_PER_BLOCK + (0..) of the GEMM
    chunk ``G`` (flat (H, rows, C) float16 scores of the scaled centred copies) one at a
    time; ``cl``: flat (H, 3, C). Pass 1 reads the row once and keeps U = min_c (F + e) and
    the two smallest F - e; if only one cluster has F - e <= U it is the exact float32
    argmin. Otherwise pass 2 scores every cluster with F - e <= U by :func:`exact_score`
    (all live clusters for a row with a non-finite entry) and keeps the first minimum, so
    the label is always the one :func:`assign_scan` would pick."""
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    lane = cuda.threadIdx.x
    m = pi[p, 0]
    C = cent.shape[2]
    live = m if m < C else C
    rows_g = G.shape[0] // (pi.shape[0] * C)
    sf1 = cuda.shared.array(LANES_MAX, np.float32)
    sf2 = cuda.shared.array(LANES_MAX, np.float32)
    sf3 = cuda.shared.array(LANES_MAX, np.float32)
    si1 = cuda.shared.array(LANES_MAX, np.int64)
    si2 = cuda.shared.array(LANES_MAX, np.int32)
    down, up = pow2_scale(pf[p, 0])
    g2 = _F32(2.0) * (up * up)
    nmax = pf[p, 2]
    rn = math.sqrt(nmax)
    bad_p = pi[p, 1] != 0
    ca = safe * alpha
    n0 = np.int64(p) * 3 * C  # cl plane offsets of |c|^2, |c^|^2, |c^|
    n1o = n0 + C
    nqo = n1o + C
    step = UNROLL * LANES
    full = live - live % step
    n_changed = 0
    for rr in range(ROWS_PER_BLOCK):
        r = np.int64(cuda.blockIdx.x) * ROWS_PER_BLOCK + rr
        i = r0 + r
        if r >= nrows or i >= m:  # the same for every lane
            break
        j = n_sink + i
        a = rown[p, i, 0]
        bn = rown[p, i, 1]
        bad = bad_p or not (math.isfinite(a) and math.isfinite(bn))
        es = safe * (gs * (nmax + _F32(2.0) * bn * rn) + abs1 * up * a + abs0 * (up * up))
        cb = safe * (beta * a + abs1 * up)
        gb = (np.int64(p) * rows_g + r) * C
        # Pass 1: UNROLL independent loads per step, then the tail one by one.
        U = _INF
        L1 = _INF
        L2 = _INF
        i1 = np.int64(-1)
        chk = _F32(0.0)
        c = np.int64(lane)
        while c < full:
            c1 = c + LANES
            c2 = c1 + LANES
            c3 = c2 + LANES
            # Unsigned indices: no negative-index wraparound code in the hot loop.
            g0 = G[_U64(gb + c)]
            g1 = G[_U64(gb + c1)]
            g2_ = G[_U64(gb + c2)]
            g3 = G[_U64(gb + c3)]
            m0 = cl[_U64(n1o + c)]
            m1 = cl[_U64(n1o + c1)]
            m2 = cl[_U64(n1o + c2)]
            m3 = cl[_U64(n1o + c3)]
            q0 = cl[_U64(nqo + c)]
            q1 = cl[_U64(nqo + c1)]
            q2 = cl[_U64(nqo + c2)]
            q3 = cl[_U64(nqo + c3)]
            U, L1, i1, L2, chk = _first_pass(c, g0, m0, q0, g2, ca, cb, es, U, L1, i1, L2, chk)
            U, L1, i1, L2, chk = _first_pass(c1, g1, m1, q1, g2, ca, cb, es, U, L1, i1, L2, chk)
            U, L1, i1, L2, chk = _first_pass(c2, g2_, m2, q2, g2, ca, cb, es, U, L1, i1, L2, chk)
            U, L1, i1, L2, chk = _first_pass(c3, g3, m3, q3, g2, ca, cb, es, U, L1, i1, L2, chk)
            c += step
        c = full + lane
        while c < live:
            U, L1, i1, L2, chk = _first_pass(c, G[_U64(gb + c)], cl[_U64(n1o + c)],
                                             cl[_U64(nqo + c)], g2, ca, cb, es, U, L1, i1, L2,
                                             chk)
            c += LANES
        if not math.isfinite(chk):
            bad = True
        # Block reduction: min U, the two smallest F - e (ties to the lower index), any bad.
        sf1[lane] = U
        sf2[lane] = L1
        sf3[lane] = L2
        si1[lane] = i1
        si2[lane] = 1 if bad else 0
        _sync()
        s = LANES // 2
        while s > 0:
            if lane < s:
                o = lane + s
                if sf1[o] < sf1[lane]:
                    sf1[lane] = sf1[o]
                la = sf2[lane]
                ia = si1[lane]
                lb = sf2[o]
                ib = si1[o]
                if ib >= 0 and (ia < 0 or lb < la or (lb == la and ib < ia)):
                    sf2[lane] = lb
                    si1[lane] = ib
                    sf3[lane] = min(sf3[o], la)
                else:
                    sf3[lane] = min(sf3[lane], lb)
                si2[lane] = si2[lane] | si2[o]
            _sync()
            s //= 2
        U = sf1[0]
        L2 = sf3[0]
        best = si1[0]
        bad = si2[0] != 0
        _sync()
        if bad or not (L2 > U):
            # Pass 2: exact scores of the candidates, first minimum; a NaN score of
            # cluster 0 keeps label 0, other NaN scores never win (the scan's rule).
            bs = _F32(0.0)
            bi = np.int64(-1)
            nan0 = 0
            c = np.int64(lane)
            while c < live:
                take = bad
                if not take:
                    n1 = cl[n1o + c]
                    f = n1 - g2 * _F32(G[gb + c])
                    e = ca * n1 + cb * cl[nqo + c] + es
                    take = f - e <= U
                if take:
                    sc = exact_score(keys, cent, b, h, j, c, cl[n0 + c])
                    if sc != sc:
                        if c == 0:
                            nan0 = 1
                    elif bi < 0 or sc < bs:
                        bs = sc
                        bi = c
                c += LANES
            sf1[lane] = bs
            si1[lane] = bi
            si2[lane] = nan0
            _sync()
            s = LANES // 2
            while s > 0:
                if lane < s:
                    o = lane + s
                    io = si1[o]
                    im = si1[lane]
                    if io >= 0 and (im < 0 or sf1[o] < sf1[lane]
                                    or (sf1[o] == sf1[lane] and io < im)):
                        sf1[lane] = sf1[o]
                        si1[lane] = io
                    si2[lane] = si2[lane] | si2[o]
                _sync()
                s //= 2
            best = si1[0]
            if si2[0] != 0:
                best = np.int64(0)
            _sync()
        if lane == 0:
            lab = np.int32(best)
            if labels[b, h, j] != lab:
                labels[b, h, j] = lab
                n_changed += 1
            cuda.atomic.add(co, (p, 0, lab), np.int32(1))
    if lane == 0 and n_changed > 0:
        cuda.atomic.add(rd, (0, t, p), np.int32(n_changed))


# ---- update: stable counting sort by label, then means --------------------------------------


@cuda.jit
def scan_fill(co, pi, rd, labels, n_sink, Hkv, C, t, final, tol, pf, bc):
    """One block per problem. Round t (``final == 0``): stopped[t] = stopped[t-1] or
    changed[t] <= floor(tol * M); the update runs (active[t] = 1) iff the problem had not
    stopped and some label changed. Then (active rounds and the final pass) CSR offsets of
    the labels and each token into its cluster's segment of ``bc[p, 0]`` (any order inside
    a segment). Also clears the per-problem maxima for the coming update."""
    sh = cuda.shared.array(SCAN_TPB_MAX, np.int64)
    p = cuda.blockIdx.x
    b = p // Hkv
    h = p - b * Hkv
    m = pi[p, 0]
    live = m if m < C else C
    tid = cuda.threadIdx.x
    if final != 0:
        if tid == 0:
            rd[2, t, p] = 1
    else:
        if tid == 0:
            pf[p, 1] = _F32(0.0)
            pf[p, 2] = _F32(0.0)
            pi[p, 1] = 0
        prev = rd[1, t - 1, p]
        ch = rd[0, t, p]
        threshold = np.int64(math.floor(tol * np.float64(m)))
        go = prev == 0 and ch > 0
        if tid == 0:
            rd[1, t, p] = 1 if (prev != 0 or ch <= threshold) else 0
            rd[2, t, p] = 1 if go else 0
        if not go:
            return
    _exclusive_scan(co, p, live, sh)
    for i in range(tid, m, cuda.blockDim.x):
        lab = labels[b, h, n_sink + i]
        slot = cuda.atomic.add(co, (p, 0, lab), np.int32(1))
        bc[p, 0, co[p, 1, lab] + slot] = i


@cuda.jit
def rank(labels, pi, rd, co, bc, n_sink, Hkv, t):
    """``bc[p, 1]``: each segment sorted by position (a token's place is the number of
    members before it), so sums over a segment run in ascending position order."""
    i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    if i >= pi[p, 0] or rd[2, t, p] == 0:
        return
    lab = labels[b, h, n_sink + i]
    lo = co[p, 1, lab]
    hi = co[p, 1, lab + 1]
    r = 0
    for s in range(lo, hi):
        if bc[p, 0, s] < i:
            r += 1
    bc[p, 1, lo + r] = i


@cuda.jit
def mean(keys, bc, co, pi, rd, n_sink, Hkv, t, mu, pf, gemm, cent, cent16, cl):
    """Block (cluster c, problem p), threads over D: an active problem's non-empty cluster
    moves to the float32 mean of its members (sequential sum in position order, one IEEE
    division); then the cluster's norms (and GEMM copy); clears its histogram count."""
    c = cuda.blockIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    C = cent.shape[2]
    D = cent.shape[3]
    m = pi[p, 0]
    live = m if m < C else C
    tid = cuda.threadIdx.x
    if tid == 0:
        co[p, 0, c] = 0
    if c >= live:
        return
    if rd[2, t, p] != 0:
        lo = co[p, 1, c]
        hi = co[p, 1, c + 1]
        if hi > lo:
            for d in range(tid, D, cuda.blockDim.x):
                acc = _F32(0.0)
                for q in range(lo, hi):
                    acc += _F32(keys[b, h, n_sink + bc[p, 1, q], d])
                cent[b, h, c, d] = acc / _F32(hi - lo)
    _sync()
    _prep_cluster(cent, b, h, p, c, mu, pf, pi, gemm, cent16, cl)


@cuda.jit
def stats(values, bc, co, pi, n_sink, Hkv, sizes, value_sums):
    """Block (cluster c, problem p): size and float32 value sum (sequential, position
    order) of the final members; zero for non-live clusters."""
    c = cuda.blockIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    C = value_sums.shape[2]
    D = values.shape[3]
    m = pi[p, 0]
    live = m if m < C else C
    tid = cuda.threadIdx.x
    if c >= live:
        for d in range(tid, D, cuda.blockDim.x):
            value_sums[b, h, c, d] = _F32(0.0)
        if tid == 0:
            sizes[b, h, c] = 0
        return
    lo = co[p, 1, c]
    hi = co[p, 1, c + 1]
    for d in range(tid, D, cuda.blockDim.x):
        acc = _F32(0.0)
        for q in range(lo, hi):
            acc += _F32(values[b, h, n_sink + bc[p, 1, q], d])
        value_sums[b, h, c, d] = acc
    if tid == 0:
        sizes[b, h, c] = hi - lo
