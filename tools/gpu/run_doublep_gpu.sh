#!/usr/bin/env bash
# Double-P on the GPU machine in one go: its GPU tests, compute-sanitizer memcheck over
# them, a per-kernel profile at B=8 / 128k and the decode benchmark.
#   bash tools/gpu/run_doublep_gpu.sh             # everything
#   SKIP_BENCH=1 bash tools/gpu/run_doublep_gpu.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=".:${PYTHONPATH:-}"
status=0
echo "== Double-P GPU tests =="
python3 -m pytest tests/gpu/test_cuda_doublep.py -q -p no:cacheprovider -p no:warnings || status=1
echo "== memcheck =="
compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest tests/gpu/test_cuda_doublep.py \
    -q -p no:cacheprovider -p no:warnings -x -k "odd or fewer or one or grows" 2>&1 | tail -4 || status=1
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== profile B=8, 128k =="
  ncu --clock-control none -k regex:"doublep_|exact_decode_merge" --launch-skip 8 --launch-count 4 \
      --section SpeedOfLight python3 tools/profile_doublep.py --batch 8 --tokens 131072 \
      --iterations 10 2>&1 | grep -E "doublep_|exact_decode_merge|Duration|DRAM Through|host time"
  echo "== benchmark =="
  python3 benchmarks/bench_doublep.py ${CASES:+--cases $CASES} || status=1
  # On the device tool's machine, bring the results back.
  [ -n "${OUT:-}" ] && cp benchmarks/results/bench_doublep.json "$OUT/" 2>/dev/null
fi
exit $status
