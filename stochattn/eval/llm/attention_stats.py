"""Statistics of SmolLM2's real attention (what synthetic K/V must reproduce, docs/llm_eval.md).

Run from the repository root (needs the ``eval`` extra)::

    python -m stochattn.eval.llm.attention_stats --play hamlet --tokens 2048 --queries 64

For the last ``--queries`` positions of the sequence (each attending over all earlier
tokens and itself, exact softmax in float64) and for every layer and query head:

- ``key_fraction[l, h, i]``: the fraction of the query's keys needed to hold
  ``MASS_LEVELS[i]`` (50/90/95/99%) of the softmax mass: the smallest number of largest
  weights whose sum reaches that mass, divided by the number of keys (p + 1);
- ``entropy``: the softmax entropy in nats (``normalized_entropy`` divides by log(p + 1));
- ``sink_mass``: the mass of the first ``n_sink`` = 4 tokens;
- ``window_mass``: the mass of the last ``window`` = 64 tokens (the query's own included).

Each is the mean over the queries; :func:`summarize` gives the median and quartiles over all
heads, the figures docs/llm_eval.md quotes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np

from .forward import forward

__all__ = ["MASS_LEVELS", "AttentionStats", "attention_stats", "query_stats", "summarize"]

MASS_LEVELS = (0.5, 0.9, 0.95, 0.99)


@dataclass
class AttentionStats:
    """Per (layer, query head) means over the queries; arrays are float64."""

    n_tokens: int
    query_positions: np.ndarray    # (Q,)
    key_fraction: np.ndarray       # (L, Hq, len(MASS_LEVELS))
    entropy: np.ndarray            # (L, Hq) nats
    normalized_entropy: np.ndarray  # (L, Hq) in [0, 1]
    sink_mass: np.ndarray          # (L, Hq) in [0, 1]
    window_mass: np.ndarray        # (L, Hq) in [0, 1]
    n_sink: int = 4
    window: int = 64


def query_stats(q, k, positions, *, n_sink=4, window=64):
    """Per-query statistics of one layer.

    Parameters
    ----------
    q : (Q, Hq, D) queries at ``positions`` (after RoPE).
    k : (T, Hkv, D) keys of the sequence (after RoPE), T > max(positions).
    positions : (Q,) int, query p sees keys 0..p.

    Returns
    -------
    dict of float64 arrays: ``key_fraction`` (Q, Hq, 4), ``entropy``, ``normalized_entropy``,
    ``sink_mass``, ``window_mass`` (Q, Hq).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    Q, Hq, D = q.shape
    T, Hkv, _ = k.shape
    G = Hq // Hkv
    pos = np.asarray(positions, dtype=np.int64)
    kh = np.repeat(np.transpose(k, (1, 0, 2)), G, axis=0)          # (Hq, T, D)
    x = np.einsum("qhd,htd->qht", q, kh) / np.sqrt(D)               # (Q, Hq, T) logits
    j = np.arange(T)
    valid = j[None, None, :] <= pos[:, None, None]
    x = np.where(valid, x, -np.inf)
    x = x - x.max(axis=-1, keepdims=True)                            # max shift
    w = np.exp(x)
    w /= w.sum(axis=-1, keepdims=True)                               # softmax, 0 off-range
    n = (pos + 1).astype(np.float64)[:, None]                        # keys per query
    # Fewest keys for a mass level: sort descending, count the prefix below the level,
    # plus one. A tiny slack (1e-12) absorbs the rounding of the cumulative sum at 99%.
    cum = np.cumsum(-np.sort(-w, axis=-1), axis=-1)
    frac = np.stack([((cum < m - 1e-12).sum(axis=-1) + 1) / n for m in MASS_LEVELS], axis=-1)
    frac = np.minimum(frac, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(w > 0, w * np.log(w), 0.0).sum(axis=-1)
        nent = np.where(n > 1, ent / np.log(np.maximum(n, 2)), 0.0)
    sink = w[..., :n_sink].sum(axis=-1)
    in_window = (j[None, :] > pos[:, None] - window) & (j[None, :] <= pos[:, None])
    win = (w * in_window[:, None, :]).sum(axis=-1)
    return dict(key_fraction=frac, entropy=ent, normalized_entropy=nent, sink_mass=sink,
                window_mass=win)


def attention_stats(weights, tokens, *, n_queries=64, n_sink=4, window=64, prefix=None):
    """:class:`AttentionStats` of the last ``n_queries`` positions of ``tokens``.

    ``prefix`` may be an exact pass made with ``keep_kv=True`` and ``capture_q`` equal to
    those positions; otherwise one is run.
    """
    tokens = np.asarray(tokens)
    T = tokens.shape[0]
    pos = np.arange(max(0, T - n_queries), T)
    if prefix is None:
        prefix = forward(weights, tokens, keep_kv=True, capture_q=pos)
    per_layer = [query_stats(q, k, pos, n_sink=n_sink, window=window)
                 for q, k in zip(prefix.q, prefix.k)]
    mean = {key: np.stack([d[key].mean(axis=0) for d in per_layer]) for key in per_layer[0]}
    return AttentionStats(n_tokens=T, query_positions=pos, n_sink=n_sink, window=window, **mean)


def summarize(stats: AttentionStats) -> dict:
    """Median and quartiles over all (layer, head) of every statistic (plain floats)."""
    out = {}
    for i, m in enumerate(MASS_LEVELS):
        out[f"key_fraction_{int(round(100 * m))}"] = _quart(stats.key_fraction[..., i])
    for key in ("entropy", "normalized_entropy", "sink_mass", "window_mass"):
        out[key] = _quart(getattr(stats, key))
    L = stats.sink_mass.shape[0]
    out["layer0_key_fraction_95_median"] = float(np.median(stats.key_fraction[0, :, 2]))
    out["sink_mass_layers_12_on"] = _quart(stats.sink_mass[12:]) if L > 12 else None
    return out


def _quart(a):
    q1, med, q3 = np.percentile(np.asarray(a, dtype=np.float64).ravel(), [25, 50, 75])
    return {"q1": float(q1), "median": float(med), "q3": float(q3)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m stochattn.eval.llm.attention_stats",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--play", default="hamlet")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--json", help="write the per-layer/head arrays and the summary here")
    args = ap.parse_args(argv)
    from .evaluate import load_tokens
    from .model import load_model

    stats = attention_stats(load_model(), load_tokens(args.play, args.tokens),
                            n_queries=args.queries)
    summ = summarize(stats)
    print(f"play {args.play}, {args.tokens} tokens, last {args.queries} queries, "
          f"{stats.entropy.size} (layer, head) pairs; median [q1, q3] over heads")
    for key, v in summ.items():
        if isinstance(v, dict):
            print(f"  {key:26s} {v['median']:.4f} [{v['q1']:.4f}, {v['q3']:.4f}]")
        elif v is not None:
            print(f"  {key:26s} {v:.4f}")
    frac95 = stats.key_fraction[..., 2]
    print("  per layer, median fraction of keys for 95% mass / mean sink mass:")
    for li in range(frac95.shape[0]):
        print(f"    layer {li:2d}: {np.median(frac95[li]):.4f}  {stats.sink_mass[li].mean():.3f}")
    if args.json:
        d = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in asdict(stats).items()}
        d["summary"] = summ
        d["play"] = args.play
        with open(args.json, "w") as fh:
            json.dump(d, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
