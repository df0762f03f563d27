"""CUDA backend: CuPy RawKernels (CUDA C++ sources in kernels/) and Numba-CUDA k-means.

Nothing here is imported by ``import stochattn``, and ``import stochattn.cuda`` imports no
CuPy and compiles nothing: the names below load their module on first access, and kernels
compile on first use.

Functions: :func:`exact_decode`, :func:`santa_prop`, :func:`santa_flash`,
:func:`flash_diagnostics`, :func:`bernoulli_scores_gpu`, :func:`kmeans_gpu`,
:func:`build_index_gpu`, :func:`clear_plan_cache`. Modules: :mod:`.config` (the tuning knobs,
one ``GpuConfig`` per device), :mod:`.doublep` (Double-P decode), :mod:`.doublep_index`
(the GPU index: build and append).

Rooms: :mod:`.runtime` (the launch runtime), :mod:`.kernels` (the CUDA sources, their
instantiations and declarations), :mod:`.kmeans` (the Numba-CUDA k-means), one host module
per estimator family (:mod:`.exact`, :mod:`.santa` for S²ANTA-prop, :mod:`.flash`,
:mod:`.bernoulli`, :mod:`.doublep`, :mod:`.doublep_index`), :mod:`.config` and
:mod:`.build_check` (compiling the sources without a GPU).
"""

import importlib

# name -> (module, attribute); attribute None: the module itself.
_LAZY = {"exact_decode": (".exact", "exact_decode"), "santa_prop": (".santa", "santa_prop"),
         "santa_flash": (".flash", "santa_flash"),
         "flash_diagnostics": (".flash", "flash_diagnostics"),
         "bernoulli_scores_gpu": (".bernoulli", "bernoulli_scores_gpu"),
         "kmeans_gpu": (".kmeans", "kmeans_gpu"),
         "build_index_gpu": (".doublep_index", "build_index_gpu"),
         "clear_plan_cache": (".runtime.inputs", "clear_plan_cache"),
         "config": (".config", None), "doublep": (".doublep", None),
         "doublep_index": (".doublep_index", None)}

__all__ = sorted(_LAZY)


def __getattr__(name):  # lazy: importing the package imports no CuPy and compiles nothing
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module, __name__)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
