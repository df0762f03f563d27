"""The Double-P index on the GPU: build, append, CSR, value means and stack for CuPy arrays
and PyTorch CUDA tensors; the GPU twin of the index half of :mod:`stochattn.reference.kmeans`.

:class:`stochattn.doublep.DoublePIndex` dispatches here when its arrays (or the cache it is
given) live on a GPU. Every array of a GPU index lives on the device of the cache, in the
caller's framework (CuPy in, CuPy arrays; torch in, torch tensors; any other DLPack GPU
array goes through CuPy and gives CuPy arrays):

=========================  ====================  ============================================
field                      shape                 dtype
=========================  ====================  ============================================
``centroids``              (B, Hkv, C, D)        float32 (the reference: float64)
``sizes``                  (B, Hkv, C)           int64
``value_sums``             (B, Hkv, C, D)        float32 (the reference: float64)
``labels``                 (B, Hkv, N)           int32, -1 outside the middle tokens
``seq_lens``               (B,)                  int64
``window_start``           (B,)                  int64
``n_initialized``          (B, Hkv)              int64
``fingerprint_positions``  (B, S)                int64, -1 for a sequence built empty
``fingerprint_keys``       (B, Hkv, S, D)        float32 (the reference: float64)
``sub_centroids``          (B, Hkv, C, m, D)     float32; ``mass="sub"`` only (else None)
``sub_sizes``              (B, Hkv, C, m)        int32; ``mass="sub"`` only (else None)
=========================  ====================  ============================================

The sub-centroids are computed after the k-means by :mod:`stochattn.cuda.doublep_sub`; an
append adds each token to the nearest sub-centroid of its cluster inside ``doublep_append``.

What runs where, all on the caller's current stream (torch's for tensors, CuPy's for
arrays):

- **Build.** :func:`stochattn.cuda.kmeans.kmeans_gpu` (Numba-CUDA: seeding bit for bit the
  reference's, float32 Lloyd iterations, deterministic statistics) gives every field but
  ``seq_lens``, which is stored as an int64 device copy of the lengths, and the
  fingerprint (:func:`fingerprint_gpu`: the key rows at ``S = FINGERPRINT_ROWS`` token
  positions of each sequence's built prefix, gathered by a few framework operations on the
  device, no synchronisation; see
  :meth:`DoublePIndex.check_keys <stochattn.doublep.DoublePIndex.check_keys>`). A paged cache (a
  GPU :class:`~stochattn.paged.PagedKV`) is first gathered into a contiguous temporary
  (:func:`gather_prefix`: a few framework operations over the page table; it reads the
  longest length, a synchronisation, and allocates the copy, which is freed after the
  build), and the labels are then widened to the cache's ``token_bound`` (so appends never
  grow them). This is prefill time only; the index keeps token positions, never page
  addresses, so it serves the paged cache as is, and pages may move between calls.
- **Append.** Two CUDA C++ kernels (``doublep_append.cu``, CuPy RawKernels: microseconds
  of host time per launch), exactly the reference's ``append_tokens``: the tokens that
  leave the window, in position order, seed the clusters that have no centroid yet
  (centroid = the key, widened exactly to float32), then join the centroid with the
  smallest ``|c|^2 - 2 k.c`` in float32, ties to the lowest cluster index. Seeding never
  depends on a score and a join never moves a centroid, so ``doublep_append_score`` scores
  the first joins of a call (four; a decode step has one) with the centroid scan split
  over about two blocks per SM, and ``doublep_append``, one block per (sequence, KV head),
  seeds, takes those minima, scores any later join of a bulk append itself, updates sizes,
  labels and float32 value sums in position order, and writes the new lengths and window
  starts over the index's own arrays (the first kernel stages each sequence's token range
  in scratch, so no block reads a value the second kernel rewrites). The index's arrays
  keep their addresses, the scratch (:func:`append_scratch_bytes`) comes from a workspace
  the index keeps, and the lengths come from the page table (paged), a GPU array read by
  pointer, or N: such an append allocates nothing and does not synchronise, so an engine
  captures it in a CUDA graph with its decode step. A paged cache is read in place (K and
  V rows through the page table, any page size 1 to 128, NHD or HND). One score code serves both kernels, so appending one token at a
  time gives the same index, bit for bit, as one bulk append, and each value sum is the
  sequential float32 sum of its members in position order (build and appends alike). Cost
  per joining token: the ``C * D`` float32 centroids of its (sequence, KV head) read once
  (9 us at batch 1, 32k, C 2048; 110 us at batch 8, 128k, C 8192 on an H200; until
  2026-12-03 a Numba-CUDA kernel took 150-590 us there, plus 0.6 ms of host time per
  launch).
- **CSR** (:func:`csr_gpu`). Offsets are the prefix sums of the sizes; token ids come from
  one sort of the composite keys ``label * N + position`` (sinks, window and padding get
  label C and sort last), which orders tokens by cluster and by position inside a cluster
  without relying on a stable sort.
- **Value means, stack.** Array operations of the framework.
- **Fingerprint check** (:func:`fingerprint_rows_gpu`, only with ``check_finite=True`` at
  decode, or an explicit ``index.check_keys(k)``): the cache's rows at the fingerprint
  positions gathered on the device (through the page table for a paged cache) and copied
  to the host with the recorded rows: a few small allocations and a synchronisation. The
  append never touches the fingerprint (a token's key never changes).

Host synchronisations: at build time, one event wait per k-means round (the early stop:
see :mod:`stochattn.cuda.kmeans`) and, for a paged cache, the read of the longest length;
otherwise none on these paths, except
``check_finite=True`` (reads k, v and GPU ``seq_lens``; at decode also the fingerprint
rows) and ``repr`` (prints the lengths). One caveat at build time:
``kmeans_gpu`` takes its scratch buffers from Numba's allocator (``cuMemAlloc``, freed
later by ``cuMemFree``), which is not stream-ordered and may serialise with the device; the
append allocates only through the framework, and only where its docstring says
(:func:`append_gpu`: a first append sizing the workspace, labels that must grow, host or
odd-dtype ``seq_lens``). Host ``seq_lens`` (NumPy, list, CPU tensor)
are checked on the host and copied to the device; GPU ``seq_lens`` have their
shape, dtype and device checked, and their values are not read: they are clamped to
``[0, N]`` on the device (a paged cache's lengths: the page table's, read by the append
kernels), and at an append also to at least the index's lengths (a
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
from .._backend import host_ints, require_cupy
from .runtime.arrays import CUPY, TORCH, ArrayMeta, host_values, launch_stream, ops_for, to_cupy
from .runtime.inputs import device_scope
from .runtime.pages import CONTIGUOUS

__all__ = ["build_index_gpu", "append_gpu", "append_scratch_bytes", "gather_prefix", "csr_gpu",
           "value_means_gpu", "stack_gpu", "device_label", "fingerprint_gpu",
           "fingerprint_rows_gpu"]


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

    def widen_bf16(self, a):
        """bfloat16 -> float32, exactly: the pattern in the high half of a float32."""
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    def to_numpy(self, a) -> np.ndarray:
        return np.asarray(a) if self.name == "numpy" else self.xp.asnumpy(a)


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

    def widen_bf16(self, a):
        return a.float()

    def to_numpy(self, a) -> np.ndarray:
        return a.detach().cpu().numpy()


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


def _check_cache(api, k, v):
    """Shapes, GPU dtypes and one device; returns ``(B, Hkv, N, D), device``."""
    metas = [ArrayMeta(a.shape, api.dtype_name(a)) for a in (k, v)]
    shape = val.check_kv_inputs(*metas, dtypes=val.GPU_DTYPES)
    device = api.device(k)
    if api.device(v) != device:
        raise ValueError(f"`k` and `v` must be on one GPU, got devices {device} and "
                         f"{api.device(v)}")
    return shape, device


_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _gpu_lens(api, seq_lens, like, batch: int):
    """GPU ``seq_lens`` in ``api``'s framework (another framework's array zero-copy through
    DLPack) with its shape (batch,), integer dtype and device (``like``'s) checked;
    attributes only."""
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
    return seq_lens


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
    seq_lens = _gpu_lens(api, seq_lens, like, batch)
    if check:
        val.check_seq_lens(api.to_numpy(seq_lens), batch, tokens)
    return api.clip(api.astype(seq_lens, "int64"), 0, tokens)


def _kmeans_module():
    """The k-means host module (importing it imports no Numba: a build of CuPy arrays whose
    kernels have raw entries never does; see stochattn.cuda.kmeans.raw)."""
    try:
        from .kmeans import host as kmeans
    except ImportError as e:  # numba-cuda missing
        raise ImportError("the GPU Double-P index needs numba-cuda: install stochattn[cuda13] "
                          "(or stochattn[cuda12])") from e
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
    bound = None
    if _is_paged(k):  # a paged prefix: a contiguous temporary copy (see gather_prefix)
        if v is not None or seq_lens is not None:
            raise TypeError("with a paged cache (`k` a PagedKV) pass no `v` and no `seq_lens`: "
                            "the page table holds the values and the lengths")
        k, v, seq_lens, bound = gather_prefix(k)
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
        if bound is not None and bound > int(arrays["labels"].shape[-1]):
            # Labels over the paged cache's whole token_bound: appends (and a CUDA graph
            # that captures them) never grow them.
            arrays = dict(arrays, labels=_grown_labels(api, arrays["labels"], bound))
        arrays = dict(arrays, **fingerprint_gpu(api, k, lens))
    return dict(arrays, seq_lens=lens, n_sink=n_sink, window=window, n_clusters=n_clusters)


# ---- append -------------------------------------------------------------------------------


_APPEND_THREADS = 1024  # doublep_append: 32 warps (the bulk path scores with them)
_SCORE_THREADS = 256  # doublep_append_score
_APPEND_LAUNCHERS: dict = {}  # (device, dtype name) -> (score, append launchers, SMs)


def _fast_tokens() -> int:
    """Joins per append that the split kernel scores (doublep_append.cu: kFastTokens)."""
    from .kernels import abi

    return abi.constant("doublep_append", "kFastTokens")


def _append_launchers(device: int, dtype_name: str):
    """The compiled append kernels for keys of ``dtype_name`` on ``device`` (current), and
    its SM count."""
    kernels = _APPEND_LAUNCHERS.get((device, dtype_name))
    if kernels is None:
        from .kernels import APPEND_CTYPES, abi
        from .runtime import launch

        ctype = APPEND_CTYPES[dtype_name]
        score, append = (abi.kernel("doublep_append", n)
                         for n in ("doublep_append_score", "doublep_append"))
        kernels = _APPEND_LAUNCHERS[(device, dtype_name)] = (
            (score, launch.launcher("doublep_append", score.expr(T=ctype))),
            (append, launch.launcher("doublep_append", append.expr(T=ctype))),
            launch.num_sms())
    return kernels


def append_scratch_bytes(batch: int, kv_heads: int, clusters: int,
                         device: int | None = None) -> int:
    """Bytes of scratch one append of an index of ``batch`` sequences, ``kv_heads`` KV heads
    and ``clusters`` clusters takes on ``device`` (default: the current one): the token
    ranges ``align(32 B)`` plus the partial minima ``align(8 B Hkv kFastTokens S)`` with
    ``S = max(1, min(ceil(2 SMs / (B Hkv)), ceil(C / 64)))`` (each piece rounded up to 256
    bytes). Needs CuPy (the SM count)."""
    from .runtime import launch

    with device_scope(_current_device() if device is None else device):
        return _append_layout(batch, kv_heads, clusters, launch.num_sms())[2]


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def _append_layout(B: int, Hkv: int, C: int, sms: int):
    """``(S, offsets, total bytes)`` of one append's scratch: staging (B, 4) int64, then the
    partial minima (B Hkv, kFastTokens, S) uint64."""
    from .runtime import launch

    # Split the centroid scan over enough blocks for two per SM, 64+ centroids each.
    S = max(1, min(-(-2 * sms // (B * Hkv)), -(-C // 64)))
    offsets, total = launch.layout((32 * B, 8 * B * Hkv * _fast_tokens() * S))
    return S, offsets, total


def append_gpu(index, k, v, seq_lens, workspace=None) -> None:
    """:meth:`DoublePIndex.append <stochattn.doublep.DoublePIndex.append>` of a GPU index,
    in place (see the module docstring).

    The index's arrays keep their addresses (lengths and window starts are rewritten in
    place by the kernels), and a call allocates nothing, copies nothing to the host and
    does not synchronise when: its scratch comes from a kept :class:`Workspace` that is
    large enough (the index's own, warmed by an earlier append, or ``workspace``), the
    labels already span the cache's N (a paged index is built with labels over the cache's
    ``token_bound``; a contiguous cache that grew past them is extended once, allocating),
    and ``seq_lens`` is None, a paged cache's table, or a contiguous int32/int64 GPU array.
    So an append can be captured in a CUDA graph with the decode after it (warm it up
    eagerly first). Host ``seq_lens`` are checked and copied to the device (an allocation
    and a host-to-device copy per call).

    Parameters
    ----------
    index : DoublePIndex
        Built on the GPU (CuPy arrays or torch CUDA tensors).
    k, v : arrays of the index's framework and device, shape (B, Hkv, N', D)
        The grown cache (float16, bfloat16 or float32); N' may exceed the index's N. Or
        ``k`` a GPU :class:`~stochattn.paged.PagedKV` (then ``v`` and ``seq_lens`` None):
        the pages are read in place, the new lengths come from the page table (read on the
        device), and N' is its ``token_bound``.
    seq_lens : integer array, shape (B,), or None
        New lengths (None: N' each). Host values are checked against [0, N']; GPU values
        are clamped to [0, N'] on the device. Either way each is raised to at least the
        index's length.
    workspace : None, Workspace or 1-D uint8 GPU array
        Scratch (:func:`append_scratch_bytes` bytes): None takes the index's own kept
        workspace.

    Raises
    ------
    TypeError
        An index of NumPy arrays (the simulator's: :meth:`DoublePIndex.append` runs the
        reference on those), ``k`` from another framework than the index, bad dtypes
        (int64 page tables: FlashInfer's int32 is required).
    ValueError
        Shapes that do not match the index, ``k`` on another GPU, bad host ``seq_lens``, a
        page size outside [1, 128], a workspace too small.
    """
    api = _api_of_array("index", index.centroids)
    paged = _is_paged(k)
    if api is NUMPY_API:
        if not paged and not (isinstance(k, np.ndarray) and isinstance(v, np.ndarray)):
            raise TypeError(f"`k` must be a NumPy array like the index's arrays (an index built "
                            f"from NumPy arrays stays on the host), got {_tname(k)}")
        raise TypeError("`index` must hold GPU arrays to append on the GPU, got NumPy arrays "
                        "(DoublePIndex.append runs the reference on a host index)")
    if paged:
        if v is not None or seq_lens is not None:
            raise TypeError("with a paged cache (`k` a PagedKV) pass no `v` and no `seq_lens`: "
                            "the page table holds the values and the lengths")
        cache = _paged_cache(api, k, index)
        (B, Hkv, N, D), device, dtype = cache.shape, cache.device, cache.dtype
        kpool, vpool = cache.k, cache.v
        st = (0, 0, 0)
        pa = cache.page_args
        lens_ptr, lens64, keep = 0, 0, None
    else:
        api_k, k, v = _cache_arrays("DoublePIndex.append", k, v)
        if api_k is not api:
            raise TypeError(f"`k` must be a {_FRAMEWORK[api.name]} like the index's arrays (the "
                            f"index was built from {_FRAMEWORK[api.name]}s), got {_tname(k)}")
        (B, Hkv, N, D), device = _check_cache(api, k, v)
        index._check_cache(B, Hkv, D)
        if api.device(index.centroids) != device:
            raise ValueError(f"`k` must be on the GPU of the index "
                             f"({api.device(index.centroids)}), got device {device}")
        dtype = api.dtype_name(k)
        kpool, vpool = _same_rows(ops_for("k", k), k, v)
        st = _element_strides(ops_for("k", k), kpool)
        pa = CONTIGUOUS
    ops = ops_for("index", index.seq_lens)
    p = ops.ptr
    with api.scope(device), device_scope(device):
        if not paged:
            lens_ptr, lens64, keep = _append_lens(api, ops, seq_lens, index.seq_lens, B, N)
        labels = index.labels
        if N > labels.shape[-1]:  # the cache grew: extend the labels with -1 (allocates)
            labels = _grown_labels(api, labels, N)
        C = int(index.centroids.shape[2])
        (score_k, score), (append_k, append), sms = _append_launchers(device, dtype)
        S, offsets, nbytes = _append_layout(B, Hkv, C, sms)
        from .runtime.workspace import scratch

        if workspace is None:
            workspace = _index_workspace(index)
        base, _keep_scratch = scratch(ops, index.seq_lens, nbytes, workspace, device)
        staging, partial = (base + o for o in offsets)
        pages = dict(zip(_PAGE_NAMES, pa))
        common = dict(keys=p(kpool), sb=st[0], sh=st[1], st=st[2], partial=partial,
                      staging=staging, Hkv=Hkv, C=C, D=D, NL=labels.shape[-1], **pages)
        stream = launch_stream(ops, device)
        score.smem = append.smem = 4 * D  # one key, widened
        score((B * Hkv, S), (_SCORE_THREADS,),
              score_k.args_of(n_cache=N, new_lens=lens_ptr, lens64=lens64,
                              old_lens=p(index.seq_lens), window_start=p(index.window_start),
                              n_init=p(index.n_initialized), centroids=p(index.centroids),
                              n_sink=index.n_sink, window=index.window, **common), stream)
        sub = index.sub_centroids is not None  # mass="sub": the nearest sub-centroid too
        append((B * Hkv,), (_APPEND_THREADS,),
               append_k.args_of(values=p(vpool), lens=p(index.seq_lens),
                                window_start=p(index.window_start), n_init=p(index.n_initialized),
                                centroids=p(index.centroids), sizes=p(index.sizes),
                                value_sums=p(index.value_sums), labels=p(labels), S=S,
                                sub_centroids=p(index.sub_centroids) if sub else 0,
                                sub_sizes=p(index.sub_sizes) if sub else 0,
                                n_sub=int(index.sub_sizes.shape[-1]) if sub else 0, **common),
               stream)
        del keep  # the lengths' device copy: freed stream-ordered after the kernels
    index.labels = labels


_PAGE_NAMES = ("kv_indptr", "kv_indices", "kv_last_page_len", "page_size", "page_stride",
               "row_stride", "head_stride")


def _index_workspace(index):
    """The append scratch an index keeps (a :class:`Workspace`, made on first use)."""
    ws = getattr(index, "_append_workspace", None)
    if ws is None:
        from .runtime.workspace import Workspace

        ws = Workspace()
        object.__setattr__(index, "_append_workspace", ws)
    return ws


def _grown_labels(api, labels, N: int):
    grown = api.full(labels, tuple(labels.shape[:2]) + (N,), -1, "int32")
    grown[..., :labels.shape[-1]] = labels
    return grown


def _append_lens(api, ops, seq_lens, like, B: int, N: int):
    """``(pointer, 1 for int64 else 0, keep_alive)`` of the requested lengths of a
    contiguous append: None gives the null pointer (N each); an int32 or int64 contiguous
    GPU array of the index's framework and device goes by pointer (clamped to [0, N] by the
    kernel, not read here); host values are checked and copied (an allocation); any other
    GPU integer array is converted (an allocation)."""
    if seq_lens is None:
        return 0, 0, None
    host = host_values("seq_lens", seq_lens)
    if host is not None:
        host = np.asarray(host)
        val.check_seq_lens(host, B, N)  # host data: checking costs nothing
        dev = api.from_host(like, np.ascontiguousarray(host, dtype=np.int64))
        return ops.ptr(dev), 1, dev
    seq_lens = _gpu_lens(api, seq_lens, like, B)
    dname = api.dtype_name(seq_lens)
    contiguous = seq_lens.is_contiguous() if api is TORCH_API else seq_lens.flags.c_contiguous
    if dname not in ("int32", "int64") or not contiguous:
        seq_lens = api.astype(seq_lens, "int64")
        dname = "int64"
    return ops.ptr(seq_lens), int(dname == "int64"), seq_lens


def _is_paged(k) -> bool:
    return type(k).__name__ == "PagedKV" and type(k).__module__ == "stochattn.paged"


class _PagedCache:
    """A GPU PagedKV as the index kernels read it: the pools in the index's framework,
    the virtual shape (B, Hkv, N = token_bound, D), the device, the dtype name and the
    seven page-table arguments (runtime/pages.py's PageArgs)."""

    __slots__ = ("k", "v", "tables", "shape", "device", "dtype", "page_args", "cache")


def _paged_cache(api, cache, index=None) -> _PagedCache:
    """Check a GPU :class:`~stochattn.paged.PagedKV` for the index kernels (attributes
    only, nothing read): pools of the index's framework (or CuPy / torch for a build), one
    device, float16 / bfloat16 (float32 too for a build), shared strides with D
    contiguous; int32 contiguous page tables on that device; page sizes 1 to 128; for an
    append, the index's batch, heads and head dim."""
    from .runtime.pages import MAX_PAGE_SIZE, PageArgs, _framework_array, _strides

    if cache.device != "cuda":
        raise TypeError("a paged cache of NumPy arrays runs on the reference; the GPU index "
                        "needs GPU pages")
    ops = TORCH if api is TORCH_API else (CUPY if api is CUPY_API else ops_for("k_pages",
                                                                              cache.k_pages))
    if ops is not TORCH and ops is not CUPY:
        ops = CUPY
    k, v = (_framework_array(ops, n, getattr(cache, n)) for n in ("k_pages", "v_pages"))
    if index is not None and _api_of_array("k_pages", k) is not api:
        raise TypeError(f"`k_pages` must be a {_FRAMEWORK[api.name]} like the index's arrays, "
                        f"got {_tname(cache.k_pages)}")
    kapi = _api_of_array("k_pages", k)
    dtype = kapi.dtype_name(k)
    if dtype not in ("float16", "bfloat16") and index is not None:
        raise TypeError(f"`k_pages` must be float16 or bfloat16 to append on the GPU (a "
                        f"float32 cache appends from contiguous arrays), got {dtype}")
    if dtype not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"`k_pages` must be float16, bfloat16 or float32 on the GPU, got {dtype}")
    device = kapi.device(k)
    if kapi.device(v) != device:
        raise ValueError(f"`k_pages` and `v_pages` must be on one GPU, got devices {device} and "
                         f"{kapi.device(v)}")
    ks, vs = _strides(ops, k), _strides(ops, v)
    if ks != vs:
        raise ValueError(f"`k_pages` and `v_pages` must share their strides (elements), got {ks} "
                         f"and {vs}")
    P = cache.page_size
    if not 1 <= P <= MAX_PAGE_SIZE:
        raise ValueError(f"`page_size` must be in [1, {MAX_PAGE_SIZE}] on the GPU, got {P}")
    page_stride, a1, a2, last = ks
    row_stride, head_stride = (a1, a2) if cache.layout == "NHD" else (a2, a1)
    if last != 1:
        raise ValueError(f"the page pools must hold each row's features contiguously, got "
                         f"strides {ks}")
    tables = [_framework_array(ops, n, getattr(cache, n))
              for n in ("kv_indptr", "kv_indices", "kv_last_page_len")]
    for name, a in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), tables):
        tdtype, _, tdev = ops.meta(a)
        if ops.dtype_name(tdtype) != "int32":
            raise TypeError(f"`{name}` must be int32 on the GPU (FlashInfer's dtype), got "
                            f"{ops.dtype_name(tdtype)}")
        if tdev != device:
            raise ValueError(f"`{name}` must be on the GPU of the pages ({device}), got device "
                             f"{tdev}")
        contiguous = a.is_contiguous() if ops is TORCH else a.flags.c_contiguous
        if not contiguous:
            raise ValueError(f"`{name}` must be contiguous")
    B, H, D, N = cache.batch, cache.kv_heads, cache.head_dim, cache.token_bound
    if N >= 2**31:
        raise ValueError(f"`max_tokens` must be below 2**31, got {N}")
    if index is not None:
        index._check_cache(B, H, D)
        if api.device(index.centroids) != device:
            raise ValueError(f"`k_pages` must be on the GPU of the index "
                             f"({api.device(index.centroids)}), got device {device}")
    out = _PagedCache()
    out.k, out.v, out.tables, out.cache = k, v, tables, cache
    out.shape, out.device, out.dtype = (B, H, N, D), device, dtype
    out.page_args = PageArgs(*(np.uint64(ops.ptr(a)) for a in tables), np.int32(P),
                             np.int64(page_stride), np.int32(row_stride), np.int32(head_stride))
    return out


