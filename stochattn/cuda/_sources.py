"""The CUDA sources of this package, the template instantiations the wrappers use, and a
compiler check that runs without a GPU.

One list serves the runtime (:mod:`._module` compiles each family with CuPy's NVRTC and
these ``name_expressions``) and the CI check (``tests/test_cuda_sources.py`` compiles the
same expanded text with ``nvcc`` or with NVRTC through ctypes). Local ``#include "x.cuh"``
lines are expanded into one text, so CuPy's compile cache (keyed on the source text) sees
header edits, and no include path is needed.

Nothing here imports CuPy.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CompileResult", "FAMILIES", "HEAD_DIMS", "GROUP_MAXES", "CTYPES", "source_text",
           "name_expressions", "group_max", "available_backends", "compile_check"]

SOURCE_DIR = Path(__file__).resolve().parent

# Kernel family -> source file. One cupy.RawModule per family.
FAMILIES = {"exact_decode": "exact_decode.cu", "exact_decode_tc": "exact_decode_tc.cu",
            "santa_prop": "santa_prop.cu",
            "santa_flash": "santa_flash.cu", "santa_flash_tc": "santa_flash_tc.cu",
            "doublep_decode": "doublep_decode.cu",
            "doublep_append": "doublep_append.cu"}

# Element type names (validation's dtype names) -> CUDA types.
CTYPES = {"float16": "stochattn::f16", "bfloat16": "stochattn::bf16"}
APPEND_CTYPES = dict(CTYPES, float32="float")
HEAD_DIMS = (64, 128)
# Register arrays are sized for GMAX query heads per KV head; G itself is a run-time value.
GROUP_MAXES = (4, 8)
MAX_GROUP = max(GROUP_MAXES)
# The families whose module holds the split-KV merge kernel (exact_decode_merge).
MERGE_FAMILIES = ("exact_decode", "exact_decode_tc", "santa_flash", "santa_flash_tc",
                  "doublep_decode")



_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def group_max(group: int) -> int:
    """The smallest compiled GMAX that holds a group of ``group`` query heads."""
    for gm in GROUP_MAXES:
        if group <= gm:
            return gm
    raise ValueError(f"query heads per KV head must be <= {MAX_GROUP}, got {group}")


def _expand(path: Path, seen: set) -> str:
    out = []
    for line in path.read_text().splitlines():
        m = _INCLUDE.match(line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if inc not in seen:  # every local header has #pragma once semantics
                seen.add(inc)
                out.append(f"// ---- begin {m.group(1)} ----")
                out.append(_expand(inc, seen))
                out.append(f"// ---- end {m.group(1)} ----")
            continue
        if line.strip() == "#pragma once":  # meaningless once expanded
            continue
        out.append(line)
    return "\n".join(out)


def source_text(family: str) -> str:
    """The family's ``.cu`` file with its local headers expanded in place."""
    return _expand(SOURCE_DIR / FAMILIES[family], set())


def _flash_warp_stages() -> int:
    from . import _abi

    return _abi.constant("santa_flash", "kFlashStages")


#: Depth of a warp's K pipeline of S²ANTA-flash (flash_tile.cuh: kFlashStages, read from the
#: source).
FLASH_WARP_STAGES = _flash_warp_stages()


