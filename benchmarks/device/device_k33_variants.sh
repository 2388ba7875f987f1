#!/usr/bin/env bash
# Issue 33 on the GPU host: variants of the quantize kernels side by side in one call, without Python.
# Each variant is benchmarks/device/k33_bench.cu built against a csrc/ tree with its own -D flags (built in
# parallel), then every variant is timed in ROUNDS interleaved rounds (the median of each row over the rounds
# is the figure), then Nsight Compute profiles the rows named in NCU.
#   VARIANTS="base:;ctas4:-DFP4C_SM90_SEARCH_CTAS=4;landed@out/k33/head:" NCU="base:0:1 ctas4:0:1" AMAX="0 6.0" \
#       bash benchmarks/device/device_k33_variants.sh
# AMAX: each variant also runs with these NVFP4 global amax values (0: the data's own), each another global
# scale and so another (r, d) table; NCU_AMAX: the one the profiles use.
# A variant is NAME:FLAGS, or NAME@TREE:FLAGS for another tree's csrc (a git-ignored copy carried along).
# Results under $OUT: env.txt, builds.txt, bench.jsonl (one line per variant and round), summary.txt, ncu.txt.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ROUNDS="${ROUNDS:-3}"; REPS="${REPS:-30}"; ROWS="${ROWS:-0:0,0:1,0:2,0:3,1:0,1:2,1:3,0:1:1}"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
  nvcc --version | tail -1; which ncu || echo "no ncu"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
IFS=';' read -r -a VS <<< "${VARIANTS:-base:}"
names=()
for v in "${VS[@]}"; do
    v="$(echo "$v" | sed 's/^ *//')"; [ -z "$v" ] && continue
    head="${v%%:*}"; flags="${v#*:}"; name="${head%@*}"; tree="$ROOT"
    [ "$head" != "$name" ] && tree="$ROOT/${head#*@}"
    names+=("$name")
    ( nvcc -O3 -std=c++17 -fmad=false -lineinfo -arch=sm_90 -I"$tree/csrc" $flags -Xptxas -v \
        -o "/tmp/k33_$name" "$ROOT/benchmarks/device/k33_bench.cu" > "/tmp/k33_build_$name.log" 2>&1 \
        && echo "$name built ($flags, $tree)" || echo "$name FAILED" ) &
done > "$OUT/builds.txt"
wait
for n in "${names[@]}"; do  # registers of the bf16 linear kernels (unrotated) per variant
    echo "== $n"; grep -A2 "quantize_kernelILi2ELi[01]ELb0ELi[0123]ELb0E" "/tmp/k33_build_$n.log" \
        | grep -o "quantize_kernelILi2ELi[01]ELb0ELi[0123]\|Used [0-9]* registers.*\|[0-9]* bytes spill stores" | paste -sd' ' | sed 's/quantize_kernel/\n  /g'
done >> "$OUT/builds.txt"
cat "$OUT/builds.txt"; stamp "built"
: > "$OUT/bench.jsonl"
for r in $(seq 1 "$ROUNDS"); do
    for n in "${names[@]}"; do
        [ -x "/tmp/k33_$n" ] || continue
        for am in ${AMAX:-0}; do  # 0: the data's own amax; else a given NVFP4 global amax (another gs)
            echo "{\"variant\": \"$n\", \"amax\": \"$am\", \"round\": $r, \"result\": $(timeout 120 "/tmp/k33_$n" "$REPS" "$ROWS" "$am" | tr -d '\n')}" >> "$OUT/bench.jsonl"
        done
    done
done
stamp "bench"
python3 - "$OUT/bench.jsonl" > "$OUT/summary.txt" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by, hashes, copies = {}, {}, []
for r in runs:
    copies.append(r["result"]["copy_GBs"])
    for row in r["result"]["rows"]:
        key = f'{row["row"]} @{r["result"]["amax"]:.5g}'
        by.setdefault(key, {}).setdefault(r["variant"], []).append(row["pct_copy"])
        hashes.setdefault(key, {}).setdefault(r["variant"], set()).add(row["hash"])
names = list(dict.fromkeys(r["variant"] for r in runs))
print("copy GB/s per run:", " ".join(f"{c:.0f}" for c in copies))
print("row (fmt:rule[:rot] @amax)".ljust(22), *[n.rjust(12) for n in names], " bytes")
for row, v in by.items():
    hs = set().union(*hashes[row].values())
    print(row.ljust(22), *[f"{statistics.median(v[n]):12.1f}" if n in v else " " * 12 for n in names],
          " same" if len(hs) == 1 else f" DIFFER {hashes[row]}")
PY
cat "$OUT/summary.txt"
STALLS=$(for r in long_scoreboard short_scoreboard wait math_pipe_throttle not_selected barrier dispatch_stall \
    no_instruction mio_throttle lg_throttle branch_resolving selected; do
    printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' "$r"; done; echo smsp__inst_executed_pipe_alu.sum)
: > "$OUT/ncu.txt"
for spec in ${NCU:-}; do  # name:fmt:rule
    n="${spec%%:*}"; row="${spec#*:}"
    echo "===== $n $row" >> "$OUT/ncu.txt"
    timeout 120 ncu --clock-control none -k regex:quantize_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --metrics "$STALLS" "/tmp/k33_$n" 1 "$row" "${NCU_AMAX:-0}" 2>&1 | grep -v '^{\|^  {\|^\]}\|^==PROF==' >> "$OUT/ncu.txt"
done
stamp "ncu"
