#!/usr/bin/env bash
# Issue 33's closing call on the GPU host: this tree's kernels against the reference on this GPU (bit for bit),
# then before (BEFORE: a `git archive` of the landed tree, carried) and after in one run: the bare kernels
# (benchmarks/device/k33_bench.cu, interleaved rounds, at the data's own global amax and at 6.0) and the public API
# (benchmarks/kernel_speed.py --api-only). Results under $OUT: tests.txt, summary.txt, bench.jsonl, api.txt.
#   BEFORE=out/k33/headtree bash benchmarks/device/device_k33_final.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"; BEFORE="$(cd "${BEFORE:?the landed tree}" && pwd)"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
build_lib() { (cd "$1" && FP4CONVERT_CACHE_DIR="$2" PYTHONPATH="$1" python3 -c \
    "import torch; from fp4convert.kernels.cuda import ops; ops.ensure_loaded(torch.device('cuda')); print('built $1')"); }
build_lib "$ROOT" /tmp/cache_after > "$OUT/build_after.txt" 2>&1 &
build_lib "$BEFORE" /tmp/cache_before > "$OUT/build_before.txt" 2>&1 &
wait; cat "$OUT"/build_*.txt | tail -4; stamp "libraries built"
(cd "$ROOT" && FP4CONVERT_CACHE_DIR=/tmp/cache_after PYTHONPATH="$ROOT" timeout "${TEST_S:-300}" python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_cuda_kernels.py tests/kernels/test_gptq_cuda.py --durations 5 2>&1 | tail -15) > "$OUT/tests.txt"
cat "$OUT/tests.txt"; stamp "tests"
OUT="$OUT" VARIANTS="before@${BEFORE#$ROOT/}:;after:" AMAX="0 6.0" ROUNDS="${ROUNDS:-3}" NCU="" \
    bash "$ROOT/benchmarks/device/device_k33_variants.sh" 2>&1 | grep -v "^  ILi\|^$\|^== " | tail -20
stamp "bare kernels"
for side in before after; do
    tree="$ROOT"; [ "$side" = before ] && tree="$BEFORE"
    echo "== $side"
    (cd "$tree" && FP4CONVERT_CACHE_DIR="/tmp/cache_$side" PYTHONPATH="$tree" timeout 120 python3 \
        "$(ls "$tree/benchmarks/kernel_speed.py" "$tree/benchmarks/kernels.py" 2>/dev/null | head -n 1)" \
        --sizes 16384 --no-peers --api-only --json "$OUT/api_$side.json" 2>&1 | tail -12)
done > "$OUT/api.txt"
cat "$OUT/api.txt"; stamp "api"
