"""Scratch buffers and launch sequence of :func:`stochattn.cuda.kmeans.kmeans_gpu` (whose
docstring describes the algorithm) as a plan that repeated builds of one configuration
reuse (:class:`BuildPlan`, cached by :mod:`stochattn.cuda.kmeans.cache`), and the GEMM of
its assignment: cuBLAS on a GPU, a NumPy emulation under the CUDA simulator.

Importing this module imports no Numba: a plan's launches come from its ``ops``, Numba's
(:class:`_NumbaOps`: the kernels of :mod:`.kernels`, :class:`.launch.Bound`) or, for CuPy
inputs whose kernels have raw entries, :class:`.rawplan.RawOps` (cubins launched without
Numba, :mod:`.raw`)."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np

from . import diskcache as _diskcache

_TPB = None  # kernels.TPB when this module first loaded the kernels (the grids' block size)


def _kernels():
    """The Numba kernels module (imports Numba)."""
    global _TPB
    try:
        from . import kernels
    except ImportError as e:  # numba-cuda missing
        if "numba" not in str(e):
            raise
        raise ImportError("the Numba path of the GPU k-means needs numba-cuda: install "
                          "stochattn[cuda13] (or stochattn[cuda12])") from e

    if _TPB is None:
        _TPB = kernels.TPB
    return kernels


def _numba_cuda():
    return _kernels().cuda


def _sim() -> bool:
    """Whether the CUDA simulator runs the kernels (without importing Numba when the
    kernels are not imported yet)."""
    import sys

    kernels = sys.modules.get(__name__.rsplit(".", 1)[0] + ".kernels")
    if kernels is not None:
        return bool(kernels.SIM)
    from .raw import simulator

    return simulator()


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
    return _numba_cuda().device_array(shape, dtype=dtype)


def _stream_ptr(kind, device) -> int:
    """Raw pointer of the stream :func:`_stream` launches on (0: the legacy default)."""
    if kind == "torch":
        import torch

        return int(torch.cuda.current_stream(device).cuda_stream)
    if kind == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _geometry(k=None) -> tuple:
    """The launch-geometry constants a plan reads (tests change them under the simulator:
    part of the plan cache key); ``k``: the plan's kernel namespace (default: the Numba
    kernels module)."""
    if k is None:
        k = _kernels()
        tpb = _TPB
    else:
        tpb = k.TPB
    return (tpb, k.SCAN_TPB, k.DIM_TPB, k.LANES, k.ROW_TILE, k.TILES_PER_BLOCK,
            k.KH_TPB, k.KH_ROWS, k.KH_SHARED, k.VEC)


_LOCAL = threading.local()


def _pinned_flags(n: int):
    """A (2, n) int32 pinned host buffer, cached per thread (freeing pinned memory would
    synchronise the device)."""
    buf = getattr(_LOCAL, "flags", None)
    if buf is None or buf.shape[1] < n:
        buf = _LOCAL.flags = _numba_cuda().pinned_array((2, max(n, 1)), dtype=np.int32)
    return buf


def _event():
    """A CUDA event without timing (the simulator's takes no arguments)."""
    cuda = _numba_cuda()
    return cuda.event() if _sim() else cuda.event(timing=False)


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
    if _sim():  # the simulator has no cuBLAS: "gemm" runs on a NumPy emulation of the GEMM
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

    def __init__(self, device: int, stream_ptr: int, cent16_shape, keys16_shape, rows: int,
                 ldc: int):
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
        self._a = self._b = self._c = 0  # set by rebind before each build
        self._H, self._C, self._D = (int(s) for s in cent16_shape)
        self._R, self._Rc, self._ldc = int(keys16_shape[1]), int(rows), int(ldc)
        get = lambda name, default: getattr(cublas, name, default)  # noqa: E731
        self._op_n, self._op_t = get("CUBLAS_OP_N", 0), get("CUBLAS_OP_T", 1)
        self._f16 = 2  # CUDA_R_16F
        self._compute = get("CUBLAS_COMPUTE_32F", 68)
        self._algo = get("CUBLAS_GEMM_DEFAULT", -1)

    def rebind(self, cent16: int, keys16: int, G: int) -> None:
        """This build's buffers (data pointers; shapes as constructed)."""
        self._a, self._b, self._c = int(cent16), int(keys16), int(G)

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

    def __init__(self, rows: int, ldc: int):
        self._cent16 = self._keys16 = self._G = None  # set by rebind before each build
        self._rows, self._ldc = rows, ldc

    def rebind(self, cent16, keys16, G) -> None:
        """This build's buffers (Numba device arrays; None: drop the last ones)."""
        self._cent16, self._keys16, self._G = cent16, keys16, G

    def __call__(self, r0: int, n: int) -> None:
        c16 = self._cent16.copy_to_host().astype(np.float32)
        k16 = self._keys16.copy_to_host()[:, r0:r0 + n].astype(np.float32)
        H, C = c16.shape[:2]
        out = np.full((H, self._rows, self._ldc), np.nan, dtype=np.float16)
        with np.errstate(all="ignore"):  # non-live centroid rows are uninitialised
            out[:, :n, :C] = np.matmul(k16, np.swapaxes(c16, 1, 2)).astype(np.float16)
        self._G.copy_to_device(out.reshape(-1))


class _Slot:
    """An argument that changes with every build (rebound by :meth:`BuildPlan.bind`)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


#: Per-build arrays that share a data pointer with another one: view name -> base name.
_DERIVED = {"G64": "G", "hb_flat": "hb"}


def _derived_views(views: dict) -> dict:
    """``views`` plus the reshaped/reinterpreted views the launches take."""
    out = dict(views)
    out["hb_flat"] = views["hb"].reshape(views["hb"].size)
    if "G" in views:
        out["G64"] = views["G"].view(np.uint64)
    return out


def _ptr(a) -> int:
    """Data pointer of a device array: PyTorch, CuPy, Numba, or any
    ``__cuda_array_interface__`` (attribute reads only for the first three)."""
    data_ptr = getattr(a, "data_ptr", None)
    if data_ptr is not None:  # PyTorch
        return int(data_ptr())
    ptr = getattr(a, "device_ctypes_pointer", None)
    if ptr is not None:  # Numba
        return int(ptr.value or 0)
    if type(a).__module__.split(".")[0] == "cupy":
        return int(a.data.ptr)
    return int(a.__cuda_array_interface__["data"][0])


class _Sizes:
    """Buffer shapes and chunking that one configuration fixes (the plan cache key holds
    everything they depend on; layouts: :mod:`stochattn.cuda.kmeans.kernels`).

    ``cached``: small scratch a cached plan keeps (O(H C) at most); ``per_build``: scratch
    that grows with N or C D (the float16 keys and score chunk: hundreds of MB at 32k),
    allocated by every build from the caller's framework and rebound.
    """

    def __init__(self, B, Hkv, N, D, C, iterations, n_sink, window, gemm, scratch_bytes,
                 vec=None):
        H = B * Hkv
        vec = _kernels().VEC if vec is None else vec
        self.B, self.Hkv, self.N, self.D, self.H, self.C = B, Hkv, N, D, H, C
        self.iterations, self.gemm = iterations, gemm
        # Rows per problem: no sequence has more than N - n_sink - window middle tokens.
        self.R = R = max(N - n_sink - window, 0)
        R1 = max(R, 1)
        self.nbits = min(16, max(1, math.ceil(math.log2(max(R, 2)))))
        # Score rows Cp apart (C rounded up to a multiple of 8): 16-byte aligned rows, read
        # as 8-byte words of VEC scores by assign_gemm; clq: (H, 2, VEC, Cp / VEC).
        self.Cp = Cp = -(-C // 8) * 8
        self.Rc = max(1, min(R1, scratch_bytes // (2 * H * Cp))) if gemm else 0
        small = 1 if not gemm else None  # placeholders when the GEMM path is off
        self.cached = dict(
            pi=((H, 2), np.int32), pf=((H, 5), np.float32), cl=((H, 3, C), np.float32),
            rd=((3, iterations + 2, H), np.int32),  # row t: round t
            co=((H, 2, C + 1), np.int32), mu=((H, small or D), np.float32),
            clq=((H, 2, vec, small or Cp // vec), np.float32))
        self.per_build = dict(
            comp=((H, R1), np.uint64), hb=((H, 2, (1 << self.nbits) + 1), np.int32),
            bc=((H, 2, R1), np.int32), cent16=((H, small or C, small or D), np.float16))
        if gemm:
            self.per_build.update(keys16=((H, R1, D), np.float16),
                                  rown=((H, R1, 2), np.float32),
                                  G=((H * self.Rc * Cp,), np.float16))

    def scratch(self, kind, like) -> dict:
        """This build's ``per_build`` buffers, in the caller's framework (none zeroed)."""
        return {name: _empty(kind, like, shape, dtype)
                for name, (shape, dtype) in self.per_build.items()}


class _NumbaOps:
    """What a :class:`BuildPlan` launches with on the Numba path: the kernels of
    :mod:`.kernels` through :class:`.launch.Bound`, Numba's device arrays, events and pinned
    memory. Before the launches are prepared it points the kernels' disk cache at the key of
    the current module values (:mod:`.diskcache`); after, it writes the raw entries of the
    launches for later processes (:func:`.raw.export`)."""

    raw = False

    def __init__(self):
        self.k = _kernels()
        self.tpb = _TPB
        self._launches = []  # (kernel, args) of each launch prepared, for the export

    def start(self) -> None:
        _diskcache.attach(self.k)

    def bound(self, kernel, grid, block, stream, args, mutable, rebind):
        from .launch import Bound

        self._launches.append((kernel, args))
        return Bound(kernel, grid, block, stream, args, mutable=mutable, rebind=rebind)

    def finish(self, stream) -> None:
        launches, self._launches = self._launches, []
        if self.k.SIM:
            return
        from . import raw

        try:
            raw.export(self.k, launches, stream)
        except Exception as e:  # noqa: BLE001 - the export is an optimisation of later processes
            if not _EXPORT_WARNED:
                _EXPORT_WARNED.append(True)
                warnings.warn(f"k-means raw entries not written ({type(e).__name__}: {e})",
                              RuntimeWarning, stacklevel=3)

    def scratch(self, kind, like, shape, dtype):
        """``(framework buffer, the array the launches take)``."""
        a = _empty(kind, like, shape, dtype)
        return a, (a if kind in ("numpy", "cai") else
                   self.k.cuda.as_cuda_array(a, sync=False))

    def host_copy(self, host, stream):
        return self.k.cuda.to_device(host, stream=stream)

    def to_device(self, dev, host, stream) -> None:
        dev.copy_to_device(host, stream=stream)

    def to_host(self, dev, host, stream) -> None:
        dev.copy_to_host(host, stream=stream)

    def event(self):
        return _event()

    def pinned_flags(self, n: int):
        return _pinned_flags(n)


_EXPORT_WARNED: list = []


class BuildPlan:
    """The launch sequence of :func:`kmeans_gpu` for one configuration (shapes, dtypes,
    options, stream), kept by the plan cache of :mod:`stochattn.cuda.kmeans.cache`: every
    kernel launch prepared (:class:`~stochattn.cuda.kmeans.launch.Bound`), the GEMM wrapper,
    the small scratch, two events. A build rebinds the arrays that change
    (:meth:`bind`: k, v, GPU seq_lens, the outputs and the ``per_build`` scratch), sets the
    seed and launches (:meth:`run`). Not thread-safe: the cache lends a plan to one build
    at a time (``in_use``).

    ``views``: the first build's Numba views of those arrays, by name (the launches are
    prepared with them; the plan keeps none of them). ``lens_mode``: "gpu" (rebound),
    "host" (copied into a buffer of the plan by :meth:`bind`) or "none" (N each).
    ``ops``: the launches' backend (default :class:`_NumbaOps`; :class:`.rawplan.RawOps`
    raises :class:`.raw.RawMiss` here when a launch has no raw entry).
    """

    in_use = False  # lent to a build (set by stochattn.cuda.kmeans.cache)

    def __init__(self, kind, like, device, stream, stream_ptr, sizes: _Sizes, n_sink, window,
                 tol, lens_mode, views, ops=None):
        z = sizes
        self.ops = ops = _NumbaOps() if ops is None else ops
        self.k = k = ops.k
        # Preparing the launches compiles the kernels (or loads them from the disk cache
        # of the current module constants: stochattn.cuda.kmeans.diskcache).
        ops.start()
        self.kind, self.stream, self.sizes, self.lens_mode = kind, stream, z, lens_mode
        self.C, self.D, self.H, self.N, self.R = z.C, z.D, z.H, z.N, z.R
        self.iterations, self.gemm, self.tol = z.iterations, z.gemm, tol
        self.ns, self.win, self.hkv = np.int64(n_sink), np.int64(window), np.int64(z.Hkv)
        self._keep = []  # framework buffers behind the Numba views of the cached scratch

        def buf(shape, dtype):
            a, view = ops.scratch(kind, like, shape, dtype)
            self._keep.append(a)
            return view

        for name, (shape, dtype) in z.cached.items():
            setattr(self, name, buf(shape, dtype))
        if lens_mode == "gpu":
            self.lens = _Slot("lens")
        else:  # a constant buffer of N each, or the host lengths' copy (bind)
            self.lens = ops.host_copy(np.full(z.B, z.N, dtype=np.int64), stream)
        self._rd_rows = [self.rd[1, t] for t in range(z.iterations + 2)]  # the stop flags
        self.tpb = ops.tpb
        self.row_grid = (max(1, -(-self.R // self.tpb)), self.H)
        self.dim_threads = _pow2_at_most(self.D, k.DIM_TPB)
        self.events = (ops.event(), ops.event())
        self._first = _derived_views(views)
        self._users = {}  # slot name -> [(Bound, argument position)]
        self._bounds = []
        self._setup_launches()
        self.rounds = self._round_launches()
        ops.finish(stream)
        if self.gemm:
            if k.SIM:
                self.gemm_call = _EmulatedGemm(z.Rc, z.Cp)
            else:
                self.gemm_call = _CublasGemm(device, stream_ptr, z.per_build["cent16"][0],
                                             z.per_build["keys16"][0], z.Rc, z.Cp)
        self._first = None
        self.needs_views = bool(k.SIM) or not all(b.prepared for b in self._bounds)

    # -- launches ------------------------------------------------------------------------

    def _bound(self, kernel, grid, block, args, mutable=()):
        """A :class:`Bound` launch of ``kernel``; :class:`_Slot` arguments are rebound."""
        slots = [i for i, a in enumerate(args) if isinstance(a, _Slot)]
        real = [self._first[a.name] if isinstance(a, _Slot) else a for a in args]
        launch = self.ops.bound(kernel, grid, block, self.stream, real, mutable, slots)
        for i in slots:
            self._users.setdefault(args[i].name, []).append((launch, i))
        self._bounds.append(launch)
        return launch

    def _setup_launches(self) -> None:
        """The launches before the rounds and after them (once per build): zeroing, the
        token ranges, the seeding (the seed words are mutable scalars), the GEMM path's
        centring and float16 keys, the final CSR and the statistics."""
        ns, hkv, H, C, R = self.ns, self.hkv, self.H, self.C, self.R
        S, _k, _TPB = _Slot, self.k, self.tpb
        pf, rd, co = (a.reshape(a.size) for a in (self.pf, self.rd, self.co))
        n_zero = max(pf.size, rd.size, co.size, self._first["hb_flat"].size)
        self.zero = self._bound(_k.zero_scratch, -(-n_zero // _TPB), _TPB,
                                (pf, rd, co, S("hb_flat")))
        token_grid = (-(-self.N // _TPB), H)
        self.prepare = self._bound(_k.prepare, token_grid, _TPB,
                                   (self.lens, ns, self.win, hkv, S("window_start"),
                                    S("labels"), self.pi))
        shift = np.uint64(32 - self.sizes.nbits)
        grid = self.row_grid
        self.seed_keys = self._bound(_k.seed_keys, grid, _TPB,
                                     (self.pi, ns, np.uint64(0), np.uint64(0), shift, S("comp"),
                                      S("hb")), mutable=(2, 3))
        self.seed_scan = self._bound(_k.seed_scan, H, _k.SCAN_TPB,
                                     (np.int64(1 << self.sizes.nbits), S("hb")))
        self.seed_fill = self._bound(_k.seed_fill, grid, _TPB,
                                     (self.pi, shift, S("comp"), S("hb"), S("bc")))
        self.seed_rank = self._bound(_k.seed_rank, grid, _TPB,
                                     (self.pi, shift, S("comp"), S("hb"), S("bc")))
        if self.gemm:
            self.centre = self._bound(_k.centre, H, self.dim_threads,
                                      (S("k"), S("bc"), self.pi, ns, hkv, np.int64(C), self.mu,
                                       self.pf))
            rows_blk = max(1, min(_k.KH_ROWS, _k.KH_SHARED // (self.D + 1)))
            rows = (-(-max(R, 1) // rows_blk), H)
            self.keys_half = self._bound(_k.keys_half, rows, _k.KH_TPB,
                                         (S("k"), self.mu, self.pf, self.pi, ns, hkv,
                                          np.int64(rows_blk), S("keys16"), S("rown")))
        gemm = np.int32(1 if self.gemm else 0)
        self.seed_centroids = self._bound(
            _k.seed_centroids, (C, H), self.dim_threads,
            (S("k"), S("bc"), self.pi, ns, hkv, self.mu, self.pf, gemm, S("centroids"),
             S("cent16"), self.cl, self.clq, S("n_initialized")))
        # The final pass's CSR (every problem: scan_fill's final flag set).
        self.final_csr = self._bound(
            _k.scan_fill, H, _k.SCAN_TPB,
            (self.co, self.pi, self.rd, ns, hkv, np.int64(C), np.int64(1), np.int32(1),
             np.float64(self.tol), self.pf), mutable=(6,))
        self.stats = self._bound(_k.stats, (C, H), self.dim_threads,
                                 (S("v"), S("bc"), self.co, self.pi, ns, hkv, S("sizes"),
                                  S("value_sums")))

    def _round_launches(self):
        """The kernels launched every round (the round number is the mutable scalar): the
        assignment (GEMM path: one assign_gemm per score chunk), then the CSR of its labels
        (scan_fill, fill, rank: a stable counting sort by label, each cluster in position
        order) and the means."""
        ns, hkv, H, C, S = self.ns, self.hkv, self.H, self.C, _Slot
        _k, _TPB = self.k, self.tpb
        t0 = np.int64(1)
        out = {}
        if self.gemm:
            Rc = self.sizes.Rc
            bounds = _bound_constants(self.D)
            cl_flat = self.cl.reshape(self.cl.size)
            out["assign"] = [
                (r0, n, self._bound(
                    _k.assign_gemm, (-(-n // (_k.ROW_TILE * _k.TILES_PER_BLOCK)), H), _k.LANES,
                    (S("k"), S("G"), S("G64"), np.int64(r0), np.int64(n), S("centroids"),
                     cl_flat, self.clq, self.pf, self.pi, S("rown"), ns, hkv, t0, *bounds,
                     S("labels"), self.co, self.rd), mutable=(13,)))
                for r0, n in ((r0, min(Rc, self.R - r0)) for r0 in range(0, self.R, Rc))]
        else:
            out["assign"] = [(0, 0, self._bound(
                _k.assign_scan, self.row_grid, _TPB,
                (S("k"), S("centroids"), self.cl, self.pi, ns, hkv, t0, S("labels"), self.co,
                 self.rd), mutable=(6,)))]
        out["scan_fill"] = self._bound(_k.scan_fill, H, _k.SCAN_TPB,
                                       (self.co, self.pi, self.rd, ns, hkv, np.int64(C), t0,
                                        np.int32(0), np.float64(self.tol), self.pf), mutable=(6,))
        for name in ("fill", "rank"):
            out[name] = self._bound(getattr(_k, name), self.row_grid, _TPB,
                                    (S("labels"), self.pi, self.rd, self.co, S("bc"), ns, hkv, t0),
                                    mutable=(7,))
        gemm = np.int32(1 if self.gemm else 0)
        out["mean"] = self._bound(_k.mean, (C, H), self.dim_threads,
                                  (S("k"), S("bc"), self.co, self.pi, self.rd, ns, hkv, t0,
                                   self.mu, self.pf, gemm, S("centroids"), S("cent16"), self.cl,
                                   self.clq), mutable=(7,))
        return out

    # -- one build -----------------------------------------------------------------------

    def bind(self, arrays: dict, views=None, host_lens=None) -> None:
        """This build's arrays, by slot name: ``arrays`` in the caller's framework (their
        data pointers are rebound), ``views`` their Numba views (needed when
        :attr:`needs_views`: the simulator, or a launch that could not be prepared);
        ``host_lens``: int64 host lengths (``lens_mode == "host"``), copied on the stream."""
        if host_lens is not None:
            self.ops.to_device(self.lens, host_lens, self.stream)
        if self.needs_views:
            if views is None:
                raise ValueError("`views` are required by this plan (unprepared launches)")
            views = _derived_views(views)
            for name, users in self._users.items():
                view = views[name]
                for launch, i in users:
                    launch.rebind(i, view)
        else:
            ptrs = {name: _ptr(a) for name, a in arrays.items()}
            for name, users in self._users.items():
                ptr = ptrs[_DERIVED.get(name, name)]
                for launch, i in users:
                    launch.rebind(i, ptr=ptr)
        if self.gemm:
            names = ("cent16", "keys16", "G")
            if self.k.SIM:
                self.gemm_call.rebind(*(views[n] for n in names))
            else:
                self.gemm_call.rebind(*(_ptr(arrays[n]) for n in names))

    def release(self) -> None:
        """Forget this build's arrays (a plain launch would keep them alive)."""
        for launch in self._bounds:
            launch.release()
        if self.gemm and self.k.SIM:
            self.gemm_call.rebind(None, None, None)

    def run(self, seed: int) -> None:
        """Launch the whole build on the stream (after :meth:`bind`); returns after the
        last launch (one host wait per round, for the stop flags of the round before)."""
        H = self.H
        self.zero()
        self.prepare()
        self.seed_keys.set(2, seed & 0xFFFFFFFF)
        self.seed_keys.set(3, seed >> 32)
        self.seed_keys()
        self.seed_scan()
        self.seed_fill()
        self.seed_rank()
        if self.gemm:
            self.centre()
            self.keys_half()
        self.seed_centroids()
        rounds, s = self.rounds, self.stream
        flags = self.ops.pinned_flags(H)
        events = self.events
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
            self.ops.to_host(self._rd_rows[t], flags[t % 2, :H], s)
            events[t % 2].record(s)
        if final is None:
            final = self.iterations + 1
            self._assign(final, rounds)
        self.final_csr(final)
        rounds["fill"](final)
        rounds["rank"](final)
        self.stats()

    def _assign(self, t: int, rounds) -> None:
        for r0, n, launch in rounds["assign"]:
            if self.gemm:
                self.gemm_call(r0, n)  # this chunk's scores (cuBLAS), then its labels
            launch(t)
