"""Passes against clustering quality for k-means schedules, on the CPU: is there a cheaper
way than full-data Lloyd rounds to the objective that Double-P's default reaches?

    python3 tools/kmeans_schedules.py --tokens 32768 --json out.json

Keys: the calibrated generator (``stochattn.eval.calibrated``, seed 0, 8 KV heads, D 128, float16
then float32), the middle tokens of each head (4 sinks and a 64-token window left out),
N/32 clusters seeded as the index seeds them (``reference.kmeans.init_order``). Lloyd in
float32 with BLAS (a study of schedules, not the reference's float64 decisions). For each
schedule: the assignment passes it costs (a pass over a fraction f of the tokens counts f;
the final assignment counts 1) and its mean squared distance against ten full rounds.
Schedules: the early stop at tol (the index's rule, default 0.05), and warm starts that
first run r rounds on a random fraction f of the tokens (a prefix of the seeding order,
which holds the seeds), then full rounds to the same stop rule.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def _assign(X, cent):
    return ((cent * cent).sum(1)[None, :] - 2.0 * (X @ cent.T)).argmin(1)


def _update(X, lab, cent):
    sums = np.zeros_like(cent)
    np.add.at(sums, lab, X)
    cnt = np.bincount(lab, minlength=cent.shape[0])
    new = cent.copy()  # an empty cluster keeps its centroid
    m = cnt > 0
    new[m] = sums[m] / cnt[m, None]
    return new


def _objective(X, cent):
    return float(((X - cent[_assign(X, cent)]) ** 2).sum(1).mean())


def lloyd(X, cent, rounds, tol):
    """Rounds of assign + update until a round changes at most floor(tol M) labels (its
    update included, as in the index); returns the centroids and the passes made."""
    lab, passes, M = None, 0, len(X)
    for _ in range(rounds):
        new = _assign(X, cent)
        passes += 1
        changed = M if lab is None else int((new != lab).sum())
        lab = new
        if changed == 0:
            break
        cent = _update(X, lab, cent)
        if changed <= np.floor(tol * M):
            break
    return cent, passes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--json", help="write the per-head results here")
    args = ap.parse_args(argv)
    from stochattn.eval.calibrated import make_calibrated_inputs
    from stochattn.reference.kmeans import init_order

    N, n_sink, window = args.tokens, 4, 64
    C = N // 32
    _, k, _ = make_calibrated_inputs(1, 32, 8, N, 128, seed=0, dtype=np.float16)
    k = np.asarray(k, np.float32)
    schedules = [("tol", None, 0, t) for t in (0.02, 0.05, 0.1)]
    schedules += [("warm", f, r, t) for f in (0.25, 0.5) for r in (2, 3, 4) for t in (0.05, 0.1)]
    rows = []
    for h in range(args.heads):
        X = k[0, h, n_sink:N - window]
        order = init_order(0, np.array([[h]]), np.arange(n_sink, N - window))[0]
        c0 = X[order[:C]].copy()
        j10 = _objective(X, lloyd(X, c0, 10, 0.0)[0])
        for kind, f, r, tol in schedules:
            passes, c = 0.0, c0
            if kind == "warm":
                c, p = lloyd(X[order[: int(len(X) * f)]], c0, r, 0.0)
                passes += f * p
            c, p = lloyd(X, c, 10, tol)
            passes += p + 1  # the final assignment
            rows.append(dict(head=h, kind=kind, fraction=f, sub_rounds=r, tol=tol,
                             passes=passes, objective_vs_10=_objective(X, c) / j10 - 1))
    print(f"{N} tokens, {C} clusters, {args.heads} heads: mean (max) over heads")
    for kind, f, r, tol in schedules:
        sel = [x for x in rows if (x["kind"], x["fraction"], x["sub_rounds"], x["tol"])
               == (kind, f, r, tol)]
        p = np.array([x["passes"] for x in sel])
        o = 100 * np.array([x["objective_vs_10"] for x in sel])
        name = f"tol {tol}" if kind == "tol" else f"{r} rounds on {f:.0%}, then tol {tol}"
        print(f"  {name:30s} passes {p.mean():5.2f} ({p.max():.2f})   objective vs 10 rounds "
              f"{o.mean():+.2f}% ({o.max():+.2f}%)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(tokens=N, clusters=C, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
