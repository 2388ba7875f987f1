"""End-to-end converter benchmark: fp4convert beside llm-compressor's model_free_ptq, one run, one table.

Generates a Llama-shaped bf16 checkpoint (default ~317M params in 4 shards, the size NOTES.md quotes
for the peer), warms the page cache, then runs each converter in a fresh subprocess ``--repeats``
times: median wall time, and the child's peak RSS read with ``os.wait4``. It also reports which
fraction of the peer's packed bytes and scales ours equal (both write compressed-tensors NVFP4).

    python benchmarks/converter.py --device cpu --peer-python /tmp/peer/bin/python
    python benchmarks/converter.py --device cuda --layers 32 --hidden 4096 --inter 14336 --vocab 128256
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

PEER_SNIPPET = """
import sys
from llmcompressor import model_free_ptq
model_free_ptq(model_stub=sys.argv[1], save_directory=sys.argv[2], scheme="NVFP4A16",
               ignore=["lm_head", "model.embed_tokens"], max_workers=int(sys.argv[3]), device=sys.argv[4])
"""


def make_checkpoint(path: Path, layers: int, hidden: int, inter: int, vocab: int, shards: int) -> int:
    import torch
    from make_tiny_llama import CONFIG, llama_tensors, write_checkpoint

    cfg = dict(CONFIG, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter, vocab_size=vocab,
               num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64)
    marker = path / "bench.json"
    if marker.exists() and json.loads(marker.read_text()) == cfg:
        return json.loads((path / "params.json").read_text())["params"]
    shutil.rmtree(path, ignore_errors=True)
    tensors = llama_tensors(cfg)
    params = sum(t.numel() for t in tensors.values())
    write_checkpoint(path, tensors, cfg, shards=_layer_shards(tensors, shards))
    del tensors
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    (path / "params.json").write_text(json.dumps({"params": params}))
    marker.write_text(json.dumps(cfg))
    return params


def _layer_shards(tensors: dict, shards: int) -> list[list[str]]:
    """Tensor names per shard, cut between decoder layers (the peer refuses a fused group split across shards)."""
    import re

    def layer(name: str) -> int:
        m = re.search(r"layers\.(\d+)\.", name)
        return int(m.group(1)) if m else -1

    layers = sorted({layer(n) for n in tensors})
    per = -(-len(layers) // shards)
    cuts = [[n for n in tensors if layer(n) in set(layers[s * per : (s + 1) * per])] for s in range(shards)]
    return [c for c in cuts if c]


def warm(path: Path) -> None:
    for p in path.glob("*.safetensors"):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def run(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process.

    The peak is the child's own VmHWM, polled until it exits (VmHWM only grows, so the last reading
    is the peak). wait4's ru_maxrss would also count the parent's RSS inherited at fork.
    """
    log = tempfile.TemporaryFile()  # not a pipe: a chatty child must never block on it
    t0 = time.perf_counter()
    # cwd: `python -m` puts it first on sys.path, so it must be the tree under test (or a neutral folder)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, cwd=cwd or tempfile.gettempdir())
    peak = 0
    status_file = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status_file.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    log.seek(0)
    err = log.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed:\n{err[-2000:]}")
    return wall, peak


