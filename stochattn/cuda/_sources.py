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
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = [
    "TileConfig",
    "TcTiling",
    "TC_TILINGS",
    "PROP_TC_TILINGS",
    "get_tc_tiling",
    "set_tc_tiling",
    "get_prop_tc_tiling",
    "set_prop_tc_tiling",
    "FLASH_TC_TILINGS",
    "get_flash_tc_tiling",
    "set_flash_tc_tiling",
    "flash_tc_smem_bytes",
    "smem_limit",
    "DEFAULT_CONFIG",
    "get_config",
    "set_config",
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



@dataclass(frozen=True)
class TileConfig:
    """Compile-time tiling of the streaming kernels (exact decode, S²ANTA-prop pass 1):
    the one place of truth for the ``STOCHATTN_*`` macros of ``decode_common.cuh`` and the
    host-side quantities derived from them (tile rows, threads, shared memory).

    ``stage_bytes``: bytes of K (and as much of V) per cp.async stage; ``stages``: pipeline
    depth; ``threads``: threads per CTA; ``reduce``: "butterfly" (all-reduce every partial
    dot product) or "scatter" (reduce-scatter, then one broadcast per logit).

    ``pdl``: programmatic dependent launch (sm_90). Every kernel is compiled with
    ``-DSTOCHATTN_PDL=1`` (its entry waits for the grid before it, then lets the next one
    launch: ``STOCHATTN_PDL_ENTRY`` in ``decode_common.cuh``), and the second and later
    kernels of one call are launched with the programmatic-serialization attribute
    (``_module.Packed(..., pdl=True)``), so that each launch overlaps the tail of the kernel
    before it. Off by default until timed on a GPU; ``STOCHATTN_PDL=1`` in the environment
    turns it on for one process.
    """

    stage_bytes: int = 4096
    stages: int = 4
    threads: int = 128
    reduce: str = "butterfly"
    pdl: bool = False

    def __post_init__(self):
        if self.reduce not in _REDUCE_CODES:
            raise ValueError(f"`reduce` must be one of {tuple(_REDUCE_CODES)}, got {self.reduce!r}")
        if self.threads not in (64, 128, 256, 512) or not 2 <= self.stages <= 8:
            raise ValueError(f"unsupported threads/stages: {self}")
        if not isinstance(self.pdl, bool):
            raise TypeError(f"`pdl` must be a bool, got {type(self.pdl).__name__}")
        for d in HEAD_DIMS:  # every head dim must tile: a power of two of rows per thread
            rpt = self.rows_per_thread(d)
            if rpt < 1 or rpt & (rpt - 1) or self.tile_rows(d) * 2 * d != self.stage_bytes \
                    or self.tile_rows(d) > 256:
                raise ValueError(f"stage_bytes {self.stage_bytes} does not tile head_dim {d} with "
                                 f"{self.threads} threads")
        # santa_flash.cu's per-warp pipeline: stages of stage_bytes / warps, 1 to 32 rows of
        # head dim 64 (a whole number of rows per lane for both head dims).
        if not 512 <= self.warp_stage_bytes() <= 4096:
            raise ValueError(f"stage_bytes / warps must be in [512, 4096], got {self}")

    def options(self) -> tuple:
        """NVRTC / nvcc options: the language standard and the tiling macros."""
        return _OPTIONS + (f"-DSTOCHATTN_STAGE_BYTES={self.stage_bytes}",
                           f"-DSTOCHATTN_STAGES={self.stages}",
                           f"-DSTOCHATTN_THREADS={self.threads}",
                           f"-DSTOCHATTN_REDUCE={_REDUCE_CODES[self.reduce]}") + (
                               ("-DSTOCHATTN_PDL=1",) if self.pdl else ())

    def tile_rows(self, head_dim: int) -> int:
        """Rows per pipeline stage (decode_common.cuh: Tiling::kTileRows)."""
        return self.stage_bytes // (2 * head_dim)

    def rows_per_thread(self, head_dim: int) -> int:
        return self.tile_rows(head_dim) // (self.threads // (head_dim // 8))

    def warp_stage_bytes(self) -> int:
        """Bytes of one stage of a warp's own K pipeline (santa_flash.cu: WarpTiling)."""
        return self.stage_bytes // (self.threads // 32)

    def smem_bytes(self, family: str, head_dim: int, gmax: int, tile_size: int = 0) -> int:
        """Dynamic shared memory of the family's streaming kernel (static arrays excluded);
        ``tile_size``: the sampling tile of santa_flash (its per-warp buffers)."""
        if family == "exact_decode":  # K+V stages, reused by the cross-warp merge
            merge = (2 + head_dim) * (self.threads // 32) * gmax * 4
            return max(self.stages * 2 * self.stage_bytes, merge)
        if family == "santa_prop":  # K stages
            return self.stages * self.stage_bytes
        if family == "doublep_decode":  # K+V stages, reused by the merge; the row list follows
            merge = (2 + head_dim) * (self.threads // 32) * gmax * 4
            return max(self.stages * 2 * self.stage_bytes, merge)
        if family == "santa_flash":  # per warp: K stages, logits, counts, row list; then merge
            if tile_size <= 0:
                raise ValueError("santa_flash's shared memory depends on `tile_size`")
            warps = self.threads // 32
            per_warp = FLASH_WARP_STAGES * self.warp_stage_bytes() + tile_size * (8 * gmax + 4)
            return max(warps * per_warp, (2 + head_dim) * warps * gmax * 4)
        raise KeyError(family)

    def label(self) -> str:
        return (f"{self.stage_bytes // 1024}K x{self.stages} t{self.threads} {self.reduce}"
                + (" pdl" if self.pdl else ""))


_REDUCE_CODES = {"butterfly": 0, "scatter": 1}
# STOCHATTN_LINEINFO=1 in the environment compiles every kernel with a line table (for
# Nsight Compute's per-line counters: ncu --import-source yes, --page source); the options
# are part of every module and plan key, so it never mixes with a build without it.
_OPTIONS = ("-std=c++17",) + (("-lineinfo",) if os.environ.get("STOCHATTN_LINEINFO") == "1"
                              else ())

# The configuration the wrappers use. To change the default, edit this line (tests and
# benchmarks follow); STOCHATTN_TILE_CONFIG="stage_bytes,stages,threads,reduce" in the
# environment overrides it for one process (e.g. "16384,3,256,scatter").
DEFAULT_CONFIG = TileConfig(stage_bytes=8192, stages=3, threads=128, reduce="scatter")


def _config_from_env() -> TileConfig:
    text = os.environ.get("STOCHATTN_TILE_CONFIG", "").strip()
    config = DEFAULT_CONFIG
    if text:
        sb, st, th, red = (x.strip() for x in text.split(","))
        config = TileConfig(int(sb), int(st), int(th), red)
    if os.environ.get("STOCHATTN_PDL") == "1":
        config = replace(config, pdl=True)
    return config


_active = [_config_from_env()]


def get_config() -> TileConfig:
    """The tiling the wrappers compile and launch now (part of every plan-cache key)."""
    return _active[0]


def set_config(config: TileConfig) -> TileConfig:
    """Use ``config`` for the kernels launched from now on (tuning); returns the previous one."""
    if not isinstance(config, TileConfig):
        raise TypeError(f"`config` must be a TileConfig, got {type(config).__name__}")
    prev, _active[0] = _active[0], config
    return prev


@dataclass(frozen=True)
class TcTiling:
    """Tiling of a tensor-core decode kernel (template parameters, independent of
    :class:`TileConfig`): ``warps`` per CTA, each streaming its own tiles of ``rows`` keys (a
    multiple of 16) through ``stages`` cp.async buffers of ``matrices`` matrices (2: K and V,
    ``exact_decode_tc.cu``; 1: K alone, ``santa_prop_logits_tc``)."""

    warps: int = 8
    rows: int = 16
    stages: int = 3
    matrices: int = 2

    def __post_init__(self):
        if self.warps not in (2, 4, 8) or self.rows not in (16, 32, 64) \
                or not 2 <= self.stages <= 8 or self.matrices not in (1, 2):
            raise ValueError(f"unsupported tensor-core tiling: {self}")
        if self.smem_bytes(max(HEAD_DIMS)) > _SMEM_LIMIT:
            raise ValueError(f"tensor-core tiling {self} needs {self.smem_bytes(max(HEAD_DIMS))} "
                             f"bytes of shared memory at head_dim {max(HEAD_DIMS)}, the limit is "
                             f"{_SMEM_LIMIT}")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int) -> int:
        """Per-warp rings; with K and V, reused by the cross-warp merge ((2 + D) floats per
        warp and head, 8 heads)."""
        rings = self.warps * self.stages * self.matrices * self.rows * head_dim * 2
        if self.matrices == 1:
            return rings
        return max(rings, (2 + head_dim) * self.warps * 8 * 4)

    def align(self) -> int:
        """Chunk lengths are multiples of this: one tile per warp."""
        return self.warps * self.rows

    def template_args(self) -> str:
        return f"{self.warps}, {self.rows}, {self.stages}"

    def params(self) -> dict:
        """The kernels' template parameters of this tiling, by name."""
        return dict(WARPS=self.warps, ROWS=self.rows, STAGES=self.stages)

    def label(self) -> str:
        return f"tc w{self.warps} r{self.rows} s{self.stages}" + (" K" if self.matrices == 1 else "")


_SMEM_LIMIT = 227 * 1024  # sm_90: dynamic shared memory per CTA

# Every tensor-core tiling that is compiled (one instantiation per dtype and head dim
# each); the first is the default. bench/tune_exact_tc.py compares them. H200, Hq 32 / Hkv 8
# / D 128, three runs (2026-12-04): all four within ~2% of each other at batch 8 and 32
# (103-110% of the 4.25 TB/s K+V floor); w8 r16 s3 is the fastest at batch 1 (CUDA-graph
# replay at 32k: 36 us against 38 us for the others), the shape furthest from the floor,
# and gives up ~1.5% at batch 32 / 128k against w4 r32 s2.
TC_TILINGS = (TcTiling(8, 16, 3), TcTiling(4, 16, 3), TcTiling(4, 16, 4), TcTiling(4, 32, 2))
_active_tc = [TC_TILINGS[0]]

# The compiled tilings of S²ANTA-prop's tensor-core pass 1 (santa_prop_logits_tc: K rings
# only, rows 16 or 32); the first is the default. bench/prop_breakdown.py, H200, fp16,
# S = 256 (2026-12-04, bench/results/prop_breakdown_2026-12-04b.json): w4 r32 s4 is the
# fastest at every shape measured (batch 8 / 32k 170 us against 176 and 181; batch 8 / 128k
# 588 against 613 and 617; batch 32 / 32k 611 against 630 and 626; batch 1 / 128k 107
# against 110 and 111).
PROP_TC_TILINGS = (TcTiling(4, 32, 4, 1), TcTiling(8, 16, 3, 1), TcTiling(8, 16, 6, 1))
_active_prop_tc = [PROP_TC_TILINGS[0]]

# The compiled tilings of S²ANTA-flash's tensor-core kernel (santa_flash_tc_chunk: K rings
# only, plus per-warp sampling buffers, flash_tc_smem_bytes); the first is the default. Not
# yet timed (2026-12-05): w4 r16 s4 fits 3 CTAs (12 warps) per SM at tile 64, like the
# CUDA-core kernel, with 12 KB of K in flight per warp; w4 r32 s4 is prop's fastest ring
# (one CTA per SM); w8 r16 s2: 8 warps with 4 KB in flight each, but its registers
# (157-213 at D = 128) allow one CTA per SM, and at D = 64 / GMAX 4 ptxas caps it at 128
# and spills 88 bytes (nvcc 13, 2026-12-05).
FLASH_TC_TILINGS = (TcTiling(4, 16, 4, 1), TcTiling(4, 32, 4, 1), TcTiling(8, 16, 2, 1))
_active_flash_tc = [FLASH_TC_TILINGS[0]]


def get_tc_tiling() -> TcTiling:
    """The tensor-core tiling that ``exact_decode(..., kernel="tc")`` launches now."""
    return _active_tc[0]


def set_tc_tiling(tiling: TcTiling) -> TcTiling:
    """Launch ``tiling`` (one of :data:`TC_TILINGS`) from now on (tuning); returns the
    previous one."""
    if tiling not in TC_TILINGS:
        raise ValueError(f"`tiling` must be one of the compiled {TC_TILINGS}, got {tiling!r}")
    prev, _active_tc[0] = _active_tc[0], tiling
    return prev


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def get_prop_tc_tiling() -> TcTiling:
    """The tiling that ``santa_prop(..., kernel="tc")`` launches now."""
    return _active_prop_tc[0]


def set_prop_tc_tiling(tiling: TcTiling) -> TcTiling:
    """Launch ``tiling`` (one of :data:`PROP_TC_TILINGS`) for prop's pass 1 from now on
    (tuning); returns the previous one."""
    if tiling not in PROP_TC_TILINGS:
        raise ValueError(f"`tiling` must be one of the compiled {PROP_TC_TILINGS}, got {tiling!r}")
    prev, _active_prop_tc[0] = _active_prop_tc[0], tiling
    return prev


def get_flash_tc_tiling() -> TcTiling:
    """The tiling that ``santa_flash(..., kernel="tc")`` launches now."""
    return _active_flash_tc[0]


def set_flash_tc_tiling(tiling: TcTiling) -> TcTiling:
    """Launch ``tiling`` (one of :data:`FLASH_TC_TILINGS`) for S²ANTA-flash's tensor-core
    kernel from now on (tuning); returns the previous one."""
    if tiling not in FLASH_TC_TILINGS:
        raise ValueError(f"`tiling` must be one of the compiled {FLASH_TC_TILINGS}, got {tiling!r}")
    prev, _active_flash_tc[0] = _active_flash_tc[0], tiling
    return prev


def flash_tc_smem_bytes(tiling: TcTiling, head_dim: int, gmax: int, tile_size: int) -> int:
    """Dynamic shared memory of ``santa_flash_tc_chunk`` (santa_flash_tc.cu): per warp the K
    ring, the padded logits [gmax][tile_size + 8] fp32, the counts [gmax][tile_size] and the
    row list [tile_size] int32; reused by the cross-warp merge ((2 + D) floats per warp and
    head)."""
    per_warp = (tiling.stages * tiling.rows * head_dim * 2 + tile_size * (8 * gmax + 4)
                + 32 * gmax)
    return max(tiling.warps * per_warp, (2 + head_dim) * tiling.warps * gmax * 4)


def smem_limit() -> int:
    """Dynamic shared memory one CTA may use on sm_90 (bytes)."""
    return _SMEM_LIMIT


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


#: Depth of a warp's K pipeline in santa_flash.cu (kFlashStages, read from the source).
FLASH_WARP_STAGES = _flash_warp_stages()


def name_expressions(family: str, dtypes=None) -> list:
    """Every template instantiation the Python wrappers may launch, as NVRTC name expressions
    (``dtypes``: restrict to these element type names, e.g. ``("float16",)`` for tuning).

    Built from the kernels' declarations in the sources (:func:`._abi.kernel`): this table
    says only which template arguments are compiled."""
    from . import _abi

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


def _compile_nvcc(code: str, names, arch: str, options=_OPTIONS, cubin=False,
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


def _compile_nvrtc(code: str, names, arch: str, options=_OPTIONS, cubin=False,
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
                  config: TileConfig | None = None, options=None,
                  cubin: bool = False, ptx: bool = False) -> CompileResult:
    """Compile ``code`` with the template instantiations ``names`` for ``arch``, with the
    tiling macros of ``config`` (default: the active configuration), or with exactly the
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
        options = (config or get_config()).options()
    if backend == "nvcc":
        return _compile_nvcc(code, list(names), arch, tuple(options), cubin, ptx)
    return _compile_nvrtc(code, list(names), arch, tuple(options), cubin, ptx)
