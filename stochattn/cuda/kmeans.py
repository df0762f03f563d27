"""Double-P k-means prefill in Numba-CUDA, the GPU twin of :mod:`stochattn.reference.kmeans`.

One launch sequence handles every (sequence b, KV head kvh) problem of a batch at once;
problem ``p = b * Hkv + kvh`` is also the ``row`` of its random stream. The token ranges,
the seeding rule, the distance, the tie rule and the live/empty cluster rules are those of
the reference module docstring; this module differs only in precision and order of work:

- **Seeding (bit for bit).** Each middle token j gets the Philox-4x32-10 word
  ``random_words(seed, 0, PURPOSE_KMEANS_INIT, row=p, stream=0, draw=j)`` (computed in the
  kernel by :func:`_philox_x0`, the reference's block function in uint64 arithmetic) and
  the 64-bit composite ``word << 32 | j``. Composites are distinct and order tokens by
  (key, position), the reference's stable sort. One thread block per problem then takes the
  ``min(C, M)`` smallest composites by ``min(C, M)`` rounds of a block-wide minimum over
  the composites above the previous winner (a selection, O(C * M / threads) per problem;
  no sort needed). Round r copies its token's key into centroid r, so the initial centroids
  equal the reference's exactly (fp16/fp32 keys widen to float32 exactly).
- **Assignment (float32).** One thread per middle token computes
  ``|c|^2 - 2 k.c`` for every live cluster, ``|c|^2`` precomputed per cluster, both sums
  sequential over D in float32 (the compiler may fuse multiply-adds), and keeps the first
  minimum (strict ``<``: ties go to the lowest index). The reference does this in float64,
  so a token whose two best distances are within float32 rounding may be assigned
  differently; everything else is the same rule.
- **Update (deterministic).** One thread block per (problem, cluster), threads over D:
  each thread sums its coordinate over the cluster's members in ascending position order
  in float32 and divides by the count (IEEE division); an empty cluster keeps its
  centroid. No floating-point atomics, so a run is reproducible bit for bit, and the
  update is exactly ``cumsum``-in-float32 of the members followed by one division.
- **Early stop.** The assignment kernel raises a per-problem flag when any label changes;
  the update kernel skips problems whose flag is down. Labels that repeat give the same
  centroids bit for bit (the update is deterministic), so skipping changes nothing: this is
  the reference's early stop, per problem and without a host synchronisation.
- **Final assignment and statistics.** One more assignment with the final centroids; sizes
  (int64) and value sums (float32, same deterministic summation) come from it.

Arrays: NumPy inputs are copied to the device and the results come back as NumPy arrays
(this is also how the tests run under ``NUMBA_ENABLE_CUDASIM=1``); CuPy arrays and PyTorch
CUDA tensors are read in place through ``__cuda_array_interface__``, the outputs are
allocated by the same framework, and the kernels run on that framework's current stream
without a host synchronisation. PyTorch bfloat16 has no array-interface type code: such
keys/values are converted to a float32 copy first. ``seq_lens`` on the GPU are trusted
(values outside ``[0, N]`` are undefined behaviour); host ``seq_lens`` are checked.

Limits: ``B * Hkv < 65536`` (grid axis y). Memory: one (B * Hkv, N) uint64 scratch.
"""

from __future__ import annotations

import math

import numpy as np

# Compatibility: numba-cuda 0.30 still refers to ``np.row_stack``, which NumPy 2.5 removed
# (seen on the H200 machine: every kernel compile failed). Restore the alias, which NumPy
# defined as ``vstack``, before numba-cuda is imported.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config as _numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from .. import _validation as val
from ..reference.rng import PURPOSE_KMEANS_INIT

__all__ = ["kmeans_gpu"]

# ---- launch geometry ------------------------------------------------------------------

# The simulator runs every thread of a block as a Python thread: keep blocks small there.
_SIM = bool(_numba_config.ENABLE_CUDASIM)
_TPB = 32 if _SIM else 128  # threads per block of the per-token kernels
_SEL_TPB = 16 if _SIM else 256  # threads of the seeding selection (a power of two)
_MAX_PROBLEMS = 65535  # grid axis y

# ---- Philox-4x32-10 (bit for bit stochattn.reference.rng.philox4x32) -------------------

