"""Error-targeted budgets on the GPU against fixed-budget S²ANTA-prop, in the same run
(issue "Error-targeted budgets": the budget choice may cost at most 5% over fixed-S prop
at batch 8, 32k and 128k).

Shape: Llama-3.1-8B decode (Hq 32, Hkv 8, D 128), fp16, calibrated inputs as bench_decode
(``--inputs``). For each (batch, context) and each error-targeted setting (``--settings``:
eps / delta / rule / norm / pilot, ``max_budget`` fixed by ``--max-budget``):

- ``targeted``: ``SantaPlan(eps=..., ...)`` with the squared value norms kept beside the
  cache (``stochattn.value_sqnorms``, computed once and untimed, as an engine updates them
  on append), through the plan with ``out=`` and its kept workspace;
- its chosen budgets from one diagnosed call: the mean S over (sequence, head), the share
  of capped heads;
- ``fixed-mean``: fixed-S prop (systematic) at S = ceil(mean chosen S): the same number of
  draws without the choice, so ``targeted / fixed-mean`` is the cost of choosing (the
  pass-1 norms read, the pilot, the budget kernel, per-row S);
- ``fixed-max``: fixed-S prop at S = max_budget, what a caller without the choice would
  set to be safe.

``--launches``: also each launch of the targeted call alone under graph replay, the
others replaced by no-ops (:func:`launch_slots`: pass 1, each pilot set, the moment and
budget kernels, the main draws; with ``--doublep`` :func:`doublep_launch_slots`: the
decode's launches, then moment, prep, pilot, budgets, main and the merge), as
``launch_<name>_us``: where the overhead goes, for a GPU image without Nsight Systems. Each
launch alone reads what the warm-up's whole call left in the plan's workspace.

With ``--doublep`` the same comparison for Double-P's sampled variant at (0.95, 0.7) (issue
32, error-targeted budgets on its C_approx; ``--doublep-settings``): ``DoublePPlan(eps=...)``
against ``DoublePPlan(budget=ceil(mean S))`` and at ``max_budget``, on one GPU index
(``tokens / 32`` clusters, 4 Lloyd iterations, built for the first sequence and stacked
over the batch, untimed), plus the share of heads that drew a pilot and the mean pilot.

Timing: ``steady`` and ``graph`` as bench_decode (the targeted call takes device offsets
only through its plan's ``advance_offset``; here host offsets, fixed per timing). Writes
benchmarks/results/bench_budgets.{json,csv} (``--out``) and prints a table.
Run: PYTHONPATH=. python3 -m benchmarks.run --routine budgets [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

from .bench_decode import (HKV, HQ, RESULTS, D, INPUTS, Timing, _fmt, _write, launches_alone,
                           make_inputs, plan_of,
                           time_graph, time_steady)

# (eps, delta, rule, norm, pilot)
SETTINGS = {
    "0.1/0.1 clt pilot64": (0.1, 0.1, "clt", "pilot", 64),
    "0.1/0.1 clt student256": (0.1, 0.1, "clt", "student", 256),
    "0.2/0.1 chebyshev pilot64": (0.2, 0.1, "chebyshev", "pilot", 64),
}
# Double-P (eps, delta, rule, norm, pilot): the pilot cap of "auto" is generous (only what
# pays is drawn; docs/budgets.md).
DOUBLEP_SETTINGS = {
    "dp 0.1/0.1 clt auto4096": (0.1, 0.1, "clt", "auto", 4096),
    "dp 0.1/0.1 clt pilot64": (0.1, 0.1, "clt", "pilot", 64),
    "dp 0.2/0.1 chebyshev bound": (0.2, 0.1, "chebyshev", "bound", 64),
}


def _torch():
    import torch

    return torch


def _host(x):
    """A diagnostics array (NumPy, CuPy or torch) as a float64 NumPy array."""
    import numpy as np

    if hasattr(x, "get"):
        x = x.get()
    elif hasattr(x, "cpu"):
        x = x.cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def launch_slots(plan):
    """``[(name, owner, attribute, index)]``: the launches of a targeted prop plan
    (``stochattn.cuda.santa._TargetedPlan``) in call order; ``index`` picks one pilot set
    of the ``pilot_launches`` sequence, None a plain attribute."""
    base = plan.base
    slots = [("pass1_logits", base, "logits", None)]
    if base.tiles is not None:  # CUDA-core pass 1: logits, then the tile statistics
        slots.append(("pass1_tiles", base, "tiles", None))
    slots += [(f"pilot_{i}", plan, "pilot_launches", i) for i in range(len(plan.pilot_launches))]
    slots += [(name, plan, f"{name}_launch", None) for name in ("moment", "budgets", "main")]
    return slots


#: The launches of a targeted Double-P sampled plan (``stochattn.cuda.doublep._DoublePPlan``
#: with ``targeted``), in call order: the decode's own (cluster logits, selection, row list,
#: exact part, the C_approx stash's tiles), then the budgets' (moment, prep, pilot, budgets,
#: main draws) and the merge. A None attribute (no pilot under "bound", no merge) is left out.
DOUBLEP_LAUNCHES = (("cluster_logits", "logits"), ("select", "select"), ("rows", "rows"),
                    ("attend", "attend"), ("tiles", "tiles"), ("moment", "split_moment"),
                    ("prep", "split_prep"), ("pilot", "split_pilot"),
                    ("budgets", "split_budgets"), ("main", "split_main"), ("merge", "merge"))


def doublep_launch_slots(plan):
    """``[(name, owner, attribute, None)]`` of a targeted Double-P plan (:data:`DOUBLEP_LAUNCHES`),
    for :func:`benchmarks.bench_decode.launches_alone`."""
    if getattr(plan, "targeted", None) is None:
        raise ValueError("`plan` must be a Double-P plan with error-targeted budgets")
    return [(name, plan, attr, None) for name, attr in DOUBLEP_LAUNCHES
            if getattr(plan, attr, None) is not None]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 8 at 32k only")
    ap.add_argument("--cases", default="1:32768,8:32768,8:131072,32:32768",
                    help="comma-separated BATCH:TOKENS (--quick: 8:32768)")
    ap.add_argument("--max-budget", type=int, default=1024)
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated names of {sorted(SETTINGS)}")
    ap.add_argument("--inputs", default="calibrated", choices=INPUTS)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--launches", action="store_true",
                    help="also each launch of the targeted call alone (graph replay)")
    ap.add_argument("--doublep", action="store_true",
                    help="Double-P's sampled variant at (0.95, 0.7) instead of S²ANTA-prop")
    ap.add_argument("--doublep-settings", default=",".join(DOUBLEP_SETTINGS),
                    help=f"comma-separated names of {sorted(DOUBLEP_SETTINGS)}")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_budgets"))
    args = ap.parse_args(argv)
    torch = _torch()
    import stochattn

    table = DOUBLEP_SETTINGS if args.doublep else SETTINGS
    names = args.doublep_settings if args.doublep else args.settings
    settings = [s.strip() for s in names.split(",") if s.strip()]
    unknown = [s for s in settings if s not in table]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {sorted(table)}")
    try:
        cases = [(8, 32768)] if args.quick else [
            tuple(int(n) for n in c.split(":")) for c in args.cases.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--cases: expected BATCH:TOKENS,..., got {args.cases!r}") from None
    meta = dict(date=time.strftime("%Y-%m-%d"), card=torch.cuda.get_device_name(),
                torch=torch.__version__, python=platform.python_version(),
                shape=dict(Hq=HQ, Hkv=HKV, D=D), dtype="float16", inputs=args.inputs,
                max_budget=args.max_budget,
                estimator="doublep (0.95, 0.7) sampled" if args.doublep else "santa prop")
    rows = []
    for B, N in cases:
        q, k, v, source = make_inputs(B, N, torch.float16, inputs=args.inputs)
        meta["source"] = source
        sq = stochattn.value_sqnorms(v)
        t = Timing.for_floor(B * HKV * N * D * 2 / 3e12 * 1e6)
        out = torch.empty_like(q)
        extra = {}
        if args.doublep:  # one index, built for the first sequence, stacked (untimed)
            from stochattn.doublep import DoublePIndex

            one = stochattn.build_doublep_index(k[:1], v[:1], n_clusters=max(1, N // 32),
                                                iterations=4)
            extra["index"] = DoublePIndex.stack([one] * B) if B > 1 else one

        def timed(plan, **call):
            run = lambda: plan.run(q, k, v, out=out, seed=1, offset=0, **extra,  # noqa: E731
                                   **call)
            run()
            return dict(steady_us=time_steady(run, t),
                        graph_us=None if args.no_graphs else time_graph(run, t))

        fixed = {}

        def make(**opts):
            if args.doublep:
                return stochattn.DoublePPlan(approx="sample", p1=0.95, p2=0.7, device="cuda",
                                             **opts)
            return stochattn.SantaPlan(device="cuda", **opts)

        def fixed_at(S):
            if S not in fixed:
                fixed[S] = timed(make(budget=S))
            return fixed[S]

        for name in settings:
            eps, delta, rule, norm, pilot = table[name]
            row = dict(batch=B, tokens=N, setting=name)
            try:
                plan = make(eps=eps, delta=delta, max_budget=args.max_budget, budget_rule=rule,
                            budget_norm=norm, pilot=pilot)
                _, diag = plan.diagnose(q, k, v, seed=1, offset=0, v_sqnorms=sq, **extra)
                row["mean_budget"] = float(_host(diag.budget).mean())
                row["capped_share"] = float(_host(diag.budget_capped).mean())
                pilots = _host(diag.budget_pilot)
                row["pilot_share"] = float((pilots > 0).mean())
                row["mean_pilot"] = float(pilots.mean())
                row.update({f"targeted_{k_}": x for k_, x in timed(plan, v_sqnorms=sq).items()})
                if args.launches:
                    run = lambda: plan.run(q, k, v, out=out, seed=1, offset=0,  # noqa: E731
                                           v_sqnorms=sq, **extra)
                    slots = (doublep_launch_slots if args.doublep else launch_slots)(
                        plan_of(run))
                    alone = launches_alone(lambda: time_graph(run, t), slots)
                    row.update({f"launch_{n}_us": x for n, x in alone.items()})
                    print(f"B={B} N={N} {name}: " + ", ".join(
                        f"{n} {x:.1f}" for n, x in alone.items()) + " us alone (graph)")
                s_mean = max(1, math.ceil(row["mean_budget"]))
                row["fixed_mean_S"] = s_mean
                for label, S in (("fixed_mean", s_mean), ("fixed_max", args.max_budget)):
                    for k_, x in fixed_at(S).items():
                        row[f"{label}_{k_}"] = x
                for mode in ("steady_us", "graph_us"):
                    tt, fm = row.get(f"targeted_{mode}"), row.get(f"fixed_mean_{mode}")
                    if tt and fm:
                        row[f"overhead_{mode[:-3]}"] = tt / fm
            except Exception as e:  # noqa: BLE001 - a failing setting is a row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            _write(rows, meta, args.out)
        fixed.clear()
        extra.clear()
        torch.cuda.empty_cache()
    _write(rows, meta, args.out)
    print(f"{'B':>3} {'N':>7} {'setting':<26} {'mean S':>7} {'capped':>6} {'targeted':>9} "
          f"{'fixed@mean':>10} {'fixed@max':>9} {'overhead':>8} {'graph':>6}")
    for r in rows:
        print(f"{r['batch']:>3} {r['tokens']:>7} {r['setting']:<26} "
              f"{_fmt(r.get('mean_budget'), '.0f'):>7} {_fmt(r.get('capped_share'), '.2f'):>6} "
              f"{_fmt(r.get('targeted_steady_us'), '.1f'):>9} "
              f"{_fmt(r.get('fixed_mean_steady_us'), '.1f'):>10} "
              f"{_fmt(r.get('fixed_max_steady_us'), '.1f'):>9} "
              f"{_fmt(r.get('overhead_steady'), '.3f'):>8} {_fmt(r.get('overhead_graph'), '.3f'):>6}"
              f" {r.get('error', '')}")
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
