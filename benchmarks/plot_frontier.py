"""The accuracy-cost frontier at 8k on SmolLM2: perplexity change against K and V rows read.

Run from the repository root (plotting needs matplotlib, in the ``eval`` extra)::

    python -m benchmarks.plot_frontier
    python -m benchmarks.plot_frontier --no-plot        # the points and the table only

Reads the Double-P mass-estimator study at 8k (``cluster_mass_8192_h100_2026-12-07_merged.json``
and the wider cuts of ``cluster_mass_8192_sub_h100_2026-12-07.json``, every configuration of
their "report" groups: Othello and King Lear, index seeds 0 and 1, 2048 positions) and the 8k accuracy sweeps (S²ANTA-prop systematic, oracle top-k, Quest, token top-p).
Each (family, setting) of the sweeps comes from the first file of ``--sweeps`` that has it; a
file that keeps one run per play gives the report plays' mean (the per-play positions' standard
errors combined), a file without the report plays gives its pooled row, marked with its plays.

Every point: perplexity change ``exp(delta) - 1`` with the 95% interval over positions
``exp(delta +- 1.96 se) - 1``; K and V rows read as fractions of the context, "with the index":
Double-P's summary vectors (centroids, sub-centroids, value summaries) counted as rows, Quest's
page summaries (min and max, 2 rows per 16-token page) added to its K. S²ANTA and the oracle
selections read every key. Writes the figure (two panels: x = K read, x = V read), a JSON of
exactly the points plotted (with the source file of each) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os

__all__ = ["doublep_points", "sweep_points", "build_points", "pareto", "markdown_table", "plot"]

RESULTS = "benchmarks/results"
MASS_FILE = f"{RESULTS}/cluster_mass_8192_h100_2026-12-07_merged.json"
# The wider cuts (mass_study --grid 8k-sub): the configurations run on both seeds.
MASS_SUB_FILE = f"{RESULTS}/cluster_mass_8192_sub_h100_2026-12-07.json"
SWEEP_FILES = (f"{RESULTS}/accuracy_8192_gpu_4096pos_2026-12-04.json",
               f"{RESULTS}/accuracy_8192_gpu_2026-12-04.json",
               f"{RESULTS}/accuracy_8192.json")
REPORT_PLAYS = ("othello", "king-lear")
QUEST_INDEX_K = 2 / 16  # Quest's page min / max: 2 rows of D per 16-token page
TARGET = 0.01  # issue 31: within 1% of exact perplexity

# family -> (colour, marker); the sweep families are matched on the sweep JSON's "family".
STYLE = {
    "Double-P paper": ("#8c564b", "X"),
    "Double-P sub": ("#1f77b4", "o"),
    "Double-P sub-near": ("#17becf", "s"),
    "Double-P pca-clip": ("#bcbd22", "P"),
    "Double-P exact C_approx weights": ("#7f7f7f", "h"),
    "Double-P exact mass (oracle)": ("#9467bd", "*"),
    "S²ANTA-prop systematic": ("#2ca02c", "D"),
    "oracle top-k": ("#d62728", "^"),
    "Quest": ("#ff7f0e", "v"),
    "token top-p (oracle)": ("#e377c2", "<"),
}
SWEEP_FAMILY = {"SANTA prop systematic": "S²ANTA-prop systematic", "oracle top-k": "oracle top-k",
                "Quest": "Quest", "oracle top-p": "token top-p (oracle)"}


def ppl_interval(delta, se):
    """Perplexity change and its 95% interval over positions, as fractions."""
    return math.expm1(delta), [math.expm1(delta - 1.96 * se), math.expm1(delta + 1.96 * se)]


def doublep_family(row):
    """Family of a mass-study row: its mass estimator (exact C_approx weights apart)."""
    if row.get("approx_weight", "estimate") == "exact":
        return "Double-P exact C_approx weights"
    return {"paper": "Double-P paper", "sub": "Double-P sub", "sub-near": "Double-P sub-near",
            "pca-clip": "Double-P pca-clip",
            "exact": "Double-P exact mass (oracle)"}.get(row["mass"], "Double-P " + row["mass"])


def doublep_setting(row):
    """``(0.95, 0.7), /16`` plus what differs from the defaults (value, margin, alpha, mass)."""
    s = f"({row['p1']:g}, {row['p2']:g}), /{row.get('cluster_ratio', 16)}"
    if row.get("approx_weight", "estimate") == "exact":
        s += f", {row['mass']} mass"
    if row.get("value", "mean") != "mean":
        s += f", {row['value']} value"
    if "margin" in row:
        s += f", margin {row['margin']:g}"
    if row.get("alpha", 1.0) != 1.0:
        s += f", alpha {row['alpha']:g}"
    return s


def doublep_points(data, source, group="report"):
    """One point per configuration of the mass study's ``group``."""
    g = data[group]
    out = []
    for r in g["rows"]:
        ppl, ci = ppl_interval(r["delta_loss"], r["delta_loss_se"])
        out.append(dict(
            family=doublep_family(r), setting=doublep_setting(r), label=r["label"],
            delta_loss=r["delta_loss"], delta_loss_se=r["delta_loss_se"],
            ppl_change=ppl, ppl_change_ci95=ci,
            k_read=r["k_read"], v_read=r["v_read"],
            k_read_all=r["k_read_all"], v_read_all=r["v_read_all"],
            plays=sorted(g["plays"]), positions=r["positions"], report_plays=True,
            seeds=r.get("seeds"), source=source))
    return out


