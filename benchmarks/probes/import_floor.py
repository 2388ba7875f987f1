"""The start-up floor of a calibrated run: what a fresh process pays before any tensor is read.

Each line is a fresh ``python -c`` process (bytecode cached by a warm-up run first), median of
``--repeats`` wall times: the interpreter alone, ``import torch``, torch with CUDA initialised, torch and
transformers with a model class resolved (what the calibration runner imports before it builds the model
on ``meta``), and fp4convert's own CLI module. A calibrated conversion cannot finish before its imports,
so these bound the ratio of a calibrated run to the data-free one (which imports neither torch nor
transformers) from below.

    python benchmarks/probes/import_floor.py --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

LINES = {
    "python": "pass",
    "torch": "import torch",
    "torch+cuda": "import torch; torch.cuda.is_available() and torch.zeros(1, device='cuda').sum().item()",
    "torch+transformers": "import torch, transformers; from transformers import LlamaForCausalLM",
    "fp4convert cli": "import fp4convert.cli.main",
}


def wall(code: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = {}
    for name, code in LINES.items():
        wall(code)  # (bytecode written, pages warm)
        runs = [round(wall(code), 3) for _ in range(args.repeats)]
        out[name] = {"median_s": statistics.median(runs), "runs_s": runs, "code": code}
        print(f"{name:20s} {out[name]['median_s']:.3f} s  {runs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "import_floor", "python": sys.version.split()[0], "lines": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
