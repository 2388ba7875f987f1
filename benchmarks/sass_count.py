"""Static SASS instructions per element of the quantize kernels' hot path, per scale rule (no GPU needed).

Why: on Hopper (sm_90, software E2M1) the searching scale rules are instruction-issue bound (Nsight
Compute: 84-86% of issue slots busy), so their time follows the instructions each element costs. This
counts them from the compiled code, so a change can be judged before it reaches a GPU.

How: a probe kernel per (dtype, format, rotation, rule) runs a thread's groups exactly as quantize_kernel
does (csrc/fp4c_quantize.cu is included, so the probe calls the kernel's own ``quantize_group``): full
32-element groups of one matrix, no input weight (the input-weighted kernels are separate). It is compiled
with the library's flags (fp4convert/kernels/cuda/build.py) for sm_90 and disassembled; the count is the
shortest path through its control-flow graph from the entry to EXIT (callees counted to their RET), which
is the common path: the rare branches (the clamp at 6, a large block's general path, the IEEE division's
slow path, a non-finite block) are the longer ones. Per element = path / (32 x groups per thread). The
per-matrix (r, d) table fill (threads < 128 of each CTA) is off that path and amortized over a CTA's
elements (8192 x groups per thread). --csrc may name an older tree (before the per-group body took its
input-weight flag: one group per thread, the weight as a runtime pointer), for before/after tables. The
registers column is the linear kernel's own (unweighted variant), from cuobjdump -res-usage.

    python benchmarks/sass_count.py [--rules nvfp4:4over6 mxfp4:wmse ...] [--dtypes bf16] [--rotate]
                                    [--csrc DIR] [--arch 90] [--keep DIR] [--json out.json] [--explain] [-D MACRO=1]

Needs nvcc and cuobjdump (CUDA toolkit; cuobjdump also comes as the nvidia-cuda-cuobjdump wheel:
``--cuobjdump PATH`` or $CUOBJDUMP).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"f32": 0, "f16": 1, "bf16": 2}
FMTS = {"nvfp4": 0, "mxfp4": 1}
RULES = {"nvfp4": ("max", "4over6", "mse", "wmse"), "mxfp4": ("floor", "rceil", "mse", "wmse")}
FLAGS = ["-O3", "-std=c++17", "-fmad=false"]

PROBE = r"""
#include "fp4c_quantize.cu"
namespace {
// quantize_kernel for one thread's full groups of matrix 0: the kernel's own quantize_group with
// full = true, groups_per_thread times (unrolled here; the kernel keeps a loop of a few instructions).
template <int DT, int FMT, bool ROT, int RULE>
__global__ void FP4C_QUANT_BOUNDS(FMT, RULE, false) sass_probe(const QuantArgs a) {
  constexpr int GPT = groups_per_thread<FMT, RULE>();
  const int64_t g0 = (int64_t)blockIdx.x * THREADS * GPT + threadIdx.x;
  constexpr bool TABLE = FMT == FMT_NVFP4 && RULE != RULE_PLAIN;
  __shared__ float2 rd[TABLE ? 128 : 1];
  const float gs = matrix_gs<FMT>(a.amax, a.gs_out, a.flag, 0, g0 == 0);
  (void)fill_candidates<FMT, RULE, DT, ROT>(rd, gs);
  // the unmasked chain where the kernel can take it (a matrix whose every table byte is safe: the common case)
  constexpr bool UM = TABLE && unmasked_flags<DT, ROT>();
#pragma unroll
  for (int k = 0; k < GPT; ++k) quantize_group<DT, FMT, ROT, RULE, false, UM>(a, 0, g0 + k * THREADS, true, gs, rd);
}

}  // namespace
"""


# The probe for a csrc/ from before the input-weighted kernels and groups_per_thread (commit f182f55,
# the measurement's "before"): one group per thread, the input weight as the kernel's runtime pointer.
PROBE_V1 = r"""
#include "fp4c_quantize.cu"
namespace {
template <int DT, int FMT, bool ROT, int RULE>
__global__ void FP4C_QUANT_BOUNDS(RULE) sass_probe(const QuantArgs a) {
  const int64_t g = (int64_t)blockIdx.x * THREADS + threadIdx.x;
  constexpr bool TABLE = FMT == FMT_NVFP4 && RULE != RULE_PLAIN;
  __shared__ float2 rd[TABLE ? 128 : 1];
  const float gs = matrix_gs<FMT>(a.amax, a.gs_out, a.flag, 0, g == 0);
  fill_candidates<FMT, RULE>(rd, gs);
  quantize_group<DT, FMT, ROT, RULE>(a, 0, g, true, gs, rd);
}
}  // namespace
"""


@dataclass
class Block:
    start: int
    n: int
    succ: list[int]
    end: int
    call: int | None  # callee entry index, if the block ends in a CALL
    exits: bool


def parse_sass(text: str) -> dict[str, list[str]]:
    """Function name -> its instructions (text without the address), from cuobjdump -sass."""
    funcs: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            assert int(m.group(1), 16) == 16 * len(cur), "non-contiguous SASS"
            cur.append(m.group(2).strip())
    return funcs


def _op(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]


def blocks_of(ins: list[str]) -> dict[int, Block]:
    """Basic blocks keyed by first instruction index (addresses are 16 bytes per instruction)."""
    leaders = {0}
    for i, t in enumerate(ins):
        op = _op(t)
        if op.startswith(("BRA", "EXIT", "CALL", "RET", "BRX", "JMP")):
            leaders.add(i + 1)
            m = re.search(r"\b0x([0-9a-f]+)\b", t.split(op, 1)[1])
            if op.startswith(("BRA", "CALL")) and m:
                leaders.add(int(m.group(1), 16) // 16)
    starts = sorted(x for x in leaders if x < len(ins))
    out: dict[int, Block] = {}
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(ins)
        last = ins[e - 1]
        op = _op(last)
        pred = last.startswith("@")
        succ: list[int] = []
        call = None
        m = re.search(r"\b0x([0-9a-f]+)\b", last.split(op, 1)[1]) if op.startswith(("BRA", "CALL")) else None
        tgt = int(m.group(1), 16) // 16 if m else None
        if op.startswith("BRA"):
            succ.append(tgt)  # type: ignore[arg-type]
            if pred or re.search(r"BRA\s+!?U?P\d", last):  # predicated, or a BRA with a predicate operand
                succ.append(e)
        elif op.startswith("CALL"):
            call = tgt
            succ.append(e)
        elif op.startswith(("EXIT", "RET")):
            if pred:
                succ.append(e)
        else:
            succ.append(e)
        n = sum(1 for t in ins[s:e] if _op(t) != "NOP")
        out[s] = Block(s, n, [x for x in succ if x < len(ins)], e, call, op.startswith("EXIT") and not pred)
    return out


def shortest(blocks: dict[int, Block], ins: list[str], src: int, want_ret: bool,
             _memo: dict[int, int] | None = None, path: list[int] | None = None) -> int:
    """Fewest instructions from block src to an EXIT (or to a RET for a callee), callees included;
    path (if given) receives the blocks on it."""
    memo = {} if _memo is None else _memo
    dist = {src: 0}
    prev: dict[int, int] = {}
    heap = [(0, src)]
    while heap:
        d, b = heapq.heappop(heap)
        if d > dist.get(b, 1 << 60):
            continue
        blk = blocks[b]
        cost = blk.n
        if blk.call is not None:
            if blk.call not in memo:
                memo[blk.call] = shortest(blocks, ins, blk.call, True, memo)
            cost += memo[blk.call]
        last = _op(ins[blk.end - 1])
        done = (want_ret and last.startswith("RET")) or (not want_ret and blk.exits)
        if done:
            if path is not None:
                path[:] = [b]
                while path[0] in prev:
                    path.insert(0, prev[path[0]])
            return d + cost
        for s in blk.succ:
            nd = d + cost
            if nd < dist.get(s, 1 << 60):
                dist[s] = nd
                prev[s] = b
                heapq.heappush(heap, (nd, s))
    raise RuntimeError("no path to EXIT/RET")


def tool(name: str, given: str | None) -> str:
    for cand in (given, os.environ.get(name.upper()), shutil.which(name)):
        if cand:
            return cand
    sys.exit(f"{name} not found: pass --{name} PATH or set ${name.upper()} (pip install nvidia-cuda-{name})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rules", nargs="*", default=[f"{f}:{r}" for f in RULES for r in RULES[f]])
    ap.add_argument("--dtypes", nargs="*", default=["bf16"], choices=list(DTYPES))
    ap.add_argument("--rotate", action="store_true", help="also the Had16 variants")
    ap.add_argument("--csrc", default=str(ROOT / "csrc"))
    ap.add_argument("--arch", default="90")
    ap.add_argument("--nvcc", default=None)
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--keep", default=None, help="keep the probe, cubin and SASS in this directory")
    ap.add_argument("--json", default=None)
    ap.add_argument("--explain", action="store_true", help="print each path's blocks (address:instructions)")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro for nvcc, e.g. -D NAME=1")
    args = ap.parse_args()
    nvcc, cuobjdump = tool("nvcc", args.nvcc), tool("cuobjdump", args.cuobjdump)
    work = Path(args.keep or tempfile.mkdtemp(prefix="sass_count_"))
    work.mkdir(parents=True, exist_ok=True)
    combos = []
    for spec in args.rules:
        fmt, rule = spec.split(":")
        for dt in args.dtypes:
            for rot in ((False, True) if args.rotate else (False,)):
                combos.append((dt, fmt, rot, rule))
    inst = "\n".join(
        f"template __global__ void sass_probe<{DTYPES[d]}, {FMTS[f]}, {'true' if r else 'false'}, "
        f"{RULES[f].index(u)}>(const QuantArgs);" for d, f, r, u in combos)
    qsrc = (Path(args.csrc) / "fp4c_quantize.cu").read_text()
    legacy = "groups_per_thread" not in qsrc
    src = (PROBE_V1 if legacy else PROBE).replace("}  // namespace\n", inst + "\n}  // namespace\n")
    (work / "probe.cu").write_text(src)
    cubin = work / "probe.cubin"
    cmd = [nvcc, *FLAGS, *(f"-D{d}" for d in args.defines), "-Xptxas", "-warn-spills", f"-I{args.csrc}",
           "-gencode", f"arch=compute_{args.arch},code=sm_{args.arch}", "-cubin", "-o", str(cubin), str(work / "probe.cu")]
    subprocess.run(cmd, check=True)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    (work / "probe.sass").write_text(sass)
    res = subprocess.run([cuobjdump, "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
    regs = {m.group(1): int(m.group(2)) for m in re.finditer(r"Function (\S+):\s*\n\s*REG:(\d+)", res)}
    funcs = parse_sass(sass)
    # groups per thread (csrc/fp4c_quantize.cu's groups_per_thread): the probe's elements per thread
    # (a tree before the striding kernels says it with FP4C_SEARCH_GPT; since them the probe takes 2)
    m = re.search(r"#define FP4C_SEARCH_GPT (\d+)", qsrc)
    gpt = (1, int(m.group(1)) if m else (2 if "RULE_WMSE ? 2 : 1;" in qsrc else 1))
    for d in args.defines:
        if d.startswith("FP4C_SEARCH_GPT="):
            gpt = (1, int(d.split("=")[1]))
    rows = []
    for d, f, r, u in combos:
        tag = f"ILi{DTYPES[d]}ELi{FMTS[f]}ELb{int(r)}ELi{RULES[f].index(u)}E"
        name = next(k for k in funcs if "sass_probe" in k and tag in k)
        ins = funcs[name]
        blocks = blocks_of(ins)
        on: list[int] = []
        path = shortest(blocks, ins, 0, False, path=on)
        if args.explain:
            print(f"{d} {f} {'had16 ' if r else ''}{u}: " + " ".join(
                f"{16 * b:x}:{blocks[b].n}" for b in on))
        search = u in ("mse", "wmse", "4over6")
        elems = 32 * (gpt[1] if search else gpt[0])
        # registers: the kernel's own (quantize_kernel, the unweighted variant), not the probe's
        kname = next((k for k in regs if "quantize_kernel" in k and (tag + ("EE" if legacy else "Lb0EE")) in k), None)
        rows.append({"dtype": d, "format": f, "rotate": r, "rule": u, "path": path, "per_element": path / elems,
                     "static": sum(1 for t in ins if _op(t) != "NOP"), "regs": regs.get(kname or name)})
    print(f"sm_{args.arch}, {nvcc}: hot-path SASS instructions of one thread (groups per thread {gpt[0]} plain, "
          f"{gpt[1]} search; probe in {work})")
    print("| dtype | format | had16 | rule | path | per element | probe static | kernel registers |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['dtype']} | {x['format']} | {'yes' if x['rotate'] else 'no'} | {x['rule']} | {x['path']} | "
              f"{x['per_element']:.2f} | {x['static']} | {x['regs']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
