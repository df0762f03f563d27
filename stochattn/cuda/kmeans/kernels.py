"""Numba-CUDA kernels of the k-means prefill; :mod:`stochattn.cuda.kmeans` launches them and
its docstring says what each step computes. Import this module only after
``stochattn.cuda.kmeans`` (which patches NumPy for numba-cuda first).

Conventions: problem ``p = b * Hkv + h`` is a (sequence, KV head) pair; ``i`` indexes its
middle tokens (position ``j = n_sink + i``), ``0 <= i < M_p``; ``live = min(C, M_p)``.
Per-token kernels run on a grid ``(ceil(rows / TPB), H)``, per-cluster kernels on
``(C, H)`` with threads over D, per-problem kernels on ``H`` blocks. The GEMM assignment runs
one warp per block and reduces with ``shfl_xor_sync``; under the CUDA simulator (which has no
warp intrinsics) :func:`_xor_f32` / :func:`_xor_i32` exchange through shared memory instead,
so the CPU tests run the same kernel code.

Scratch layout (few arrays, since every array argument costs host time at each launch):

- ``pi`` (H, 2) int32: M_p, non-finite-centroid flag;
- ``pf`` (H, 5) float32: squared scale radius, max |c^|^2, max |c|^2, and the power-of-two
  scale's (2**-e, 2**e) from :func:`pow2_scale`, computed once by :func:`centre` (GEMM path);
- ``cl`` (H, 3, C) float32: |c|^2 (the scan's norm), |c^|^2 and |c^| of the float16
  centred copy c^ (original units);
- ``clq`` (H, 2, VEC, Cp / VEC) float32: |c^|^2 and |c^| again, cluster ``c`` at
  ``[:, :, c % VEC, c // VEC]``, so that a warp reading VEC clusters per lane loads them
  coalesced (GEMM path; Cp = C rounded up to a multiple of 8, the row stride of the score
  chunk ``G``);
- ``rd`` (3, rounds, H) int32: changed labels, stopped, update active, per round;
- ``co`` (H, 2, C + 1) int32: label histogram / scatter cursors, CSR offsets;
- ``bc`` (H, 2, R) int32: tokens bucketed by label (any order), then sorted (CSR);
- ``hb`` (H, 2, bins + 1) int32 and ``comp`` (H, R) uint64: the seeding's counting sort;
- ``rown`` (H, R, 2) float32: |k^| (original units) and |k| per middle token.
"""

from __future__ import annotations

import math

import numpy as np
from numba import config as _numba_config  # the package's __init__ made NumPy safe for it
from numba import cuda

from ...spec import PURPOSE_KMEANS_INIT, philox4x32_10

# ---- launch geometry ------------------------------------------------------------------

# Numba freezes the module-level values read by a kernel into its machine code at the first
# compile; the disk cache (stochattn.cuda.kmeans.diskcache) keys its directories on every
# number of this module (and on this file's contents), so changing one before the first
# build compiles afresh instead of loading code made under another value.

# The simulator runs every thread of a block as a Python thread: keep blocks small there.
SIM = bool(_numba_config.ENABLE_CUDASIM)
TPB = 32 if SIM else 256  # threads per block of the per-token kernels
SCAN_TPB = 1 if SIM else 256  # threads of the per-problem scans (any size)
DIM_TPB = 1 if SIM else 256  # threads over D of the per-cluster kernels (a power of two)
LANES = 1 if SIM else 32  # threads (one warp) of a GEMM-assignment block (power of 2, <= 32)
LANES_MAX = 32  # shared-memory size of the simulator's warp shuffles
# GEMM assignment geometry, from tools/tune_kmeans.py on the H200 (2026-12-04, 128k tokens,
# 4096 clusters, ms per build): 4 x 1 45.6, 8 x 1 49.4, 4 x 2 53.2, 4 x 4 55.5, 16 x 1
# 61.5 (registers). Loading a lane's next words ahead did not help (4 x 1: 47.4).
ROW_TILE = 2 if SIM else 4  # rows of the GEMM chunk one assignment block reads together
TILES_PER_BLOCK = 2 if SIM else 1  # row tiles per assignment block, one after the other
VEC = 4  # float16 scores per 8-byte load (the GEMM chunk's row stride is a multiple of 8)
SCAN_TPB_MAX = 256  # shared-memory size of the scans (tests may raise SCAN_TPB to this)
DIM_SHARED = 1024  # the per-cluster kernels stage rows of D <= DIM_SHARED in shared memory
KH_ROWS = 4 if SIM else 32  # most rows per keys_half block (one thread each in phase 2)
KH_TPB = 8 if SIM else 256  # threads of a keys_half block
KH_SHARED = 4160  # float32 slots per keys_half staging array (32 rows of D = 129)
MU_SAMPLE = 256  # the centring vector is the mean of at most this many initial centroids

