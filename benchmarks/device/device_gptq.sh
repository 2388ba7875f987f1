#!/usr/bin/env bash
# One device call for --method gptq and the kernels: the GPU tests (the CUDA GPTQ sweep against the reference,
# the GPU run against the CPU's, the quantize kernels bit for bit), the kernels' throughput, then the cost rows
# of benchmarks/iw_cost.py on 8 Llama-3-8B-shaped layers (data-free, --input-weights random, W4A4, GPTQ; a
# warm-up run first). Results under $OUT.
# IMPORTS=1 (default): first the start-up floor (benchmarks/probes/import_floor.py), $OUT/import_floor.json.
# PROFILE=1: then a cProfile of the GPTQ row, $OUT/gptq_profile.txt.
# SWEEP=1: meanwhile, on the host's CPU cores, GPTQ on the tiny checkpoint of every sweep architecture the
# runner runs that benchmarks/results/cpu2_20261128_gptq_sweep.jsonl has no run of (benchmarks/calibration_sweep.py
# --method gptq, 12 processes of one thread, CUDA hidden); its rows in $OUT/gptq_sweep.jsonl.
#   ROWS="none random w4a4 gptq" REPEATS=2 bash benchmarks/device/device_gptq.sh
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
# the imports' bytecode cached where it can be written (the host's site-packages are read-only: without this
# every process compiles transformers again, seconds an installed package never pays); env.txt records that
# bytecode is written
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1 FP4CONVERT_CACHE_DIR=/tmp/fp4convert-cache PYTHONPYCACHEPREFIX=/tmp/pycache
if ls .whl/*.whl >/dev/null 2>&1; then   # compressed-tensors and its needs (not installed on the GPU host);
    # .whl_llmc: llm-compressor 0.14.0.1 and what it needs beyond them (the iw_cost row llmc_gptq)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        $(ls .whl_llmc/*.whl 2>/dev/null)
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
{ date -u; nvidia-smi -L; python3 -c 'import sys, torch, transformers; print(torch.__version__, transformers.__version__,
  "dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix)'; } 2>&1 | tee "$OUT/env.txt"
if [ "${SWEEP:-0}" = 1 ]; then
    python3 - <<'PY' > /tmp/sweep_todo.txt
import json
d = json.load(open("benchmarks/results/cpu2_20261128_calibration_sweep.json"))
done = {json.loads(x)["model_type"]: json.loads(x)["outcome"]
        for x in open("benchmarks/results/cpu2_20261128_gptq_sweep.jsonl") if x.startswith("{")}
print("\n".join(r["model_type"] for r in d["rows"] if r["outcome"] == "ran" and done.get(r["model_type"]) != "ran"))
PY
    split -n r/12 /tmp/sweep_todo.txt /tmp/sweep_part_
    for f in /tmp/sweep_part_*; do
        CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout "${SWEEP_S:-500}" python3 benchmarks/calibration_sweep.py \
            --method gptq --timeout 240 --root "$f.root" "$f.json" $(cat "$f") > "$f.log" 2>&1 &
    done
fi
timeout "${TEST_S:-330}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_gptq_cuda.py \
    "tests/calibrate/test_gptq.py::test_gptq_on_the_gpu_is_deterministic_and_matches_the_cpu_at_the_model_level" \
    tests/kernels/test_cuda_kernels.py} 2>&1 | tail -n 40 | tee "$OUT/gpu_tests.txt"
rc=${PIPESTATUS[0]}
if [ "${SWEEP:-0}" = 1 ]; then
    wait
    grep -h '^{"model_type"' /tmp/sweep_part_*.log > "$OUT/gptq_sweep.jsonl"
    echo "sweep: $(wc -l < /tmp/sweep_todo.txt) types, $(wc -l < "$OUT/gptq_sweep.jsonl") rows"; grep -h -c '"outcome": "ran"' "$OUT/gptq_sweep.jsonl"
fi
if [ "${KERNELS:-1}" = 1 ]; then  # this tree's kernels, and (BEFORE=dir: a copy of an earlier tree) those before, in one run
    timeout "${KERNELS_S:-120}" python3 benchmarks/kernel_speed.py --sizes 16384 --no-peers --json "$OUT/kernels.json" 2>&1 \
        | tail -n 40
    if [ -n "${BEFORE:-}" ] && [ -d "$BEFORE" ]; then
        # an earlier tree may hold benchmarks/kernels.py (kernel_speed.py's name before issue 43)
        (cd "$BEFORE" && PYTHONPATH="$PWD:/tmp/site" timeout "${KERNELS_S:-120}" python3 \
            "$(ls benchmarks/kernel_speed.py benchmarks/kernels.py 2>/dev/null | head -n 1)" --sizes 16384 \
            --no-peers --json "$OUT/kernels_before.json") 2>&1 | tail -n 40
    fi
fi
if [ "${IMPORTS:-1}" = 1 ]; then  # the start-up floor of a calibrated run (fresh processes, bytecode warm)
    timeout 120 python3 benchmarks/probes/import_floor.py --repeats 3 --json "$OUT/import_floor.json" 2>&1 | tee "$OUT/import_floor.txt"
fi
if [ "${BENCH:-1}" = 1 ]; then
    timeout "${BENCH_S:-300}" python3 benchmarks/iw_cost.py --work /tmp/iw_cost --layers 8 --device auto --warmup \
        --rows ${ROWS:-none random w4a4 gptq gptq_file llmc_gptq} --repeats "${REPEATS:-2}" --json "$OUT/iw_cost.json" 2>&1 | tee "$OUT/iw_cost.txt"
    # what the process imports before and around a GPTQ run (bytecode warm), slowest first
    python3 -X importtime -m fp4convert quantize /tmp/iw_cost/src /tmp/iw_cost/imp --method gptq -q --overwrite \
        2> /tmp/importtime.txt >/dev/null
    sort -t'|' -k2 -n -r /tmp/importtime.txt | head -n 40 > "$OUT/importtime.txt"
fi
if [ "${PROFILE:-0}" = 1 ]; then  # where a GPTQ run's time goes (the GPU's time lands where the host waits for it)
    python3 -m cProfile -o /tmp/gptq.prof -m fp4convert quantize /tmp/iw_cost/src /tmp/iw_cost/prof \
        --method gptq -q --overwrite
    python3 -c "
import pstats; p = pstats.Stats('/tmp/gptq.prof'); p.sort_stats('cumulative').print_stats(70); p.sort_stats('tottime').print_stats(40)" \
        > "$OUT/gptq_profile.txt" 2>&1
fi
exit $rc
