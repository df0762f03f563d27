"""Double-P decode benchmark on one GPU: stage 1 + stage 2 + attention (one call of
:func:`stochattn.doublep_attention` on a GPU index) against torch SDPA, FlashInfer 0.6.0
(when importable), our exact kernel and the K+V bandwidth floor, all in the same run; plus
what the selection did (clusters selected and exact, tokens read exactly, estimated vs true
mass) and the output error against exact attention.

Shape: Llama-3.1-8B decode (Hq 32, Hkv 8, D 128), float16. Inputs: the calibrated
long-context generator (``stochattn.eval.calibrated.make_calibrated_inputs``: clustered keys in
topic runs, sinks, power-law recency, per-head peakedness fitted to SmolLM2; see
docs/generator.md) for one sequence per context length, copied to every batch entry (each
stored separately, so every byte is read). The index: ``build_doublep_index`` on the GPU
for that sequence (``tokens / tokens_per_cluster`` clusters, default 32 tokens per
cluster, 10 iterations; its build time is reported), replicated over the batch with
``DoublePIndex.stack``.

Timing: median over batches of back-to-back calls between two CUDA events (as
bench_decode.py's ``median_us``), after warm-up. FlashInfer runs in its native paged
layout (copied once, untimed); the fastest exact baseline is the minimum over SDPA and the
FlashInfer variants.

``--mass paper,sub`` also times Double-P's sub-centroid cluster mass (issue 31,
``doublep_attention(..., mass="sub")``): the index is then built with ``mass="sub"``
(its build time, sub-centroids included, is ``build_ms``; a paper decode of it is the
paper index's bit for bit), and every Double-P row runs once per mass (``doublep-sub(...)``
rows beside ``doublep(...)``).

Run: PYTHONPATH=. python3 benchmarks/bench_doublep.py [--cases 8:131072,1:32768,32:32768]
[--sample-budgets 64,256] [--mass paper,sub] [--out bench_doublep.json]
Writes benchmarks/results/<out> and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from benchmarks.bench_decode import (D, HKV, HQ, RESULTS, Timing, copy_bandwidth, flashinfer_runners,
                                make_inputs, time_steady)

SETTINGS = ((0.95, 0.7), (0.99, 0.8), (0.99, 0.9), (0.9, 0.6))


def calibrated(batch, tokens, dtype, seed=0):
    """q (B, Hq, D), k, v (B, Hkv, N, D) torch CUDA tensors: one calibrated sequence copied
    to every batch entry (bench_decode.make_inputs)."""
    import torch

    q, k, v, _ = make_inputs(batch, tokens, getattr(torch, dtype), seed=seed, inputs="calibrated")
    return q, k, v


def relative_error(got, want):
    """Mean over (b, h) of ||got - want|| / ||want||."""
    g, w = got.double(), want.double()
    return float(((g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-30)).mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="8:131072,1:32768,8:32768,32:32768",
                    help="batch:context pairs")
    ap.add_argument("--tokens-per-cluster", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--sample-budgets", default="64,256",
                    help="budgets of the sampled variant at (0.95, 0.7) ('' for none)")
    ap.add_argument("--mass", default="paper",
                    help="cluster masses of the Double-P rows, comma-separated: paper, sub")
    ap.add_argument("--out", default="bench_doublep.json", help="file name under benchmarks/results")
    args = ap.parse_args(argv)
    masses = [m for m in args.mass.split(",") if m]
    if not masses or any(m not in ("paper", "sub") for m in masses):
        ap.error(f"--mass: expected paper and/or sub, got {args.mass!r}")
    import torch
    import torch.nn.functional as F

    import stochattn
    from stochattn.doublep import DoublePIndex

    bw = copy_bandwidth()
    meta = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(),
                host=platform.node(), torch=torch.__version__, copy_bandwidth_gbs=bw / 1e9,
                shape=dict(Hq=HQ, Hkv=HKV, D=D), dtype=args.dtype,
                tokens_per_cluster=args.tokens_per_cluster, iterations=args.iterations,
                masses=masses,
                inputs="stochattn.eval.calibrated.make_calibrated_inputs (smollm2 profile), seed 0")
    rows = []
    for case in args.cases.split(","):
        B, N = (int(x) for x in case.split(":"))
        notes = {}
        q, k, v = calibrated(B, N, args.dtype)
        C = max(1, N // args.tokens_per_cluster)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        index1 = stochattn.build_doublep_index(k[:1], v[:1], n_clusters=C,
                                               iterations=args.iterations,
                                               mass="sub" if "sub" in masses else "paper")
        torch.cuda.synchronize()
        build_ms = (time.perf_counter() - t0) * 1e3  # kernels compiled by an earlier case or not
        index = DoublePIndex.stack([index1] * B) if B > 1 else index1
        floor_us = 2 * B * HKV * N * D * 2 / bw * 1e6
        timing = Timing.for_floor(floor_us)
        qs = q.unsqueeze(2)
        base = {"sdpa": lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True),
                "ours_exact": lambda: stochattn.exact_attention(q, k, v)}
        buffers = []
        if not args.no_flashinfer:
            fi, buffers = flashinfer_runners(q, k, v, N, notes)
            base.update(fi)
        times = {name: time_steady(fn, timing) for name, fn in base.items()}
        exact_names = [n for n in times if n != "ours_exact"]
        fastest = min(exact_names, key=times.get)
        exact_out = stochattn.exact_attention(q, k, v)
        row = dict(batch=B, context=N, clusters=C, build_ms=build_ms, floor_kv_us=floor_us,
                   fastest_exact=fastest,
                   fastest_exact_us=times[fastest], baselines_us=times, methods={}, notes=notes)
        def measure(fn, *stats, **kw):
            """Time fn(q, k, v, index=index, **kw); summarise one call with diagnostics."""
            us = time_steady(lambda: fn(q, k, v, index=index, **kw), timing)
            out, d = fn(q, k, v, index=index, return_diagnostics=True, **kw)
            res = dict(us=us, speedup_vs_fastest=times[fastest] / us,
                       tokens_exact_fraction=float((d.tokens_exact / N).mean()),
                       true_mass=float(d.true_mass.mean()),
                       rel_error=relative_error(out, exact_out))
            res.update({name: _STATS[name](d) for name in stats})
            return res

        for mass in masses:
            tag = "" if mass == "paper" else "-sub"
            for p1, p2 in SETTINGS:
                row["methods"][f"doublep{tag}({p1}, {p2})"] = measure(
                    stochattn.doublep_attention, "clusters_selected", "clusters_exact",
                    "estimated_mass", "true_mass_min", "k_rows_read_fraction", p1=p1, p2=p2,
                    mass=mass)
            # The sampled variant (unbiased for the p2 = 1 output) at (0.95, 0.7).
            for S in (int(x) for x in args.sample_budgets.split(",") if x):
                row["methods"][f"doublep{tag}-sample(0.95, 0.7, S={S})"] = measure(
                    stochattn.doublep_attention, "k_rows_read_fraction", "v_rows_read_fraction",
                    p1=0.95, p2=0.7, approx="sample", budget=S, mass=mass)
        # Fixed top-k clusters at the exact-cluster count of Double-P (0.95, 0.7).
        first = "" if masses[0] == "paper" else "-sub"
        kc = max(1, int(round(row["methods"][f"doublep{first}(0.95, 0.7)"]["clusters_exact"])))
        row["methods"][f"cluster_topk({kc})"] = measure(
            stochattn.cluster_topk_attention, "clusters_selected", clusters=kc)
        rows.append(row)
        buffers = q = k = v = index = index1 = exact_out = base = None  # free the GPU
        torch.cuda.empty_cache()
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, args.out), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(_row_text(row), flush=True)


# Summaries of a Diagnostics, by the name they get in the results.
_STATS = {
    "clusters_selected": lambda d: float(d.clusters_selected.mean()),
    "clusters_exact": lambda d: float(d.clusters_exact.mean()),
    "estimated_mass": lambda d: float(d.estimated_mass.mean()),
    "true_mass_min": lambda d: float(d.true_mass.min()),
    "k_rows_read_fraction": lambda d: float(d.k_read_fraction.mean()),
    "v_rows_read_fraction": lambda d: float(d.v_read_fraction.mean()),
}


def _row_text(row) -> str:
    b = row["baselines_us"]
    lines = [f"B={row['batch']} N={row['context']} C={row['clusters']}: index build (B=1) "
             f"{row['build_ms']:.0f} ms; floor {row['floor_kv_us']:.0f} us; "
             + ", ".join(f"{n} {t:.0f} us" for n, t in b.items())]
    for name, m in row["methods"].items():
        extra = "".join(f" {key}={m[key]:.4g}" for key in ("tokens_exact_fraction", "clusters_selected",
                                                           "clusters_exact", "estimated_mass",
                                                           "true_mass", "k_rows_read_fraction",
                                                           "v_rows_read_fraction", "rel_error")
                        if key in m)
        lines.append(f"  {name}: {m['us']:.0f} us, {m['speedup_vs_fastest']:.2f}x vs "
                     f"{row['fastest_exact']}{extra}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
