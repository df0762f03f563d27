"""Where S2ANTA-prop spends its time: pass 1 alone, pass 2 alone, both (GPU machine).

Times the two launches of the cached plan separately (steady state: median over 5
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
            p1, p2 = plan.pass1, plan.pass2
            plan.pass2 = lambda *a, **kw: None
            only1 = time_steady(lambda: santa_prop(q, k, v, budget=S, seed=1))
            plan.pass2, plan.pass1 = p2, (lambda *a, **kw: None)
            only2 = time_steady(lambda: santa_prop(q, k, v, budget=S, seed=1))
            plan.pass1 = p1
            print(f"B={B:3d} N={N:6d} S={S:5d}: both {both:7.1f} us | pass1 {only1:7.1f} | "
                  f"pass2 {only2:7.1f} | K floor {floor_k:6.1f} | chunks {plan.chunks}")
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
