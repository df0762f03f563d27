"""Static machine-code statistics of one CUDA kernel instantiation, without a GPU: registers,
spills, and the instructions of every loop by opcode. For predicting before measuring
(how many instructions a change adds to a hot loop) and for comparing revisions when no
GPU is at hand.

    python3 tools/sass_stats.py exact_decode_tc "f16, 128, 8, 16, 3"
    python3 tools/sass_stats.py exact_decode_tc "f16, 128, 8, 16, 3" --rev-dir tools/revs/35347df
    python3 tools/sass_stats.py santa_flash "f16, 128, 4>" --top 12

The family's source is expanded as the runtime expands it
(``stochattn.cuda.kernels.source_text``) and compiled (``stochattn.cuda.build_check``) for
``--arch`` (sm_90) with the tiling options of the default configuration
(``stochattn.cuda.config``), with nvcc when on PATH, else with NVRTC from the
``nvidia-cuda-nvrtc`` wheel; ``-Xptxas -v`` gives registers and spills. ``--rev-dir D``
takes the source, the instantiations and the options from the revision extracted under
``D`` by ``tools/compare_revisions.py prepare`` (its ``kernels`` and ``config`` modules, or
the one ``_sources`` module of a revision before the backend's rooms). The machine code is
disassembled by ``nvdisasm`` (on PATH, or from the ``nvidia-cuda-nvdisasm`` wheel:
``pip install nvidia-cuda-nvdisasm``). A loop is a backward branch: its body is every
instruction from the branch target to the branch. The compiler that the GPU machine's
CuPy uses may be a different release: compare revisions with one compiler.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_FUNC = re.compile(r"^\s*\.text\.(\S+):")
_BRANCH = re.compile(r"\b(?:BRA|BRX)\b.*`\((\.L_x_\d+)\)")


class Sources(NamedTuple):
    """One revision's kernels: ``source_text(family)``, ``name_expressions(family)`` and the
    compiler options of its default configuration."""

    source_text: Callable
    name_expressions: Callable
    options: tuple


def _load(name: str, path: str, package_dir: str):
    spec = importlib.util.spec_from_file_location(name, path,
                                                  submodule_search_locations=[package_dir])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def load_sources(rev_dir: str | None) -> Sources:
    """The kernels of the working tree, or of a revision extracted under ``rev_dir``."""
    if rev_dir is None:
        from stochattn.cuda import config, kernels

        return Sources(kernels.source_text, kernels.name_expressions,
                       tuple(config.get_config().tiling.options()))
    # The revision's stochattn.cuda under another name: its __init__ imports nothing heavy,
    # and the modules read here import each other relatively.
    cuda_dir = os.path.join(rev_dir, "stochattn", "cuda")
    pkg = "_rev_cuda_" + re.sub(r"\W", "_", os.path.abspath(rev_dir))
    if pkg not in sys.modules:
        _load(pkg, os.path.join(cuda_dir, "__init__.py"), cuda_dir)
    if os.path.exists(os.path.join(cuda_dir, "_sources.py")):  # before the rooms: one module
        mod = importlib.import_module(pkg + "._sources")
        return Sources(mod.source_text, mod.name_expressions, tuple(mod.get_config().options()))
    kernels = importlib.import_module(pkg + ".kernels")
    config = importlib.import_module(pkg + ".config")
    return Sources(kernels.source_text, kernels.name_expressions,
                   tuple(config.get_config().tiling.options()))


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for base in sys.path:
        hits = glob.glob(os.path.join(base or ".", "nvidia", "*", "bin", "nvdisasm"))
        if hits:
            return sorted(hits)[-1]
    raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")


def parse_sass(text: str) -> dict:
    """``{function: [(label or None, instruction text), ...]}`` in address order."""
    funcs: dict = {}
    cur = None
    label = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _LABEL.match(line)
        if m:
            label = m.group(1)
            continue
        m = _INSN.match(line)
        if m and cur is not None:
            cur.append((label, m.group(2)))
            label = None
    return funcs


def opcode(insn: str) -> str:
    """``@!P0 LDG.E.64 R2, ...`` -> ``LDG``."""
    word = insn.split()[1] if insn.startswith("@") else insn.split()[0]
    return word.split(".")[0]


def loops(insns) -> list:
    """``[(start, end)]`` index ranges of backward branches (target .. branch), outermost
    first for equal starts."""
    where = {lab: i for i, (lab, _) in enumerate(insns) if lab}
    found = []
    for i, (_, text) in enumerate(insns):
        m = _BRANCH.search(text)
        if m and m.group(1) in where and where[m.group(1)] <= i:
            found.append((where[m.group(1)], i))
    return sorted(found, key=lambda r: (r[0], -r[1]))


def compile_cubin(sources, family: str, pattern: str, arch: str, backend=None):
    names = [n for n in sources.name_expressions(family) if re.search(pattern, n)]
    if not names:
        raise SystemExit(f"no instantiation of {family} matches {pattern!r}: "
                         f"{sources.name_expressions(family)}")
    from stochattn.cuda.build_check import compile_check  # the working tree's driver

    opts = sources.options + ("-Xptxas=-v",)
    res = compile_check(sources.source_text(family), names, backend=backend, arch=arch,
                        options=opts, cubin=True)
    if not res.ok:
        raise SystemExit(res.log)
    return names, res


def report(names, res, top: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(res.cubin)
        sass = subprocess.run([nvdisasm(), "-c", path], check=True, capture_output=True,
                              text=True).stdout
    out = [f"instantiations: {', '.join(names)} ({res.backend})"]
    out += [ln.strip() for ln in res.log.splitlines() if re.search(r"registers|spill", ln)]
    for fn, insns in parse_sass(sass).items():
        out.append(f"\n{fn}: {len(insns)} instructions")
        for a, b in loops(insns):
            ops = collections.Counter(opcode(t) for _, t in insns[a:b + 1])
            head = ", ".join(f"{k} {v}" for k, v in ops.most_common(top))
            out.append(f"  loop [{a}, {b}]: {b - a + 1} instructions: {head}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("family")
    ap.add_argument("match", help="regular expression on the instantiation's name expression")
    ap.add_argument("--rev-dir", help="take the sources from this extracted revision")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--backend", choices=("nvcc", "nvrtc"))
    ap.add_argument("--top", type=int, default=8, help="opcodes listed per loop")
    args = ap.parse_args(argv)
    sources = load_sources(args.rev_dir)
    names, res = compile_cubin(sources, args.family, args.match, args.arch, args.backend)
    print(report(names, res, args.top))


if __name__ == "__main__":
    main()
