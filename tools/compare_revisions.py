"""Time exact decode as built by several git revisions of stochattn, one after another on
one machine: to settle whether a slowdown between two benchmark runs is the code's or the
machine's.

Two steps, because the GPU machine gets a copy of the working tree without ``.git``:

    python3 tools/compare_revisions.py prepare 35347df c20ab41 HEAD   # here
    # there (carry ["tools/revs"], an ignored folder):
    PYTHONPATH=. python3 tools/compare_revisions.py time --json $OUT/revs.json

``prepare`` writes ``git archive REV stochattn`` to ``tools/revs/<short sha>/`` for each
revision (and a ``revs.txt`` listing them in the order given). ``time`` runs one child
process per revision, in that order and then the first once more (A B C A: a drift of the
machine over the run shows as a difference between the two A's), each with the
revision's ``stochattn`` first on ``sys.path`` (the child checks which one it imported).
Each child times, at every case, the revision's ``exact_decode(q, k, v, kernel=...)`` and
torch SDPA on the same inputs (Gaussian, seed 0, made on the GPU), and the device's copy
bandwidth once; the table gives microseconds and the percentage of the K+V floor (bytes of
K and V over 4.25e12 B/s, as tools/tune_exact_tc.py). Timing: tools/tune_decode.py's
``time_steady`` (3 warm-ups, median of 5 batches of 20 back-to-back calls).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REVS_DIR = os.path.join(ROOT, "tools", "revs")
HQ, HKV, D = 32, 8, 128
BANDWIDTH = 4.25e12  # B/s, as tools/tune_exact_tc.py
MARK = "@@compare_revisions@@ "
ROW_MARK = "@@compare_revisions_row@@ "


def parse_cases(text: str):
    """``"8:32768,1:131072"`` -> [(8, 32768), (1, 131072)]."""
    cases = []
    for item in text.split(","):
        b, _, n = item.partition(":")
        if not n:
            raise ValueError(f"cases: expected BATCH:CONTEXT items, got {item!r}")
        cases.append((int(b), int(n)))
    return cases


def prepare(revs, out_dir=REVS_DIR, repo=ROOT):
    """Extract ``stochattn/`` of each revision into ``out_dir/<short sha>``; returns the
    short shas in the order given (also written to ``out_dir/revs.txt``)."""
    os.makedirs(out_dir, exist_ok=True)
    shas = []
    for rev in revs:
        sha = subprocess.run(["git", "rev-parse", "--short=7", f"{rev}^{{commit}}"], cwd=repo,
                             check=True, capture_output=True, text=True).stdout.strip()
        blob = subprocess.run(["git", "archive", "--format=tar", sha, "stochattn"], cwd=repo,
                              check=True, capture_output=True).stdout
        dest = os.path.join(out_dir, sha)
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            tar.extractall(dest, filter="data")
        shas.append(sha)
    with open(os.path.join(out_dir, "revs.txt"), "w") as f:
        f.write("\n".join(shas) + "\n")
    return shas


def _child(rev_dir: str, cases, kernel: str):
    sys.path.insert(0, rev_dir)
    import stochattn
    import torch
    import torch.nn.functional as F

    from tools.tune_decode import copy_bandwidth, time_steady

    where = os.path.dirname(os.path.abspath(stochattn.__file__))
    if not where.startswith(os.path.abspath(rev_dir)):
        raise RuntimeError(f"imported stochattn from {where}, not from {rev_dir}")
    from stochattn.cuda.exact import exact_decode

    import inspect

    # A revision without the kernel argument times its only kernel; the results say which.
    has_kernel = "kernel" in inspect.signature(exact_decode).parameters
    used = kernel if has_kernel else "default (no kernel argument)"

    def ours(q, k, v):
        return exact_decode(q, k, v, kernel=kernel) if has_kernel else exact_decode(q, k, v)

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    for b, n in cases:
        q = torch.randn(b, HQ, D, device="cuda", generator=g, dtype=torch.float32).half()
        k = torch.randn(b, HKV, n, D, device="cuda", generator=g, dtype=torch.float16)
        v = torch.randn(b, HKV, n, D, device="cuda", generator=g, dtype=torch.float16)
        q4 = q[:, :, None]
        ref = F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)[:, :, 0].double()
        err = float((ours(q, k, v).double() - ref).abs().max() / ref.abs().max())
        us = time_steady(lambda: ours(q, k, v))
        sdpa = time_steady(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
        floor = 2 * k.numel() * k.element_size() / BANDWIDTH * 1e6
        rows.append({"batch": b, "context": n, "us": us, "sdpa_us": sdpa, "floor_us": floor,
                     "err": err})
        del q, k, v, q4, ref
        torch.cuda.empty_cache()
        # One line per row as it is measured, so that a run cut off at its time limit keeps
        # what it measured.
        print(ROW_MARK + json.dumps(rows[-1]), flush=True)
    print(MARK + json.dumps({"rev_dir": rev_dir, "stochattn": where, "copy_Bps": bw,
                             "kernel": used, "device": torch.cuda.get_device_name(),
                             "rows": rows}), flush=True)


def time_revisions(cases, kernel="tc", revs_dir=REVS_DIR, repeat_first=True, json_path=None):
    """One child per revision of ``revs_dir/revs.txt`` (then the first again); returns the
    children's results in run order. Each child's rows are printed, and ``json_path``
    rewritten, as soon as the child returns."""
    with open(os.path.join(revs_dir, "revs.txt")) as f:
        shas = [s for s in f.read().split() if s]
    order = shas + shas[:1] if repeat_first and len(shas) > 1 else shas
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    spec = ",".join(f"{b}:{n}" for b, n in cases)
    results = []
    for sha in order:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_child",
                                 os.path.join(revs_dir, sha), "--cases", spec, "--kernel", kernel],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        final, other = None, []
        for ln in proc.stdout:  # each row as the child measures it
            if ln.startswith(ROW_MARK):
                row = json.loads(ln[len(ROW_MARK):])
                print(f"  {sha} B={row['batch']} N={row['context']}: {row['us']:.1f} us "
                      f"({100 * row['floor_us'] / row['us']:.0f}% of floor), SDPA "
                      f"{row['sdpa_us']:.1f} us", flush=True)
            elif ln.startswith(MARK):
                final = json.loads(ln[len(MARK):])
            else:
                other.append(ln)
        rc = proc.wait()
        if rc or final is None:
            tail = "".join(other)[-3000:]
            print(f"{sha}: child failed (rc {rc})\n{tail}", flush=True)
            results.append({"rev": sha, "failed": True, "output": tail})
            continue
        final["rev"] = sha
        results.append(final)
        print(f"{sha}: copy bandwidth {final['copy_Bps'] / 1e12:.2f} TB/s, kernel "
              f"{final.get('kernel', kernel)}", flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1)
    return results


def print_table(results):
    ok = [r for r in results if not r.get("failed")]
    if not ok:
        return
    print(f"{'B':>3s} {'N':>7s} {'floor':>7s} | " + " | ".join(
        f"{r['rev']:>7s} us  %fl  sdpa" for r in ok))
    for i, row in enumerate(ok[0]["rows"]):
        cells = []
        for r in ok:
            x = r["rows"][i]
            bad = "!" if not x["err"] < 2e-2 else " "
            cells.append(f"{x['us']:8.1f} {100 * x['floor_us'] / x['us']:4.0f}%{bad}{x['sdpa_us']:6.0f}")
        print(f"{row['batch']:3d} {row['context']:7d} {row['floor_us']:7.1f} | " + " | ".join(cells))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="extract revisions into tools/revs (needs git)")
    p.add_argument("revs", nargs="+")
    p.add_argument("--dir", default=REVS_DIR)
    t = sub.add_parser("time", help="time each prepared revision (needs the GPU)")
    t.add_argument("--cases", default="8:32768,32:131072,1:131072,1:32768")
    t.add_argument("--kernel", default="tc")
    t.add_argument("--dir", default=REVS_DIR)
    t.add_argument("--json", help="write every child's results here")
    c = sub.add_parser("_child")
    c.add_argument("rev_dir")
    c.add_argument("--cases", required=True)
    c.add_argument("--kernel", default="tc")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        shas = prepare(args.revs, args.dir)
        print(f"prepared {' '.join(shas)} in {args.dir}")
    elif args.cmd == "_child":
        _child(args.rev_dir, parse_cases(args.cases), args.kernel)
    else:
        results = time_revisions(parse_cases(args.cases), args.kernel, args.dir,
                                 json_path=args.json)
        print_table(results)
        if args.json:
            print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
