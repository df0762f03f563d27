#!/usr/bin/env bash
# First use with and without tools/gpu/patches/prefetch_first_use.patch, each in fresh
# processes with an empty CuPy cache (the Numba k-means cache is left as it is; the
# index-process rows are skipped). Run from the repository root on the GPU machine.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=".:${PYTHONPATH:-}"
out="${OUT:-benchmarks/results/tmp}"
mkdir -p "$out"
for variant in landed patched; do
  if [ "$variant" = patched ]; then git apply tools/gpu/patches/prefetch_first_use.patch || exit 1; fi
  CUPY_CACHE_DIR=$(mktemp -d) timeout 150 python3 -m tools.first_use --no-index-processes \
    --out "$out/first_use_$variant.json" 2>&1 | grep -v Warning | tail -12 | sed "s/^/$variant: /"
  if [ "$variant" = patched ]; then git apply -R tools/gpu/patches/prefetch_first_use.patch; fi
done
