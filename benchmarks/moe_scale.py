"""GPTQ (and W4A4 calibration) on frontier-MoE shapes from FP8 sources: wall time, peak GPU and host memory, the
per-layer breakdown, and how many experts the router sent too few tokens (issue 42 item 7).

The checkpoints are synthetic but real in every way that costs: the model's own transformers config (Qwen3-30B-A3B:
48 layers, 128 experts of 768, top-8; DeepSeek-V3: 61 layers, 3 dense then MoE, 256 routed experts of 2048 and a
shared one, MLA), every linear weight FP8 E4M3 with 128 x 128 block scales as those releases ship them (random
normal weights, std 0.02), norms, routers and embeddings in bf16, per-expert 2-D names, a character tokenizer.
``--layers N`` keeps the first N layers (the config says N). The calibration tokens come from a text file (the
standard library's docstrings, repeated): ``--samples`` x ``--seq-len``.

Rows (``--rows``), each a fresh process, its ``--json`` kept:

- ``gptq``: ``fp4convert quantize SRC DST --method gptq --calibration-data FILE --format compressed-tensors`` (its
  defaults otherwise: NVFP4A16, true-sequential, act-order, the routed-expert policy);
- ``w4a4``: ``--activations nvfp4 --format compressed-tensors`` (W4A4 calibration, no GPTQ);
- ``llmc``: llm-compressor's ``oneshot`` with ``GPTQModifier(targets="Linear", scheme="NVFP4A16",
  ignore=["lm_head", "re:.*mlp.gate$"])``, its recipe defaults, on a bf16 copy of the same (FP8-decoded) weights
  and the same token windows (``--peer-python``: a python with llmcompressor).

    python benchmarks/moe_scale.py --shape qwen3-30b-a3b --layers 48 --samples 256 --seq-len 2048 --rows gptq \\
        --work /tmp/ms --json out.json
    python benchmarks/moe_scale.py --shape deepseek-v3 --layers 4 --samples 64 --seq-len 2048 --rows gptq w4a4
    python benchmarks/moe_scale.py --shape tiny --layers 2 --samples 4 --seq-len 64 --rows gptq   # a CPU check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shape_config(shape: str, layers: int) -> dict:
    """config.json of a model of ``shape`` cut to ``layers`` layers."""
    if shape in ("qwen3-30b-a3b", "tiny"):
        import transformers as tf

        big = shape == "qwen3-30b-a3b"
        cfg = tf.Qwen3MoeConfig(
            vocab_size=151936 if big else 256, hidden_size=2048 if big else 128, intermediate_size=6144 if big else 256,
            moe_intermediate_size=768 if big else 64, num_experts=128 if big else 16, num_experts_per_tok=8 if big else 4,
            num_attention_heads=32 if big else 4, num_key_value_heads=4 if big else 2, head_dim=128 if big else 32,
            num_hidden_layers=layers, norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False,
            rms_norm_eps=1e-6)
    elif shape in ("deepseek-v3", "tiny-deepseek"):
        import transformers as tf

        small = {} if shape == "deepseek-v3" else dict(
            vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_attention_heads=4, num_key_value_heads=4)
        cfg = tf.DeepseekV3Config(num_hidden_layers=layers, **small)
    else:
        raise SystemExit(f"unknown shape {shape}")
    out = cfg.to_dict()
    out["architectures"] = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    out["torch_dtype"] = "bfloat16"
    out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    return out


def checkpoint_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of the checkpoint as released: "fp8" (a linear weight stored FP8 with
    block scales), "bf16" or "f32". Per-expert 2-D names, as the releases have them (transformers merges them)."""
    import torch
    import transformers as tf

    config = getattr(tf, cfg["architectures"][0].replace("ForCausalLM", "Config"))(**{
        k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config", "torch_dtype")})
    with torch.device("meta"):
        model = getattr(tf, cfg["architectures"][0])(config)
    out = []
    for name, p in model.state_dict().items():  # (persistent buffers too: DeepSeek's e_score_correction_bias)
        shape = tuple(p.shape)
        if name.endswith("experts.gate_up_proj"):
            e, two_i, h = shape
            for k in range(e):
                for proj in ("gate_proj", "up_proj"):
                    out.append((f"{name[:-len('gate_up_proj')]}{k}.{proj}.weight", (two_i // 2, h), "fp8"))
        elif name.endswith("experts.down_proj"):
            e, h, i = shape
            out += [(f"{name[:-len('down_proj')]}{k}.down_proj.weight", (h, i), "fp8") for k in range(e)]
        elif len(shape) == 2 and name.endswith(".weight") and ".layers." in name and not name.endswith("mlp.gate.weight"):
            out.append((name, shape, "fp8"))
        elif name.endswith("e_score_correction_bias"):
            out.append((name, shape, "f32"))
        else:
            out.append((name, shape, "bf16"))
    return out


def make(shape: str, layers: int, dst: Path, device: str, shard_bytes: int = 4 << 30) -> Path:
    """The synthetic FP8 checkpoint (weights drawn on ``device``), in shards of about ``shard_bytes``."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT))
    from tests.calibrate.test_calibrate import add_tokenizer

    if (dst / "model.safetensors.index.json").exists():
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    cfg = shape_config(shape, layers)
    gen = torch.Generator(device).manual_seed(0)
    index: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size, n = 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(dst / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, shp, kind in checkpoint_tensors(cfg):
        if kind == "fp8":
            m, k = shp
            w = torch.randn(m, k, generator=gen, device=device) * 0.02
            gm, gk = math.ceil(m / 128), math.ceil(k / 128)
            pad = torch.zeros(gm * 128, gk * 128, device=device)
            pad[:m, :k] = w.abs()
            amax = pad.reshape(gm, 128, gk, 128).amax(dim=(1, 3))
            scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :k]
            shard[name] = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn).cpu()
            shard[name + "_scale_inv"] = scale.float().cpu()
            size += m * k + scale.numel() * 4
        elif kind == "f32":
            shard[name] = torch.zeros(shp)
            size += 4 * math.prod(shp)
        else:
            ones = name.endswith(("norm.weight", "layernorm.weight"))
            t = torch.ones(shp) if ones else torch.randn(*shp, generator=gen, device=device) * 0.02
            shard[name] = t.to(torch.bfloat16).cpu()
            size += 2 * math.prod(shp)
        if size >= shard_bytes:
            flush()
    flush()
    total = sum((dst / f).stat().st_size for f in set(index.values()))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}, indent=1))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    add_tokenizer(dst)
    return dst


def calibration_text(path: Path, tokens: int) -> Path:
    """A text of at least ``tokens`` characters (the character tokenizer's tokens): the standard library's
    module docstrings, repeated."""
    if path.exists() and path.stat().st_size >= tokens:
        return path
    import importlib

    parts = []
    for name in sorted(sys.stdlib_module_names - {"antigravity", "this"}):
        if name.startswith("_") or len(parts) >= 300:
            continue
        try:
            doc = importlib.import_module(name).__doc__
        except Exception:  # noqa: BLE001 (a module that does not import here has no text for us)
            continue
        if doc:
            parts.append(doc.encode("ascii", "ignore").decode())
    text = "\n\n".join(parts) + "\n\n"
    path.write_text(text * (tokens // len(text) + 2))
    return path


ROWS = {"gptq": ["--method", "gptq", "--format", "compressed-tensors"],
        "w4a4": ["--activations", "nvfp4", "--format", "compressed-tensors"]}


def run_ours(row: str, src: Path, dst: Path, text: Path, samples: int, seq_len: int, timeout: float) -> dict:
    """One fp4convert run (a fresh process): its --json, the wall time, the stderr's last progress line."""
    cmd = [sys.executable, "-m", "fp4convert", "quantize", str(src), str(dst), "--overwrite", "--json",
           "--calibration-data", str(text), "--calibration-samples", str(samples), "--calibration-seq-len", str(seq_len),
           *ROWS[row]]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                            "FP4CONVERT_PROGRESS_INTERVAL": "30"})
    wall = time.perf_counter() - t0
    out: dict = {"row": row, "command": " ".join(cmd[1:]), "rc": p.returncode, "wall_s": round(wall, 2)}
    if p.returncode:
        out["error"] = p.stderr[-3000:]
        return out
    got = json.loads(p.stdout)
    out.update({k: got.get(k) for k in ("wall_s", "peak_rss_bytes", "stages_s", "counts", "quantized")})
    out["process_wall_s"] = round(wall, 2)
    progress = [json.loads(x)["progress"] for x in p.stderr.splitlines() if x.startswith('{"progress"')]
    out["progress"] = progress[-3:]
    manifest = json.loads((dst / "fp4convert.json").read_text()) if (dst / "fp4convert.json").exists() else None
    if manifest and manifest.get("method", {}).get("experts"):
        ex = {k: v for k, v in manifest["method"]["experts"].items() if k != "policy"}
        out["experts"] = {"layers": len(ex), "experts": sum(len(v["routed_tokens"]) for v in ex.values()),
                          "all_tokens": sum(len(v["all_tokens"]) for v in ex.values()),
                          "min_routed": min((min(v["routed_tokens"]) for v in ex.values()), default=None)}
    return out


LLMC = """
import json, resource, sys, time, torch
t0 = time.time()
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
src, dst, tokens = sys.argv[1], sys.argv[2], torch.load(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", device_map="cuda")
ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
t1 = time.time()
oneshot(model=model, dataset=ds, recipe=GPTQModifier(targets="Linear", scheme="NVFP4A16",
        ignore=["lm_head", "re:.*mlp.gate$"]), num_calibration_samples=tokens.shape[0], max_seq_length=tokens.shape[1])
t2 = time.time()
print(json.dumps({"wall_s": time.time() - t0, "oneshot_s": t2 - t1, "peak_rss_bytes":
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "counts": {"gpu_peak_MB": torch.cuda.max_memory_allocated() / 1e6}}))
"""


def bf16_copy(src: Path, dst: Path) -> Path:
    """The same weights as bf16 (each FP8 weight decoded exactly, then rounded to bf16), config without FP8."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from fp4convert.numerics.reference import fp8_block_dequantize

    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out_index = {}
    for f in sorted(set(index.values())):
        tensors = {}
        with safe_open(str(src / f), "pt") as h:
            for k in h.keys():
                if k.endswith("_scale_inv"):
                    continue
                t = h.get_tensor(k)
                if t.dtype == torch.float8_e4m3fn:
                    t = fp8_block_dequantize(t.cuda(), h.get_tensor(k + "_scale_inv").cuda(), (128, 128)).to(torch.bfloat16).cpu()
                tensors[k] = t
        save_file(tensors, str(dst / f), metadata={"format": "pt"})
        out_index.update({k: f for k in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": out_index}))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for p in src.iterdir():
        if p.name.startswith("tokenizer") or p.name == "special_tokens_map.json":
            shutil.copy(p, dst / p.name)
    return dst


def run_peer(src: Path, dst: Path, text: Path, samples: int, seq_len: int, python: str, timeout: float) -> dict:
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from fp4convert.calibrate.samples import file_tokens

    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    tokens = dst.parent / "peer_tokens.pt"
    torch.save(file_tokens(tok, text, samples, seq_len), tokens)
    t0 = time.perf_counter()
    p = subprocess.run([python, "-c", LLMC, str(src), str(dst), str(tokens)], capture_output=True, text=True,
                       timeout=timeout)
    out = {"row": "llmc", "rc": p.returncode, "process_wall_s": round(time.perf_counter() - t0, 2)}
    if p.returncode:
        out["error"] = p.stderr[-3000:]
        return out
    out.update(json.loads(p.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "deepseek-v3", "tiny", "tiny-deepseek"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", nargs="+", default=["gptq"], choices=[*ROWS, "llmc"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/moe_scale"))
    ap.add_argument("--device", default="cuda", help="where the synthetic weights are drawn")
    ap.add_argument("--peer-python", default=sys.executable)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    t0 = time.perf_counter()
    src = make(a.shape, a.layers, a.work / f"{a.shape}-{a.layers}", a.device)
    made_s = time.perf_counter() - t0
    text = calibration_text(a.work / "calibration.txt", a.samples * a.seq_len)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    rows = []
    for row in a.rows:
        if row == "llmc":
            peer_src = bf16_copy(src, a.work / f"{a.shape}-{a.layers}-bf16")
            r = run_peer(peer_src, a.work / "out-llmc", text, a.samples, a.seq_len, a.peer_python, a.timeout)
        else:
            r = run_ours(row, src, a.work / f"out-{row}", text, a.samples, a.seq_len, a.timeout)
        r.update({"shape": a.shape, "layers": a.layers, "samples": a.samples, "seq_len": a.seq_len,
                  "source_bytes": size})
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("stages_s", "progress", "error")}), flush=True)
        if r.get("error"):
            print(r["error"], file=sys.stderr)
    result = {"made_s": round(made_s, 1), "source_bytes": size, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
