#!/usr/bin/env bash
# Compile-check every kernel for sm_90 (software E2M1), sm_100a and sm_120a (hardware E2M1) with the
# local nvcc, with the library's own flags; no GPU needed. Also checks, in the PTX, that the E2M1
# conversion instruction is used exactly where the target has it. ~30 s on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"
NVCC="${NVCC:-nvcc}"
SRC=fp4convert_kernels.cu
FLAGS=(-O3 -std=c++17 -fmad=false -Xptxas -warn-spills,-warn-lmem-usage)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$NVCC" --version | tail -n 2

check() {  # arch, expect_hw (1/0)
    local arch="$1" hw="$2"
    "$NVCC" "${FLAGS[@]}" -gencode "arch=compute_${arch},code=sm_${arch}" -cubin -o "$tmp/$arch.cubin" "$SRC" \
        2> "$tmp/$arch.log" || { cat "$tmp/$arch.log"; echo "FAIL: sm_$arch does not compile"; return 1; }
    if grep -Ei "warning|spill|lmem" "$tmp/$arch.log"; then echo "FAIL: sm_$arch warnings/spills"; return 1; fi
    "$NVCC" -std=c++17 -fmad=false -arch="compute_${arch}" -ptx -o "$tmp/$arch.ptx" "$SRC"
    local n
    n=$(grep -c "cvt.rn.satfinite.e2m1x2.f32" "$tmp/$arch.ptx" || true)
    if [ "$hw" = 1 ] && [ "$n" = 0 ]; then echo "FAIL: sm_$arch should use the hardware E2M1 conversion"; return 1; fi
    if [ "$hw" = 0 ] && [ "$n" != 0 ]; then echo "FAIL: sm_$arch must not use cvt e2m1x2"; return 1; fi
    if grep -q "rcp.approx\|div.approx\|div.full" "$tmp/$arch.ptx"; then echo "FAIL: sm_$arch approximate division"; return 1; fi
    echo "ok: sm_$arch ($(grep -c '^.visible .entry\|^.entry' "$tmp/$arch.ptx") kernels, e2m1 cvt x$n)"
}

pids=()
check 90 0 & pids+=($!)
check 100a 1 & pids+=($!)
wait "${pids[0]}"; wait "${pids[1]}"
check 120a 1
echo "compile check passed"
