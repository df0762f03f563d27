"""CUDA backend: CuPy RawKernels (CUDA C++ sources in this folder) and Numba-CUDA k-means.

Nothing here is imported by ``import stochattn``; kernels compile on first use.
"""

_LAZY = {"exact_decode": ".exact", "santa_prop": ".santa", "santa_flash": ".flash",
         "flash_diagnostics": ".flash", "kmeans_gpu": ".kmeans",
         "build_index_gpu": ".doublep_index"}


def __getattr__(name):  # lazy: importing the package imports no CuPy and compiles nothing
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
