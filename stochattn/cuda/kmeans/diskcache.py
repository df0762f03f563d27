"""On-disk cache of the k-means kernels' machine code, so that a later process loads them
instead of compiling them again (7-11 s on an H100 before this cache).

Numba's own ``cache=True`` is not safe here: its index knows the kernel's bytecode and
the modification time of its file, not the values of the module constants that Numba
freezes into the machine code (``ROW_TILE``, ``LANES``, ``DIM_SHARED``, ...: tests and
``tools/tune_kmeans.py`` change them before the first compile), nor the device functions
that come from other files (the Philox block function of :mod:`stochattn.spec`). This
module keeps Numba's cache files and loader but puts them in a directory named after a
key of everything frozen into the code:

- the SHA-256 of the source file of every module whose functions the kernels compile
  (:mod:`~stochattn.cuda.kmeans.kernels` and the modules of the device functions it calls,
  found through their dispatchers);
- every module-level number, string or array of those modules (the values Numba would
  freeze), by name;
- the versions of Python, NumPy, Numba, numba-cuda, llvmlite and the CUDA Python packages,
  and the Numba settings that change code generation (optimisation, debug info, default
  PTX target);
- a format number of this module.

Inside that directory Numba's index adds what it keys itself: the kernel's argument
types, its bytecode, the device's compute capability and the CUDA runtime version.

Where: ``$NUMBA_CACHE_DIR/stochattn-kmeans/<key>`` when ``NUMBA_CACHE_DIR`` is set, else
``${XDG_CACHE_HOME:-~/.cache}/stochattn/kmeans/<key>`` (never next to the package, which
may be read-only); each key directory holds ``key.json``, the values it was made from.
Off: ``STOCHATTN_KMEANS_CACHE=0`` in the environment, or :data:`ENABLED` = False (read at
every new build plan). :func:`clear_disk_cache` deletes the directory. An unwritable
directory turns the cache off for the process (one warning); so does a change of the
frozen values after a kernel of the process was compiled (the code in memory may then mix
two configurations, and nothing of it is saved). Under the CUDA simulator nothing here
runs: its kernels are Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import warnings

import numpy as np

__all__ = ["ENABLED", "ENV_SWITCH", "enabled", "cache_root", "key_material", "cache_key",
           "attach", "counts", "clear_disk_cache"]

#: Bumped when this module changes what a key directory holds.
FORMAT = 1

#: Environment variable that turns the disk cache off ("0", "off", "false", "no") or on
#: ("1", "on", "true", "yes"; also when unset).
ENV_SWITCH = "STOCHATTN_KMEANS_CACHE"

#: True or False overrides :data:`ENV_SWITCH`; None follows it (read at every new plan).
ENABLED = None

_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes")
_PACKAGES = ("numpy", "numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core")
_NUMBA_SETTINGS = ("OPT", "DEBUGINFO_DEFAULT", "CUDA_DEBUGINFO_DEFAULT", "CUDA_DEFAULT_PTX_CC",
                   "CUDA_ENABLE_PYNVJITLINK", "CUDA_ENABLE_MINOR_VERSION_COMPATIBILITY")

_lock = threading.Lock()
# key: the key of the values at the latest plan (compiles happen only while building a
# plan, so code compiled since then used them); path: the directory the kernels' caches
# point at (None: detached); off: why the cache stays off in this process.
_state = {"key": None, "path": None, "off": None}
_digests: dict = {}
_versions: dict = {}


def enabled() -> bool:
    """Whether builds use the disk cache (:data:`ENABLED`, else :data:`ENV_SWITCH`)."""
    if ENABLED is not None:
        return bool(ENABLED)
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"`{ENV_SWITCH}` must be one of {_ON[1:] + _OFF} (or unset), got "
                     f"{os.environ[ENV_SWITCH]!r}")


def cache_root() -> str:
    """The directory that holds one subdirectory per key (see the module docstring)."""
    numba_dir = os.environ.get("NUMBA_CACHE_DIR", "")
    if numba_dir:
        return os.path.join(os.path.abspath(numba_dir), "stochattn-kmeans")
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "stochattn", "kmeans")


# ---- the key ----------------------------------------------------------------------------------


def _py_func(obj):
    """The Python function of a Numba CUDA dispatcher (the simulator's kernels: ``fn``),
    else None."""
    if hasattr(obj, "targetoptions"):
        return getattr(obj, "py_func", None)
    if type(obj).__name__ == "FakeCUDAKernel":
        return getattr(obj, "fn", None)
    return None


def _is_dispatcher(obj) -> bool:
    return _py_func(obj) is not None


def _modules(module) -> list:
    """``module`` and every module whose functions its dispatchers compile (transitively,
    through module-level dispatchers), sorted by name."""
    found = {module.__name__: module}
    todo = [module]
    while todo:
        for obj in list(vars(todo.pop()).values()):
            if not _is_dispatcher(obj):
                continue
            name = getattr(_py_func(obj), "__module__", None)
            mod = sys.modules.get(name) if name else None
            if mod is not None and name not in found:
                found[name] = mod
                todo.append(mod)
    return [found[name] for name in sorted(found)]


def _file_digest(path: str) -> str:
    """SHA-256 of a source file, read once per process (the code Numba compiles is the
    code imported then)."""
    digest = _digests.get(path)
    if digest is None:
        with open(path, "rb") as f:
            digest = _digests[path] = hashlib.sha256(f.read()).hexdigest()
    return digest


def _value(v):
    """A stable text for a frozen value, or None for what Numba would not freeze as a
    constant (modules, functions, dispatchers...)."""
    if isinstance(v, (bool, int, float, complex, str, bytes, np.generic)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, type):  # a scalar type used as a constructor (np.float32, ...)
        return f"type:{v.__module__}.{v.__qualname__}"
    if isinstance(v, np.ndarray):
        data = hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
        return f"ndarray:{v.dtype.str}:{v.shape}:{data}"
    if isinstance(v, tuple):
        parts = [_value(x) for x in v]
        return None if None in parts else "tuple:(" + ",".join(parts) + ")"
    return None


def _package_versions() -> dict:
    if not _versions:
        from importlib import metadata

        for name in _PACKAGES:
            try:
                _versions[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                _versions[name] = None
    return dict(_versions)


def _numba_settings() -> dict:
    try:
        from numba.cuda.core import config
    except ImportError:  # older numba-cuda: Numba's own config
        from numba import config
    return {name: repr(getattr(config, name, None)) for name in _NUMBA_SETTINGS}


def key_material(module) -> dict:
    """Everything the key of ``module``'s kernels is made of, as plain JSON values."""
    sources, values = {}, {}
    for mod in _modules(module):
        path = getattr(mod, "__file__", None)
        sources[mod.__name__] = _file_digest(path) if path else None
        for name, v in vars(mod).items():
            if name.startswith("__"):
                continue
            text = _value(v)
            if text is not None:
                values[f"{mod.__name__}.{name}"] = text
    return {
        "format": FORMAT,
        "sources": sources,
        "values": dict(sorted(values.items())),
        "python": list(sys.version_info[:3]) + [sys.implementation.name,
                                                getattr(sys, "abiflags", "")],
        "packages": _package_versions(),
        "numba": _numba_settings(),
    }


def _digest(material: dict) -> str:
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_key(module) -> str:
    """The key of ``module``'s kernels under the current values (32 hex digits)."""
    return _digest(key_material(module))


# ---- attaching Numba's cache ----------------------------------------------------------------


def _kernels(module) -> list:
    """The kernels (not device functions) of ``module``, in a fixed order."""
    out = []
    for name in sorted(vars(module)):
        obj = getattr(module, name)
        if (hasattr(obj, "targetoptions") and hasattr(obj, "_cache")
                and not obj.targetoptions.get("device")):
            out.append(obj)
    return out


def _compiled_any(module) -> bool:
    """Whether any dispatcher of ``module`` (kernel or device function) holds code."""
    return any(_is_dispatcher(obj) and getattr(obj, "overloads", None)
               for obj in vars(module).values())


def _cache_class(path: str, stamp: str):
    """numba-cuda's kernel cache with its files in ``path`` and ``stamp`` as the source
    stamp its index checks (the key: the index then never depends on file times)."""
    from numba.cuda.core.caching import _CacheLocator
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

    class Locator(_CacheLocator):
        def __init__(self, py_func, py_file):
            self._lineno = py_func.__code__.co_firstlineno

        def get_cache_path(self):
            return path

        def get_source_stamp(self):
            return stamp

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            return cls(py_func, py_file)

    impl = type("KeyedCacheImpl", (CUDACacheImpl,), {"_locator_classes": [Locator]})
    return type("KeyedCache", (CUDACache,), {"_impl_class": impl})


def _detach(kernels) -> None:
    from numba.cuda.core.caching import NullCache

    for k in kernels:
        k._cache = NullCache()
    _state["path"] = None


def _turn_off(kernels, reason: str) -> None:
    _detach(kernels)
    if _state["off"] is None:
        _state["off"] = reason
        warnings.warn(f"k-means disk cache off for this process: {reason}", RuntimeWarning,
                      stacklevel=3)


def _write_key(path: str, key: str, material: dict) -> None:
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, "key.json")
    if os.path.exists(target):
        return
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(material, key=key), f, indent=1, sort_keys=True)
    os.replace(tmp, target)