def name_expressions(family: str, dtypes=None) -> list:
    """Every template instantiation the Python wrappers may launch, as NVRTC name expressions
    (``dtypes``: restrict to these element type names, e.g. ``("float16",)`` for tuning).

    Built from the kernels' declarations in the sources (:func:`._abi.kernel`): this table
    says only which template arguments are compiled."""
    from . import _abi
    from .config import FLASH_TC_TILINGS, PROP_TC_TILINGS, TC_TILINGS

    def k(name):
        return _abi.kernel(family, name)

    names = []
    if family == "doublep_append":  # the index's cache may also be float32
        return [k(kernel).expr(T=ctype) for dname, ctype in APPEND_CTYPES.items()
                if dtypes is None or dname in dtypes
                for kernel in ("doublep_append_score", "doublep_append")]
    for dname, T in CTYPES.items():
        if dtypes is not None and dname not in dtypes:
            continue
        if family == "exact_decode":
            names += [k("exact_decode_chunk").expr(T=T, D=d, GMAX=gm)
                      for d in HEAD_DIMS for gm in GROUP_MAXES]
        elif family == "exact_decode_tc":
            names += [k("exact_decode_tc_chunk").expr(T=T, D=d, **t.params())
                      for d in HEAD_DIMS for t in TC_TILINGS]
        elif family == "santa_prop":
            for d in HEAD_DIMS:
                for gm in GROUP_MAXES:
                    names += [k("santa_prop_logits").expr(T=T, D=d, GMAX=gm, QHAT=qhat)
                              for qhat in (False, True)]
                names.append(k("santa_prop_sample").expr(T=T, D=d))
                names += [k("santa_prop_logits_tc").expr(T=T, D=d, **t.params())
                          for t in PROP_TC_TILINGS]
            names.append(k("bernoulli_qhat").expr(T=T))
            names += [k("bernoulli_logits_fm").expr(T=T, GMAX=gm) for gm in GROUP_MAXES]
        elif family == "santa_flash":
            names += [k("santa_flash_chunk").expr(T=T, D=d, GMAX=gm)
                      for d in HEAD_DIMS for gm in GROUP_MAXES]
        elif family == "santa_flash_tc":
            names += [k("santa_flash_tc_chunk").expr(T=T, D=d, GMAX=gm, **t.params())
                      for d in HEAD_DIMS for gm in GROUP_MAXES for t in FLASH_TC_TILINGS]
        elif family == "doublep_decode":
            for d in HEAD_DIMS:
                for gm in GROUP_MAXES:
                    names += [k("doublep_cluster_logits").expr(T=T, D=d, GMAX=gm),
                              k("doublep_attend").expr(T=T, D=d, GMAX=gm, SAMPLE=False),
                              k("doublep_attend").expr(T=T, D=d, GMAX=gm, SAMPLE=True),
                              k("doublep_true_mass").expr(T=T, D=d, GMAX=gm)]
        else:
            raise KeyError(family)
        if family in MERGE_FAMILIES:  # the split-KV merge (merge.cuh)
            names.append(k("exact_decode_merge").expr(T=T))
    if family == "santa_prop":
        names.append(k("santa_prop_tiles").expr())  # not a template: one kernel for every dtype
    if family == "doublep_decode":
        names += [k("doublep_select").expr(), k("doublep_select_sorted").expr()]
        names += [k("doublep_rows").expr(GMAX=gm, SAMPLE=flag) for gm in GROUP_MAXES
                  for flag in (False, True)]
    return names


# ---- compiler check (no GPU needed) -------------------------------------------------------


@dataclass
class CompileResult:
    """Outcome of one compilation: ``ok``, the compiler's log and which backend ran."""

    ok: bool
    log: str
    backend: str
    cubin: bytes | None = None  # the machine code, when compile_check(..., cubin=True)
    ptx: str | None = None  # the PTX, when compile_check(..., ptx=True)


def _nvcc() -> str | None:
    return shutil.which("nvcc")


def _nvrtc_library() -> str | None:
    """libnvrtc from the ``nvidia-cuda-nvrtc`` wheel (site-packages/nvidia/**/lib)."""
    candidates = []
    for base in sys.path:
        if not base or not os.path.isdir(os.path.join(base, "nvidia")):
            continue
        candidates += glob.glob(os.path.join(base, "nvidia", "**", "lib", "libnvrtc.so*"), recursive=True)
    # Prefer the plain runtime library over libnvrtc-builtins and newest versions first.
    candidates = sorted({c for c in candidates if "builtins" not in os.path.basename(c)}, reverse=True)
    return candidates[0] if candidates else None


def available_backends() -> dict:
    """``{"nvcc": path or None, "nvrtc": path or None}``."""
    return {"nvcc": _nvcc(), "nvrtc": _nvrtc_library()}


def _with_instantiations(code: str, names) -> str:
    # Taking the address of a __global__ template specialisation in host code makes nvcc
    # instantiate (and compile) its device code, as NVRTC's name expressions do.
    refs = ",\n  ".join(f"(void*)&{n}" for n in names)
    return code + ("\n\nvoid* stochattn_instantiations[] = {\n  " + refs + "\n};\n" if names else "\n")