def sweep_setting(row):
    """``S = 64`` / ``k = 256`` / ``b = 64`` / ``p = 0.9`` from a sweep row's options."""
    o = row["options"]
    if row["estimator"] == "top_p":
        return f"p = {o['p']:g}"
    return {"santa": "S", "topk": "k", "quest": "b"}[row["estimator"]] + f" = {o['budget']}"


def _sweep_point(row, delta, se, k, v, plays, positions, source, report):
    ppl, ci = ppl_interval(delta, se)
    k_all = k + (QUEST_INDEX_K if row["estimator"] == "quest" else 0.0)
    return dict(family=SWEEP_FAMILY[row["family"]], setting=sweep_setting(row), label=row["label"],
                delta_loss=delta, delta_loss_se=se, ppl_change=ppl, ppl_change_ci95=ci,
                k_read=k, v_read=v, k_read_all=min(1.0, k_all), v_read_all=v,
                plays=sorted(plays), positions=positions, report_plays=report,
                seeds=row.get("seeds"), source=source)


def sweep_points(data, source, keep, plays=REPORT_PLAYS):
    """Points of an accuracy sweep for the rows ``keep(row)`` accepts.

    With a run of every one of ``plays`` for a row (its ``runs``): the plays' mean loss change
    and reads (equal positions per play) and the combined s.e. ``sqrt(sum se_i^2) / n``.
    Otherwise the row itself (all of the file's plays pooled)."""
    out = []
    for row in data["rows"]:
        if row.get("family") not in SWEEP_FAMILY or not keep(row):
            continue
        runs = {r["play"]: r for r in data.get("runs", []) if r.get("label") == row["label"]
                and r.get("options") == row["options"]}
        if all(p in runs for p in plays):
            rs = [runs[p] for p in plays]
            n = len(rs)
            delta = sum(r["delta_loss"] for r in rs) / n
            se = math.sqrt(sum(r["delta_loss_se_positions"] ** 2 for r in rs)) / n
            k = sum(r["diagnostics"]["k_read_fraction"] for r in rs) / n
            v = sum(r["diagnostics"]["v_read_fraction"] for r in rs) / n
            out.append(_sweep_point(row, delta, se, k, v, plays,
                                    sum(r["n_positions"] for r in rs), source, True))
        else:
            out.append(_sweep_point(row, row["delta_loss"], row["delta_loss_se_positions"],
                                    row["k_read_fraction"], row["v_read_fraction"], row["plays"],
                                    data["n_positions"] * len(row["plays"]), source, False))
    return out


def keep_sweep_row(s_min=64, s_max=512):
    """S²ANTA-prop systematic at S_min..S_max and every oracle top-k, Quest and top-p row."""
    def keep(row):
        if row["family"] == "SANTA prop systematic":
            return s_min <= row["options"]["budget"] <= s_max
        return True
    return keep


