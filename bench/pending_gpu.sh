#!/usr/bin/env bash
# The GPU checks that sessions without a GPU left behind, one step per device call (each
# well under the 10-minute limit), run from the repository root on the GPU machine.
# Outputs go to $OUT (the device tool's folder) or bench/results/tmp. Remove a step once its
# results are in docs/benchmarks.md.
#
#   bash bench/pending_gpu.sh flash-tests     # every flash GPU test, both step-1 kernels
#   bash bench/pending_gpu.sh flash-sanitize  # compute-sanitizer memcheck, odd sizes, both kernels
#   bash bench/pending_gpu.sh flash-tune      # bench/tune_flash.py: simt against every tc tiling
#   bash bench/pending_gpu.sh decode-tests    # exact / plan / prop GPU tests, memcheck of the merge
#   bash bench/pending_gpu.sh read-floor      # bench/read_floor.py: what one read-only launch takes
#   bash bench/pending_gpu.sh revisions       # compare_revisions (carry bench/revs, made here by
#                                             #   python3 bench/compare_revisions.py prepare ...)
#   bash bench/pending_gpu.sh kmeans-patch labels  # bench/results/kmeans_assign_*_2026-12-05.patch
#   bash bench/pending_gpu.sh kmeans-patch both    #   timed against the landed kernel, 32k and 128k
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".:${PYTHONPATH:-}"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
out="${OUT:-bench/results/tmp}"
mkdir -p "$out"
step="${1:?usage: bash bench/pending_gpu.sh STEP (see the header)}"
py="python3 -m pytest -q -p no:cacheprovider"
case "$step" in
  flash-tests)
    $py tests/gpu/test_cuda_flash.py --durations=5 2>&1 | tee "$out/flash_tests.log" ;;
  flash-sanitize)
    compute-sanitizer --tool memcheck --error-exitcode 9 $py tests/gpu/test_cuda_flash.py \
      -k "seq_lens or shorter or in_kernel_merge or tc_equals" 2>&1 | tail -40 \
      | tee "$out/flash_sanitize.log" ;;
  flash-tune)
    python3 bench/tune_flash.py --cases 8:32768,8:131072,32:32768,1:32768 --tiles 64,128 \
      --budgets 256,2048 --kernels simt,tc --tc-tilings all --json "$out/tune_flash.json" \
      2>&1 | tee "$out/tune_flash.log" ;;
  decode-tests)
    $py tests/gpu/test_cuda_exact.py tests/gpu/test_cuda_plans.py tests/gpu/test_cuda_santa.py \
      2>&1 | tail -15 | tee "$out/decode_tests.log"
    compute-sanitizer --tool memcheck --error-exitcode 9 $py tests/gpu/test_cuda_exact.py \
      -k "in_kernel_merge or seq_lens" 2>&1 | tail -15 | tee -a "$out/decode_tests.log" ;;
  read-floor)
    python3 bench/read_floor.py --json "$out/read_floor.json" 2>&1 | tee "$out/read_floor.log" ;;
  revisions)
    python3 bench/compare_revisions.py time --json "$out/revisions.json" 2>&1 \
      | tee "$out/revisions.log" ;;
  kmeans-patch)
    # VARIANT=labels: the old labels loaded with the row norms (label_prefetch patch);
    # VARIANT=both: that and the interleaved row reductions (interleaved patch on top).
    variant="${2:-labels}"
    patches=bench/results/kmeans_assign_label_prefetch_2026-12-05.patch
    [ "$variant" = both ] && patches="$patches bench/results/kmeans_assign_interleaved_2026-12-05.patch"
    for ctx in 32768 131072; do
      python3 bench/tune_kmeans.py --tokens "$ctx" --clusters $((ctx / 32)) --geometries 4x1 2>&1 \
        | tail -2 | sed "s/^/landed $ctx: /" | tee -a "$out/kmeans_patch_$variant.log"
    done
    for P in $patches; do git apply "$P" 2>/dev/null || patch -p1 < "$P" || exit 1; done
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_kmeans.py 2>&1 | tail -2 \
      | tee -a "$out/kmeans_patch_$variant.log"
    for ctx in 32768 131072; do
      python3 bench/tune_kmeans.py --tokens "$ctx" --clusters $((ctx / 32)) --geometries 4x1 2>&1 \
        | tail -2 | sed "s/^/$variant $ctx: /" | tee -a "$out/kmeans_patch_$variant.log"
    done
    for P in $(echo $patches | tr ' ' '\n' | tac); do
      git apply -R "$P" 2>/dev/null || patch -R -p1 < "$P"
    done ;;
  *)
    echo "unknown step $step" >&2
    exit 2 ;;
esac