_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_U64_ONE = np.uint64(1)
_U64_MAX = np.uint64(0xFFFFFFFFFFFFFFFF)
_WORD2_PURPOSE = np.uint64(PURPOSE_KMEANS_INIT << 28)


@cuda.jit(device=True)
def _philox_x0(c0, c1, c2, c3, k0, k1):
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


# ---- kernels ----------------------------------------------------------------------------


@cuda.jit
def _prepare(lens, n_sink, window, Hkv, ws, labels):
    """window_start[b] = max(n_sink, L_b - window); labels = -1 everywhere."""
    j = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    if j == 0 and h == 0:
        w = np.int64(lens[b]) - window
        ws[b] = w if w > n_sink else n_sink
    if j < labels.shape[2]:
        labels[b, h, j] = -1


@cuda.jit
def _seed(keys, ws, n_sink, Hkv, C, seed_lo, seed_hi, comp, centroids, n_init):
    """One block per problem: random keys of the middle tokens, then the min(C, M) smallest
    (key, position) composites become centroids 0 .. min(C, M) - 1 in that order."""
    p = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    b = p // Hkv
    h = p - b * Hkv
    D = keys.shape[3]
    stop = ws[b]
    m = stop - n_sink
    live = m if m < C else C
    if tid == 0:
        n_init[b, h] = live
    for i in range(tid, C * D, nthr):  # non-live clusters keep centroid 0
        centroids[b, h, i // D, i - (i // D) * D] = np.float32(0.0)
    # Counter (draw=j, stream=0, (purpose << 28) | row, offset=0), key = the seed words.
    word2 = _WORD2_PURPOSE | np.uint64(p)
    for j in range(n_sink + tid, stop, nthr):
        x0 = _philox_x0(np.uint64(j), np.uint64(0), word2, np.uint64(0), seed_lo, seed_hi)
        comp[p, j] = (x0 << _S32) | np.uint64(j)
    red = cuda.shared.array(_SEL_TPB, dtype=np.uint64)
    cuda.syncthreads()  # zeroed centroids before any round writes one
    lo = np.uint64(0)
    for r in range(live):
        # Each thread scans the composites it wrote itself (same stride): no sync needed.
        best = _U64_MAX
        for j in range(n_sink + tid, stop, nthr):
            c = comp[p, j]
            if c >= lo and c < best:
                best = c
        red[tid] = best
        cuda.syncthreads()
        s = nthr // 2
        while s > 0:  # tree minimum (nthr is a power of two)
            if tid < s and red[tid + s] < red[tid]:
                red[tid] = red[tid + s]
            cuda.syncthreads()
            s //= 2
        win = red[0]
        pos = np.int64(win & _MASK32)
        for d in range(tid, D, nthr):
            centroids[b, h, r, d] = np.float32(keys[b, h, pos, d])
        lo = win + _U64_ONE  # composites are distinct; the winner is never the max
        cuda.syncthreads()  # everyone read red[0] before the next round overwrites it


@cuda.jit
def _norms(centroids, ws, n_sink, Hkv, norms, changed):
    """|c|^2 per live cluster (sequential float32 sum); clears the problem's change flag."""
    p = cuda.blockIdx.x
    b = p // Hkv
    h = p - b * Hkv
    C = centroids.shape[2]
    D = centroids.shape[3]
    m = ws[b] - n_sink
    live = m if m < C else C
    if cuda.threadIdx.x == 0:
        changed[p] = 0
    for c in range(cuda.threadIdx.x, live, cuda.blockDim.x):
        acc = np.float32(0.0)
        for d in range(D):
            x = centroids[b, h, c, d]
            acc += x * x
        norms[p, c] = acc


@cuda.jit
def _assign(keys, centroids, norms, ws, n_sink, Hkv, labels, changed):
    """One thread per token: nearest live centroid by |c|^2 - 2 k.c, first minimum."""
    j = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    stop = ws[b]
    if j < n_sink or j >= stop:
        return
    C = centroids.shape[2]
    D = centroids.shape[3]
    m = stop - n_sink
    live = m if m < C else C
    best = np.int32(0)
    best_score = np.float32(0.0)
    for c in range(live):
        dot = np.float32(0.0)
        for d in range(D):
            dot += np.float32(keys[b, h, j, d]) * centroids[b, h, c, d]
        score = norms[p, c] - np.float32(2.0) * dot
        if c == 0 or score < best_score:  # strict: ties stay with the lowest index
            best = np.int32(c)
            best_score = score
    if labels[b, h, j] != best:
        labels[b, h, j] = best
        changed[p] = 1  # every writer writes 1: a benign race


@cuda.jit
def _update(keys, labels, ws, n_sink, Hkv, changed, centroids):
    """Block (cluster c, problem p), threads over D: centroid = mean of its members, summed
    in ascending position order in float32; empty clusters and unchanged problems skip."""
    c = cuda.blockIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    C = centroids.shape[2]
    D = centroids.shape[3]
    stop = ws[b]
    m = stop - n_sink
    live = m if m < C else C
    if changed[p] == 0 or c >= live:
        return
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        acc = np.float32(0.0)
        count = 0
        for t in range(n_sink, stop):
            if labels[b, h, t] == c:
                acc += np.float32(keys[b, h, t, d])
                count += 1
        if count > 0:
            centroids[b, h, c, d] = acc / np.float32(count)


@cuda.jit
def _statistics(values, labels, ws, n_sink, Hkv, sizes, value_sums):
    """Block (cluster c, problem p): size and float32 value sum of the final members."""
    c = cuda.blockIdx.x
    p = cuda.blockIdx.y
    b = p // Hkv
    h = p - b * Hkv
    D = values.shape[3]
    stop = ws[b]
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        acc = np.float32(0.0)
        count = 0
        for t in range(n_sink, stop):
            if labels[b, h, t] == c:
                acc += np.float32(values[b, h, t, d])
                count += 1
        value_sums[b, h, c, d] = acc
        if d == 0:
            sizes[b, h, c] = count


# ---- host side --------------------------------------------------------------------------


def _pow2_at_most(n: int, cap: int) -> int:
    """Largest power of two <= min(n, cap), at least 1."""
    return 1 << max(0, int(math.log2(max(1, min(n, cap)))))


class _Meta:
    """Shape and dtype name of a device array, for stochattn._validation."""

    __slots__ = ("shape", "ndim", "dtype")

    def __init__(self, shape, dtype):
        self.shape = tuple(int(s) for s in shape)
        self.ndim = len(self.shape)
        self.dtype = str(dtype).replace("torch.", "")


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
    return cuda.get_current_device().id


def _stream(kind, device):
    """The stream to launch on: the framework's current one (no host synchronisation)."""
    if kind == "torch":
        import torch

        ptr = torch.cuda.current_stream(device).cuda_stream
    elif kind == "cupy":
        import cupy

        ptr = cupy.cuda.get_current_stream().ptr
    else:
        return cuda.default_stream()
    return cuda.external_stream(ptr) if ptr else cuda.default_stream()


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


def kmeans_gpu(k, v, seq_lens=None, *, n_clusters, iterations=10, n_sink=4, window=64, seed=0):
    """Double-P prefill k-means on the GPU for every (sequence, KV head) of a batch.

    Same index as :func:`stochattn.reference.kmeans.build_index` (seeding, tie rule,
    live/empty clusters, early stop, final assignment), computed in float32: see the
    module docstring for what may differ (assignments whose two best distances are within
    float32 rounding) and what is exact (the seeding).

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
        Lloyd iterations after the seeding (>= 0); a final assignment always follows.
    n_sink, window : int
        Exact tokens at the start and the end of each sequence (>= 0).
    seed : int
        Seed of the initialisation, ``0 <= seed < 2**64``.

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
        ``window``, host ``seq_lens`` outside [0, N], or ``B * Hkv > 65535``.
    TypeError
        Unsupported array types or dtypes.

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
    metas = [_Meta(a.shape, a.dtype) for a in (k, v)]
    B, Hkv, N, D = val.check_kv_inputs(*metas, dtypes=("float16", "bfloat16", "float32"))
    n_clusters = val.check_positive_int("n_clusters", n_clusters)
    if n_clusters > N:
        raise ValueError(f"`n_clusters` must be <= {N} (the seq axis of `k`), got {n_clusters}")
    iterations = val.check_nonnegative_int("iterations", iterations)
    n_sink = val.check_nonnegative_int("n_sink", n_sink)
    window = val.check_nonnegative_int("window", window)
    seed, _ = val.check_seed_offset(seed, 0)
    H = B * Hkv
    if H > _MAX_PROBLEMS:
        raise ValueError(f"`k` batch * kv_heads must be <= {_MAX_PROBLEMS}, got {H}")
    C = n_clusters

    device = _device_of(kind, k)
    ctx = cuda.gpus[device] if kind in ("torch", "cupy") and not _SIM else _NullContext()
    with ctx:
        stream = _stream(kind, device)
        if kind == "numpy":
            k_dev = cuda.to_device(np.ascontiguousarray(k), stream=stream)
            v_dev = cuda.to_device(np.ascontiguousarray(v), stream=stream)
        else:
            k_dev = cuda.as_cuda_array(k, sync=False)
            v_dev = cuda.as_cuda_array(v, sync=False)
        if seq_lens is None:
            lens_dev = cuda.to_device(np.full(B, N, dtype=np.int64), stream=stream)
        elif isinstance(seq_lens, (np.ndarray, list, tuple)) or (
                type(seq_lens).__module__.split(".")[0] == "torch" and not seq_lens.is_cuda):
            host = np.asarray(seq_lens) if not hasattr(seq_lens, "numpy") else seq_lens.numpy()
            val.check_seq_lens(host, B, N)
            lens_dev = cuda.to_device(host.astype(np.int64), stream=stream)
        else:
            lens_dev = cuda.as_cuda_array(seq_lens, sync=False)
            if tuple(lens_dev.shape) != (B,):
                raise ValueError(f"`seq_lens` must have shape ({B},), got {tuple(lens_dev.shape)}")
            if np.dtype(lens_dev.dtype).kind not in "iu":
                raise TypeError(f"`seq_lens` must have an integer dtype, got {lens_dev.dtype}")

        outs = dict(
            centroids=_empty(kind, k, (B, Hkv, C, D), np.float32),
            sizes=_empty(kind, k, (B, Hkv, C), np.int64),
            value_sums=_empty(kind, k, (B, Hkv, C, D), np.float32),
            labels=_empty(kind, k, (B, Hkv, N), np.int32),
            window_start=_empty(kind, k, (B,), np.int64),
            n_initialized=_empty(kind, k, (B, Hkv), np.int64),
        )
        dev = {name: a if kind in ("numpy", "cai") else cuda.as_cuda_array(a, sync=False)
               for name, a in outs.items()}
        comp = cuda.device_array((H, N), dtype=np.uint64, stream=stream)
        norms = cuda.device_array((H, C), dtype=np.float32, stream=stream)
        changed = cuda.device_array((H,), dtype=np.int32, stream=stream)

        i64 = np.int64
        ns, win, hkv = i64(n_sink), i64(window), i64(Hkv)
        token_grid = ((N + _TPB - 1) // _TPB, H)
        dim_threads = _pow2_at_most(D, _TPB)
        ws, labels, cent = dev["window_start"], dev["labels"], dev["centroids"]

        _prepare[token_grid, _TPB, stream](lens_dev, ns, win, hkv, ws, labels)
        _seed[H, _SEL_TPB, stream](k_dev, ws, ns, hkv, i64(C),
                                   np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32),
                                   comp, cent, dev["n_initialized"])
        for _ in range(iterations):
            _norms[H, _TPB, stream](cent, ws, ns, hkv, norms, changed)
            _assign[token_grid, _TPB, stream](k_dev, cent, norms, ws, ns, hkv, labels, changed)
            _update[(C, H), dim_threads, stream](k_dev, labels, ws, ns, hkv, changed, cent)
        _norms[H, _TPB, stream](cent, ws, ns, hkv, norms, changed)
        _assign[token_grid, _TPB, stream](k_dev, cent, norms, ws, ns, hkv, labels, changed)
        _statistics[(C, H), dim_threads, stream](v_dev, labels, ws, ns, hkv, dev["sizes"],
                                                 dev["value_sums"])
        if kind == "numpy":
            result = {name: a.copy_to_host(stream=stream) for name, a in dev.items()}
            stream.synchronize()
            return result
        if kind == "cai":
            return dev
        return outs


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
