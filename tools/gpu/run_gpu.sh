#!/usr/bin/env bash
# GPU tests and the decode benchmark in one go (run from the repository root on the GPU
# machine). FlashInfer: put its install dir on PYTHONPATH (e.g. /tmp/site); its kernels
# JIT-compile on first use (about a minute per variant, not counted in the timings).
#   bash tools/gpu/run_gpu.sh               # everything
#   QUICK=1 bash tools/gpu/run_gpu.sh       # benchmark batch 1/8, context 8k/32k only
#   NO_GRAPHS=1 bash tools/gpu/run_gpu.sh   # skip the CUDA-graph timings
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=".:${PYTHONPATH:-}"
mkdir -p benchmarks/results
status=0
echo "== compile check (nvcc / NVRTC, no GPU needed) =="
python3 -m pytest tests/test_cuda_sources.py -q -x -p no:cacheprovider || status=1
echo "== GPU tests =="
python3 -m pytest tests/gpu -q -p no:cacheprovider --durations=5 || status=1
echo "== benchmark =="
python3 benchmarks/bench_decode.py ${QUICK:+--quick} ${NO_GRAPHS:+--no-graphs} || status=1
exit $status
