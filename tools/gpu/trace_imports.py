"""Issue 30: which call of a warm first index build imports SciPy, cupyx.scipy, numpy.f2py or
array_api_compat. On the H100 (2026-12-07) cProfile of a warm raw build (0.68-0.78 s with
the profiler, 0.40 s without) put ~0.5 s under fingerprint_gpu in lazy imports of those
packages (an importlib LazyLoader module touched through hasattr: cupy.testing is one);
this prints the stack of the first import of each, to find the call to avoid.

Run on the GPU machine from the repository root, after a cold build has written the raw
entries into the same NUMBA_CACHE_DIR:

    D=$(mktemp -d); NUMBA_CACHE_DIR=$D python3 -m tools.first_use --index-only
    NUMBA_CACHE_DIR=$D PYTHONPATH=. python3 tools/gpu/trace_imports.py
"""
import importlib.abc
import sys
import time
import traceback

WATCH = ("scipy", "cupyx.scipy", "numpy.f2py", "array_api_compat")
seen = set()


class Tracer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = next((w for w in WATCH if name == w or name.startswith(w + ".")), None)
        if top and top not in seen:
            seen.add(top)
            print(f"==== first import of {name}", flush=True)
            traceback.print_stack(limit=25, file=sys.stdout)
        return None


import cupy as cp  # noqa: E402
import stochattn  # noqa: E402
from tools.first_use import _inputs, N  # noqa: E402

_, k, v = _inputs(cp)
sys.meta_path.insert(0, Tracer())
t = time.perf_counter()
stochattn.build_doublep_index(k, v, n_clusters=N // 32)
cp.cuda.Device().synchronize()
print("first build", time.perf_counter() - t, "numba" in sys.modules)
