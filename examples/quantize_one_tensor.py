"""Quantize one weight of the shipped example checkpoint and report what came out."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

import fp4convert

CKPT = Path(__file__).parent / "tiny-llama"
NAME = "model.layers.0.mlp.up_proj.weight"

with safe_open(str(CKPT / "model-00001-of-00002.safetensors"), "pt") as f:
    w = f.get_tensor(NAME)
for fmt in ("nvfp4", "mxfp4"):
    q = fp4convert.quantize(w, fmt)
    w_hat = fp4convert.dequantize(q, torch.float32)
    rel = ((w_hat - w.float()).norm() / w.float().norm()).item()
    print(f"{NAME} {tuple(w.shape)} -> {fmt}: packed {tuple(q.packed.shape)}, scale {tuple(q.scale.shape)} "
          f"{q.scale.dtype}, relative error {rel:.4f}")