def build_points(mass, sweeps, *, load=None, keep=None):
    """Every point: the report group of the mass study (``mass``: a path, or several, each
    configuration from the first file that has it), then each (family, setting) of the
    sweeps from the first of ``sweeps`` that has it; ordered by family (``STYLE``), then K
    and V read. ``load(path)`` returns a file's dict."""
    load = load or _load_json
    keep = keep or keep_sweep_row()
    points, labels = [], set()
    for path in [mass] if isinstance(mass, str) else mass:
        for p in doublep_points(load(path), path):
            if p["label"] not in labels:
                labels.add(p["label"])
                points.append(p)
    seen = set()
    for path in sweeps:
        for p in sweep_points(load(path), path, keep):
            if (p["family"], p["setting"]) not in seen:
                seen.add((p["family"], p["setting"]))
                points.append(p)
    fams = list(STYLE)
    return sorted(points, key=lambda p: (fams.index(p["family"]), not p["report_plays"],
                                         p["k_read_all"], p["v_read_all"]))


def pareto(points, x):
    """Indices of the points on the lower-left frontier of (``x``, ppl change), by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][x], points[i]["ppl_change"]))
    best, out = math.inf, []
    for i in order:
        if points[i]["ppl_change"] < best:
            best = points[i]["ppl_change"]
            out.append(i)
    return out


def mark_frontier(points):
    """``frontier_k`` / ``frontier_v``: on the frontier of the report plays' points."""
    rep = [i for i, p in enumerate(points) if p["report_plays"]]
    for x, key in (("k_read_all", "frontier_k"), ("v_read_all", "frontier_v")):
        on = {rep[j] for j in pareto([points[i] for i in rep], x)}
        for i, p in enumerate(points):
            p[key] = i in on
    return points


