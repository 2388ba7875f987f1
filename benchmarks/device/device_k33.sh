#!/usr/bin/env bash
# Issue 33 on the GPU host: the searching scale rules before (A, e.g. cdc6cfa) and after (B) in ONE call each
# step, so the figures compare within one run. Two trees side by side (each a plain copy of the package,
# e.g. `git archive cdc6cfa | tar -x -C A`; the kernel cache is keyed by source hash, so one cache holds both):
#   A=/path/to/before B=/path/to/after bash benchmarks/device/device_k33.sh kernels   # ~6 min
#   A=/path/to/before B=/path/to/after bash benchmarks/device/device_k33.sh e2e       # ~6 min
# kernels: builds both trees' CUDA and CPU kernels (in parallel); B's bit-exact tests on this GPU and CPU
#   (tests/kernels/test_cuda_kernels.py, the CPU kernel's rule tests, tests/kernels/test_cpu_simd.py); benchmarks/kernel_speed.py
#   --sizes 16384 --no-peers for A then B (bare kernels, every rule, and the public-API rows); Nsight Compute on
#   the NVFP4 4over6 and MXFP4 wmse kernels of each tree (one launch each, --clock-control none); the CPU
#   kernel's throughput per thread count (benchmarks/cpu_kernel.py --threads 1,16).
# e2e: benchmarks/ab_vs_copy.py (A and B beside `cp -r` + sync, interleaved, median of 3) at default settings,
#   dense (8 Llama-3-8B layers) and MoE (64 experts x 8 layers), --device cpu then --device cuda.
# Results under $OUT (flat: the device tool brings back at most 8 files). Both trees must have the package
# layout of 2026-11-28 or later (fp4convert.kernels.*); benchmarks/device/device_k33_final.sh is the later before/after.
set -uo pipefail
MODE="${1:-kernels}"
A="$(cd "${A:?A: the before tree}" && pwd)"; B="$(cd "${B:?B: the after tree}" && pwd)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4c-cache}"  # one cache: keyed by source hash
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
in_tree() {  # tree, command...: run with that tree's package and kernel cache
    local tree="$1"; shift
    (cd "$tree" && PYTHONPATH="$tree" "$@")
}
speed_script() {  # tree: its GPU kernel benchmark (benchmarks/kernels.py before issue 43 renamed it)
    if [ -f "$1/benchmarks/kernel_speed.py" ]; then echo benchmarks/kernel_speed.py; else echo benchmarks/kernels.py; fi
}
build() {
    in_tree "$1" python3 -c "
import time, torch; t = time.perf_counter()
from fp4convert.kernels import cpu_lib; cpu_lib.load(); c = time.perf_counter() - t
from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda'))
print('$(basename "$1"): CPU kernel %.1f s, CUDA kernels %.1f s' % (c, time.perf_counter() - t - c))"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  lscpu | grep -E "^Model name|^CPU\(s\)|^Thread|^Core|^Socket"; echo "avx512f cpus: $(grep -c -w avx512f /proc/cpuinfo)"
  nvcc --version | tail -1; python3 -c "import torch; print('torch', torch.__version__)"; which ncu || echo "no ncu"
  echo "A=$A ($(cat "$A/TREE" 2>/dev/null)) B=$B ($(cat "$B/TREE" 2>/dev/null))"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
build "$A" > "$OUT/build_A.txt" 2>&1 & pa=$!
build "$B" > "$OUT/build_B.txt" 2>&1 & pb=$!
wait $pa; wait $pb; cat "$OUT/build_A.txt" "$OUT/build_B.txt" | tail -4 | tee -a "$OUT/env.txt"
stamp "built"

if [ "$MODE" = kernels ]; then
    # bit-exactness on this GPU and this CPU (AVX-512 here), tree B
    in_tree "$B" timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_cuda_kernels.py tests/kernels/test_cpu_simd.py \
        tests/kernels/test_cpu_kernel.py -k "not build and not compiler and not cache and not import" 2>&1 | tail -6 > "$OUT/tests.txt"
    cat "$OUT/tests.txt"; stamp "tests"
    for T in "$A" "$B"; do
        echo "== $(basename "$T")"
        in_tree "$T" timeout 150 python3 "$(speed_script "$T")" --sizes 16384 --no-peers --json "$OUT/kernels_$(basename "$T").json" 2>&1 | tail -40
    done > "$OUT/kernels.txt"
    stamp "kernels"
    cat > /tmp/ncu_one.py <<'EOF'
import sys, torch
from fp4convert.kernels.cuda import ops
fmt, rule = sys.argv[1], sys.argv[2]
x = torch.randn(16384, 16384, device="cuda").to(torch.bfloat16)
import fp4convert
for _ in range(2):
    fp4convert.quantize(x, fmt, scale_rule=rule, global_amax=x.abs().amax().float() if fmt == "nvfp4" else None)
torch.cuda.synchronize()
EOF
    for T in "$A" "$B"; do
        for fr in "nvfp4 4over6" "mxfp4 wmse"; do
            echo "== $(basename "$T") $fr"
            in_tree "$T" timeout 60 ncu --clock-control none -k regex:quantize_kernel --launch-skip 1 --launch-count 1 \
                --section SpeedOfLight --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
                python3 /tmp/ncu_one.py $fr 2>&1 | grep -E "quantize_kernel|Duration|Throughput|Executed Ipc|Issue Slots|Registers|Achieved Occupancy|Pipe" | head -16
        done
    done > "$OUT/ncu.txt" 2>&1
    stamp "ncu"
    for T in "$A" "$B"; do
        echo "== $(basename "$T")"
        in_tree "$T" timeout 100 python3 benchmarks/cpu_kernel.py --threads 1,8,16 --repeats 3 2>&1 | tail -5
    done > "$OUT/cpu_kernel.txt"
    stamp "cpu kernel"
    tail -n 200 "$OUT/kernels.txt" | grep -E "^==|4over6|wmse|mse|max|floor|copy|quantize\(" | head -60
    cat "$OUT/ncu.txt" | head -40; cat "$OUT/cpu_kernel.txt"
else
    W=/tmp/e2e
    for case in dense moe; do
        for dev in cpu cuda; do
            stamp "$case $dev"
            timeout 300 python3 "$B/benchmarks/ab_vs_copy.py" --a "$A" --b "$B" --work "$W" --case $case --layers 8 \
                --experts 64 --device $dev --repeats "${REPEATS:-3}" 2>&1 | tail -16
        done
        rm -rf "$W"
    done > "$OUT/e2e.txt" 2>&1
    stamp "e2e"; cat "$OUT/e2e.txt"
fi