# ---- Philox-4x32-10 (stochattn.spec.philox4x32_10, the reference's, compiled) ---------

_S32 = np.uint64(32)
_WORD2_PURPOSE = np.uint64(PURPOSE_KMEANS_INIT << 28)
_F32 = np.float32
_U64 = np.uint64
_INF = np.float32(np.inf)
_FULL_MASK = 0xFFFFFFFF


_philox4x32_10 = cuda.jit(device=True)(philox4x32_10)


@cuda.jit(device=True)
def philox_x0(c0, c1, c2, c3, k0, k1):
    """First output word of Philox-4x32-10; every argument a uint32 value held in uint64.

    The block function is :func:`stochattn.spec.philox4x32_10`, the one the NumPy reference
    runs (the other three words are dead code here, which the compiler drops).
    """
    return _philox4x32_10(c0, c1, c2, c3, k0, k1)[0]


# ---- shared device functions ------------------------------------------------------------


@cuda.jit(device=True)
def _sync():
    """``syncthreads``, skipped by one-thread blocks (the simulator's barrier is slow, and
    its tests mostly run one-thread blocks; a uniform branch on the GPU)."""
    if cuda.blockDim.x > 1:
        cuda.syncthreads()


@cuda.jit(device=True)
def _segment_sum(row, lo, hi):
    """Integer sum of ``row[lo:hi]`` (eight loads issued ahead; unsigned indices)."""
    s = 0
    c = _U64(lo)
    end = _U64(hi)
    while c + _U64(8) <= end:
        x0 = row[c]
        x1 = row[c + _U64(1)]
        x2 = row[c + _U64(2)]
        x3 = row[c + _U64(3)]
        x4 = row[c + _U64(4)]
        x5 = row[c + _U64(5)]
        x6 = row[c + _U64(6)]
        x7 = row[c + _U64(7)]
        s += ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        c += _U64(8)
    while c < end:
        s += row[c]
        c += _U64(1)
    return s


