"""End-to-end decode speed of a Llama-3.1-8B-shaped transformers model with stochattn.

A model of the Llama-3.1-8B shape (32 layers, hidden 4096, Hq 32, Hkv 8, D 128,
intermediate 14336, vocab 128256) with random bf16 weights is built on the GPU; for every
(context, batch) its StaticCache is filled directly with synthetic K/V of ``context``
tokens (the prefill, which would cost ~0.26 s per sequence at 128k and needs a real prompt
to mean anything, is skipped), then 128 tokens are decoded greedily, one forward per token,
with each attention implementation in turn.

K/V (``--kv``): ``calibrated`` (default) fills every layer and sequence with one draw of
stochattn.eval.calibrated's generator (attention as peaked as SmolLM2's, docs/generator.md) and makes
every decode call attend with that draw's query instead of the random model's
(benchmarks/e2e_impls.CalibratedQuery): a random model's query is unrelated to the cache, its
attention flat, and Double-P's cost depends on how peaked attention is. ``gaussian`` fills
the cache with Gaussian K/V and keeps the model's query (flat attention; what the
2026-12-02 run used). The tokens decoded are meaningless either way (random weights).

Implementations:

- ``sdpa``: transformers' own SDPA attention (what a user gets by default);
- ``flashinfer``: FlashInfer 0.6.0's batch decode reading the StaticCache in place
  (benchmarks/e2e_impls.FlashInferDecode), when importable;
- ``stochattn_exact``: stochattn.integrations.transformers with the exact split-KV kernel;
- ``stochattn_santa``: the same with S²ANTA-prop, systematic sampler, S = --budget (256);
- ``stochattn_flash``: S²ANTA-flash, systematic, S = --flash-budget (2048);
- ``stochattn_doublep``: Double-P (0.95, 0.7), centroid summaries; its index is built by
  the integration at the first decode call of each phase (the prefill is skipped), so the
  warm-up steps and the warm-up rounds of the attention-alone timing absorb the k-means;
- ``stochattn_doublep_sample``: Double-P (0.95, 0.7), the sampled variant with
  S = --doublep-budget (64).
The default runs sdpa, stochattn_exact and stochattn_santa; ``--impls all`` runs every one.
The timed steps follow the warm-up steps directly (the context grows by --warmup tokens
first); before the warm-up and before the attention-alone timing the cache length is reset
to ``context`` and the stochattn implementation's per-layer state (decode step, Double-P
index) with it.

Reported per run: tokens/s (batch * steps / wall time), the median wall time of one
decode step, the GPU time of the 32 attention calls of one step measured alone (same
cache tensors, same mask, CUDA events) and its share of the step, and the speedup over
SDPA measured in the same run. Decoding is eager PyTorch (no CUDA graphs, no
torch.compile: the integration keeps Python state per layer), so at batch 1 the CPU
launching ~30 kernels per layer can be what limits tokens/s; the attention share then
says how much a faster attention could give at most.

Batch 8 at 128k needs 32 * 2 * 8 * 131072 * 8 * 128 * 2 bytes = 137 GB of K/V, which
does not fit next to the 16 GB of weights on a 141 GB H200: such configurations are
skipped (and listed as skipped in the JSON).

    python3 benchmarks/e2e_decode.py                       # GPU, ~3-4 minutes
    python3 benchmarks/e2e_decode.py --quick               # 32k only, batch 1 and 8
    python3 benchmarks/e2e_decode.py --tiny --device cpu   # a 2-layer model, CPU smoke test
    python3 benchmarks/e2e_decode.py --impls all           # every implementation

Writes benchmarks/results/e2e_decode.json (or --out) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from benchmarks.e2e_impls import CalibratedQuery, FlashInferDecode  # noqa: E402
from stochattn.integrations.transformers import register  # noqa: E402

IMPLS = ("sdpa", "flashinfer", "stochattn_exact", "stochattn_santa", "stochattn_flash", "stochattn_doublep",
         "stochattn_doublep_sample")
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                rope_theta=500000.0)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=128)


class Clock:
    """Wall and GPU time: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def event(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def build_model(shape, dtype, device, max_len):
    cfg = LlamaConfig(**shape, max_position_embeddings=max_len, bos_token_id=0, eos_token_id=None,
                      pad_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def calibrated_draw(cfg, context, seed):
    """One calibrated decode step for one sequence: q (Hq, D), k, v (Hkv, context, D),
    float16 NumPy arrays (stochattn.eval.calibrated; ~1.5 s per KV head at 128k on one core)."""
    import numpy as np

    from stochattn.eval.calibrated import make_calibrated_inputs

    q, k, v = make_calibrated_inputs(1, cfg.num_attention_heads, cfg.num_key_value_heads,
                                     context, cfg.head_dim, seed=seed, dtype=np.float16)
    return q[0], k[0], v[0]


def filled_cache(model, batch, context, steps, dtype, device, seed, draw=None):
    """A StaticCache of ``context + steps + 1`` rows per layer whose first ``context`` rows
    hold K/V as if a prompt of that length had been read: ``draw``'s k, v (the same in every
    layer and sequence) or, without one, Gaussian K/V (float32 draws, cast)."""
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=context + steps + 1)
    g = torch.Generator(device=device).manual_seed(seed)
    stub = torch.zeros(batch, cfg.num_key_value_heads, 1, cfg.head_dim, dtype=dtype, device=device)
    kv = None if draw is None else [torch.from_numpy(a).to(device=device, dtype=dtype)
                                    for a in draw[1:]]
    for layer in cache.layers:
        layer.lazy_initialization(stub, stub)
        for i, t in enumerate((layer.keys, layer.values)):
            view = t[:, :, :context]
            for b in range(batch):  # per sequence: bounded float32 scratch
                view[b].copy_(kv[i] if kv is not None else
                              torch.randn(view[b].shape, generator=g, device=device))
        layer.cumulative_length.fill_(context)
    return cache


def reset(cache, context, fn):
    """Cache length back to ``context``; a stochattn implementation forgets its per-layer
    state (decode step, Double-P index), which would otherwise be ahead of the cache."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(context)
    if hasattr(fn, "reset"):
        fn.reset()


def cache_kwarg(model):
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def decode(model, cache, key, tokens, steps, clock):
    """Greedy decode of ``steps`` tokens; returns (wall seconds, per-step ms, last tokens)."""
    marks = [clock.event()]
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=tokens, use_cache=True, logits_to_keep=1, **{key: cache}).logits
            tokens = logits[:, -1:].argmax(-1)
            marks.append(clock.event())
    clock.sync()
    wall = time.perf_counter() - t0
    return wall, [clock.ms(a, b) for a, b in zip(marks, marks[1:])], tokens


def attention_alone(model, cache, impl, fn, context, batch, clock, reps):
    """GPU time (ms) of the attention calls of one decode step (every layer once), on the
    cache tensors with the decode mask (keys 0 .. context), query random."""
    cfg = model.config
    dev = cache.layers[0].keys.device
    dtype = cache.layers[0].keys.dtype
    n = cache.layers[0].keys.shape[2]
    q = getattr(fn, "query", None)
    if q is None:
        q = torch.randn(batch, cfg.num_attention_heads, 1, cfg.head_dim, device=dev).to(dtype)
    mask = (torch.arange(n, device=dev) <= context).view(1, 1, 1, n).expand(batch, 1, 1, n)
    modules = [layer.self_attn for layer in model.model.layers]
    scaling = modules[0].scaling
    times = []
    with torch.no_grad():
        for rep in range(reps + 2):
            clock.sync()
            a = clock.event()
            for m, layer in zip(modules, cache.layers):
                fn(m, q, layer.keys, layer.values, mask, scaling=scaling)
            b = clock.event()
            clock.sync()
            if rep >= 2:  # two warm-up rounds (compilation, plan caches)
                times.append(clock.ms(a, b))
    return statistics.median(times)


def _registered_name(impl):
    """The transformers name of an implementation's wrapper: transformers takes any name
    containing "flash" for one of its flash-attention kernels."""
    return "e2e_" + impl.replace("flash", "fl")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--budget", type=int, default=256, help="S of S²ANTA-prop")
    ap.add_argument("--flash-budget", type=int, default=2048, help="S of S²ANTA-flash")
    ap.add_argument("--doublep-budget", type=int, default=64, help="S of Double-P's sampled variant")
    ap.add_argument("--impls", nargs="+", default=["sdpa", "stochattn_exact", "stochattn_santa"],
                    help=f"some of {', '.join(IMPLS)}, or 'all'")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--kv", default="calibrated", choices=["calibrated", "gaussian"],
                    help="cache contents and query (module docstring)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attn-reps", type=int, default=5)
    ap.add_argument("--no-mask-check", action="store_true",
                    help="check_mask=False for the stochattn implementations")
    ap.add_argument("--quick", action="store_true", help="32k only")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e_decode.json"))
    args = ap.parse_args(argv)
    if args.impls == ["all"]:
        args.impls = list(IMPLS)
    unknown = [i for i in args.impls if i not in IMPLS]
    if unknown:
        ap.error(f"unknown --impls {unknown}; choose from {', '.join(IMPLS)} or 'all'")
    if args.quick:
        args.contexts = [32768]
    if args.tiny and args.contexts == [32768, 131072]:
        args.contexts, args.steps = [512], min(args.steps, 8)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    clock = Clock(device)
    shape = TINY if args.tiny else LLAMA_8B
    max_len = max(args.contexts) + args.warmup + args.steps + 1
    t_build = time.perf_counter()
    model = build_model(shape, dtype, device, max_len)
    key = cache_kwarg(model)
    print(f"model built in {time.perf_counter() - t_build:.1f} s", flush=True)

    check = not args.no_mask_check
    notes = {}
    impls = {"sdpa": sdpa_attention_forward}
    if "flashinfer" in args.impls:
        try:
            impls["flashinfer"] = FlashInferDecode()
        except Exception as e:  # noqa: BLE001 - not importable, no GPU: say so and go on
            notes["flashinfer"] = f"skipped: {type(e).__name__}: {str(e)[:200]}"
            print(f"flashinfer {notes['flashinfer']}", flush=True)
            args.impls = [i for i in args.impls if i != "flashinfer"]
    impls["stochattn_exact"] = register("stochattn_exact", estimator="exact", check_mask=check)
    impls["stochattn_santa"] = register("stochattn_santa", estimator="santa", budget=args.budget,
                                        sampler="systematic", schedule="prop", check_mask=check)
    # (transformers refuses to set an implementation whose name contains "flash")
    impls["stochattn_flash"] = register("stochattn_s2fl", estimator="santa",
                                        budget=args.flash_budget, sampler="systematic",
                                        schedule="flash", check_mask=check)
    impls["stochattn_doublep"] = register("stochattn_doublep", estimator="doublep", p1=0.95,
                                          p2=0.7, check_mask=check)
    impls["stochattn_doublep_sample"] = register(
        "stochattn_doublep_sample", estimator="doublep", p1=0.95, p2=0.7, approx="sample",
        budget=args.doublep_budget, check_mask=check)
    # Every implementation runs wrapped, so that all see the same (calibrated) query.
    wrapped = {}
    for impl in args.impls:
        wrapped[impl] = CalibratedQuery(impls[impl])
        AttentionInterface.register(_registered_name(impl), wrapped[impl])
        AttentionMaskInterface.register(_registered_name(impl), sdpa_mask)

    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    total_mem = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    runs, skipped = [], []
    for context in args.contexts:
        for batch in args.batches:
            rows = context + args.warmup + args.steps + 1
            kv_bytes = (cfg.num_hidden_layers * 2 * batch * rows * cfg.num_key_value_heads
                        * cfg.head_dim * dtype.itemsize)
            if total_mem is not None and weight_bytes + kv_bytes > 0.92 * total_mem:
                why = (f"K/V {kv_bytes / 1e9:.0f} GB + weights {weight_bytes / 1e9:.0f} GB exceed "
                       f"92% of the GPU's {total_mem / 1e9:.0f} GB")
                skipped.append(dict(context=context, batch=batch, why=why))
                print(f"skip context {context} batch {batch}: {why}", flush=True)
                continue
            draw = calibrated_draw(cfg, context, seed=context) if args.kv == "calibrated" else None
            cache = filled_cache(model, batch, context, args.warmup + args.steps, dtype, device,
                                 seed=context + batch, draw=draw)
            query = None if draw is None else (
                torch.from_numpy(draw[0]).to(device=device, dtype=dtype)[None, :, None, :]
                .expand(batch, -1, -1, -1).contiguous())
            start = torch.randint(cfg.vocab_size, (batch, 1), device=device)
            sdpa_tps = None
            for impl in args.impls:
                model.set_attn_implementation(_registered_name(impl))
                fn = wrapped[impl]
                fn.query = query
                reset(cache, context, fn)
                # Warm-up, then the timed steps right after it (no reset in between: a
                # Double-P index built by the warm-up's first step keeps growing).
                decode(model, cache, key, start, args.warmup, clock)
                wall, steps_ms, _ = decode(model, cache, key, start, args.steps, clock)
                reset(cache, context, fn)
                attn_ms = attention_alone(model, cache, impl, fn, context, batch, clock, args.attn_reps)
                step_ms = statistics.median(steps_ms)
                tps = batch * args.steps / wall
                if impl == "sdpa":
                    sdpa_tps = tps
                run = dict(context=context, batch=batch, impl=impl, steps=args.steps,
                           tokens_per_s=tps, wall_s=wall, step_ms_median=step_ms,
                           step_ms_min=min(steps_ms), attention_ms_per_step=attn_ms,
                           attention_share=attn_ms / step_ms,
                           speedup_vs_sdpa=None if sdpa_tps is None else tps / sdpa_tps,
                           kv_gb=kv_bytes / 1e9)
                runs.append(run)
                print(f"context {context:>6} batch {batch} {impl:<16} {tps:8.1f} tok/s  "
                      f"step {step_ms:7.2f} ms  attention {attn_ms:7.2f} ms "
                      f"({100 * run['attention_share']:.0f}%)", flush=True)
            del cache, query
            if device.type == "cuda":
                torch.cuda.empty_cache()

    baselines = ("sdpa", "flashinfer")
    for r in runs:  # against the faster exact baseline of the same configuration
        base = [x["tokens_per_s"] for x in runs if x["impl"] in baselines
                and (x["context"], x["batch"]) == (r["context"], r["batch"])]
        r["speedup_vs_fastest_exact"] = r["tokens_per_s"] / max(base) if base else None
    result = dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        torch=torch.__version__, transformers=transformers.__version__,
        model=dict(shape, dtype=args.dtype, random_weights=True, weight_gb=weight_bytes / 1e9),
        kv=("StaticCache filled with one draw of stochattn.eval.calibrated (SmolLM2 profile), the same "
            "in every layer and sequence; decode queries replaced by that draw's query; prefill "
            "skipped" if args.kv == "calibrated" else
            "StaticCache filled with Gaussian K/V (float32 draws cast to the model dtype), the "
            "model's own queries; prefill skipped"),
        notes=notes,
        decode="greedy, one forward per token (eager, logits_to_keep=1)",
        budget=args.budget, check_mask=check, warmup_steps=args.warmup,
        attention_alone="median over %d rounds of the per-layer attention calls of one step "
                        "(CUDA events), same cache and mask, random query" % args.attn_reps,
        runs=runs, skipped=skipped)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    print("| context | batch | attention | tokens/s | step (ms) | attention alone (ms) | share | vs SDPA "
          "| vs fastest exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        vs = "" if r["speedup_vs_sdpa"] is None else f"{r['speedup_vs_sdpa']:.2f}x"
        vf = "" if r["speedup_vs_fastest_exact"] is None else f"{r['speedup_vs_fastest_exact']:.2f}x"
        print(f"| {r['context']} | {r['batch']} | {r['impl']} | {r['tokens_per_s']:.1f} | "
              f"{r['step_ms_median']:.2f} | {r['attention_ms_per_step']:.2f} | "
              f"{100 * r['attention_share']:.0f}% | {vs} | {vf} |")
    for s in skipped:
        print(f"| {s['context']} | {s['batch']} | skipped: {s['why']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
