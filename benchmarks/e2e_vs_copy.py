"""fp4convert beside `cp -r` + `sync` of the same checkpoint, one run, one table (issue 10's yardstick).

Creates two bf16 checkpoints (a dense Llama-3-8B-shaped one with ``--layers`` layers and a
many-expert MoE), warms the page cache, then for each runs ``--repeats`` times, side by side:
``cp -r SRC DST && sync``; with ``--floor`` the write-only floor (the first fp4convert output, in the
page cache, copied and synced: the output's bytes written and nothing else); fp4convert on one GPU; on
N GPUs (torchrun) when more are visible; on one GPU with ``--procs-per-gpu`` torchrun ranks; and
``--device cpu``. Rows are interleaved (every row once per round), the median of ``--repeats`` rounds
is reported; every fp4convert run is followed by ``sync`` too and byte-compared with the first GPU
run; fp4convert runs at its defaults unless ``--shard`` is given. Writes ``e2e_vs_copy.json`` and
``e2e_vs_copy.md`` into ``--out``.

    python benchmarks/e2e_vs_copy.py --work /tmp/e2e --out $OUT
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

ROOT = Path(__file__).resolve().parents[1]


def _save_shards(path: Path, named: list[tuple[str, tuple[int, ...]]], shards: int, config: dict, seed: int) -> None:
    """Generate and write tensors shard by shard (never the whole model in memory)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    total = sum(int(torch.Size(s).numel()) for _, s in named)
    per, cur, part, idx, weight_map = total / shards, 0, {}, 1, {}

    def flush() -> None:
        nonlocal part, idx
        fname = f"model-{idx:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
        part, idx = {}, idx + 1

    for name, shape in named:
        if "norm" in name:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        part[name] = t
        cur += t.numel()
        if cur >= per * idx and idx < shards:
            flush()
    if part:
        flush()
    n = idx - 1
    if n != shards:  # rename to the real count
        for i in range(1, n + 1):
            old = path / f"model-{i:05d}-of-{shards:05d}.safetensors"
            new = path / f"model-{i:05d}-of-{n:05d}.safetensors"
            old.rename(new)
        weight_map = {k: v.replace(f"-of-{shards:05d}", f"-of-{n:05d}") for k, v in weight_map.items()}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=2))


