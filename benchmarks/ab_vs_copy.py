"""Two source trees of fp4convert (A/B, e.g. main and a branch) beside `cp -r` + `sync`, rows interleaved.

Creates (once) the dense or MoE checkpoint of :mod:`e2e_vs_copy` at the given size, warms the page cache,
then per round runs ``cp -r SRC DST && sync`` and ``python -m fp4convert quantize SRC DST --json`` from
each tree (``PYTHONPATH=TREE``), each followed by ``sync``; prints the median of ``--repeats`` rounds,
every run's ``stages_s``, and whether the trees wrote the same bytes (the manifest, ``fp4convert.json``,
compared without its ``files`` checksums and ``manifest_version``: the checksum kind may differ).

    python benchmarks/ab_vs_copy.py --a /tmp/main-tree --b . --case dense --layers 1 --device cpu
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_vs_copy as e2e  # noqa: E402


def digest(path: Path) -> str:
    """The output's bytes; the manifest without its checksums (their kind is what an A/B may change)."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == "fp4convert.json":
            m = json.loads(data)
            m.pop("manifest_version", None)
            m["files"] = {f: r["size"] for f, r in m["files"].items()}
            data = json.dumps(m, sort_keys=True).encode()
        h.update(p.relative_to(path).as_posix().encode())
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="source tree A (its fp4convert package is run)")
    ap.add_argument("--b", type=Path, required=True, help="source tree B")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ab"))
    ap.add_argument("--case", choices=["dense", "moe"], default="dense")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--extra", default="", help="more quantize arguments for both trees")
    args = ap.parse_args()
    src = args.work / f"{args.case}-{args.layers}"
    if not (src / "config.json").exists():
        (e2e.dense(src, args.layers) if args.case == "dense" else e2e.moe(src, args.layers, args.experts))
    size = e2e.warm(src)
    dst = args.work / "dst"
    rows = [("cp -r + sync", f"cp -r {src} {dst}", None)]
    for label, tree in (("A", args.a), ("B", args.b)):
        rows.append((f"{label}: {tree}", f"{sys.executable} -m fp4convert quantize {src} {dst} --json --device "
                                        f"{args.device} {args.extra}", tree.resolve()))
    walls: dict[str, list[float]] = {r[0]: [] for r in rows}
    stages: dict[str, list[dict]] = {r[0]: [] for r in rows}
    digests: dict[str, set[str]] = {r[0]: set() for r in rows}
    for _ in range(args.repeats):
        for label, cmd, tree in rows:
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"])
            env = dict(os.environ, PYTHONPATH=str(tree or ""))
            w, out, split = e2e.timed(cmd, env)
            walls[label].append(w)
            s = e2e.summary(out)
            stages[label].append({"wall_s": s.get("wall_s"), "stages_s": s.get("stages_s"), **split})
            if tree is not None:
                digests[label].add(digest(dst))
            print(f"  {label}: {w:.2f} s", flush=True)
    shutil.rmtree(dst, ignore_errors=True)
    cp = statistics.median(walls[rows[0][0]])
    print(f"{args.case} ({args.layers} layers), {size / 1e9:.2f} GB in, {os.cpu_count()} CPUs, --device {args.device} "
          f"{args.extra}; median of {args.repeats}, interleaved")
    for label, _, _ in rows:
        m = statistics.median(walls[label])
        print(f"{label}: median {m:.2f} s ({m / cp:.2f}x cp), runs {[round(x, 2) for x in walls[label]]}")
        for s in stages[label]:
            if s.get("stages_s"):
                print(f"    convert {s['wall_s']} s, process {s['process_s']} s, sync {s['sync_s']} s; stages {s['stages_s']}")
    a, b = digests[rows[1][0]], digests[rows[2][0]]
    print(f"same bytes: A runs alike {len(a) == 1}, B runs alike {len(b) == 1}, A == B {a == b}")


if __name__ == "__main__":
    main()
