"""The k-means kernels' machine code as plain cubins, for a process that must not import
Numba ("raw" entries; issue 30: a later process's first index build in < 0.3 s, of which
``import numba.cuda`` alone took 1.2 s).

A process that builds through Numba on a GPU (compiling the kernels, or loading them
from :mod:`.diskcache`) also writes, for every kernel specialization its plan launches,
an **entry**: the linked cubin for the device's compute capability, the kernel's mangled
entry name, and its argument signature (per Python argument: an array's dtype, ndim and
Numba layout, or a scalar's dtype), from which the flattened launch arguments follow
(:func:`flat_abi`: Numba's ``_Kernel._prepare_args`` layout, meminfo, parent, nitems,
itemsize, data, shape[ndim], strides[ndim] per array). A later process whose inputs are
CuPy arrays finds the entries of every launch of its plan and launches the same machine
code with the same arguments through ``cuLaunchKernel`` (:mod:`.rawplan`), without
importing Numba; anything missing or different sends it to the Numba path.

Entries live in ``<diskcache.cache_root()>/raw/<key>/``: ``<kernel>.<signature hash>.json``
and ``.cubin``, written atomically (temporary file, ``os.replace``). The key is computed
without Numba (:func:`raw_key`): this module's format number, the SHA-256 of the kernels'
source files (:data:`SOURCES`, the files :func:`diskcache.key_material` hashes), the
versions of Python and the packages of the Numba stack (``importlib.metadata``), the
``NUMBA_*`` environment variables that may change code generation, and the device's
compute capability.

Frozen values: Numba freezes module constants into the code, and tests and
``tools/tune_kmeans.py`` change them at runtime. An entry is written only when every
module-level value of the :data:`SOURCES` modules (those :mod:`.diskcache` keys on) equals
the value the unmodified source gives, as read by :func:`source_values` (an ``ast`` walk that
evaluates literals, names, arithmetic, ``x if SIM else y`` with ``SIM`` False, and NumPy
scalar constructors only; anything else is "unknown", and an unknown name that holds a
value at runtime blocks the export). Each entry records those values; the reader compares
them against its own parse of the source (and, where the kernels module is imported, against
its runtime values).

Switch: ``STOCHATTN_KMEANS_RAW=0`` turns raw entries off (neither read nor written), and
so does everything that turns the disk cache off (``STOCHATTN_KMEANS_CACHE=0``,
:data:`diskcache.ENABLED`); the CUDA simulator never uses them. Nothing here imports Numba
except :func:`export`, called from the Numba path.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import threading

import numpy as np

from . import diskcache as _diskcache

__all__ = ["FORMAT", "ENV_SWITCH", "SOURCES", "enabled", "raw_key", "raw_dir", "source_values",
           "frozen_texts", "runtime_matches", "signature_of", "flat_abi", "flatten",
           "numba_layout", "entry_name", "write_entry", "read_entry", "export", "RawMiss"]

#: Bumped when an entry's contents or the flattened layout change.
FORMAT = 1

#: Environment variable that turns raw entries off ("0", "off", "false", "no").
ENV_SWITCH = "STOCHATTN_KMEANS_RAW"

#: The modules whose source the kernels compile (checked against diskcache's list at export).
SOURCES = ("stochattn.cuda.kmeans.kernels", "stochattn.spec")

#: Names whose value the source computes from the environment: their value on a GPU.
PRESETS = {"stochattn.cuda.kmeans.kernels": {"SIM": False}}

_ENV_IGNORED = ("NUMBA_CACHE_DIR", "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the directory holding the stochattn package


class RawMiss(Exception):
    """A raw entry is missing, stale or unusable: take the Numba path."""


def enabled() -> bool:
    """Whether raw entries are read and written (:data:`ENV_SWITCH` and the disk cache's
    own switch)."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    return _diskcache.enabled()


def simulator() -> bool:
    """Whether Numba's CUDA simulator is (or will be) on in this process."""
    numba = sys.modules.get("numba")
    config = getattr(numba, "config", None) if numba is not None else None
    if config is not None and hasattr(config, "ENABLE_CUDASIM"):
        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0")


# ---- the source's values ----------------------------------------------------------------------

_UNKNOWN = object()
_NUMPY = object()  # the name bound to `import numpy`
_NP_NAMES = {"inf": np.inf, "nan": np.nan, "pi": np.pi}
_NP_TYPES = {"uint64", "int64", "uint32", "int32", "uint16", "int16", "uint8", "int8",
             "float16", "float32", "float64", "bool_"}
