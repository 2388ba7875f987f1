"""Every output format's bytes and config files, read back, without transformers.

The real consumers (transformers + compressed-tensors) are in tests/e2e/test_consumers.py; these tests pin
what each format module writes so that breaking e.g. ModelOpt's ``weight_scale_2`` or
compressed-tensors' ``group_size`` fails here even where those packages are not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import fp4convert
from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert
from fp4convert.errors import ConfigError
from fp4convert.formats import OUTPUT_FORMATS, all_formats, detect, get_format
from fp4convert.formats.base import OutputInfo
from fp4convert.storage.safetensors import DTYPES, TensorInfo

from tests import checkpoints as ck

SEED = 1234
CASES = [(f, s, r) for f in OUTPUT_FORMATS for s in ("nvfp4", "mxfp4") for r in (None, "had16")
         if f != "modelopt" or (s == "nvfp4" and r is None)]


def weight(m: int = 160, k: int = 96, seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 0.02).to(torch.bfloat16)


def written(fmt, module: str, q, scheme: str, rotate: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The bytes a format writes for one matrix, read as the tensors its entries promise (what a loader sees)."""
    entries = fmt.entries(module, tuple(q.shape), scheme, rotate)
    out = fmt.tensors(module, q)
    assert [n for n, _ in out] == [e.name for e in entries]
    assert [len(b) for _, b in out] == [e.nbytes for e in entries]
    return [(e.name, torch.frombuffer(bytearray(b), dtype=torch.uint8).view(DTYPES[e.dtype]).reshape(e.shape))
            for e, (_, b) in zip(entries, out)]


def test_registry_names_match_modules() -> None:
    assert [f.name for f in all_formats()] == list(OUTPUT_FORMATS)
    with pytest.raises(ConfigError, match="unknown format 'gguf'"):
        get_format("gguf")


@pytest.mark.parametrize("fmt_name,scheme,rotate", CASES)
def test_tensors_match_entries_and_read_back(fmt_name: str, scheme: str, rotate: str | None) -> None:
    """What a format writes is exactly what it promised from shapes alone, and reads back losslessly."""
    fmt = get_format(fmt_name)
    x = weight()
    q = fp4convert.quantize(x, scheme, rotate=rotate, scale_layout="swizzled" if fmt.swizzled else "linear",
                            backend="reference")
    entries = fmt.entries("layer", tuple(x.shape), scheme, rotate)
    tensors = written(fmt, "layer", q, scheme, rotate)
    infos = {n: TensorInfo(n, e.dtype, e.shape, "f", 0, e.nbytes) for (n, _), e in zip(tensors, entries)}
    data = dict(tensors)
    manifest = {"format": fmt_name, "scale_layout": "128x4" if fmt.swizzled else "linear"}
    modules, problems = fmt.find_modules(infos, manifest)
    assert not problems and list(modules) == ["layer"]
    back = fmt.load(modules["layer"], lambda info: data[info.name], rotate)
    assert torch.equal(back.packed, q.packed)
    assert torch.equal(back.linear_scale().view(torch.uint8), q.linear_scale().view(torch.uint8))
    if q.global_scale is not None:
        assert back.global_scale.item() == q.global_scale.item()
    assert torch.equal(fp4convert.dequantize(back, torch.float32), fp4convert.dequantize(q, torch.float32))


def test_global_scale_conventions() -> None:
    x = weight()
    q = fp4convert.quantize(x, "nvfp4", backend="reference")
    native = dict(written(get_format("fp4convert"), "m", fp4convert.quantize(x, scale_layout="swizzled"), "nvfp4"))
    ct = dict(written(get_format("compressed-tensors"), "m", q, "nvfp4"))
    mo = dict(written(get_format("modelopt"), "m", q, "nvfp4"))
    assert native["m.weight_global_scale"].shape == (1,) and native["m.weight_global_scale"].item() == q.global_scale.item()
    assert ct["m.weight_global_scale"].dtype == torch.float32 and ct["m.weight_global_scale"].shape == (1,)
    assert mo["m.weight_scale_2"].shape == () and mo["m.weight_scale_2"].item() == (1.0 / q.global_scale).item()
    assert torch.equal(mo["m.weight"], q.packed) and mo["m.weight_scale"].dtype == torch.float8_e4m3fn
    assert native["m.weight_scale"].shape == (256, 8)  # 160 rows -> 256, 6 blocks -> 8
    assert ct["m.weight_scale"].shape == (160, 6)
    assert torch.equal(ct["m.weight_scale"].view(torch.uint8), q.scale.view(torch.uint8))
    assert torch.equal(native["m.weight_scale"].view(torch.uint8),
                       fp4convert.swizzle_scales(q.scale).view(torch.uint8))


