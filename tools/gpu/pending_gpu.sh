#!/usr/bin/env bash
# The GPU checks that sessions without a GPU left behind, run from the repository root on the
# GPU machine. Outputs go to $OUT (the device tool's folder) or benchmarks/results/tmp. Remove a
# step once its results are in docs/benchmarks.md.
#
# Several steps may share one device call (a fresh machine costs minutes to start and a warm
# one is given back 30 s after a call): the steps run in the order given, each logs its
# exit status and seconds to $out/steps.log, and a step whose estimate (EST below, guessed
# from earlier runs of similar size) no longer fits in BUDGET_S (default 560 s, under the
# 600 s limit of a call) is skipped and listed, to be run in the next call.
#
#   bash tools/gpu/pending_gpu.sh gpu-suite       # every GPU test (both flash step-1 kernels)
#   bash tools/gpu/pending_gpu.sh flash-tests     # every flash GPU test, both step-1 kernels
#   bash tools/gpu/pending_gpu.sh flash-sanitize  # compute-sanitizer memcheck, odd sizes, both kernels
#   bash tools/gpu/pending_gpu.sh flash-tune      # tools/tune_flash.py: simt against every tc tiling
#   bash tools/gpu/pending_gpu.sh decode-tests    # exact / plan / prop GPU tests, memcheck of the merge
#   bash tools/gpu/pending_gpu.sh flash-ncu       # Nsight Compute on both flash kernels, per-line counters
#   bash tools/gpu/pending_gpu.sh pdl             # programmatic dependent launch: tests, then on/off timing
#   bash tools/gpu/pending_gpu.sh read-floor      # tools/read_floor.py: what one read-only launch takes
#   bash tools/gpu/pending_gpu.sh revisions       # compare_revisions (carry tools/revs, made here by
#                                             #   python3 tools/compare_revisions.py prepare ...)
#   bash tools/gpu/pending_gpu.sh kmeans-patch:labels  # kmeans_assign_*_2026-12-05.patch (below)
#   bash tools/gpu/pending_gpu.sh kmeans-patch:both    #   timed against the landed kernel, 32k and 128k
#   bash tools/gpu/pending_gpu.sh paged-bench     # bench_paged --quick: flash's tile page numbers
#                                             #   (3c71c0d) paged/contiguous, FlashInfer on the
#                                             #   combined pool and on K/V views (carry .whl)
#   bash tools/gpu/pending_gpu.sh paged-capacity  # the Double-P index vs cache capacity test (900f9ba)
#   bash tools/gpu/pending_gpu.sh budgets-tests   # GPU tests of the budget kernels (review of 2026-12-07:
#                                             #   KvRows addressing, block_reduce) and of prop
#   bash tools/gpu/pending_gpu.sh budgets-sanitize  # memcheck of the error-targeted budget kernels
#   bash tools/gpu/pending_gpu.sh budgets-bench   # benchmarks/bench_budgets.py: the choice's cost
#                                             #   against fixed-S prop (target <= 5%)
#   bash tools/gpu/pending_gpu.sh prefetch-patch  # tools/gpu/patches/prefetch_first_use.patch: prop's and the
#                                             #   split-KV merge's kernels compile in parallel on
#                                             #   first use; tests, then tools/first_use.py cold
#   bash tools/gpu/pending_gpu.sh student-patch   # budgets_review.patch (review fixes and
#                                             #   tests) then the studentised bound in one
#                                             #   pass, ILP 4: tests, memcheck, bench_budgets
#   bash tools/gpu/pending_gpu.sh on-demand-patch # plain kernels compiled only where named:
#                                             #   GPU tests, memcheck, first use cold A/B
#   bash tools/gpu/pending_gpu.sh budgets-profile # nsys: where the error-targeted call's
#                                             #   remaining 1.19-1.53x over fixed S goes
#
# The kmeans-patch steps read their patches from the git-ignored benchmarks/results/tmp/ (they
# left the tree; they are in git history as of commit 0d2bdc0). Extract them here, then carry
# that folder:
#   mkdir -p benchmarks/results/tmp && for p in label_prefetch interleaved; do
#     git show 0d2bdc0:bench/results/kmeans_assign_${p}_2026-12-05.patch \
#       > benchmarks/results/tmp/kmeans_assign_${p}_2026-12-05.patch; done
#
# Device time counts from the asking to the giving back, starts (a minute or more) and the
# 30 s warm tail included: give each call BUDGET_S from status's budget_left_s less ~120 s.
# THE QUEUE, in order of value (after the fifth session of 2026-12-07, whose H100 ran and
# landed kmeans_raw, exact_lse, doublep_sub and doublep_budgets; the patches left are
# fp16_sub.patch (item 3) and prefetch_first_use.patch). Older notes: git log of this file.
#   1. issue 30: the warm first index build is 0.40-0.68 s through the raw entries (target 0.3
#      s); cProfile put ~0.5 s of a profiled build in fingerprint_gpu importing SciPy /
#      cupyx.scipy lazily (SciPy's sparse, numpy.f2py, array_api_compat); find the call
#      (tools/gpu/trace_imports.py prints the stack of each first import) and avoid it.
#   2. issue 32: fold m2's sums into pass 1 (the moment pass is 104 of the 152 us overhead
#      at B8/128k, budgets.md, 2.4x the 44 us its stash read costs: its 4096-token CTAs
#      each reduce the row's 2048 tile maxima first; see why before changing it:
#      ncu --clock-control none -k regex:santa_prop_second_moment --launch-skip 3
#      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section
#      Occupancy --section WarpStateStats python3 -m benchmarks.run --routine budgets
#      --cases 8:131072 --settings "0.1/0.1 clt pilot64" --no-graphs), then the pilot; where Double-P's "auto" (2.8-3.7x fixed S)
#      spends its time (~60 s): python3 -m benchmarks.run --routine budgets --doublep
#      --cases 8:32768,8:131072 --launches --out $OUT/bench_doublep_budgets_launches
#   3. issue 31: fp16 sub-centroids (the +120-132 us of stage 1 is bytes), written as
#      tools/gpu/patches/fp16_sub.patch (branch fp16-sub; CPU compile and tests pass). Apply
#      it, then: python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_doublep_sub.py
#      tests/gpu/test_cuda_doublep.py tests/gpu/test_cuda_doublep_append.py
#      tests/gpu/test_paged_doublep.py tests/gpu/test_cuda_doublep_budgets.py
#      -k "not decode_paged_equals_contiguous"; memcheck (--report-api-errors no) of
#      test_cuda_doublep_sub.py -k "llama or empty or append or paged or other_sub or float32";
#      python3 -u benchmarks/bench_doublep.py --cases 8:131072 --mass paper,sub
#      --no-flashinfer --sample-budgets 64 --out bench_doublep_sub16.json (predicted: sub
#      (0.99, 0.9) ~455 us, 3.0x SDPA, from 522 us); land if so; then the nine other
#      8k-sub configurations on seed 1 (GRID=8k-sub FIRST_SEED=1 SEEDS=1 TAG=v, after
#      run_llm_eval_gpu.sh install) and Macbeth seed 1 of the first grid; the 8k perplexity
#      through the GPU sub path (after the model install): python3 -m benchmarks.accuracy
#      --xp cupy --plays othello king-lear hamlet macbeth --tokens 8192 --stride 4 --seeds 1
#      --only doublep-0.99-0.9 doublep-sub-0.99-0.9 --out $OUT/accuracy_8192_sub.json
#   4. issue 30's decode loop again on the landed tree (run_llm_eval_gpu.sh run loop);
#      paged prop at B1 (1.27x eager, 1.12x graph) and flash at B8 (1.11x), bench_paged.
#   5. issue 35: python3 -m pytest -q tests/gpu/test_context_parallel_gpu.py (exact decode
#      over GPU shards, written 2026-12-07, not yet run); per-rank flash / prop kernels
#      (prop's pass 1 / pass 2 split), then NCCL.
set -u -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=".:${PYTHONPATH:-}"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
out="${OUT:-benchmarks/results/tmp}"
mkdir -p "$out"
[ $# -ge 1 ] || { echo "usage: bash tools/gpu/pending_gpu.sh STEP... (see the header)" >&2; exit 2; }
py="python3 -m pytest -q -p no:cacheprovider"
budget="${BUDGET_S:-560}"
start=$SECONDS

# Estimated seconds per step (rough: from the durations of earlier GPU runs of that size).
est() {
  case "$1" in
    gpu-suite) echo 330 ;; flash-tests) echo 120 ;; decode-tests) echo 150 ;;
    decode-sanitize) echo 120 ;; flash-sanitize) echo 420 ;; flash-tune) echo 240 ;;
    kmeans-patch:*) echo 120 ;; read-floor) echo 60 ;; flash-ncu) echo 150 ;; pdl) echo 180 ;; revisions) echo 200 ;;
    paged-bench) echo 220 ;; paged-capacity) echo 40 ;; budgets-sanitize) echo 150 ;; prefetch-patch) echo 200 ;;
    budgets-bench) echo 200 ;; budgets-tests) echo 150 ;; student-patch) echo 200 ;;
    budgets-profile) echo 120 ;; on-demand-patch) echo 330 ;;
    *) echo 60 ;;
  esac
}