_BUILTINS = {"int": int, "float": float, "bool": bool}
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b,
           ast.Div: lambda a, b: a / b, ast.Mod: lambda a, b: a % b,
           ast.Pow: lambda a, b: a ** b, ast.LShift: lambda a, b: a << b,
           ast.RShift: lambda a, b: a >> b, ast.BitOr: lambda a, b: a | b,
           ast.BitAnd: lambda a, b: a & b, ast.BitXor: lambda a, b: a ^ b}
_UNARY = {ast.USub: lambda a: -a, ast.UAdd: lambda a: +a, ast.Invert: lambda a: ~a,
          ast.Not: lambda a: not a}

_lock = threading.Lock()
_parsed: dict = {}  # module name -> (texts, unknown names) of its source
_digests: dict = {}  # path -> sha256


def source_path(module: str) -> str:
    """The source file of one of :data:`SOURCES` (found without importing it)."""
    return os.path.join(_ROOT, *module.split(".")) + ".py"


def _eval(node, env):
    """The value of a constant expression, or _UNKNOWN."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, (int, float, str, bytes, bool)) else _UNKNOWN
    if isinstance(node, ast.Name):
        return env.get(node.id, _UNKNOWN)
    if isinstance(node, ast.Tuple):
        items = [_eval(e, env) for e in node.elts]
        return _UNKNOWN if any(x is _UNKNOWN for x in items) else tuple(items)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if env.get(node.value.id) is _NUMPY:
            if node.attr in _NP_NAMES:
                return _NP_NAMES[node.attr]
            if node.attr in _NP_TYPES:
                return getattr(np, node.attr)
        return _UNKNOWN
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        x = _eval(node.operand, env)
        return _UNKNOWN if x is _UNKNOWN else _UNARY[type(node.op)](x)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left, env), _eval(node.right, env)
        if a is _UNKNOWN or b is _UNKNOWN:
            return _UNKNOWN
        try:
            return _BINOPS[type(node.op)](a, b)
        except Exception:  # noqa: BLE001 - not a value we can reproduce
            return _UNKNOWN
    if isinstance(node, ast.IfExp):
        test = _eval(node.test, env)
        if test is _UNKNOWN:
            return _UNKNOWN
        return _eval(node.body if test else node.orelse, env)
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        func = node.func
        ctor = None
        if isinstance(func, ast.Name) and func.id in _BUILTINS and func.id not in env:
            ctor = _BUILTINS[func.id]
        elif isinstance(func, ast.Attribute):
            ctor = _eval(func, env)
            if not (isinstance(ctor, type) and issubclass(ctor, np.generic)):
                ctor = None
        x = _eval(node.args[0], env)
        if ctor is None or x is _UNKNOWN:
            return _UNKNOWN
        try:
            return ctor(x)
        except Exception:  # noqa: BLE001
            return _UNKNOWN
    return _UNKNOWN


def _stored_names(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Store)}


def _resolve(module: str, level: int, name) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")[:-level]
    return ".".join(base + ([name] if name else []))


def _parse(module: str, presets: dict = None):
    """``(values, unknown)``: the module-level values the source of ``module`` gives (by
    name) and the names it binds to something this walk cannot evaluate. ``presets``:
    values of names the source computes from the environment (default :data:`PRESETS`)."""
    with open(source_path(module), "rb") as f:
        tree = ast.parse(f.read(), filename=source_path(module))
    env, unknown = {}, set()
    presets = PRESETS.get(module, {}) if presets is None else presets

    def bind(name, value):
        if name in presets:
            value = presets[name]
        env[name] = value
        if value is _UNKNOWN:
            unknown.add(name)
        else:
            unknown.discard(name)

    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                name = alias.asname or alias.name.split(".")[0]
                bind(name, _NUMPY if alias.name == "numpy" and alias.asname in (None, "np")
                     and name in ("np", "numpy") else _UNKNOWN)
        elif isinstance(stmt, ast.ImportFrom):
            source = _resolve(module, stmt.level, stmt.module)
            values = frozen_values(source) if source in SOURCES and source != module else None
            for alias in stmt.names:
                v = values[0].get(alias.name, _UNKNOWN) if values is not None else _UNKNOWN
                bind(alias.asname or alias.name, v)
        elif isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            value = _eval(stmt.value, env)
            for t in stmt.targets:
                bind(t.id, value)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            bind(stmt.target.id, _eval(stmt.value, env) if stmt.value is not None else _UNKNOWN)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            env.pop(stmt.name, None)  # functions and classes: never frozen values
            unknown.discard(stmt.name)
        elif isinstance(stmt, ast.Expr):
            continue  # docstrings, calls without a binding
        else:  # augmented assignments, if/for/try/with blocks: whatever they bind is unknown
            for name in _stored_names(stmt):
                bind(name, _UNKNOWN)
    values = {name: v for name, v in env.items() if v is not _UNKNOWN and v is not _NUMPY}
    return values, unknown


def frozen_values(module: str):
    """``(values, unknown names)`` of :func:`_parse`, once per process and source file."""
    with _lock:
        hit = _parsed.get(module)
    if hit is None:
        hit = _parse(module)
        with _lock:
            _parsed[module] = hit
    return hit


def source_values(module: str) -> dict:
    """The module-level values the unmodified source of ``module`` gives (those it can
    evaluate), by name."""
    return dict(frozen_values(module)[0])


def _texts(entries) -> dict:
    """``{"module.NAME": text}`` of the ``(module, name, value)`` entries whose value Numba
    would freeze (:func:`diskcache._value` texts), dunder names left out."""
    out = {}
    for module, name, v in entries:
        if name.startswith("__"):
            continue
        text = _diskcache._value(v)
        if text is not None:
            out[f"{module}.{name}"] = text
    return dict(sorted(out.items()))


def frozen_texts() -> dict:
    """``{"module.NAME": text}`` of every value of the :data:`SOURCES` modules that Numba
    would freeze (:func:`diskcache._value` texts), as the sources give them."""
    return _texts((m, name, v) for m in SOURCES for name, v in frozen_values(m)[0].items())


def runtime_texts(modules) -> dict:
    """The same texts from imported modules (``{name: module}``)."""
    return _texts((m, name, v) for m, mod in modules.items() for name, v in vars(mod).items())


def runtime_matches(modules=None) -> bool:
    """Whether the imported :data:`SOURCES` modules (default: those in ``sys.modules``;
    True when none is) hold exactly the values their source gives."""
    if modules is None:
        modules = {m: sys.modules[m] for m in SOURCES if m in sys.modules}
    if not modules:
        return True
    want = frozen_texts()
    got = runtime_texts(modules)
    want = {k: v for k, v in want.items() if k.rsplit(".", 1)[0] in modules}
    return got == want


# ---- the key --------------------------------------------------------------------------------


def _file_digest(path: str) -> str:
    digest = _digests.get(path)
    if digest is None:
        with open(path, "rb") as f:
            digest = _digests[path] = hashlib.sha256(f.read()).hexdigest()
    return digest


def key_material(cc: str) -> dict:
    """What the raw key of compute capability ``cc`` ("90") is made of (no Numba)."""
    return {
        "format": FORMAT,
        "sources": {m: _file_digest(source_path(m)) for m in SOURCES},
        "packages": _diskcache._package_versions(),
        "python": list(sys.version_info[:3]) + [sys.implementation.name,
                                                getattr(sys, "abiflags", "")],
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("NUMBA_") and k not in _ENV_IGNORED
                and k != "NUMBA_ENABLE_CUDASIM"},
        "cc": str(cc),
    }


def raw_key(cc: str) -> str:
    """The key (32 hex digits) of the raw entries for compute capability ``cc``."""
    text = json.dumps(key_material(cc), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def raw_dir(key: str) -> str:
    return os.path.join(_diskcache.cache_root(), "raw", key)


# ---- signatures and the flattened arguments ---------------------------------------------------


def numba_layout(shape, strides, itemsize: int) -> str:
    """The layout letter Numba gives a device array (``DeviceNDArray._numba_type_`` with the
    contiguity flags of its ``dummyarray``): "C", "F" or "A"."""
    size = int(np.prod(shape)) if len(shape) else 1
    broadcast = 0 in strides and size != 0
    c = f = True
    if len(shape) and size != 0 and not any(s == 0 for s in strides):
        sd = itemsize
        for n, s in zip(reversed(shape), reversed(strides)):
            if n != 1:
                c = c and s == sd
                sd *= n
        sd = itemsize
        for n, s in zip(shape, strides):
            if n != 1:
                if s != sd:
                    f = False
                    break
                sd *= n
    elif len(shape) and size != 0:
        c = f = False
    if c and not broadcast:
        return "C"
    if f and not broadcast:
        return "F"
    return "A"


def _c_strides(shape, itemsize: int) -> tuple:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _interface(a):
    """``(dtype, shape, strides in bytes, data pointer)`` from ``__cuda_array_interface__``
    (strides None: C-contiguous, as Numba takes it)."""
    cai = a.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(int(s) for s in cai["shape"])
    strides = cai.get("strides")
    strides = _c_strides(shape, dtype.itemsize) if strides is None else tuple(
        int(s) for s in strides)
    return dtype, shape, strides, int(cai["data"][0] or 0)


def signature_of(position: int, a) -> tuple:
    """The signature of one kernel argument: ``("array", dtype str, ndim, layout)`` for a
    device array, ``("scalar", dtype str)`` for a NumPy scalar."""
    if hasattr(a, "__cuda_array_interface__"):
        dtype, shape, strides, _ = _interface(a)
        return ("array", dtype.str, len(shape), numba_layout(shape, strides, dtype.itemsize))
    if isinstance(a, np.generic) and a.dtype.kind in "iuf" and a.nbytes in (4, 8):
        return ("scalar", a.dtype.str)
    raise TypeError(f"kernel argument {position} must be a device array or a 4- or 8-byte "
                    f"NumPy integer or float scalar, got {type(a).__name__}")


#: Fields of a flattened array argument (CUDAKernel._prepare_args), before shape and strides.
ARRAY_HEAD = (("meminfo", "<u8"), ("parent", "<u8"), ("nitems", "<i8"), ("itemsize", "<i8"),
              ("data", "<u8"))
DATA_FIELD = 4


def flat_abi(signature) -> list:
    """The flattened parameters of a kernel signature: ``[(field name, dtype str)]``."""
    out = []
    for i, sig in enumerate(signature):
        if sig[0] == "array":
            ndim = int(sig[2])
            out += [(f"{i}.{name}", dt) for name, dt in ARRAY_HEAD]
            out += [(f"{i}.shape{d}", "<i8") for d in range(ndim)]
            out += [(f"{i}.stride{d}", "<i8") for d in range(ndim)]
        elif sig[0] == "scalar":
            out.append((f"{i}", np.dtype(sig[1]).str))
        else:
            raise ValueError(f"`signature` entry {i} must be an array or a scalar, got {sig!r}")
    return out


def flatten(signature, args):
    """``(values, first)``: the flattened arguments as NumPy scalars of the parameters'
    types (pointers and meminfo/parent uint64, counts, shape and strides int64) and the
    position of each argument's first parameter."""
    values, first = [], []
    for i, (sig, a) in enumerate(zip(signature, args)):
        first.append(len(values))
        if sig[0] == "array":
            dtype, shape, strides, ptr = _interface(a)
            if (dtype.str, len(shape)) != (sig[1], sig[2]):
                raise ValueError(f"kernel argument {i} must be an array of {sig[1]} with "
                                 f"{sig[2]} dims, got {dtype.str} with {len(shape)}")
            nitems = int(np.prod(shape)) if shape else 1
            values += [np.uint64(0), np.uint64(0), np.int64(nitems), np.int64(dtype.itemsize),
                       np.uint64(ptr)]
            values += [np.int64(s) for s in shape] + [np.int64(s) for s in strides]
        else:
            values.append(np.dtype(sig[1]).type(a))
    if len(signature) != len(args):
        raise ValueError(f"`args` must have {len(signature)} entries, got {len(args)}")
    return values, first


