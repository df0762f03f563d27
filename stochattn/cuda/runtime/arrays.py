"""GPU arrays in and out of the kernels, with as little host work per call as possible.

Three kinds of input, each handled by one small "ops" object:

- PyTorch CUDA tensors (:data:`TORCH`): the kernels get raw ``data_ptr()`` values, launch on
  torch's current stream, and every output and scratch buffer comes from torch's caching
  allocator (``new_empty``), so a call can be captured in a ``torch.cuda.CUDAGraph``. No
  DLPack exchange, no CuPy array, no host synchronisation. bfloat16 needs nothing special:
  the kernels read raw 16-bit patterns, the output is a ``torch.bfloat16`` tensor.
- CuPy arrays (:data:`CUPY`): launched on CuPy's current stream; buffers from CuPy's pool.
- any other CUDA array with ``__dlpack__`` (JAX, ...): taken zero-copy with
  :func:`cupy.from_dlpack` once per call, then handled as CuPy; the public functions hand
  the result back through the caller's array-API namespace (``jax.numpy.from_dlpack``,
  zero-copy; :func:`stochattn._backend.in_callers_framework`). A bfloat16 array fails
  there with CuPy's message if this CuPy has no bfloat16 dtype.

Inputs that are not C-contiguous or not 16-byte aligned are copied (the kernels use 16-byte
vector loads).
"""

from __future__ import annotations

import numpy as np

__all__ = ["TORCH", "CUPY", "ops_for", "to_cupy", "host_values", "launch_stream"]


def _is_torch_type(t) -> bool:
    return t.__module__.split(".")[0] == "torch"


class _TorchOps:
    name = "torch"

    @staticmethod
    def meta(t):
        """What a plan depends on: dtype, shape, device (-1 on the host)."""
        return (t.dtype, t.shape, t.get_device())

    @staticmethod
    def dtype_name(dtype) -> str:
        return str(dtype).replace("torch.", "")

    @staticmethod
    def contiguous(name, t):
        if t.is_contiguous() and not t.data_ptr() % 16:
            return t
        # A fresh allocation of the caching allocator is 512-byte aligned.
        return t.contiguous() if not t.is_contiguous() else t.clone()

    @staticmethod
    def ptr(t) -> int:
        return t.data_ptr()

    @staticmethod
    def empty(like, shape, dtype=None):
        """Uninitialised tensor on ``like``'s device, from torch's caching allocator on the
        current stream (``dtype``: None for ``like``'s, or "uint8"/"int32"/"int64")."""
        if dtype is None:
            return like.new_empty(shape)
        import torch

        return like.new_empty(shape, dtype=getattr(torch, dtype))

    @staticmethod
    def zeros(like, shape, dtype):
        """Zeroed tensor of ``dtype`` (as in :meth:`empty`), filled on the current stream."""
        import torch

        return like.new_zeros(shape, dtype=getattr(torch, dtype))

    @staticmethod
    def device_error(name, t):
        return TypeError(f"`{name}` must be a CUDA tensor, got a tensor on {t.device}")


class _CupyOps:
    name = "cupy"

    @staticmethod
    def meta(a):
        return (a.dtype, a.shape, a.data.device_id)

    @staticmethod
    def dtype_name(dtype) -> str:
        return str(dtype)

    @staticmethod
    def contiguous(name, a):
        if a.flags.c_contiguous and not a.data.ptr % 16:
            return a
        import cupy

        with cupy.cuda.Device(a.data.device_id):
            return cupy.array(a, order="C", copy=True)  # fresh allocations are 256-byte aligned

    @staticmethod
    def ptr(a) -> int:
        return a.data.ptr

    @staticmethod
    def empty(like, shape, dtype=None):
        import cupy

        return cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)

    @staticmethod
    def zeros(like, shape, dtype):
        import cupy

        return cupy.zeros(shape, dtype=dtype)  # memset on CuPy's current stream

    @staticmethod
    def device_error(name, a):  # CuPy arrays always live on a GPU
        return TypeError(f"`{name}` must be on a GPU")


TORCH = _TorchOps()
CUPY = _CupyOps()
_DLPACK = "dlpack"
_KINDS: dict = {}  # type -> TORCH, CUPY or _DLPACK (classification cached per type)


def ops_for(name: str, a):
    """The ops of ``a``'s framework: TORCH, CUPY, or "dlpack" (convert with :func:`to_cupy`)."""
    t = type(a)
    kind = _KINDS.get(t)
    if kind is None:
        if _is_torch_type(t):
            kind = TORCH
        else:
            try:
                import cupy
            except ImportError:  # pragma: no cover - the wrappers need CuPy anyway
                cupy = None
            if cupy is not None and isinstance(a, cupy.ndarray):
                kind = CUPY
            elif hasattr(a, "__dlpack__"):
                kind = _DLPACK
            else:
                raise TypeError(f"`{name}` must be a CuPy array or a CUDA array with `__dlpack__`, "
                                f"got {t.__name__}")
        _KINDS[t] = kind
    return kind


def to_cupy(name: str, a):
    """Zero-copy CuPy view of a DLPack CUDA array."""
    import cupy

    try:
        return cupy.from_dlpack(a)
    except Exception as e:  # noqa: BLE001 - say which argument
        raise TypeError(f"`{name}` could not be taken as a CUDA array through DLPack: {e}") from e


class ArrayMeta:
    """Shape, ndim and dtype name of an array: what :mod:`stochattn._validation` reads, with
    no data access."""

    __slots__ = ("shape", "ndim", "dtype")

    def __init__(self, shape, dtype_name: str):
        self.shape = tuple(int(s) for s in shape)
        self.ndim = len(self.shape)
        self.dtype = dtype_name


def to_host(a) -> np.ndarray:
    """NumPy copy of a CuPy array or PyTorch tensor (a NumPy array as it is); a device
    array's copy synchronises."""
    if hasattr(a, "get"):
        return a.get()
    if hasattr(a, "cpu"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def host_values(name: str, a):
    """NumPy view of host data (NumPy array, list/tuple, PyTorch CPU tensor), or None when
    ``a`` lives on a GPU."""
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, (list, tuple)):
        return np.asarray(a)
    if _is_torch_type(type(a)):
        return None if a.is_cuda else a.detach().numpy()
    try:
        ops_for(name, a)  # CuPy array or other DLPack producer: on a GPU
        return None
    except TypeError:
        pass
    raise TypeError(f"`{name}` must be an integer array, got {type(a).__name__}")


# ---- streams ------------------------------------------------------------------------------

_EXTERNAL: dict = {}  # (stream pointer, device) -> cupy.cuda.ExternalStream


def _torch_raw_stream():
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda dev: torch.cuda.current_stream(dev).cuda_stream


_raw_stream = None


def launch_stream(ops, device: int):
    """The CuPy stream object to launch on: torch's current stream on ``device`` (wrapped
    once per stream as a ``cupy.cuda.ExternalStream``) for torch inputs, None (CuPy's
    current stream) for CuPy inputs."""
    global _raw_stream
    if ops is not TORCH:
        return None
    if _raw_stream is None:
        _raw_stream = _torch_raw_stream()
    ptr = _raw_stream(device)
    s = _EXTERNAL.get((ptr, device))
    if s is None:
        import cupy

        s = cupy.cuda.ExternalStream(ptr, device)
        if len(_EXTERNAL) > 64:  # streams come and go; keep the table small
            _EXTERNAL.clear()
        _EXTERNAL[(ptr, device)] = s
    return s