# compute-sanitizer refuses the device on some machines (gVisor: "Device not supported";
# the device tool's KINDS.md): probe once, and skip the sanitizer steps there.
sanitizer_state=""
sanitizer_ok() {
  if [ -z "$sanitizer_state" ]; then
    if compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -c "import cupy; cupy.arange(4).sum().get()" >"$out/sanitizer_probe.log" 2>&1
    then sanitizer_state=ok; rm -f "$out/sanitizer_probe.log"
    else sanitizer_state=no; echo "compute-sanitizer does not run here (sanitizer_probe.log)"
    fi
  fi
  [ "$sanitizer_state" = ok ]
}

run_step() {
case "$1" in
  gpu-suite)
    $py tests/gpu --durations=15 -rs 2>&1 | tee "$out/gpu_suite.log" | tail -60 ;;
  decode-sanitize)
    sanitizer_ok || return 3
    compute-sanitizer --tool memcheck --error-exitcode 9 $py tests/gpu/test_cuda_exact.py \
      -k "in_kernel_merge or seq_lens" 2>&1 | tee "$out/decode_sanitize.log" | tail -15 ;;
  flash-tests)
    $py tests/gpu/test_cuda_flash.py --durations=5 2>&1 | tee "$out/flash_tests.log" ;;
  flash-sanitize)
    # memcheck over the odd sizes; racecheck and synccheck (the tc kernel's ldmatrix reads
    # other lanes' cp.async copies and its logits are written and read across lanes between
    # __syncwarp()s) on the small cases of every tc tiling.
    sanitizer_ok || return 3
    compute-sanitizer --tool memcheck --error-exitcode 9 $py tests/gpu/test_cuda_flash.py \
      -k "seq_lens or shorter or in_kernel_merge or tc_equals" 2>&1 | tee "$out/flash_sanitize.log" \
      | tail -40 &&
    for tool in racecheck synccheck; do
      compute-sanitizer --tool $tool --error-exitcode 9 $py tests/gpu/test_cuda_flash.py \
        -k "shorter or (tc_equals and float16)" 2>&1 | tee -a "$out/flash_sanitize.log" \
        | tail -12 || return 1
    done ;;
  flash-ncu)
    # Nsight Compute on both flash kernels at batch 8 / 32k, S = 2048, tile 64 (Gaussian
    # K/V): throughput, occupancy, stall reasons, executed instructions, and per-line
    # counters of the source (line tables from STOCHATTN_LINEINFO=1): where a tile's
    # instructions and stalls go now that the logits are on the tensor cores.
    for kern in simt tc; do
      STOCHATTN_LINEINFO=1 ncu --clock-control none -k regex:santa_flash --launch-skip 4 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section InstructionStats --section SourceCounters --import-source yes -f \
        -o "/tmp/flash_$kern" python3 tools/profile_flash.py 8 32768 2048 64 "$kern" \
        2>&1 | tail -5 || return 1
      ncu -i "/tmp/flash_$kern.ncu-rep" --page details --csv > "$out/flash_ncu_$kern.csv" &&
      ncu -i "/tmp/flash_$kern.ncu-rep" --page source --csv --print-source cuda \
        > "$out/flash_ncu_source_$kern.csv" || return 1
    done ;;
  pdl)
    # Programmatic dependent launch: the chains unchanged bit for bit (tests/gpu/test_pdl.py),
    # then on/off alternated for prop and Double-P (tools/pdl_ab.py).
    $py tests/gpu/test_pdl.py 2>&1 | tee "$out/pdl.log" | tail -5
    python3 tools/pdl_ab.py --json "$out/pdl_ab.json" 2>&1 | tee -a "$out/pdl.log" ;;
  flash-tune)
    python3 tools/tune_flash.py --cases 8:32768,8:131072,32:32768,1:32768 --tiles 64,128 \
      --budgets 256,2048 --kernels simt,tc --tc-tilings all --json "$out/tune_flash.json" \
      2>&1 | tee "$out/tune_flash.log" ;;
  decode-tests)
    $py tests/gpu/test_cuda_exact.py tests/gpu/test_cuda_plans.py tests/gpu/test_cuda_santa.py \
      2>&1 | tee "$out/decode_tests.log" | tail -15
    run_step decode-sanitize ;;
  read-floor)
    python3 tools/read_floor.py --json "$out/read_floor.json" 2>&1 | tee "$out/read_floor.log" ;;
  revisions)
    python3 tools/compare_revisions.py time --json "$out/revisions.json" 2>&1 \
      | tee "$out/revisions.log" ;;
  kmeans-patch:*)
    # labels: the old labels loaded with the row norms (label_prefetch patch);
    # both: that and the interleaved row reductions (interleaved patch on top).
    variant="${1#kmeans-patch:}"
    pdir=benchmarks/results/tmp  # extracted from git history, see the header
    patches=$pdir/kmeans_assign_label_prefetch_2026-12-05.patch
    [ "$variant" = both ] && patches="$patches $pdir/kmeans_assign_interleaved_2026-12-05.patch"
    for P in $patches; do [ -f "$P" ] || { echo "missing $P (see the header)" >&2; return 1; }; done
    for ctx in 32768 131072; do
      python3 tools/tune_kmeans.py --tokens "$ctx" --clusters $((ctx / 32)) --geometries 4x1 2>&1 \
        | tail -2 | sed "s/^/landed $ctx: /" | tee -a "$out/kmeans_patch_$variant.log"
    done
    applied=""
    for P in $patches; do
      if git apply "$P" 2>/dev/null || patch -p1 < "$P"; then
        applied="$P $applied"
      else
        for A in $applied; do git apply -R "$A" 2>/dev/null || patch -R -p1 < "$A"; done
        return 1
      fi
    done
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_kmeans.py 2>&1 | tee -a "$out/kmeans_patch_$variant.log" \
      | tail -2
    for ctx in 32768 131072; do
      python3 tools/tune_kmeans.py --tokens "$ctx" --clusters $((ctx / 32)) --geometries 4x1 2>&1 \
        | tail -2 | sed "s/^/$variant $ctx: /" | tee -a "$out/kmeans_patch_$variant.log"
    done
    for A in $applied; do git apply -R "$A" 2>/dev/null || patch -R -p1 < "$A"; done ;;
  paged-bench)
    python3 -c "import flashinfer" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
      --target /tmp/site .whl/*.whl
    PYTHONPATH="/tmp/site:$PYTHONPATH" python3 -u -m benchmarks.run --routine paged --quick \
      --no-doublep --calls 20 --out "$out/bench_paged_quick" 2>&1 | tail -14 ;;
  paged-capacity)
    $py tests/gpu/test_paged_doublep.py -k capacity 2>&1 | tail -5 ;;
  budgets-tests)
    $py tests/gpu/test_cuda_santa_budgets.py tests/gpu/test_cuda_santa.py \
      tests/gpu/test_paged_santa_prop.py tests/gpu/test_cuda_doublep_sample.py 2>&1 \
      | tee "$out/budgets_tests.log" | tail -6 ;;
  budgets-bench)
    python3 -u -m benchmarks.run --routine budgets --out "$out/bench_budgets" 2>&1 | tail -16 ;;
  budgets-sanitize)
    sanitizer_ok || return 3
    compute-sanitizer --tool memcheck --error-exitcode 9 $py tests/gpu/test_cuda_santa_budgets.py \
      2>&1 | tee "$out/budgets_sanitize.log" | tail -15 ;;
  student-patch)
    # tools/gpu/patches/budgets_review.patch (the review of 2026-12-07: positive weight
    # decided in float64 for vmax, a NaN the tensor-core tile maxima dropped caught by the
    # budget kernel; tests over several 4096-token chunks, contiguous and paged, S_B = 53,
    # a NaN key on both pass-1 kernels), then student_one_pass.patch (the studentised
    # bound's set-B projections in one pass, four gathers in flight per warp): the budgets
    # tests with the first alone, then with both, memcheck, then the bench.
    R=tools/gpu/patches/budgets_review.patch P=tools/gpu/patches/student_one_pass.patch
    git apply "$R" || return 1
    $py tests/gpu/test_cuda_santa_budgets.py 2>&1 | tail -2
    git apply "$P" || { git apply -R "$R"; return 1; }
    $py tests/gpu/test_cuda_santa_budgets.py 2>&1 | tail -2
    if sanitizer_ok; then
      compute-sanitizer --tool memcheck --error-exitcode 9 $py tests/gpu/test_cuda_santa_budgets.py \
        2>&1 | grep -E "passed|failed|ERROR SUMMARY"
    fi
    python3 -u -m benchmarks.run --routine budgets --out "$out/bench_budgets_student_patch" 2>&1 | tail -14
    git apply -R "$P"; git apply -R "$R" ;;
  on-demand-patch)
    # tools/gpu/patches/on_demand_kernels.patch: the six plain kernels of santa_prop and
    # doublep_decode as templates, so NVRTC compiles them only into the module that names
    # them (docs/gpu.md). nvcc sm_90: 82 of 86 instantiations byte-identical; bernoulli_qhat
    # (f16, bf16) and doublep_rows<4|8, true> differ in register allocation only. Their
    # GPU tests and those of every launch by name, memcheck of Bernoulli and Double-P
    # sampled, then first use cold (empty CuPy cache) with the patch and without.
    P=tools/gpu/patches/on_demand_kernels.patch
    git apply "$P" || return 1
    $py tests/gpu/test_cuda_bernoulli.py tests/gpu/test_cuda_doublep.py \
      tests/gpu/test_cuda_doublep_sample.py tests/gpu/test_cuda_santa.py \
      tests/gpu/test_cuda_santa_budgets.py tests/gpu/test_paged_doublep.py 2>&1 | tail -3
    if sanitizer_ok; then
      compute-sanitizer --tool memcheck --error-exitcode 9 $py tests/gpu/test_cuda_bernoulli.py \
        tests/gpu/test_cuda_doublep_sample.py 2>&1 | grep -E "passed|failed|ERROR SUMMARY"
    fi
    CUPY_CACHE_DIR=$(mktemp -d) timeout 150 python3 -m tools.first_use --no-index-processes \
      --out "$out/first_use_on_demand.json" 2>&1 | grep -E "first_s|total"
    git apply -R "$P"
    CUPY_CACHE_DIR=$(mktemp -d) timeout 150 python3 -m tools.first_use --no-index-processes \
      --out "$out/first_use_landed.json" 2>&1 | grep -E "first_s|total" ;;
  budgets-profile)
    CASES="8:131072 1:32768" bash tools/gpu/budgets_profile.sh 2>&1 | tail -44 ;;
  prefetch-patch)
    P=tools/gpu/patches/prefetch_first_use.patch
    [ -f "$P" ] || { echo "missing $P" >&2; return 1; }
    git apply "$P" || return 1
    $py tests/gpu/test_cuda_santa.py tests/gpu/test_cuda_exact.py tests/gpu/test_cuda_flash.py -x \
      2>&1 | tail -3
    CUPY_CACHE_DIR=$(mktemp -d) python3 -m tools.first_use --no-index-processes \
      --out "$out/first_use_prefetch.json" 2>&1 | tail -30
    git apply -R "$P" ;;
  *)
    echo "unknown step $1" >&2
    return 2 ;;
esac
}

for step in "$@"; do
  case "$step" in
    gpu-suite|flash-tests|decode-tests|decode-sanitize|flash-sanitize|flash-tune|read-floor) ;;
    flash-ncu|pdl) ;;
    revisions|kmeans-patch:labels|kmeans-patch:both) ;;
    paged-bench|paged-capacity|budgets-sanitize|prefetch-patch|budgets-bench|budgets-tests) ;;
    student-patch|budgets-profile|on-demand-patch) ;;
    *) echo "unknown step $step (see the header)" >&2; exit 2 ;;
  esac
done
for step in "$@"; do
  used=$((SECONDS - start))
  need=$(est "$step")
  if [ $((used + need)) -gt "$budget" ]; then
    echo "SKIPPED $step: ${used}s used, needs ~${need}s of ${budget}s" | tee -a "$out/steps.log"
    continue
  fi
  t0=$SECONDS
  run_step "$step"
  rc=$?
  echo "STEP $step rc=$rc $((SECONDS - t0))s (estimate ${need}s)" | tee -a "$out/steps.log"
done
