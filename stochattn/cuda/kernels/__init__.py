"""The CUDA C++ sources of the GPU backend (this folder: ``.cu`` files are compiled, one
per kernel family; ``.cuh`` files are included) and the template instantiations the host
modules launch.

One list serves the runtime (:mod:`..runtime.launch` compiles each family with CuPy's NVRTC
and these ``name_expressions``) and the offline check (:mod:`..build_check` compiles the
same expanded text with ``nvcc`` or with NVRTC through ctypes). Local ``#include "x.cuh"``
lines are expanded into one text, so CuPy's compile cache (keyed on the source text) sees
header edits, and no include path is needed. Each kernel's contract (name, template
parameters, arguments) is read from its signature by :mod:`.abi`.

Nothing here imports CuPy.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["SOURCE_DIR", "FAMILIES", "CTYPES", "APPEND_CTYPES", "HEAD_DIMS", "GROUP_MAXES",
           "DOUBLEP_SUB_COUNTS",
           "MAX_GROUP", "MERGE_FAMILIES", "source_text", "name_expressions", "group_max"]

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
#: Sub-centroids per cluster that Double-P's mass="sub" cluster logits are compiled for
#: (doublep_cluster_logits_sub's NSUB; the GPU decode refuses an index with another n_sub).
DOUBLEP_SUB_COUNTS = (2, 4, 8)
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


def name_expressions(family: str, dtypes=None) -> list:
    """Every template instantiation the Python wrappers may launch, as NVRTC name expressions
    (``dtypes``: restrict to these element type names, e.g. ``("float16",)`` for tuning).

    Built from the kernels' declarations in the sources (:func:`.abi.kernel`): this table
    says only which template arguments are compiled."""
    from ..config import FLASH_TC_TILINGS, PROP_TC_TILINGS, TC_TILINGS
    from . import abi

    def k(name):
        return abi.kernel(family, name)

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
                names.append(k("santa_prop_sample_budgets").expr(T=T, D=d))
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
                    names += [k("doublep_cluster_logits_sub").expr(T=T, D=d, GMAX=gm, NSUB=m)
                              for m in DOUBLEP_SUB_COUNTS]
                    names += [k("doublep_cluster_logits").expr(T=T, D=d, GMAX=gm),
                              k("doublep_attend").expr(T=T, D=d, GMAX=gm, SAMPLE=False),
                              k("doublep_attend").expr(T=T, D=d, GMAX=gm, SAMPLE=True),
                              k("doublep_true_mass").expr(T=T, D=d, GMAX=gm)]
        else:
            raise KeyError(family)
        if family in MERGE_FAMILIES:  # the split-KV merge (merge.cuh)
            names.append(k("exact_decode_merge").expr(T=T))
    if family == "santa_prop":
        names.append(k("santa_prop_tiles").expr())  # one kernel for every dtype (on demand)
        # error-targeted budgets (compiled on demand too: decode_common.cuh)
        names += [k("santa_prop_second_moment").expr(), k("santa_prop_budgets").expr(),
                  k("value_sqnorms_rows").expr()]
        # Double-P's sampled variant with error-targeted budgets (stochattn.cuda.doublep; on demand)
        names += [k("doublep_split_prep").expr(), k("doublep_split_budgets").expr()]
    if family == "doublep_decode":
        names += [k("doublep_select").expr(), k("doublep_select_sorted").expr()]
        names += [k("doublep_rows").expr(GMAX=gm, SAMPLE=flag) for gm in GROUP_MAXES
                  for flag in (False, True)]
    return names