def _compile_nvcc(code: str, names, arch: str, options=("-std=c++17",), cubin=False,
                  ptx=False) -> CompileResult:
    nvcc = _nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "check.cu")
        with open(src, "w") as f:
            f.write(_with_instantiations(code, names))
        kind, ext = ("-ptx", "ptx") if ptx else ("-cubin", "cubin") if cubin else ("-c", "o")
        out = os.path.join(tmp, "check." + ext)
        cmd = [nvcc, f"-arch={arch}", *options, kind, src, "-o", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        ok = proc.returncode == 0
        binary = Path(out).read_bytes() if cubin and not ptx and ok else None
        text = Path(out).read_text() if ptx and ok else None
    return CompileResult(ok, proc.stdout + proc.stderr, "nvcc", binary, text)


def _compile_nvrtc(code: str, names, arch: str, options=("-std=c++17",), cubin=False,
                   ptx=False) -> CompileResult:
    lib = ctypes.CDLL(_nvrtc_library())
    prog = ctypes.c_void_p()

    def check(status, what):
        if status != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {lib.nvrtcGetErrorString(status).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"check.cu", 0, None, None),
          "nvrtcCreateProgram")
    try:
        for n in names:
            check(lib.nvrtcAddNameExpression(prog, n.encode()), "nvrtcAddNameExpression")
        if ptx:  # NVRTC hands out PTX for a virtual architecture only
            arch = arch.replace("sm_", "compute_")
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.value.decode(errors="replace")
        ok = status == 0
        if ok:  # every name expression must resolve to a compiled kernel
            for n in names:
                lowered = ctypes.c_char_p()
                st = lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(lowered))
                if st != 0:
                    ok = False
                    log += f"\nname expression {n!r} did not resolve"
        binary = text = None
        if ok and ptx:
            check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            buf = ctypes.create_string_buffer(size.value)
            check(lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            text = buf.value.decode()
        elif ok and cubin:
            check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            buf = ctypes.create_string_buffer(size.value)
            check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            binary = buf.raw
        return CompileResult(ok, log, "nvrtc", binary, text)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_check(code: str, names=(), *, backend: str | None = None, arch: str = "sm_90",
                  config=None, options=None,
                  cubin: bool = False, ptx: bool = False) -> CompileResult:
    """Compile ``code`` with the template instantiations ``names`` for ``arch``, with the
    options of ``config`` (a :class:`.config.TileConfig`; default: the process default
    config's tiling), or with exactly the
    compiler ``options`` given (a tuple of strings; then ``config`` is not used).

    ``backend``: "nvcc", "nvrtc" or None (nvcc when on PATH, else NVRTC from the
    ``nvidia-cuda-nvrtc`` wheel). ``cubin``: also return the machine code (``arch`` must
    then be a real architecture such as sm_90); ``ptx``: return the PTX instead (for the
    virtual architecture of ``arch``). Raises ``RuntimeError`` when the backend is missing.
    """
    found = available_backends()
    if backend is None:
        backend = "nvcc" if found["nvcc"] else "nvrtc" if found["nvrtc"] else None
    if backend is None or not found.get(backend):
        raise RuntimeError(f"no CUDA compiler: nvcc not on PATH and no libnvrtc found ({found})")
    if options is None:
        if config is None:
            from .config import get_config

            config = get_config().tiling
        options = config.options()
    if backend == "nvcc":
        return _compile_nvcc(code, list(names), arch, tuple(options), cubin, ptx)
    return _compile_nvrtc(code, list(names), arch, tuple(options), cubin, ptx)


# ---- deprecated spellings of the config (tests and tuning tools) -----------------------------
# The tuning knobs live in :mod:`stochattn.cuda.config` (one GpuConfig per device). These
# forward to the process default's config until every caller uses set_config/using_config.

_CONFIG_NAMES = {"TileConfig", "TcTiling", "TC_TILINGS", "PROP_TC_TILINGS", "FLASH_TC_TILINGS",
                 "flash_tc_smem_bytes", "smem_limit"}


def __getattr__(name):
    if name in _CONFIG_NAMES:
        from . import config

        return getattr(config, name)
    if name == "DEFAULT_CONFIG":
        from .config import DEFAULT_TILE_CONFIG

        return DEFAULT_TILE_CONFIG
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


get_tc_tiling, set_tc_tiling = _knob("tc_tiling")
get_prop_tc_tiling, set_prop_tc_tiling = _knob("prop_tc_tiling")
get_flash_tc_tiling, set_flash_tc_tiling = _knob("flash_tc_tiling")