@cuda.jit(device=True)
def _exclusive_scan(a, p, n, shared):
    """Whole block: ``a[p, 1, :n + 1]`` = exclusive prefix sums of ``a[p, 0, :n]``, then
    ``a[p, 0, :n] = 0`` (ready to serve as scatter cursors). ``shared``: blockDim int64.
    Each thread scans a contiguous segment (integer sums: any order gives the same)."""
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    seg = (n + nthr - 1) // nthr
    lo = tid * seg
    hi = min(lo + seg, n)
    cnt = a[p, 0]
    off = a[p, 1]
    shared[tid] = _segment_sum(cnt, lo, hi) if lo < hi else 0
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
    c = _U64(lo)
    end = _U64(hi) if lo < hi else c
    while c + _U64(4) <= end:  # four loads ahead of the dependent writes
        x0 = cnt[c]
        x1 = cnt[c + _U64(1)]
        x2 = cnt[c + _U64(2)]
        x3 = cnt[c + _U64(3)]
        off[c] = run
        run += x0
        off[c + _U64(1)] = run
        run += x1
        off[c + _U64(2)] = run
        run += x2
        off[c + _U64(3)] = run
        run += x3
        cnt[c] = 0
        cnt[c + _U64(1)] = 0
        cnt[c + _U64(2)] = 0
        cnt[c + _U64(3)] = 0
        c += _U64(4)
    while c < end:
        off[c] = run
        run += cnt[c]
        cnt[c] = 0
        c += _U64(1)
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
    preselects the clusters to score). Eight elements of each row are loaded ahead of
    their additions, which stay in ascending d."""
    kr = keys[b, h, j]  # row views: one base address each, not four indices per element
    cr = cent[b, h, c]
    dot = _F32(0.0)
    d = _U64(0)
    end = _U64(kr.shape[0])
    while d + _U64(8) <= end:  # unsigned index: no wraparound code
        k0 = _F32(kr[d])
        k1 = _F32(kr[d + _U64(1)])
        k2 = _F32(kr[d + _U64(2)])
        k3 = _F32(kr[d + _U64(3)])
        k4 = _F32(kr[d + _U64(4)])
        k5 = _F32(kr[d + _U64(5)])
        k6 = _F32(kr[d + _U64(6)])
        k7 = _F32(kr[d + _U64(7)])
        c0 = cr[d]
        c1 = cr[d + _U64(1)]
        c2 = cr[d + _U64(2)]
        c3 = cr[d + _U64(3)]
        c4 = cr[d + _U64(4)]
        c5 = cr[d + _U64(5)]
        c6 = cr[d + _U64(6)]
        c7 = cr[d + _U64(7)]
        dot += k0 * c0
        dot += k1 * c1
        dot += k2 * c2
        dot += k3 * c3
        dot += k4 * c4
        dot += k5 * c5
        dot += k6 * c6
        dot += k7 * c7
        d += _U64(8)
    while d < end:
        dot += _F32(kr[d]) * cr[d]
        d += _U64(1)
    return norm - _F32(2.0) * dot


if SIM:

    @cuda.jit(device=True)
    def _xor_f32(x, m):
        """``shfl_xor_sync`` of a float32 for the simulator (blocks of one warp): through
        shared memory, every lane of the block taking part."""
        buf = cuda.shared.array(LANES_MAX, np.float32)
        lane = cuda.threadIdx.x
        cuda.syncthreads()
        buf[lane] = x
        cuda.syncthreads()
        return buf[lane ^ m]

    @cuda.jit(device=True)
    def _xor_i32(x, m):
        """``shfl_xor_sync`` of an int32 for the simulator (see :func:`_xor_f32`)."""
        buf = cuda.shared.array(LANES_MAX, np.int32)
        lane = cuda.threadIdx.x
        cuda.syncthreads()
        buf[lane] = x
        cuda.syncthreads()
        return buf[lane ^ m]

else:

    @cuda.jit(device=True)
    def _xor_f32(x, m):
        """Value of lane ``laneid ^ m`` (the whole warp takes part)."""
        return cuda.shfl_xor_sync(_FULL_MASK, x, m)

    @cuda.jit(device=True)
    def _xor_i32(x, m):
        """Value of lane ``laneid ^ m`` (the whole warp takes part)."""
        return cuda.shfl_xor_sync(_FULL_MASK, x, m)


@cuda.jit(device=True)
def _sumsq2(xs, ys, off, n):
    """(sum xs[off + d]^2, sum ys[off + d]^2) over d < n, each a sequential float32 sum in
    ascending d (the same arithmetic as a plain loop; four loads issued ahead)."""
    sa = _F32(0.0)
    sb = _F32(0.0)
    o = _U64(off)
    end = o + _U64(n)
    while o + _U64(4) <= end:
        a0 = xs[o]
        a1 = xs[o + _U64(1)]
        a2 = xs[o + _U64(2)]
        a3 = xs[o + _U64(3)]
        b0 = ys[o]
        b1 = ys[o + _U64(1)]
        b2 = ys[o + _U64(2)]
        b3 = ys[o + _U64(3)]
        sa += a0 * a0
        sa += a1 * a1
        sa += a2 * a2
        sa += a3 * a3
        sb += b0 * b0
        sb += b1 * b1
        sb += b2 * b2
        sb += b3 * b3
        o += _U64(4)
    while o < end:
        a0 = xs[o]
        b0 = ys[o]
        sa += a0 * a0
        sb += b0 * b0
        o += _U64(1)
    return sa, sb


@cuda.jit(device=True)
def _member_sum(rows, order, lo, hi, d):
    """Sequential float32 sum of ``rows[order[q], d]`` over lo <= q < hi in ascending q
    (``rows``: a problem's middle-token rows, ``order``: a row of ``bc``; eight member loads
    issued ahead of the additions, same order). Unsigned indices: no negative-index
    wraparound code in the loop."""
    acc = _F32(0.0)
    du = _U64(d)
    q = _U64(lo)
    end = _U64(hi)
    while q + _U64(8) <= end:
        x0 = _F32(rows[_U64(order[q]), du])
        x1 = _F32(rows[_U64(order[q + _U64(1)]), du])
        x2 = _F32(rows[_U64(order[q + _U64(2)]), du])
        x3 = _F32(rows[_U64(order[q + _U64(3)]), du])
        x4 = _F32(rows[_U64(order[q + _U64(4)]), du])
        x5 = _F32(rows[_U64(order[q + _U64(5)]), du])
        x6 = _F32(rows[_U64(order[q + _U64(6)]), du])
        x7 = _F32(rows[_U64(order[q + _U64(7)]), du])
        acc += x0
        acc += x1
        acc += x2
        acc += x3
        acc += x4
        acc += x5
        acc += x6
        acc += x7
        q += _U64(8)
    while q < end:
        acc += _F32(rows[_U64(order[q]), du])
        q += _U64(1)
    return acc


@cuda.jit(device=True)
def _prep_cluster(cent, b, h, p, c, mu, pf, pi, gemm, cent16, cl, clq, xs, ys):
    """Whole block, after each thread wrote its coordinates ``d = tid, tid + nthr, ...`` of
    the centroid row: ``cl[p, 0, c] = |c|^2`` (sequential float32 sum over D) and, for the
    GEMM path, the scaled float16 centred copy, its squared norm and norm in original units
    (in ``cl`` and ``clq``), and the per-problem maxima / non-finite flag. ``xs``, ``ys``:
    shared float32 arrays of DIM_SHARED, where the row and its float16 copy are staged so
    that thread 0's sequential sums read shared memory (rows with D > DIM_SHARED are read
    back from global memory)."""
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    D = cent.shape[3]
    staged = D <= DIM_SHARED
    down = pf[p, 3]
    up = pf[p, 4]
    for d in range(tid, D, nthr):  # the coordinates this thread wrote
        x = cent[b, h, c, d]
        if gemm:
            y = np.float16((x - mu[p, d]) * down)
            cent16[p, c, d] = y
            if staged:
                ys[d] = _F32(y)
        if staged:
            xs[d] = x
    _sync()
    if tid == 0:
        if staged:  # (ys unused without the GEMM: its sum is dropped)
            n, n1 = _sumsq2(xs, ys if gemm else xs, 0, D)
        else:
            n = _F32(0.0)
            n1 = _F32(0.0)
            for d in range(D):
                x = cent[b, h, c, d]
                n += x * x
            if gemm:
                for d in range(D):
                    y = _F32(cent16[p, c, d])
                    n1 += y * y
        cl[p, 0, c] = n
        if gemm:
            n1 = n1 * (up * up)  # exact power-of-two rescaling to original units
            cl[p, 1, c] = n1
            q = math.sqrt(n1)
            cl[p, 2, c] = q
            clq[p, 0, c % VEC, c // VEC] = n1
            clq[p, 1, c % VEC, c // VEC] = q
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
def zero_scratch(pf, rd, co, hb):
    """The scratch a build accumulates into (flat views of ``pf``, ``rd``, ``co``, ``hb``)
    set to zero, one thread per element of the largest: a cached build plan reuses the
    first three, and ``hb`` comes from an allocator that does not clear."""
    i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    if i < pf.shape[0]:
        pf[i] = _F32(0.0)
    if i < rd.shape[0]:
        rd[i] = 0
    if i < co.shape[0]:
        co[i] = 0
    if i < hb.shape[0]:
        hb[i] = 0


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
def seed_scan(nbins, hb):
    """One block per problem: bin offsets of the composites (counting sort)."""
    sh = cuda.shared.array(SCAN_TPB_MAX, np.int64)
    _exclusive_scan(hb, cuda.blockIdx.x, nbins, sh)


@cuda.jit
def seed_fill(pi, shift, comp, hb, bc):
    """One thread per middle token: the token into its bin of ``bc[p, 0]`` (any order
    inside a bin)."""
    i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    if i >= pi[p, 0]:
        return
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
    keys_p = comp[p]
    seg = bc[p, 0]
    r = 0
    s = _U64(lo)
    end = _U64(hi)
    while s < end:
        if keys_p[_U64(seg[s])] < key:
            r += 1
        s += _U64(1)
    bc[p, 1, lo + r] = i


@cuda.jit
def centre(keys, bc, pi, n_sink, Hkv, C, mu, pf):
    """One block per problem, threads over D: mu = mean of the first min(live, MU_SAMPLE)
    initial centroids (any vector would do: it only centres the float16 GEMM), and
    ``pf[p, 0]`` = the largest squared distance of those to mu, which fixes the power-of-two
    scale ``pf[p, 3:5]`` (:func:`pow2_scale`, once per problem)."""
    p = cuda.blockIdx.x
    b = p // Hkv
    h = p - b * Hkv
    D = keys.shape[3]
    m = pi[p, 0]
    live = m if m < C else C
    cnt = live if live < MU_SAMPLE else MU_SAMPLE
    tid = cuda.threadIdx.x
    rows = keys[b, h, n_sink:]  # the middle tokens' keys, (tokens, D)
    order = bc[p, 1]
    for d in range(tid, D, cuda.blockDim.x):
        acc = _member_sum(rows, order, 0, cnt, d)
        if cnt > 0:
            mu[p, d] = acc / _F32(cnt)
        else:
            mu[p, d] = _F32(0.0)
    if tid == 0:
        pf[p, 0] = _F32(0.0)
        pf[p, 1] = _F32(0.0)
        pf[p, 2] = _F32(0.0)
    _sync()
    mrow = mu[p]
    for r in range(tid, cnt, cuda.blockDim.x):
        key = rows[_U64(order[_U64(r)])]
        s = _F32(0.0)
        for d in range(D):
            du = _U64(d)
            x = _F32(key[du]) - mrow[du]
            s += x * x
        if math.isfinite(s):
            cuda.atomic.max(pf, (p, 0), s)
    _sync()
    if tid == 0:
        down, up = pow2_scale(pf[p, 0])
        pf[p, 3] = down
        pf[p, 4] = up


@cuda.jit(device=True)
def _half_elem(rows, mrow, m, i0, r, d, down, staged, stride, out16, xs, ys):
    """One element of :func:`keys_half`'s phase 1 (row i0 + r, coordinate d; ``rows``: the
    problem's middle-token keys, ``mrow``: its mu, ``out16``: its float16 keys; unsigned
    indices, no wraparound code)."""
    i = _U64(i0 + r)
    du = _U64(d)
    if i < _U64(m):
        x = _F32(rows[i, du])
        y = np.float16((x - mrow[du]) * down)
        out16[i, du] = y
        if staged:
            o = _U64(r * stride + d)
            xs[o] = x
            ys[o] = _F32(y)
    else:
        out16[i, du] = np.float16(0.0)


@cuda.jit
def keys_half(keys, mu, pf, pi, n_sink, Hkv, rows_blk, keys16, rown):
    """Block (rows_blk rows from ``blockIdx.x * rows_blk``, problem p). Phase 1, threads over
    (row, d) with d fastest (coalesced): keys16[p, i] = float16((k - mu) * 2**-e) (zero past
    the middle), staging k and the float16 row (as float32) in shared memory, rows D + 1
    apart (no bank conflicts between rows). Phase 2, one thread per row: rown[p, i] =
    (|keys16 row| * 2**e, |k|), sequential float32 sums over D (inf when not finite; zero
    past the middle); rows with D + 1 > KH_SHARED are read back from global memory."""
    xs = cuda.shared.array(KH_SHARED, np.float32)
    ys = cuda.shared.array(KH_SHARED, np.float32)
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    D = keys.shape[3]
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    m = pi[p, 0]
    i0 = np.int64(cuda.blockIdx.x) * rows_blk
    nr = min(rows_blk, keys16.shape[1] - i0)
    stride = D + 1
    staged = nr * stride <= KH_SHARED
    down = pf[p, 3]
    up = pf[p, 4]
    rows = keys[b, h, n_sink:]
    mrow = mu[p]
    out16 = keys16[p]
    if D <= nthr:  # nthr // D rows at a time
        rstep = nthr // D
        r = tid // D
        d = tid - r * D
        if r < rstep:
            while r < nr:
                _half_elem(rows, mrow, m, i0, r, d, down, staged, stride, out16, xs, ys)
                r += rstep
    else:
        for r in range(nr):
            for d in range(tid, D, nthr):
                _half_elem(rows, mrow, m, i0, r, d, down, staged, stride, out16, xs, ys)
    _sync()
    if tid < nr:
        i = i0 + tid
        if i >= m:
            rown[p, i, 0] = _F32(0.0)
            rown[p, i, 1] = _F32(0.0)
            return
        if staged:
            sb, sa = _sumsq2(xs, ys, tid * stride, D)
        else:
            sa = _F32(0.0)
            sb = _F32(0.0)
            for d in range(D):
                x = _F32(keys[b, h, n_sink + i, d])
                z = _F32(keys16[p, i, d])
                sa += z * z
                sb += x * x
        rown[p, i, 0] = math.sqrt(sa) * up if math.isfinite(sa) else _INF
        rown[p, i, 1] = math.sqrt(sb) if math.isfinite(sb) else _INF


@cuda.jit
def seed_centroids(keys, bc, pi, n_sink, Hkv, mu, pf, gemm, cent, cent16, cl, clq, n_init):
    """Block (cluster c, problem p): centroid c = key of the c-th token of the order (exact
    widening), zero for non-live clusters; then the cluster's norms (and GEMM copy)."""
    xs = cuda.shared.array(DIM_SHARED, np.float32)
    ys = cuda.shared.array(DIM_SHARED, np.float32)
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
    _prep_cluster(cent, b, h, p, c, mu, pf, pi, gemm, cent16, cl, clq, xs, ys)


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
def _filter(g, n1, q, g2, ca, cb, es):
    """Filter score F = |c^|^2 - 2 g 4^e of one GEMM score g and its bound e = ca |c^|^2 +
    cb |c^| + es (n1 = |c^|^2, q = |c^|)."""
    f = n1 - g2 * _F32(g)
    e = (ca * n1 + cb * q) + es
    return f, e