def same_fraction(ours: Path, theirs: Path) -> dict:
    """Fraction of identical bytes in weight_packed and weight_scale, and of identical global scales."""
    import torch
    from safetensors.torch import load_file

    a, b = {}, {}
    for p in ours.glob("*.safetensors"):
        a.update(load_file(p))
    for p in theirs.glob("*.safetensors"):
        b.update(load_file(p))
    out = {}
    for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
        names = [n for n in a if n.endswith(suffix) and n in b]
        eq = tot = 0
        for n in names:
            x, y = a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)
            if x.shape != y.shape:
                continue
            eq += int((x == y).sum())
            tot += x.numel()
        out[suffix] = eq / tot if tot else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fp4convert-bench"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--device", action="append", help="fp4convert --device values (repeatable); default cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer-python", help="a python with llmcompressor installed (omit to skip the peer)")
    ap.add_argument("--peer-device", default="cpu")
    ap.add_argument("--peer-workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--formats", default="native,compressed-tensors",
                    help="comma-separated fp4convert output formats to time (compressed-tensors is the peer's)")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="also time fp4convert from another source tree (e.g. a baseline checkout); repeatable")
    args = ap.parse_args()
    devices = args.device or ["cpu"]
    formats = args.formats.split(",")
    trees = [("", ROOT)] + [(t.split("=", 1)[0], Path(t.split("=", 1)[1])) for t in args.tree]

    src = args.workdir / "src"
    params = make_checkpoint(src, args.layers, args.hidden, args.inter, args.vocab, args.shards)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    warm(src)
    rows = []

    # Interleaved: repeat r of every converter runs before repeat r+1 of any, so a change in the
    # machine's load (a shared 2-core box) hits all of them alike.
    jobs = []

    def bench(label: str, cmd_for, out: Path, env: dict | None = None, cwd: Path | None = None) -> None:
        jobs.append((label, cmd_for, out, (env, cwd), [], []))

    for tag, tree in trees:
        env = dict(os.environ, PYTHONPATH=str(tree))
        name = f"fp4convert{f' [{tag}]' if tag else ''}"
        for dev in devices:
            for fmt in formats:
                bench(f"{name} --device {dev} --format {fmt}",
                      lambda o, d=dev, f=fmt: [sys.executable, "-m", "fp4convert", "quantize", str(src), str(o),
                                               "--device", d, "-q", "--format", f],
                      args.workdir / f"ours{tag}-{fmt}-{dev}", env, tree)
    agreement = None
    peer = args.workdir / "peer"
    if args.peer_python:
        bench(f"llm-compressor model_free_ptq ({args.peer_device}, {args.peer_workers} workers)",
              lambda o: [args.peer_python, "-c", PEER_SNIPPET, str(src), str(o), str(args.peer_workers), args.peer_device],
              peer)
    for _ in range(args.repeats):
        for label, cmd_for, out, env, walls, rss in jobs:
            shutil.rmtree(out, ignore_errors=True)
            w, r = run(cmd_for(out), *env)
            walls.append(w)
            rss.append(r)
            print(f"{label}: {w:.2f} s, {r / 1e6:.0f} MB", file=sys.stderr, flush=True)
    for label, _, _, _, walls, rss in jobs:
        med = statistics.median(walls)
        rows.append({"tool": label, "wall_s": med, "min_s": min(walls), "mparams_per_s": params / med / 1e6,
                     "peak_rss_mb": max(rss) / 1e6, "runs": len(walls), "runs_s": [round(w, 2) for w in walls]})
    if args.peer_python and "compressed-tensors" in formats:
        agreement = same_fraction(args.workdir / f"ours-compressed-tensors-{devices[0]}", peer)

    print(f"\ncheckpoint: {params / 1e6:.1f}M params, {size / 1e9:.2f} GB bf16 in {args.shards} shards; "
          f"median of {args.repeats} runs, warm page cache\n")
    peer_row = rows[-1] if args.peer_python else None
    print("| converter | wall s (median) | runs s | M params/s | peak RSS MB | x peer throughput | / peer memory |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        vs = (f"{peer_row['wall_s'] / r['wall_s']:.2f}x | {r['peak_rss_mb'] / peer_row['peak_rss_mb']:.2f}"
              if peer_row else "- | -")
        print(f"| {r['tool']} | {r['wall_s']:.2f} | {', '.join(map(str, r['runs_s']))} | {r['mparams_per_s']:.1f} | "
              f"{r['peak_rss_mb']:.0f} | {vs} |")
    if agreement:
        print("\nidentical bytes, ours vs peer (compressed-tensors NVFP4): "
              + ", ".join(f"{k} {v:.6f}" for k, v in agreement.items() if v is not None))
    if args.json:
        args.json.write_text(json.dumps({"params": params, "bytes": size, "rows": rows, "agreement": agreement}, indent=2))


if __name__ == "__main__":
    main()
