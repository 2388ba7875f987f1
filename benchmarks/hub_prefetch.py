"""A Hub conversion against the plain download of the same files (issue 21, item 7).

The stand-in Hub of ``tests/hubserver.py`` (Hub + "CDN" on loopback, real huggingface_hub code paths)
serves a bf16 Llama-like checkpoint of several shards through one shared link of ``--rate`` MB/s
(every byte the CDN sends is paced through it, whatever the number of connections). Timed, each in a
fresh subprocess with an empty HF cache, rows interleaved, median of ``--reps``:

* ``download``: ``huggingface_hub.snapshot_download`` of the repo (every file, its default 8 workers);
* ``fp4convert`` at each checkout given (``--checkout NAME=PATH``, e.g. main and this branch) and each
  ``--device`` (default ``cpu``; ``auto`` is what a user on a GPU machine gets):
  ``python -m fp4convert quantize REPO OUT --device DEVICE -q`` (defaults otherwise), wall time of the
  whole process, start-up included.

Writes one JSON record (settings, every run, medians, ratios to the download) to ``--json``.

    python benchmarks/hub_prefetch.py --checkout main=/work/main --checkout branch=. \\
        --rate 40 --shards 8 --layers 16 --json benchmarks/results/cpu2_hub_prefetch.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.hubserver import FakeHub, hub_env  # noqa: E402

REPO = "bench-org/llama-shards"
COMMIT = hashlib.sha1(b"fp4convert hub prefetch benchmark").hexdigest()


def make_model(path: Path, hidden: int, layers: int, shards: int) -> int:
    """A Llama-like bf16 checkpoint (random weights, shapes a real config loads), written shard by shard."""
    import torch
    from safetensors.torch import save_file

    inter, heads, kv = 2 * hidden, 16, 4
    hd = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    per = -(-layers // shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        t: dict[str, torch.Tensor] = {}
        if s == 0:
            t["model.embed_tokens.weight"] = w(cfg["vocab_size"], hidden)
        for i in range(s * per, min((s + 1) * per, layers)):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
            t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
            t[p + "self_attn.q_proj.weight"] = w(heads * hd, hidden)
            t[p + "self_attn.k_proj.weight"] = w(kv * hd, hidden)
            t[p + "self_attn.v_proj.weight"] = w(kv * hd, hidden)
            t[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
            t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
            t[p + "mlp.up_proj.weight"] = w(inter, hidden)
            t[p + "mlp.down_proj.weight"] = w(hidden, inter)
        if s == shards - 1:
            t["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
            t["lm_head.weight"] = w(cfg["vocab_size"], hidden)
        save_file(t, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg))
    return sum(p.stat().st_size for p in path.iterdir())


def timed(cmd: list[str], env: dict, cwd: Path) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=3600)
    return time.perf_counter() - t0, r.returncode, (r.stderr or "")[-2000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH",
                    help="an fp4convert checkout to time (repeatable; default: this one as 'branch')")
    ap.add_argument("--rate", type=float, default=40.0, help="link speed, MB/s (10^6 bytes)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", nargs="+", default=["cpu"], help="fp4convert's --device, one row each (cpu, auto, cuda)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    checkouts = dict(c.split("=", 1) for c in args.checkout) or {"branch": str(ROOT)}
    work = Path(args.work or tempfile.mkdtemp(prefix="hub_prefetch_"))
    model = work / "model"
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        make_model(model, args.hidden, args.layers, args.shards)
    total = sum(p.stat().st_size for p in model.iterdir())
    print(f"model: {total / 1e9:.2f} GB in {args.shards} shards; link {args.rate:g} MB/s "
          f"(the bytes alone: {total / args.rate / 1e6:.1f} s)", flush=True)
    commits = {}
    for name, path in checkouts.items():
        commits[name] = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()
    runs: list[dict] = []
    with FakeHub(lifetime=24 * 3600, rate=args.rate * 1e6) as hub:
        hub.add(REPO, model, COMMIT)
        rows = {f"{n}:{d}" if len(args.device) > 1 else n: (n, d) for n in checkouts for d in args.device}
        cases = ["download", *rows]
        for rep in range(args.reps):
            order = cases[rep % len(cases):] + cases[:rep % len(cases)]  # rotate who goes first
            for case in order:
                home, out = work / "hf_home", work / "out"
                shutil.rmtree(home, ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)
                env = hub_env(hub.endpoint, home)
                if case == "download":
                    cmd = [sys.executable, "-c", f"from huggingface_hub import snapshot_download as s; s({REPO!r})"]
                    cwd = work
                else:
                    name, device = rows[case]
                    cmd = [sys.executable, "-m", "fp4convert", "quantize", REPO, str(out), "--device", device, "-q"]
                    cwd = Path(checkouts[name]).resolve()
                    env["PYTHONPATH"] = str(cwd)
                sent0 = sum(r.sent for r in hub.requests(server="cdn"))
                wall, rc, err = timed(cmd, env, cwd)
                sent = sum(r.sent for r in hub.requests(server="cdn")) - sent0
                runs.append({"case": case, "rep": rep, "wall_s": round(wall, 3), "rc": rc, "cdn_bytes": sent})
                print(f"rep {rep} {case:>10}: {wall:7.2f} s  rc={rc}  cdn {sent / 1e9:.3f} GB", flush=True)
                if rc != 0:
                    print(err, file=sys.stderr)
                    raise SystemExit(f"{case} failed")
        shutil.rmtree(work / "hf_home", ignore_errors=True)
        shutil.rmtree(work / "out", ignore_errors=True)
    med = {c: statistics.median(r["wall_s"] for r in runs if r["case"] == c) for c in cases}
    ratio = {c: round(med[c] / med["download"], 3) for c in rows}
    for c in cases:
        print(f"median {c:>10}: {med[c]:7.2f} s" + (f"  ({ratio[c]:.2f}x download)" if c in ratio else ""))
    record = {
        "benchmark": "hub_prefetch", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
        "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
        "settings": {"rate_MBps": args.rate, "hidden": args.hidden, "layers": args.layers, "shards": args.shards,
                     "model_bytes": total, "reps": args.reps, "device": args.device,
                     "command": "python -m fp4convert quantize REPO OUT --device DEVICE -q",
                     "download": "huggingface_hub.snapshot_download(REPO) (8 workers)", "commits": commits,
                     "server": "tests/hubserver.py FakeHub, one shared paced link, LFS via the CDN origin, no Xet"},
        "runs": runs, "median_s": med, "ratio_to_download": ratio,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