@cuda.jit(device=True)
def _n1p(n1, ca):
    """``|c^|^2 - ca |c^|^2``, the per-cluster part of :func:`_low`."""
    return n1 - ca * n1


@cuda.jit(device=True)
def _low(g, n1p, q, g2, cb):
    """F - e + es of one GEMM score, from ``n1p = |c^|^2 - ca |c^|^2``: the lower end of
    the score's interval shifted by the row's constant es (an order-preserving shift).
    Its roundings differ from those of :func:`_filter` by a few ulps of |F| + e, which the
    bound's safety factor covers hundreds of times over (a candidate set only has to
    contain the exact minimum)."""
    return (n1p - g2 * _F32(g)) - cb * q


@cuda.jit(device=True)
def _first_pass(c, g, n1p, q, g2, cb, L1, i1, L2):
    """One cluster of pass 1: keeps the two smallest :func:`_low` and the index of the
    smallest (strict ``<``, clusters ascending per lane: ties to the lowest index)."""
    lo = _low(g, n1p, q, g2, cb)
    L2 = min(L2, max(L1, lo))
    if lo < L1:
        i1 = c
    L1 = min(L1, lo)
    return L1, i1, L2


@cuda.jit(device=True)
def _take_exact(keys, cent, b, h, j, c, norm, bs, bi, nan0):
    """Exact score of candidate c into a lane's (best score, its cluster, NaN at cluster 0),
    candidates visited in ascending cluster order: the first minimum wins; a NaN score of
    cluster 0 keeps label 0, other NaN scores never win (the scan's rule)."""
    sc = exact_score(keys, cent, b, h, j, c, norm)
    if sc != sc:
        if c == 0:
            nan0 = np.int32(1)
    elif bi < 0 or sc < bs:
        bs = sc
        bi = c
    return bs, bi, nan0