def dense(path: Path, layers: int) -> None:
    h, inter, vocab, kv = 4096, 14336, 128256, 1024
    named = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        named += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                  (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                  (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                  (p + "mlp.down_proj.weight", (h, inter))]
    named += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "vocab_size": vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    _save_shards(path, named, 4, cfg, 0)


def moe(path: Path, layers: int, experts: int) -> None:
    h, inter, vocab = 2048, 384, 32000
    named = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        named += [(p + "input_layernorm.weight", (h,))]
        named += [(p + f"self_attn.{x}_proj.weight", (h, h)) for x in "qkvo"]
        named += [(p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate.weight", (experts, h))]
        for e in range(experts):
            q = p + f"mlp.experts.{e}."
            named += [(q + "gate_proj.weight", (inter, h)), (q + "up_proj.weight", (inter, h)),
                      (q + "down_proj.weight", (h, inter))]
    named += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": h,
           "num_hidden_layers": layers, "num_experts": experts, "moe_intermediate_size": inter,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": vocab, "tie_word_embeddings": False}
    _save_shards(path, named, 4, cfg, 1)


def warm(path: Path) -> int:
    n = 0
    for p in path.glob("*"):
        with open(p, "rb") as f:
            while b := f.read(64 << 20):
                n += len(b)
    return n


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(path).as_posix().encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def timed(cmd: str, env: dict) -> tuple[float, str, dict]:
    """Wall time of ``cmd`` then ``sync``; its stdout (fp4convert's --json summary, with stages_s);
    and the split: the process's seconds and the following sync's."""
    t0 = time.perf_counter()
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env)
    t1 = time.perf_counter()
    subprocess.run(["sync"])
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"{cmd} failed:\n{r.stderr[-3000:]}")
    return wall, r.stdout, {"process_s": round(t1 - t0, 3), "sync_s": round(wall - (t1 - t0), 3)}


def summary(stdout: str) -> dict:
    """The --json summary's timing fields (the last JSON object printed; {} for other commands)."""
    try:
        s = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        return {}
    return {k: s[k] for k in ("wall_s", "read_wait_s", "stages_s", "counts", "process_s") if k in s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs-per-gpu", type=int, default=4, help="0 to skip the one-GPU torchrun row")
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--torch-row", action="store_true", help="also run the GPU row on the torch pipeline")
    ap.add_argument("--only", choices=["dense", "moe"], default=None)
    ap.add_argument("--lane-rows", default="", help="comma-separated --lanes values for extra 1-GPU rows (e.g. 1,4)")
    ap.add_argument("--shard", default=None,
                    help="--max-shard-size of every fp4convert row (default: the converter's own default, 5GB)")
    ap.add_argument("--floor", action="store_true",
                    help="a write-only floor row: the first fp4convert output (in the page cache) copied and synced")
    ap.add_argument("--cpu-cores", default="", help="taskset CPU list for the --device cpu row (default: all)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        gpus = 0
    py = sys.executable
    results = {"gpus": gpus, "cpus": os.cpu_count(), "cases": {}}
    cases = {"dense": lambda p: dense(p, args.layers), "moe": lambda p: moe(p, args.moe_layers, args.experts)}
    for case, make in cases.items():
        if args.only and case != args.only:
            continue
        src = args.work / case
        if not (src / "config.json").exists():
            t0 = time.perf_counter()
            make(src)
            print(f"{case}: created in {time.perf_counter() - t0:.1f} s", flush=True)
        size = warm(src)
        dst = args.work / "dst"
        ref_out = args.work / f"{case}-ref-out"  # the first fp4convert output: the floor row copies it
        sz = f" --max-shard-size {args.shard}" if args.shard else ""
        q = f"{py} -m fp4convert quantize {src} {dst} --json{sz}"
        tr = f"{py} -m torch.distributed.run --standalone"
        rows = [("cp -r + sync", f"cp -r {src} {dst}")]
        if args.floor:
            rows.append(("write-only floor: cp -r of the output (page cache) + sync", f"cp -r {ref_out} {dst}"))
        if gpus:
            rows.append(("fp4convert, 1 GPU", f"{q} --device cuda"))
            for n in filter(None, args.lane_rows.split(",")):  # the default row runs with --lanes 0 (auto)
                rows.append((f"fp4convert, 1 GPU, --lanes {n}", f"{q} --device cuda --lanes {n}"))
            if args.torch_row:  # the same run on the torch backend (same bytes; an A/B of the two CUDA backends)
                rows.append(("fp4convert, 1 GPU, --backend stacked", f"{q} --device cuda --backend stacked"))
            if gpus > 1:
                rows.append((f"fp4convert, {gpus} GPUs (torchrun)",
                             f"{tr} --nproc-per-node {gpus} -m fp4convert quantize {src} {dst} --json --device cuda{sz}"))
            if args.procs_per_gpu > 1:
                rows.append((f"fp4convert, 1 GPU x {args.procs_per_gpu} processes (torchrun)",
                             f"CUDA_VISIBLE_DEVICES=0 {tr} --nproc-per-node {args.procs_per_gpu} -m fp4convert quantize "
                             f"{src} {dst} --json --device cuda{sz}"))
        if not args.no_cpu:
            pin = f"taskset -c {args.cpu_cores} " if args.cpu_cores else ""
            cores = args.cpu_cores or f"{os.cpu_count()} cores"
            rows.append((f"fp4convert --device cpu ({cores})", f"{pin}{q} --device cpu"))
        if args.floor:  # the output the floor row copies (not timed)
            shutil.rmtree(ref_out, ignore_errors=True)
            first = next(c for label, c in rows if label.startswith("fp4convert"))
            timed(first.replace(str(dst), str(ref_out)), env)
            warm(ref_out)
        # Interleaved: every row once per round, so drift (page cache, thermals, other load) hits all alike.
        walls: dict[str, list[float]] = {label: [] for label, _ in rows}
        inside: dict[str, list[dict]] = {label: [] for label, _ in rows}
        digests: dict[str, str] = {}
        out_bytes: dict[str, int] = {}
        for _ in range(args.repeats):
            for label, cmd in rows:
                shutil.rmtree(dst, ignore_errors=True)
                subprocess.run(["sync"])
                w, out, split = timed(cmd, env)
                walls[label].append(w)
                inside[label].append({**summary(out), "outside": split})
                if label.startswith("fp4convert"):
                    digests[label] = digest(dst)
                out_bytes[label] = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
        shutil.rmtree(dst, ignore_errors=True)
        out_rows, ref_digest = [], None
        for label, cmd in rows:
            same = None
            if label in digests:
                ref_digest = ref_digest or digests[label]
                same = digests[label] == ref_digest
            row = {"what": label, "cmd": cmd, "median_s": statistics.median(walls[label]), "runs_s": walls[label],
                   "out_bytes": out_bytes[label], "same_bytes_as_first_fp4convert_run": same, "inside": inside[label]}
            out_rows.append(row)
            print(f"{case}: {label}: median {row['median_s']:.2f} s, runs {[round(x, 2) for x in walls[label]]}",
                  flush=True)
            for x in inside[label]:
                if "wall_s" in x:
                    print(f"    convert() {x['wall_s']} s; process {x.get('process_s')}; {x['outside']}; "
                          f"stages {x.get('stages_s')}; counts {x.get('counts')}", flush=True)
        cp = out_rows[0]["median_s"]
        for r in out_rows:
            r["vs_cp"] = r["median_s"] / cp
        results["cases"][case] = {"bytes_in": size, "rows": out_rows}
    (args.out / "e2e_vs_copy.json").write_text(json.dumps(results, indent=2))
    lines = [f"GPUs: {gpus}, CPU cores: {os.cpu_count()}; median of {args.repeats}, rows interleaved; warm page "
             f"cache; each command followed by `sync`; --max-shard-size {args.shard or 'default (5GB)'}", ""]
    for case, c in results["cases"].items():
        lines += [f"### {case}: {c['bytes_in'] / 1e9:.2f} GB in", "",
                  "| what | median s | runs s | x cp | out GB | bytes = first fp4convert row |", "|---|---|---|---|---|---|"]
        for r in c["rows"]:
            lines.append(f"| {r['what']} | {r['median_s']:.2f} | {', '.join(f'{x:.2f}' for x in r['runs_s'])} | "
                         f"{r['vs_cp']:.2f} | {r['out_bytes'] / 1e9:.2f} | {r['same_bytes_as_first_fp4convert_run']} |")
        lines.append("")
    (args.out / "e2e_vs_copy.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
