"""Compile the package's CUDA sources without a GPU: the check CI runs and the tools that
read machine code (register counts, SASS) use.

``compile_check(source_text(family), name_expressions(family), ...)`` compiles a family's
expanded source with every instantiation the runtime uses, for ``sm_90`` by default, with
``nvcc`` when on PATH, else with NVRTC from the ``nvidia-cuda-nvrtc`` wheel (through
ctypes); it can return the cubin or the PTX. Not used at run time (the runtime compiles
through CuPy). Nothing here imports CuPy.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .kernels import FAMILIES, SOURCE_DIR, name_expressions, source_text

__all__ = ["CompileResult", "available_backends", "compile_check", "compile_family", "FAMILIES",
           "SOURCE_DIR", "source_text", "name_expressions"]


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


def compile_family(family: str, *, backend: str | None = None, arch: str = "sm_90", config=None,
                   options=None, cubin: bool = False, ptx: bool = False) -> CompileResult:
    """:func:`compile_check` of one kernel family: its expanded source with every name
    expression the runtime may launch."""
    return compile_check(source_text(family), name_expressions(family), backend=backend,
                         arch=arch, config=config, options=options, cubin=cubin, ptx=ptx)
