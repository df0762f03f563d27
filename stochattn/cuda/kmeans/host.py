"""Double-P k-means prefill in Numba-CUDA, the GPU twin of :mod:`stochattn.reference.kmeans`.

One launch sequence handles every (sequence b, KV head kvh) problem of a batch at once;
problem ``p = b * Hkv + kvh`` is also the ``row`` of its random stream. The token ranges,
the seeding rule, the distance, the tie rule, the live/empty cluster rules and the early
stop (``tol``) are those of the reference module docstring; this module differs only in
precision and order of work (kernels: :mod:`stochattn.cuda.kmeans.kernels`):

- **Seeding (bit for bit).** Each middle token j gets the Philox-4x32-10 word
  ``random_words(seed, 0, PURPOSE_KMEANS_INIT, row=p, stream=0, draw=j)`` (computed in the
  kernel by :func:`_philox_x0`, the reference's block function in uint64 arithmetic) and
  the 64-bit composite ``word << 32 | j``; composites are distinct and order tokens by
  (key, position), the reference's stable sort. A counting sort on the top bits of the
  word (uniform by construction; one bin per token on average) followed by ranking inside
  each bin sorts them in O(M) per problem; the first ``min(C, M)`` tokens' keys become the
  centroids, so the initial centroids equal the reference's exactly.
- **Assignment (float32 decisions).** Every label is the first minimum, over the live
  clusters, of the float32 score ``|c|^2 - 2 k.c`` with both sums sequential over D (the
  compiler may fuse multiply-adds): exactly the label that one thread per token scanning
  every cluster gives (``method="scan"``), whichever path computed it. The reference
  decides in float64, so a token whose two best distances lie within float32 rounding may
  be labelled differently; everything else is the same rule. ``method="gemm"`` (the
  default when CuPy is installed) preselects: keys and centroids are centred (``mu`` = mean
  of up to 256 initial centroids), scaled by a power of two (those centroids to norms <=
  16, far from float16 overflow), rounded to float16, and one strided-batched cuBLAS GEMM
  per chunk of tokens (float32 accumulation, float16 output, at most
  :data:`GEMM_SCRATCH_BYTES` of scores at once; rows padded to a multiple of 8 scores)
  gives every (token, cluster) score. A kernel (one warp per block, a tile of rows read
  together in coalesced 8-byte words, warp-shuffle reductions) reads each token's row once
  with a proven bound ``e_c`` on the gap between that
  score and the float32 score (float16 rounding of inputs and output, the accumulation,
  the float32 scan's own rounding, times ``1 + 2**-8``): when a single cluster can be the
  float32 minimum it is the label; otherwise the clusters whose interval reaches the
  upper bound of the cluster with the smallest lower bound are scored exactly, each by
  the lane that read it (a lane holding two or more rescans its own clusters), and a row
  that may hold a non-finite or overflowed score (a non-finite key or centroid, or a key
  so far out that float16 could overflow) scores every cluster. In a NumPy model of this
  filter on LLM-like keys (``stochattn/eval/calibrated.py``, N/32 clusters) 3-4% of the tokens
  need the second look at 32k and about 10% at 128k (a fifth in the first round, against the
  initial centroids), 1.1-1.2 candidates on average; a lane holds two candidates in
  0.3-0.9% of the tokens.
- **Update (deterministic, O(M D)).** A stable counting sort of the tokens by label: the
  integer histogram (built by the assignment), an exclusive scan per problem, a scatter
  (one thread per token), and each token's place inside its cluster = the number of members
  before it in position order. Each cluster then moves to the float32 sum of its
  members' keys in ascending position order divided by the count (IEEE division); empty
  clusters stay. No
  floating-point atomics, so a run is reproducible bit for bit. Placing a token costs
  the size of its cluster: negligible unless one cluster holds a large share of the tokens.
- **Early stop.** The assignment counts changed labels per problem (integer atomics); a
  per-problem flag marks a problem whose round changed at most ``floor(tol * M)`` labels,
  after which its update is skipped. The host reads each round's flags one round late
  (copy to pinned memory, event), so the device does not idle, and stops launching once
  every problem has stopped: the assignment already launched is then the final one. These
  event waits, one per round, are the only host synchronisations.
- **Final assignment and statistics.** Sizes (int64) and value sums (float32, the same
  sequential sums in position order) come from the final labels.

Cost of one round, H problems of M tokens, C clusters, D = 128 (``method="gemm"``): the
GEMM's 2 H M C D flops, 4 H M C bytes of float16 scores written and read, about 8
floating-point operations per score in the filter, O(H M D) for the rest, and a handful of
kernel launches (host time that dominates small problems); ``benchmarks/bench_kmeans.py``
measures it against torch SDPA's causal prefill.

Arrays: NumPy inputs are copied to the device and the results come back as NumPy arrays
(this is also how the tests run under ``NUMBA_ENABLE_CUDASIM=1``, where ``method="gemm"``
runs the same kernels on a NumPy emulation of the GEMM); CuPy arrays and PyTorch CUDA
tensors are read in place through ``__cuda_array_interface__``, the outputs and scratch
buffers are allocated by the same framework, and everything runs on that framework's
current stream (cuBLAS included). PyTorch bfloat16 has no array-interface type code: such
keys/values are converted to a float32 copy first. ``seq_lens`` on the GPU are trusted
(values outside ``[0, N]`` are undefined behaviour); host ``seq_lens`` are checked.

Host time: the first build of a configuration (framework, device, stream, shapes, dtypes,
seq_lens kind, options) prepares every launch and keeps the result as a plan
(:mod:`stochattn.cuda.kmeans.cache`, at most :data:`BUILD_CACHE_SIZE` plans): the
prepared argument lists, the cuBLAS wrapper, two events and the small scratch (O(H C)
bytes, zeroed on the stream by every build). A later build of the same configuration
allocates its outputs and large scratch, rewrites the data pointers, the seed and the
lengths in the prepared lists and launches: no Numba argument handling, no
``as_cuda_array`` for PyTorch and CuPy arrays. A plan serves one build at a time (another
thread's build of the same configuration builds uncached). The kernels themselves are
compiled once per process, or loaded from the disk cache of an earlier process
(:mod:`stochattn.cuda.kmeans.diskcache`: keyed on the kernels' sources and module
constants; off with ``STOCHATTN_KMEANS_CACHE=0``; :func:`clear_disk_cache`). For CuPy
inputs, a process whose kernels have raw entries (:mod:`stochattn.cuda.kmeans.raw`, written
by an earlier process's Numba build) launches those cubins without importing Numba
(:mod:`stochattn.cuda.kmeans.rawplan`; same machine code, same arguments); anything missing
takes the Numba path (off alone: ``STOCHATTN_KMEANS_RAW=0``).

Limits: ``B * Hkv < 65536`` (grid axis y). Memory, beyond the outputs: the float16 keys
(H, N, D) and the score chunk for the GEMM path, and a few (H, N) integer arrays, all
allocated by each build from the caller's framework (Numba's allocator for NumPy inputs).
"""

