#!/usr/bin/env bash
# One device call for --method gptq: its GPU tests (the CUDA sweep against the reference, the GPU run
# against the CPU's), the calibration runner's GPU tests, then the cost rows of benchmarks/iw_cost.py on 8
# Llama-3-8B-shaped layers (data-free, --input-weights random, W4A4, GPTQ). Results under $OUT.
#   ROWS="none random w4a4 gptq" REPEATS=2 bash benchmarks/device_gptq.sh
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FP4CONVERT_CACHE_DIR=/tmp/fp4convert-cache
if ls .whl/*.whl >/dev/null 2>&1; then   # compressed-tensors and its needs (not installed on the GPU host)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
{ date -u; nvidia-smi -L; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; } 2>&1 | tee "$OUT/env.txt"
timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_gptq_cuda.py \
    "tests/calibrate/test_gptq.py::test_gptq_on_the_gpu_is_deterministic_and_matches_the_cpu_at_the_model_level"} \
    2>&1 | tee "$OUT/gpu_tests.txt"
rc=${PIPESTATUS[0]}
if [ "${BENCH:-1}" = 1 ]; then
    timeout "${BENCH_S:-300}" python3 benchmarks/iw_cost.py --work /tmp/iw_cost --layers 8 --device auto \
        --rows ${ROWS:-none random w4a4 gptq} --repeats "${REPEATS:-2}" --json "$OUT/iw_cost.json" 2>&1 | tee "$OUT/iw_cost.txt"
fi
exit $rc
