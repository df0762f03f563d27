"""The Numba-free backend of a k-means build plan (:class:`RawOps`): the kernels' raw entries
(:mod:`.raw`) loaded as CuPy modules and launched through ``cuLaunchKernel`` with the
arguments Numba would pass (:class:`RawBound`, the twin of :class:`.launch.Bound`), CuPy
buffers, events and pinned memory. Used for CuPy inputs only; :func:`ops_for` answers None
(the Numba path) whenever anything it needs is missing."""

from __future__ import annotations

import os
import threading
import types

import numpy as np

from . import raw as _raw
from .launch import array_layout

__all__ = ["RawBound", "RawOps", "ops_for", "KERNELS", "counts"]

#: The kernels a plan launches (attributes of a raw plan's kernel namespace).
KERNELS = ("zero_scratch", "prepare", "seed_keys", "seed_scan", "seed_fill", "seed_rank",
           "centre", "keys_half", "seed_centroids", "assign_scan", "assign_gemm", "scan_fill",
           "fill", "rank", "mean", "stats")
#: The module constants a plan reads (its launch geometry).
CONSTANTS = ("SIM", "TPB", "SCAN_TPB", "DIM_TPB", "LANES", "ROW_TILE", "TILES_PER_BLOCK",
             "KH_ROWS", "KH_TPB", "KH_SHARED", "VEC")

_lock = threading.Lock()
_functions: dict = {}  # (device, cubin path, entry) -> (RawModule, RawKernel, function pointer)
_ops: dict = {}  # device -> RawOps
_LOCAL = threading.local()
#: Launches prepared from raw entries and raw plans built in this process (tests, tools).
_counts = {"launches": 0, "plans": 0}


def counts() -> dict:
    """``{"launches": raw launches prepared, "plans": raw plans built}`` in this process."""
    return dict(_counts)


def _bits(x) -> int:
    return int(np.asarray(x).view(np.uint32 if x.nbytes == 4 else np.uint64))


class RawBound:
    """A kernel launch with its flattened arguments packed once (8-byte slots, each value
    in the low bytes, as :class:`stochattn.cuda.runtime.launch.Packed`), launched by
    ``launch(fptr, grid, block, 0, stream pointer, params, 0)`` (``cuLaunchKernel``).

    ``signature``: the kernel's (:func:`.raw.signature_of` of ``args``); ``mutable`` and
    ``rebind``: as :class:`.launch.Bound` (integer scalars replaced by :meth:`set` or a call's
    value; arrays whose data pointer :meth:`rebind` replaces).
    """

    __slots__ = ("_fptr", "_grid", "_block", "_stream", "_launch", "_vals", "_ptrs",
                 "_params", "_mut", "_at", "_layouts")

    def __init__(self, fptr: int, grid, block, stream_ptr: int, signature, args, mutable=(),
                 rebind=(), launch=None):
        values, first = _raw.flatten(signature, args)
        self._vals = np.zeros(max(1, len(values)), dtype=np.uint64)
        for j, x in enumerate(values):
            self._vals[j] = _bits(x)
        base = self._vals.ctypes.data
        self._ptrs = np.array([base + 8 * j for j in range(len(self._vals))], dtype=np.uint64)
        self._params = int(self._ptrs.ctypes.data)
        self._mut = {}
        for i in mutable:
            if signature[i][0] != "scalar" or np.dtype(signature[i][1]).kind not in "iu":
                raise ValueError(f"`mutable` position {i} must be an integer scalar argument, "
                                 f"got {signature[i]}")
            self._mut[i] = (first[i], np.dtype(signature[i][1]).type)
        self._layouts, self._at = {}, {}
        for i in rebind:
            if signature[i][0] != "array":
                raise ValueError(f"`rebind` position {i} must be an array argument, got "
                                 f"{signature[i]}")
            self._layouts[i] = array_layout(args[i])
            self._at[i] = first[i] + _raw.DATA_FIELD
        grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
        block = tuple(block) if isinstance(block, tuple) else (block,)
        self._grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self._block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self._fptr, self._stream, self._launch = int(fptr), int(stream_ptr), launch

    prepared = True  # (as Bound.prepared: no Numba argument handling per call)

    @property
    def values(self) -> np.ndarray:
        """The packed argument slots (a copy)."""
        return self._vals.copy()

    def set(self, i: int, value) -> None:
        """Replace the mutable scalar at position ``i`` of ``args``."""
        if i not in self._mut:
            raise ValueError(f"`i` must be a mutable position {tuple(self._mut)}, got {i}")
        at, typ = self._mut[i]
        self._vals[at] = _bits(typ(value))

    def rebind(self, i: int, array=None, ptr=None) -> None:
        """Replace the array at position ``i`` (``ptr``: its data pointer, trusted;
        ``array``: checked against the prepared dtype, shape and strides)."""
        layout = self._layouts.get(i)
        if layout is None:
            raise ValueError(f"`i` must be a rebind position {tuple(self._layouts)}, got {i}")
        if ptr is None:
            if array is None:
                raise ValueError("`array` or `ptr` is required")
            got = array_layout(array)
            if got != layout:
                raise ValueError(f"`array` must have (dtype, shape, strides) {layout} "
                                 f"(argument {i}), got {got}")
            ptr = int(array.__cuda_array_interface__["data"][0] or 0)
        self._vals[self._at[i]] = int(ptr)

    def release(self) -> None:
        """Nothing to drop (the slots hold integers only)."""

    def __call__(self, value=None) -> None:
        if value is not None:
            for at, typ in self._mut.values():
                self._vals[at] = _bits(typ(value))
        g, b = self._grid, self._block
        self._launch(self._fptr, g[0], g[1], g[2], b[0], b[1], b[2], 0, self._stream,
                     self._params, 0)


