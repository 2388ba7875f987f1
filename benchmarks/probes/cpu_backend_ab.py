"""--device cpu beside the GPU on benchmarks/e2e_vs_copy.py's dense and MoE checkpoints, interleaved, with an A/B
of the CPU backends (issue 21 item 6).

Rows, each command followed by ``sync``, repeat r of every row before repeat r + 1 of any (so a change
in the machine's load hits all rows alike), median of ``--repeats``:

- ``cp -r`` + sync;
- fp4convert on one GPU (when there is one);
- ``--device cpu`` as it runs by default: the torch-free ``cpu-native`` backend
  (fp4convert/quantizer/backends/cpu_native.py: each shape group of a batch one threaded kernel call on the
  reader's buffer, 2 lanes, no torch import);
- ``--device cpu --backend cpu``: the torch backend (a pool of Python threads, each calling the CPU
  path, and so the kernel, on row slices with one kernel thread);
- optionally (``--torch-row``) ``--device cpu --backend cpu`` on the torch path (``FP4CONVERT_CPU_KERNEL=0``).

Every fp4convert row's output is byte-compared with the first fp4convert row's. The checkpoints are
e2e_vs_copy.py's (made here when ``--work`` lacks them).

    python benchmarks/probes/cpu_backend_ab.py --work /tmp/e2e --out $OUT --repeats 3 --defaults
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

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
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
    py = sys.executable
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
        q = f"{py} -m fp4convert quantize {src} {dst} --json{shard}"
        rows = [("cp -r + sync", f"cp -r {src} {dst}")]
        if gpus:
            rows.append(("fp4convert, 1 GPU", f"{q} --device cuda"))
        cores = os.cpu_count()
        rows.append((f"fp4convert --device cpu ({cores} cores), default (cpu-native)", f"{q} --device cpu"))
        rows.append((f"fp4convert --device cpu ({cores} cores), --backend cpu (torch)", f"{q} --device cpu --backend cpu"))
        if args.torch_row:
            rows.append((f"fp4convert --device cpu ({cores} cores), torch path",
                         f"FP4CONVERT_CPU_KERNEL=0 {q} --device cpu --backend cpu"))
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
