#!/usr/bin/env bash
# One device call: build the kernels, run the GPU tests, benchmark. Logs go to $OUT (or ./out).
#   bash benchmarks/device_check.sh [all|tests|bench|quick]   (quick: tests minus the > 1 GiB ones)
set -uo pipefail
MODE="${1:-all}"
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4convert-cache}"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv;
  nvcc --version | tail -n 1; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
    2>&1 | tee "$OUT/env.txt"
# Resource report and SASS of the sm_90 build (registers, spills, instruction mix).
nvcc -O3 -std=c++17 -fmad=false -gencode arch=compute_90,code=sm_90 -cubin -Xptxas -v -o /tmp/k.cubin \
    csrc/fp4convert_kernels.cu > "$OUT/ptxas.txt" 2>&1
cuobjdump -sass /tmp/k.cubin > /tmp/sass.txt 2>&1 && gzip -c /tmp/sass.txt > "$OUT/sass_sm90.txt.gz"
t0=$(date +%s)
python3 -c 'import torch; from fp4convert.cuda import ops; print("build+first call:", ops.amax(torch.ones(1,16,16,device="cuda"), None))' 2>&1 | tee "$OUT/build.txt"
echo "build seconds: $(( $(date +%s) - t0 ))" | tee -a "$OUT/build.txt"
rc=0
if [ "$MODE" = all ] || [ "$MODE" = tests ] || [ "$MODE" = quick ]; then
    sel=()
    [ "$MODE" = quick ] && sel=(-k "not large")
    python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_kernels.py "${sel[@]}" --durations=8 2>&1 | tee "$OUT/tests.txt"
    rc=${PIPESTATUS[0]}
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ] || [ "$MODE" = quick ]; then
    python3 benchmarks/kernels.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
fi
exit $rc
