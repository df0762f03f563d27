"""Scratch buffers and launch sequence of :func:`stochattn.cuda.kmeans.kmeans_gpu` (whose
docstring describes the algorithm), and the GEMM of its assignment: cuBLAS on a GPU, a NumPy
emulation under the CUDA simulator."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np

from . import _kmeans_kernels as _k
from ._kmeans_kernels import cuda
from ._numba_launch import Bound

_SIM = _k.SIM
_TPB = _k.TPB


def _pow2_at_most(n: int, cap: int) -> int:
    """Largest power of two <= min(n, cap), at least 1."""
    return 1 << max(0, int(math.log2(max(1, min(n, cap)))))


def _empty(kind, like, shape, dtype):
    """Output buffer in the caller's framework (NumPy/other inputs: a numba device array)."""
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), device=like.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.data.device_id):
            return cupy.empty(shape, dtype=dtype)
    return cuda.device_array(shape, dtype=dtype)


def _zeros(kind, like, shape, dtype, stream):
    """Zero-filled buffer like :func:`_empty` (a host copy for NumPy/other inputs)."""
    if kind == "torch":
        import torch

        return torch.zeros(shape, dtype=getattr(torch, np.dtype(dtype).name), device=like.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.data.device_id):
            return cupy.zeros(shape, dtype=dtype)
    return cuda.to_device(np.zeros(shape, dtype=dtype), stream=stream)


def _stream_ptr(kind, device) -> int:
    """Raw pointer of the stream :func:`_stream` launches on (0: the legacy default)."""
    if kind == "torch":
        import torch

        return int(torch.cuda.current_stream(device).cuda_stream)
    if kind == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _data_ptr(a) -> int:
    return int(a.__cuda_array_interface__["data"][0])


_LOCAL = threading.local()


def _pinned_flags(n: int):
    """A (2, n) int32 pinned host buffer, cached per thread (freeing pinned memory would
    synchronise the device)."""
    buf = getattr(_LOCAL, "flags", None)
    if buf is None or buf.shape[1] < n:
        buf = _LOCAL.flags = cuda.pinned_array((2, max(n, 1)), dtype=np.int32)
    return buf


def _event():
    """A CUDA event without timing (the simulator's takes no arguments)."""
    return cuda.event() if _SIM else cuda.event(timing=False)


def _cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.libs import cublas  # noqa: F401
    except ImportError:
        return False
    return True


def _use_gemm(method: str) -> bool:
    if method == "scan":
        return False
    if _SIM:  # the simulator has no cuBLAS: "gemm" runs on a NumPy emulation of the GEMM
        return method == "gemm"
    if _cupy_available():
        return True
    if method == "gemm":
        raise ImportError("`method='gemm'` needs CuPy (cuBLAS): install stochattn[cuda13] "
                          "(or stochattn[cuda12])")
    return False


def _bound_constants(D: int):
    """Coefficients of the filter bound (assign_gemm): e_c = safe * (alpha n1_c +
    (beta |k^| + abs1 2^s) sqrt(n1_c) + gs (max|c|^2 + 2 |k| max|c|) + abs1 2^s |k^| +
    abs0 4^s), with n1_c = |c^_c|^2 and |k^| the float16 centred row's norm (original
    units), 2^s the power-of-two scale. rho: float16 rounding of a centred input (with the
    float32 subtraction); gamma_n = n u / (1 - n u) (u = 2**-24) bounds an n-term float32
    sum, doubled twice for the tensor cores' accumulation; u16: float16 rounding of the
    GEMM output; abs terms: float16 subnormals (absolute 2**-25 in scaled units)."""
    u16, u32 = 2.0**-11, 2.0**-24
    rho = u16 * (1.0 + 2.0**-9) + 2.0 * u32
    g_d = D * u32 / (1.0 - D * u32)
    g_d2 = (D + 2) * u32 / (1.0 - (D + 2) * u32)
    alpha = 2.0 * rho + g_d + u32
    beta = 2.0 * (2.0 * rho + rho * rho + 4.0 * g_d + u16 + u32)
    abs1 = 2.0**-22 * math.sqrt(D)
    abs0 = 2.0**-22
    safe = 1.0 + 2.0**-8
    return tuple(np.float32(x) for x in (alpha, beta, g_d2, abs1, abs0, safe))