@cuda.jit(device=True)
def _rescan(c, bd, G, gb, cl, n0, n1o, nqo, ca, g2, cb, thr, keys, cent, b, h, j, bs, bi,
            nan0):
    """Pass 2 of a lane that holds two or more candidates: cluster c's :func:`_low` again
    (every cluster of a bad row, ``bd != 0``), and its exact score if it is a candidate
    (``n0``, ``n1o``, ``nqo``: the problem's offsets of |c|^2, |c^|^2, |c^| in ``cl``)."""
    take = bd != 0
    if not take:
        take = _low(G[gb + c], _n1p(cl[n1o + c], ca), cl[nqo + c], g2, cb) <= thr
    if take:
        bs, bi, nan0 = _take_exact(keys, cent, b, h, j, c, cl[n0 + c], bs, bi, nan0)
    return bs, bi, nan0


@cuda.jit(device=True)
def _merge_two(L1, i1, L2, lo, io, l2o):
    """Merge (smallest F - e, its index, second smallest) of two sets of clusters; index -1:
    empty. Symmetric, so both lanes of a shuffle pair get the same triple."""
    if io >= 0 and (i1 < 0 or lo < L1 or (lo == L1 and io < i1)):
        return lo, io, min(l2o, L1)
    return L1, i1, min(L2, lo)