def markdown_table(points):
    """The points as a markdown table (frontier marks: K / V)."""
    lines = ["| family | setting | ppl change [95% CI] | K read with the index | V read "
             "(with the index) | plays, positions | source |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        lo, hi = p["ppl_change_ci95"]
        mark = ("K" if p.get("frontier_k") else "") + ("V" if p.get("frontier_v") else "")
        plays = "report" if p["report_plays"] else " + ".join(x.title() for x in p["plays"])
        lines.append(
            f"| {p['family']} | {p['setting']} | {100 * p['ppl_change']:+.2f}% "
            f"[{100 * lo:+.1f}, {100 * hi:+.1f}]{' **' + mark + '**' if mark else ''} | "
            f"{100 * p['k_read_all']:.1f}% | {100 * p['v_read_all']:.1f}% | "
            f"{plays}, {p['positions']} | `{os.path.basename(p['source'])}` |")
    return "\n".join(lines)


# Points at 100% of K (they read every key) side by side, so that they stay legible.
DODGE_FULL_K = {"Double-P exact mass (oracle)": 0.92, "S²ANTA-prop systematic": 0.96,
                "oracle top-k": 1.04, "token top-p (oracle)": 1.08}


def _xy(p, x, ymax):
    """Plotted position of a point: x in %, dodged at 100% of K; y in %, clipped at ``ymax``."""
    xi = 100 * p[x]
    if x == "k_read_all" and p[x] >= 0.999:
        xi *= DODGE_FULL_K.get(p["family"], 1.0)
    return xi, min(100 * p["ppl_change"], ymax)


def _panel(ax, points, x, xlabel, ymax):
    for fam, (color, marker) in STYLE.items():
        for report in (True, False):
            ps = [p for p in points if p["family"] == fam and p["report_plays"] == report]
            if not ps:
                continue
            xs, ys = zip(*(_xy(p, x, ymax) for p in ps))
            lo = [y - 100 * p["ppl_change_ci95"][0] if y < ymax else 0 for p, y in zip(ps, ys)]
            hi = [max(0.0, min(100 * p["ppl_change_ci95"][1], ymax) - y) for p, y in zip(ps, ys)]
            ax.errorbar(xs, ys, yerr=[lo, hi], ls="none", marker=marker, color=color, ms=6,
                        mfc=color if report else "white", capsize=2, lw=0.9, elinewidth=0.8,
                        label=fam + ("" if report else " *"))
    rep = [p for p in points if p["report_plays"]]
    front = [rep[i] for i in pareto(rep, x)]
    fx = [100 * p[x] for p in front] + [100.0]
    fy = [100 * p["ppl_change"] for p in front]
    ax.step(fx, fy + fy[-1:], where="post", color="0.35", lw=0.9, ls=":",
            label="frontier (report plays)")
    ax.axhline(100 * TARGET, color="#d62728", lw=0.9, ls="--", label="+1% (issue 31's target)")
    ax.axhline(0.0, color="0.5", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylim(-1.3, ymax + 0.3)
    ax.grid(True, which="both", alpha=0.25)


def plot(points, out, *, ymax=6.0, dpi=110):
    """Write the two-panel figure of ``points`` to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker as mt

    fig, axes = plt.subplots(1, 2, figsize=(12.5, 5.6), dpi=dpi, sharey=True)
    _panel(axes[0], points, "k_read_all", "K rows read, with the index's summary vectors "
           "(% of context, log)", ymax)
    _panel(axes[1], points, "v_read_all", "V rows read, with the index's value summaries "
           "(% of context, log)", ymax)
    for ax in axes:
        ax.xaxis.set_major_formatter(mt.FuncFormatter(lambda v, _: f"{v:g}%"))
        ax.xaxis.set_minor_formatter(mt.FuncFormatter(
            lambda v, _: f"{v:g}" if str(round(v, 6))[0] in "235" else ""))
        ax.tick_params(axis="x", which="minor", labelsize=7)
    axes[0].set_ylabel(f"perplexity change vs exact attention (%)\n95% CI over positions; "
                       f"clipped at +{ymax:g}%")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   title="filled: report plays Othello + King Lear,\npositions 4096-8188 "
                         "step 4 (2048):\nDouble-P: H100 mass study 12-07, 2 seeds;\n"
                         "S²ANTA: H200 sweep 12-04; same positions,\nseparate runs, not "
                         "paired.\n* hollow: Hamlet + Macbeth, 128 positions\nper play "
                         "(S = 256: H200 12-04; top-k,\nQuest, top-p: CPU 12-02): other plays\n"
                         "and positions than the filled", title_fontsize=7)
    off = [p for p in points if 100 * p["ppl_change"] > ymax]
    if off:  # drawn at the top edge; their values under the legend
        axes[1].text(1.03, 0.0, "at the top edge, off the axis:\n" + "\n".join(
            f"{p['family']} {p['setting']}: {100 * p['ppl_change']:+.0f}%" for p in off),
            transform=axes[1].transAxes, ha="left", va="bottom", fontsize=7)
    fig.suptitle("SmolLM2-135M, 8192 tokens, every layer: accuracy against rows read (K: "
                 "S²ANTA, top-k, top-p and the exact-mass\noracle read every key, drawn side by side "
                 "at 100%; Quest's K counts its page summaries). Frontier: the report plays' "
                 "points only", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def _load_json(path):
    with open(path) as fh:
        return json.load(fh)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot_frontier",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--mass", nargs="+", default=[MASS_FILE, MASS_SUB_FILE],
                    help="the mass study's JSONs (report group; first file first per "
                         "configuration)")
    ap.add_argument("--sweeps", nargs="+", default=list(SWEEP_FILES),
                    help="accuracy sweeps, first file first for each (family, setting)")
    ap.add_argument("--santa-budgets", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    ap.add_argument("--out", default="docs/accuracy_frontier_8k.png")
    ap.add_argument("--json", default=f"{RESULTS}/accuracy_frontier_8k_2026-12-07.json")
    ap.add_argument("--ymax", type=float, default=6.0, help="top of the y axis (%%)")
    ap.add_argument("--no-plot", action="store_true", help="points, JSON and table only")
    args = ap.parse_args(argv)
    points = mark_frontier(build_points(args.mass, args.sweeps,
                                        keep=keep_sweep_row(*args.santa_budgets)))
    with open(args.json, "w") as fh:
        json.dump(dict(date="2026-12-07", n_tokens=8192, model="SmolLM2-135M-Instruct",
                       command="python -m benchmarks.plot_frontier",
                       note="ppl_change and its 95% CI over positions as fractions; reads as "
                            "fractions of the context; *_all: with the index's summary rows "
                            "(Quest: + 2/16 page summaries on K); frontier_*: on the lower-left "
                            "frontier of the report plays' points",
                       points=points), fh, indent=1)
    print(markdown_table(points))
    if not args.no_plot:
        plot(points, args.out, ymax=args.ymax)
        print(f"wrote {args.out}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