def attach(module):
    """Point the disk cache of every kernel of ``module`` at the directory of the current
    key, before a build plan compiles them; returns that directory, or None (the cache is
    off, the simulator runs the kernels, or this Numba lacks the cache classes used)."""
    if getattr(module, "SIM", False):
        return None
    with _lock:
        material = key_material(module)
        key = _digest(material)
        kernels = _kernels(module)
        if key != _state["key"] and _compiled_any(module):
            # Code compiled under other (or unknown) values is in memory; a new kernel
            # would link its device functions: save nothing from now on.
            _turn_off(kernels, "kernels were compiled earlier in this process under other "
                               "(or unknown) module constants")
        _state["key"] = key
        if _state["off"] is not None or not enabled():
            if _state["path"] is not None:
                _detach(kernels)
            return None
        path = os.path.join(cache_root(), key)
        if _state["path"] == path:
            return path
        try:
            _write_key(path, key, material)
            cls = _cache_class(path, key)
            caches = [cls(k.py_func) for k in kernels]
        except OSError as e:
            _turn_off(kernels, f"cannot write {path!r} ({e})")
            return None
        except (ImportError, AttributeError, TypeError) as e:  # another numba-cuda
            _turn_off(kernels, f"this numba-cuda lacks the cache classes used ({e})")
            return None
        for k, cache in zip(kernels, caches):
            k._cache = cache
        _state["path"] = path
        return path


def counts(module) -> tuple:
    """(loaded from disk, compiled) kernel overloads of ``module`` in this process, summed
    over its kernels (Numba's per-dispatcher counters; (0, 0) under the simulator)."""
    hits = misses = 0
    for k in _kernels(module) if not getattr(module, "SIM", False) else ():
        hits += sum(getattr(k, "_cache_hits", {}).values())
        misses += sum(getattr(k, "_cache_misses", {}).values())
    return hits, misses


def clear_disk_cache() -> int:
    """Delete :func:`cache_root` (every key's kernels); returns the number of files removed.
    Kernels already loaded stay in memory; the next new plan writes its key again."""
    root = cache_root()
    n = sum(len(files) for _, _, files in os.walk(root))
    shutil.rmtree(root, ignore_errors=True)
    with _lock:
        _state["path"] = None  # (the kernels' caches recreate their files when saving)
    return n


def _reset_for_tests() -> None:
    """Forget this process's key and off reason (tests only)."""
    with _lock:
        _state.update(key=None, path=None, off=None)