def _sig_hash(kernel: str, signature) -> str:
    text = json.dumps([kernel, [list(s) for s in signature]], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_name(kernel: str, signature) -> str:
    """The file stem of the entry of ``kernel`` for ``signature``."""
    return f"{kernel}.{_sig_hash(kernel, signature)}"


# ---- entries ----------------------------------------------------------------------------------


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_entry(directory: str, key: str, kernel: str, signature, entry: str, cubin: bytes,
                values: dict, material: dict = None) -> str:
    """Write one entry (cubin first, then its JSON, both atomically) and, once, the
    directory's ``key.json`` (``material``, what the key was made of); returns the JSON
    path."""
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, entry_name(kernel, signature))
    _atomic_write(stem + ".cubin", bytes(cubin))
    doc = {"format": FORMAT, "key": key, "kernel": kernel, "entry": entry,
           "signature": [list(s) for s in signature], "abi": [list(f) for f in flat_abi(signature)],
           "values": values, "cubin": os.path.basename(stem) + ".cubin",
           "cubin_sha256": hashlib.sha256(bytes(cubin)).hexdigest()}
    _atomic_write(stem + ".json", json.dumps(doc, indent=1, sort_keys=True).encode())
    key_file = os.path.join(directory, "key.json")
    if not os.path.exists(key_file):
        _atomic_write(key_file, json.dumps(dict(material or {}, key=key), indent=1,
                                           sort_keys=True).encode())
    return stem + ".json"


