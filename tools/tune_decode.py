"""Tile-configuration sweep of the streaming decode kernels on one GPU (about 2-3 minutes,
most of it NVRTC compiles, which run in parallel threads).

For each ``stochattn.cuda.config.TileConfig`` of the grid (stage bytes x stages x
threads x reduction, pruned to what fits and tiles D = 64 and 128) the exact-decode and
S²ANTA-prop modules are compiled through the library's own path
(``stochattn.cuda.runtime.launch.get_kernel`` with the config's ``-D`` options, fp16
instantiations only: ``config.set_config(dtypes=("float16",))``), then:

1. correctness: exact decode against a float64 torch reference on two small ragged cases
   (D 128 / G 4 and D 64 / G 6, seq_lens with a 0 and a partial tile, split and unsplit),
   and against fp32 torch SDPA on every timed shape; max |ours - ref| / max |ref| must be
   < 2e-2 or the variant is printed as WRONG and skipped. S²ANTA-prop: the sampled indices
   must agree with the first (default) variant's on >= 99% of points (fp32 logits summed
   in another order may move a point across a CDF boundary, rarely).
2. timing (steady state: 3 warm-up calls, then 5 batches of 20 back-to-back calls between
   CUDA events, median of the per-call times): exact decode at fp16 Hq 32 / Hkv 8 / D 128,
   B=1 N=131072, B=8 N=32768, B=32 N=32768 (Gaussian K/V made on the GPU), and
   S²ANTA-prop systematic S=256 tile 64 at B=8 N=32768. torch SDPA (fp16) is timed too.

Floors: bytes of K+V (K alone for S²ANTA-prop's logits kernel) over the device-to-device copy
bandwidth measured here (2 GB torch copy, bytes read plus written).

Prints one table per shape sorted by time, then the best configuration per shape and the
best by the geometric mean of time / floor over the exact shapes, with the line to make
it the default.

Run: PYTHONPATH=. python3 tools/tune_decode.py [--quick] [--threads 8]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HQ, HKV, D = 32, 8, 128
TOL = 2e-2
SHAPES = [(1, 131072), (8, 32768), (32, 32768)]
SANTA_SHAPE = (8, 32768)

# (stage_bytes, stages, threads, reduce). The first entry is today's default tiling.
GRID = [
    (4096, 4, 128, "butterfly"),
    (4096, 4, 128, "scatter"),
    (4096, 6, 128, "scatter"),
    (8192, 3, 128, "scatter"),
    (8192, 4, 128, "scatter"),
    (8192, 4, 128, "butterfly"),
    (4096, 4, 256, "scatter"),
    (8192, 3, 256, "scatter"),
    (8192, 4, 256, "scatter"),
    (16384, 2, 256, "scatter"),
    (16384, 3, 256, "scatter"),
    (16384, 3, 256, "butterfly"),
    (16384, 4, 256, "scatter"),
]
SMEM_LIMIT = 227 * 1024


def _grid(quick):
    from stochattn.cuda.config import TileConfig

    out = []
    for sb, st, th, red in GRID[:5] if quick else GRID:
        try:
            cfg = TileConfig(sb, st, th, red)
        except ValueError as e:
            print(f"skip {(sb, st, th, red)}: {e}")
            continue
        if max(cfg.smem_bytes(f, d, 8) for f in ("exact_decode", "santa_prop") for d in (64, 128)) \
                + 8 * 256 * 4 > SMEM_LIMIT:
            print(f"skip {cfg.label()}: shared memory over {SMEM_LIMIT} bytes")
            continue
        out.append(cfg)
    return out


def time_steady(fn, batches=5, calls=20, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(batches):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        per.append(s.elapsed_time(e) * 1e3 / calls)
    return float(np.median(per))


def copy_bandwidth(nbytes=2 << 30, reps=10):
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bufs = [src, dst]
    t = time_steady(lambda: bufs[1].copy_(bufs[0]), batches=3, calls=reps, warmup=2)
    bufs.clear()
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * nbytes / (t * 1e-6)


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def ref_f64(q, k, v, seq_lens):
    """Float64 reference with seq_lens (empty sequence -> zeros)."""
    import torch

    B, Hq, Dd = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, Dd, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        kk = k[b, :, :n].double().repeat_interleave(G, 0)  # (Hq, n, D)
        vv = v[b, :, :n].double().repeat_interleave(G, 0)
        x = torch.einsum("hd,hnd->hn", q[b].double(), kk) / math.sqrt(Dd)
        p = torch.softmax(x, -1)
        out[b] = torch.einsum("hn,hnd->hd", p, vv)
    return out


def small_cases():
    import torch

    g = torch.Generator(device="cuda").manual_seed(1)
    cases = []
    for B, hkv, G, N, d, lens in ((3, 2, 4, 5003, 128, [5003, 1777, 0]), (2, 2, 6, 999, 64, [1, 998])):
        q = (3 * torch.randn(B, hkv * G, d, device="cuda", generator=g)).half()
        k = torch.randn(B, hkv, N, d, device="cuda", generator=g).half()
        v = torch.randn(B, hkv, N, d, device="cuda", generator=g).half()
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        cases.append((q, k, v, sl, ref_f64(q, k, v, lens)))
    return cases


def compile_all(configs, threads):
    """Compile every config's modules in parallel threads, each under the process default
    config with that tiling; returns {label: error or None}."""
    from stochattn.cuda import config
    from stochattn.cuda.runtime import launch

    base = config.get_config()

    def one(tiling):
        cfg = base.replace(tiling=tiling)
        try:
            launch.get_kernel("exact_decode", "exact_decode_merge<stochattn::f16>", cfg)
            launch.get_kernel("santa_prop", "santa_prop_sample<stochattn::f16, 128>", cfg)
            return None
        except Exception as e:  # noqa: BLE001 - report and skip the variant
            return f"{type(e).__name__}: {str(e)[-800:]}"

    with ThreadPoolExecutor(max(1, threads)) as ex:
        return dict(zip([c.label() for c in configs], ex.map(one, configs)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first 5 configurations only")
    ap.add_argument("--threads", type=int, default=8, help="parallel compiles")
    ap.add_argument("--no-santa", action="store_true")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from stochattn.cuda import clear_plan_cache, config
    from stochattn.cuda.exact import exact_decode
    from stochattn.cuda.santa import santa_prop

    t0 = time.time()
    initial = config.set_config(dtypes=("float16",))
    configs = _grid(args.quick)
    print(f"device {torch.cuda.get_device_name()}; {len(configs)} configurations", flush=True)
    errors = compile_all(configs, args.threads)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    for lab, err in errors.items():
        if err:
            print(f"COMPILE FAILED {lab}: {err}")
    configs = [c for c in configs if not errors[c.label()]]

    def use(cfg):
        config.set_config(tiling=cfg)

    # 1. small ragged correctness cases
    ok = {}
    cases = small_cases()
    for cfg in configs:
        use(cfg)
        worst = 0.0
        try:
            for q, k, v, sl, ref in cases:
                for nc in (None, 1, 3):
                    worst = max(worst, rel_err(exact_decode(q, k, v, sl, num_chunks=nc), ref))
        except Exception:  # noqa: BLE001
            print(f"ERROR {cfg.label()} (small cases):\n{traceback.format_exc()[-1500:]}")
            worst = float("inf")
        ok[cfg.label()] = worst < TOL
        if not ok[cfg.label()]:
            print(f"WRONG {cfg.label()}: small-case rel err {worst:.2e} (skipped)")
    del cases
    configs = [c for c in configs if ok[c.label()]]
    print(f"small cases done ({time.time() - t0:.0f} s)", flush=True)

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read+write)", flush=True)
    results = {}  # (shape name) -> list of (time us, label)
    floors = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, N in SHAPES:
        name = f"exact B={B} N={N}"
        q = torch.randn(B, HQ, D, device="cuda", generator=gen).half()
        k = torch.randn(B, HKV, N, D, device="cuda", generator=gen).half()
        v = torch.randn(B, HKV, N, D, device="cuda", generator=gen).half()
        ref = F.scaled_dot_product_attention(q.float()[:, :, None], k.float(), v.float(),
                                             enable_gqa=True)[:, :, 0]
        floors[name] = 2 * k.numel() * 2 / bw * 1e6
        rows = [(time_steady(lambda: F.scaled_dot_product_attention(
            q[:, :, None], k, v, enable_gqa=True)), "torch SDPA fp16")]
        for cfg in configs:
            use(cfg)
            try:
                err = rel_err(exact_decode(q, k, v), ref)
                if not err < TOL:
                    print(f"WRONG {cfg.label()} at {name}: rel err {err:.2e} (skipped)")
                    continue
                rows.append((time_steady(lambda: exact_decode(q, k, v)), cfg.label()))
            except Exception:  # noqa: BLE001
                print(f"ERROR {cfg.label()} at {name}:\n{traceback.format_exc()[-1500:]}")
        results[name] = rows
        print(f"{name} done ({time.time() - t0:.0f} s)", flush=True)
        del q, k, v, ref
        clear_plan_cache()
        torch.cuda.empty_cache()

    if not args.no_santa:
        B, N = SANTA_SHAPE
        name = f"santa_prop sys S=256 B={B} N={N}"
        q = torch.randn(B, HQ, D, device="cuda", generator=gen).half()
        k = torch.randn(B, HKV, N, D, device="cuda", generator=gen).half()
        v = torch.randn(B, HKV, N, D, device="cuda", generator=gen).half()
        floors[name] = k.numel() * 2 / bw * 1e6  # K alone
        rows, base_idx = [], None
        for cfg in configs:
            use(cfg)
            try:
                _, idx = santa_prop(q, k, v, budget=256, sampler="systematic", seed=1,
                                    return_indices=True)
                if base_idx is None:
                    base_idx = idx
                agree = float((idx == base_idx).double().mean())
                if agree < 0.99:
                    print(f"WRONG {cfg.label()} at {name}: indices agree on {agree:.4f} (skipped)")
                    continue
                rows.append((time_steady(lambda: santa_prop(q, k, v, budget=256,
                                                            sampler="systematic", seed=1)),
                             cfg.label()))
            except Exception:  # noqa: BLE001
                print(f"ERROR {cfg.label()} at {name}:\n{traceback.format_exc()[-1500:]}")
        results[name] = rows
        del q, k, v
        clear_plan_cache()
        torch.cuda.empty_cache()
    config.set_config(config=initial)

    print(f"\n==== results (steady-state us, median of 5 x 20 calls; floor = bytes / copy bw) "
          f"wall {time.time() - t0:.0f} s")
    for name, rows in results.items():
        fl = floors[name]
        print(f"\n{name}: floor {fl:.1f} us ({'K only' if 'santa' in name else 'K+V'})")
        for t, lab in sorted(rows):
            print(f"  {lab:<28} {t:8.1f} us  {fl / t * 100:5.1f}% of floor")
    print("\nbest per shape:")
    for name, rows in results.items():
        mine = [r for r in rows if not r[1].startswith("torch")]
        if mine:
            t, lab = min(mine)
            print(f"  {name:<36} {lab:<28} {t:8.1f} us ({floors[name] / t * 100:.1f}% of floor)")
    # Overall: geometric mean of time / floor over the exact shapes (all must be present).
    exact_names = [n for n in results if n.startswith("exact")]
    score = {}
    for cfg in configs:
        ts = [next((t for t, lab in results[n] if lab == cfg.label()), None) for n in exact_names]
        if all(t is not None for t in ts) and ts:
            score[cfg] = math.exp(np.mean([math.log(t / floors[n]) for t, n in zip(ts, exact_names)]))
    if score:
        best = min(score, key=score.get)
        print(f"\nbest overall (geo-mean time/floor over exact shapes): {best.label()} "
              f"= {1 / score[best] * 100:.1f}% of floor")
        for cfg in sorted(score, key=score.get):
            print(f"  {cfg.label():<28} {1 / score[cfg] * 100:5.1f}%")
        print("\nto make it the default, in stochattn/cuda/config.py:\n  DEFAULT_TILE_CONFIG = "
              f"TileConfig(stage_bytes={best.stage_bytes}, stages={best.stages}, "
              f"threads={best.threads}, reduce={best.reduce!r})\nor for one process: "
              f"STOCHATTN_TILE_CONFIG={best.stage_bytes},{best.stages},{best.threads},{best.reduce}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
