"""Plot an accuracy sweep: loss change against the fraction of V rows read.

Run from the repository root (needs matplotlib, in the ``eval`` extra)::

    python -m benchmarks.plot_accuracy                      # benchmarks/results/accuracy_2048.json
    python -m benchmarks.plot_accuracy --json FILE --out docs/accuracy_2k.png

Reads the ``rows`` of the JSON written by :mod:`benchmarks.accuracy`: one line per estimator
family (x: mean fraction of V rows read per (position, KV head, layer), log scale; y: change
of the mean next-token loss against exact attention, nats per token), error bars on the
stochastic estimators (95% interval of the estimator's randomness, seeds pooled over
positions), every point labelled with its setting; the Double-P and cluster top-k labels add the
fraction of K rows read (``K31%``), which for them is below 100% (SANTA and the oracle
selections read every key, Quest as many K as V rows).
"""

from __future__ import annotations

import argparse
import json

__all__ = ["plot"]

# One style per family; SANTA samplers share a hue family, the baselines differ in marker.
_STYLE = {
    "SANTA prop systematic": dict(color="#1f77b4", marker="o"),
    "SANTA prop stratified": dict(color="#17becf", marker="s"),
    "SANTA prop iid": dict(color="#9467bd", marker="^"),
    "oracle top-k": dict(color="#d62728", marker="D"),
    "Quest": dict(color="#ff7f0e", marker="v"),
    "oracle top-p": dict(color="#2ca02c", marker="P"),
    "Double-P centroid": dict(color="#8c564b", marker="X"),
    "Double-P sample": dict(color="#e377c2", marker="*"),
    "top-k clusters": dict(color="#7f7f7f", marker="h"),
    "Double-P centroid, N/4 clusters": dict(color="#8c564b", marker="X", ls="--", mfc="none"),
    "top-k clusters, N/4 clusters": dict(color="#7f7f7f", marker="h", ls="--", mfc="none"),
}


def _setting(row):
    o = row["options"]
    if row["estimator"] == "santa":
        return f"S={o['budget']}"
    if row["estimator"] == "topk":
        return f"k={o['budget']}"
    if row["estimator"] == "quest":
        return f"b={o['budget']}"
    if row["estimator"] == "top_p":
        return f"p={o['p']}"
    if row["estimator"] == "doublep":
        s = f"S={o['budget']}" if o.get("approx") == "sample" else f"{o['p1']}/{o['p2']}"
    elif row["estimator"] == "cluster_topk":
        s = f"{o['clusters']} cl"
    else:
        return ""
    # These read only part of K: show how much (SANTA and the oracles read every key).
    return s + f" K{100 * row.get('k_read_fraction', 1):.0f}%"


def plot(data, out, *, linthresh=0.003, dpi=110):
    """Write the figure of sweep ``data`` (the JSON dict) to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in data["rows"] if "v_read_fraction" in r]
    fig, ax = plt.subplots(figsize=(11.0, 5.8), dpi=dpi)
    families = list(dict.fromkeys(r["family"] for r in rows))
    for fam in families:
        rs = sorted((r for r in rows if r["family"] == fam), key=lambda r: r["v_read_fraction"])
        x = [r["v_read_fraction"] for r in rs]
        y = [r["delta_loss"] for r in rs]
        style = _STYLE.get(fam, {})
        # The seeds' interval pooled over positions (P-ish degrees of freedom; the t interval
        # over 3 seeds, df = 2, is in the table); falls back to the t interval.
        err = [r.get("delta_loss_ci95_pooled") or r.get("delta_loss_ci95") or 0.0 for r in rs]
        label = fam + (f" ({rs[0]['seeds']} seeds)" if rs[0].get("stochastic") else "")
        ax.errorbar(x, y, yerr=err if any(err) else None, label=label, capsize=3, lw=1.4,
                    ms=6, **style)
        for i, (r, xi, yi) in enumerate(zip(rs, x, y)):
            # Alternate above / below: neighbouring points of a family are close in x.
            ax.annotate(_setting(r), (xi, yi), textcoords="offset points",
                        xytext=(5, 4 if i % 2 == 0 else -11), fontsize=7,
                        color=style.get("color", "k"))
    ax.axhline(0.0, color="0.4", lw=0.8, ls="--")
    ax.set_xscale("log")
    ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
             if min(r["v_read_fraction"] for r in rows) / 1.5 <= t
             <= max(r["v_read_fraction"] for r in rows) * 1.5]
    ax.set_xticks(ticks, [f"{100 * t:g}%" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    top = max(r["delta_loss"] for r in rows)
    ax.set_ylim(-0.02, max(0.2, 1.6 * top))
    # Changes range from ~1e-3 (near exact) to ~0.5 nats (coarse selections): a symmetric
    # log axis keeps both ends readable, linear within +-linthresh.
    ax.set_yscale("symlog", linthresh=linthresh, linscale=1.0)
    ax.set_xlabel("fraction of V rows read (mean over positions, KV heads, layers; log)")
    ax.set_ylabel(f"change of next-token loss vs exact (nats/token)\n"
                  f"symlog: linear within ±{linthresh:g}")
    plays = ", ".join(data.get("plays", []))
    ax.set_title(f"SmolLM2-135M, {data.get('n_tokens')} tokens, {plays}: "
                 f"{data.get('n_positions')} positions per play (every {data.get('stride')}th "
                 f"of the 2nd half)\nerror bars: 95% CI of the estimator's randomness "
                 f"(seeds, pooled over positions); not the positions' sampling",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              title="K n% in a label: fraction of K\nrows read (the others read\nevery key; "
                    "Quest: K = V).\nDouble-P sample: p1/p2 = 0.95/0.7", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot_accuracy",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="benchmarks/results/accuracy_2048.json")
    ap.add_argument("--out", default="docs/accuracy_2k.png")
    ap.add_argument("--linthresh", type=float, default=0.003,
                    help="linear range of the symlog y axis (nats)")
    args = ap.parse_args(argv)
    with open(args.json) as fh:
        data = json.load(fh)
    plot(data, args.out, linthresh=args.linthresh)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