def _function(device: int, cubin: str, entry: str):
    """``(module, kernel, function pointer)`` of ``entry`` in ``cubin`` on ``device``."""
    key = (device, cubin, entry)
    hit = _functions.get(key)
    if hit is None:
        import cupy

        with cupy.cuda.Device(device):
            module = cupy.RawModule(path=cubin)
            kernel = module.get_function(entry)
            fptr = int(kernel.kernel.ptr)  # loads the module on this device
        with _lock:
            hit = _functions.setdefault(key, (module, kernel, fptr))
    return hit


class RawOps:
    """What a :class:`.build.BuildPlan` launches with on the raw path (CuPy inputs on
    ``device``, raw entries in ``directory`` under ``key``); :meth:`bound` raises
    :class:`.raw.RawMiss` for a launch without a usable entry."""

    raw = True

    def __init__(self, device: int, key: str, directory: str, launch):
        values = _raw.source_values("stochattn.cuda.kmeans.kernels")
        missing = [n for n in CONSTANTS if n not in values]
        if missing:
            raise _raw.RawMiss(f"the kernels' source gives no value for {missing}")
        self.k = types.SimpleNamespace(**{n: values[n] for n in CONSTANTS},
                                       **{n: n for n in KERNELS})
        self.tpb = self.k.TPB
        self.device, self.key, self.directory = device, key, directory
        self._launch = launch
        self._values = _raw.frozen_texts()
        self._entries: dict = {}  # (kernel, signature) -> entry

    # -- the plan's hooks (see build._NumbaOps) ------------------------------------------

    def start(self) -> None:
        if not _raw.runtime_matches():
            raise _raw.RawMiss("the imported kernels' module values differ from the source")

    def finish(self, stream) -> None:
        _counts["plans"] += 1

    def bound(self, kernel, grid, block, stream, args, mutable, rebind):
        try:
            signature = tuple(_raw.signature_of(i, a) for i, a in enumerate(args))
        except TypeError as e:
            raise _raw.RawMiss(str(e)) from None
        entry = self._entries.get((kernel, signature))
        if entry is None:
            entry = _raw.read_entry(self.directory, self.key, kernel, signature, self._values)
            self._entries[(kernel, signature)] = entry
        try:
            _, _, fptr = _function(self.device, entry["cubin"], entry["entry"])
            launch = RawBound(fptr, grid, block, int(stream.ptr), signature, args, mutable,
                              rebind, self._launch)
        except Exception as e:  # noqa: BLE001 - a cubin CuPy cannot load: the Numba path
            raise _raw.RawMiss(f"cannot load {entry['cubin']} ({type(e).__name__}: {e})") from e
        _counts["launches"] += 1
        return launch

    def scratch(self, kind, like, shape, dtype):
        import cupy

        with cupy.cuda.Device(self.device):
            a = cupy.empty(shape, dtype=dtype)
        return a, a

    def host_copy(self, host, stream):
        import cupy

        with cupy.cuda.Device(self.device):
            a = cupy.empty(host.shape, dtype=host.dtype)
            a.set(host, stream=stream)
        return a

    def to_device(self, dev, host, stream) -> None:
        dev.set(np.ascontiguousarray(host, dtype=dev.dtype), stream=stream)

    def to_host(self, dev, host, stream) -> None:
        """Queue a copy of the contiguous device array ``dev`` into the pinned ``host``."""
        from cupy.cuda import runtime

        runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, dev.nbytes,
                            runtime.memcpyDeviceToHost, stream.ptr)

    def event(self):
        import cupy

        with cupy.cuda.Device(self.device):
            return cupy.cuda.Event(block=False, disable_timing=True)

    def pinned_flags(self, n: int):
        """A (2, n) int32 pinned host buffer, cached per thread."""
        buf = getattr(_LOCAL, "flags", None)
        if buf is None or buf.shape[1] < n:
            import cupy

            n = max(n, 1)
            mem = cupy.cuda.alloc_pinned_memory(2 * n * 4)
            buf = np.frombuffer(mem, dtype=np.int32, count=2 * n).reshape(2, n)
            _LOCAL.flags, _LOCAL.flags_mem = buf, mem
        return buf


def ops_for(device: int):
    """The raw backend for CuPy inputs on ``device``, or None: raw entries off, the
    simulator, kernels imported with other values, no CuPy launch entry point, or no
    entry directory for this key."""
    if not _raw.enabled() or _raw.simulator() or not _raw.runtime_matches():
        return None
    ops = _ops.get(device)
    if ops is not None:
        return ops
    try:
        import cupy

        from ..runtime.launch import _launch_kernel

        launch = _launch_kernel()
        if launch is None:
            return None
        cc = str(cupy.cuda.Device(device).compute_capability)
        key = _raw.raw_key(cc)
        directory = _raw.raw_dir(key)
        if not os.path.isdir(directory):
            return None
        ops = RawOps(device, key, directory, launch)
    except Exception:  # noqa: BLE001 - no CuPy, no device, no source: the Numba path
        return None
    with _lock:
        return _ops.setdefault(device, ops)


def _reset_for_tests() -> None:
    with _lock:
        _functions.clear()
        _ops.clear()
    _counts.update(launches=0, plans=0)
