"""Deprecated spellings from before the backend's rooms (kept for tests and tools until
they use the public paths; nothing in :mod:`stochattn` uses them).

- Module names: ``from stochattn.cuda import _sources`` gives :mod:`.kernels`, ``_module``
  :mod:`.runtime.launch`, ``_inputs``/``_arrays``/``_pdl`` the :mod:`.runtime` modules,
  ``_abi`` :mod:`.kernels.abi`, ``_kmeans_*``/``_numba_launch`` the :mod:`.kmeans` modules.
- On :mod:`.kernels` (the old ``_sources``): the compiler check (:mod:`.build_check`), the
  config classes and tilings (:mod:`.config`), and the old setters below, which act on the
  process default :class:`.config.GpuConfig`.
- On :mod:`.runtime.launch` (the old ``_module``): ``MERGE_IN_KERNEL`` and ``limit_dtypes``.
"""

from __future__ import annotations

import importlib

MODULES = {"_sources": ".kernels", "_abi": ".kernels.abi", "_module": ".runtime.launch",
           "_inputs": ".runtime.inputs", "_arrays": ".runtime.arrays", "_pdl": ".runtime.pdl",
           "_kmeans_build": ".kmeans.build", "_kmeans_cache": ".kmeans.cache",
           "_kmeans_kernels": ".kmeans.kernels", "_numba_launch": ".kmeans.launch"}

_FROM_CHECK = {"CompileResult", "available_backends", "compile_check"}
_FROM_CONFIG = {"TileConfig", "TcTiling", "TC_TILINGS", "PROP_TC_TILINGS", "FLASH_TC_TILINGS",
                "flash_tc_smem_bytes", "smem_limit"}


def module(name: str):
    """The module an old private module name now lives in."""
    return importlib.import_module(MODULES[name], __package__)


def sources_attr(name: str):
    """An old ``_sources`` attribute that is no longer defined in :mod:`.kernels`."""
    if name in _FROM_CHECK:
        from . import build_check

        return getattr(build_check, name)
    if name in _FROM_CONFIG:
        from . import config

        return getattr(config, name)
    if name == "DEFAULT_CONFIG":
        from .config import DEFAULT_TILE_CONFIG

        return DEFAULT_TILE_CONFIG
    if name == "FLASH_WARP_STAGES":
        from .config import _flash_warp_stages

        return _flash_warp_stages()
    if name in _SETTERS:
        return _SETTERS[name]
    raise AttributeError(name)


def get_config():
    """Deprecated: ``config.get_config().tiling``."""
    from .config import get_config

    return get_config().tiling


def set_config(tiling):
    """Deprecated: ``config.set_config(tiling=...)``; returns the previous tiling."""
    from .config import TileConfig, set_config

    if not isinstance(tiling, TileConfig):
        raise TypeError(f"`config` must be a TileConfig, got {type(tiling).__name__}")
    return set_config(tiling=tiling).tiling


def _knob(field):
    def get():
        from .config import get_config

        return getattr(get_config(), field)

    def set_(tiling):
        from .config import set_config

        return getattr(set_config(**{field: tiling}), field)

    get.__doc__ = f"Deprecated: ``config.get_config().{field}``."
    set_.__doc__ = f"Deprecated: ``config.set_config({field}=...)``; returns the previous one."
    return get, set_


_SETTERS = {"get_config": get_config, "set_config": set_config}
for _field in ("tc_tiling", "prop_tc_tiling", "flash_tc_tiling"):
    _SETTERS["get_" + _field], _SETTERS["set_" + _field] = _knob(_field)
