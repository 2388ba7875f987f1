#!/usr/bin/env bash
# One device call (issue 21 item 6, "the CPU at the disk's speed"), on the 16-core GPU host:
#   1. build the CPU kernel (cold, timed) and, meanwhile, the CUDA kernels;
#   2. the bit-exact CPU tests on this CPU (the kernel's AVX-512 clone where the CPU has it, and every
#      x86-64 level it runs built alone): tests/kernels/test_cpu_kernel.py, tests/kernels/test_cpu.py,
#      tests/quantizer/test_backend_cpu_native.py;
#   3. kernel throughput per thread count beside memcpy (benchmarks/cpu_kernel.py);
#   4. --device cpu beside `cp -r` + sync and the GPU on e2e_vs_copy.py's dense (8 Llama-3-8B layers, 5.6 GB)
#      and MoE (64 experts x 8 layers, 3 GB) checkpoints, interleaved, median of 3, with two CPU rows
#      (benchmarks/probes/cpu_backend_ab.py): the default (the torch-free cpu-native backend) and --backend cpu
#      (torch); at default settings (the issue's yardstick). AB_ARGS adds
#      options: --torch-row (one torch-path run per case, ~1 min), --layers N, --only dense|moe.
# Results in $OUT: env.txt, build*.txt, tests.txt, cpu_kernel.{txt,json}, cpu_backend_ab.{md,json,txt}.
# Budget: ~7-8 min on an H100 host with 16 cores (checkpoint generation ~1-2 min of it); under the 10-min
# limit of one call (the tests stop at 300 s, the throughput step at 150 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4CONVERT_CACHE_DIR="${FP4CONVERT_CACHE_DIR:-/tmp/fp4c-cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
WORK="${E2E_WORK:-/tmp/e2e}"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  lscpu | grep -E "^Model name|^CPU\(s\)|^Thread|^Socket|^NUMA node\(s\)" || true
  echo "avx512f: $(grep -c -w avx512f /proc/cpuinfo || true) cpus, avx2: $(grep -c -w avx2 /proc/cpuinfo || true) cpus"
  g++ --version | head -1 || true
  python3 -c "import torch, os; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'cpus', os.cpu_count())"
  df -h "$(dirname "$WORK")" | tail -1; git log -1 --oneline 2>/dev/null || true; } | tee "$OUT/env.txt"
t0=$(date +%s)

# 1. builds
python3 -c "
import time; t = time.perf_counter()
from fp4convert import cpu_kernel
lib = cpu_kernel.load()
print(f'CPU kernel built and loaded in {time.perf_counter() - t:.1f} s:', cpu_kernel.spec().path())" 2>&1 | tee "$OUT/build.txt"
( python3 -c "import torch; from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda')); print('CUDA kernels ready')" \
    > "$OUT/build_cuda.txt" 2>&1 || echo "CUDA build failed" >> "$OUT/build_cuda.txt" ) &
cuda_build=$!

# 2. bit-exact tests (their status is recorded; the benchmarks run either way)
set +e
timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/kernels/test_cpu_kernel.py tests/kernels/test_cpu.py \
    tests/quantizer/test_backend_cpu_native.py \
    > "$OUT/tests_full.txt" 2>&1
echo "pytest exit status: $?" >> "$OUT/tests_full.txt"
set -e
tail -20 "$OUT/tests_full.txt" | tee "$OUT/tests.txt"
wait "$cuda_build" || true
cat "$OUT/build_cuda.txt"
echo "after tests: $(( $(date +%s) - t0 )) s"

# 3. kernel throughput (GB/s of bf16 input) per thread count, beside memcpy
timeout 150 python3 benchmarks/cpu_kernel.py --threads 1,2,4,8,16 --repeats 3 --json "$OUT/cpu_kernel.json" 2>&1 \
    | tee "$OUT/cpu_kernel.txt" || echo "cpu_kernel.py did not finish" | tee -a "$OUT/cpu_kernel.txt"
echo "after throughput: $(( $(date +%s) - t0 )) s"

# 4. --device cpu vs the GPU (and cp -r), interleaved, with the CPU backend A/B
python3 benchmarks/probes/cpu_backend_ab.py --work "$WORK" --out "$OUT" --repeats "${E2E_REPEATS:-3}" --defaults ${AB_ARGS:-} 2>&1 \
    | tee "$OUT/cpu_backend_ab.txt"
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/cpu_backend_ab.txt"
rm -rf "$WORK"