from __future__ import annotations

import numpy as np

from ... import _validation as val
from ...spec import DEFAULT_TOL, check_tol
from ..runtime.arrays import ArrayMeta
from . import build as _build
from . import cache as _kmeans_cache
from . import raw as _raw
from .diskcache import clear_disk_cache
from .build import BuildPlan as _BuildPlan
from .build import _empty, _geometry, _Sizes, _stream_ptr, _use_gemm
from .launch import array_layout

__all__ = ["kmeans_gpu", "GEMM_SCRATCH_BYTES", "BUILD_CACHE_SIZE", "clear_build_cache",
           "clear_disk_cache"]

_MAX_PROBLEMS = 65535  # grid axis y
# Configurations (plan cache keys without the backend) whose raw plan missed an entry in
# this process: they take the Numba path without looking again.
_raw_missed: set = set()


def __getattr__(name):
    """Numba's names, imported on first use (the raw path never imports Numba): ``cuda``
    (numba.cuda), ``_k`` (the kernels), ``_SIM``, ``_TPB``, ``_philox_x0`` (the tests call
    it directly)."""
    if name == "cuda":
        return _build._numba_cuda()
    if name == "_k":
        return _build._kernels()
    if name in ("_SIM", "_TPB"):
        return getattr(_build._kernels(), name[1:])
    if name == "_philox_x0":
        return _build._kernels().philox_x0
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Largest float16 score chunk of the GEMM path, in bytes (a module attribute, read at
#: every call): tokens are processed in chunks of ``GEMM_SCRATCH_BYTES // (2 H C)`` rows.
GEMM_SCRATCH_BYTES = 1 << 30

#: Most build plans kept (a module attribute, read at every call; 0 turns the cache off).
#: A plan (one per configuration: framework, device, stream, shapes, dtypes, options)
#: keeps the prepared launches and O(B Hkv C) bytes of small scratch, so that a repeated
#: build spends no host time on Numba's argument handling; the large scratch (float16
#: keys, score chunk) is allocated by every build. See :mod:`stochattn.cuda.kmeans.cache`.
BUILD_CACHE_SIZE = 8


def clear_build_cache() -> None:
    """Forget every cached build plan (and the device scratch they keep)."""
    _kmeans_cache.clear()


# ---- host side --------------------------------------------------------------------------


def _framework(name, a):
    """"numpy", "torch" or "cupy" (anything else with ``__cuda_array_interface__``)."""
    if isinstance(a, np.ndarray):
        return "numpy"
    if type(a).__module__.split(".")[0] == "torch":
        if not a.is_cuda:
            raise TypeError(f"`{name}` must be a CUDA tensor or a NumPy array, got a tensor on "
                            f"{a.device}")
        return "torch"
    if hasattr(a, "__cuda_array_interface__"):
        return "cupy" if type(a).__module__.split(".")[0] == "cupy" else "cai"
    raise TypeError(f"`{name}` must be a NumPy array, a CuPy array or a CUDA tensor, "
                    f"got {type(a).__name__}")


def _device_of(kind, a) -> int:
    if kind == "numpy":
        return 0
    if kind == "torch":
        return a.get_device()
    if kind == "cupy":
        return a.data.device_id
    return _build._numba_cuda().get_current_device().id


def _stream(kind, device):
    """The stream to launch on: the framework's current one (no host synchronisation)."""
    cuda = _build._numba_cuda()
    if kind == "torch":
        import torch

        ptr = torch.cuda.current_stream(device).cuda_stream
    elif kind == "cupy":
        import cupy

        ptr = cupy.cuda.get_current_stream().ptr
    else:
        return cuda.default_stream()
    return cuda.external_stream(ptr) if ptr else cuda.default_stream()


def kmeans_gpu(k, v, seq_lens=None, *, n_clusters, iterations=10, n_sink=4, window=64, seed=0,
               tol=DEFAULT_TOL, method="auto"):
    """Double-P prefill k-means on the GPU for every (sequence, KV head) of a batch.

    Same index as :func:`stochattn.reference.kmeans.build_index` with the same ``tol``
    (seeding, tie rule, live/empty clusters, early stop, final assignment), decided in
    float32: see the module docstring for what may differ (assignments whose two best
    distances are within float32 rounding) and what is exact (the seeding).

    Parameters
    ----------
    k, v : array, shape (B, Hkv, N, D)
        Key and value caches, float16, bfloat16 (PyTorch only; copied to float32) or
        float32: NumPy arrays (copied to the device and back), CuPy arrays or PyTorch
        CUDA tensors (read in place).
    seq_lens : integer array, shape (B,), optional
        Sequence lengths in ``[0, N]`` (default N each); host arrays are checked, GPU
        arrays are trusted.
    n_clusters : int
        Clusters per (sequence, KV head), ``1 <= C <= N``.
    iterations : int
        Most Lloyd rounds after the seeding (>= 0); a final assignment always follows.
    n_sink, window : int
        Exact tokens at the start and the end of each sequence (>= 0).
    seed : int
        Seed of the initialisation, ``0 <= seed < 2**64``.
    tol : float
        Early-stop tolerance in [0, 1]: a (sequence, KV head) whose round changed the
        cluster of at most ``floor(tol * M)`` of its M middle tokens stops moving its
        centroids (0: only at a fixed point). Default
        :data:`stochattn.reference.kmeans.DEFAULT_TOL` (0.05), as the reference.
    method : {"auto", "gemm", "scan"}
        How the assignment finds candidates; the labels are the same either way.
        ``"gemm"``: float16 cuBLAS GEMM plus exact float32 checks (needs CuPy; under the
        CUDA simulator a NumPy emulation of the GEMM); ``"scan"``: every cluster scored
        in float32 by one thread per token (O(M C D) per round, for tests and machines
        without CuPy); ``"auto"``: ``"gemm"`` when CuPy is installed, else ``"scan"``
        (always ``"scan"`` under the simulator).

    Returns
    -------
    dict of arrays, in the framework of ``k`` (NumPy for NumPy inputs):
        ``centroids`` (B, Hkv, C, D) float32, ``sizes`` (B, Hkv, C) int64,
        ``value_sums`` (B, Hkv, C, D) float32, ``labels`` (B, Hkv, N) int32 (-1 outside the
        middle), ``window_start`` (B,) int64, ``n_initialized`` (B, Hkv) int64.

    Raises
    ------
    ValueError
        Bad shapes, ``n_clusters`` outside [1, N], negative ``iterations``, ``n_sink`` or
        ``window``, ``tol`` outside [0, 1], an unknown ``method``, host ``seq_lens``
        outside [0, N], or ``B * Hkv > 65535``.
    TypeError
        Unsupported array types or dtypes.
    ImportError
        ``method="gemm"`` on a GPU without CuPy.

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.cuda.kmeans import kmeans_gpu
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((1, 2, 100, 8)).astype(np.float32)
    >>> out = kmeans_gpu(k, k, n_clusters=4, iterations=2)  # doctest: +SKIP
    >>> out["sizes"].sum(axis=-1)  # doctest: +SKIP
    array([[32, 32]])
    """
    kind_k, kind_v = _framework("k", k), _framework("v", v)
    if kind_k != kind_v:
        raise TypeError(f"`k` and `v` must come from one framework, got {kind_k} and {kind_v}")
    kind = kind_k
    if kind == "torch" and str(k.dtype) == str(v.dtype) == "torch.bfloat16":
        # No __cuda_array_interface__ type code for bfloat16: widen (exactly) to float32.
        k, v = k.float(), v.float()
    metas = [ArrayMeta(a.shape, str(a.dtype).replace("torch.", "")) for a in (k, v)]
    B, Hkv, N, D = val.check_kv_inputs(*metas, dtypes=("float16", "bfloat16", "float32"))
    n_clusters = val.check_positive_int("n_clusters", n_clusters)
    if n_clusters > N:
        raise ValueError(f"`n_clusters` must be <= {N} (the seq axis of `k`), got {n_clusters}")
    iterations = val.check_nonnegative_int("iterations", iterations)
    n_sink = val.check_nonnegative_int("n_sink", n_sink)
    window = val.check_nonnegative_int("window", window)
    seed, _ = val.check_seed_offset(seed, 0)
    tol = check_tol(tol)
    method = val.check_choice("method", method, ("auto", "gemm", "scan"))
    H = B * Hkv
    if H > _MAX_PROBLEMS:
        raise ValueError(f"`k` batch * kv_heads must be <= {_MAX_PROBLEMS}, got {H}")
    gemm = _use_gemm(method)

    device = _device_of(kind, k)
    args = (kind, k, v, seq_lens, device, B, Hkv, N, D, n_clusters, iterations, n_sink,
            window, seed, tol, gemm)
    if kind == "cupy":
        from .rawplan import ops_for

        ops = ops_for(device)
        if ops is not None:
            try:
                return _run(ops, *args)
            except _raw.RawMiss:
                pass  # no launch ran: the Numba path builds the same index
    return _run(None, *args)


def _run(ops, kind, k, v, seq_lens, device, B, Hkv, N, D, n_clusters, iterations, n_sink,
         window, seed, tol, gemm):
    """One build with the plan of its configuration (``ops``: a raw backend, or None for
    Numba's); raises :class:`.raw.RawMiss` before any launch when the raw backend lacks an
    entry."""
    raw = ops is not None
    if raw:
        import cupy

        cuda, ctx = None, cupy.cuda.Device(device)
    else:
        cuda = _build._numba_cuda()
        ctx = (cuda.gpus[device] if kind in ("torch", "cupy") and not _build._sim()
               else _NullContext())
    with ctx:
        lens_arr, host_lens, lens_key = _lens(seq_lens, B, N)
        if kind == "numpy":  # copies on the legacy default stream (as every NumPy build)
            stream = cuda.default_stream()
            k = cuda.to_device(np.ascontiguousarray(k), stream=stream)
            v = cuda.to_device(np.ascontiguousarray(v), stream=stream)
            layout = (k.dtype.str,)
        elif kind == "cai":
            k, v = cuda.as_cuda_array(k, sync=False), cuda.as_cuda_array(v, sync=False)
            layout = (array_layout(k), array_layout(v))
        elif kind == "torch":
            layout = (str(k.dtype), tuple(k.stride()), tuple(v.stride()))
        else:
            layout = (k.dtype.str, k.strides, v.strides)
        stream_ptr = _stream_ptr(kind, device)
        key = (kind, device, stream_ptr, B, Hkv, N, D, layout, n_clusters, iterations, n_sink,
               window, tol, gemm, GEMM_SCRATCH_BYTES, lens_key,
               "raw" if raw else "numba", _geometry(ops.k) if raw else _geometry())
        if raw and key in _raw_missed:
            raise _raw.RawMiss("this configuration missed a raw entry before")
        limit = BUILD_CACHE_SIZE
        plan = _kmeans_cache.acquire(key) if limit > 0 else None
        cached = plan is not None  # lent by the cache: hand it back whatever happens
        try:
            sizes = plan.sizes if cached else _Sizes(B, Hkv, N, D, n_clusters, iterations,
                                                     n_sink, window, gemm, GEMM_SCRATCH_BYTES,
                                                     vec=ops.k.VEC if raw else None)
            outs = dict(
                centroids=_empty(kind, k, (B, Hkv, n_clusters, D), np.float32),
                sizes=_empty(kind, k, (B, Hkv, n_clusters), np.int64),
                value_sums=_empty(kind, k, (B, Hkv, n_clusters, D), np.float32),
                labels=_empty(kind, k, (B, Hkv, N), np.int32),
                window_start=_empty(kind, k, (B,), np.int64),
                n_initialized=_empty(kind, k, (B, Hkv), np.int64),
            )
            # This build's arrays (the scratch from the caller's framework: freed when the
            # call returns, stream-ordered there); Numba views only where needed (a cache
            # hit on a GPU rebinds data pointers only; the raw path takes CuPy's arrays).
            arrays = dict(outs, k=k, v=v, **sizes.scratch(kind, k))
            if lens_arr is not None:
                arrays["lens"] = lens_arr
            views = None
            if not cached or plan.needs_views:
                views = dict(arrays) if raw else {
                    name: a if hasattr(a, "copy_to_host")  # Numba's (or simulated)
                    else cuda.as_cuda_array(a, sync=False) for name, a in arrays.items()}
            if not cached:
                if raw:
                    stream = cupy.cuda.get_current_stream()
                elif kind != "numpy":
                    stream = _stream(kind, device)
                lens_mode = lens_key if lens_key in ("none", "host") else "gpu"
                extra = dict(ops=ops) if raw else {}
                try:
                    plan = _BuildPlan(kind, k, device, stream, stream_ptr, sizes, n_sink,
                                      window, tol, lens_mode, views, **extra)
                except _raw.RawMiss:
                    _raw_missed.add(key)
                    raise
                cached = _kmeans_cache.offer(key, plan, limit)
            plan.bind(arrays, views, host_lens)
            plan.run(seed)
        finally:
            if plan is not None:
                plan.release()
                if cached:
                    _kmeans_cache.release(plan)
        if kind == "numpy":
            result = {name: outs[name].copy_to_host(stream=plan.stream) for name in outs}
            plan.stream.synchronize()
            return result
        return outs


def _lens(seq_lens, B: int, N: int):
    """(GPU array or None, int64 host copy or None, cache-key part) of ``seq_lens``: host
    lengths are checked; GPU lengths have their shape and dtype checked (attributes only)
    and are read in place (a Numba view for other array-interface objects)."""
    if seq_lens is None:
        return None, None, "none"
    if isinstance(seq_lens, (np.ndarray, list, tuple)) or (
            type(seq_lens).__module__.split(".")[0] == "torch" and not seq_lens.is_cuda):
        host = np.asarray(seq_lens) if not hasattr(seq_lens, "numpy") else seq_lens.numpy()
        val.check_seq_lens(host, B, N)
        return None, np.ascontiguousarray(host, dtype=np.int64).reshape(B), "host"
    module = type(seq_lens).__module__.split(".")[0]
    if module == "torch":
        dtype = str(seq_lens.dtype).replace("torch.", "")
        shape, strides = tuple(seq_lens.shape), tuple(seq_lens.stride())
    else:
        if module != "cupy" and not hasattr(seq_lens, "copy_to_host"):  # not Numba's
            seq_lens = _build._numba_cuda().as_cuda_array(seq_lens, sync=False)
        dtype = np.dtype(seq_lens.dtype).name
        shape, strides = tuple(seq_lens.shape), tuple(seq_lens.strides)
    if shape != (B,):
        raise ValueError(f"`seq_lens` must have shape ({B},), got {shape}")
    try:
        integer = np.dtype(dtype).kind in "iu"
    except TypeError:  # a PyTorch dtype without a NumPy name (bfloat16)
        integer = False
    if not integer:
        raise TypeError(f"`seq_lens` must have an integer dtype, got {dtype}")
    return seq_lens, None, ("gpu", module, dtype, strides)


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