class _CublasGemm:
    """``G[p, :n, :C] = keys16[p, r0:r0 + n] @ cent16[p].T`` for every problem p (G: flat
    (H, rows, Cp), rows Cp >= C apart): one
    strided-batched cuBLAS call (float16 inputs, float32 accumulation, float16 output) on
    the stream of the Numba launches."""

    def __init__(self, device: int, stream_ptr: int, cent16, keys16, G, rows: int, ldc: int):
        import cupy
        from cupy.cuda import device as cupy_device
        from cupy_backends.cuda.libs import cublas

        self._cupy, self._cublas, self._device = cupy, cublas, device
        with cupy.cuda.Device(device), warnings.catch_warnings():
            # CuPy 14 deprecates ExternalStream for objects with __cuda_stream__; we only
            # hold the raw pointer of the stream the Numba kernels run on.
            warnings.simplefilter("ignore", DeprecationWarning)
            self._handle = cupy_device.get_cublas_handle()
            self._stream = (cupy.cuda.ExternalStream(stream_ptr, device) if stream_ptr
                            else cupy.cuda.Stream.null)
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)
        self._a, self._b, self._c = _data_ptr(cent16), _data_ptr(keys16), _data_ptr(G)
        self._H, self._C, self._D = (int(s) for s in cent16.shape)
        self._R, self._Rc, self._ldc = int(keys16.shape[1]), int(rows), int(ldc)
        get = lambda name, default: getattr(cublas, name, default)  # noqa: E731
        self._op_n, self._op_t = get("CUBLAS_OP_N", 0), get("CUBLAS_OP_T", 1)
        self._f16 = 2  # CUDA_R_16F
        self._compute = get("CUBLAS_COMPUTE_32F", 68)
        self._algo = get("CUBLAS_GEMM_DEFAULT", -1)

    def __call__(self, r0: int, n: int) -> None:
        H, C, D, R, Rc, ldc = self._H, self._C, self._D, self._R, self._Rc, self._ldc
        # cuBLAS is column-major: the row-major (n, C) score block of problem p is the
        # column-major (C, n) matrix cent16[p] (D x C, transposed) times keys16 rows (D x n).
        with self._cupy.cuda.Device(self._device), self._stream:
            self._cublas.gemmStridedBatchedEx(
                self._handle, self._op_t, self._op_n, C, n, D, self._one.ctypes.data,
                self._a, self._f16, D, C * D,
                self._b + 2 * r0 * D, self._f16, D, R * D,
                self._zero.ctypes.data,
                self._c, self._f16, ldc, Rc * ldc,
                H, self._compute, self._algo)


class _EmulatedGemm:
    """The GEMM of :class:`_CublasGemm` in NumPy (float32 accumulation of the exact
    float16 products, float16 output), for the CUDA simulator's device arrays. The padding
    columns C..Cp of ``G`` get NaN (never read as scores)."""

    def __init__(self, cent16, keys16, G, rows: int, ldc: int):
        self._cent16, self._keys16, self._G, self._rows = cent16, keys16, G, rows
        self._ldc = ldc

    def __call__(self, r0: int, n: int) -> None:
        c16 = self._cent16.copy_to_host().astype(np.float32)
        k16 = self._keys16.copy_to_host()[:, r0:r0 + n].astype(np.float32)
        H, C = c16.shape[:2]
        out = np.full((H, self._rows, self._ldc), np.nan, dtype=np.float16)
        with np.errstate(all="ignore"):  # non-live centroid rows are uninitialised
            out[:, :n, :C] = np.matmul(k16, np.swapaxes(c16, 1, 2)).astype(np.float16)
        self._G.copy_to_device(out.reshape(-1))


