"""--device cpu beside the GPU on benchmarks/e2e_vs_copy.py's dense and MoE checkpoints, interleaved, with an A/B
of the CPU backend (issue 21 item 6).

Rows, each command followed by ``sync``, repeat r of every row before repeat r + 1 of any (so a change
in the machine's load hits all rows alike), median of ``--repeats``:

- ``cp -r`` + sync;
- fp4convert on one GPU (when there is one);
- ``--device cpu`` as the pipeline runs it (``pipeline.CpuBackend``: a pool of Python threads, each
  calling the CPU path on row slices with one kernel thread);
- ``--device cpu`` with the proposed torch-pipeline backend (:class:`ThreadedKernelBackend` below: one
  kernel call per matrix, threaded inside the kernel, pass 2 behind the compute loop on one helper thread);
- ``--device cpu`` on the torch-free path (:mod:`fp4convert.cpu_direct`, wired as proposed for convert.py:
  no torch import, each shape group one threaded kernel call on the reader's buffer, 2 lanes);
- optionally (``--torch-row``) ``--device cpu`` on the torch path (``FP4CONVERT_CPU_KERNEL=0``).

Every fp4convert row's output is byte-compared with the first fp4convert row's. The checkpoints are
e2e_vs_copy.py's (made here when ``--work`` lacks them). The backend swap happens in this process
(``python benchmarks/cpu_backend_ab.py --run ARGS...`` replaces ``pipeline.CpuBackend`` when
``FP4CONVERT_CPU_BACKEND=threaded``, or routes the CPU to cpu_direct when it is ``direct``, then runs the
CLI), so the library is unchanged.

    python benchmarks/cpu_backend_ab.py --work /tmp/e2e --out $OUT --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ThreadedKernelBackend:
    """The proposed CpuBackend once the compiled kernel threads itself: per unit, one amax call per
    member (pass 1, here: the unit's global scale needs it) and one quantize call per member with the
    scales written swizzled by the kernel (pass 2, on a helper thread so the compute loop goes on to
    the next unit), every call on ``workers`` kernel threads. Same result tuple as pipeline.CpuBackend."""

    def __init__(self, workers: int = 1) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.workers = max(1, workers)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fp4convert-quantize")

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def run(self, batch, hosts, s, free):
        import torch

        from fp4convert import cpu
        from fp4convert import reference as ref
        from fp4convert.pipeline import unit_amax

        n = len(batch.members)
        amax = torch.zeros(n, dtype=torch.float32)
        ga = gs = None
        if s.scheme.global_scale:
            for i, x in enumerate(hosts):
                amax[i] = cpu.amax(x.unsqueeze(0), s.rotate, self.workers)[0]
            ga = unit_amax(amax, batch)
            gs = ref.global_scale(ga)

        def work() -> tuple:
            try:
                packed, scales, flags = [], [], []
                for i, x in enumerate(hosts):
                    p, sc, f = cpu.quantize(x.unsqueeze(0), s.scheme.name, None if gs is None else gs[i : i + 1],
                                            s.rotate, s.swizzle, threads=self.workers, **s.extra)
                    packed.append(p[0])
                    scales.append(sc[0])
                    flags.append(bool(f))
            finally:
                free(None)
            return packed, scales, flags, amax, ga, gs, None

        return self.pool.submit(work).result


def run_cli(argv: list[str]) -> None:
    """The fp4convert CLI, with the CPU backend swapped when FP4CONVERT_CPU_BACKEND=threaded."""
    sys.path.insert(0, str(ROOT))
    variant = os.environ.get("FP4CONVERT_CPU_BACKEND", "pool")
    if variant == "direct":  # the torch-free path (fp4convert.cpu_direct), wired as proposed for convert.py
        from fp4convert import convert as c
        from fp4convert import cpu_direct, direct

        real = c._direct_runtime
        c._direct_runtime = lambda config, world, plan: (  # type: ignore[assignment]
            cpu_direct.runtime(config, world, plan) if config.device == "cpu" else real(config, world, plan))
        real_backend = direct.DirectBackend
        direct.DirectBackend = lambda rt: (  # type: ignore[misc, assignment]
            rt.backend() if isinstance(rt, cpu_direct.CpuRuntime) else real_backend(rt))
    else:
        from fp4convert import pipeline  # torch imported here in both torch variants, outside convert()'s timer

        if variant == "threaded":
            pipeline.CpuBackend = ThreadedKernelBackend  # type: ignore[misc, assignment]
    from fp4convert.cli import main

    main(argv, prog_name="fp4convert")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        run_cli(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-row", action="store_true", help="also --device cpu on the torch path (slow)")
    ap.add_argument("--only", choices=["dense", "moe"], default=None)
    ap.add_argument("--defaults", action="store_true",
                    help="fp4convert at default settings (e2e_vs_copy.py passes --max-shard-size 512MB / 256MB)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e_vs_copy as e2e  # its checkpoints, page-cache warming, digest and `cmd && sync` timing

    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        gpus = 0
    py, me = sys.executable, Path(__file__).resolve()
    results: dict = {"gpus": gpus, "cpus": os.cpu_count(), "cases": {}}
    makers = {"dense": lambda p: e2e.dense(p, args.layers), "moe": lambda p: e2e.moe(p, args.moe_layers, args.experts)}
    for case, make in makers.items():
        if args.only and case != args.only:
            continue
        src = args.work / case
        if not (src / "config.json").exists():
            make(src)
        size = e2e.warm(src)
        dst = args.work / "dst"
        shard = "" if args.defaults else f" --max-shard-size {dict(dense='512MB', moe='256MB')[case]}"
        q = f"{py} {me} --run quantize {src} {dst} --json{shard}"
        rows = [("cp -r + sync", f"cp -r {src} {dst}")]
        if gpus:
            rows.append(("fp4convert, 1 GPU", f"{q} --device cuda"))
        cores = os.cpu_count()
        rows.append((f"fp4convert --device cpu ({cores} cores), pipeline.CpuBackend", f"{q} --device cpu"))
        rows.append((f"fp4convert --device cpu ({cores} cores), threaded kernel backend",
                     f"FP4CONVERT_CPU_BACKEND=threaded {q} --device cpu"))
        rows.append((f"fp4convert --device cpu ({cores} cores), torch-free (cpu_direct)",
                     f"FP4CONVERT_CPU_BACKEND=direct {q} --device cpu"))
        if args.torch_row:
            rows.append((f"fp4convert --device cpu ({cores} cores), torch path", f"FP4CONVERT_CPU_KERNEL=0 {q} --device cpu"))
        # untimed: the first plan of a new checkpoint builds its model definition (cached on disk after), which
        # would otherwise land in whichever row runs first
        subprocess.run(["bash", "-c", f"{q} --device cpu --dry-run > /dev/null"], env=env, check=True)
        walls: dict[str, list[float]] = {label: [] for label, _ in rows}
        inside: dict[str, list[dict]] = {label: [] for label, _ in rows}
        same: dict[str, bool | None] = {label: None for label, _ in rows}
        first_digest = None
        for r in range(args.repeats):
            for label, cmd in rows:
                if label.endswith("torch path") and r > 0:
                    continue  # one run: ~5x the others
                shutil.rmtree(dst, ignore_errors=True)
                subprocess.run(["sync"])
                w, out, split = e2e.timed(cmd, env)
                walls[label].append(w)
                inside[label].append({**e2e.summary(out), "outside": split})
                if label.startswith("fp4convert") and r == 0:
                    d = e2e.digest(dst)
                    first_digest = first_digest or d
                    same[label] = d == first_digest
                print(f"{case}: {label}: {w:.2f} s", flush=True)
        shutil.rmtree(dst, ignore_errors=True)
        cp = statistics.median(walls[rows[0][0]])
        gpu = statistics.median(walls[rows[1][0]]) if gpus else None
        out_rows = []
        for label, cmd in rows:
            med = statistics.median(walls[label])
            out_rows.append({"what": label, "cmd": cmd, "median_s": med, "runs_s": walls[label], "vs_cp": med / cp,
                             "vs_gpu": med / gpu if gpu else None, "same_bytes_as_first_fp4convert_row": same[label],
                             "inside": inside[label]})
        results["cases"][case] = {"bytes_in": size, "rows": out_rows}
    (args.out / "cpu_backend_ab.json").write_text(json.dumps(results, indent=2))
    lines = [f"GPUs: {gpus}, CPU cores: {os.cpu_count()}; median of {args.repeats} (torch row: 1 run); interleaved; "
             f"warm page cache; each command followed by `sync`; "
             f"{'default settings' if args.defaults else 'e2e_vs_copy.py shard sizes'}", ""]
    for case, c in results["cases"].items():
        lines += [f"### {case}: {c['bytes_in'] / 1e9:.2f} GB in", "",
                  "| what | median s | runs s | x cp | x GPU | bytes = first fp4convert row |", "|---|---|---|---|---|---|"]
        for r in c["rows"]:
            vg = f"{r['vs_gpu']:.2f}" if r["vs_gpu"] else "-"
            lines.append(f"| {r['what']} | {r['median_s']:.2f} | {', '.join(f'{x:.2f}' for x in r['runs_s'])} | "
                         f"{r['vs_cp']:.2f} | {vg} | {r['same_bytes_as_first_fp4convert_row']} |")
        lines.append("")
    (args.out / "cpu_backend_ab.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
