"""Paged against contiguous KV caches on one GPU: every estimator on the same tokens, in
FlashInfer's paged layout and in the contiguous (B, Hkv, N, D) layout, with FlashInfer's own
paged decode on the same pages, all measured in the same run.

Shape: Llama-3.1-8B decode (Hq 32, Hkv 8, D 128), fp16, batch 1/8/32, context 32k/128k
(configurations that do not fit in free memory are skipped). The paged cache holds the
same tokens as the contiguous one, page size 16 (``--page-size``), layout NHD
(``--layout``), pages in a random physical order; ``max_tokens`` is the context, so the
kernels plan the same launches for both.

Estimators: exact decode, S²ANTA-prop S=256 (systematic), S²ANTA-flash S=2048, Double-P
(0.95, 0.7) with its index built once on the contiguous cache (the index holds token
positions, so the paged call reads the same rows through the page table). Each is called
through its plan with ``out=`` and the plan's kept workspace (the serving path: no
allocation per call). Baseline: FlashInfer 0.6.0 ``BatchDecodeWithPagedKVCacheWrapper``
(tensor cores) on the same pages, when importable.

Timing: ``steady`` (R calls back to back between two events, median over batches) and
``graph`` (R calls captured once in a CUDA graph and replayed), as in bench_decode. The
ratio ``paged / contiguous`` is the headline (target: within 5%). Inputs: the calibrated
generator (``stochattn.eval.calibrated``, as bench_decode's default).

Writes benchmarks/results/bench_paged.{json,csv} (``--out`` for another stem) and prints a
table. Run: PYTHONPATH=. python3 -m benchmarks.run --routine paged [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

from .bench_decode import (HKV, HQ, RESULTS, D, Timing, _fmt, _write, make_inputs, time_graph,
                           time_steady)


def _torch():
    import torch

    return torch


def to_paged(k, v, page_size, layout, seed, order="shuffled"):
    """A GPU PagedKV holding k, v (B, Hkv, N, D) torch tensors, pages in a random physical
    order (``order="sequential"``: in token order, for diagnosis): every sequence full (N
    tokens), ``max_tokens`` N."""
    torch = _torch()
    from stochattn.paged import paged_kv

    B, H, N, _ = k.shape
    P = page_size
    n_pages = math.ceil(N / P)
    total = B * n_pages
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(total, device="cuda", generator=g)  # logical page i -> physical
    if order == "sequential":
        perm = torch.arange(total, device="cuda")
    pool = torch.empty((total, 2, P, H, D), dtype=k.dtype, device="cuda")
    pad = n_pages * P - N
    for i, x in enumerate((k, v)):
        t = x.transpose(1, 2)  # (B, N, H, D)
        if pad:
            t = torch.cat([t, t.new_zeros(B, pad, H, D)], dim=1)
        pool[perm, i] = t.reshape(total, P, H, D)
    if layout == "HND":
        pool = pool.transpose(2, 3).contiguous()
    indptr = (torch.arange(B + 1, device="cuda", dtype=torch.int32) * n_pages).contiguous()
    last = torch.full((B,), N - (n_pages - 1) * P, dtype=torch.int32, device="cuda")
    return paged_kv(pool, kv_indptr=indptr, kv_indices=perm.to(torch.int32).contiguous(),
                    kv_last_page_len=last, layout=layout, max_tokens=N), pool


def _flashinfer(q, cache, notes, pages):
    """FlashInfer's paged decode on the same pages, or None. ``pages``: what ``run`` gets,
    the combined pool (num_pages, 2, ...) as an engine passes it, or the (K, V) pair of
    strided views of it."""
    torch = _torch()
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - report any import failure
        notes["flashinfer"] = f"not importable: {type(e).__name__}: {str(e)[:200]}"
        return None
    try:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout=cache.layout,
                                                          use_tensor_cores=True)
        w.plan(cache.kv_indptr, cache.kv_indices, cache.kv_last_page_len, HQ, HKV, D,
               cache.page_size, pos_encoding_mode="NONE", q_data_type=q.dtype,
               kv_data_type=cache.k_pages.dtype)
        out = w.run(q, pages)
        return (lambda: w.run(q, pages)), out, ws
    except Exception as e:  # noqa: BLE001
        notes["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return None


def methods():
    """name -> (plan factory, needs a Double-P index)."""
    import stochattn

    return {
        "exact": (lambda: stochattn.ExactPlan(device="cuda"), False),
        "prop S=256": (lambda: stochattn.SantaPlan(budget=256, device="cuda"), False),
        "flash S=2048": (lambda: stochattn.SantaPlan(budget=2048, schedule="flash",
                                                     device="cuda"), False),
        "doublep (0.95, 0.7)": (lambda: stochattn.DoublePPlan(p1=0.95, p2=0.7, device="cuda"),
                                True),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 and 8 at 32k only")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layout", choices=("NHD", "HND"), default="NHD")
    ap.add_argument("--order", choices=("shuffled", "sequential"), default="shuffled",
                    help="physical page order (sequential: to separate the page lookup's cost "
                         "from the scattered reads)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--no-doublep", action="store_true", help="skip Double-P (its index build)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_paged"))
    args = ap.parse_args(argv)
    torch = _torch()
    import stochattn

    cases = [(1, 32768), (8, 32768)] if args.quick else [
        (1, 32768), (8, 32768), (32, 32768), (1, 131072), (8, 131072), (32, 131072)]
    meta = dict(date=time.strftime("%Y-%m-%d"), card=torch.cuda.get_device_name(),
                torch=torch.__version__, python=platform.python_version(),
                page_size=args.page_size, layout=args.layout, order=args.order,
                shape=dict(Hq=HQ, Hkv=HKV, D=D),
                dtype="float16", inputs="calibrated")
    rows = []
    for B, N in cases:
        need = 2 * 2 * B * HKV * N * D * 2  # contiguous + paged, K + V, fp16
        free = torch.cuda.mem_get_info()[0]
        if need > 0.8 * free:
            rows.append(dict(batch=B, tokens=N, skipped=f"needs {need / 2**30:.1f} GiB"))
            continue
        q, k, v, source = make_inputs(B, N, torch.float16)
        meta["source"] = source
        cache, pool = to_paged(k, v, args.page_size, args.layout, seed=B * N,
                               order=args.order)
        notes = {}
        t = Timing.for_floor(B * HKV * N * D * 4 / 3e12 * 1e6)
        t.calls = args.calls
        index = None
        # FlashInfer on the combined pool (what engines and the decode loop pass), and on
        # the same pool as two strided (K, V) views (this benchmark's baseline before
        # 2026-12-07, 3-8x slower than the loop's figure for FlashInfer: kept to compare).
        for fi_name, pages in (("flashinfer paged (tc)", pool),
                               ("flashinfer paged (tc), K/V views",
                                (cache.k_pages, cache.v_pages))):
            fi = _flashinfer(q, cache, notes, pages)
            if fi is None:
                continue
            fn, fi_out, _ws = fi
            row = dict(batch=B, tokens=N, method=fi_name,
                       paged_us=time_steady(fn, t),
                       paged_graph_us=None if args.no_graphs else time_graph(fn, t))
            exact = stochattn.ExactPlan(device="cuda").run(q, k, v)
            row["max_abs_diff_vs_ours"] = float((fi_out.float() - exact.float()).abs().max())
            rows.append(row)
            del fn, fi_out, _ws, fi
        for name, (make, needs_index) in methods().items():
            if needs_index and args.no_doublep:
                continue
            row = dict(batch=B, tokens=N, method=name)
            try:
                plan = make()
                extra = {}
                if needs_index:
                    if index is None:
                        t0 = time.perf_counter()
                        index = stochattn.build_doublep_index(k, v, n_clusters=N // 32)
                        torch.cuda.synchronize()
                        row["index_build_s"] = time.perf_counter() - t0
                    extra["index"] = index
                stochastic = name.startswith(("prop", "flash"))
                if stochastic:
                    extra.update(seed=1, offset=0)
                out_c = torch.empty_like(q)
                out_p = torch.empty_like(q)
                run_c = lambda: plan.run(q, k, v, out=out_c, **extra)  # noqa: E731
                run_p = lambda: plan.run(q, cache, out=out_p, **extra)  # noqa: E731
                run_c()
                run_p()
                torch.cuda.synchronize()
                row["bitwise_equal"] = bool(torch.equal(out_c, out_p))
                row["max_abs_diff"] = float((out_c.float() - out_p.float()).abs().max())
                row["contiguous_us"] = time_steady(run_c, t)
                row["paged_us"] = time_steady(run_p, t)
                row["paged_over_contiguous"] = row["paged_us"] / row["contiguous_us"]
                if not args.no_graphs:
                    row["contiguous_graph_us"] = time_graph(run_c, t)
                    row["paged_graph_us"] = time_graph(run_p, t)
                    row["graph_paged_over_contiguous"] = (row["paged_graph_us"]
                                                          / row["contiguous_graph_us"])
                row["workspace_bytes"] = plan.workspace.nbytes()
            except Exception as e:  # noqa: BLE001 - a failing method is a row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            _write(rows, dict(meta, notes=notes), args.out)
        del q, k, v, cache, pool, index
        torch.cuda.empty_cache()
    _write(rows, meta, args.out)
    print(f"{'B':>3} {'N':>7} {'method':<24} {'contig us':>10} {'paged us':>9} {'ratio':>6} "
          f"{'graph ratio':>11} {'bitwise':>7}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>3} {r['tokens']:>7} skipped: {r['skipped']}")
            continue
        print(f"{r['batch']:>3} {r['tokens']:>7} {r['method']:<24} "
              f"{_fmt(r.get('contiguous_us'), '.1f'):>10} {_fmt(r.get('paged_us'), '.1f'):>9} "
              f"{_fmt(r.get('paged_over_contiguous'), '.3f'):>6} "
              f"{_fmt(r.get('graph_paged_over_contiguous'), '.3f'):>11} "
              f"{str(r.get('bitwise_equal', '-')):>7} {r.get('error', '')}")
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
