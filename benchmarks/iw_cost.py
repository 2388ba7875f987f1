"""What ``--input-weights random`` costs end to end (issue 22 item 3: a default must not cost visibly).

One checkpoint (``benchmarks/e2e_vs_copy.py``'s dense 8B-shaped layers, random bf16 weights, a real
Llama config), converted at default settings with ``--input-weights none`` (today's default) and
``random``, rows interleaved, ``sync`` after each, median of ``--repeats``; each command a fresh
process, start-up included. Prints and writes (``--json``) every run and the medians.

    python benchmarks/iw_cost.py --layers 8 --device auto cpu --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_vs_copy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/iw_cost"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", nargs="+", default=["auto"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-repeats", type=int, default=None, help="repeats of the cpu rows (default: --repeats)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    src = args.work / "src"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        e2e_vs_copy.dense(src, args.layers)
    size = sum(p.stat().st_size for p in src.iterdir())
    e2e_vs_copy.warm(src)
    runs = []
    rows = [(d, iw) for d in args.device for iw in ("none", "random")]
    for rep in range(args.repeats):
        for dev, iw in rows:
            if dev == "cpu" and args.cpu_repeats is not None and rep >= args.cpu_repeats:
                continue
            out = args.work / "out"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"])
            cmd = [sys.executable, "-m", "fp4convert", "quantize", str(src), str(out), "--device", dev,
                   "--input-weights", iw, "-q"]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            subprocess.run(["sync"])
            wall = time.perf_counter() - t0
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{dev} {iw}: exit {r.returncode}")
            runs.append({"device": dev, "input_weights": iw, "rep": rep, "wall_s": round(wall, 3)})
            print(f"rep {rep} --device {dev:4} --input-weights {iw:6}: {wall:7.2f} s", flush=True)
    med = {f"{d} {iw}": statistics.median(r["wall_s"] for r in runs if (r["device"], r["input_weights"]) == (d, iw))
           for d, iw in rows}
    for k, v in med.items():
        base = med[k.split()[0] + " none"]
        print(f"median {k:12}: {v:7.2f} s  ({v / base:.2f}x of input weights none)")
    rec = {"benchmark": "iw_cost", "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "bytes": size,
           "cpus": os.cpu_count(), "runs": runs, "median_s": med,
           "command": "python -m fp4convert quantize SRC OUT --device D --input-weights IW -q (defaults otherwise)"}
    if args.json:
        args.json.write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