def test_had16_transform_is_the_sylvester_matrix_in_bf16() -> None:
    """compressed-tensors' online rotation tensor: written without torch, equal to torch's bf16 matrix."""
    from fp4convert.formats.compressed_tensors import sylvester_hadamard

    q = fp4convert.quantize(weight(), "nvfp4", rotate="had16", backend="reference")
    got = dict(written(get_format("compressed-tensors"), "m", q, "nvfp4", "had16"))["m.had16_input.weight"]
    assert torch.equal(got.view(torch.int16), sylvester_hadamard(16).to(torch.bfloat16).view(torch.int16))


def _info(scheme: str = "nvfp4", rotate: str | None = None) -> OutputInfo:
    return OutputInfo(scheme, rotate, None, ("lm_head", "model.embed_tokens"))


def test_compressed_tensors_config(tmp_path: Path) -> None:
    fmt = get_format("compressed-tensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert fmt.finalize(tmp_path, _info("nvfp4")) == ["config.json"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 64  # the rest is kept
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head", "model.embed_tokens"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert w == {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                 "dynamic": False}
    assert qc["config_groups"]["group_0"]["input_activations"] is None and "transform_config" not in qc
    assert fmt.detect(tmp_path, cfg) and fmt.rotation(tmp_path, cfg, None) is None

    fmt.finalize(tmp_path, _info("mxfp4", "had16"))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "group"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    t = qc["transform_config"]["config_groups"]["had16"]
    assert t["type"] == "hadamard" and t["head_dim"] == 16
    assert fmt.rotation(tmp_path, {"quantization_config": qc}, None) == "had16"


def test_modelopt_files(tmp_path: Path) -> None:
    fmt = get_format("modelopt")
    (tmp_path / "config.json").write_text("{}")
    assert sorted(fmt.finalize(tmp_path, _info())) == ["config.json", "hf_quant_config.json"]
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "fp4convert"
    assert hq["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                  "exclude_modules": ["lm_head", "model.embed_tokens"]}
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["ignore"] == qc["exclude_modules"] == hq["quantization"]["exclude_modules"]
    fmt.finalize(tmp_path, OutputInfo("nvfp4", None, None, ()))
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"] == ["lm_head"]
    assert fmt.detect(tmp_path, {})
    with pytest.raises(ConfigError, match="NVFP4 only"):
        fmt.check("mxfp4", None)
    with pytest.raises(ConfigError, match="cannot record a rotation"):
        fmt.check("nvfp4", "had16")


@pytest.mark.parametrize("fmt_name,scheme,rotate", CASES)
def test_converted_folder_is_detected_and_named(tmp_path: Path, fmt_name: str, scheme: str, rotate: str | None) -> None:
    src = tmp_path / "src"
    ck.llama(src, layers=1, single=True)
    dst = tmp_path / "out"
    convert(src, dst, ConvertConfig(scheme=scheme, rotate=rotate, format=fmt_name, device="cpu"))
    fmt = get_format(fmt_name)
    cfg = json.loads((dst / "config.json").read_text())
    manifest = json.loads((dst / "fp4convert.json").read_text())
    assert detect(dst, cfg, manifest) is fmt
    if fmt_name != "fp4convert":
        assert detect(dst, cfg, None) is fmt  # also without the manifest
    with safe_open(dst / "model.safetensors", "pt") as f:
        names = set(f.keys())
    module = "model.layers.0.self_attn.q_proj"
    for e in fmt.entries(module, (64, 64), scheme, rotate):
        assert e.name in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


@pytest.mark.parametrize("block", [["a", "b"], [[16], [16]], [None, None], [128], [128, 128, 1], [0, 128],
                                   [-16, 16], [True, 16], "128x128", 128, [128.5, 128]])
def test_fp8_weight_block_size_of_a_wrong_type_is_exit_4(tmp_path, block) -> None:
    """Issue 23 item 10: ["a","b"], [[16],[16]] and [null,null] were internal errors (exit 1)."""
    from click.testing import CliRunner

    from fp4convert.cli.main import main

    cfg = ck.llama_config(layers=1)
    t = ck.llama_tensors(cfg)
    w = t["model.layers.0.mlp.down_proj.weight"]
    t["model.layers.0.mlp.down_proj.weight"] = w.float().to(torch.float8_e4m3fn)
    t["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(1, 1)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": block}
    ck.write(tmp_path / "src", t, cfg)
    res = CliRunner().invoke(main, ["quantize", str(tmp_path / "src"), str(tmp_path / "q"), "--dry-run"])
    assert res.exit_code == 4, res.output
    assert "config.json: quantization_config.weight_block_size is" in res.output and "Traceback" not in res.output
    cfg["quantization_config"]["weight_block_size"] = [128, 128]  # the same checkpoint with a sound block plans
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    assert CliRunner().invoke(main, ["quantize", str(tmp_path / "src"), str(tmp_path / "q"), "--dry-run"]).exit_code == 0
