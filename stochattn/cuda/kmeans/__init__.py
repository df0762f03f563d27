"""The Numba-CUDA k-means prefill of Double-P's index: :func:`kmeans_gpu`.

- :mod:`.host`: :func:`kmeans_gpu` (validation, the build plan's cache, the rounds), its
  knobs ``GEMM_SCRATCH_BYTES`` and ``BUILD_CACHE_SIZE`` (module attributes of
  :mod:`.host`, read at every call) and :func:`clear_build_cache`;
- :mod:`.build`: one build plan per configuration (prepared launches, scratch, the GEMM);
- :mod:`.cache`: the plans lent to builds; :mod:`.kernels`: the Numba kernels;
- :mod:`.diskcache`: the kernels' machine code on disk, for later processes
  (:func:`clear_disk_cache`);
- :mod:`.launch`: Numba launches prepared once (:class:`.launch.Bound`);
- :mod:`.raw`: the kernels' machine code as plain cubins ("raw entries") for processes that
  must not import Numba, and :mod:`.rawplan`: a build plan's launches from them (CuPy
  inputs).

``import stochattn.cuda.kmeans`` imports no Numba (the names below load :mod:`.host` on
first access, and :mod:`.host` imports Numba only on the Numba path); it only makes NumPy
safe for numba-cuda, once for every module here.
"""

import importlib

import numpy as np

# Compatibility: numba-cuda 0.30 still refers to ``np.row_stack``, which NumPy 2.5 removed
# (seen on the H200 machine: every kernel compile failed). Restore the alias, which NumPy
# defined as ``vstack``, before any module of this package imports numba-cuda.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

__all__ = ["kmeans_gpu", "clear_build_cache", "clear_disk_cache", "GEMM_SCRATCH_BYTES",
           "BUILD_CACHE_SIZE"]


def __getattr__(name):  # lazy: the host module imports Numba
    if name in __all__:
        return getattr(importlib.import_module(".host", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
