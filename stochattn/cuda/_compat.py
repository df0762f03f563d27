"""Deprecated private module names from before the backend's rooms, for the last users in
the package itself: ``from stochattn.cuda import _inputs`` gives :mod:`.runtime.inputs`
(``stochattn/_plan.py``, ``stochattn/santa.py``) and ``_sources`` gives :mod:`.kernels`
(``stochattn/_plan.py``). Delete this module, and the fallback in ``stochattn/cuda/__init__``
that uses it, once they import the public paths. Tools, benchmarks and tests use the public
paths (:mod:`.config`, :mod:`.build_check`, :mod:`.kernels`, :mod:`.runtime`,
:mod:`.kmeans`); the old setters of ``_sources`` and ``_module.MERGE_IN_KERNEL`` /
``limit_dtypes`` are gone (``config.set_config(...)``).
"""

from __future__ import annotations

import importlib

MODULES = {"_sources": ".kernels", "_inputs": ".runtime.inputs"}


def module(name: str):
    """The module an old private module name now lives in."""
    return importlib.import_module(MODULES[name], __package__)