@cuda.jit
def assign_gemm(keys, G, G64, r0, nrows, cent, cl, clq, pf, pi, rown, n_sink, Hkv, t, alpha,
                beta, gs, abs1, abs0, safe, labels, co, rd):
    """One warp (LANES threads) per block, TILES_PER_BLOCK tiles of ROW_TILE consecutive rows
    of the GEMM chunk (``G``: flat (H, rows, Cp) float16 scores of the scaled centred
    copies; ``G64``: the same memory as 8-byte words; ``cl``: flat (H, 3, C)).

    Pass 1 reads the tile's rows together: lane l loads words l, l + LANES, ... of each row
    (VEC scores per load, coalesced) and the VEC clusters' |c^|^2, |c^| once for all rows
    (``clq``); the last ``live % VEC`` clusters are read one by one. Per row each lane keeps
    the two smallest F - e of its clusters (shifted by the row's constant, :func:`_low`)
    and the index of the smallest; butterfly shuffles reduce them over the warp. The exact
    score of a cluster lies in [F - e, F + e], so the exact minimum's cluster has F - e <=
    U, with U = F + e of the cluster of smallest F - e. If only one cluster of the row
    passes, it is the exact float32 argmin. Otherwise the candidates are scored by
    :func:`exact_score` where they are: a lane whose own second smallest F - e passes
    rescans its clusters (rare), any other lane scores its smallest if that passes, all
    lanes at once; then the first minimum over the warp. Rows that may hold a
    non-finite or overflowed score (a non-finite key or centroid, or a key so far out that
    ``|k^| max|c^|`` could leave float16 range) score every live cluster instead, so the
    label is always the one :func:`assign_scan` would pick. Rows past the chunk's end
    repeat its last row (in-bounds loads, results dropped)."""
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    lane = cuda.threadIdx.x
    m = pi[p, 0]
    C = cent.shape[2]
    live = m if m < C else C
    C4 = clq.shape[3]  # row stride of G in words
    rows_g = G64.shape[0] // (pi.shape[0] * C4)
    down = pf[p, 3]
    up = pf[p, 4]
    g2 = _F32(2.0) * (up * up)
    nmax = pf[p, 2]
    rn = math.sqrt(nmax)
    # |g| <= |k^| |c^| in scaled units (Cauchy-Schwarz; float32 accumulation): rows under
    # this bound on |k^| (original units) have finite float16 scores, by a wide margin.
    qs = math.sqrt(pf[p, 1]) * (down * down)
    a_ok = _F32(16384.0) / qs if qs > 0 else _INF
    bad_p = pi[p, 1] != 0
    ca = safe * alpha
    n0 = np.int64(p) * 3 * C  # cl plane offsets of |c|^2, |c^|^2, |c^|
    n1o = n0 + C
    nqo = n1o + C
    full = live // VEC  # words whose VEC clusters are all live
    rows_end = min(nrows, m - r0)  # chunk rows r < rows_end are middle tokens
    L1 = cuda.local.array(ROW_TILE, np.float32)
    L2 = cuda.local.array(ROW_TILE, np.float32)
    es = cuda.local.array(ROW_TILE, np.float32)
    cb = cuda.local.array(ROW_TILE, np.float32)
    i1 = cuda.local.array(ROW_TILE, np.int32)
    bad = cuda.local.array(ROW_TILE, np.int32)
    gw = cuda.local.array(ROW_TILE, np.int64)
    word = cuda.local.array(ROW_TILE, np.uint64)
    half = word.view(np.float16)  # VEC scores per word, the first in the low bits
    n_changed = 0
    for tile in range(TILES_PER_BLOCK):
        rt = (np.int64(cuda.blockIdx.x) * TILES_PER_BLOCK + tile) * ROW_TILE
        if rt >= rows_end:  # the same for every lane
            break
        nval = min(ROW_TILE, rows_end - rt)
        for k in range(ROW_TILE):
            r = rt + min(k, nval - 1)
            i = r0 + r
            a = rown[p, i, 0]
            bn = rown[p, i, 1]
            # (not a < a_ok: also true for NaN a or a_ok)
            bad[k] = 1 if bad_p or not (math.isfinite(bn) and a < a_ok) else 0
            es[k] = safe * (gs * (nmax + _F32(2.0) * bn * rn) + abs1 * up * a
                            + abs0 * (up * up))
            cb[k] = safe * (beta * a + abs1 * up)
            gw[k] = (np.int64(p) * rows_g + r) * C4
            L1[k] = _INF
            L2[k] = _INF
            i1[k] = -1
        # Pass 1: VEC clusters per word, words ascending per lane.
        w = np.int64(lane)
        while w < full:
            c = np.int32(w * VEC)
            m0 = clq[p, 0, 0, w]
            m1 = clq[p, 0, 1, w]
            m2 = clq[p, 0, 2, w]
            m3 = clq[p, 0, 3, w]
            q0 = clq[p, 1, 0, w]
            q1 = clq[p, 1, 1, w]
            q2 = clq[p, 1, 2, w]
            q3 = clq[p, 1, 3, w]
            for k in range(ROW_TILE):
                word[k] = G64[_U64(gw[k] + w)]
            m0 = _n1p(m0, ca)  # once for all rows of the tile
            m1 = _n1p(m1, ca)
            m2 = _n1p(m2, ca)
            m3 = _n1p(m3, ca)
            for k in range(ROW_TILE):
                l1_, i_, l2_ = L1[k], i1[k], L2[k]
                cbk = cb[k]
                l1_, i_, l2_ = _first_pass(c, half[VEC * k], m0, q0, g2, cbk, l1_, i_, l2_)
                l1_, i_, l2_ = _first_pass(c + 1, half[VEC * k + 1], m1, q1, g2, cbk, l1_, i_,
                                           l2_)
                l1_, i_, l2_ = _first_pass(c + 2, half[VEC * k + 2], m2, q2, g2, cbk, l1_, i_,
                                           l2_)
                l1_, i_, l2_ = _first_pass(c + 3, half[VEC * k + 3], m3, q3, g2, cbk, l1_, i_,
                                           l2_)
                L1[k], i1[k], L2[k] = l1_, i_, l2_
            w += LANES
        # The last live % VEC clusters, one by one.
        c = np.int32(full * VEC) + lane
        while c < live:
            n1p = _n1p(cl[n1o + c], ca)
            q = cl[nqo + c]
            for k in range(ROW_TILE):
                L1[k], i1[k], L2[k] = _first_pass(c, G[gw[k] * VEC + c], n1p, q, g2, cb[k],
                                                  L1[k], i1[k], L2[k])
            c += LANES
        for k in range(ROW_TILE):
            if k < nval:  # the same for every lane
                l1 = L1[k]
                ii = i1[k]
                l2 = L2[k]
                bd = bad[k]
                # Warp reduction: the two smallest F - e + es (ties to the lower index);
                # every lane ends with the same values. (bad is the same for every lane.)
                off = LANES // 2
                while off > 0:
                    lo_ = _xor_f32(l1, off)
                    io_ = _xor_i32(ii, off)
                    l2o = _xor_f32(l2, off)
                    l1, ii, l2 = _merge_two(l1, ii, l2, lo_, io_, l2o)
                    off //= 2
                best = ii
                j = n_sink + r0 + rt + k
                gb = gw[k] * VEC
                cbk = cb[k]
                thr = _INF
                if bd == 0:
                    # Candidates: F - e <= U = min (F + e), and U <= F + e of the cluster
                    # with the smallest F - e, so F - e + es <= thr keeps every candidate.
                    f, e = _filter(G[gb + ii], cl[n1o + ii], cl[nqo + ii], g2, ca, cbk, es[k])
                    thr = (f + e) + es[k]
                if bd != 0 or not (l2 > thr):
                    # Pass 2: exact scores of the candidates, each where pass 1 left it.
                    bs = _F32(0.0)
                    bi = np.int32(-1)
                    nan0 = np.int32(0)
                    if bd != 0 or not (L2[k] > thr):
                        # Two or more candidates in this lane (or every cluster of a bad
                        # row): rescan its clusters in pass 1's order.
                        w = np.int64(lane)
                        while w < full:
                            for x in range(VEC):
                                bs, bi, nan0 = _rescan(
                                    np.int32(w * VEC + x), bd, G, gb, cl, n0, n1o, nqo, ca,
                                    g2, cbk, thr, keys, cent, b, h, j, bs, bi, nan0)
                            w += LANES
                        c = np.int32(full * VEC) + lane
                        while c < live:
                            bs, bi, nan0 = _rescan(c, bd, G, gb, cl, n0, n1o, nqo, ca, g2,
                                                   cbk, thr, keys, cent, b, h, j, bs, bi,
                                                   nan0)
                            c += LANES
                    elif not (L1[k] > thr):
                        c = i1[k]
                        bs, bi, nan0 = _take_exact(keys, cent, b, h, j, c, cl[n0 + c], bs,
                                                   bi, nan0)
                    off = LANES // 2
                    while off > 0:
                        bo = _xor_f32(bs, off)
                        io_ = _xor_i32(bi, off)
                        if io_ >= 0 and (bi < 0 or bo < bs or (bo == bs and io_ < bi)):
                            bs = bo
                            bi = io_
                        nan0 = nan0 | _xor_i32(nan0, off)
                        off //= 2
                    best = bi
                    if nan0 != 0:
                        best = np.int32(0)
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
def scan_fill(co, pi, rd, n_sink, Hkv, C, t, final, tol, pf):
    """One block per problem. Round t (``final == 0``): stopped[t] = stopped[t-1] or
    changed[t] <= floor(tol * M); the update runs (active[t] = 1) iff the problem had not
    stopped and some label changed. Then (active rounds and the final pass) CSR offsets of
    the labels (:func:`fill` then puts each token into its cluster's segment of
    ``bc[p, 0]``). Also clears the per-problem maxima for the coming update."""
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


