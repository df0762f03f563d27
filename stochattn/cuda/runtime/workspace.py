"""Scratch memory and outputs of a call, taken from the caller instead of allocated.

Every family's launch plan knows how many scratch bytes one call needs (its
``scratch_bytes``) and its output shape. A call gets its scratch from one of:

- ``None``: a fresh buffer from the framework's allocator (torch's caching allocator, CuPy's
  pool), as before: the functional API's calls, safe on any number of streams;
- a :class:`Workspace`: a buffer kept between calls (a plan's own, see
  :meth:`stochattn.Plan.workspace`), allocated on the first call that needs more than it
  holds and reused after: a call that finds it large enough allocates nothing;
- a 1-D uint8 GPU array of the caller's framework (an engine's own arena), checked for
  size, dtype, device and contiguity; it must outlive the queued kernels.

An output comes from ``out=`` (checked: shape, dtype, device, contiguity, framework) or a
fresh allocation. So a call with ``out`` and a kept or given workspace allocates nothing,
copies nothing to the host and does not synchronise.

One workspace serves one stream at a time: two calls queued on different streams with the
same workspace race (as FlashInfer's wrappers do with theirs).
"""

from __future__ import annotations

import threading

from .arrays import TORCH, ops_for

__all__ = ["Workspace", "scratch", "output", "ALIGN"]

ALIGN = 256  # bytes: every piece of a scratch layout starts at a multiple of this


class Workspace:
    """A scratch buffer kept between calls, per device, grown when a call needs more.

    ``nbytes(device)`` says what it holds; :meth:`reserve` allocates ahead of a CUDA-graph
    capture (or let an eager warm-up call do it); :meth:`release` drops the buffers.
    """

    def __init__(self):
        self._buffers: dict = {}  # (framework, device) -> uint8 array
        self._lock = threading.Lock()

    def nbytes(self, device: int | None = None) -> int:
        """Bytes held on ``device`` (None: the largest over the devices)."""
        sizes = [_size(b) for (_, d), b in self._buffers.items() if device is None or d == device]
        return max(sizes, default=0)

    def reserve(self, like, nbytes: int) -> None:
        """Hold at least ``nbytes`` on the device and in the framework of the GPU array
        ``like``."""
        self.pointer(ops_for("like", like), like, int(nbytes), _device_of(like))

    def release(self) -> None:
        """Drop the buffers (freed through their framework's allocator)."""
        with self._lock:
            self._buffers.clear()

    def pointer(self, ops, like, nbytes: int, device: int) -> int:
        key = (ops.name, device)
        buf = self._buffers.get(key)
        if buf is None or _size(buf) < nbytes:
            with self._lock:
                buf = self._buffers.get(key)
                if buf is None or _size(buf) < nbytes:
                    # Round up, so that a slowly growing sequence does not reallocate often.
                    grown = max(nbytes, ALIGN) if buf is None else max(nbytes, 2 * _size(buf))
                    buf = self._buffers[key] = ops.empty(like, (_round(grown),), "uint8")
        return ops.ptr(buf)

    def __repr__(self) -> str:
        held = ", ".join(f"{f}:{d}={_size(b)} B" for (f, d), b in self._buffers.items())
        return f"Workspace({held or 'empty'})"


def _round(n: int) -> int:
    return -(-n // (1 << 20)) * (1 << 20) if n > (1 << 20) else -(-n // ALIGN) * ALIGN


def _size(buf) -> int:
    return int(buf.numel()) if hasattr(buf, "numel") else int(buf.size)


def _device_of(a) -> int:
    ops = ops_for("like", a)
    return ops.meta(a)[2]


def scratch(ops, like, nbytes: int, workspace, device: int):
    """``(pointer, keep_alive)`` of ``nbytes`` of scratch on ``like``'s device, from
    ``workspace`` (None, a :class:`Workspace` or a uint8 GPU array; see the module
    docstring)."""
    if nbytes <= 0:
        return 0, None
    if workspace is None:
        buf = ops.empty(like, (nbytes,), "uint8")
        return ops.ptr(buf), buf
    if isinstance(workspace, Workspace):
        return workspace.pointer(ops, like, nbytes, device), None
    return _check_array("workspace", ops, workspace, (nbytes,), "uint8", device, at_least=True,
                        align=ALIGN), None


def output(ops, like, shape, dtype, out, device: int, name: str = "out"):
    """The output array of a call: ``out`` checked (shape, dtype — None for ``like``'s —,
    device, contiguity, framework), or a fresh one."""
    if out is None:
        return ops.empty(like, shape, dtype)
    if dtype is None:
        dtype = ops.dtype_name(ops.meta(like)[0])
    _check_array(name, ops, out, tuple(shape), dtype, device)
    return out


def _check_array(name, ops, a, shape, dtype, device, at_least=False, align=16) -> int:
    if ops_for(name, a) is not ops:
        raise TypeError(f"`{name}` must come from the framework of `q` ({ops.name}), got "
                        f"{type(a).__module__}.{type(a).__name__}")
    adtype, ashape, adev = ops.meta(a)
    ashape = tuple(int(s) for s in ashape)
    if ops.dtype_name(adtype) != dtype:
        raise TypeError(f"`{name}` must have dtype {dtype}, got {ops.dtype_name(adtype)}")
    if at_least:
        if len(ashape) != 1 or ashape[0] < shape[0]:
            raise ValueError(f"`{name}` must be a 1-D array of at least {shape[0]} bytes for this "
                             f"call, got shape {ashape}")
    elif ashape != shape:
        raise ValueError(f"`{name}` must have shape {shape}, got {ashape}")
    if adev != device:
        raise ValueError(f"`{name}` must be on the GPU of `q` ({device}), got device {adev}")
    contiguous = a.is_contiguous() if ops is TORCH else a.flags.c_contiguous
    if not contiguous:
        raise ValueError(f"`{name}` must be contiguous")
    ptr = ops.ptr(a)
    if ptr % align:
        raise ValueError(f"`{name}` must be {align}-byte aligned, got address {ptr:#x}")
    return ptr
