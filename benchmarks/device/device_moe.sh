#!/usr/bin/env bash
# Issue 42 on one GPU, one device call: the GPU tests of the calibrated path (streamed experts, FP8 sources decoded on
# the GPU, the GPU GPTQ determinism), then benchmarks/moe_scale.py rows. Results under $OUT (moe_*.json, logs).
#   ROWS="qwen3-30b-a3b:4:256:gptq,w4a4 deepseek-v3:4:64:gptq" TESTS=1 PEER="qwen3-30b-a3b:2:32" bash benchmarks/device/device_moe.sh
# ROWS: shape:layers:samples:rows (rows comma-separated; seq-len 2048); PEER: shape:layers:samples for llm-compressor
# (the same rows run for fp4convert first, on the same tokens). ROW_S: each row's time limit (s).
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1 FP4CONVERT_CACHE_DIR=/tmp/fp4convert-cache PYTHONPYCACHEPREFIX=/tmp/pycache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -n 2
export PYTHONPATH="$PWD:/tmp/site"
if [ -n "${PEER:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_llmc .whl_llmc/*.whl \
        $(ls .whl/*.whl | grep -v compressed_tensors) 2>&1 | tail -n 2
    cat > /tmp/llmc_python <<'SH'
#!/usr/bin/env bash
PYTHONPATH=/tmp/site_llmc exec python3 "$@"
SH
    chmod +x /tmp/llmc_python
fi
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=memory.total,memory.used --format=csv; free -g | head -2; df -h /tmp | tail -1
  python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; } 2>&1 | tee "$OUT/env.txt"
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider -x \
        "tests/calibrate/test_experts.py::test_the_streamed_forward_is_the_module_s_own_bit_for_bit" \
        "tests/calibrate/test_sources.py::test_an_fp8_source_calibrates_on_the_gpu_as_its_twin" \
        "tests/calibrate/test_gptq.py::test_gptq_on_the_gpu_is_deterministic_and_matches_the_cpu_at_the_model_level" \
        2>&1 | tail -n 25 | tee "$OUT/gpu_tests.txt"
fi
for spec in ${ROWS:-}; do
    IFS=: read -r shape layers samples rows <<< "$spec"
    name="moe_${shape}_${layers}L_${samples}x2048"
    timeout "${ROW_S:-540}" python3 benchmarks/moe_scale.py --shape "$shape" --layers "$layers" \
        --samples "$samples" --seq-len 2048 --rows ${rows//,/ } --work /tmp/ms --json "$OUT/$name.json" 2>&1 \
        | tail -n 30 | tee "$OUT/$name.log"
done
if [ -n "${PEER:-}" ]; then
    IFS=: read -r shape layers samples <<< "$PEER"
    name="peer_${shape}_${layers}L_${samples}x2048"
    timeout "${PEER_S:-540}" python3 benchmarks/moe_scale.py --shape "$shape" --layers "$layers" \
        --samples "$samples" --seq-len 2048 --rows gptq llmc --peer-python /tmp/llmc_python --work /tmp/ms \
        --json "$OUT/$name.json" 2>&1 | tail -n 30 | tee "$OUT/$name.log"
fi
nvidia-smi --query-gpu=memory.used --format=csv | tail -1