@cuda.jit
def fill(labels, pi, rd, co, bc, n_sink, Hkv, t):
    """One thread per middle token of an active problem: the token into its cluster's
    segment of ``bc[p, 0]`` (any order inside a segment; :func:`rank` sorts it)."""
    i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    if i >= pi[p, 0] or rd[2, t, p] == 0:
        return
    lab = labels[b, h, n_sink + i]
    slot = cuda.atomic.add(co, (p, 0, lab), np.int32(1))
    bc[p, 0, co[p, 1, lab] + slot] = i


@cuda.jit(device=True)
def _count_below(seg, lo, hi, i):
    """Number of entries of ``seg[lo:hi]`` below ``i`` (unsigned indices: a tight loop)."""
    r = 0
    s = _U64(lo)
    end = _U64(hi)
    while s < end:
        if seg[s] < i:
            r += 1
        s += _U64(1)
    return r


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
    bc[p, 1, lo + _count_below(bc[p, 0], lo, hi, i)] = i


@cuda.jit
def mean(keys, bc, co, pi, rd, n_sink, Hkv, t, mu, pf, gemm, cent, cent16, cl, clq):
    """Block (cluster c, problem p), threads over D: an active problem's non-empty cluster
    moves to the float32 mean of its members (sequential sum in position order, one IEEE
    division); then the cluster's norms (and GEMM copy); clears its histogram count."""
    xs = cuda.shared.array(DIM_SHARED, np.float32)
    ys = cuda.shared.array(DIM_SHARED, np.float32)
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
            rows = keys[b, h, n_sink:]
            order = bc[p, 1]
            crow = cent[b, h, c]
            for d in range(tid, D, cuda.blockDim.x):
                crow[_U64(d)] = _member_sum(rows, order, lo, hi, d) / _F32(hi - lo)
    _prep_cluster(cent, b, h, p, c, mu, pf, pi, gemm, cent16, cl, clq, xs, ys)


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
    rows = values[b, h, n_sink:]
    order = bc[p, 1]
    vrow = value_sums[b, h, c]
    for d in range(tid, D, cuda.blockDim.x):
        vrow[_U64(d)] = _member_sum(rows, order, lo, hi, d)
    if tid == 0:
        sizes[b, h, c] = hi - lo
