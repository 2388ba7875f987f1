"""Calibrating quantized sources directly (issue 42 item 2): FP8 block-scaled (DeepSeek/Qwen3-FP8 style), FP8 per
tensor and gpt-oss MXFP4 blocks are decoded exactly on the run's device as each block loads
(fp4convert/calibrate/weights.py), nothing written in bf16 first. The bytes of ``--method gptq`` and of W4A4
calibration equal those of the same run on an fp32 twin checkpoint holding the exactly decoded values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from fp4convert.cli.main import main
from tests import zoo
from tests.calibrate.test_calibrate import TEXT, add_tokenizer

FP8_MAX = 448.0


def fp8_per_tensor_variant(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``src`` with every linear weight of the blocks as FP8 E4M3 times one fp32 ``weight_scale`` (ModelOpt /
    compressed-tensors float-quantized style); returns the exact fp32 twin."""
    out, exact = {}, {}
    for name, t in zoo.read_tensors(src).items():
        if name.endswith(".weight") and t.dim() == 2 and ".layers." in name and "norm" not in name \
                and not name.endswith(("mlp.gate.weight", "router.weight")):
            scale = (t.float().abs().amax() / FP8_MAX).reshape(())
            q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale"] = q, scale.float()
            exact[name] = q.float() * scale.float()
        else:
            out[name] = exact[name] = t
    zoo._rewrite(src, dst, out, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    return exact


def _variants(tmp_path: Path, family: str, kind: str) -> tuple[Path, Path]:
    """(the quantized source, its fp32 twin), both with a tokenizer."""
    src = zoo.build(family, tmp_path / f"{family}-bf16")
    q = tmp_path / f"{family}-{kind}"
    if kind == "fp8-block":
        exact = zoo.fp8_block_variant(src, q, block=(32, 32))
    elif kind == "fp8-tensor":
        exact = fp8_per_tensor_variant(src, q)
    else:
        exact = zoo.mxfp4_variant(src, q)
    twin = zoo.write_like(q, tmp_path / f"{family}-{kind}-twin", {k: v.float() for k, v in exact.items()})
    return add_tokenizer(q), add_tokenizer(twin)


def _quantize(src: Path, dst: Path, text: Path, *extra, device: str = "cpu") -> dict[str, torch.Tensor]:
    r = CliRunner().invoke(main, ["quantize", str(src), str(dst), "--device", device, "--calibration-data", str(text),
                                  "--calibration-samples", "4", "--calibration-seq-len", "32", "-q", *extra],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out: dict[str, torch.Tensor] = {}
    for f in sorted(dst.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "calibration.txt"
    p.write_text(TEXT)
    return p


@pytest.mark.parametrize("family,kind", [("llama", "fp8-block"), ("qwen3_moe", "fp8-block"), ("llama", "fp8-tensor"),
                                         ("gpt_oss", "mxfp4")])
@pytest.mark.parametrize("extra", [("--method", "gptq"),
                                   ("--activations", "nvfp4", "--format", "compressed-tensors")], ids=["gptq", "w4a4"])
def test_a_quantized_source_calibrates_as_its_exact_fp32_twin(tmp_path, text, family, kind, extra):
    """Every quantized matrix's bytes (and W4A4's input scales) equal those of the run on the fp32 twin: the blocks
    ran on the exactly decoded weights. The kept tensors are the source's (FP8 norms and embeddings never are)."""
    src, twin = _variants(tmp_path, family, kind)
    got = _quantize(src, tmp_path / "from-source", text, *extra)
    want = _quantize(twin, tmp_path / "from-twin", text, *extra)
    quantized = [k for k in want if k.endswith(("weight_packed", "weight_scale", "weight_global_scale",
                                                "input_global_scale", "weight_scale_2", "input_scale"))]
    assert quantized and len(quantized) > 4
    for k in quantized:
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    manifest = json.loads((tmp_path / "from-source" / "fp4convert.json").read_text()) \
        if (tmp_path / "from-source" / "fp4convert.json").exists() else None
    if manifest is not None and extra[0] == "--method":
        assert manifest["method"]["rtn"] == []  # every matrix GPTQ's, none left to round-to-nearest


def test_the_decoded_block_is_on_the_run_device_and_never_written(tmp_path, monkeypatch):
    """The FP8 bytes are what is read; the decode happens when the block loads (no bf16/fp32 copy of the source
    appears on disk): the only files a GPTQ run on an FP8 source writes are the output's and the store's."""
    from fp4convert.calibrate import weights

    src, _ = _variants(tmp_path, "llama", "fp8-block")
    decoded: list[str] = []
    real = weights.BlockWeights._decoded

    def spy(self, name):
        t = real(self, name)
        assert t.dtype == torch.float32 and t.device == self.device
        decoded.append(name)
        return t

    monkeypatch.setattr(weights.BlockWeights, "_decoded", spy)
    before = {p for p in tmp_path.rglob("*") if p.is_file()}
    p = tmp_path / "t.txt"
    p.write_text(TEXT)
    _quantize(src, tmp_path / "out", p, "--method", "gptq")
    fp8 = [k for k, v in zoo.read_tensors(src).items() if v.dtype == torch.float8_e4m3fn]
    assert set(decoded) >= set(fp8)  # every FP8 weight decoded as its block loaded
    new = {p for p in tmp_path.rglob("*") if p.is_file()} - before
    assert all(p.is_relative_to(tmp_path / "out") for p in new if p.suffix == ".safetensors"), new


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_an_fp8_source_calibrates_on_the_gpu_as_its_twin(tmp_path, text, family):
    """On a GPU the FP8 codes cross to the device as they are and the CUDA decode kernel makes the fp32 weights: the
    GPTQ bytes equal the fp32 twin's on the same GPU (deterministic there, docs/numerics.md "GPTQ")."""
    src, twin = _variants(tmp_path, family, "fp8-block")
    got = _quantize(src, tmp_path / "from-source", text, "--method", "gptq", device="cuda")
    want = _quantize(twin, tmp_path / "from-twin", text, "--method", "gptq", device="cuda")
    keys = [k for k in want if k.endswith(("weight_packed", "weight_scale", "weight_global_scale"))]
    assert keys and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in keys)