class _Build:
    """Scratch buffers and the launch sequence of one :func:`kmeans_gpu` call (layouts: the
    docstring of :mod:`stochattn.cuda._kmeans_kernels`)."""

    def __init__(self, kind, like, device, stream, k_dev, v_dev, lens_dev, dev, C, iterations,
                 n_sink, window, seed, tol, gemm, scratch_bytes):
        B, Hkv, N, D = (int(s) for s in k_dev.shape)
        H = B * Hkv
        self.kind, self.stream, self.gemm = kind, stream, gemm
        self.k, self.v, self.lens, self.out = k_dev, v_dev, lens_dev, dev
        self.C, self.D, self.H, self.N, self.iterations = C, D, H, N, iterations
        self.seed, self.tol = seed, tol
        self.ns, self.win, self.hkv = np.int64(n_sink), np.int64(window), np.int64(Hkv)
        # Rows per problem: no sequence has more than N - n_sink - window middle tokens.
        self.R = max(N - n_sink - window, 0)
        R1 = max(self.R, 1)
        self._keep = []  # framework buffers behind the Numba views, alive until the end

        def buf(shape, dtype, zero=False):
            a = (_zeros(kind, like, shape, dtype, stream) if zero
                 else _empty(kind, like, shape, dtype))
            self._keep.append(a)
            return a if kind in ("numpy", "cai") else cuda.as_cuda_array(a, sync=False)

        self.nbits = min(16, max(1, math.ceil(math.log2(max(self.R, 2)))))
        self.comp = buf((H, R1), np.uint64)
        self.hb = buf((H, 2, (1 << self.nbits) + 1), np.int32, zero=True)
        self.pi = buf((H, 2), np.int32)
        self.pf = buf((H, 5), np.float32, zero=True)
        self.cl = buf((H, 3, C), np.float32)
        self.rd = buf((3, iterations + 2, H), np.int32, zero=True)  # row t: round t
        self.co = buf((H, 2, C + 1), np.int32, zero=True)
        self.bc = buf((H, 2, R1), np.int32)
        small = 1 if not gemm else None  # placeholders when the GEMM path is off
        self.mu = buf((H, small or D), np.float32)
        self.cent16 = buf((H, small or C, small or D), np.float16)
        # Score rows Cp apart (C rounded up to a multiple of 8): 16-byte aligned rows, read
        # as 8-byte words of VEC scores by assign_gemm; clq: (H, 2, VEC, Cp / VEC).
        Cp = -(-C // 8) * 8
        self.clq = buf((H, 2, _k.VEC, small or Cp // _k.VEC), np.float32)
        if gemm:
            self.keys16 = buf((H, R1, D), np.float16)
            self.rown = buf((H, R1, 2), np.float32)
            self.Rc = max(1, min(R1, scratch_bytes // (2 * H * Cp)))
            self.G = buf((H * self.Rc * Cp,), np.float16)
            self.G64 = self.G.view(np.uint64)
            self.cl_flat = self.cl.reshape(H * 3 * C)
            self.bounds = _bound_constants(D)
            if _SIM:
                self.gemm_call = _EmulatedGemm(self.cent16, self.keys16, self.G, self.Rc, Cp)
            else:
                self.gemm_call = _CublasGemm(device, _stream_ptr(kind, device), self.cent16,
                                             self.keys16, self.G, self.Rc, Cp)
        self.row_grid = (max(1, -(-self.R // _TPB)), H)
        self.dim_threads = _pow2_at_most(D, _k.DIM_TPB)

    # -- steps ---------------------------------------------------------------------------

    def run(self) -> None:
        s, ns, hkv, H, C = self.stream, self.ns, self.hkv, self.H, self.C
        ws, labels, cent = self.out["window_start"], self.out["labels"], self.out["centroids"]
        token_grid = ((self.N + _TPB - 1) // _TPB, H)
        _k.prepare[token_grid, _TPB, s](self.lens, ns, self.win, hkv, ws, labels, self.pi)
        self._seed()
        gemm = np.int32(1 if self.gemm else 0)
        _k.seed_centroids[(C, H), self.dim_threads, s](
            self.k, self.bc, self.pi, ns, hkv, self.mu, self.pf, gemm, cent, self.cent16,
            self.cl, self.clq, self.out["n_initialized"])
        rounds = self._round_launches(gemm)
        flags = _pinned_flags(H)
        events = (_event(), _event())
        final = None
        for t in range(1, self.iterations + 1):
            self._assign(t, rounds)
            if t >= 2:
                # Flags of round t - 1 (the device is busy with round t meanwhile).
                events[(t - 1) % 2].synchronize()
                if flags[(t - 1) % 2, :H].all():
                    final = t  # every problem stopped: this assignment is the final one
                    break
            for name in ("scan_fill", "fill", "rank", "mean"):
                rounds[name](t)
            self.rd[1, t].copy_to_host(flags[t % 2, :H], stream=s)
            events[t % 2].record(s)
        if final is None:
            final = self.iterations + 1
            self._assign(final, rounds)
        # The final pass's CSR (every problem: scan_fill's final flag set).
        _k.scan_fill[self.H, _k.SCAN_TPB, s](
            self.co, self.pi, self.rd, ns, hkv, np.int64(C), np.int64(final), np.int32(1),
            np.float64(self.tol), self.pf)
        rounds["fill"](final)
        rounds["rank"](final)
        _k.stats[(C, H), self.dim_threads, s](self.v, self.bc, self.co, self.pi, ns, hkv,
                                              self.out["sizes"], self.out["value_sums"])

    def _round_launches(self, gemm):
        """The kernels launched every round, their arguments prepared once
        (:class:`~stochattn.cuda._numba_launch.Bound`; the round number is the mutable
        scalar): the assignment (GEMM path: one assign_gemm per score chunk), then the CSR
        of its labels (scan_fill, fill, rank: a stable counting sort by label, each cluster
        in position order) and the means."""
        s, ns, hkv, H, C = self.stream, self.ns, self.hkv, self.H, self.C
        labels, cent = self.out["labels"], self.out["centroids"]
        t0 = np.int64(1)
        out = {}
        if self.gemm:
            out["assign"] = [
                (r0, n, Bound(
                    _k.assign_gemm, (-(-n // (_k.ROW_TILE * _k.TILES_PER_BLOCK)), H), _k.LANES,
                    s, (self.k, self.G, self.G64, np.int64(r0), np.int64(n), cent, self.cl_flat,
                        self.clq, self.pf, self.pi, self.rown, ns, hkv, t0, *self.bounds,
                        labels, self.co, self.rd), mutable=(13,)))
                for r0, n in ((r0, min(self.Rc, self.R - r0))
                              for r0 in range(0, self.R, self.Rc))]
        else:
            out["assign"] = [(0, 0, Bound(
                _k.assign_scan, self.row_grid, _TPB, s,
                (self.k, cent, self.cl, self.pi, ns, hkv, t0, labels, self.co, self.rd),
                mutable=(6,)))]
        out["scan_fill"] = Bound(_k.scan_fill, H, _k.SCAN_TPB, s,
                                 (self.co, self.pi, self.rd, ns, hkv, np.int64(C), t0,
                                  np.int32(0), np.float64(self.tol), self.pf), mutable=(6,))
        for name in ("fill", "rank"):
            out[name] = Bound(getattr(_k, name), self.row_grid, _TPB, s,
                              (labels, self.pi, self.rd, self.co, self.bc, ns, hkv, t0),
                              mutable=(7,))
        out["mean"] = Bound(_k.mean, (C, H), self.dim_threads, s,
                            (self.k, self.bc, self.co, self.pi, self.rd, ns, hkv, t0, self.mu,
                             self.pf, gemm, cent, self.cent16, self.cl, self.clq), mutable=(7,))
        return out

    def _seed(self) -> None:
        """Initial order of the middle tokens (``bc[:, 1]``) and, for the GEMM path, the
        centring vector, the scale, the float16 keys and their norms."""
        s, ns, hkv, H = self.stream, self.ns, self.hkv, self.H
        shift = np.uint64(32 - self.nbits)
        grid = self.row_grid
        _k.seed_keys[grid, _TPB, s](self.pi, ns, np.uint64(self.seed & 0xFFFFFFFF),
                                    np.uint64(self.seed >> 32), shift, self.comp, self.hb)
        _k.seed_scan[H, _k.SCAN_TPB, s](np.int64(1 << self.nbits), self.hb)
        _k.seed_fill[grid, _TPB, s](self.pi, shift, self.comp, self.hb, self.bc)
        _k.seed_rank[grid, _TPB, s](self.pi, shift, self.comp, self.hb, self.bc)
        if self.gemm:
            _k.centre[H, self.dim_threads, s](self.k, self.bc, self.pi, ns, hkv,
                                              np.int64(self.C), self.mu, self.pf)
            D = self.D
            rows_blk = max(1, min(_k.KH_ROWS, _k.KH_SHARED // (D + 1)))
            rows = (-(-max(self.R, 1) // rows_blk), H)
            _k.keys_half[rows, _k.KH_TPB, s](self.k, self.mu, self.pf, self.pi, ns, hkv,
                                             np.int64(rows_blk), self.keys16, self.rown)

    def _assign(self, t: int, rounds) -> None:
        for r0, n, launch in rounds["assign"]:
            if self.gemm:
                self.gemm_call(r0, n)  # this chunk's scores (cuBLAS), then its labels
            launch(t)
