"""--resume refuses when the source's weights changed since the interrupted run, even at equal shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp4convert.convert as conv
from fp4convert.config import ConvertConfig
from fp4convert.convert import convert
from fp4convert.errors import OutputError

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny-llama"


def test_resume_refuses_modified_source(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for p in EXAMPLE.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    dst = tmp_path / "out"
    real = conv._quantize_unit
    calls = {"n": 0}

    def crash_late(*a, **k):
        calls["n"] += 1
        if calls["n"] > 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(conv, "_quantize_unit", crash_late)
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), dst, ConvertConfig(max_shard_size=200_000))
    monkeypatch.setattr(conv, "_quantize_unit", real)
    assert any(dst.glob("*.safetensors")) and not (dst / "fp4convert.json").exists()

    # Same shapes, new values: the header hash is unchanged, only the data (and mtime) differ.
    shard = src / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    tensors = {k: torch.flip(v, dims=[0]).contiguous() for k, v in tensors.items()}
    save_file(tensors, shard, metadata={"format": "pt"})
    os.utime(shard, ns=(1, 1))
    with pytest.raises(OutputError, match="modified since the interrupted run"):
        convert(str(src), dst, ConvertConfig(max_shard_size=200_000, resume=True))