def read_entry(directory: str, key: str, kernel: str, signature, values: dict = None) -> dict:
    """The entry of ``kernel`` for ``signature`` in ``directory``, checked (format, key,
    kernel, signature, flattened layout, frozen values against ``values``, default
    :func:`frozen_texts`, and the cubin's SHA-256): ``{"entry", "cubin" (path)}``; raises
    :class:`RawMiss` naming what is wrong."""
    stem = os.path.join(directory, entry_name(kernel, signature))
    try:
        with open(stem + ".json", "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise RawMiss(f"no raw entry {stem}.json ({e})") from None
    want = {"format": FORMAT, "key": key, "kernel": kernel,
            "signature": [list(s) for s in signature],
            "abi": [list(f) for f in flat_abi(signature)]}
    for name, v in want.items():
        if doc.get(name) != v:
            raise RawMiss(f"raw entry {stem}.json: `{name}` is {doc.get(name)!r}, expected {v!r}")
    if doc.get("values") != (frozen_texts() if values is None else values):
        raise RawMiss(f"raw entry {stem}.json was written under other module values")
    cubin = os.path.join(directory, str(doc.get("cubin", "")))
    if os.path.dirname(os.path.abspath(cubin)) != os.path.abspath(directory):
        raise RawMiss(f"raw entry {stem}.json names a cubin outside its directory")
    try:
        with open(cubin, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise RawMiss(f"raw entry {stem}.json: cannot read its cubin ({e})") from None
    if digest != doc.get("cubin_sha256"):
        raise RawMiss(f"raw entry {stem}.json: its cubin's SHA-256 differs")
    if not isinstance(doc.get("entry"), str) or not doc["entry"]:
        raise RawMiss(f"raw entry {stem}.json has no entry name")
    return {"entry": doc["entry"], "cubin": cubin}


# ---- export (from the Numba path) -------------------------------------------------------------

def _numba_types_equal(signature, argtypes) -> bool:
    from numba.cuda import types
    from numba.cuda.np import numpy_support

    if len(signature) != len(argtypes):
        return False
    for sig, ty in zip(signature, argtypes):
        dt = numpy_support.from_dtype(np.dtype(sig[1]))
        want = types.Array(dt, int(sig[2]), sig[3]) if sig[0] == "array" else dt
        if ty != want:
            return False
    return True


def _plain(x):
    """A flattened Numba argument as a comparable value (ctypes scalars: their value)."""
    x = getattr(x, "value", x)
    return x if x is not None else 0


def _same_flat(ours, theirs) -> bool:
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        b = _plain(b)
        if isinstance(a, np.floating):
            if np.asarray(a).tobytes() != np.asarray(type(a)(b)).tobytes():
                return False
        elif int(a) != int(b):
            return False
    return True


# Why the exports of this process wrote what they wrote: "reason" (the last export's
# reason for writing nothing at all, or None) and, per kernel name, the outcome of its last
# launch ("written", "exists", or why it was skipped). Read by :func:`export_report`; the
# GPU tests and tools/first_use.py print it, so a run that writes no entry says why.
_REPORT = {"exports": 0, "reason": None, "kernels": {}}


def export_report() -> dict:
    """What this process's :func:`export` calls did (a copy): ``exports`` (calls),
    ``reason`` (why the last wrote nothing at all, else None), ``kernels`` ({name:
    outcome of its last launch})."""
    return {"exports": _REPORT["exports"], "reason": _REPORT["reason"],
            "kernels": dict(_REPORT["kernels"])}


def _nothing(reason: str) -> int:
    _REPORT["reason"] = reason
    return 0


def export(kernels_module, launches, stream) -> int:
    """Write the raw entries of ``launches`` (``[(dispatcher, args)]``, the Numba views a
    plan's launches were prepared with) that this process has not written yet; returns how
    many it wrote. Writes nothing (0) when raw entries are off, under the simulator, when
    the disk cache is off or saw other values, or when the modules' values differ from their
    source; skips a launch whose Numba types or flattened arguments differ from this
    module's (or whose code needs more than a plain module load). Each outcome is kept for
    :func:`export_report`."""
    _REPORT["exports"] += 1
    _REPORT["reason"] = None
    if getattr(kernels_module, "SIM", True):
        return _nothing("the CUDA simulator")
    if not enabled():
        return _nothing("raw entries off (STOCHATTN_KMEANS_RAW=0)")
    if _diskcache._state.get("off") is not None or _diskcache._state.get("path") is None:
        return _nothing(f"the disk cache is off or unattached (state {_diskcache._state!r})")
    names = {m.__name__ for m in _diskcache._modules(kernels_module)}
    if names != set(SOURCES):
        return _nothing(f"the kernels' modules {sorted(names)} are not {sorted(SOURCES)}")
    if not runtime_matches({m: sys.modules[m] for m in SOURCES}):
        return _nothing("the modules' values differ from their source (tuned or patched)")
    from numba import cuda

    try:
        from numba.cuda.core import config
    except ImportError:
        from numba import config
    if getattr(config, "CUDA_ENABLE_NRT", False):
        return _nothing("Numba's NRT is on")
    cc_tuple = cuda.get_current_device().compute_capability
    cc = f"{cc_tuple[0]}{cc_tuple[1]}"
    key = raw_key(cc)
    directory = raw_dir(key)
    values = frozen_texts()
    written = 0
    for kernel, args in launches:
        name = getattr(getattr(kernel, "py_func", None), "__name__", repr(kernel))
        outcome = _export_one(kernel, name, args, stream, directory, key, values, cc, cc_tuple)
        _REPORT["kernels"][name] = outcome
        if outcome == "unwritable":
            return written  # an unwritable directory: the disk cache warned already
        written += outcome == "written"
    return written


def _cubin_bytes(cubin) -> bytes:
    """The bytes of what ``CodeLibrary.get_cubin`` returns: bytes in older numba-cuda, a
    ``cuda.core`` ``ObjectCode`` (its ``code``) in 0.30."""
    code = getattr(cubin, "code", cubin)
    if isinstance(code, (bytes, bytearray, memoryview)):
        return bytes(code)
    raise TypeError(f"get_cubin gave {type(cubin).__name__}, not a cubin's bytes")


def _export_one(kernel, name, args, stream, directory, key, values, cc, cc_tuple) -> str:
    """One launch's entry: "written", "exists", "unwritable" or why it was skipped."""
    try:
        signature = tuple(signature_of(i, a) for i, a in enumerate(args))
    except TypeError as e:
        return f"skipped: an argument without a raw signature ({e})"
    path = os.path.join(directory, entry_name(name, signature) + ".json")
    if os.path.exists(path):  # (written by this or another process)
        return "exists"
    try:
        argtypes = tuple(kernel.typeof_pyval(a) for a in args)
        compiled = kernel.compile(argtypes)
        lib = compiled._codelibrary
        extras = [n for n, v in (("cooperative", compiled.cooperative),
                                 ("debug", compiled.debug), ("extensions", compiled.extensions),
                                 ("setup functions", lib._setup_functions),
                                 ("teardown functions", lib._teardown_functions),
                                 ("use_cooperative", lib.use_cooperative)) if v]
        if extras:
            return f"skipped: needs more than a module load ({', '.join(extras)})"
        if not _numba_types_equal(signature, compiled.argument_types):
            return (f"skipped: Numba's argument types {compiled.argument_types} are not "
                    f"this module's {signature}")
        flat, retr = [], []
        for ty, val in zip(compiled.argument_types, args):
            compiled._prepare_args(ty, val, stream, retr, flat)
        ours, _ = flatten(signature, args)
        if retr:
            return "skipped: Numba copies an argument back after the launch"
        if not _same_flat(ours, flat):
            return "skipped: the flattened arguments differ from Numba's"
        cubin = _cubin_bytes(lib.get_cubin(cc=cc_tuple))
        write_entry(directory, key, name, signature, lib._entry_name, cubin, values,
                    key_material(cc))
    except OSError:
        return "unwritable"
    except Exception as e:  # noqa: BLE001 - another numba-cuda: no raw entry, same results
        return f"skipped: {type(e).__name__}: {e}"[:300]
    return "written"


def _reset_for_tests() -> None:
    _REPORT.update(exports=0, reason=None, kernels={})
    with _lock:
        _parsed.clear()
    _digests.clear()
