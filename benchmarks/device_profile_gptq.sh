set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FP4CONVERT_CACHE_DIR=/tmp/fp4convert-cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site"
timeout 150 python3 -m pytest -q -p no:cacheprovider "tests/calibrate/test_gptq.py::test_gptq_on_the_gpu_is_deterministic_and_matches_the_cpu_at_the_model_level" 2>&1 | tail -3 | tee "$OUT/gpu_test.txt"
python3 -c "
import sys; sys.path.insert(0,'benchmarks'); import e2e_vs_copy, iw_cost
from pathlib import Path
src=Path('/tmp/iw/src'); e2e_vs_copy.dense(src, 8); iw_cost.char_tokenizer(src)
import pydoc_data.topics as t
Path('/tmp/iw/text.txt').write_text(''.join(t.topics[k] for k in sorted(t.topics)))
"
python3 -m fp4convert quantize /tmp/iw/src /tmp/iw/o0 --json > /dev/null 2>&1   # warm: kernel build, page cache
for row in "none:" "gptqfile:--method gptq --calibration-data /tmp/iw/text.txt" "gptq:--method gptq" ; do
  name="${row%%:*}"; opts="${row#*:}"; rm -rf /tmp/iw/o; sync
  t0=$(date +%s.%N)
  if [ "$name" = gptqfile ]; then
    timeout 200 python3 -m cProfile -o "$OUT/prof_$name.out" -m fp4convert quantize /tmp/iw/src /tmp/iw/o $opts --json > "$OUT/$name.json" 2> "$OUT/$name.err"
  else
    timeout 200 python3 -m fp4convert quantize /tmp/iw/src /tmp/iw/o $opts --json > "$OUT/$name.json" 2> "$OUT/$name.err"
  fi
  sync; t1=$(date +%s.%N); echo "$name $(echo "$t1 - $t0" | bc) s" | tee -a "$OUT/times.txt"
done
python3 -c "
import pstats; p=pstats.Stats('$OUT/prof_gptqfile.out'); p.sort_stats('cumulative').print_stats(45)" > "$OUT/prof_cum.txt" 2>&1
python3 -c "
import pstats; p=pstats.Stats('$OUT/prof_gptqfile.out'); p.sort_stats('tottime').print_stats(30)" > "$OUT/prof_tot.txt" 2>&1
tail -5 "$OUT"/*.err
