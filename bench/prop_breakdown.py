"""Where S2ANTA-prop spends its time: each of its three launches alone, and all (GPU machine).

Times the launches of the cached plan (logits, tile statistics, sampling and gather) separately (steady state: median over 5
batches of 20 back-to-back calls between CUDA events) at the Llama-3.1-8B decode shape,
against the K-only bandwidth floor. Run: PYTHONPATH=. python3 bench/prop_breakdown.py
"""

from __future__ import annotations

import gc

from bench.tune_decode import time_steady


def main():
    import torch

    from stochattn.cuda import santa as cs
    from stochattn.cuda.santa import santa_prop

    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / (time_steady(lambda: y.copy_(x), batches=3, calls=5) * 1e-6)
    del x, y
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    for B, N in ((1, 131072), (8, 32768), (32, 32768)):
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.float16)
        k = torch.randn(B, 8, N, 128, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        floor_k = k.numel() * 2 / bw * 1e6
        for S in (256, 2048):
            both = time_steady(lambda: santa_prop(q, k, v, budget=S, seed=1))
            plan = next(o for o in gc.get_objects() if isinstance(o, cs._PropPlan)
                        and o.shape.batch == B and o.shape.tokens == N and o.S == S)
            alone = {}
            launches = ("logits", "tiles", "sample")
            saved = {name: getattr(plan, name) for name in launches}
            for name in launches:
                for other in launches:  # every launch but `name` does nothing
                    setattr(plan, other, saved[other] if other == name else (lambda *a, **kw: None))
                alone[name] = time_steady(lambda: santa_prop(q, k, v, budget=S, seed=1))
            for name in launches:
                setattr(plan, name, saved[name])
            print(f"B={B:3d} N={N:6d} S={S:5d}: all {both:7.1f} us | "
                  + " | ".join(f"{n} {t:7.1f}" for n, t in alone.items())
                  + f" | K floor {floor_k:6.1f} | chunks {plan.chunks}")
        if B == 8:  # the logits kernel's token split: default vs forced chunk counts
            from stochattn.cuda import _module, _sources

            cfg = _sources.get_config()
            occ = _module.ctas_per_sm("santa_prop", "santa_prop_logits<stochattn::f16, 128, 4, false>",
                                      cfg.threads, cfg.smem_bytes("santa_prop", 128, 4))
            times = {nc: time_steady(lambda: santa_prop(q, k, v, budget=256, seed=1, num_chunks=nc))
                     for nc in (None, 8, 16, 24, 33, 48, 64)}
            print(f"  logits kernel: {occ} CTAs/SM; S=256 total by num_chunks: "
                  + " ".join(f"{nc}:{t:.1f}" for nc, t in times.items()))
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
