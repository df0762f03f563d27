"""stochattn from JAX: JAX GPU arrays in through DLPack, JAX arrays out (issue 6, item 4).

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 tools/jax_example.py

One decode step of a Llama-3.1-8B-shaped layer (Hq 32, Hkv 8, D 128, float16) on K/V
from the calibrated generator (docs/generator.md), held as JAX arrays on the GPU. Every
estimator is called on the JAX arrays as they are: the kernels read the JAX buffers in
place (CuPy views through DLPack, no copy) and each result is a ``jax.Array`` again. The
script checks both (buffer pointers, result types), compares every output with exact
attention computed by JAX in float32, and times each call against a jitted JAX exact
attention (wall-clock per call over back-to-back calls, the host work and the DLPack
hand-over included, since that is what a JAX caller pays; ``--json`` writes the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory to CuPy too

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import stochattn  # noqa: E402
from stochattn.eval.calibrated import make_calibrated_inputs  # noqa: E402


@jax.jit
def jax_exact(q, k, v):
    """Exact decode attention in JAX (float32 accumulation), GQA by reshaping the heads."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, D).astype(jnp.float32)
    logits = jnp.einsum("bhgd,bhnd->bhgn", qg, k.astype(jnp.float32)) / np.sqrt(D)
    w = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhgn,bhnd->bhgd", w, v.astype(jnp.float32)).reshape(B, Hq, D)


def median_us(fn, reps, batches=5):
    """Per-call time in steady state: ``reps`` calls back to back, one wait at the end,
    median over ``batches`` (host work overlaps the GPU as in a decode loop)."""
    fn().block_until_ready()  # warm-up: compilation, plans
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn()
        out.block_until_ready()
        times.append((time.perf_counter() - t0) * 1e6 / reps)
    return statistics.median(times)


def rel_error(out, ref):
    o, r = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.mean(np.linalg.norm(o - r, axis=-1) / np.linalg.norm(r, axis=-1)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    gpu = jax.devices("gpu")[0]
    B, N = args.batch, args.tokens
    q, k, v = (jax.device_put(jnp.asarray(x), gpu) for x in
               make_calibrated_inputs(B, 32, 8, N, 128, seed=0, dtype=np.float16))
    print(f"JAX {jax.__version__} on {gpu.device_kind}; q {q.shape} k {k.shape} {k.dtype}")

    import cupy  # only to show that the kernels read the JAX buffers in place

    in_place = all(cupy.from_dlpack(x).data.ptr == x.unsafe_buffer_pointer() for x in (q, k, v))
    print(f"kernels read the JAX buffers in place: {in_place}")

    index = stochattn.build_doublep_index(k, v, n_clusters=N // 32, seed=0)
    calls = {
        "jax exact (jit)": lambda: jax_exact(q, k, v),
        "stochattn exact": lambda: stochattn.exact_attention(q, k, v),
        "S2ANTA-prop S=256": lambda: stochattn.santa_attention(q, k, v, budget=256, seed=0),
        "S2ANTA-flash S=2048": lambda: stochattn.santa_attention(q, k, v, budget=2048, seed=0,
                                                                 schedule="flash"),
        "Double-P (0.95, 0.7)": lambda: stochattn.doublep_attention(q, k, v, index=index),
    }
    # What the DLPack exchange alone costs a call: q, k, v into CuPy, one result back.
    spare = cupy.empty(q.shape, dtype=cupy.float16)

    def handover():
        for x in (q, k, v):
            cupy.from_dlpack(x)
        return jnp.from_dlpack(spare)

    calls["DLPack hand-over only"] = handover
    ref = jax_exact(q, k, v)
    rows = []
    for name, fn in calls.items():
        out = fn()
        assert isinstance(out, jax.Array), f"{name} returned {type(out).__name__}"
        rows.append(dict(name=name, type=type(out).__name__, dtype=str(out.dtype),
                         us=median_us(fn, args.reps),
                         rel_error=rel_error(out, ref) if fn is not handover else None))
    base = rows[0]["us"]
    print(f"\n{'call':<22} {'returns':<10} {'median us':>10} {'vs jax':>7} {'rel. error':>10}")
    for r in rows:
        err = "" if r["rel_error"] is None else f"{r['rel_error']:>10.4f}"
        print(f"{r['name']:<22} {r['type']:<10} {r['us']:>10.1f} {base / r['us']:>6.2f}x {err}")
    if args.json:
        meta = dict(batch=B, tokens=N, q_heads=32, kv_heads=8, head_dim=128, dtype="float16",
                    jax=jax.__version__, device=gpu.device_kind, in_place=in_place,
                    timing="wall-clock per call, reps calls back to back, median of 5 batches")
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
