"""The Double-P index on the GPU: build, append, CSR, value means and stack for CuPy arrays
and PyTorch CUDA tensors; the GPU twin of the index half of :mod:`stochattn.reference.kmeans`.

:class:`stochattn.doublep.DoublePIndex` dispatches here when its arrays (or the cache it is
given) live on a GPU. Every array of a GPU index lives on the device of the cache, in the
caller's framework (CuPy in, CuPy arrays; torch in, torch tensors; any other DLPack GPU
array goes through CuPy and gives CuPy arrays):

=================  ====================  ============================================
field              shape                 dtype
=================  ====================  ============================================
``centroids``      (B, Hkv, C, D)        float32 (the reference: float64)
``sizes``          (B, Hkv, C)           int64
``value_sums``     (B, Hkv, C, D)        float32 (the reference: float64)
``labels``         (B, Hkv, N)           int32, -1 outside the middle tokens
``seq_lens``       (B,)                  int64
``window_start``   (B,)                  int64
``n_initialized``  (B, Hkv)              int64
=================  ====================  ============================================

What runs where, all on the caller's current stream (torch's for tensors, CuPy's for
arrays):

- **Build.** :func:`stochattn.cuda.kmeans.kmeans_gpu` (Numba-CUDA: seeding bit for bit the
  reference's, float32 Lloyd iterations, deterministic statistics) gives every field but
  ``seq_lens``, which is stored as an int64 device copy of the lengths.
- **Append.** One Numba-CUDA kernel, one thread block per (sequence, KV head), walks the
  tokens that leave the window in position order, exactly as the reference's
  ``append_tokens``: while clusters without a centroid remain, a token seeds the next one
  (centroid = its key, widened exactly to float32); otherwise the block scores every
  centroid, ``|c|^2 - 2 k.c`` in float32 (one thread per cluster, sequential over D, the
  k-means kernel's arithmetic), and a tree reduction keeps the smallest score, ties to the
  lowest cluster index. Sizes, labels and float32 value sums are updated by the block in
  position order, so appending one token at a time gives the same index, bit for bit, as
  one bulk append, and each value sum is the sequential float32 sum of its members in
  position order (build and appends alike). Cost per leaving token: ``C * D`` multiply-adds
  spread over the block; a decode step moves one token per sequence.
- **CSR** (:func:`csr_gpu`). Offsets are the prefix sums of the sizes; token ids come from
  one sort of the composite keys ``label * N + position`` (sinks, window and padding get
  label C and sort last), which orders tokens by cluster and by position inside a cluster
  without relying on a stable sort.
- **Value means, stack.** Array operations of the framework.

Host synchronisations: at build time, one event wait per k-means round (the early stop:
see :mod:`stochattn.cuda.kmeans`); otherwise none on these paths, except
``check_finite=True`` (reads k, v and GPU ``seq_lens``) and ``repr`` (prints the lengths). One caveat at build time:
``kmeans_gpu`` takes its scratch buffers from Numba's allocator (``cuMemAlloc``, freed
later by ``cuMemFree``), which is not stream-ordered and may serialise with the device; the
append allocates only through the framework. Host ``seq_lens`` (NumPy, list, CPU tensor)
are checked on the host and copied to the device; GPU ``seq_lens`` have their
shape, dtype and device checked, and their values are not read: they are clamped to
``[0, N]`` on the device, and at an append also to at least the index's lengths (a
sequence never shrinks; the reference raises instead, which would need a synchronisation
here).

Differences from the reference (float64): distances and statistics in float32, so a token
whose two best distances lie within float32 rounding may be labelled differently (a
near-tie; at build time such a difference in an early iteration also moves the later
centroids), centroids and value sums agree to float32 rounding, and ``csr_gpu`` pads the
token ids to N (the label axis) instead of the longest middle, to avoid reading lengths
back to the host.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .. import _validation as val
from .._backend import require_cupy
from ._arrays import CUPY, TORCH, host_values, ops_for, to_cupy

__all__ = ["build_index_gpu", "append_gpu", "csr_gpu", "value_means_gpu", "stack_gpu",
           "device_label"]


# ---- the framework operations the index needs -------------------------------------------------


class _NumpyLike:
    """NumPy (the index arrays of the CPU tests, run under Numba's CUDA simulator) or CuPy:
    one API."""

    def __init__(self, name: str):
        self.name = name

    @property
    def xp(self):
        if self.name == "numpy":
            return np
        import cupy

        return cupy

    def is_array(self, a) -> bool:
        return isinstance(a, self.xp.ndarray)

    def device(self, a) -> int:
        return -1 if self.name == "numpy" else int(a.data.device_id)

    def scope(self, device: int):
        """Allocations and launches of CuPy on ``device``."""
        if self.name == "numpy":
            return contextlib.nullcontext()
        import cupy

        return cupy.cuda.Device(device)

    def dtype_name(self, a) -> str:
        return str(a.dtype)

    def full(self, like, shape, value, dtype: str):
        return self.xp.full(shape, value, dtype=dtype)

    def arange(self, like, n: int):
        return self.xp.arange(n, dtype=np.int64)

    def from_host(self, like, host: np.ndarray):
        return host.copy() if self.name == "numpy" else self.xp.asarray(host)

    def astype(self, a, dtype: str):
        return a.astype(dtype)  # always a copy

    def clip(self, a, lo, hi):
        return self.xp.clip(a, lo, hi)

    def maximum(self, a, b):
        return self.xp.maximum(a, b)

    def where(self, cond, a, b):
        return self.xp.where(cond, a, b)

    def cumsum(self, a):
        return self.xp.cumsum(a, axis=-1)

    def sort(self, a):
        return self.xp.sort(a, axis=-1)

    def concatenate(self, arrays):
        return self.xp.concatenate(arrays, axis=0)

    def bits16(self, a):
        """The raw 16-bit patterns of a bfloat16 array, as int16 (a view)."""
        return a.view(np.int16)

    def widen_bf16(self, a):
        """bfloat16 -> float32, exactly: the pattern in the high half of a float32."""
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    def to_numpy(self, a) -> np.ndarray:
        return np.asarray(a) if self.name == "numpy" else self.xp.asnumpy(a)

    def kernel_array(self, a):
        """What a Numba kernel takes: NumPy as is, CuPy through __cuda_array_interface__."""
        if self.name == "numpy":
            return a
        return _kmeans_module().cuda.as_cuda_array(a, sync=False)


class _Torch:
    """PyTorch CUDA tensors: new tensors on the device of ``like``, from torch's caching
    allocator on torch's current stream."""

    name = "torch"

    @staticmethod
    def _torch():
        import torch

        return torch

    def is_array(self, a) -> bool:
        return type(a).__module__.split(".")[0] == "torch"

    def device(self, a) -> int:
        return int(a.get_device())

    def scope(self, device: int):
        return contextlib.nullcontext()  # every allocation names its device

    def dtype_name(self, a) -> str:
        return str(a.dtype).replace("torch.", "")

    def full(self, like, shape, value, dtype: str):
        torch = self._torch()
        return torch.full(shape, value, dtype=getattr(torch, dtype), device=like.device)

    def arange(self, like, n: int):
        torch = self._torch()
        return torch.arange(n, dtype=torch.int64, device=like.device)

    def from_host(self, like, host: np.ndarray):
        torch = self._torch()
        # Pageable source: CUDA stages it at once, so the copy needs no host sync and the
        # NumPy buffer may go away; ordered on torch's current stream.
        return torch.from_numpy(host).to(like.device, non_blocking=True)

    def astype(self, a, dtype: str):
        return a.to(getattr(self._torch(), dtype), copy=True)

    def clip(self, a, lo, hi):
        return self._torch().clamp(a, lo, hi)

    def maximum(self, a, b):
        torch = self._torch()
        return torch.maximum(a, b) if isinstance(b, torch.Tensor) else torch.clamp(a, min=b)

    def where(self, cond, a, b):
        return self._torch().where(cond, a, b)

    def cumsum(self, a):
        return self._torch().cumsum(a, dim=-1)

    def sort(self, a):
        return self._torch().sort(a, dim=-1).values

    def concatenate(self, arrays):
        return self._torch().cat(list(arrays), dim=0)

    def bits16(self, a):
        return a.view(self._torch().int16)

    def widen_bf16(self, a):
        return a.float()

    def to_numpy(self, a) -> np.ndarray:
        return a.detach().cpu().numpy()

    def kernel_array(self, a):
        # No __cuda_array_interface__ on tensors that require grad: the kernels never need it.
        return _kmeans_module().cuda.as_cuda_array(a.detach(), sync=False)


NUMPY_API = _NumpyLike("numpy")
CUPY_API = _NumpyLike("cupy")
TORCH_API = _Torch()


def _api_of_array(name: str, a):
    """The API of an index array (NumPy, CuPy or torch)."""
    if isinstance(a, np.ndarray):
        return NUMPY_API
    module = type(a).__module__.split(".")[0]
    if module == "torch":
        return TORCH_API
    if module == "cupy":
        return CUPY_API
    raise TypeError(f"`{name}` must hold NumPy arrays, CuPy arrays or torch tensors, "
                    f"got {type(a).__name__}")


def _cache_arrays(function: str, k, v):
    """``(api, k, v)`` for a KV cache: torch CUDA tensors, CuPy arrays, other DLPack GPU
    arrays (taken zero-copy as CuPy) or NumPy arrays (the simulator tests)."""
    if isinstance(k, np.ndarray) and isinstance(v, np.ndarray):
        return NUMPY_API, k, v
    if type(k).__module__.split(".")[0] != "torch":
        require_cupy(function)
    ops_k, ops_v = ops_for("k", k), ops_for("v", v)
    if ops_k is not ops_v and (ops_k in (TORCH, CUPY) or ops_v in (TORCH, CUPY)):
        raise TypeError("`k` and `v` must come from one framework (both PyTorch tensors or both "
                        f"CuPy arrays), got {_tname(k)} and {_tname(v)}")
    if ops_k is TORCH:
        for name, a in (("k", k), ("v", v)):
            if not a.is_cuda:
                raise TypeError(f"`{name}` must be a CUDA tensor, got a tensor on {a.device}")
        return TORCH_API, k, v
    if ops_k is not CUPY:  # other DLPack producers: through CuPy
        k, v = to_cupy("k", k), to_cupy("v", v)
    return CUPY_API, k, v


def _tname(a) -> str:
    return f"{type(a).__module__}.{type(a).__name__}"


class _Meta:
    """Shape and dtype name of an array, for stochattn._validation."""

    __slots__ = ("shape", "ndim", "dtype")

    def __init__(self, shape, dtype_name):
        self.shape = tuple(int(s) for s in shape)
        self.ndim = len(self.shape)
        self.dtype = dtype_name


def _check_cache(api, k, v):
    """Shapes, GPU dtypes and one device; returns ``(B, Hkv, N, D), device``."""
    metas = [_Meta(a.shape, api.dtype_name(a)) for a in (k, v)]
    shape = val.check_kv_inputs(*metas, dtypes=val.GPU_DTYPES)
    device = api.device(k)
    if api.device(v) != device:
        raise ValueError(f"`k` and `v` must be on one GPU, got devices {device} and "
                         f"{api.device(v)}")
    return shape, device


_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _device_lens(api, seq_lens, like, batch: int, tokens: int, check: bool):
    """Sequence lengths as a new int64 (B,) array of ``api`` on ``like``'s device.

    None: ``tokens`` each. Host values: checked against [0, tokens], then copied. GPU
    values: shape, dtype and device checked; values read only when ``check`` (a
    synchronisation), otherwise clamped to [0, tokens] on the device.
    """
    if seq_lens is None:
        return api.full(like, (batch,), tokens, "int64")
    host = seq_lens if api is NUMPY_API else host_values("seq_lens", seq_lens)
    if host is not None:
        host = np.asarray(host)
        val.check_seq_lens(host, batch, tokens)  # host data: checking costs nothing
        return api.from_host(like, np.ascontiguousarray(host, dtype=np.int64))
    if not api.is_array(seq_lens):  # another framework's GPU array: zero-copy through DLPack
        seq_lens = to_cupy("seq_lens", seq_lens)
        if api is TORCH_API:
            import torch

            seq_lens = torch.from_dlpack(seq_lens)
    shape = tuple(int(s) for s in seq_lens.shape)
    if shape != (batch,):
        raise ValueError(f"`seq_lens` must have shape ({batch},), got {shape}")
    dname = api.dtype_name(seq_lens)
    if dname not in _INTS:
        raise TypeError(f"`seq_lens` must have an integer dtype, got {dname}")
    device = api.device(like)
    if api.device(seq_lens) != device:
        raise ValueError(f"`seq_lens` must be on the GPU of `k` ({device}), "
                         f"got device {api.device(seq_lens)}")
    if check:
        val.check_seq_lens(api.to_numpy(seq_lens), batch, tokens)
    return api.clip(api.astype(seq_lens, "int64"), 0, tokens)


# numba.cuda, imported on first use (after stochattn.cuda.kmeans has applied its NumPy
# compatibility fix). A module global, not a local, because Numba's simulator swaps the
# ``cuda`` global of a kernel for its fake module.
cuda = None


def _kmeans_module():
    global cuda
    try:
        from . import kmeans
    except ImportError as e:  # numba-cuda missing
        raise ImportError("the GPU Double-P index needs numba-cuda: install stochattn[cuda13] "
                          "(or stochattn[cuda12])") from e
    cuda = kmeans.cuda
    return kmeans


# ---- build --------------------------------------------------------------------------------


def build_index_gpu(k, v, seq_lens=None, *, n_clusters, iterations=10, n_sink=4, window=64,
                    seed=0, tol=None, check_finite=False) -> dict:
    """Prefill on the GPU: the fields of a :class:`~stochattn.doublep.DoublePIndex`.

    The arguments, their checks and the error messages are those of
    :func:`stochattn.build_doublep_index`, whose GPU path this is; see the module
    docstring for what runs where and what may differ from the reference.

    Parameters
    ----------
    k, v : CuPy array or PyTorch CUDA tensor, shape (B, Hkv, N, D)
        float16, bfloat16 or float32 (bfloat16 is widened to a float32 copy for the
        k-means). NumPy arrays also work (the CPU tests run them under Numba's CUDA
        simulator) and give NumPy fields.
    seq_lens : integer array, shape (B,), optional
        Host (checked) or GPU (clamped to [0, N]; checked when ``check_finite``).
    n_clusters, iterations, n_sink, window, seed, tol, check_finite
        As :func:`stochattn.build_doublep_index` (``tol=None``: k-means' default).

    Returns
    -------
    dict
        Keyword arguments of DoublePIndex: the arrays of the module docstring's table in
        the framework of ``k``, and ``n_sink``, ``window``, ``n_clusters``.
    """
    api, k, v = _cache_arrays("build_doublep_index", k, v)
    (B, Hkv, N, D), device = _check_cache(api, k, v)
    n_clusters, iterations, n_sink, window, seed = val.check_index_options(
        n_clusters, N, iterations, n_sink, window, seed)
    if check_finite:
        val.check_finite(k=k, v=v)
    kmeans = _kmeans_module()
    with api.scope(device):
        lens = _device_lens(api, seq_lens, k, B, N, check=check_finite)
        if api is CUPY_API and api.dtype_name(k) == "bfloat16":
            k, v = api.widen_bf16(k), api.widen_bf16(v)  # Numba has no bfloat16 arrays
        extra = {} if tol is None else dict(tol=tol)
        arrays = kmeans.kmeans_gpu(k, v, lens, n_clusters=n_clusters, iterations=iterations,
                                   n_sink=n_sink, window=window, seed=seed, **extra)
    return dict(arrays, seq_lens=lens, n_sink=n_sink, window=window, n_clusters=n_clusters)


# ---- append -------------------------------------------------------------------------------


def _make_append_kernel(widen, threads):
    """The append kernel for keys/values read through ``widen`` (a device function giving
    the float32 value of one element); ``threads`` is the block size, a power of two.
    Call after :func:`_kmeans_module` (which imports Numba)."""

    @cuda.jit
    def append_kernel(keys, values, new_lens, n_sink, window, Hkv, ws, n_init, centroids, sizes,
                      value_sums, labels):
        p = cuda.blockIdx.x  # one block per (sequence b, KV head h)
        tid = cuda.threadIdx.x
        nthr = cuda.blockDim.x
        b = p // Hkv
        h = p - b * Hkv
        C = centroids.shape[2]
        D = centroids.shape[3]
        N = keys.shape[2]
        if labels.shape[2] < N:
            N = labels.shape[2]
        # Tokens [ws[b], max(n_sink, L' - window)) leave the window; never read past N.
        start = ws[b]
        stop = np.int64(new_lens[b]) - window
        if stop < n_sink:
            stop = n_sink
        if stop > N:
            stop = N
        red_score = cuda.shared.array(threads, dtype=np.float32)
        red_index = cuda.shared.array(threads, dtype=np.int64)
        live = n_init[b, h]  # the same value in every thread, updated identically
        cuda.syncthreads()  # every thread has read n_init before thread 0 may rewrite it
        for t in range(start, stop):
            if live < C:
                # A cluster without a centroid is left: the token seeds it.
                c = live
                for d in range(tid, D, nthr):
                    centroids[b, h, c, d] = widen(keys[b, h, t, d])
                live += 1
            else:
                # Nearest centroid: |c|^2 - 2 k.c per cluster, first minimum per thread
                # (clusters ascending), then a tree reduction that prefers the smaller
                # score and, on equal scores, the lower index: the reference's argmin.
                best = np.int64(-1)
                best_score = np.float32(0.0)
                for cc in range(tid, C, nthr):
                    nrm = np.float32(0.0)
                    dot = np.float32(0.0)
                    for d in range(D):
                        x = centroids[b, h, cc, d]
                        nrm += x * x
                        dot += widen(keys[b, h, t, d]) * x
                    score = nrm - np.float32(2.0) * dot
                    if best < 0 or score < best_score:
                        best = cc
                        best_score = score
                red_score[tid] = best_score
                red_index[tid] = best
                cuda.syncthreads()
                s = nthr // 2
                while s > 0:  # nthr is a power of two
                    if tid < s:
                        other = red_index[tid + s]
                        if other >= 0:
                            mine = red_index[tid]
                            so = red_score[tid + s]
                            sm = red_score[tid]
                            if mine < 0 or so < sm or (so == sm and other < mine):
                                red_index[tid] = other
                                red_score[tid] = so
                    cuda.syncthreads()
                    s //= 2
                c = red_index[0]
            # Statistics in position order: thread d owns coordinate d, thread 0 the counts.
            for d in range(tid, D, nthr):
                value_sums[b, h, c, d] += widen(values[b, h, t, d])
            if tid == 0:
                sizes[b, h, c] += 1
                labels[b, h, t] = c
            # Everyone has read red_index[0], and a seeded centroid is visible to every
            # thread, before the next token.
            cuda.syncthreads()
        if tid == 0:
            n_init[b, h] = live

    return append_kernel


_KERNELS: dict = {}


def _append_kernel(bf16: bool):
    """The append kernel for float16/float32 (``bf16=False``) or bfloat16 bit patterns held
    as int16 (``bf16=True``), built once."""
    kernel = _KERNELS.get(bf16)
    if kernel is None:
        kmeans = _kmeans_module()
        threads = 16 if kmeans._SIM else 256
        if not bf16:
            @cuda.jit(device=True)
            def widen(x):
                return np.float32(x)
        elif kmeans._SIM:
            @cuda.jit(device=True)
            def widen(x):  # simulator: plain NumPy on one int16 scalar
                bits = np.uint32(np.int16(x).view(np.uint16)) << np.uint32(16)
                return np.array([bits], dtype=np.uint32).view(np.float32)[0]
        else:
            from numba.cuda import libdevice

            @cuda.jit(device=True)
            def widen(x):  # the 16 bits become the high half of a float32: exact
                return libdevice.int_as_float(np.int32((np.int32(x) & 0xFFFF) << 16))
        kernel = _KERNELS[bf16] = (_make_append_kernel(widen, threads), threads)
    return kernel


def append_gpu(index, k, v, seq_lens) -> None:
    """:meth:`DoublePIndex.append <stochattn.doublep.DoublePIndex.append>` of a GPU index,
    in place (no host synchronisation; see the module docstring).

    Parameters
    ----------
    index : DoublePIndex
        Built on the GPU (or, in the CPU tests, by :func:`build_index_gpu` on NumPy arrays).
    k, v : arrays of the index's framework and device, shape (B, Hkv, N', D)
        The grown cache (float16, bfloat16 or float32); N' may exceed the index's N.
    seq_lens : integer array, shape (B,), or None
        New lengths (None: N' each). Host values are checked against [0, N']; GPU values
        are clamped to [0, N']. Either way each is raised to at least the index's length.

    Raises
    ------
    TypeError
        ``k`` from another framework than the index, bad dtypes.
    ValueError
        Shapes that do not match the index, ``k`` on another GPU, bad host ``seq_lens``.
    """
    api = _api_of_array("index", index.centroids)
    if api is NUMPY_API and not (isinstance(k, np.ndarray) and isinstance(v, np.ndarray)):
        raise TypeError(f"`k` must be a NumPy array like the index's arrays (an index built from "
                        f"NumPy arrays stays on the host), got {_tname(k)}")
    api_k, k, v = _cache_arrays("DoublePIndex.append", k, v)
    if api_k is not api:
        raise TypeError(f"`k` must be a {_FRAMEWORK[api.name]} like the index's arrays (the index "
                        f"was built from {_FRAMEWORK[api.name]}s), got {_tname(k)}")
    (B, Hkv, N, D), device = _check_cache(api, k, v)
    index._check_cache(B, Hkv, D)
    if api.device(index.centroids) != device:
        raise ValueError(f"`k` must be on the GPU of the index ({api.device(index.centroids)}), "
                         f"got device {device}")
    bf16 = api.dtype_name(k) == "bfloat16"
    with api.scope(device):
        new = _device_lens(api, seq_lens, k, B, N, check=False)
        new = api.maximum(new, index.seq_lens)  # a sequence never shrinks (values not read)
        labels = index.labels
        if N > labels.shape[-1]:  # the cache grew: extend the labels with -1
            grown = api.full(labels, (B, Hkv, N), -1, "int32")
            grown[..., :labels.shape[-1]] = labels
            labels = grown
        if bf16:
            k, v = api.bits16(k), api.bits16(v)
        _launch_append(api, device, index, k, v, new, labels, bf16)
        # New arrays (stream-ordered after the kernel, which read the old window starts).
        window_start = api.maximum(index.window_start,
                                   api.maximum(new - index.window, index.n_sink))
    index.labels, index.window_start, index.seq_lens = labels, window_start, new


def _launch_append(api, device, index, keys, values, new_lens, labels, bf16: bool) -> None:
    """One launch of the append kernel: one block per (sequence, KV head) on the current
    stream of ``api``; ``keys``/``values`` hold bfloat16 bit patterns as int16 when
    ``bf16``. Updates ``index``'s centroids, sizes, value sums and n_initialized and
    ``labels`` (which must cover the cache) in place; reads ``index.window_start``."""
    kernel, threads = _append_kernel(bf16)
    kmeans = _kmeans_module()
    B, Hkv = (int(s) for s in index.centroids.shape[:2])
    launch = (contextlib.nullcontext() if api is NUMPY_API or kmeans._SIM
              else kmeans.cuda.gpus[device])
    with launch:
        stream = kmeans._stream(api.name, device)
        kk, vv, nn, ws, n_init, cent, sizes, sums, lab = (
            api.kernel_array(a) for a in (keys, values, new_lens, index.window_start,
                                          index.n_initialized, index.centroids, index.sizes,
                                          index.value_sums, labels))
        kernel[B * Hkv, threads, stream](kk, vv, nn, np.int64(index.n_sink),
                                         np.int64(index.window), np.int64(Hkv), ws, n_init,
                                         cent, sizes, sums, lab)


_FRAMEWORK = {"numpy": "NumPy array", "cupy": "CuPy array", "torch": "PyTorch CUDA tensor"}


# ---- views of an index ----------------------------------------------------------------------


def csr_gpu(index):
    """Tokens grouped by cluster, on the index's device (no host synchronisation).

    Returns
    -------
    offsets : int64 array, shape (B, Hkv, C + 1)
        Cluster c of (b, kvh) holds ``token_ids[b, kvh, offsets[c]:offsets[c + 1]]``.
    token_ids : int64 array, shape (B, Hkv, N)
        Positions grouped by cluster, ascending inside a cluster, then -1. N is the label
        axis (the reference pads to the longest middle instead, which would need the
        lengths on the host): ``token_ids[..., :M]`` equals the reference's.
    """
    api = _api_of_array("index", index.labels)
    labels, sizes = index.labels, index.sizes
    B, Hkv, C = (int(s) for s in sizes.shape)
    N = int(labels.shape[-1])
    with api.scope(api.device(labels)):
        offsets = api.full(sizes, (B, Hkv, C + 1), 0, "int64")
        offsets[..., 1:] = api.cumsum(sizes)  # prefix sums of the cluster sizes
        lab = api.astype(labels, "int64")
        # Composite keys label * N + position are distinct, so any sort orders the tokens
        # by (cluster, position); unlabelled positions get cluster C and go last.
        keys = api.where(lab >= 0, lab, C) * N + api.arange(labels, N)
        keys = api.sort(keys)
        token_ids = api.where(keys < C * N, keys % N, -1)
    return offsets, token_ids


def value_means_gpu(index):
    """``value_sums / sizes`` (B, Hkv, C, D) float32 on the index's device; 0 for empty
    clusters."""
    api = _api_of_array("index", index.value_sums)
    with api.scope(api.device(index.value_sums)):
        # An empty cluster's value sum is exactly 0 (no member was ever added), so dividing
        # by max(size, 1) gives the 0 of the reference without a select.
        s = api.astype(api.maximum(index.sizes[..., None], 1), "float32")
        return index.value_sums / s


def stack_gpu(indexes) -> dict:
    """The arrays of :meth:`DoublePIndex.stack <stochattn.doublep.DoublePIndex.stack>` for
    GPU indexes (new arrays; labels padded with -1). The caller has checked the types and
    construction parameters.

    Raises
    ------
    TypeError
        Indexes of different frameworks (or host and GPU indexes mixed).
    ValueError
        Indexes on different GPUs.
    """
    apis = [_api_of_array(f"indexes[{i}]", ix.centroids) for i, ix in enumerate(indexes)]
    api = apis[0]
    for i, other in enumerate(apis):
        if other is not api:
            raise TypeError(f"`indexes[{i}]` must hold {_FRAMEWORK[api.name]}s like indexes[0], "
                            f"got {_FRAMEWORK[other.name]}s")
    device = api.device(indexes[0].centroids)
    for i, ix in enumerate(indexes):
        if api.device(ix.centroids) != device:
            raise ValueError(f"`indexes[{i}]` must be on the GPU of indexes[0] ({device}), "
                             f"got device {api.device(ix.centroids)}")
    with api.scope(device):
        N = max(int(ix.labels.shape[-1]) for ix in indexes)
        labels = []
        for ix in indexes:  # pad every label array with -1 (no cluster) to the longest cache
            lab = api.full(ix.labels, tuple(ix.labels.shape[:2]) + (N,), -1, "int32")
            lab[..., :ix.labels.shape[-1]] = ix.labels
            labels.append(lab)
        cat = lambda name: api.concatenate([getattr(ix, name) for ix in indexes])  # noqa: E731
        return dict(centroids=cat("centroids"), sizes=cat("sizes"), value_sums=cat("value_sums"),
                    labels=api.concatenate(labels), seq_lens=cat("seq_lens"),
                    window_start=cat("window_start"), n_initialized=cat("n_initialized"))


def device_label(index) -> str:
    """Where a GPU index lives, for its repr: ``"cupy:0"``, ``"torch:cuda:0"``."""
    api = _api_of_array("index", index.centroids)
    if api is TORCH_API:
        return f"torch:{index.centroids.device}"
    return f"{api.name}:{api.device(index.centroids)}"
