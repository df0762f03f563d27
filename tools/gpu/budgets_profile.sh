#!/usr/bin/env bash
# Where the error-targeted S²ANTA-prop call's time goes (issue 32's overhead against fixed
# S, docs/budgets.md): Nsight Systems over benchmarks/bench_budgets.py, one case per
# profile (so each kernel's mean is one shape's), the CUDA kernel summary printed (mean
# ns per launch of every kernel: pass 1, the pilot's and the main sampling, the moment
# and budget kernels, and the fixed-S call's kernels beside them). Run from the
# repository root on the GPU machine; CSVs go to $OUT (or benchmarks/results/tmp).
#   CASES="1:32768 8:131072" SETTING="0.1/0.1 clt pilot64" bash tools/gpu/budgets_profile.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=".:${PYTHONPATH:-}"
out="${OUT:-benchmarks/results/tmp}"
mkdir -p "$out"
command -v nsys >/dev/null || { echo "nsys not found"; exit 3; }
for case in ${CASES:-1:32768 8:131072}; do
  tag=$(echo "$case" | tr ':' '_')
  rep="/tmp/budgets_$tag"
  timeout 240 nsys profile -t cuda --force-overwrite true -o "$rep" \
    python3 -m benchmarks.bench_budgets --cases "$case" --no-graphs \
    --settings "${SETTING:-0.1/0.1 clt pilot64}" --out "/tmp/bench_budgets_$tag" >/dev/null 2>&1
  nsys stats -q -r cuda_gpu_kern_sum --format csv -o "$out/budgets_kern_$tag" "$rep.nsys-rep" \
    >/dev/null 2>&1
  echo "=== $case"
  python3 - "$out/budgets_kern_${tag}_cuda_gpu_kern_sum.csv" <<'PY'
import csv, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
    for r in rows:
        name = r["Name"].split("(")[0][:70]
        print(f"{name:<70} n={r['Instances']:>6} mean={float(r['Avg (ns)']) / 1e3:9.1f} us "
              f"total={float(r['Time (%)']):5.1f}%")
except (OSError, KeyError, ValueError) as e:  # another nsys version's columns: print it raw
    print(f"({type(e).__name__}: {e})")
    print(open(sys.argv[1]).read()[:4000] if __import__("os").path.exists(sys.argv[1]) else "")
PY
done
