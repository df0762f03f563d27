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

__all__ = [
    "CompileResult",
    "FAMILIES",
    "HEAD_DIMS",
    "GROUP_MAXES",
    "CTYPES",
    "source_text",
    "name_expressions",
    "group_max",
    "available_backends",
    "compile_check",
]

SOURCE_DIR = Path(__file__).resolve().parent

# Kernel family -> source file. One cupy.RawModule per family.
FAMILIES = {"exact_decode": "exact_decode.cu", "santa_prop": "santa_prop.cu"}

# Element type names (validation's dtype names) -> CUDA types.
CTYPES = {"float16": "stochattn::f16", "bfloat16": "stochattn::bf16"}
HEAD_DIMS = (64, 128)
# Register arrays are sized for GMAX query heads per KV head; G itself is a run-time value.
GROUP_MAXES = (4, 8)
MAX_GROUP = max(GROUP_MAXES)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_OPTIONS = ("-std=c++17",)


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


def name_expressions(family: str) -> list:
    """Every template instantiation the Python wrappers may launch, as NVRTC name expressions."""
    names = []
    for ctype in CTYPES.values():
        if family == "exact_decode":
            for d in HEAD_DIMS:
                for gm in GROUP_MAXES:
                    names.append(f"exact_decode_chunk<{ctype}, {d}, {gm}>")
            names.append(f"exact_decode_merge<{ctype}>")
        elif family == "santa_prop":
            for d in HEAD_DIMS:
                for gm in GROUP_MAXES:
                    names.append(f"santa_prop_pass1<{ctype}, {d}, {gm}>")
                names.append(f"santa_prop_sample<{ctype}, {d}>")
        else:
            raise KeyError(family)
    return names


# ---- compiler check (no GPU needed) -------------------------------------------------------


@dataclass
class CompileResult:
    """Outcome of one compilation: ``ok``, the compiler's log and which backend ran."""

    ok: bool
    log: str
    backend: str


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


def _compile_nvcc(code: str, names, arch: str) -> CompileResult:
    nvcc = _nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "check.cu")
        with open(src, "w") as f:
            f.write(_with_instantiations(code, names))
        cmd = [nvcc, f"-arch={arch}", *_OPTIONS, "-c", src, "-o", os.path.join(tmp, "check.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    return CompileResult(proc.returncode == 0, proc.stdout + proc.stderr, "nvcc")


def _compile_nvrtc(code: str, names, arch: str) -> CompileResult:
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
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in _OPTIONS)]
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
        return CompileResult(ok, log, "nvrtc")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_check(code: str, names=(), *, backend: str | None = None, arch: str = "sm_90") -> CompileResult:
    """Compile ``code`` with the template instantiations ``names`` for ``arch``.

    ``backend``: "nvcc", "nvrtc" or None (nvcc when on PATH, else NVRTC from the
    ``nvidia-cuda-nvrtc`` wheel). Raises ``RuntimeError`` when the backend is missing.
    """
    found = available_backends()
    if backend is None:
        backend = "nvcc" if found["nvcc"] else "nvrtc" if found["nvrtc"] else None
    if backend is None or not found.get(backend):
        raise RuntimeError(f"no CUDA compiler: nvcc not on PATH and no libnvrtc found ({found})")
    if backend == "nvcc":
        return _compile_nvcc(code, list(names), arch)
    return _compile_nvrtc(code, list(names), arch)
