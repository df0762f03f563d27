"""Which backend runs a call: NumPy arrays go to the reference, GPU arrays to CUDA.

``import stochattn`` imports neither CuPy nor Numba; this module only looks at types.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["backend_of", "callers_namespace", "cuda_not_implemented", "host_floats", "host_ints",
           "in_callers_framework", "require_cupy", "to_namespace"]


def _kind(name: str, a) -> str:
    if isinstance(a, np.ndarray):
        return "numpy"
    module = type(a).__module__.split(".")[0]
    if module == "cupy":
        return "cuda"
    if hasattr(a, "__dlpack_device__"):
        device_type, _ = a.__dlpack_device__()
        # DLPack device types: 1 CPU, 2 CUDA, 3 CUDA host, 13 CUDA managed.
        if int(device_type) in (2, 3, 13):
            return "cuda"
        if int(device_type) == 1:
            raise TypeError(
                f"`{name}` is a CPU {type(a).__name__}; pass NumPy arrays for the CPU reference "
                "(for example `np.asarray(x)` or `x.numpy()`)"
            )
    raise TypeError(
        f"`{name}` must be a NumPy array, a CuPy array or a GPU array with `__dlpack__`, "
        f"got {type(a).__name__}"
    )


def backend_of(**arrays) -> str:
    """Return ``"numpy"`` or ``"cuda"`` for the named arrays, which must agree.

    ``None`` entries are skipped. Raises ``TypeError`` for unsupported types and for a mix
    of host and device arrays.
    """
    kinds = {name: _kind(name, a) for name, a in arrays.items() if a is not None}
    found = set(kinds.values())
    if len(found) > 1:
        detail = ", ".join(f"`{n}` on {'GPU' if k == 'cuda' else 'host (NumPy)'}" for n, k in kinds.items())
        raise TypeError(f"all arrays must live on one device, got {detail}")
    return found.pop() if found else "numpy"


def cuda_not_implemented(function: str, what: str) -> NotImplementedError:
    """The error raised where a GPU path does not exist yet."""
    return NotImplementedError(
        f"`{function}` has no CUDA kernel yet ({what}); pass NumPy arrays to run the "
        "reference implementation on the CPU"
    )


def require_cupy(function: str) -> None:
    """Raise a clear ImportError when a GPU array arrives and CuPy is not installed."""
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"`{function}` got GPU arrays, and the CUDA backend needs CuPy: install "
            "stochattn[cuda13] (or stochattn[cuda12])"
        ) from e


def _host(a) -> np.ndarray:
    """A device-to-host copy for CuPy and torch arrays (diagnostics only, which are allowed
    to synchronise); NumPy arrays as they are."""
    if hasattr(a, "get"):
        a = a.get()
    elif hasattr(a, "cpu"):
        a = a.cpu()
    return np.asarray(a)


def host_ints(a) -> np.ndarray:
    """Integer values on the host as int64 (see _host)."""
    return _host(a).astype(np.int64)


def host_floats(a) -> np.ndarray:
    """Values on the host as float64 (see _host)."""
    return _host(a).astype(np.float64)


# ---- results in the caller's framework ------------------------------------------------------

_NATIVE = ("numpy", "cupy", "torch")  # frameworks the CUDA wrappers return natively


def callers_namespace(a):
    """The array namespace to hand GPU results back in, for a GPU array of a framework other
    than CuPy and PyTorch (JAX, ...), which the kernels see through CuPy: its array-API
    namespace (``a.__array_namespace__()``, e.g. ``jax.numpy``), if it has one with
    ``from_dlpack``. None for NumPy, CuPy and PyTorch arrays (their results already come
    back in their own type) and for arrays with no such namespace (the result stays CuPy)."""
    if type(a).__module__.split(".")[0] in _NATIVE:
        return None
    get = getattr(a, "__array_namespace__", None)
    if get is None:
        return None
    try:
        xp = get()
    except Exception:  # noqa: BLE001 - no usable namespace: leave the result as CuPy
        return None
    return xp if hasattr(xp, "from_dlpack") else None


def to_namespace(result, xp):
    """``result`` with every CuPy array in it (also inside tuples and lists) taken into
    ``xp`` through DLPack, zero-copy; other values (host diagnostics) as they are."""
    if isinstance(result, (tuple, list)):
        return type(result)(to_namespace(r, xp) for r in result)
    if type(result).__module__.split(".")[0] == "cupy" and hasattr(result, "__dlpack__"):
        return xp.from_dlpack(result)
    return result


def in_callers_framework(position: int = 0):
    """Decorator of a GPU path whose positional argument ``position`` is ``q``: its results
    come back in ``q``'s framework (see :func:`callers_namespace`)."""

    def decorate(gpu_path):
        @functools.wraps(gpu_path)
        def wrapped(*args, **kwargs):
            result = gpu_path(*args, **kwargs)
            xp = callers_namespace(args[position])
            return result if xp is None else to_namespace(result, xp)

        return wrapped

    return decorate
