"""Which backend runs a call: NumPy arrays go to the reference, GPU arrays to CUDA.

``import stochattn`` imports neither CuPy nor Numba; this module only looks at types.
"""

from __future__ import annotations

import numpy as np

__all__ = ["backend_of", "cuda_not_implemented", "host_floats", "host_ints", "require_cupy"]


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