def gather_prefix(cache):
    """``(k, v, seq_lens, N)`` of a GPU paged cache for an index build: contiguous
    ``(B, Hkv, Ng, D)`` copies of its tokens (zero past each length) with ``Ng =
    max(longest sequence, 1)``, the lengths (int64, on the device) and the cache's
    ``token_bound`` N. Prefill-time only: it reads the longest length (a synchronisation)
    and allocates the copies and index arrays (a few framework operations: no kernel of
    its own). The index keeps token positions, never addresses, so the built index serves
    the paged cache as is."""
    c = _paged_cache(None, cache)
    kapi = _api_of_array("k_pages", c.k)
    indptr, indices, _ = c.tables
    B, H, N, D = c.shape
    P = cache.page_size
    with kapi.scope(c.device):
        indptr64 = kapi.astype(indptr, "int64")
        count = indptr64[1:] - indptr64[:-1]  # pages per sequence
        lens = kapi.where(count > 0, (count - 1) * P + kapi.astype(c.tables[2], "int64"),
                          kapi.full(count, (B,), 0, "int64"))
        Ng = max(int(kapi.to_numpy(lens).max()) if B else 0, 1)  # synchronises
        nnz = int(indices.shape[0])
        if nnz == 0:
            k = kapi.full(c.k, (B, H, Ng, D), 0, c.dtype)
            return k, kapi.full(c.k, (B, H, Ng, D), 0, c.dtype), lens, N
        t = kapi.arange(lens, Ng)  # int64
        start = indptr64[:-1]
        slot = kapi.clip(start[:, None] + t[None, :] // P, 0, nnz - 1)
        valid = t[None, :] < lens[:, None]
        page = kapi.astype(indices, "int64")[slot]  # (B, Ng)
        inner = t % P
        out = []
        for pool in (c.k, c.v):
            # (num_pages, page_size, Hkv, D) in both layouts (an HND pool: a strided view)
            nhd = pool if cache.layout == "NHD" else (
                pool.transpose(1, 2) if kapi is TORCH_API else pool.transpose(0, 2, 1, 3))
            rows = nhd[page, inner[None, :]]  # (B, Ng, Hkv, D)
            rows = kapi.where(valid[:, :, None, None], rows,
                              kapi.full(rows, (), 0, c.dtype))
            rows = rows.permute(0, 2, 1, 3) if kapi is TORCH_API else rows.transpose(0, 2, 1, 3)
            out.append(rows.contiguous() if kapi is TORCH_API else kapi.xp.ascontiguousarray(rows))
    return out[0], out[1], lens, N


def _element_strides(ops, a):
    """Strides of the batch, head and token axes of a (B, Hkv, N, D) array, in elements."""
    if ops.name == "torch":
        return a.stride()[:3]
    return tuple(s // a.itemsize for s in a.strides[:3])


def _same_rows(ops, k, v):
    """k and v with unit stride along D and the same strides (the append kernel's layout;
    a KV cache has it already): contiguous copies otherwise."""
    sk, sv = _element_strides(ops, k), _element_strides(ops, v)
    unit = lambda a: (a.stride()[3] if ops.name == "torch" else a.strides[3] // a.itemsize) == 1  # noqa: E731
    if sk == sv and unit(k) and unit(v):
        return k, v
    if ops.name == "torch":
        return k.contiguous(), v.contiguous()
    import cupy

    return cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)


_FRAMEWORK = {"numpy": "NumPy array", "cupy": "CuPy array", "torch": "PyTorch CUDA tensor"}


# ---- the fingerprint ------------------------------------------------------------------------


def fingerprint_gpu(api, k, lens) -> dict:
    """The fingerprint fields of an index built from ``k`` (B, Hkv, N, D; ``api``'s
    framework, float16 / bfloat16 / float32) at the device lengths ``lens`` (int64, in
    [0, N]): ``fingerprint_positions`` (B, S) int64, the host rule of
    :func:`stochattn.doublep._fingerprint_positions` computed on the device, and
    ``fingerprint_keys`` (B, Hkv, S, D) float32, exact copies of the key rows there (0 where
    the position is -1). A few framework operations on the caller's stream; no
    synchronisation."""
    from ..doublep import FINGERPRINT_ROWS as S

    B = int(k.shape[0])
    last = api.maximum(lens - 1, 0)  # (B,) int64
    positions = api.arange(lens, S)[None, :] * last[:, None] // (S - 1)  # (B, S)
    built = lens[:, None] > 0
    positions = api.where(built, positions, api.full(positions, (B, S), -1, "int64"))
    rows = _rows_at(api, k, api.maximum(positions, 0))  # (B, Hkv, S, D) float32
    rows = api.where(built[:, None, :, None], rows, api.full(rows, (), 0, "float32"))
    return dict(fingerprint_positions=positions, fingerprint_keys=_contiguous(api, rows))


def _rows_at(api, k, t):
    """``k[b, :, t[b, s]]`` as float32 (B, Hkv, S, D) for a (B, Hkv, N, D) array and device
    positions ``t`` (B, S) int64 in [0, N): one gather, bfloat16 widened exactly."""
    b = api.arange(t, int(k.shape[0]))[:, None]
    dtype = api.dtype_name(k)
    rows = _tokens_first(api, _bits(api, k))[b, t]  # (B, S, Hkv, D)
    return _swap12(api, _as_float32(api, rows, dtype))


def _tokens_first(api, a):
    """A view of a (X, H, T, D) array with axes 1 and 2 swapped: (X, T, H, D)."""
    return a.transpose(1, 2) if api is TORCH_API else a.transpose(0, 2, 1, 3)


_swap12 = _tokens_first  # the same swap, the other way


def _bits(api, a):
    """A bfloat16 NumPy / CuPy array as its uint16 patterns (a view: CuPy's indexing may
    lack the dtype); anything else as it is."""
    if api is not TORCH_API and api.dtype_name(a) == "bfloat16":
        return a.view(np.uint16)
    return a


def _as_float32(api, a, dtype: str):
    """Gathered rows of a ``dtype`` cache (float16, bfloat16 as :func:`_bits`, float32) as
    float32, exactly (a copy)."""
    if dtype == "bfloat16":
        return api.widen_bf16(a)
    return api.astype(a, "float32")


def _contiguous(api, a):
    if api is TORCH_API:
        return a.contiguous()
    return api.xp.ascontiguousarray(a)


def _key_api(name: str, a):
    """``(api, a)`` for a key array or page pool: NumPy (the CPU tests), torch, CuPy, or
    another DLPack GPU array taken zero-copy as CuPy."""
    if isinstance(a, np.ndarray):
        return NUMPY_API, a
    if type(a).__module__.split(".")[0] == "torch":
        return TORCH_API, a
    require_cupy("DoublePIndex.check_keys")
    if type(a).__module__.split(".")[0] != "cupy":
        a = to_cupy(name, a)
    return CUPY_API, a


def fingerprint_rows_gpu(index, k):
    """What :meth:`DoublePIndex.check_keys <stochattn.doublep.DoublePIndex.check_keys>`
    compares, for a GPU index, as host arrays: ``(positions (B, S), recorded (B, Hkv, S, D)
    float32, rows (B, Hkv, S, D) float32, available (B,))``, where ``rows`` are the keys of
    the cache ``k`` at the index's fingerprint positions and ``available`` the tokens each
    sequence of ``k`` holds (N for an array, the page table's lengths for a paged cache).

    The rows are gathered on the device in the cache's framework (a paged cache through
    its page table, any layout and page size) and copied to the host, with the recorded
    rows and the positions: small allocations and a synchronisation (the check path of
    ``check_finite=True``, never the default decode path). The comparison itself is the
    host's :func:`stochattn.doublep._compare_fingerprint`, one rule for both backends.

    Raises
    ------
    ValueError
        A cache whose (batch, kv_heads, head_dim) is not the index's.
    """
    iapi = _api_of_array("index", index.fingerprint_positions)
    positions = iapi.to_numpy(index.fingerprint_positions).astype(np.int64)  # synchronises
    recorded = iapi.to_numpy(index.fingerprint_keys)
    if _is_paged(k):
        rows, available = _paged_rows(index, k, positions)
    else:
        kapi, k = _key_api("k", k)
        if len(k.shape) != 4:
            raise ValueError(f"`k` must have 4 dimensions (batch, kv_heads, tokens, head_dim), "
                             f"got shape {tuple(int(s) for s in k.shape)}")
        B, Hkv, N, D = (int(s) for s in k.shape)
        index.check_cache(B, Hkv, D)
        with kapi.scope(kapi.device(k)):
            t = kapi.from_host(k, np.clip(positions, 0, N - 1))
            rows = kapi.to_numpy(_rows_at(kapi, k, t))
        available = np.full(B, N, dtype=np.int64)
    return positions, recorded, rows, available


def _paged_rows(index, cache, positions):
    """``(rows (B, Hkv, S, D) float32 on the host, lengths (B,))`` of a paged cache at the
    fingerprint positions: token t of sequence b is page ``kv_indices[kv_indptr[b] + t //
    P]``, slot ``t % P`` (positions past a sequence's length are clamped to its last token
    and reported by the comparison)."""
    B, Hkv, D, P = cache.batch, cache.kv_heads, cache.head_dim, cache.page_size
    index.check_cache(B, Hkv, D)
    kapi, pool = _key_api("k_pages", cache.k_pages)
    _, indices = _key_api("kv_indices", cache.kv_indices)
    indptr = host_ints(cache.kv_indptr)  # (B + 1,) and (B,): small, read on the host
    lens = host_ints(cache.seq_lens)
    nnz = int(indices.shape[0])
    S = positions.shape[1]
    if nnz == 0:  # no sequence holds a token
        return np.zeros((B, Hkv, S, D), dtype=np.float32), np.zeros(B, dtype=np.int64)
    t = np.clip(positions, 0, np.maximum(lens - 1, 0)[:, None])
    slot = np.clip(indptr[:-1, None] + t // P, 0, nnz - 1)
    with kapi.scope(kapi.device(pool)):
        page = kapi.astype(indices, "int64")[kapi.from_host(pool, slot)]  # (B, S)
        inner = kapi.from_host(pool, t % P)
        dtype = kapi.dtype_name(pool)
        pool = _bits(kapi, pool)
        nhd = pool if cache.layout == "NHD" else _tokens_first(kapi, pool)
        rows = _swap12(kapi, _as_float32(kapi, nhd[page, inner], dtype))  # (B, Hkv, S, D)
        return kapi.to_numpy(rows), lens


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
        from ..doublep import _stacked_fingerprints, _stacked_sub

        return dict(centroids=cat("centroids"), sizes=cat("sizes"), value_sums=cat("value_sums"),
                    labels=api.concatenate(labels), seq_lens=cat("seq_lens"),
                    window_start=cat("window_start"), n_initialized=cat("n_initialized"),
                    **_stacked_fingerprints(indexes, cat), **_stacked_sub(indexes, cat))


def device_label(index) -> str:
    """Where a GPU index lives, for its repr: ``"cupy:0"``, ``"torch:cuda:0"``."""
    api = _api_of_array("index", index.centroids)
    if api is TORCH_API:
        return f"torch:{index.centroids.device}"
    return f"{api.name}:{api.device(index.centroids)}"
