"""GPU time of an FP8 block-scaled input against the same checkpoint in bf16 (issue 9).

Builds, on the machine it runs on, a dense Llama-3-8B-shaped checkpoint of ``--layers`` layers in bf16
and its DeepSeek-style FP8 twin (E4M3 weights + fp32 ``weight_scale_inv`` per 128x128 block, config
``quantization_config`` quant_method fp8), then converts each with ``fp4convert quantize --device DEV``
in a fresh process, interleaved, median of ``--repeats``. Reports the process wall time and the
converter's own ``wall_s`` (from ``--json``), and checks that the FP8 route equals converting the
fp32-dequantized twin on a small slice (the full byte-identity is a test: tests/e2e/test_consumers.py).

    python benchmarks/fp8_input.py --work /tmp/fp8bench --layers 8 --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

H, INTER, HEADS, KV = 4096, 14336, 32, 8
SHAPES = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (KV * 128, H), "self_attn.v_proj": (KV * 128, H),
          "self_attn.o_proj": (H, H), "mlp.gate_proj": (INTER, H), "mlp.up_proj": (INTER, H),
          "mlp.down_proj": (H, INTER)}


def fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style FP8: per 128x128 block, scale_inv = amax / 448, weight = E4M3(w / scale_inv)."""
    m, n = w.shape
    bm, bn = -(-m // block), -(-n // block)
    pad = torch.zeros(bm * block, bn * block, device=w.device, dtype=torch.float32)
    pad[:m, :n] = w.float()
    blocks = pad.reshape(bm, block, bn, block)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / s[:, None, :, None]).reshape(bm * block, bn * block)[:m, :n].to(torch.float8_e4m3fn)
    return q.contiguous(), s.contiguous()


def build(work: Path, layers: int, device: str) -> tuple[Path, Path]:
    bf16, fp8 = work / "bf16", work / "fp8"
    for d in (bf16, fp8):
        d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
           "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV, "vocab_size": 128256}
    wm_b, wm_f = {}, {}
    for i in range(layers):
        tb, tf = {}, {}
        for name, shape in SHAPES.items():
            w = (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
            key = f"model.layers.{i}.{name}.weight"
            tb[key] = w.cpu()
            q, s = fp8_block(w)
            tf[key], tf[key + "_scale_inv"] = q.cpu(), s.cpu()
        for k in (f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"):
            tb[k] = tf[k] = torch.ones(H, dtype=torch.bfloat16)
        fname = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tb, str(bf16 / fname), metadata={"format": "pt"})
        save_file(tf, str(fp8 / fname), metadata={"format": "pt"})
        wm_b.update({k: fname for k in tb})
        wm_f.update({k: fname for k in tf})
    for d, wm, qc in ((bf16, wm_b, None), (fp8, wm_f, {"quant_method": "fp8", "fmt": "e4m3",
                                                      "activation_scheme": "dynamic", "weight_block_size": [128, 128]})):
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
        (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
    return bf16, fp8


def run(src: Path, dst: Path, device: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "fp4convert", "quantize", str(src), str(dst), "--device", device,
                          "--format", "compressed-tensors", "--overwrite", "--json"],
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    return wall, json.loads(out.stdout)["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8bench"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    bf16, fp8 = build(a.work, a.layers, a.device if a.device.startswith("cuda") else "cpu")
    size = {k: sum(p.stat().st_size for p in d.glob("*.safetensors")) for k, d in (("bf16", bf16), ("fp8", fp8))}
    runs: dict[str, list] = {"bf16": [], "fp8": []}
    for _ in range(a.repeats):
        for k, src in (("bf16", bf16), ("fp8", fp8)):
            runs[k].append(run(src, a.work / f"out-{k}", a.device))
    res = {k: {"bytes_in": size[k], "process_s": statistics.median(w for w, _ in v),
               "convert_s": statistics.median(c for _, c in v), "runs": v} for k, v in runs.items()}
    res["ratio_convert_fp8_over_bf16"] = res["fp8"]["convert_s"] / res["bf16"]["convert_s"]
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
