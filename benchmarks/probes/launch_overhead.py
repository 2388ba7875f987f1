"""What a process costs before it converts anything: Python, torch, torchrun (issue 10's 2-GPU row).

Times, median of ``--repeats``, each a fresh process: bare Python; ``import torch`` (and again with a
writable bytecode cache, to tell compiling torch's modules from running them); ``fp4convert
--version``; ``torchrun`` starting N copies of that (the launcher's own cost, as the workers import
no torch); and N workers that import torch and join a gloo group (what a torch rank costs). Prints JSON.

    python benchmarks/probes/launch_overhead.py [--nproc 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANK_SCRIPT = """
import time, os
t0 = time.perf_counter()
import torch, torch.distributed as dist
t1 = time.perf_counter()
dist.init_process_group("gloo")
dist.barrier()
t2 = time.perf_counter()
dist.destroy_process_group()
print(f"rank {os.environ['RANK']}: import torch {t1 - t0:.2f} s, gloo group {t2 - t1:.2f} s", flush=True)
"""


def timed(cmd: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    py = sys.executable
    torchrun = shutil.which("torchrun") or ""
    out: dict = {"python": sys.version.split()[0], "dont_write_bytecode": sys.flags.dont_write_bytecode,
                 "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        pkg = Path(spec.origin).parent
        cache = pkg / "__pycache__"
        out["torch_dir"] = str(pkg)
        out["torch_pycache_files"] = len(list(cache.glob("*.pyc"))) if cache.is_dir() else 0
        out["torch_dir_writable"] = os.access(pkg, os.W_OK)
    pyc = tempfile.mkdtemp(prefix="pyc-")

    def med(cmd: list[str], env: dict | None = None) -> dict:
        runs = [timed(cmd, env) for _ in range(a.repeats)]
        return {"median_s": round(statistics.median(runs), 3), "runs_s": [round(r, 3) for r in runs]}

    out["python_pass"] = med([py, "-c", "pass"])
    out["import_torch"] = med([py, "-c", "import torch"])
    # Fill the cache once (PYTHONDONTWRITEBYTECODE, if set, would stop that: "" unsets it).
    timed([py, "-c", "import torch, torch.distributed.run, fp4convert.cli"],
          {"PYTHONPYCACHEPREFIX": pyc, "PYTHONDONTWRITEBYTECODE": ""})
    out["import_torch_own_pycache"] = med([py, "-c", "import torch"], {"PYTHONPYCACHEPREFIX": pyc})
    out["fp4convert_version"] = med([py, "-m", "fp4convert", "--version"])
    if torchrun:
        tr = [torchrun, "--nproc-per-node", str(a.nproc)]
        out[f"torchrun_{a.nproc}_fp4convert_version"] = med(tr + ["-m", "fp4convert", "--version"])
        out[f"torchrun_{a.nproc}_fp4convert_version_own_pycache"] = med(
            tr + ["-m", "fp4convert", "--version"], {"PYTHONPYCACHEPREFIX": pyc})
        script = Path(pyc) / "rank.py"
        script.write_text(RANK_SCRIPT)
        out[f"torchrun_{a.nproc}_torch_gloo_ranks"] = med(tr + [str(script)])
        r = subprocess.run(tr + [str(script)], capture_output=True, text=True)
        out["rank_lines"] = re.findall(r"rank \d+: [^\n]*? gloo group [\d.]+ s", r.stdout)
    shutil.rmtree(pyc, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
