#!/usr/bin/env bash
# One device call: build the kernels, run the GPU tests, benchmark. Logs go to $OUT (or ./out).
#   bash benchmarks/device/device_check.sh [all|tests|bench|quick]   (quick: tests minus the > 1 GiB ones)
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
# Resource report (registers, spills) and SASS of the sm_90 quantize kernels, with the static SASS
# instruction count per quantize kernel (per thread = per 32 elements; see benchmarks/NOTES.md).
nvcc -O3 -std=c++17 -fmad=false -gencode arch=compute_90,code=sm_90 -cubin -Xptxas -v -o /tmp/q.cubin \
    csrc/fp4c_quantize.cu > "$OUT/ptxas.txt" 2>&1
if cuobjdump -sass /tmp/q.cubin > /tmp/sass.txt 2>&1; then
    gzip -c /tmp/sass.txt > "$OUT/sass_sm90_quantize.txt.gz"
    python3 - /tmp/sass.txt <<'EOF' 2>&1 | tee "$OUT/sass_counts.txt"
import re, sys
cur, counts = None, {}
for line in open(sys.argv[1]):
    m = re.search(r"Function : (\S+)", line)
    if m:
        cur = m.group(1)
        counts[cur] = 0
    elif cur and re.search(r"/\*[0-9a-f]{4}\*/\s+\S", line):
        counts[cur] += 1
print("static SASS instructions per quantize kernel (dtype 0 f32 / 1 f16 / 2 bf16, fmt 0 nvfp4 / 1 mxfp4, rule 0/1/2):")
for name, c in sorted(counts.items()):
    m = re.search(r"(quantize_kernel|quantize_swizzled_kernel)ILi(\d)ELi(\d)ELb(\d)ELi(\d)E", name)
    if m:
        print(f"{m.group(1):26s} dtype {m.group(2)} fmt {m.group(3)} had16 {m.group(4)} rule {m.group(5)}: {c:5d} ({c / 32:.1f}/element)")
EOF
fi
t0=$(date +%s)
python3 -c 'import torch; from fp4convert.kernels.cuda import ops; print("build+first call:", ops.amax(torch.ones(1,16,16,device="cuda"), None))' 2>&1 | tee "$OUT/build.txt"
echo "build seconds: $(( $(date +%s) - t0 ))" | tee -a "$OUT/build.txt"
t0=$(date +%s%N)
python3 -c 'import torch; from fp4convert.kernels.cuda import ops; ops.amax(torch.ones(1,16,16,device="cuda"), None)' 2>&1
echo "second process, cached library, import + CUDA init + first call: $(( ($(date +%s%N) - t0) / 1000000 )) ms" | tee -a "$OUT/build.txt"
rc=0
if [ "$MODE" = all ] || [ "$MODE" = tests ] || [ "$MODE" = quick ]; then
    sel=()
    [ "$MODE" = quick ] && sel=(-k "not large")
    python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_cuda_kernels.py tests/kernels/test_cuda_build.py "${sel[@]}" \
        --durations=8 2>&1 | tee "$OUT/tests.txt"
    rc=${PIPESTATUS[0]}
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ] || [ "$MODE" = quick ]; then
    python3 benchmarks/kernel_speed.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
fi
exit $rc
